"""The trace command, the HTML page, and trace() on a user model."""

import json

import pytest
import torch

from tiny_models import LLAMA
from trainmem.inventory import Category
from trainmem.trace import trace


@pytest.fixture
def config_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    return str(path)


def _run(argv):
    """Parse with this command module alone (the main CLI registers it the same way)."""
    import argparse

    from trainmem.trace import cli

    parser = argparse.ArgumentParser(prog="trainmem")
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_trace_json_snapshot_and_html(config_path, tmp_path, capsys):
    snap, page = tmp_path / "s.pickle", tmp_path / "t.html"
    rc = _run(["trace", "--model", config_path, "--batch", "2", "--seq", "64", "--precision", "fp32",
               "--snapshot", str(snap), "--html", str(page), "--json", "--progress", "always"])
    out, err = capsys.readouterr()
    assert rc == 0
    d = json.loads(out)
    assert d["schema"] == "trainmem.trace/2"
    assert d["peak_bytes"] > 0 and d["peak_reserved_bytes"] >= d["peak_bytes"]
    assert "100%" in err  # progress bar on stderr
    assert snap.stat().st_size > 0
    text = page.read_text()
    assert "<svg" in text and "http" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_trace_text_output(config_path, capsys):
    assert _run(["trace", "--model", config_path, "--batch", "1", "--seq", "32", "--precision", "fp32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("trace: LlamaForCausalLM, batch 1, seq 32, fp32")
    assert "peak allocated" in out and "reserved (model)" in out


def test_unsupported_is_one_line_error(config_path):
    from trainmem.errors import UnsupportedError
    with pytest.raises(UnsupportedError) as info:
        _run(["trace", "--model", config_path, "--attention", "mem-efficient", "--seq", "16"])
    assert "mem-efficient" in str(info.value) and "\n" not in str(info.value)


class TwoLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(256, 1024)  # weight 1024*256*4 = 1 MiB
        self.down = torch.nn.Linear(1024, 256)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_trace_any_model_exact_bytes():
    model = TwoLayer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    x = torch.randn(128, 256)  # 128 * 256 * 4 = 131072
    with trace(model, opt, inputs=[x]) as t:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    r = t.result
    items = r.items.by_name()
    # up's output is freed by relu, which saves its own: 128 * 1024 * 4 = 524288
    assert items["relu"] == 524288 and "up.addmm" not in items
    assert r.items.total(Category.PARAMETER) == 2102272  # 2 * 1024 * 256 * 4 + 1024 * 4 + 256 * 4
    assert items["up.weight.grad"] == 1048576  # 1024 * 256 * 4
    assert r.items.total(Category.INPUT) == 131072
    # peak when up's bias grad is made: params and grads (2 * 2102272), relu's input gradient
    # (524288), the input (131072), the loss and its seed gradient (2 * 512) = 4860928
    assert r.peak_bytes == 4860928
    assert r.totals_at_peak_bytes["gradient"] == 2102272
    assert r.peak_phase == "backward"
    assert r.peak_module == "up"
    assert {m.name for m in r.modules} >= {"up", "down"}

"""compare runs CPU kernels on both sides: --device cuda is refused in one line, --device cpu is
what it does without the flag."""

from __future__ import annotations

import json

import pytest

from trainmem.cli import main


def test_compare_refuses_cuda_in_one_line(capsys):
    assert main(["compare", "--model", "gpt2", "--seq", "64", "--device", "cuda"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == "" and "\n" not in err
    assert err.startswith("SpecError: device='cuda': compare traces CPU kernels") and "estimate --device cuda" in err


@pytest.mark.slow  # 8-13 s: in the slow set so the default run stays under 10 minutes
def test_compare_default_is_cpu_and_says_so(capsys):
    base = ["compare", "--model", "gpt2", "--batch", "1", "--seq", "64", "--json"]
    assert main(base) == 0
    default = json.loads(capsys.readouterr().out)
    assert main([*base, "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out) == default
    assert main(base[:-1]) == 0
    assert any("CPU kernels" in line for line in capsys.readouterr().out.splitlines()[:2])


def test_compare_states_both_reserved_peaks_without_a_gpu(capsys, tmp_path):
    """--memory-figure reserved needed --gpu in compare, though estimate and trace each model the
    reserved peak without one (the allocation order, the recorded allocations): both are stated,
    each equal to its own command's figure."""
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                   max_position_embeddings=256)))
    base = ["--model", str(cfg), "--seq", "32", "--precision", "bf16", "--memory-figure", "reserved", "--json"]
    assert main(["compare", *base]) == 0
    both = json.loads(capsys.readouterr().out)
    assert main(["estimate", *base, "--device", "cpu"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert both["estimate"]["memory_figure"] == alone["memory_figure"]
    assert both["estimate"]["memory_figure"]["peak_reserved_bytes"] > 0
    assert both["trace"]["memory_figure"]["figure"] == "reserved"
    assert both["trace"]["memory_figure"]["peak_reserved_bytes"] > 0

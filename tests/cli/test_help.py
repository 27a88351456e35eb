"""Reports a person reads (issue 15, item 9): every option has help, --help fits 120 columns, no
internal words, snapshot prints sizes, and every file written is named on stderr."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from trainmem.cli import build_parser, main

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=1000, max_position_embeddings=256)
INTERNAL = re.compile(r"\bbrief\b|\bladder\b|\brung\b", re.IGNORECASE)


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {"": parser, **sub.choices}


@pytest.fixture
def columns_120(monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # argparse wraps to the terminal width


@pytest.mark.parametrize("command", list(_commands()))
def test_every_option_has_help_and_help_fits_120_columns(command, columns_120):
    parser = _commands()[command]
    for action in parser._actions:
        if action.option_strings:
            assert action.help and action.help != argparse.SUPPRESS, (command, action.option_strings)
    text = parser.format_help()
    assert [line for line in text.splitlines() if len(line) > 120] == []
    assert not INTERNAL.search(text), INTERNAL.search(text)


def test_subcommand_summaries_say_no_internal_words():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for choice in sub._choices_actions:
        assert choice.help and not INTERNAL.search(choice.help), choice.dest


def test_advise_text_has_no_internal_words(capsys):
    assert main(["advise", "--model", "gpt2", "--seq", "1024", "--batch", "32", "--gpu", "l4",
                 "--max-estimates", "8"]) == 0
    out = capsys.readouterr().out
    assert "usual fixes" in out and not INTERNAL.search(out)


@pytest.fixture(scope="module")
def snapshot_file(tmp_path_factory):
    from trainmem.specs import ImplSpec, StepSpec
    from trainmem.trace import trace_step
    from trainmem.trace.snapshot import write_snapshot

    result = trace_step(TINY, StepSpec(batch=2, seq=64, precision="fp32"), ImplSpec())
    return write_snapshot(result, tmp_path_factory.mktemp("snap") / "s.pickle")


def test_snapshot_prints_sizes_and_keeps_the_json(snapshot_file, capsys):
    assert main(["snapshot", str(snapshot_file), "--top", "3", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert set(d) == {"schema", "trainmem_version", "inputs", "num_segments", "reserved_bytes", "allocated_bytes",
                      "peak_bytes", "num_events", "top_allocations"}
    assert d["schema"] == "trainmem.snapshot/2" and d["inputs"]["file"] == str(snapshot_file)
    assert main(["snapshot", str(snapshot_file), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "{" not in out and "[" not in out and "_bytes" not in out  # no dict or list reprs, no raw keys
    lines = out.splitlines()
    reserved = f"{d['reserved_bytes'] / 2**20:.2f} MiB"
    assert lines[1] == f"reserved         {reserved} in {d['num_segments']} segment(s)"
    top = d["top_allocations"][0]
    assert any(line.split() and line.strip().endswith(top["where"]) for line in lines[-3:])
    assert len([line for line in lines if line.startswith("    ") or line.startswith("  ")]) == 3


def _wrote(err: str) -> list[str]:
    return [line.removeprefix("wrote ") for line in err.splitlines() if line.startswith("wrote ")]


def test_estimate_and_sweep_html_say_where_they_wrote(tmp_path, capsys):
    page = tmp_path / "e.html"
    assert main(["estimate", "--model", "gpt2", "--seq", "128", "--html", str(page), "--json"]) == 0
    out, err = capsys.readouterr()
    json.loads(out)  # stdout stays JSON
    assert _wrote(err) == [str(page)] and page.stat().st_size > 0
    page = tmp_path / "s.html"
    assert main(["sweep", "--model", "gpt2", "--over", "batch", "--budget", "4GiB", "--max", "4",
                 "--html", str(page)]) == 0
    assert _wrote(capsys.readouterr().err) == [str(page)]


def test_trace_names_each_file_it_wrote(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    snap, page = tmp_path / "t.pickle", tmp_path / "t.html"
    assert main(["trace", "--model", str(cfg), "--seq", "32", "--snapshot", str(snap), "--html", str(page)]) == 0
    assert _wrote(capsys.readouterr().err) == [str(snap), str(page)]

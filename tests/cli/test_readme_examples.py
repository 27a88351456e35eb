"""README.md's Examples block and its two ``$ trainmem ...`` samples, run as a new user would.

Each example line runs through ``trainmem.cli.main`` as written (``[--opt]`` brackets: once without,
once with each); lines whose ``--model`` is a placeholder (``path/to/...``) or a Hugging Face cache
name (``ORG/NAME``) need a file this checkout does not have and are listed, not run. Each sample's
printed lines (``...`` elided) must appear in the output, whitespace-collapsed: the terminal wraps
them, the README does not.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from trainmem.cli import main

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
#: examples a test run cannot reach: placeholders and the local Hugging Face cache
NEEDS_A_FILE = ("path/to/", "Qwen/Qwen3-30B-A3B")
#: examples over ~3 s on two cores (a 7B fake trace, a compare's trace, the planner's searches)
SLOW = ("trainmem trace --model llama-2-7b", "trainmem compare", "--gpus 1024", "--search", "--count")


def _examples() -> list[str]:
    block = README.split("## Examples", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = []
    for raw in block.strip().splitlines():
        line = raw.split("  #")[0].strip()
        optional = re.findall(r"\[(--[^\]]+)\]", line)
        base = re.sub(r"\s*\[--[^\]]+\]", "", line)
        lines += [base] + [f"{base} {o}" for o in optional]
    return lines


def _runnable(line: str):
    return pytest.param(line, marks=pytest.mark.slow) if any(s in line for s in SLOW) else line


EXAMPLES = _examples()


def _run(capsys, line: str, tmp_path=None) -> str:
    argv = shlex.split(line)
    assert argv[0] == "trainmem"
    argv = argv[1:]
    if ">" in argv:  # `--json > estimate.json`: the JSON on stdout
        argv = argv[:argv.index(">")]
    if tmp_path is not None:  # output files (--snapshot, --html) into the test's folder
        argv = [str(tmp_path / a) if a.endswith((".pickle", ".html")) else a for a in argv]
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out


def test_the_examples_block_is_read():
    assert len(EXAMPLES) >= 25
    assert sum(any(n in e for n in NEEDS_A_FILE) for e in EXAMPLES) == 4


@pytest.mark.parametrize("line", [_runnable(e) for e in EXAMPLES if not any(n in e for n in NEEDS_A_FILE)])
def test_each_example_runs(capsys, tmp_path, line):
    out = _run(capsys, line, tmp_path)
    if "--json" in line:
        assert json.loads(out)["schema"].startswith("trainmem.")
    else:
        assert out.strip()


def _samples() -> list[tuple[str, list[str]]]:
    samples = []
    for block in re.findall(r"```\n(\$ trainmem .*?)```", README, re.S):
        command, *shown = block.strip().splitlines()
        samples.append((command[2:], [s for s in shown if s.strip() != "..."]))
    return samples


def _collapsed(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("command, shown", [
    pytest.param(c, s, marks=pytest.mark.slow) if "plan" in c else (c, s) for c, s in _samples()])
def test_each_sample_prints_what_the_readme_shows(capsys, command, shown):
    assert shown
    out = _collapsed(_run(capsys, command))
    for line in shown:
        assert _collapsed(line) in out, line


def test_every_command_but_presets_and_serve_takes_json():
    """The README: "Every command but `presets` and `serve` takes `--json`" (it said every command)."""
    import argparse

    from trainmem.cli import build_parser

    assert "Every command but `presets` and `serve` takes `--json`" in README
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    with_json = {name for name, p in sub.choices.items() if any("--json" in a.option_strings for a in p._actions)}
    assert set(sub.choices) - with_json == {"presets", "serve"}

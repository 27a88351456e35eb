"""Every command's text output fits 120 columns, at defaults and with --gpu/--gpus (issue 15, item 9).

Run through ``trainmem.cli.main`` as a user runs them; the width is counted in characters, not
bytes (``—``, ``−``, ``×`` are one column each). --json is one line by design and is not checked.
"""

import pytest

from trainmem.cli import main
from trainmem.report.wrap import WIDTH, wrap_line

PRESETS = ("llama-3-8b", "gpt2", "mixtral-8x7b")
FAST = (
    ["estimate"], ["estimate", "--summary"], ["estimate", "--tree"], ["estimate", "--detail"],
    ["estimate", "--gpu", "H100-80GB"], ["estimate", "--mode", "inference", "--gpu", "H100-80GB"],
    ["sweep", "--over", "seq", "--gpu", "H100-80GB"],
)
SLOW = (  # a few seconds each: the advisor's search, the planner, explain's re-estimates
    ["advise", "--gpu", "H100-80GB"], ["advise", "--gpu", "H100-80GB", "--gpus", "8"],
    ["plan", "--gpu", "H100-80GB", "--gpus", "8"], ["explain"],
)


def _widest(capsys, argv) -> tuple[int, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = out.splitlines()
    assert lines, f"{argv} printed nothing"
    widest = max(lines, key=len)
    return len(widest), widest


@pytest.mark.parametrize("model", PRESETS)
@pytest.mark.parametrize("argv", FAST, ids=" ".join)
def test_estimate_and_sweep_fit_120_columns(capsys, argv, model):
    width, line = _widest(capsys, [*argv, "--model", model])
    assert width <= WIDTH, line


@pytest.mark.slow
@pytest.mark.parametrize("model", PRESETS)
@pytest.mark.parametrize("argv", SLOW, ids=" ".join)
def test_advise_plan_explain_fit_120_columns(capsys, argv, model):
    width, line = _widest(capsys, [*argv, "--model", model])
    assert width <= WIDTH, line


@pytest.mark.parametrize("argv", [
    ["presets"],
    pytest.param(["trace", "--model", "gpt2", "--seq", "64", "--gpu", "H100-80GB"], marks=pytest.mark.slow),
    pytest.param(["compare", "--model", "gpt2", "--seq", "64", "--gpu", "H100-80GB"], marks=pytest.mark.slow),
], ids=lambda a: a[0])
def test_trace_compare_presets_fit_120_columns(capsys, argv):
    pytest.importorskip("torch") if argv[0] != "presets" else None
    width, line = _widest(capsys, argv)
    assert width <= WIDTH, line


def test_wrap_keeps_indent_words_and_shell_continuations():
    prose = "  usable = " + " − ".join(["79.65 GiB capacity"] * 8)
    wrapped = wrap_line(prose).split("\n")
    assert all(len(x) <= WIDTH for x in wrapped) and wrapped[1].startswith("    79.65")
    assert " ".join(x.strip() for x in wrapped) == prose.strip()  # no word lost or split
    cmd = "   trainmem estimate " + " ".join(f"--flag{i} value" for i in range(20))
    lines = wrap_line(cmd).split("\n")
    assert all(x.endswith(" \\") for x in lines[:-1]) and all(len(x) <= WIDTH for x in lines)
    assert wrap_line("short") == "short"
    title = "trainmem plan — llama-3-8b, seq 2048, " + "words " * 30  # a report's title is prose
    assert " \\" not in wrap_line(title) and wrap_line(title).split("\n")[1].startswith("  w")

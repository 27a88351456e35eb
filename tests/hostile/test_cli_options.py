"""Every option of every command with wrong types, zero, negatives and huge values (issue 8).

The options are read from the parser itself, so a new option is tried without editing this file.
A value either runs (exit 0) or fails in one line with exit 2: never a traceback, an internal
error (exit 1) or a hang. Values that can never be right must fail.
"""

from __future__ import annotations

import argparse

import pytest

from hostile_helpers import assert_one_line_error
from trainmem.cli import build_parser

#: arguments that make a successful run of each command cheap (the tiny model comes first)
BASE = {
    "estimate": ["--seq", "64"],
    "compare": ["--seq", "32"],
    "trace": ["--seq", "32"],
    "profile": ["--seq", "32", "--run-on", "cpu", "--steps", "1", "--warmup", "0", "--no-modules"],
    "sweep": ["--over", "seq", "--budget", "64MiB", "--max", "256"],
    "plan": ["--seq", "64", "--gpus", "8", "--global-batch", "16", "--gpu", "h100-80gb"],
    "advise": ["--seq", "64", "--gpu", "h100-80gb"],
    "explain": ["--seq", "64", "--gpu", "h100-80gb"],
}
NEVER_INT = ["abc", "", "1.5", "nan", "0x10", "1e3"]
EDGE_INT = ["0", "-1", "1000000000000", "9" * 40]
NEVER_FLOAT = ["abc", "", "1e400", "nan", "inf", "-inf"]
EDGE_FLOAT = ["-1", "0", "1e12"]
STRINGS = ["", "bogus", "/nonexistent/x", "-1", "1000000000000", "\u202e\x7f"]
#: option types that parse lists of names, not numbers
STRING_TYPES = {"freeze", "lora-targets"}
#: commands whose successful runs are slow (real or fake steps): only values that must fail
SLOW = {"profile", "sweep", "trace", "compare"}
#: flags whose value is an output path: tried in test_outputs_are_never_half_written
OUTPUTS = {"--html", "--plot", "--snapshot", "--out"}


def _float_like(action) -> bool:
    return getattr(action.type, "__name__", "") in ("float", "lora-alpha", "lora-dropout", "parse", "gpu-tflops") \
        or action.dest in ("mfu", "reserve_fraction")


def _cases():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for cmd, parser in sub.choices.items():
        for action in parser._actions:
            if not action.option_strings or action.dest == "help" or action.nargs == 0:
                continue
            flag = action.option_strings[-1]
            if flag in OUTPUTS:
                continue
            if action.choices:
                never, edge = ["bogus", ""], []
            elif _float_like(action):
                never, edge = NEVER_FLOAT, EDGE_FLOAT
            elif action.type is not None and getattr(action.type, "__name__", "") not in STRING_TYPES:
                never, edge = NEVER_INT, EDGE_INT
            else:
                never, edge = [], STRINGS
            if cmd in SLOW and not (action.choices or action.type is not None and edge is EDGE_INT):
                edge = [v for v in edge if v in ("", "bogus", "/nonexistent/x")]
            for v in never:
                yield pytest.param(cmd, flag, v, True, id=f"{cmd} {flag}={v[:12]!r}")
            for v in edge:
                if cmd in SLOW and v in ("1000000000000", "9" * 40) and flag in ("--seq", "--batch"):
                    continue  # refused or run in test_huge_values
                yield pytest.param(cmd, flag, v, False, id=f"{cmd} {flag}={v[:12]!r}")


@pytest.mark.parametrize("cmd, flag, value, must_fail", list(_cases()))
def test_option_value_fails_in_one_line_or_runs(cli, tiny, cmd, flag, value, must_fail):
    model = [] if flag == "--model" else ["--model", tiny]
    r = cli([cmd, *model, *BASE.get(cmd, []), f"{flag}={value}"])
    if must_fail or r.rc != 0:
        assert_one_line_error(r)


@pytest.mark.parametrize("argv", [
    ["estimate", "--model", "llama-3-8b", "--seq", "1000000000000", "--batch", "2"],
    ["estimate", "--model", "gpt2", "--seq", "1000000000000"],   # learned positions
    ["estimate", "--batch", "1000000000000", "--seq", "4096"],
    ["estimate", "--grad-accum", "1000000000000"],
    ["estimate", "--dp", "1000000000000"],
    ["estimate", "--tp", "3"],                                    # does not divide 32 heads
    ["estimate", "--pp", "64"],                                   # more stages than layers
    ["estimate", "--pp", "2", "--layer-split", "1,1"],            # does not sum to 32
    ["estimate", "--pp", "2", "--layer-split", "-1,33"],
    ["estimate", "--pp", "2", "--layer-split", "a,b"],
    ["estimate", "--cp", "3", "--seq", "4096"],
    ["estimate", "--ep", "3", "--model", "mixtral-8x7b"],
    ["estimate", "--sp"],                                         # needs --tp
    ["estimate", "--virtual-stages", "2"],                        # needs interleaved
    ["estimate", "--offload", "gpu"],
    ["estimate", "--lora-rank", "8"],                             # without --finetune lora
    ["estimate", "--finetune", "lora", "--lora-rank", "1000000000000"],
    ["estimate", "--finetune", "lora", "--lora-dropout", "1.5"],
    ["estimate", "--finetune-preset", "no-such-recipe"],
    ["estimate", "--recompute-every", "2"],                       # needs every-k
    ["estimate", "--model", "no-such-preset"],
    ["estimate", "--model", "lama-3-8b"],
    ["estimate", "--model", "https://huggingface.co/gpt2"],
    ["estimate", "--model", "meta-llama/Llama-2-7b-hf"],          # a hub id: never downloaded
    ["estimate", "--model", "/dev/null"],
    ["estimate", "--model", "/"],
    ["plan", "--gpus", "8", "--global-batch", "1000000000000", "--gpu", "h100-80gb"],
    ["plan", "--gpus", "8", "--global-batch", "16", "--gpu", "h100"],
    ["plan", "--gpus", "8", "--global-batch", "16", "--gpu", "custom"],
    ["sweep", "--over", "seq", "--budget", "-1GiB"],
    ["sweep", "--over", "seq", "--budget", "9" * 400],
    ["sweep", "--over", "seq", "--budget", "80XB"],
    ["profile", "--seq", "32", "--run-on", "cpu", "--layers", "1000000000000"],
    ["profile", "--seq", "32", "--run-on", "cpu", "--steps", "1000000000000"],
    ["profile", "--seq", "32", "--run-on", "cpu", "--warmup", "1000000000000"],
    ["profile", "--seq", "32", "--run-on", "cpu", "--seed", "9" * 40],
    ["profile", "--seq", "32", "--run-on", "cpu", "--variants", "attention=bogus"],
    ["profile", "--seq", "32", "--run-on", "cpu", "--variants", ";;"],
    ["trace", "--model", "gpt2", "--seq", "1000000000000"],
    ["trace", "--seq", "32", "--recompute-every", "2"],
    ["estimate", "--tree", "-1"],
    ["estimate", "--tree", "4"],
    ["bogus-command"],
    ["estimate", "--no-such-flag"],
])
def test_bad_combinations_fail_in_one_line(cli, argv):
    assert_one_line_error(cli(argv))


@pytest.mark.parametrize("argv", [
    ["estimate", "--model", "llama-3-8b", "--seq", "1000000000000"],  # RoPE: allowed, must not hang
    ["estimate", "--model", "llama-3.1-405b", "--seq", "1000000", "--batch", "1000"],
    ["estimate", "--mode", "inference", "--context", "1000000000000"],
    ["plan", "--gpus", "1000000000000", "--global-batch", "16", "--gpu", "h100-80gb"],
    ["sweep", "--over", "seq", "--budget", "1000TiB", "--model", "gpt2"],
])
def test_huge_but_valid_values_finish(cli, argv):
    r = cli(argv, timeout=60)
    assert r.rc in (0, 2), r.err
    if r.rc == 2:
        assert_one_line_error(r)


def test_outputs_are_never_half_written(cli, tiny, tmp_path):
    """A failure after parsing leaves none of the named outputs behind."""
    cases = [
        ["estimate", "--model", tiny, "--tp", "3", "--html", tmp_path / "e.html", "--plot", tmp_path / "e.png"],
        ["compare", "--model", tiny, "--seq", "32", "--recompute-every", "2", "--html", tmp_path / "c.html",
         "--plot", tmp_path / "c.svg"],
        ["trace", "--model", tiny, "--seq", "32", "--recompute-every", "2", "--snapshot", tmp_path / "t.pickle",
         "--html", tmp_path / "t.html"],
        ["profile", "--model", tiny, "--seq", "32", "--run-on", "cpu", "--warmup", "-1", "--out", tmp_path / "p.json",
         "--snapshot", tmp_path / "p.pickle"],
        ["sweep", "--model", tiny, "--over", "seq", "--budget", "-5", "--out", tmp_path / "s.json"],
        ["estimate", "--model", tiny, "--plot", tmp_path / "e.bmp"],
    ]
    for argv in cases:
        assert_one_line_error(cli(argv))
    leftovers = [p for p in tmp_path.rglob("*")]
    assert leftovers == [], leftovers


@pytest.mark.parametrize("argv, why", [
    (["estimate", "--fsdp", "hybrid", "--fsdp-group", "3", "--dp", "8"], "a shard group of 3 does not divide dp=8"),
    (["sweep", "--over", "seq", "--budget", "80GiB", "--start", "512", "--max", "64"],
     "--start past --max is ignored: the sweep starts at 8"),
    (["plan", "--gpus", "8", "--global-batch", "16", "--gpu", "h100-80gb", "--gpu-tflops", "inf"],
     "an infinite compute rate gives zero step times"),
])
def test_findings_fail_in_one_line(cli, argv, why):  # issue 8 findings, fixed since
    assert_one_line_error(cli(argv))

"""Every size a command is given is echoed with how it was read (GB decimal, G/GiB binary), and the
rule is in each size flag's --help."""

from __future__ import annotations

import json

import pytest

from trainmem.cli import build_parser, main
from trainmem.units import SIZE_RULE


def test_sweep_budget_in_gb_is_decimal(capsys):
    assert main(["sweep", "--model", "gpt2", "--over", "batch", "--budget", "8GB", "--max", "4"]) == 0
    # 8 · 10^9 = 8,000,000,000 bytes; / 2^30 = 7.4506 GiB
    assert capsys.readouterr().out.splitlines()[0] == "budget: 8GB = 8,000,000,000 bytes = 7.45 GiB"


def test_estimate_gpu_memory_in_g_is_binary(capsys):
    assert main(["estimate", "--model", "gpt2", "--seq", "128", "--gpu", "custom", "--gpu-memory", "80G"]) == 0
    # 80 · 2^30 = 85,899,345,920 bytes
    assert "gpu memory: 80G = 85,899,345,920 bytes = 80.00 GiB" in capsys.readouterr().out.splitlines()


def test_advise_reports_memory_and_reserve_and_json_is_unchanged(capsys):
    args = ["advise", "--model", "gpt2", "--seq", "256", "--gpu", "h100-80gb", "--gpu-memory", "80GB",
            "--reserve", "512MiB", "--max-estimates", "4"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["gpu memory: 80GB = 80,000,000,000 bytes = 74.51 GiB",
                         "reserve: 512MiB = 536,870,912 bytes = 0.50 GiB"]  # 512 · 2^20
    assert main([*args, "--json"]) == 0
    json.loads(capsys.readouterr().out)  # text lines stay out of the JSON


def test_reserve_zero_reads_as_zero(capsys):
    assert main(["advise", "--model", "gpt2", "--seq", "256", "--gpu", "h100-80gb", "--reserve", "0",
                 "--max-estimates", "4"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "reserve: 0 bytes"


def _size_actions():
    parser = build_parser()
    for name, sub in parser._subparsers._group_actions[0].choices.items():
        for a in sub._actions:
            if a.metavar == "SIZE" and not any(o.endswith("-bw") for o in a.option_strings):
                yield name, a


@pytest.mark.parametrize("command,action", list(_size_actions()), ids=lambda x: getattr(x, "dest", x))
def test_every_size_flag_states_the_rule(command, action):
    assert SIZE_RULE in action.help, (command, action.option_strings)

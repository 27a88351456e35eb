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

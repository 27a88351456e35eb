"""plan / advise / explain from the command line: JSON contracts, one-line errors, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainmem.cli import main


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainmem.cli", *args], capture_output=True, text=True, timeout=120)


def test_plan_json(capsys):
    assert main(["plan", "--model", "gpt2", "--seq", "512", "--global-batch", "16", "--gpu", "l4", "--gpus", "2",
                 "--json", "--rejected", "--top", "3"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == "trainmem.plan/2"
    assert 1 <= len(data["candidates"]) <= 3 and data["pareto"]
    for c in data["candidates"]:
        assert set(c) >= {"config", "peak_bytes", "step_time_s", "tokens_per_s", "fits"} and c["fits"]
        assert c["peak_bytes"] <= data["reserve"]["usable_bytes"]
    assert all("reason" in r for r in data["rejected"])


def test_plan_text(capsys):
    assert main(["plan", "--model", "gpt2", "--seq", "512", "--global-batch", "8", "--gpu", "rtx-4090",
                 "--gpus", "1", "--attention", "flash"]) == 0
    out = capsys.readouterr().out
    assert "Fastest configurations that fit" in out and "Pareto" in out


def test_advise_and_explain_json(capsys):
    assert main(["advise", "--model", "gpt2", "--batch", "8", "--seq", "1024", "--attention", "eager",
                 "--gpu", "custom", "--gpu-memory", "4GiB", "--gpu-tflops", "100", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == "trainmem.advise/2" and data["fits"] is True
    assert all(set(s) >= {"action", "saved_bytes", "peak_bytes_after", "throughput_cost"} for s in data["steps"])
    assert main(["explain", "--model", "gpt2", "--seq", "256", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == "trainmem.explain/2" and len(data["answers"]) == 8


@pytest.mark.parametrize("args, needle", [
    (["plan", "--model", "gpt2", "--global-batch", "8", "--gpu", "h100", "--gpus", "8"], "did you mean h100-80gb"),
    (["plan", "--model", "gpt2", "--global-batch", "8", "--gpu", "h100-80gb", "--gpus", "12"], "multiple of 8"),
    (["plan", "--model", "gpt2", "--global-batch", "0", "--gpu", "h100-80gb", "--gpus", "8"], "must be positive"),
    (["plan", "--model", "gpt2", "--global-batch", "8", "--gpu", "h100-80gb", "--gpus", "8", "--mfu", "3"], "mfu"),
    (["advise", "--model", "gpt2", "--gpu", "custom", "--gpu-memory", "24GiB"], "--gpu-tflops"),
    (["advise", "--model", "gpt2", "--gpu", "custom", "--gpu-memory", "24 parsecs", "--gpu-tflops", "1"], "gpu_memory"),
    (["explain", "--model", "no-such-model"], "no-such-model"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle):
    r = run(*args)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert needle in lines[-1]
    assert len([l for l in lines if not l.startswith("usage:")]) == 1

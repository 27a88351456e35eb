"""Under torchrun each rank measures and rank 0 prints the per-rank table (gloo on CPU)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from measure_tiny import LLAMA

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # a 2-rank torchrun, ~25 s
ROOT = Path(__file__).resolve().parents[2]


def test_torchrun_two_ranks_rank0_reports_both(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not found")
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(LLAMA))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run([torchrun, "--nproc-per-node", "2", "-m", "trainmem.cli", "profile", "--model", str(cfg),
                        "--seq", "32", "--precision", "fp32", "--run-on", "cpu", "--steps", "1", "--no-modules",
                        "--json"], capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1  # rank 0 only
    d = json.loads(lines[0])
    assert [rank["rank"] for rank in d["ranks"]] == [0, 1]
    assert d["peak_bytes"] == max(rank["peak_bytes"] for rank in d["ranks"])
    assert d["tokens_per_s"] == pytest.approx(sum(rank["tokens_per_s"] for rank in d["ranks"]))
    # activations per tensor, gathered from both ranks: the same keys, named without DDP's "module."
    keys = [[i["key"] for i in rank["items"]] for rank in d["ranks"]]
    assert keys[0] == keys[1] and "model.layers.0.mlp.act_fn:22528B:0" in keys[0]  # B·S·F·4

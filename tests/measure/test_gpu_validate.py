"""bench/gpu_validate.py works before a GPU shows up: its --cpu dry run on tiny sizes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_validate_cpu_dry_run(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_validate.py"), "--cpu", "--limit", "3",
                        "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_validate_cpu.json", "gpu_validate_cpu.md"]
    d = json.loads((tmp_path / "gpu_validate_cpu.json").read_text())
    assert len(d["rows"]) == 3 and all(row["status"] == "ok" for row in d["rows"])
    for row in d["rows"]:
        assert row["reserved_bytes"] is None  # reserved n/a on CPU
        assert abs(row["estimate_error_pct"]) < 2.0 and abs(row["trace_error_pct"]) < 2.0
    assert "| reference | eager | none | bf16 | 64 |" in (tmp_path / "gpu_validate_cpu.md").read_text()

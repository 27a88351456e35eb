"""bench/gpu_validate.py works before a GPU shows up: its --cpu dry run on tiny sizes."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # 8-13 s: in the slow set so the default run stays under 10 minutes
def test_gpu_validate_cpu_dry_run(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gpu_validate", ROOT / "bench" / "gpu_validate.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # in process: torch is imported once for the whole folder
    # the reference model's rows (issue 13's rows: tests/bench/test_gpu_validate.py)
    only = "ref-eager-s64,ref-eager-s128,ref-eager-full"
    assert bench.main(["--cpu", "--only", only, "--out-dir", str(tmp_path)]) == 0
    assert "| ref-eager-s64 |" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_validate_cpu.json", "gpu_validate_cpu.md"]
    d = json.loads((tmp_path / "gpu_validate_cpu.json").read_text())
    assert len(d["rows"]) == 3 and all(row["status"] == "ok" for row in d["rows"])
    for row in d["rows"]:
        assert row["reserved_bytes"] is None  # reserved n/a on CPU
        assert abs(row["estimate_error_pct"]) < 2.0 and abs(row["trace_error_pct"]) < 2.0
    assert "| ref-eager-s64 | reference eager bf16 S64 |" in (tmp_path / "gpu_validate_cpu.md").read_text()

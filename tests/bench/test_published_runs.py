"""bench/published: every case is well formed, and run.py runs cases end to end."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run_module():
    spec = importlib.util.spec_from_file_location("published_run", ROOT / "bench" / "published" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up here
    spec.loader.exec_module(mod)
    return mod


run = _run_module()


def test_cases_are_valid_and_enough():
    cases = run.load_cases()
    assert len(cases) >= 30
    for c in cases:
        assert c["source"]["quote"].strip()
        if "/" in c["model_arg"]:
            assert (ROOT / c["model_arg"]).is_file(), c["id"]


def test_a_bad_case_names_its_id_and_field(tmp_path):
    doc = json.loads(run.CASES.read_text())
    doc["cases"][0]["figure"]["bytes"] += 1
    bad = tmp_path / "cases.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=doc["cases"][0]["id"] + ": figure.bytes"):
        run.load_cases(bad)


def test_two_cases_run_and_one_refusal_is_an_outcome():
    cases = {c["id"]: c for c in run.load_cases()}
    ok = run.run_case(cases["litgpt-rt-stablelm3b-lora-mb1"])
    assert ok.status == "ok" and ok.predicted_bytes > 0
    assert ok.ratio == ok.predicted_bytes / 9_690_000_000  # 9.69 GB, decimal, as lit-gpt prints it
    case = cases["torchtitan-llama3.1-405b-3d-interleaved-1f1b"]
    i = case["args"].index("--layer-split")  # without torchtitan's uneven split 126 layers do not divide
    refused = run.run_case({**case, "args": case["args"][:i] + case["args"][i + 2:]})
    assert refused.status == "refused" and refused.predicted_bytes is None
    assert "virtual_stages=2" in refused.reason


def test_summary_arithmetic():
    class O:  # the two attributes summarize reads
        def __init__(self, r):
            self.ratio, self.status = r, "ok"

    s = run.summarize([O(0.95), O(1.05), O(1.2), O(0.5)])
    # sorted 0.5, 0.95, 1.05, 1.2 -> median (0.95 + 1.05) / 2 = 1.0; worst |0.5 - 1| = 0.5
    assert s["median_ratio"] == pytest.approx(1.0) and s["worst_ratio"] == 0.5
    assert s["within_10pct"] == 0.5 and s["within_25pct"] == 0.75
    assert (s["under"], s["over"]) == (2, 2)


def test_only_prints_without_writing(capsys):
    assert run.main(["--only", "litgpt-rt-stablelm3b-lora-mb1"]) == 0
    assert "litgpt-rt-stablelm3b-lora-mb1" in capsys.readouterr().out
    assert run.main(["--only", "no-such-case"]) == 2


def test_a_reserved_kind_case_reads_the_reserved_figure():
    """Schema /2 (docs/schema.md): a figure other than allocated is memory_figure.peak_<figure>_bytes."""
    assert run.predicted_bytes({"peak_bytes": 5}) == 5
    assert run.predicted_bytes({"peak_bytes": 5, "memory_figure": {"figure": "allocated", "peak_bytes": 5}}) == 5
    assert run.predicted_bytes({"peak_bytes": 5, "memory_figure": {"figure": "reserved",
                                                                   "peak_reserved_bytes": 7}}) == 7
    case = {c["id"]: c for c in run.load_cases()}["torchtitan-llama3.1-8b-fsdp8-fsdp"]
    assert case["figure"]["compare"] == "reserved" and "--memory-figure" in case["args"]
    out = run.run_case(case)
    allocated = run.run_case({**case, "args": [a for a in case["args"] if a not in ("--memory-figure", "reserved")]})
    assert out.status == "ok" and out.predicted_bytes > allocated.predicted_bytes  # the allocator's reserve on top


def test_engine_is_validated(tmp_path):
    doc = json.loads(run.CASES.read_text())
    doc["cases"][0]["engine"] = "guess"
    bad = tmp_path / "cases.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=doc["cases"][0]["id"] + ": engine="):
        run.load_cases(bad)


@pytest.mark.slow
def test_a_trace_engine_case_runs_trainmem_trace():
    """phi has no estimator rules: the case runs `trainmem trace` (fake tensors, ~20 s CPU)."""
    case = {c["id"]: c for c in run.load_cases()}["litgpt-rt-phi1.5-lora-mb1"]
    assert case["engine"] == "trace"
    out = run.run_case(case)
    assert out.status == "ok" and out.predicted_bytes > 0

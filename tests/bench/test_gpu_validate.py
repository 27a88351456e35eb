"""bench/gpu_validate.py: the plan's ids, bad input, robustness (a missing library, a failing step, an
interruption, the time budget) and, slow, the CPU dry run of issue 13's rows with estimate == trace where the
project claims it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_validate  # noqa: E402
import gpu_validate_plan  # noqa: E402
import gpu_validate_run  # noqa: E402

ISSUE_13 = ("compile-block", "compile-block-full", "op-eager", "op-compile-block", "optim-foreach", "optim-fused",
            "optim-for-loop", "optim-in-backward", "compile-model", "compile-model-full", "float8-compile-block-full")


def _rows(out: Path, stem: str = "gpu_validate_cpu") -> list[dict]:
    return json.loads((out / f"{stem}.json").read_text())["rows"]


def test_issue_13_rows_come_first_with_stable_ids_on_both_devices():
    for cpu in (False, True):
        ids = [r.id for r in gpu_validate_plan.plan(cpu)]
        assert tuple(ids[:len(ISSUE_13)]) == ISSUE_13
        assert len(set(ids)) == len(ids)
    gpu = {r.id: r for r in gpu_validate_plan.plan(False)}
    # the GPU sizes of the brief: S 4096, the optimizer rows at S 1024 (there the step is the peak), flash
    assert {gpu[i].seq for i in ISSUE_13 if not i.startswith("optim-")} == {4096}
    assert {gpu[i].seq for i in ISSUE_13 if i.startswith("optim-")} == {1024}
    assert {gpu[i].attention for i in ISSUE_13} == {"flash"}
    assert gpu["float8-compile-block-full"].needs == ("torchao",)


def test_a_claim_takes_its_phase_s_tolerance():
    optim = next(r for r in gpu_validate_plan.plan(True) if r.id == "optim-foreach").cpu_claim
    # optimizer phase: to the byte (the estimate counts the caller's ids there); elsewhere within 0.5%
    assert optim.holds(estimate_bytes=2286912, estimate_phase="optimizer", trace_bytes=2286912)
    assert not optim.holds(estimate_bytes=2286784, estimate_phase="optimizer", trace_bytes=2286912)
    assert optim.holds(estimate_bytes=1831624 - 9000, estimate_phase="backward_end", trace_bytes=1831624)
    block = next(r for r in gpu_validate_plan.plan(True) if r.id == "compile-block").cpu_claim
    assert not block.holds(estimate_bytes=100, estimate_phase="backward_start", trace_bytes=101)


@pytest.mark.parametrize("argv,message", [
    (["--cpu", "--only", "compile-block,nosuch"], "only='compile-block,nosuch': unknown row id nosuch"),
    (["--cpu", "--only", ","], "only=',': unknown row id (none given)"),
    (["--cpu", "--budget-s", "0"], "budget_s=0.0: must be a positive number of seconds"),
    (["--cpu", "--limit", "0"], "limit=0: must be at least 1"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, tmp_path):
    assert gpu_validate.main([*argv, "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpu_validate: {message}") and err.count("\n") == 1
    assert not list(tmp_path.iterdir())


def test_a_missing_library_is_a_row_that_says_so(monkeypatch):
    real = gpu_validate_run.importlib.util.find_spec
    monkeypatch.setattr(gpu_validate_run.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchao" else real(name, *a))
    run = next(r for r in gpu_validate_plan.plan(True) if r.id == "float8-compile-block-full")
    row = gpu_validate_run.run_one(run, gpu_validate.model_config(True), "cpu")
    assert row["status"] == "not run: torchao not installed"
    assert row["id"] == "float8-compile-block-full" and row["compile_scope"] == "block"


def test_a_failing_step_is_a_row_with_its_error(monkeypatch):
    def fail(*args):
        raise RuntimeError("no kernel for this\nsecond line")
    monkeypatch.setattr(gpu_validate_run, "_measure", fail)
    run = next(r for r in gpu_validate_plan.plan(True) if r.id == "ref-eager-s64")
    row = gpu_validate_run.run_one(run, gpu_validate.model_config(True), "cpu")
    assert row["status"] == "measure failed: RuntimeError: no kernel for this"
    assert row["estimate_bytes"] == row["trace_logical_bytes"] > 0  # the stages before it still stand


def test_an_interrupted_run_keeps_its_rows_and_marks_the_rest(monkeypatch, tmp_path):
    calls = []

    def fake(run, config, device):
        calls.append(run.id)
        if len(calls) == 2:
            raise KeyboardInterrupt("signal 15")
        return {"id": run.id, **run.settings(), "status": "ok"}

    monkeypatch.setattr(gpu_validate_run, "run_one", fake)
    assert gpu_validate.main(["--cpu", "--out-dir", str(tmp_path), "--only", ",".join(ISSUE_13[:4])]) == 130
    rows = _rows(tmp_path)
    assert [r["status"] for r in rows] == ["ok", "interrupted (signal 15)", "not run (interrupted)",
                                           "not run (interrupted)"]
    assert [r["id"] for r in rows] == list(ISSUE_13[:4])
    assert "INTERRUPTED" in (tmp_path / "gpu_validate_cpu.md").read_text()


def test_only_reruns_rows_in_place_of_the_earlier_run_s(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_validate_run, "run_one", lambda run, *a: {"id": run.id, **run.settings(), "status": "new"})
    assert gpu_validate.main(["--cpu", "--out-dir", str(tmp_path), "--only", ",".join(ISSUE_13[:3])]) == 0
    assert gpu_validate.main(["--cpu", "--out-dir", str(tmp_path), "--only", f"{ISSUE_13[1]},hf-eager-s64"]) == 0
    assert [r["id"] for r in _rows(tmp_path)] == [*ISSUE_13[:3], "hf-eager-s64"]  # plan order
    # a row the rerun did not start leaves the earlier one standing
    monkeypatch.setattr(gpu_validate_run, "run_one", lambda *a: pytest.fail("no row may start"))
    assert gpu_validate.main(["--cpu", "--out-dir", str(tmp_path), "--only", ISSUE_13[0], "--budget-s", "1e-9"]) == 0
    assert [r["status"] for r in _rows(tmp_path)] == ["new"] * 4


def test_a_spent_budget_lists_every_row_as_skipped(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_validate_run, "run_one", lambda *a: pytest.fail("no row may start"))
    assert gpu_validate.main(["--cpu", "--out-dir", str(tmp_path), "--budget-s", "1e-9"]) == 0
    rows = _rows(tmp_path)
    assert [r["id"] for r in rows] == [r.id for r in gpu_validate_plan.plan(True)]
    assert {r["status"] for r in rows} == {"skipped (time budget)"}


@pytest.mark.slow
def test_the_cpu_dry_run_of_issue_13_rows(tmp_path):
    # issue 13's rows and one row of each older kind (the eager ladder, bitsandbytes, eager Float8)
    only = [*ISSUE_13, "ref-eager-s64", "optim-adamw8bit", "float8-tensorwise-bf16"]
    assert gpu_validate.main(["--cpu", "--out-dir", str(tmp_path), "--only", ",".join(only)]) == 0
    rows = {r["id"]: r for r in _rows(tmp_path)}
    assert list(rows) == only
    plan = {r.id: r for r in gpu_validate_plan.plan(True)}
    for rid, r in rows.items():
        assert r["status"] == "ok", (rid, r["status"], r.get("notes"))
        assert r["allocated_bytes"] > 0 and r["reserved_bytes"] is None  # CPU: the live set, no allocator
        if plan[rid].cpu_claim is not None:  # the project's claim of estimate against trace (Claim.holds)
            assert r["cpu_claim"] == {"source": plan[rid].cpu_claim.source, "holds": True}, (rid, r)
        if plan[rid].compile_scope is not None:  # the measured compiled step says which backend it ran
            assert r["compile_backend"] == gpu_validate_run.CPU_BACKEND
            assert any("trainmem_partition" in n for n in r["notes"])
    assert all(plan[i].cpu_claim is not None for i in ISSUE_13)
    text = (tmp_path / "gpu_validate_cpu.md").read_text()
    assert "| compile-block | hf sdpa bf16 S128, compile block, fused |" in text

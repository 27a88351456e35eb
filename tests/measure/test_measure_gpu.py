"""CUDA paths: allocator statistics, memory history snapshot, allocator cap in the device sweep.
Skipped without a CUDA device (tests/measure/conftest.py)."""

import pickle

import pytest

from trainmem.specs import ImplSpec, StepSpec

from measure_tiny import LLAMA

pytestmark = pytest.mark.gpu


def test_cuda_profile_statistics_and_snapshot(tmp_path):
    from trainmem.measure import profile_model

    snap = tmp_path / "snap.pickle"
    r = profile_model(LLAMA, StepSpec(batch=2, seq=128, precision="bf16"), ImplSpec(attention="sdpa"),
                      device="cuda", steps=2, snapshot=str(snap))
    rank = r.ranks[0]
    assert r.device.startswith("cuda:")
    assert r.peak_reserved_bytes >= r.peak_bytes >= rank.baseline_bytes > 0
    assert rank.peak_active_bytes >= r.peak_bytes
    assert rank.num_ooms == 0 and rank.num_alloc_retries == 0
    assert rank.context_bytes > 0  # the CUDA context lives outside the caching allocator
    assert rank.modules and max(m.backward_peak_bytes for m in rank.modules) > 0
    with open(snap, "rb") as f:
        data = pickle.load(f)
    assert "segments" in data and "device_traces" in data


def test_cuda_device_sweep_catches_oom():
    import torch

    from trainmem.measure import sweep

    budget = 256 * 2**20
    r = sweep(LLAMA, StepSpec(batch=8, precision="bf16"), ImplSpec(attention="eager"), over="seq",
              budget_bytes=budget, backend="device", start=128, stop=1 << 14, multiple=128, device="cuda")
    assert r.max_fit is not None and r.max_fit < 1 << 14
    assert all(p.reserved_bytes is None or p.reserved_bytes <= budget for p in r.points if p.fits)
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # the cap was lifted afterwards
    del x


def test_cuda_compare_within_tolerance():
    from trainmem.measure.compare import compare_run

    table, _ = compare_run(LLAMA, StepSpec(batch=2, seq=256, precision="bf16"), ImplSpec(attention="eager"),
                           device="cuda", steps=2, modules=False)
    assert abs(table.row("parameter").estimate_error_pct) < 1.0
    assert abs(table.row("peak_allocated").estimate_error_pct) < 25.0  # CUDA kernels, workspaces: see docs

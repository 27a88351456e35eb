"""The planner: what it picks fits, the front is non-dominated, rejections say why."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainmem.estimate import estimate
from trainmem.plan.hardware import Reserve, load_gpu
from trainmem.plan.ranks import per_rank_peak
from trainmem.plan.search import SearchSpace, plan
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import load_model


@pytest.fixture(scope="module")
def small_plan():
    # llama-3-8b on 16 L4s: too big for one (24 GB), so sharding, TP or recompute is needed
    return plan(load_model("llama-3-8b"), seq=2048, global_batch=32, gpu=load_gpu("l4"), gpus=16,
                precision="mixed-bf16", keep_rejected=True)


def _specs(cfg, seq, precision="mixed-bf16"):
    step = StepSpec(batch=cfg["micro_batch"], seq=seq, grad_accum=cfg["grad_accum"], precision=precision)
    impl = ImplSpec(attention=cfg["attention"], recompute=cfg["recompute"])
    par = ParallelSpec(dp=cfg["dp"], tp=cfg["tp"], sp=cfg["sp"], cp=cfg["cp"], pp=cfg["pp"],
                       microbatches=cfg["grad_accum"], zero=cfg["zero"], offload=tuple(cfg["offload"]))
    return step, impl, par


def test_chosen_configurations_fit_and_are_sorted(small_plan):
    p = small_plan
    assert p.candidates and all(c.fits for c in p.candidates)
    times = [c.step_time_s for c in p.candidates]
    assert times == sorted(times)
    model = load_model("llama-3-8b")
    for c in p.candidates:
        cfg = c.config
        assert cfg["dp"] * cfg["tp"] * cfg["cp"] * cfg["pp"] == 16
        assert cfg["dp"] * cfg["micro_batch"] * cfg["grad_accum"] == 32
        step, impl, par = _specs(cfg, 2048)
        # the reported peak is the per-rank peak of that configuration, and it fits
        assert per_rank_peak(model, step, impl, par) == c.peak_bytes <= p.usable_bytes
        assert c.tokens_per_s == pytest.approx(32 * 2048 / c.step_time_s)


def test_pareto_front_is_not_dominated(small_plan):
    front = small_plan.pareto
    assert front
    for a in front:
        for b in front:
            assert not (b.peak_bytes < a.peak_bytes and b.step_time_s < a.step_time_s)
    peaks = [c.peak_bytes for c in front]
    assert peaks == sorted(peaks)
    assert [c.step_time_s for c in front] == sorted((c.step_time_s for c in front), reverse=True)


def test_rejected_configurations_say_why(small_plan):
    reasons = [r for _, r in small_plan.rejected]
    assert any(r.startswith("peak ") and "> usable" in r for r in reasons)
    assert any("needs a fused attention kernel" in r for r in reasons)
    assert any("tp=16 spans nodes" in r for r in reasons)  # 8 L4s per node
    data = small_plan.to_dict(rejected=True)
    assert data["schema"] == "trainmem.plan/2" and len(data["rejected"]) == len(reasons)
    for c in data["candidates"] + data["pareto"]:
        assert set(c) >= {"config", "peak_bytes", "step_time_s", "tokens_per_s", "fits"}


def test_nothing_fits_shows_the_closest():
    p = plan(load_model("llama-2-70b"), seq=4096, global_batch=8, gpu=load_gpu("rtx-4090"), gpus=1,
             space=SearchSpace(attention=("flash",), recompute=("full",)))
    assert p.candidates and not any(c.fits for c in p.candidates) and not p.pareto


def test_single_gpu_plan_matches_the_estimator():
    model = load_model("gpt2")
    p = plan(model, seq=512, global_batch=4, gpu=load_gpu("rtx-4090"), gpus=1, precision="bf16")
    best = p.candidates[0]
    step, impl, _ = _specs(best.config, 512, "bf16")
    assert best.peak_bytes == estimate(model, step, impl).peak_bytes


def test_reserve_changes_what_fits():
    model = load_model("gpt2")
    gpu = load_gpu("custom", memory_bytes=6 << 30, bf16_flops=1e14)
    loose = plan(model, seq=1024, global_batch=16, gpu=gpu, gpus=1, reserve=Reserve(fixed_bytes=0, fraction=0.0))
    tight = plan(model, seq=1024, global_batch=16, gpu=gpu, gpus=1, reserve=Reserve(fixed_bytes=3 << 30))
    assert loose.stats["fitting"] > tight.stats["fitting"]
    assert all(c.peak_bytes <= tight.usable_bytes for c in tight.candidates)

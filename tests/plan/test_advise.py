"""The advisor's ladder, checked against the estimator's own numbers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainmem.estimate import estimate
from trainmem.plan.advise import RUNGS, advise
from trainmem.plan.hardware import Reserve, load_gpu
from trainmem.plan.ranks import per_rank_peak
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import load_model

GPT2 = load_model("gpt2")


def _gpu(gib: int):
    return load_gpu("custom", memory_bytes=gib << 30, bf16_flops=1e14)


def _replay(model, step, impl, cfg):
    s = replace(step, batch=cfg["micro_batch"], grad_accum=cfg["grad_accum"], seq=cfg["seq"])
    i = replace(impl, attention=cfg["attention"], recompute=cfg["recompute"])
    p = ParallelSpec(dp=cfg["dp"], tp=cfg["tp"], sp=cfg["sp"], zero=cfg["zero"], offload=tuple(cfg["offload"]))
    return per_rank_peak(model, s, i, p)


def test_ladder_numbers_are_the_estimators():
    step, impl = StepSpec(batch=8, seq=1024), ImplSpec(attention="eager")
    a = advise(GPT2, step, impl, _gpu(4))
    assert a.start_peak_bytes == estimate(GPT2, step, impl).peak_bytes
    assert a.fits and a.steps
    before = a.start_peak_bytes
    for s in a.steps:
        assert s.peak_bytes_after == _replay(GPT2, step, impl, s.config)
        assert s.saved_bytes == before - s.peak_bytes_after > 0
        before = s.peak_bytes_after
    # rungs in the brief's order, stopping at the first that fits
    order = [RUNGS.index(s.rung) for s in a.steps]
    assert order == sorted(order)
    assert a.steps[-1].peak_bytes_after <= a.usable_bytes
    assert all(s.peak_bytes_after > a.usable_bytes for s in a.steps[:-1])
    assert a.steps[0].rung == "attention" and a.steps[0].config["attention"] == "flash"


def test_never_recommends_what_is_already_on():
    step, impl = StepSpec(batch=1, seq=1024), ImplSpec(attention="flash", recompute="full")
    a = advise(GPT2, step, impl, _gpu(1), reserve=Reserve(fixed_bytes=0, fraction=0.0))
    rungs = {s.rung for s in a.steps}
    assert not rungs & {"attention", "micro_batch", "selective_recompute", "full_recompute"}
    why = dict(a.skipped)
    assert "already flash" in why["attention"]
    assert "already 1" in why["micro_batch"]
    assert "already full" in why["full_recompute"]
    assert "--gpus" in why["tensor_parallel"]


def test_micro_batch_rung_keeps_the_global_batch():
    step, impl = StepSpec(batch=8, seq=1024, grad_accum=2), ImplSpec(attention="flash")
    a = advise(GPT2, step, impl, _gpu(3))
    mb = next(s for s in a.steps if s.rung == "micro_batch")
    assert mb.config["micro_batch"] * mb.config["grad_accum"] == 16
    assert mb.throughput_cost >= 0


@pytest.mark.slow  # ~3 s on CI's two cores (5.7 s on the loaded shared machine)
def test_tensor_parallel_rung_with_more_gpus():
    model = load_model("llama-3-8b")
    step, impl = StepSpec(batch=1, seq=8192, precision="mixed-bf16"), ImplSpec(recompute="full")
    a = advise(model, step, impl, load_gpu("a100-80gb"), gpus=8)
    rungs = [s.rung for s in a.steps]
    assert "tensor_parallel" in rungs or "zero" in rungs
    for s in a.steps:
        assert s.peak_bytes_after == _replay(model, step, impl, s.config)
        assert s.config["dp"] * s.config["tp"] == 8
        assert s.config["micro_batch"] * s.config["grad_accum"] * s.config["dp"] == 8


def test_already_fits_recommends_nothing():
    a = advise(GPT2, StepSpec(batch=1, seq=128), ImplSpec(), load_gpu("h100-80gb"))
    assert a.fits and not a.steps
    data = a.to_dict()
    assert data["schema"] == "trainmem.advise/2" and data["steps"] == [] and data["fits"] is True

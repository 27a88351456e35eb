"""The closed-form per-rank peak: exact against the estimator at degree 1, exact sharding arithmetic."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainmem.estimate import estimate
from trainmem.plan.ranks import per_rank_peak, stage_peaks
from trainmem.plan.shard import breakdown, rank_peak
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import load_model


@pytest.mark.parametrize("name", ["gpt2", "llama-3-8b", "mixtral-8x7b"])
@pytest.mark.parametrize("attention, recompute", [("eager", "none"), ("flash", "selective"), ("sdpa", "full")])
@pytest.mark.parametrize("loss, accum", [("ce", 1), ("chunked-ce", 4)])
def test_degree_one_reproduces_the_estimator(name, attention, recompute, loss, accum):
    model = load_model(name)
    step = StepSpec(batch=3, seq=256, precision="mixed-bf16", loss=loss, grad_accum=accum)
    impl = ImplSpec(attention=attention, recompute=recompute)
    e = estimate(model, step, impl)
    [only] = rank_peak(breakdown(e), ParallelSpec(), accumulate=accum > 1)
    assert (only.peak_bytes, only.phase) == (e.peak_bytes, e.peak_phase)
    # affine in the micro-batch: B=1 and B=2 give B=3 exactly
    b1 = breakdown(estimate(model, replace(step, batch=1), impl))
    b2 = breakdown(estimate(model, replace(step, batch=2), impl))
    assert rank_peak(b1.scaled(b2, 3), ParallelSpec(), accumulate=accum > 1)[0].peak_bytes == e.peak_bytes


def test_zero_stages_shard_model_states_over_dp():
    model = load_model("gpt2")
    step = StepSpec(batch=1, seq=128, precision="mixed-bf16")
    e = estimate(model, step, ImplSpec())
    t = e.totals_bytes
    peaks = {}
    for z in range(4):
        [s] = stage_peaks(model, step, ImplSpec(), ParallelSpec(dp=4, zero=z))
        peaks[z] = s
    # optimizer phase holds parameters, master weights, states, gradients, temporaries
    opt0 = peaks[0].parts
    assert opt0["optimizer_states"] == t["optimizer_state"] and opt0["master_weights"] == t["master_weight"]
    assert peaks[1].parts["optimizer_states"] == round(t["optimizer_state"] / 4)
    assert peaks[3].parts["parameters"] == round(t["parameter"] / 4)
    assert peaks[0].peak_bytes > peaks[1].peak_bytes > peaks[2].peak_bytes > peaks[3].peak_bytes - 1


def test_tensor_parallel_splits_head_and_ffn_tensors_and_sp_the_rest():
    model = load_model("llama-3-8b")
    step = StepSpec(batch=8, seq=4096)  # activations set the peak
    b = breakdown(estimate(model, step, ImplSpec()))
    no_sp = rank_peak(b, ParallelSpec(tp=4), accumulate=False)[0].parts
    sp = rank_peak(b, ParallelSpec(tp=4, sp=True), accumulate=False)[0].parts
    assert b.act_split > b.act_replicated > 0
    assert sp["activations"] < no_sp["activations"]


def test_pipeline_first_stage_holds_pp_microbatches():
    model = load_model("llama-3-8b")  # 32 layers
    step = StepSpec(batch=8, seq=4096, grad_accum=8)
    b = breakdown(estimate(model, step, ImplSpec()))
    first, last = rank_peak(b, ParallelSpec(pp=4, microbatches=8), accumulate=True)
    block = (b.act_split + b.act_replicated) / 32
    # first stage: 4 micro-batches in flight × 8 blocks; the last holds 1 × 8 blocks + head
    assert first.stage == "first" and last.stage == "last"
    assert first.phase in ("forward", "backward")  # the first stage holds no head
    assert first.parts["activations"] == round(4 * 8 * block + b.act_first)
    assert last.parts["activations"] < first.parts["activations"]


def test_per_rank_peak_single_device_is_the_estimate():
    model, step = load_model("gpt2"), StepSpec(batch=2, seq=128)
    assert per_rank_peak(model, step, ImplSpec(), ParallelSpec()) == estimate(model, step, ImplSpec()).peak_bytes

"""The explainer's answers carry the estimator's numbers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainmem.estimate import estimate
from trainmem.estimate.inference import inference_estimate
from trainmem.plan.explain import QUESTIONS, explain
from trainmem.plan.hardware import load_gpu
from trainmem.plan.ranks import per_rank_peak
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import load_model

MODEL = load_model("gpt2")
STEP = StepSpec(batch=2, seq=512, precision="mixed-bf16")


@pytest.fixture(scope="module", params=["eager", "flash"])
def case(request):
    impl = ImplSpec(attention=request.param)
    ex = explain(MODEL, STEP, impl, gpu=load_gpu("rtx-4090"), zero_ranks=4)
    return impl, {a.key: a for a in ex.answers}, ex


def test_every_question_is_answered(case):
    _, answers, ex = case
    assert list(answers) == list(QUESTIONS)
    data = ex.to_dict()
    assert data["schema"] == "trainmem.explain/2"
    assert all(set(a) >= {"question", "answer", "numbers"} for a in data["answers"])


def test_sequence_doubling(case):
    impl, answers, _ = case
    n = answers["sequence_doubles"].numbers
    e1, e2 = estimate(MODEL, STEP, impl), estimate(MODEL, replace(STEP, seq=1024), impl)
    assert n["activation_bytes"] == [e1.totals_bytes["activation"], e2.totals_bytes["activation"]]
    assert n["peak_bytes"] == [e1.peak_bytes, e2.peak_bytes]
    assert n["linear_bytes"][1] == 2 * n["linear_bytes"][0]
    assert n["quadratic_bytes"][1] == 4 * n["quadratic_bytes"][0]
    if impl.attention == "eager":
        assert "transformer.h.*.attn.softmax" in n["quadratic_tensors"]
        assert n["quadratic_bytes"][0] > 0
    else:
        assert n["quadratic_bytes"] == [0, 0] and "nothing grows ×4" in answers["sequence_doubles"].answer


def test_grad_accumulation(case):
    impl, answers, _ = case
    n = answers["grad_accum"].numbers
    e1, e4 = estimate(MODEL, STEP, impl), estimate(MODEL, replace(STEP, grad_accum=4), impl)
    assert n["activation_bytes"] == [e1.totals_bytes["activation"]] * 2 == [e4.totals_bytes["activation"]] * 2
    assert n["peak_bytes"] == [e1.peak_bytes, e4.peak_bytes]
    assert n["increase_bytes"] == e4.peak_bytes - e1.peak_bytes


def test_zero_stages_leave_activations_alone(case):
    impl, answers, _ = case
    n = answers["zero_stages"].numbers
    t = estimate(MODEL, STEP, impl).totals_bytes
    for z in range(4):
        st = n["stages"][f"zero{z}"]
        assert st["activation"] == t["activation"]
        assert st["peak_bytes"] == per_rank_peak(MODEL, STEP, impl, ParallelSpec(dp=4, zero=z))
    assert n["stages"]["zero1"]["optimizer_state"] == t["optimizer_state"] // 4
    assert n["stages"]["zero2"]["gradient"] == t["gradient"] // 4
    assert n["stages"]["zero3"]["parameter"] == t["parameter"] // 4


def test_weights_sum_precision_inference(case):
    impl, answers, _ = case
    e = estimate(MODEL, STEP, impl)
    t = e.totals_bytes
    w = answers["weights_fit"].numbers
    assert (w["parameter_bytes"], w["peak_bytes"]) == (t["parameter"], e.peak_bytes)
    assert w["weights_fit"] is True
    # the step's verdict is estimate's --memory-figure reserved one (allocator model, capacity − context)
    from trainmem.estimate.allocation_order import estimate_reserved
    assert w["peak_reserved_bytes"] == estimate_reserved(e).reserved_bytes
    assert w["training_fits"] is (w["peak_reserved_bytes"] <= w["usable_bytes"])
    s = answers["sum_vs_peak"].numbers
    assert s["sum_of_ledgers_bytes"] == sum(t.values()) and s["peak_bytes"] == e.peak_bytes
    mp = answers["mixed_precision"].numbers["bytes_per_parameter"]
    # mixed-bf16 AdamW: 2 + 2 + 4 + 8 bytes per parameter
    assert mp == {"parameter": 2, "gradient": 2, "master_weight": 4, "optimizer_state": 8}
    inf = inference_estimate(MODEL, STEP, impl, context=STEP.seq)
    ti = answers["train_vs_inference"].numbers
    assert ti["inference_peak_bytes"] == inf.peak_bytes < ti["training_peak_bytes"] == e.peak_bytes
    assert ti["kv_cache_bytes"] == inf.totals_bytes["kv_cache"]

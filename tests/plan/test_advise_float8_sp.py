"""advise under TP without SP: tensorwise Float8 is offered as one change that also turns SP on
(torchao's tensorwise Float8 TP styles need the SP plan; the estimator refuses tensorwise TP
without SP), with the estimator's memory and the FP8/TP pricing of the existing choices; a
combination the estimator refuses is never offered (issue 13)."""

from __future__ import annotations

from dataclasses import replace

from trainmem.estimate import estimate
from trainmem.plan.advise import _Clock, _Measure, search
from trainmem.plan.choices import CHOICES, Config, Context
from trainmem.plan.cost import CostModel
from trainmem.plan.hardware import load_gpu
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import load_model
from trainmem.errors import TrainmemError

import pytest

LLAMA3 = load_model("llama-3-8b")
H100 = load_gpu("h100-80gb")
FP8 = Context(model=LLAMA3, gpus=2, gpus_per_node=8, fp8=True)
TW_SP = "Float8 linears, tensorwise with sequence parallelism"


def _variants(c: Config) -> dict[str, Config]:
    return {what: new for new, what in CHOICES["float8"].variants(c, FP8)}


def test_tensorwise_without_sp_comes_with_sp():
    start = Config(StepSpec(seq=4096), ImplSpec(), ParallelSpec(tp=2))
    got = _variants(start)
    assert sorted(got) == ["Float8 linears, rowwise", TW_SP]
    tw = got[TW_SP]
    assert tw.par == replace(start.par, sp=True) and tw.impl == ImplSpec(float8="tensorwise")
    assert got["Float8 linears, rowwise"].par == start.par  # rowwise keeps the plain TP styles
    # the estimator refuses tensorwise Float8 TP without SP: that half alone is never a candidate
    with pytest.raises(TrainmemError):
        estimate(LLAMA3, start.step, ImplSpec(float8="tensorwise"), parallel=start.par)
    assert "--float8 tensorwise" in tw.command("llama-3-8b") and "--tp 2 --sp" in tw.command("llama-3-8b")


def test_one_change_with_the_estimators_memory_and_the_fp8_sp_price():
    """Llama-3-8B S=4096 bf16 TP2 without SP: the combined change is the estimate of TP2+SP with
    tensorwise Float8 (what tensorwise on an SP start costs), one change, priced
    by the cost model on the new configuration (FP8 rate; TP traffic the same volume with SP)."""
    start = Config(StepSpec(seq=4096), ImplSpec(), ParallelSpec(tp=2))
    tw = _variants(start)[TW_SP]
    measure = _Measure(LLAMA3)
    e = estimate(LLAMA3, tw.step, tw.impl, parallel=tw.par)
    on_sp = _variants(replace(start, par=replace(start.par, sp=True)))["Float8 linears, tensorwise"]
    assert on_sp == tw and measure(tw)[0] == e.peak_bytes < measure(start)[0]
    usable = measure.reserved(tw)
    assert measure.reserved(start) > usable
    options, stats = search(LLAMA3, start, H100, usable, gpus=2, budget=8, max_changes=1, top=3,
                            top_changing=0, measure=measure)
    fits = {o.actions: o for o in options}
    best = fits[(TW_SP,)]
    assert best.changes == ("float8",) and best.peak_bytes == e.peak_bytes
    clock = _Clock(LLAMA3, start, H100, CostModel())
    sp_only = replace(start, par=replace(start.par, sp=True))
    f8_on_sp = replace(sp_only, impl=ImplSpec(float8="tensorwise"))
    assert best.throughput_cost == clock.throughput_cost(tw) == clock.throughput_cost(f8_on_sp) < 0
    assert clock.throughput_cost(sp_only) == clock.throughput_cost(start)  # SP alone: same price


def test_the_combination_the_estimator_refuses_is_never_offered():
    # amp-bf16 under TP: the Float8 TP styles are modelled in pure precisions only
    start = Config(StepSpec(seq=4096, precision="amp-bf16"), ImplSpec(), ParallelSpec(tp=2))
    measure = _Measure(LLAMA3)
    assert measure(_variants(start)[TW_SP]) is None
    usable = (measure(start) and measure.reserved(start)) - 1
    options, _ = search(LLAMA3, start, H100, usable, gpus=2, budget=6, max_changes=1, top=3,
                        top_changing=0, measure=measure)
    assert not any(o.actions == (TW_SP,) for o in options)

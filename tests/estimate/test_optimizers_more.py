"""torch's RMSprop and Adagrad, bitsandbytes' one-state optimizers (Lion, RMSprop; 8-bit, 32-bit,
paged) and AdEMAMix (two momenta in one state): the estimate's state layouts and step temporaries as exact integers, then against the
tracer (the real optimizer classes on fake tensors) and a real CPU step.

Two tiny Llamas built from config, those of tests/estimate/test_optimizer_impl.py (h128, 3 layers,
F344, V500: its parameter order gives the for-loop rules' neighbours) and of
tests/estimate/test_optimizers_8bit.py (h128, 2 layers, F345, V1000: its embedding and head, 128000
values each, are paged; gate/up/down, 44160 values, end in a partial 256-value block).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_optimizer_impl import (CFG, MODEL, TOTAL, _phase_peaks,  # noqa: E402
                                 _real_step, _specs)
from test_optimizer_impl import test_rule_bytes_are_exact as _exact_rule  # noqa: E402
from test_optimizers_8bit import CFG as CFG_V1000, MODEL as MODEL_V1000, _real_states  # noqa: E402

from trainmem.estimate import estimate  # noqa: E402
from trainmem.estimate.model_states import model_state_items, optimizer_step_transient_bytes  # noqa: E402
from trainmem.estimate.state_items import optimizer_state_items  # noqa: E402
from trainmem.inventory import Category  # noqa: E402
from trainmem.specs import StepSpec  # noqa: E402
from trainmem.trace import trace_step  # noqa: E402

BNB_ONE = ("lion32bit", "lion8bit", "paged-lion8bit", "paged-lion32bit", "rmsprop8bit", "rmsprop32bit")
BNB_MORE = (*BNB_ONE, "ademamix", "ademamix8bit")  # AdEMAMix: state1 holds two momenta
STATES = (Category.OPTIMIZER_STATE, Category.PAGED_STATE)


def _bytes(opt, shape, precision="fp32"):
    items = optimizer_state_items("w", shape, StepSpec(optimizer=opt, precision=precision))
    return sum(i.bytes for i in items), sum(i.bytes for i in items if i.category is Category.PAGED_STATE)


# layouts, as exact integers -----------------------------------------------------------------------

@pytest.mark.parametrize("opt,shape,precision,total,paged", [
    ("rmsprop", (44160,), "fp32", 44160 * 4, 0),                # square_avg like the parameter
    ("rmsprop", (44160,), "bf16", 44160 * 2, 0),
    ("adagrad", (44160,), "bf16", 44160 * 2, 0),                # sum like the parameter
    ("adagrad", (44160,), "mixed-bf16", 44160 * 4, 0),          # of the fp32 master
    ("lion32bit", (44160,), "bf16", 44160 * 4, 0),                   # bitsandbytes: one fp32 state1 whatever the dtype
    ("lion8bit", (4095,), "fp32", 4095 * 4, 0),                 # under min_8bit_size: fp32
    ("lion8bit", (4096,), "fp32", 4096 + 16 * 4, 0),            # uint8 state1 + 16 fp32 absmax1
    ("lion8bit", (44160,), "bf16", 44160 + 173 * 4, 0),         # ⌈44160/256⌉ = 173 blocks
    ("paged-lion8bit", (99999,), "fp32", 99999 + 391 * 4, 0),   # under 1e5: a plain device tensor
    ("paged-lion8bit", (100000,), "fp32", 100000 + 391 * 4, 100000),  # state1 paged, absmax1 not
    ("paged-lion32bit", (100000,), "bf16", 100000 * 4, 100000 * 4),
    ("rmsprop8bit", (44160,), "fp32", 44160 + 173 * 4, 0),
    ("rmsprop32bit", (44160,), "bf16", 44160 * 4, 0),
    ("ademamix", (44160,), "bf16", 3 * 44160 * 4, 0),          # state1 (2, n) + state2 (n), fp32
    ("ademamix8bit", (4095,), "fp32", 3 * 4095 * 4, 0),
    ("ademamix8bit", (44160,), "fp32", 3 * 44160 + 3 * 173 * 4, 0),  # absmax1 (2, 173), absmax2 (173,)
])
def test_state_layout_bytes(opt, shape, precision, total, paged):
    assert _bytes(opt, shape, precision) == (total, paged)


@pytest.mark.parametrize("opt,maps", [("lion8bit", ["optimizer.qmap1"]), ("rmsprop8bit", ["optimizer.qmap1"]),
                                      ("lion32bit", []), ("adamw8bit", ["optimizer.qmap1", "optimizer.qmap2"]),
                                      ("ademamix8bit", ["optimizer.qmap1", "optimizer.qmap2"])])
def test_one_state_optimizers_move_one_map_to_the_device(opt, maps):
    # Optimizer1State.init_state moves name2qmap["dynamic"] alone; Optimizer2State both
    items = model_state_items(MODEL, StepSpec(optimizer=opt))
    assert [(i.name, i.bytes) for i in items if i.name.startswith("optimizer.qmap")] == [(m, 1024) for m in maps]


# step temporaries, as exact integers --------------------------------------------------------------

# numel in optimizer order: embed 64000; per block q 16384, k 8192, v 8192, o 16384, gate/up/down
# 44032 each, two norms 128; final norm 128; lm_head 64000. Neighbours: gate + up = 88064, the most.
@pytest.mark.parametrize("optimizer,impl,in_backward,numel_x", [
    ("rmsprop", "foreach", False, TOTAL),          # sqrt(square_avg) of every tensor at once
    ("rmsprop", "for-loop", False, 2 * 44032),     # gate's avg still bound + up's
    ("adagrad", "foreach", False, 2 * TOTAL),      # std and numerator of every tensor at once
    ("adagrad", "for-loop", False, 2 * 44032),
    ("adagrad", "fused", False, 0),
    ("rmsprop", "foreach", True, 64000),           # one optimizer per parameter: the largest alone
    ("adagrad", "foreach", True, 2 * 64000),
    ("adagrad", "for-loop", True, 64000),
])
@pytest.mark.parametrize("precision,elem", [("fp32", 4), ("bf16", 2)])
def test_rule_bytes_are_exact(optimizer, impl, in_backward, numel_x, precision, elem):
    _exact_rule(optimizer, impl, in_backward, numel_x, precision, elem)  # the adamw/sgd cases' check


@pytest.mark.parametrize("opt", BNB_MORE)
def test_bitsandbytes_step_keeps_no_temporaries(opt):
    step, im = _specs(opt, "fp32", "auto")
    assert optimizer_step_transient_bytes(MODEL, step, im) == (0, "fused: bitsandbytes' kernel updates each tensor "
                                                                  "in place")


# estimate == trace == real run -------------------------------------------------------------------

_FAST = {("rmsprop", "foreach", "fp32")}


@pytest.mark.parametrize("optimizer,impl,precision", [
    pytest.param(o, i, p, marks=() if (o, i, p) in _FAST else pytest.mark.slow)  # ~4-8 s each
    for o, impls in (("rmsprop", ("foreach", "for-loop")), ("adagrad", ("foreach", "for-loop", "fused")))
    for i in impls for p in ("fp32", "bf16")])
def test_torch_optimizer_phase_estimate_trace_real(optimizer, impl, precision):
    step, im = _specs(optimizer, precision, impl)
    est, t = estimate(MODEL, step, im), trace_step(CFG, step, im)
    est_opt = next(p for p in est.phases if p.name == "optimizer")
    trace_opt, _ = _phase_peaks(t, "optimizer")
    assert trace_opt == est_opt.bytes, (trace_opt, est_opt.bytes, est_opt.note)  # the caller's ids counted in both
    states = {i.name: i.bytes for i in t.items if i.category is Category.OPTIMIZER_STATE}
    assert states == {i.name: i.bytes for i in est.inventory if i.category is Category.OPTIMIZER_STATE}

    real_peak, real_opt, steps = _real_step(step, im)
    assert steps == 30 * 4  # one fp32 0-dim counter per parameter (host memory on CUDA)
    assert real_opt == trace_opt + steps
    assert real_peak == t.peak_logical_bytes + steps
    if est.peak_phase == "optimizer":  # foreach and for-loop: the step's peak is this mechanism's
        assert t.peak_logical_bytes == est.peak_bytes
    else:  # fused: the peak is in backward, modelled elsewhere (tests/estimate/test_groundtruth_hf.py)
        assert abs(est.peak_bytes - t.peak_logical_bytes) <= 0.005 * t.peak_logical_bytes


@pytest.mark.parametrize("opt,precision", [
    pytest.param(o, p, marks=() if (o, p) == ("paged-lion8bit", "bf16") else pytest.mark.slow)  # ~1-2 s each
    for o in BNB_MORE for p in ("fp32", "bf16")])
def test_bitsandbytes_trace_equals_the_estimate(opt, precision):
    pytest.importorskip("bitsandbytes")
    step, im = _specs(opt, precision, "auto")
    est, t = estimate(MODEL_V1000, step, im), trace_step(CFG_V1000, step, im)
    for cat in STATES:  # every state, named alike, to the byte; paged ones their own ledger in both
        traced = {i.name: i.bytes for i in t.items if i.category is cat}
        estimated = {i.name: i.bytes for i in est.inventory if i.category is cat}
        # the shared maps: the trace names them after the first parameter whose state holds them
        assert {n: b for n, b in traced.items() if not n.endswith((".qmap1", ".qmap2"))} == {
            n: b for n, b in estimated.items() if not n.startswith("optimizer.qmap")}
        assert sum(traced.values()) == sum(estimated.values())
    paged = {"paged-lion8bit": 2 * 128000, "paged-lion32bit": 2 * 128000 * 4}.get(opt, 0)  # embed + head state1
    assert t.totals_at_peak_bytes["paged_optimizer_state"] == est.totals_bytes.get("paged_optimizer_state", 0) == paged
    est_opt = next(p for p in est.phases if p.name == "optimizer")
    assert _phase_peaks(t, "optimizer")[0] == est_opt.bytes  # the kernel allocates nothing; the ids in both


@pytest.mark.parametrize("opt,precision", [
    pytest.param(o, p, marks=() if (o, p) in {("lion8bit", "fp32"), ("ademamix8bit", "bf16")} else pytest.mark.slow)
    for o in BNB_MORE for p in ("fp32", "bf16")])
def test_state_bytes_equal_the_real_bitsandbytes_optimizer(opt, precision):
    real, real_total = _real_states(opt, precision)  # a real CPU step: paging falls back to plain tensors
    items = [i for i in model_state_items(MODEL_V1000, StepSpec(optimizer=opt, precision=precision))
             if i.category in STATES]
    est: dict[str, int] = {}
    for i in items:
        owner = next((n for n in real if i.name.startswith(n + ".")), None)
        if owner is not None:
            est[owner] = est.get(owner, 0) + i.bytes
    assert est == real  # every parameter, to the byte
    assert sum(i.bytes for i in items) == real_total  # with the shared maps, once

"""``--optimizer-impl foreach|fused|for-loop`` and ``--optimizer-in-backward``: the estimate's
rules against the tracer (torch's own optimizers on fake tensors) and a real CPU step.

A tiny Llama built from config (h128, 3 layers, V500; B1, S64), CPU kernels (``device='cpu'``).
The three count the same bytes (the model's buffers, rotary ``inv_freq``, included:
estimate/buffers.py; the caller's input ids, which the estimate's optimizer phase counts as the
caller's batch: ``PhaseInputs.optimizer_batch``) except, in the real run only, Adam's fp32 0-dim
``step`` counters (CPU tensors here, host memory on CUDA: the estimate and the tracer leave them out).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.estimate.model_states import optimizer_step_transient_bytes
from trainmem.inventory import Category
from trainmem.models.hf import build_hf_model
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config
from trainmem.trace import trace_step
from trainmem.trace.live import LiveStorages
from trainmem.trace.optimizers import make_optimizer_for
from trainmem.trace.torch_state import default_dtype

CFG = dict(model_type="llama", hidden_size=128, intermediate_size=344, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, vocab_size=500)
B, S = 1, 64
IMPLS = ("foreach", "fused", "for-loop")
MODEL = spec_from_hf_config(CFG)
NUM_PARAMS = 30  # embed, 3 × (q k v o gate up down + 2 norms), norm, lm_head


def _specs(optimizer, precision, impl, in_backward=False):
    return (StepSpec(batch=B, seq=S, precision=precision, optimizer=optimizer),
            ImplSpec(attention="sdpa", device="cpu", optimizer_impl=impl, optimizer_in_backward=in_backward))


# the rules, as exact integers ------------------------------------------------------------------

# numel: embed = lm_head = 500·128 = 64000; per block q = o = 128·128 = 16384, k = v = 64·128 = 8192,
# gate = up = down = 344·128 = 44032, two norms of 128; final norm 128.
# total = 2·64000 + 3·(2·16384 + 2·8192 + 3·44032 + 2·128) + 128 = 128000 + 3·181504 + 128 = 672640
TOTAL = 672640


@pytest.mark.parametrize("optimizer,impl,in_backward,numel_x", [
    ("adamw", "foreach", False, TOTAL),                # sqrt(exp_avg_sq) of every tensor at once
    ("adamw", "for-loop", False, 44032 + 2 * 44032),   # gate's denom + down's sqrt and quotient = 132096
    ("adamw", "fused", False, 0),
    ("sgd-momentum", "foreach", False, 0),
    ("sgd-momentum", "for-loop", False, 0),
    ("sgd-momentum", "fused", False, 0),
    ("adamw", "foreach", True, 64000),                 # one optimizer per parameter: the largest alone
    ("adamw", "for-loop", True, 2 * 64000),            # ... and no previous denom
    ("adamw", "fused", True, 0),
])
@pytest.mark.parametrize("precision,elem", [("fp32", 4), ("bf16", 2)])
def test_rule_bytes_are_exact(optimizer, impl, in_backward, numel_x, precision, elem):
    step, im = _specs(optimizer, precision, impl, in_backward)
    nbytes, rule = optimizer_step_transient_bytes(MODEL, step, im)
    assert nbytes == numel_x * elem, rule
    assert rule.startswith(impl)


def test_default_impl_follows_the_device():
    step = StepSpec(batch=B, seq=S, precision="fp32")
    for device, impl in (("cuda", "foreach"), ("cpu", "for-loop")):
        _, rule = optimizer_step_transient_bytes(MODEL, step, ImplSpec(device=device))
        assert rule.startswith(impl)
    e = estimate(MODEL, step, ImplSpec(device="cuda"))
    assert "foreach" in e.phases[-1].note


@pytest.mark.parametrize("step,impl,field", [
    (StepSpec(grad_accum=2), ImplSpec(optimizer_in_backward=True), "grad_accum"),
    (StepSpec(precision="mixed-bf16"), ImplSpec(optimizer_in_backward=True), "precision"),
    (StepSpec(optimizer="adafactor"), ImplSpec(optimizer_impl="fused"), "optimizer_impl"),
])
def test_impossible_combinations_name_the_field(step, impl, field):
    with pytest.raises(SpecError) as err:
        estimate(MODEL, step, impl)
    assert err.value.field == field


def test_bad_impl_value_is_refused():
    with pytest.raises(SpecError, match="optimizer_impl='foreach2'"):
        ImplSpec(optimizer_impl="foreach2")


# estimate == trace == real run -------------------------------------------------------------------

def _phase_peaks(result, phase: str) -> tuple[int, int]:
    """Logical bytes of a traced step: (most alive during ``phase``, largest rise within one
    stretch of ``phase`` over the bytes alive when it began)."""
    rec = result.recording
    marks: dict[int, list[str]] = {}  # event index -> phases starting there (a phase may allocate nothing)
    for i, name in rec.marks:
        marks.setdefault(i, []).append(name)
    live = top = rise = begin = 0
    current = None
    for i, e in enumerate(rec.events):
        for current in marks.get(i, ()):
            begin = live
            if current == phase:
                top = max(top, live)
        live += rec.blocks[e].nbytes if e >= 0 else -rec.blocks[~e].nbytes
        if current == phase:
            top = max(top, live)
            rise = max(rise, live - begin)
    return top, rise


def _not_estimated(result) -> int:
    """Input ids: in every live set of the trace; the estimate counts them as the embedding's saved indices in
    forward and backward, and as the caller's batch in its optimizer phase."""
    return sum(i.bytes for i in result.items if i.category is Category.INPUT)


def _real_step(step, impl) -> tuple[int, int, int]:
    """(whole-step peak, optimizer.step() peak, host step counters) of a real CPU step, steady state."""
    torch.manual_seed(0)
    with default_dtype(torch.bfloat16 if step.precision == "bf16" else torch.float32):  # as trace_step builds it
        model = build_hf_model(CFG, attention="sdpa")
    model.train()
    _, _, opt = make_optimizer_for(model, step, impl)
    ids = torch.randint(0, CFG["vocab_size"], (B, S))

    def one(live=None):
        loss = model(ids, labels=ids).loss
        loss.backward()
        del loss
        if live is not None:
            live.take_peak()  # a new interval: optimizer.step() alone
        opt.step()
        peak = live.take_peak() if live is not None else 0
        opt.zero_grad(set_to_none=True)
        return peak

    one()  # states exist from here on
    states = [v for s in opt.state.values() for v in s.values()]
    steps = sum(v.untyped_storage().nbytes() for s in opt.state.values() for k, v in s.items() if k == "step")
    with LiveStorages([*model.parameters(), *model.buffers(), ids, *states]) as live:
        opt_peak = one(live)
    return live.peak, opt_peak, steps


@pytest.mark.slow  # 12 cases of ~2-4 s (a trace and a real step each): in the slow set since 2026-12-02
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd-momentum"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_optimizer_phase_estimate_trace_real(precision, optimizer, impl):
    step, im = _specs(optimizer, precision, impl)
    est = estimate(MODEL, step, im)
    t = trace_step(CFG, step, im)
    est_opt = next(p for p in est.phases if p.name == "optimizer")
    trace_opt, _ = _phase_peaks(t, "optimizer")
    assert est_opt.parts["caller_ids"] == _not_estimated(t) == B * S * 8  # the caller's ids: 1·64·8 = 512
    assert trace_opt == est_opt.bytes, (trace_opt, est_opt.bytes, est_opt.note)

    real_peak, real_opt, steps = _real_step(step, im)
    assert steps == (NUM_PARAMS * 4 if optimizer == "adamw" else 0)  # fp32 0-dim counters; SGD keeps none
    assert real_opt == trace_opt + steps
    assert real_peak == t.peak_logical_bytes + steps
    if est.peak_phase == "optimizer":  # the step's peak is this mechanism's: to the byte
        assert t.peak_logical_bytes == est.peak_bytes
    else:  # the peak is in backward, modelled elsewhere (tests/estimate/test_groundtruth_hf.py)
        assert abs(est.peak_bytes - t.peak_logical_bytes) <= 0.005 * t.peak_logical_bytes


@pytest.mark.slow  # 9 cases of ~2-5 s: in the slow set since 2026-12-02
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("optimizer,precision", [("adamw", "fp32"), ("adamw", "bf16"), ("sgd-momentum", "fp32")])
def test_optimizer_in_backward_estimate_trace_real(optimizer, precision, impl):
    step, im = _specs(optimizer, precision, impl, in_backward=True)
    est = estimate(MODEL, step, im)
    assert "optimizer" not in {p.name for p in est.phases}
    t = trace_step(CFG, step, im)
    # each hook's own temporaries: exactly one parameter's (the largest: lm_head / embed, 64000)
    _, hook_rise = _phase_peaks(t, "step_in_backward")  # the trace names it as the estimate does
    one_param, _ = optimizer_step_transient_bytes(MODEL, step, im)
    assert hook_rise == one_param
    # no phase holds every gradient
    assert all(p.parts.get("gradients", 0) <= 64000 * (4 if precision == "fp32" else 2) for p in est.phases)

    real_peak, _, steps = _real_step(step, im)
    assert real_peak == t.peak_logical_bytes + steps
    # step_in_backward is modelled at the head, where the loss's tensors are freed but for its
    # scalars (a few bytes): within 0.01%; a peak in another phase is modelled elsewhere
    tolerance = 1e-4 if est.peak_phase == "step_in_backward" else 0.005
    assert abs(est.peak_bytes + _not_estimated(t) - t.peak_logical_bytes) <= tolerance * t.peak_logical_bytes


def test_in_backward_saves_the_gradients():
    step, fused = _specs("adamw", "fp32", "fused")
    _, inb = _specs("adamw", "fp32", "fused", in_backward=True)
    normal, stepped = estimate(MODEL, step, fused), estimate(MODEL, step, inb)
    assert stepped.peak_bytes < normal.peak_bytes


@pytest.mark.parametrize("args,needle", [
    (["--optimizer-in-backward", "--grad-accum", "2"], "grad_accum=2"),
    (["--optimizer", "adafactor", "--optimizer-impl", "fused"], "optimizer_impl='fused'"),
])
def test_cli_refuses_in_one_line(args, needle):
    proc = subprocess.run([sys.executable, "-m", "trainmem.cli", "estimate", "--model", "gpt2", "--seq", "64", *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def test_every_optimizer_implementation_has_one_step_rule():
    """specs/optimizer_impl.py names the implementations (the tracer reads it); the estimator keeps
    one temporaries rule for each pair, and none for a pair the table lacks."""
    from trainmem.estimate.optimizer_step import _RULES
    from trainmem.specs.optimizer_impl import IMPLEMENTATIONS
    from trainmem.specs.step import OPTIMIZERS

    assert set(IMPLEMENTATIONS) == set(OPTIMIZERS)
    assert set(_RULES) == {(o, i) for o, impls in IMPLEMENTATIONS.items() for i in impls}

"""``--optimizer-in-backward`` with an untied head and plain cross-entropy (estimate/peak.py,
``step_in_backward``): the head's weight gradient is stepped in its hook next to the logits'
gradient that produced it, in the logits' dtype. With bf16 the fp32 log-softmax gradient was cast
back (``ToCopyBackward0``) and freed by the engine before the head's ``MmBackward0`` ran; the phase
counted it in fp32, B·S·V·2 bytes over (256,000 B on this tiny Llama, +3.2%), and left out the loss
and its seed gradient (8 B). The tiny untied Llama of test_tied_in_backward.py (h64, 2 layers, V8000,
B1, S16), CPU kernels, torchtune's hooks; the trace is held to a real step there and here."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_tied_in_backward import B, S, UNTIED, _head_moment, _phase, _specs, _torchtune_register  # noqa: E402

from trainmem.estimate import estimate  # noqa: E402
from trainmem.models.hf import build_hf_model  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402
from trainmem.trace import trace_step  # noqa: E402
from trainmem.trace.live import LiveStorages  # noqa: E402
from trainmem.trace.optimizers import _make_optimizer  # noqa: E402
from trainmem.trace.torch_state import default_dtype  # noqa: E402


def test_head_moment_holds_the_logits_gradient_in_their_dtype():
    step, im = _specs("bf16")
    ph = _phase(estimate(spec_from_hf_config(UNTIED), step, im), "step_in_backward")
    assert ph.parts["logits_grad"] == B * S * 8000 * 2 and ph.parts["loss_scalars"] == 2 * 4


def _real_peak(step, impl) -> tuple[int, int]:
    """(whole-step peak, host step counters) of a real CPU step, steady state: the trace leaves the
    0-dim step counters out, as in test_tied_in_backward._real_step."""
    torch.manual_seed(0)
    with default_dtype(torch.bfloat16 if step.precision == "bf16" else torch.float32):
        model = build_hf_model(UNTIED, attention="sdpa")
    model.train()
    optim_dict = {p: _make_optimizer("adamw", [p], impl.optimizer_impl) for p in model.parameters()}
    _torchtune_register()(model, optim_dict)
    ids = torch.randint(0, UNTIED["vocab_size"], (B, S))

    def one():
        model(ids, labels=ids).loss.backward()

    one()
    states = [v for o in optim_dict.values() for s in o.state.values() for v in s.values()]
    steps = sum(v.untyped_storage().nbytes() for o in optim_dict.values() for s in o.state.values()
                for k, v in s.items() if k == "step")
    with LiveStorages([*model.parameters(), *model.buffers(), ids, *states]) as live:
        one()
    return live.peak, steps


@pytest.mark.slow  # one trace and one real step: ~10 s on 2 shared cores
@pytest.mark.parametrize("precision, impl", [("bf16", "fused"), ("bf16", "for-loop"), ("fp32", "fused")])
def test_untied_in_backward_estimate_trace_real(precision, impl):
    step, im = _specs(precision, impl)
    est = estimate(spec_from_hf_config(UNTIED), step, im)
    t = trace_step(UNTIED, step, im)
    assert _head_moment(t) == _phase(est, "step_in_backward").bytes  # was 255,992 B over in bf16 fused
    if est.peak_phase == "step_in_backward":
        assert est.peak_bytes == t.peak_logical_bytes
    real, steps = _real_peak(step, im)
    assert steps == 21 * 4  # fp32 0-dim counters: embed, 2 × (7 linears + 2 norms), norm, lm_head
    assert real == t.peak_logical_bytes + steps

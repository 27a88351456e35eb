"""``--offload activations`` without recompute: the block backward moments under torchtune's offload
(estimate/offload_moments.py) against the tracer and a real CPU step.

Tiny Llamas (h64, 2 layers) on CPU kernels. Before these moments the estimate was 24,968 B under the
trace for V256 B1 S64 bf16 (an RMSNorm's ``PowBackward0`` in block 0, with two brought-back copies of its
fp32 input) and 32,776 B under for B2 S96 fp32 (the gated MLP product's ``MulBackward0``: the down
projection's gradients were left out). Each is now equal to the byte. The real step runs real tensors
under the same hooks (``trace/offload.py``, torchtune's policy: its class cannot run on CPU here,
docs/offload.md), measured as live storages; it adds only Adam's fp32 0-dim ``step`` counters, CPU
tensors here, which the trace and the estimate leave out.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config
from trainmem.trace import trace_step
from trainmem.trace.offload import offload_activations

from real_steps import real_step  # noqa: E402  (tests/estimate/real_steps.py)

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256)
OFFLOAD = ParallelSpec(offload=("activations",))
IMPL = ImplSpec(device="cpu")
#: (precision, B, S, where the estimate's peak is)
CASES = [("bf16", 1, 64, "an RMSNorm's PowBackward0"), ("fp32", 2, 96, "the gated MLP product's MulBackward0")]


@pytest.mark.parametrize("precision,batch,seq,where", CASES)
def test_block_moment_equals_trace(precision, batch, seq, where):
    step = StepSpec(batch=batch, seq=seq, precision=precision)
    est = estimate(spec_from_hf_config(LLAMA), step, IMPL, OFFLOAD)
    traced = trace_step(LLAMA, step, IMPL, offload=("activations",))
    assert est.peak_bytes == traced.peak_logical_bytes, (est.peak_bytes, traced.peak_logical_bytes, est.peak.note)
    assert est.peak_phase == "backward_first_block" and where in est.peak.note
    assert traced.peak_phase == "backward"


@pytest.mark.slow  # two real steps beside the traces (a few seconds each)
@pytest.mark.parametrize("precision,batch,seq,where", CASES)
def test_real_step_equals_trace(precision, batch, seq, where):
    step = StepSpec(batch=batch, seq=seq, precision=precision)
    traced = trace_step(LLAMA, step, IMPL, offload=("activations",))
    real, counters = real_step(LLAMA, step, IMPL, forward=offload_activations)
    assert counters == 21 * 4  # embed, 2 × (q k v o gate up down + 2 norms), norm, lm_head: one fp32 0-dim each
    assert real == traced.peak_logical_bytes + counters, (real, traced.peak_logical_bytes, counters)


@pytest.mark.slow  # h128/L3 at B2 S256: a few seconds per trace
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_h128_step_peak_equals_trace(precision):
    """docs/offload.md's tiny Llama (h128/L3, V500, B2 S256, foreach AdamW): fp32's peak is block 0's MLP
    product moment (0.988 of the trace before it was modelled), bf16's the loss backward."""
    cfg = dict(model_type="llama", hidden_size=128, intermediate_size=344, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=500)
    step = StepSpec(batch=2, seq=256, precision=precision)
    impl = ImplSpec(device="cpu", optimizer_impl="foreach")
    est = estimate(spec_from_hf_config(cfg), step, impl, OFFLOAD)
    assert est.peak_bytes == trace_step(cfg, step, impl, offload=("activations",)).peak_logical_bytes

"""Eager ``--recompute op``: a checkpointed block's node moments on its recomputed set
(estimate/op_moments.py) against the tracer and a real CPU step under real op-level checkpointing.

Tiny Llamas on CPU kernels (SDPA). Before these moments the estimate was under the trace by 12,296 B
(h64, 2 layers, V256, B1 S64 bf16), 24,584 B (fp32) and 4,104 B (amp-bf16), in block 0's gated MLP product
backward, and by 8,200 B at B2 S96 fp32 in block 1's. Each is now equal to the byte. The real step runs
torchtitan's policy through ``torch.utils.checkpoint`` (``trace.recompute.enable_recompute``), measured as
live storages. It adds only Adam's fp32 0-dim ``step`` counters, CPU tensors here, which the trace and
the estimate leave out.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config
from trainmem.trace import trace_step
from trainmem.trace.recompute import enable_recompute

from real_steps import real_step  # noqa: E402  (tests/estimate/real_steps.py)

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256)
IMPL = ImplSpec(device="cpu", recompute="op")
#: (precision, B, S, the phase of the estimate's peak: the block whose MLP product tops)
CASES = [("bf16", 1, 64, "backward_first_block"), ("fp32", 1, 64, "backward_first_block"),
         ("fp32", 2, 96, "backward"), ("amp-bf16", 1, 64, "backward_first_block")]


@pytest.mark.parametrize("precision,batch,seq,phase", CASES[:3])
def test_block_moment_equals_trace(precision, batch, seq, phase):
    step = StepSpec(batch=batch, seq=seq, precision=precision)
    est = estimate(spec_from_hf_config(LLAMA), step, IMPL)
    traced = trace_step(LLAMA, step, IMPL)
    assert est.peak_bytes == traced.peak_logical_bytes, (est.peak_bytes, traced.peak_logical_bytes, est.peak.note)
    assert est.peak_phase == phase and "op_moments" in est.peak.note


@pytest.mark.slow  # a trace and two real steps a case (a few seconds)
@pytest.mark.parametrize("precision,batch,seq,phase", CASES)
def test_real_step_equals_trace_and_estimate(precision, batch, seq, phase):
    step = StepSpec(batch=batch, seq=seq, precision=precision)
    traced = trace_step(LLAMA, step, IMPL)
    real, counters = real_step(LLAMA, step, IMPL, prepare=lambda m: enable_recompute(m, IMPL))
    assert counters == 21 * 4  # embed, 2 × (q k v o gate up down + 2 norms), norm, lm_head: one fp32 0-dim each
    assert real == traced.peak_logical_bytes + counters, (real, traced.peak_logical_bytes, counters)
    assert estimate(spec_from_hf_config(LLAMA), step, IMPL).peak_bytes == traced.peak_logical_bytes

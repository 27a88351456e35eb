"""Exactness defects of the trace, each pinned with ==.

1. Under activation checkpointing transformers turns the KV cache off, and
   ``masking_utils.find_packed_sequence_indices`` treated a FakeTensor as "tracing": the fake
   forward built a (B, 1, S, S) causal mask the real run never makes (tiny Llama, full recompute:
   every module's forward and backward peak 2,048 B above the real run's at B=2, S=32).
   ``trace/hf_masks.py`` gives the real run's answer; fake == real to the byte.
"""

import pytest

from trainmem.specs import ImplSpec, StepSpec
from trainmem.trace import trace_step

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, pad_token_id=0)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("recompute", ["full", "every-k"])
def test_fake_trace_equals_real_under_recompute(attention, recompute):
    step = StepSpec(batch=2, seq=32, precision="fp32")
    impl = ImplSpec(attention=attention, device="cpu", recompute=recompute)
    fake = trace_step(LLAMA, step, impl)
    real = trace_step(LLAMA, step, impl, real=True)
    assert fake.meta["fake"] and not real.meta["fake"]
    assert fake.modules == real.modules
    assert fake.timeline_allocated_bytes == real.timeline_allocated_bytes
    assert fake.peak_bytes == real.peak_bytes

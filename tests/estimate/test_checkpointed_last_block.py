"""A checkpointed last block's backward (estimate/backward_moments.py ``block_phases``): the block keeps only what
later nodes saved of it, its output, the final norm's input, which that norm's backward released before the block
recomputes (torch/csrc/autograd/engine.cpp ``Node::release_variables``), so the working set no longer counts it.

Tiny Phi-3 (h64, F192, 4/2 heads, 2 layers, V256), LoRA on qkv_proj, amp-bf16, AdamW for-loop, CPU fake-tensor
traces, estimate - trace: every-k (k=2) B2 S32 +16,376 -> 0, B1 S32 +8,184 -> 0; full B2 S64 +8,184 -> 0. Full B1/B2
S32 move from +8,184 / +16,376 (the last block) to +6,136 (the first block's working set; taking its kept output
off as the last block's reads 8,192 B under the trace in tiny Llama full-recompute cases: not the same mechanism)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec
from trainmem.specs.loaders import spec_from_hf_config

PHI3 = dict(model_type="phi3", hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, num_labels=3, pad_token_id=0)
IMPL = ImplSpec(device="cpu", optimizer_impl="for-loop")
LORA = FinetuneSpec(mode="lora", lora_targets=("qkv_proj",))


@pytest.mark.slow  # one fake-tensor trace each
@pytest.mark.parametrize("recompute,every,batch,seq", [("every-k", 2, 2, 32), ("every-k", 2, 1, 32),
                                                       ("full", 1, 2, 64)])
def test_checkpointed_last_block_equals_trace(recompute, every, batch, seq):
    from trainmem.estimate import estimate
    from trainmem.trace import trace_step

    step, impl = StepSpec(batch=batch, seq=seq, precision="amp-bf16"), replace(IMPL, recompute=recompute,
                                                                              recompute_every=every)
    e = estimate(spec_from_hf_config(PHI3), step, impl, finetune=LORA)
    t = trace_step(PHI3, step, impl, finetune=LORA)
    assert (e.peak_bytes, e.peak_phase) == (t.peak_logical_bytes, "backward")

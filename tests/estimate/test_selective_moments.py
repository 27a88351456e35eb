"""estimate/selective_moments.py: the bytes a block releases before its attention core is recomputed
(``--recompute selective``), and what the step reads with them (estimate/backward_moments.py, patch pending).

Tiny GPT-NeoX (h128, F512, 4 heads, 2 layers, V128, parallel residual) and tiny Llama (h64, F176, 4/2 heads), LoRA
r 8 (peft's default targets), AdamW, sdpa, CPU fake-tensor traces. Before (estimate - trace): GPT-NeoX LoRA fp32
B1 S32 +33,016 B, B2 S64 +132,600 B; bf16 B1 S32 +8,576 B, B2 S64 +34,816 B; amp-bf16 B1 S32 +5,872 B, B2 S64
+127,464 B; full fine-tuning fp32 / bf16 / amp-bf16 B2 S64 +132,088 / +66,808 / +99,320 B. With the working set less
these bytes: bf16 equal; fp32 and amp-bf16 S·8 B under (one int64 (S,) position_ids, which GPTNeoXLayer passes to
the attention function in its kwargs and the selective checkpoint holds until the first block's attention backward:
not in the selective saved set yet). Llama LoRA and full fine-tuning: unchanged (equal at S64)."""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.estimate.selective_moments import saved_after_attention
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec
from trainmem.specs.loaders import spec_from_hf_config

NEOX = dict(model_type="gpt_neox", hidden_size=128, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, vocab_size=128, max_position_embeddings=512)
LORA = FinetuneSpec(mode="lora", lora_rank=8)


def _case(precision, batch, seq):
    return StepSpec(batch=batch, seq=seq, precision=precision, optimizer="adamw"), \
        ImplSpec(attention="sdpa", device="cpu", recompute="selective")


def test_neox_saved_after_attention_as_integers():
    e = estimate(spec_from_hf_config(NEOX), *_case("fp32", 1, 32), finetune=LORA)
    # post_attention_layernorm's mean and rstd (2 · 32 · 4), dense_h_to_4h's output (the frozen MLP's one saved
    # tensor, 32 · 512 · 4) and the block's output (32 · 128 · 4)
    assert saved_after_attention(e.inventory, 1) == 2 * 32 * 4 + 32 * 512 * 4 + 32 * 128 * 4 == 82_176


@pytest.mark.slow  # one fake-tensor trace each
@pytest.mark.parametrize("batch,seq", [(1, 32), (2, 64)])
def test_neox_lora_selective_bf16_equals_trace(batch, seq):
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    step, impl = _case("bf16", batch, seq)
    t = trace_step(NEOX, step, impl, finetune=LORA)
    e = estimate(spec_from_hf_config(NEOX), step, impl, finetune=LORA)
    # the top: the last block's fused QKV adapter in the forward (estimate/adapter_forward.py)
    assert (t.peak_op, e.peak_phase, e.peak_bytes) == ("mul", "forward", t.peak_logical_bytes)

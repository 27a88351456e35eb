"""The last block's adapted fused QKV projection in the forward (estimate/adapter_forward.py ``_FUSED_QKV``): peft's
default target on GPT-NeoX (``query_key_value``), frozen MLP. At lora_B's scaled output the forward holds the
tensors saved so far, the input norm's bf16 output (the frozen base layer saves nothing; lora_A saves peft's fp32
copy), the base layer's (B, S, 3H) output, lora_B's fp32 output and its scaled copy, the embedding's output and
cache_position.

Tiny GPT-NeoX (h128, F512, 4 heads, 2 layers, V128) LoRA r 8 bf16 (fp32 adapters), AdamW, sdpa, CPU fake-tensor
traces: the forward phase was 32,496 B (B1 S32) under the trace's forward top, both --recompute none and selective;
under selective that moment is the step's top (the estimate's peak hid it: the attention core's working set
was 8,576 B over, estimate/backward_moments.py). Now the forward phase equals the trace's forward top."""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec
from trainmem.specs.loaders import spec_from_hf_config

NEOX = dict(model_type="gpt_neox", hidden_size=128, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, vocab_size=128, max_position_embeddings=512)
LORA = FinetuneSpec(mode="lora", lora_rank=8)


def _case(batch, seq, recompute):
    return StepSpec(batch=batch, seq=seq, precision="bf16", optimizer="adamw"), \
        ImplSpec(attention="sdpa", device="cpu", recompute=recompute)


def test_qkv_adapter_forward_as_integers():
    e = estimate(spec_from_hf_config(NEOX), *_case(1, 32, "selective"), finetune=LORA)
    at = {p.name: p for p in e.phases}["forward"]
    R = 32 * 128  # (B, S, H) elements
    assert at.parts["block_locals"] == R * 2  # the input norm's bf16 output
    # inputs_embeds (bf16); the selective checkpoint holds position_ids (an activation, rules_hf._gpt), so
    # adapter_forward._cache_position adds none
    assert at.parts["model_locals"] == R * 2
    # the base layer's bf16 (B, S, 3H) output, lora_B's fp32 output and its scaled copy (peft's fp32 copy of the
    # input is saved by lora_A: an activation)
    assert at.parts["adapter_forward"] == 3 * R * 2 + 2 * 3 * R * 4
    assert "logits" not in at.parts


@pytest.mark.slow  # one fake-tensor trace each
@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("batch,seq", [(1, 32), (2, 64)])
def test_forward_phase_equals_trace_forward_top(batch, seq, recompute):
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    step, impl = _case(batch, seq, recompute)
    t = trace_step(NEOX, step, impl, finetune=LORA)
    rec, live, top, phase = t.recording, 0, 0, None
    marks = dict(rec.marks)
    for k, ev in enumerate(rec.events):
        phase = marks.get(k, phase)
        block = rec.blocks[ev if ev >= 0 else ~ev]
        live += block.nbytes if ev >= 0 else -block.nbytes
        if phase == "forward":
            top = max(top, live)
    e = estimate(spec_from_hf_config(NEOX), step, impl, finetune=LORA)
    assert {p.name: p.bytes for p in e.phases}["forward"] == top

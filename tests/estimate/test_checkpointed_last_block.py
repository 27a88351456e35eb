"""A checkpointed last block's backward (estimate/backward_moments.py ``block_phases``): the block keeps only what
later nodes saved of it, its output, the final norm's input, which that norm's backward released before the block
recomputes (torch/csrc/autograd/engine.cpp ``Node::release_variables``), so the working set no longer counts it.

Tiny Phi-3 (h64, F192, 4/2 heads, 2 layers, V256), LoRA on qkv_proj, amp-bf16, AdamW for-loop, CPU fake-tensor
traces, estimate - trace: every-k (k=2) B2 S32 +16,376 -> 0, B1 S32 +8,184 -> 0; full B2 S64 +8,184 -> 0. Full B1/B2
S32 moved from +8,184 / +16,376 (the last block) to +6,136 (the first block's working set), and to 0 once the first
block's working set, too, leaves out its output, which the next block's backward released (backward_moments.py
``_output_released``): then the node moments decide. The same took tiny GPT-2 and Phi-3 (h64, 2 layers, V256)
amp-bf16 --recompute full B2 S64 from +16,120 / +16,376 to 0 (their tops: the first block's MLP node moments); the
lead's head scan (tiny Llama, Phi-3, GPT-2, Qwen2, BERT; three heads, fp32/bf16/amp-bf16, B1/B2 x S32/S64, recompute
none/full) found no case under with it."""

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


@pytest.mark.slow  # one fake-tensor trace each
@pytest.mark.parametrize("batch", [1, 2])
def test_checkpointed_first_block_lora_equals_trace(batch):
    """Phi-3 LoRA on qkv_proj, amp-bf16, --recompute full, S32: +6,136 B before the first block's working set left
    out its released output; now the last block's down_proj cast moment is the top, as in the trace."""
    from trainmem.estimate import estimate
    from trainmem.trace import trace_step

    step, impl = StepSpec(batch=batch, seq=32, precision="amp-bf16"), replace(IMPL, recompute="full")
    e = estimate(spec_from_hf_config(PHI3), step, impl, finetune=LORA)
    t = trace_step(PHI3, step, impl, finetune=LORA)
    assert (e.peak_bytes, e.peak_phase) == (t.peak_logical_bytes, "backward")
    assert e.peak_bytes == {1: 786_504, 2: 904_776}[batch]


GPT2 = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=512)
PHI3_FULL = dict(model_type="phi3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=256, max_position_embeddings=512, pad_token_id=0)
#: amp-bf16 --recompute full B2 S64: the first block's MLP node moment (GPT-2: gelu_new's MulBackward0), == trace
FIRST = {"gpt2": (GPT2, 3_338_760), "phi3": (PHI3_FULL, 2_229_320)}


@pytest.mark.parametrize("family", sorted(FIRST))
def test_first_block_working_set_leaves_out_its_output(family):
    from trainmem.estimate import estimate
    from trainmem.estimate.block_backward import block_items
    from trainmem.inventory import Category

    cfg, top = FIRST[family]
    step, impl = StepSpec(batch=2, seq=64, precision="amp-bf16"), replace(IMPL, recompute="full")
    e = estimate(spec_from_hf_config(cfg), step, impl)
    # what the checkpointed block 0 keeps: its output (2·64·64·4 = 32,768), block 1's checkpoint input
    kept = [i for i in block_items(e.inventory, 0) if i.category is Category.ACTIVATION]
    assert sum(i.bytes for i in kept) == 32_768
    first = next(p for p in e.phases if p.name == "backward_first_block")
    assert "node_work" in first.parts and (e.peak_phase, e.peak_bytes) == ("backward_first_block", top)


@pytest.mark.slow  # one fake-tensor trace each
@pytest.mark.parametrize("family", sorted(FIRST))
def test_first_block_equals_trace(family):
    from trainmem.trace import trace_step

    cfg, top = FIRST[family]
    step, impl = StepSpec(batch=2, seq=64, precision="amp-bf16"), replace(IMPL, recompute="full")
    assert trace_step(cfg, step, impl).peak_logical_bytes == top

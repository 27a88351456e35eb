"""A forward moment inside the last block (estimate/adapter_forward.py): its LoRA-adapted down projection's adapter
sum, with the base layer's output, peft's fp32 copy of the product and the block's and the model's locals alive.

Tiny GPT-NeoX (h128, F512, V128) and Llama (h64, F176, 4/2 heads, V128), 2 layers, LoRA r 8 on every linear, AdamW,
sdpa, CPU fake-tensor traces, logical bytes. Before (estimate - trace), amp-bf16 --recompute none: GPT-NeoX B1 S32
-57,072 B, B2 S64 -325,096 B, Llama B2 S64 -2,024 B (q, v and the MLP too; --grad-accum 2 too), B2 S96 -11,240 B,
B4 S64 -19,928 B, --recompute selective B2 S64 -1,512 B; bf16 (fp32 adapters) GPT-NeoX B2 S64 -66,048 B. Now equal."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec
from trainmem.specs.loaders import spec_from_hf_config

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
NEOX = dict(model_type="gpt_neox", hidden_size=128, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, vocab_size=128, max_position_embeddings=512)
EVERY = {"llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
         "gpt_neox": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")}
MLP = {"llama": ("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"),
       "gpt_neox": ("query_key_value", "dense_h_to_4h", "dense_4h_to_h")}


def _case(cfg, targets, precision, batch, seq, recompute="none", grad_accum=1):
    ft = FinetuneSpec(mode="lora", lora_rank=8, lora_targets=targets[cfg["model_type"]])
    step = StepSpec(batch=batch, seq=seq, precision=precision, optimizer="adamw", grad_accum=grad_accum)
    return spec_from_hf_config(cfg), step, ImplSpec(attention="sdpa", device="cpu", recompute=recompute), ft


def test_neox_adapter_forward_as_integers():
    model, step, impl, ft = _case(NEOX, EVERY, "amp-bf16", 1, 32)
    e = estimate(model, step, impl, finetune=ft)
    at = {p.name: p for p in e.phases}["forward"]
    R, F = 32 * 128, 32 * 512  # (B, S, H) and (B, S, F) elements
    # the MLP's fp32 input (post_attention_layernorm's output), the bf16 GELU output, the attention's bf16 output
    assert at.parts["block_locals"] == R * 4 + F * 2 + R * 2
    assert at.parts["model_locals"] == R * 4 + 32 * 8  # inputs_embeds (fp32), cache_position
    # the base layer's bf16 output, peft's fp32 copy of the GELU output, lora_B's bf16 output and its scaled copy
    assert at.parts["adapter_forward"] == R * 2 + F * 4 + 2 * R * 2
    # not yet made: the logits and their fp32 copy, the final hidden state, the block's output and what comes after
    assert "logits" not in at.parts and "head_input_unsaved" not in at.parts
    assert at.parts["kv_cache_unsaved"] == 2 * 4 * 32 * 32 * 4  # each block's fp32 K cache copy (autocast saves bf16)
    assert (e.peak_phase, e.peak_bytes) == ("forward", 3_201_056)


def test_not_read_with_adapter_dropout_or_checkpointed():
    model, step, impl, ft = _case(NEOX, EVERY, "amp-bf16", 1, 32)
    fwd = {p.name: p for p in estimate(model, step, impl, finetune=replace(ft, lora_dropout=0.1)).phases}["forward"]
    assert "adapter_forward" not in fwd.parts  # dropout's output and mask: not modelled here
    model, step, impl, ft = _case(NEOX, EVERY, "amp-bf16", 1, 32, recompute="full")
    fwd = {p.name: p for p in estimate(model, step, impl, finetune=ft).phases}["forward"]
    assert "adapter_forward" not in fwd.parts


@pytest.mark.slow  # one fake-tensor trace each, ~1-4 s
@pytest.mark.parametrize("cfg,targets,precision,batch,seq,recompute,grad_accum", [
    (NEOX, EVERY, "amp-bf16", 1, 32, "none", 1), (NEOX, EVERY, "amp-bf16", 2, 64, "none", 1),
    (NEOX, MLP, "amp-bf16", 2, 64, "none", 1), (NEOX, EVERY, "bf16", 2, 64, "none", 1),
    (LLAMA, EVERY, "amp-bf16", 2, 64, "none", 1), (LLAMA, MLP, "amp-bf16", 2, 64, "none", 1),
    (LLAMA, EVERY, "amp-bf16", 4, 64, "none", 1), (LLAMA, EVERY, "amp-bf16", 2, 64, "selective", 1),
    (LLAMA, EVERY, "amp-bf16", 2, 64, "none", 2)])
def test_adapter_forward_equals_trace(cfg, targets, precision, batch, seq, recompute, grad_accum):
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    model, step, impl, ft = _case(cfg, targets, precision, batch, seq, recompute, grad_accum)
    t = trace_step(cfg, step, impl, finetune=ft)
    e = estimate(model, step, impl, finetune=ft)
    assert t.peak_op == "mul" and t.peak_module.endswith((".mlp.down_proj", ".mlp.dense_4h_to_h"))
    assert "adapter_forward" in e.peak.parts
    assert (e.peak_phase, e.peak_bytes) == ("forward", t.peak_logical_bytes)


@pytest.mark.slow  # two real LoRA optimizer steps and one trace, ~5 s
def test_adapter_forward_equals_a_real_step():
    """The loop the trace runs (trace/step.py), on real CPU tensors (tests/estimate/test_grad_accum_transient.py's
    pattern): tiny GPT-NeoX LoRA on every linear, amp-bf16 B1 S32, its live storages' peak == the trace == the
    estimate (AdamW's host step counters left out, as the trace leaves them out)."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from real_steps import real_step  # tests/estimate/real_steps.py
    from trainmem.trace import trace_step
    from trainmem.trace.finetune import apply_finetune

    model_spec, step, impl, ft = _case(NEOX, EVERY, "amp-bf16", 1, 32)
    peak, counters = real_step(NEOX, step, impl,
                               wrap=lambda model: apply_finetune(model, ft.for_model(model_spec), model_spec))
    e = estimate(model_spec, step, impl, finetune=ft)
    assert peak - counters == e.peak_bytes == trace_step(NEOX, step, impl, finetune=ft).peak_logical_bytes == 3_201_056

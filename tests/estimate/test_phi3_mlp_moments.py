"""estimate/block_backward.py: Phi-3's fused ``gate_up_proj`` MLP among the layouts whose last backward nodes are
moments (``Phi3MLP.forward``, transformers 5.24 modeling_phi3.py: gate_up_proj, chunk, ``up * act(gate)``, down_proj).

Tiny Phi-3 (h64, F192, 4/2 heads, 2 layers, V256, 3 labels), AdamW, CPU fake-tensor traces. Before (estimate - trace),
--recompute none, fp32: seq-cls and token-cls B2 S32 −32,776 B (F128: −16,384 B at B1 S64 and B2 S32), the top being
the last block's MulBackward0 (the product's two gradients beside the down projection's); now equal, bf16 and
amp-bf16 unchanged (equal), lm unchanged (equal). --recompute full fp32 lm / seq-cls −57,352 → −24,576 B, then 0:
without the KV cache (checkpointing turns it off) V reaches SDPA as a view of qkv_proj's output, whose whole storage
the kernel keeps (estimate/rules_hf.py _llama_attention), not a (B, S, Akv·hd) cache copy."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainmem.estimate import estimate
from trainmem.estimate.block_backward import norm_backward_parts
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

PHI3 = dict(model_type="phi3", hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, num_labels=3, pad_token_id=0)
IMPL = ImplSpec(device="cpu", optimizer_impl="for-loop")


def _model(head):
    return replace(spec_from_hf_config(PHI3), head=head, num_labels=3)


def test_phi3_product_moment_as_integers():
    e = estimate(_model("seq-cls"), StepSpec(batch=2, seq=32, precision="fp32"), IMPL)
    residual = 2 * 32 * 64 * 4  # the block output's gradient (B, S, H) fp32: 16,384
    parts = norm_backward_parts(e.inventory, 1, residual)
    # MulBackward0 of up * act(gate): its two (B, S, F) gradients and the down projection's input gradient, beside
    # the residual gradient: 16,384 + 3 · (2 · 32 · 192 · 4) = 163,840; down_proj's weight gradient 192 · 64 · 4
    assert parts[0] == {"block_gradients": 49_152, "freed_activations": 65_536, "after_attention": 0,
                        "work": 16_384 + 3 * 49_152}


@pytest.mark.slow  # one fake-tensor trace each
@pytest.mark.parametrize("head", ["seq-cls", "token-cls", "lm"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "amp-bf16"])
def test_phi3_heads_equal_trace(head, precision):
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    step = StepSpec(batch=2, seq=32, precision=precision)
    t = trace_step(PHI3, step, IMPL, head=head)
    assert estimate(_model(head), step, IMPL).peak_bytes == t.peak_logical_bytes


@pytest.mark.parametrize("cache,saved", [
    (True, ("q_rope", 64 * 64 * 4), ),
    (False, ("qkv_proj.out", 64 * 128 * 4), )])
def test_phi3_value_without_cache_keeps_the_fused_output(cache, saved):
    from trainmem.estimate.activations import activation_inventory

    inv = activation_inventory(_model("lm"), StepSpec(batch=2, seq=32, precision="fp32"), IMPL, kv_cache=cache)
    attn = {i.name.rpartition("self_attn.")[2]: i.bytes for i in inv if "layers.0.self_attn." in i.name}
    # with the cache SDPA reads its (B, S, Akv·hd) copy of V (2 · 32 · 32 · 4 = 8,192); without it (checkpointing
    # turns it off) a view of qkv_proj's output: the whole (B, S, (A+2·Akv)·hd) storage, 2 · 32 · 128 · 4 = 32,768
    assert attn.get("v_cache") == (8_192 if cache else None)
    assert attn[saved[0]] == saved[1]


@pytest.mark.slow  # one fake-tensor trace each
@pytest.mark.parametrize("precision", ["fp32", "bf16", "amp-bf16"])
def test_phi3_full_recompute_equals_trace(precision):
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    step, impl = StepSpec(batch=2, seq=32, precision=precision), replace(IMPL, recompute="full")
    t = trace_step(PHI3, step, impl)
    # fp32 was 57,352 B under (the product moment), then 24,576 (V's cache-sized copy in place of the fused storage)
    assert estimate(_model("lm"), step, impl).peak_bytes == t.peak_logical_bytes

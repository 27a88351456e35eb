"""Eager backward moments of LayerNorm/GELU blocks and of autocast's weight casts (estimate/block_backward.py,
issue 13): GPT-NeoX's MLP (dense_h_to_4h, exact GELU, dense_4h_to_h) and fused query_key_value, its parallel
residual under autocast, the input projections' weight-cast moments of a Llama block under autocast, GPT-2's
MLP under autocast, and a checkpointed block's kept output.

Before, the tiny GPT-NeoX below (h128, F512, 2 layers, V128, SGD, B 1-2, S 32-96) read estimate/trace
0.92-0.99 (eager, fp32 / bf16 / amp-bf16, recompute none / full) and the tiny Llama (h512, 2 layers, V128)
under amp-bf16 S64 was 653,568 B under; estimate == trace to the byte at the peak now. GPT-NeoX amp-bf16 at
B 2 S 64-96 tops at the loss's forward, not a backward moment: tests/estimate/test_eager_moments_forward.py."""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.estimate.block_backward import norm_backward_parts
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

NEOX = dict(model_type="gpt_neox", hidden_size=128, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, vocab_size=128, max_position_embeddings=512)
LLAMA = dict(model_type="llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
GPT2 = dict(model_type="gpt2", n_embd=128, n_layer=2, n_head=4, vocab_size=128, n_positions=512)
H, F = 128, 512
R = 96 * H * 4  # B 1, S 96: the residual stream's gradient, fp32 (49,152 B)


def _moments(precision):
    e = estimate(spec_from_hf_config(NEOX), StepSpec(batch=1, seq=96, precision=precision, optimizer="sgd"),
                 ImplSpec(attention="sdpa", device="cpu"))
    return norm_backward_parts(e.inventory, 0, R)


def test_neox_moments_as_integers():
    gelu, down, up, qkv = _moments("fp32")
    prod, x = 96 * F * 4, R  # dense_4h_to_h's input (the GELU output, 196,608 B) and a (B, S, H) tensor
    down_g, up_g = F * H * 4 + H * 4, H * F * 4 + F * 4  # weight and bias gradients: 262,656 and 264,192
    # GeluBackward0: its input gradient (dense_4h_to_h's input gradient) and output beside the residual
    # gradient; the GELU output (dense_4h_to_h's saved input) and the block output (residual_mlp) freed
    assert gelu == {"block_gradients": down_g, "freed_activations": prod + R, "after_attention": 0,
                    "work": R + 2 * prod}
    # the end of dense_4h_to_h's AddmmBackward0: its saved input still held, its input gradient made
    assert down == {"block_gradients": down_g, "new_gradients": down_g, "freed_activations": R,
                    "after_attention": 0, "work": R + prod}
    # the end of dense_h_to_4h's: the GELU's output (its output gradient) and its input gradient; the MLP's
    # two (B, S, F) tensors freed, the norm's output (its saved input) held
    assert up == {"block_gradients": down_g + up_g, "accum_new_gradients": up_g,
                  "freed_activations": 2 * prod + R, "after_attention": 0, "work": R + prod + x}
    # the end of query_key_value's: its output gradient (B·S·3H) and input gradient; every gradient of the
    # block but the input norm's (post-attention norm 2·H·4, dense H·H·4 + H·4, qkv 3H·H·4 + 3H·4)
    qkv_g = 3 * H * H * 4 + 3 * H * 4
    assert qkv["block_gradients"] == down_g + up_g + 2 * H * 4 + H * H * 4 + H * 4 + qkv_g
    assert qkv["accum_new_gradients"] == qkv_g and qkv["after_attention"] == 1
    assert qkv["work"] == R + x + 3 * x


def test_neox_autocast_moments_as_integers():
    gelu, cast, up, qkv = _moments("amp-bf16")
    prod = 96 * F * 2  # the bf16 GELU output (98,304 B)
    # the parallel residual: the bf16 sum of the two branches gets the fp32 gradient cast to bf16, which
    # waits for the attention's backward through the MLP's (B·S·H·2)
    pending = 96 * H * 2
    down_w, down_copy = F * H * 4, F * H * 2  # dense_4h_to_h's fp32 weight gradient and bf16 weight copy
    assert gelu["work"] == R + pending + 2 * prod
    assert gelu["freed_activations"] == prod + R + down_copy  # the GELU output, residual_mlp, the copy
    # the weight copy's ToCopyBackward0: its bf16 weight and bias (H·2) gradients, dense_4h_to_h's input
    # gradient; the fp32 bias gradient is not made yet
    assert cast == {"block_gradients": down_w, "new_gradients": down_w, "freed_activations": prod + R + down_copy,
                    "after_attention": 0, "work": R + pending + down_copy + H * 2 + prod}
    # dense_h_to_4h's weight cast: the norm output's fp32 gradient (its input copy's cast) beside its bf16
    # weight and bias (F·2) gradients; its copies (weight F·H·2, input B·S·H·2) and the MLP's tensors freed
    assert up["work"] == R + pending + R + F * H * 2 + F * 2 and up["accum_new_gradients"] == H * F * 4
    assert up["freed_activations"] == 2 * prod + down_copy + R + F * H * 2 + 96 * H * 2
    # query_key_value's weight cast: the norm output's fp32 gradient, the bf16 weight and bias gradients
    assert qkv["work"] == 2 * R + 3 * H * H * 2 + 3 * H * 2 and qkv["accum_new_gradients"] == 3 * H * H * 4


def test_llama_autocast_projection_casts_as_integers():
    """Llama under amp-bf16 (B 1, S 64): q_proj's and gate_proj's weight casts after their MmBackward0
    released their copies; the norm output's fp32 gradient (the input-copy casts summed: q's, k's and v's;
    gate's and up's) and the bf16 weight gradient beside the new fp32 one."""
    e = estimate(spec_from_hf_config(LLAMA), StepSpec(batch=1, seq=64, precision="amp-bf16", optimizer="sgd"),
                 ImplSpec(attention="sdpa", device="cpu"))
    r = 64 * 512 * 4  # 131,072 B
    q, gate, up = (m for m in norm_backward_parts(e.inventory, 0, r) if m.get("accum_new_gradients"))
    assert q["accum_new_gradients"] == 512 * 512 * 4 and q["work"] == r + r + 512 * 512 * 2
    assert gate["accum_new_gradients"] == 1024 * 512 * 4 and gate["work"] == r + r + 1024 * 512 * 2
    # the MLP's gradients only (down, up 2·1024·512·4 and gate's): the attention's backward has not run
    assert gate["block_gradients"] == 3 * 1024 * 512 * 4 and gate["after_attention"] == 0
    # up_proj's cast, before gate's node: MulBackward0's bf16 gradient for the SiLU branch (64·1024·2) waits, gate's
    # copies (weight 1024·512·2, input 64·512·2) and output (SiLU's saved input) are still held, gate has no gradient
    gate_out = 64 * 1024 * 2
    assert up["accum_new_gradients"] == 1024 * 512 * 4 and up["block_gradients"] == 2 * 1024 * 512 * 4
    assert up["work"] == r + r + gate_out + 1024 * 512 * 2
    assert gate["freed_activations"] - up["freed_activations"] == 1024 * 512 * 2 + 64 * 512 * 2 + gate_out


def test_gpt2_autocast_c_proj_cast_bias_first():
    """GPT-2 amp-bf16 (B 1, S 64): c_proj's ``torch.addmm(bias, x, weight)`` casts its bias copy back before
    its weight copy (the traces' order: the autocast wrapper's argument order), so at the weight's cast the
    fp32 bias gradient exists and the bf16 one was freed; the product moment is read past the bf16 copies."""
    e = estimate(spec_from_hf_config(GPT2), StepSpec(batch=1, seq=64, precision="amp-bf16", optimizer="sgd"),
                 ImplSpec(attention="sdpa", device="cpu"))
    r = 64 * H * 4  # 32,768 B
    prod, cast = norm_backward_parts(e.inventory, 1, r)
    assert prod["work"] == r + 3 * 64 * F * 2  # c_proj's input gradient and the product's two, bf16
    # the new fp32 weight and bias gradients; the bf16 weight gradient (F·H·2) and c_proj's input gradient
    assert cast == {"block_gradients": F * H * 4 + H * 4, "new_gradients": F * H * 4 + H * 4,
                    "freed_activations": prod["freed_activations"], "after_attention": 0,
                    "work": r + F * H * 2 + 64 * F * 2}


def test_checkpointed_first_block_frees_its_kept_output():
    """--recompute full, Llama bf16, 2 blocks (B 1, S 32): block 0 keeps its output (32·512·2 B) as block 1's
    checkpoint input, which its recomputation does not make (block 1's RMSNorm saves its own fp32 copy);
    block 1's first node released it, so every moment of block 0 has it freed. The checkpoint's frame still
    holds the rotary cos/sin at the input norm's moment (was 16,128 B over the trace: 32,768 B kept, 16,640 B
    of cos/sin and position ids freed)."""
    from trainmem.estimate.activations import activation_inventory

    step = StepSpec(batch=1, seq=32, precision="bf16", optimizer="sgd")
    model = spec_from_hf_config(LLAMA)
    e = estimate(model, step, ImplSpec(attention="sdpa", device="cpu", recompute="full"))
    plain = activation_inventory(model, step, ImplSpec(attention="sdpa", device="cpu"), kv_cache=False)
    with_rec = norm_backward_parts(e.inventory, 0, 32 * 512 * 2, plain)
    eager = norm_backward_parts(estimate(model, step, ImplSpec(attention="sdpa", device="cpu")).inventory, 0,
                                32 * 512 * 2)
    assert [m["freed_activations"] - n["freed_activations"] for m, n in zip(with_rec, eager)] == [32 * 512 * 2] * 6
    assert with_rec[-2]["after_attention"] == 0 and eager[-2]["after_attention"] == 1  # the input norm's


#: (config, precision, batch, seq, recompute, the trace's top): each new moment as the step's top, and how
#: far under (or over) the trace the estimate was before (B)
CASES = [
    (NEOX, "fp32", 1, 96, "none", "gpt_neox.layers.0.post_mlp_dropout"),  # dense_4h_to_h's end: 151,560
    (NEOX, "fp32", 1, 96, "full", "gpt_neox.layers.0.mlp.act"),  # GELU, the recomputed qkv output: 311,816
    (NEOX, "bf16", 1, 96, "none", "gpt_neox.layers.0.post_mlp_dropout"),  # 75,016
    (NEOX, "bf16", 1, 96, "full", "gpt_neox.layers.0.mlp.act"),  # 155,912
    (NEOX, "amp-bf16", 1, 96, "none", "gpt_neox.layers.1.post_mlp_dropout"),  # dense_4h_to_h's cast: 41,224
    (NEOX, "amp-bf16", 1, 96, "full", "gpt_neox.layers.0.post_mlp_dropout"),  # 155,912
    (NEOX, "fp32", 1, 64, "none", "gpt_neox.layers.0.attention.query_key_value"),  # qkv's end: 130,560
    (NEOX, "fp32", 1, 64, "full", "gpt_neox.layers.0.mlp.dense_h_to_4h"),  # dense_h_to_4h's end: 164,352
    (NEOX, "amp-bf16", 1, 32, "none", "gpt_neox.layers.0.attention.query_key_value"),  # qkv's cast: 64,000
    (NEOX, "amp-bf16", 1, 64, "none", "gpt_neox.layers.0.mlp.dense_h_to_4h"),  # dense_h_to_4h's cast: 115,712
    (LLAMA, "amp-bf16", 1, 64, "none", "model.layers.0.self_attn.q_proj"),  # q_proj's cast: 653,568
    (LLAMA, "amp-bf16", 1, 64, "full", "model.layers.0.self_attn.q_proj"),  # 719,616
    ({**LLAMA, "model_type": "qwen2"}, "amp-bf16", 2, 32, "none", "model.layers.0.self_attn.q_proj"),  # 652,544
    (LLAMA, "amp-bf16", 2, 64, "none", "model.layers.0.mlp.gate_proj"),  # gate_proj's cast: 1,048,576
    (LLAMA, "amp-bf16", 2, 96, "full", "model.layers.0.mlp.gate_proj"),  # 524,288
    ({**LLAMA, "model_type": "qwen2"}, "amp-bf16", 2, 96, "none", "model.layers.0.mlp.gate_proj"),  # 524,288
    # GPT-2 under autocast and full recompute: its gelu_new product's moment with the bf16 copies (read without
    # them) and c_proj's weight cast, bias cast first (Conv1D's addmm(bias, x, weight)): 164,360, 33,288
    (GPT2, "amp-bf16", 2, 64, "full", "transformer.h.0.mlp.act"),
    ({**GPT2, "vocab_size": 1000}, "amp-bf16", 1, 128, "full", "transformer.h.0.mlp.act"),
    # the first block's norms under full recompute, over before (B): 262,144, 16,128, 146,688, 97,792
    ({**LLAMA, "vocab_size": 1000}, "bf16", 1, 256, "full", "model.layers.0.post_attention_layernorm"),
    (LLAMA, "bf16", 1, 32, "full", "model.layers.0.input_layernorm"),
    (LLAMA, "bf16", 2, 96, "full", "model.layers.0.input_layernorm"),
    ({**LLAMA, "model_type": "qwen2"}, "bf16", 2, 64, "full", "model.layers.0.input_layernorm"),
    # up_proj's weight-copy cast, before gate_proj's (h64, F176, 4/2 heads): 4,096 B under before
    ({**LLAMA, "hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 4}, "amp-bf16", 1, 32, "full",
     "model.layers.0.mlp.up_proj"),
    ({**LLAMA, "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 4},
     "amp-bf16", 1, 32, "full", "model.layers.0.mlp.up_proj"),
]


@pytest.mark.slow  # one fake-tensor trace each, ~0.3-2 s
@pytest.mark.parametrize("cfg,precision,batch,seq,recompute,top", CASES)
def test_estimate_equals_trace(cfg, precision, batch, seq, recompute, top):
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    step = StepSpec(batch=batch, seq=seq, precision=precision, optimizer="sgd")
    impl = ImplSpec(attention="sdpa", device="cpu", recompute=recompute)
    t, e = trace_step(cfg, step, impl), estimate(spec_from_hf_config(cfg), step, impl)
    assert t.peak_module == top
    assert e.peak_bytes == t.peak_logical_bytes, (e.peak_phase, e.peak_bytes, t.peak_logical_bytes)

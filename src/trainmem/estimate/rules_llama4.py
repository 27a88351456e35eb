"""The ``hf`` rules for Llama-4 text (transformers 5.x ``models/llama4/modeling_llama4.py``).

What differs from the Llama rules (``rules_hf.py``):

* RoPE is one complex64 (1, S, hd/2) table (``Llama4TextRotaryEmbedding``: ``torch.polar``);
  ``apply_rotary_emb`` multiplies ``view_as_complex(x.float())`` by it (the complex product keeps
  the table) and casts the fp32 result back (``type_as``);
* RoPE blocks normalize q and k per head with a weightless L2 norm (``Llama4TextL2Norm``, with
  ``use_qk_norm``): keeps the fp32 input and rsqrt; NoPE blocks (``no_rope_layers``) scale q by
  ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1`` (``attn_temperature_tuning``): the
  product keeps the (1, S, 1, 1) fp32 scales;
* q reaches attention as a transpose of (B, S, A, hd): eager attention copies it for the matmul;
  the eager softmax runs in the scores' dtype (``eager_attention_forward``);
* chunked blocks get SDPA an explicit mask once S reaches ``attention_chunk_size``
  (``create_chunked_causal_mask``; ``estimate/attention.py`` ``window_mask``);
* MoE blocks (``Llama4TextMoe``) run every token through every expert: the router keeps its
  top-k indices (``scatter_``) and the fp32 sigmoid of the scattered scores (``Llama4Router``);
  ``routed_in = x.repeat(E, 1) * scores``, then ``bmm`` experts (``Llama4TextExperts``): every
  routed tensor has E·B·S rows whatever the routing; a shared expert (a dense MLP) adds in place.

Checked against autograd's saved set in ``tests/estimate/test_rules_hybrid.py``.
"""

from __future__ import annotations

from contextlib import nullcontext

from trainmem.estimate.attention import attention_core, resolve_kernel, window_mask
from trainmem.estimate.ctx import Ctx, promote
from trainmem.estimate.graph import Sym
from trainmem.estimate.rules_hf_masks import _checkpoint_extras
from trainmem.estimate.rules_hf_parts import (_embedding, _gated_mlp, _head, _layers, _loss, _policy, _qkv_proj,
                                              _rmsnorm)
from trainmem.specs.layer_kind import LayerKind

__all__ = ["llama4_forward"]


def llama4_forward(ctx: Ctx) -> None:
    g, m = ctx.graph, ctx.model
    x = _embedding(ctx, "model.embed_tokens")
    with g.module("model.rotary_emb"):
        freqs = g.new("freqs_cis", (1, ctx.S, m.head_dim // 2), ("1", "S", "hd/2"), "complex64", False)
    kernel = resolve_kernel(ctx)
    held = _checkpoint_extras(ctx, kernel, x.dtype)  # position ids; eager: the causal mask
    # checkpoints of chunked blocks hold create_chunked_causal_mask's mask, materialized over the batch
    # (unlike the expanded sliding-window mask): boolean for SDPA, additive in x's dtype for eager
    chunked = g.new("model.chunked_mask", (ctx.B, 1, ctx.S, ctx.S), ("B", "1", "S", "S"),
                    x.dtype if kernel == "eager" else "bool", False)
    on_chunks = held[:-1] + [chunked] if kernel == "eager" and held else held + [chunked]

    def layer(i: int, x: Sym) -> Sym:
        kind = m.kind(i)
        masked = kernel != "eager" and window_mask(ctx, kind)
        k_i = resolve_kernel(ctx, masked) if masked else kernel
        mine = on_chunks if masked or (kernel == "eager" and kind.attention == "chunked") else held
        if ctx.impl.checkpointed(i):
            with g.checkpoint(x, freqs, *mine, policy=_policy(ctx)):
                return _layer(ctx, x, freqs, kind, k_i, masked)
        # selective checkpoints the attention function: Llama4TextDecoderLayer does not pass
        # position_ids on, so it holds only the mask it is handed
        return _layer(ctx, x, freqs, kind, k_i, masked, [t for t in mine if t.dtype != "int64"])

    x = _layers(ctx, "model.layers.", x, layer)
    h = _rmsnorm(ctx, x, "model.norm")
    _loss(ctx, _head(ctx, h, "lm_head"))


def _layer(ctx: Ctx, x: Sym, freqs: Sym, kind: LayerKind, kernel: str, masked: bool, held: list[Sym] = ()) -> Sym:
    g, m = ctx.graph, ctx.model
    B, S, hd = ctx.B, ctx.S, m.head_dim
    h = _rmsnorm(ctx, x, "input_layernorm")
    with g.module("self_attn"):
        q, k, v = _qkv_proj(ctx, h)
        q = Sym(q.name, (B, S, m.num_heads, hd), ("B", "S", "A", "hd"), q.dtype, q.requires_grad, seq=q.seq)
        k = Sym(k.name, (B, S, m.num_kv_heads, hd), ("B", "S", "Akv", "hd"), k.dtype, k.requires_grad, seq=k.seq)
        if kind.rope:
            g.save(freqs, when=q.requires_grad or k.requires_grad)  # the complex product keeps the table
            q, k = (ctx.cast(g.new(f"{n}_rope", t.shape, t.dims, "float32", t.requires_grad), t.dtype, f"{n}_rope_cast")
                    for t, n in ((q, "q"), (k, "k")))
            if m.qk_norm:
                q, k = _l2norm(ctx, q, "q_norm"), _l2norm(ctx, k, "k_norm")
        elif m.attn_temperature_tuning:
            scales = g.new("attn_scales", (1, S, 1, 1), ("1", "S", "1", "1"), "float32", False)
            g.save(scales, when=q.requires_grad)
            q = ctx.cast(g.new("q_scaled", q.shape, q.dims, promote(q.dtype, "float32"), q.requires_grad), q.dtype,
                         "q_scaled_cast")
        # the KV cache's torch.cat hands attention fresh copies of K and V (as in rules_hf._llama_layer)
        k = g.new("k_cache", k.shape, k.dims, k.dtype, k.requires_grad)
        v = g.new("v_cache", (B, S, m.kv_size), ("B", "S", "Akv·hd"), v.dtype, v.requires_grad)
        with g.checkpoint(q, k, v, *held) if ctx.impl.recompute == "selective" else nullcontext():
            o = attention_core(ctx, q, k, v, kernel=kernel, gqa_native=kernel != "eager" and hd <= 256,
                               softmax_fp32=False, masked=masked, q_copy=kernel in ("eager", "math"))
        with g.module("o_proj"):
            a = ctx.linear(o, m.hidden_size, "H", weight=(m.hidden_size, m.q_size), bias=m.out_bias)
    x = ctx.add(x, a, "residual_attn")
    h = _rmsnorm(ctx, x, "post_attention_layernorm")
    with g.module("feed_forward"):
        y = _moe(ctx, h) if kind.mlp == "moe" else _gated_mlp(ctx, h)
    return ctx.add(x, y, "residual_mlp")


def _l2norm(ctx: Ctx, x: Sym, name: str) -> Sym:
    """``Llama4TextL2Norm``: ``(x.float() * rsqrt(mean(x²) + eps)).type_as(x)``; keeps the fp32
    input and rsqrt (per head), no weight."""
    g = ctx.graph
    with g.module(name):
        x32 = ctx.cast(x, "float32", "x_fp32")
        rs = g.new("rsqrt", x.shape[:-1] + (1,), x.dims[:-1] + ("1",), "float32", x.requires_grad)
        g.save(x32, rs, when=x.requires_grad)
        return ctx.cast(g.new("normed", x.shape, x.dims, "float32", x.requires_grad), x.dtype, "out")


def _moe(ctx: Ctx, h: Sym) -> Sym:
    """``Llama4TextMoe``: sigmoid top-k router, every token through every expert (E·B·S rows), shared expert."""
    g, m = ctx.graph, ctx.model
    H, E, k, F = m.hidden_size, m.num_experts, m.top_k, m.expert_ffn_size
    T = ctx.B * ctx.S
    with g.module("router"):
        logits = ctx.linear(h, E, "E", weight=(E, H))
        # topk's values and indices (an op-level policy keeps both); scatter_ keeps the index
        g.new("top_val", (T, k), ("B·S", "k"), logits.dtype, logits.requires_grad, op="topk")
        g.save(g.new("top_idx", (T, k), ("B·S", "k"), "int64", False, op="topk"))
        sig = g.new("sigmoid", (T, E), ("B·S", "E"), "float32", logits.requires_grad)  # sigmoid keeps its output
        g.save(sig)
        scores = ctx.cast(sig, logits.dtype, "scores")
    ET, ETs = E * T, "E·B·S"
    # router_scores.transpose(0, 1).reshape(-1, 1) copies; routed_in = x.repeat(E, 1) * that column
    col = g.new("scores_col", (ET, 1), (ETs, "1"), scores.dtype, scores.requires_grad)
    rep = g.new("routed_repeat", (ET, H), (ETs, "H"), h.dtype, h.requires_grad)
    routed = ctx.mul(rep, col, "routed_in", shape=(ET, H), dims=(ETs, "H"))
    with g.module("experts"):  # bmm keeps its inputs: routed_in, then act(gate) * up
        low = ctx.low  # bmm is on autocast's lower-precision list: it keeps the casts, the weights' too
        x_in = ctx.cast(routed, low, "routed_in_cast") if low else routed
        if low:
            g.save(g.new("gate_up_proj_cast", (E, H, 2 * F), ("E", "H", "2Fe"), low),
                   g.new("down_proj_cast", (E, F, H), ("E", "Fe", "H"), low))
        gu = g.new("gate_up", (E, T, 2 * F), ("E", "B·S", "2Fe"), x_in.dtype, op="bmm")  # gate, up: views of it
        act = g.new("act", (E, T, F), ("E", "B·S", "Fe"), x_in.dtype)
        prod = g.new("act_mul_up", (E, T, F), ("E", "B·S", "Fe"), x_in.dtype)
        g.save(x_in, gu, act, prod)
        g.new("down", (E, T, H), ("E", "B·S", "H"), x_in.dtype, op="bmm")  # an op-level policy may keep it
    with g.module("shared_expert"):
        shared = _gated_mlp(ctx, h, (m.num_shared_experts * F, "Es·Fe"))  # one expert wide
    return shared  # out.add_(routed sum): in place, keeps nothing

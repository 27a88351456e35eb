"""The ``hf`` rules for gpt-oss (transformers 5.x ``models/gpt_oss/modeling_gpt_oss.py``).

What differs from the Llama rules (``rules_hf.py``):

* attention is eager only (``GptOssPreTrainedModel._supports_sdpa = False``) and concatenates a
  learned sink logit per head to the scores (``eager_attention_forward``): the softmax keeps
  (B, A, S, S+1) in the scores' dtype, the max-subtraction keeps its (B, A, S, 1) int64 indices;
  sliding and full blocks differ only in the additive mask, which keeps nothing;
* RoPE rotates halves with a (1, 1, S, hd/2) table (``_apply_rotary_emb``: chunk, mul, cat);
* ``GptOssRMSNorm`` multiplies by the weight in fp32 and casts last;
* the MoE MLP (``GptOssMLP``): a biased router, top-k then a softmax over the k values
  (``GptOssTopKRouter``), and ``grouped_mm`` experts with biases and the clamped SwiGLU
  ``(clamp(up) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate, max=limit)``
  (``GptOssExperts._apply_gate``; ``integrations/moe.py`` ``grouped_mm_experts_forward``).

Every routed tensor has B·S·k rows, so the total does not depend on the routing assumption.
Checked against autograd's saved set in ``tests/estimate/test_rules_hybrid.py``. Under
``recompute='op'`` (torchtitan's policy) the ops are tagged: the addmm projections, both eager bmm's,
the router's topk; ``max(dim=-1)`` and ``_grouped_mm`` are not on the policy's list
(``tests/estimate/test_gpt_oss_op_recompute.py``).
"""

from __future__ import annotations

from contextlib import nullcontext

from trainmem.errors import UnsupportedError
from trainmem.estimate.ctx import Ctx, promote
from trainmem.estimate.graph import Sym
from trainmem.estimate.rules_hf_masks import _checkpoint_extras
from trainmem.estimate.rules_hf_parts import _embedding, _head, _layers, _loss, _policy, _qkv_proj, _rmsnorm

__all__ = ["gpt_oss_forward"]


def gpt_oss_forward(ctx: Ctx) -> None:
    g, m = ctx.graph, ctx.model
    if ctx.impl.attention != "eager":  # the SDPA kernels are refused before (rules_hf._refuse_sdpa)
        raise UnsupportedError(f"{m.name}: gpt_oss: its flash attention (a hub kernel that takes the sinks) is not "
                               "modelled; estimate it with --attention eager (as --profile traced and trainmem "
                               "trace run it)")
    x = _embedding(ctx, "model.embed_tokens")
    with g.module("model.rotary_emb"):  # GptOssRotaryEmbedding: cos/sin of hd/2 frequencies, in x's dtype
        rot, dims = (1, 1, ctx.S, m.head_dim // 2), ("1", "1", "S", "hd/2")
        cos, sin = g.new("cos", rot, dims, x.dtype, False), g.new("sin", rot, dims, x.dtype, False)
    held = _checkpoint_extras(ctx, "eager", x.dtype)  # position ids and the eager causal mask
    sliding = held
    if held and any(k.attention == "sliding" for k in m.kinds):
        # sliding blocks get (and their checkpoints hold) create_sliding_window_causal_mask's mask instead
        sliding = held[:-1] + [g.new("model.sliding_window_mask", (ctx.B, 1, ctx.S, ctx.S), ("B", "1", "S", "S"),
                                     x.dtype, False)]

    def layer(i: int, x: Sym) -> Sym:
        mine = sliding if m.kind(i).attention == "sliding" else held
        if ctx.impl.checkpointed(i):
            with g.checkpoint(x, cos, sin, *mine, policy=_policy(ctx)):
                return _layer(ctx, x, cos, sin)
        # selective checkpoints the attention function: it gets the position ids (GptOssDecoderLayer passes
        # them on, GptOssAttention.forward hands **kwargs to attention_interface) and its block's mask
        return _layer(ctx, x, cos, sin, mine)

    x = _layers(ctx, "model.layers.", x, layer)
    h = _rmsnorm(ctx, x, "model.norm", cast_last=True)
    _loss(ctx, _head(ctx, h, "lm_head"))


def _layer(ctx: Ctx, x: Sym, cos: Sym, sin: Sym, held: list[Sym] = ()) -> Sym:
    g, m = ctx.graph, ctx.model
    H, qs = m.hidden_size, m.q_size
    h = _rmsnorm(ctx, x, "input_layernorm", cast_last=True)
    with g.module("self_attn"):
        q, k, v = _qkv_proj(ctx, h)
        # first*cos - second*sin, second*cos + first*sin: the muls keep the table, cat makes q and k anew
        g.save(cos, sin, when=q.requires_grad or k.requires_grad)
        q = g.new("q_rope", (ctx.B, m.num_heads, ctx.S, m.head_dim), ("B", "A", "S", "hd"),
                  promote(q.dtype, cos.dtype), q.requires_grad)
        k = g.new("k_rope", (ctx.B, m.num_kv_heads, ctx.S, m.head_dim), ("B", "Akv", "S", "hd"),
                  promote(k.dtype, cos.dtype), k.requires_grad)
        with g.checkpoint(q, k, v, *held) if ctx.impl.recompute == "selective" else nullcontext():
            o = _sink_attention(ctx, q, k, v)
        with g.module("o_proj"):
            a = ctx.linear(o, H, "H", weight=(H, qs), bias=m.out_bias)
    x = ctx.add(x, a, "residual_attn")
    h = _rmsnorm(ctx, x, "post_attention_layernorm", cast_last=True)
    with g.module("mlp"):
        y = _moe(ctx, h)
    return ctx.add(x, y, "residual_mlp")


def _sink_attention(ctx: Ctx, q: Sym, k: Sym, v: Sym) -> Sym:
    """``eager_attention_forward`` with sinks: (B, A, S, hd) heads in, (B, S, A·hd) out."""
    g, m = ctx.graph, ctx.model
    B, S, A, hd = ctx.B, ctx.S, m.num_heads, m.head_dim
    heads, hdims = (B, A, S, hd), ("B", "A", "S", "hd")
    low = ctx.low  # matmul is on autocast's lower-precision list
    rg = q.requires_grad or k.requires_grad or v.requires_grad
    qm = ctx.cast(q, low, "q_cast") if low else q
    # repeat_kv, then matmul's reshape of the transposed K: a fresh heads-wide copy either way
    kt = g.new("k_t", heads, hdims, low or k.dtype, k.requires_grad)
    # matmul folds the heads into aten.bmm: an op-level policy keeps its (B·A, S, S) output
    g.new("scores", (B, A, S, S), ("B", "A", "S", "S"), qm.dtype, rg, op="bmm")
    g.save(qm, when=kt.requires_grad)
    g.save(kt, when=qm.requires_grad)
    # scores * scaling + mask (in the embedding dtype) ++ sinks (a parameter): type promotion
    sdtype = promote(promote(qm.dtype, ctx.param), ctx.param)
    with_sink, sdims = (B, A, S, S + 1), ("B", "A", "S", "S+1")
    g.save(g.new("max_idx", (B, A, S, 1), ("B", "A", "S", "1"), "int64", False), when=rg)  # amax over keys
    probs = g.new("softmax", with_sink, sdims, sdtype, rg)  # softmax(dtype=combined.dtype) keeps its output
    g.save(probs, when=rg)
    # probs[..., :-1] is a view; .to(value_states.dtype) copies only when the dtypes differ
    pv_dtype = low or v.dtype
    pv_in = probs if pv_dtype == probs.dtype else g.new("probs_cast", (B, A, S, S), ("B", "A", "S", "S"), pv_dtype, rg)
    vv = g.new("v_repeat", heads, hdims, low or v.dtype, v.requires_grad)
    g.save(pv_in, when=vv.requires_grad)
    g.save(vv, when=rg)
    g.new("pv", heads, hdims, vv.dtype, rg, op="bmm")
    return g.new("attn_out", (B, S, A * hd), ("B", "S", "A·hd"), vv.dtype, rg)  # transpose(1, 2).contiguous()


def _moe(ctx: Ctx, h: Sym) -> Sym:
    """``GptOssMLP``: router, top-k softmax, grouped_mm experts with biases and the clamped SwiGLU."""
    g, m = ctx.graph, ctx.model
    H, E, k, F = m.hidden_size, m.num_experts, m.top_k, m.expert_ffn_size
    T = ctx.B * ctx.S
    Tk, Tks = T * k, "B·S·k"
    with g.module("router"):
        logits = ctx.linear(h, E, "E", weight=(E, H), bias=True)
        # topk keeps its indices for backward; an op-level policy keeps both outputs (aten.topk is on
        # trace/recompute.py op_sac_context's save list; GptOssTopKRouter.forward: torch.topk(router_logits))
        g.new("top_val", (T, k), ("B·S", "k"), logits.dtype, logits.requires_grad, op="topk")
        g.save(g.new("top_idx", (T, k), ("B·S", "k"), "int64", False, op="topk"))
        # softmax(top values, dtype=their dtype) keeps its output
        scores = g.new("scores", (T, k), ("B·S", "k"), logits.dtype, logits.requires_grad)
        g.save(scores)
    with g.module("experts"):
        # grouped_mm_experts_forward: hidden_states[perm // k], sample_weights[perm], the bias gathers
        # by the sorted expert ids, weighted_out[inv_perm]: four (B·S·k,) int64 indices, int32 offsets
        g.save(*(g.new(n, (Tk,), (Tks,), "int64", False) for n in ("token_idx", "perm", "expert_ids", "inv_perm")),
               g.new("offsets", (E,), ("E",), "int32", False))
        act = ctx.param  # _grouped_mm casts the input to the weights' dtype
        x_in = g.new("gathered", (Tk, H), (Tks, "H"), act)
        gu = g.new("gate_up", (Tk, 2 * F), (Tks, "2Fe"), act)  # both clamps keep views of it
        half, hdims = (Tk, F), (Tks, "Fe")
        sig = g.new("sigmoid", half, hdims, act)
        gate = g.new("gate_clamped", half, hdims, act)
        up1 = g.new("up_plus_one", half, hdims, act)
        glu = g.new("glu", half, hdims, act)
        gated = g.new("gated", half, hdims, act)
        down = g.new("down", (Tk, H), (Tks, "H"), act)
        w = g.new("weights", (Tk, 1), (Tks, "1"), scores.dtype)
        g.save(x_in, gu, sig, gate, up1, glu, gated, down, w)
    return g.new("moe_out", h.shape, h.dims, h.dtype)

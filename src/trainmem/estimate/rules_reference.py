"""The ``reference`` profile: what trainmem's own reference decoder keeps for backward.

Follows ``trainmem/models/reference.py`` op by op; checked to the byte against saved-tensor
hooks and live-storage tracking on CPU in ``tests/estimate/test_reference_groundtruth.py``.
Item names are the model's module paths (``layers.0.attn.q``, ``layers.0.mlp.down``, ...).

Known limitations: CUDA-only paths (``device="cuda"``: bool dropout masks, ``_fused_rms_norm``,
CUDA flash / memory-efficient SDPA, fp32 statistics in ``native_layer_norm``) follow the
kernels' documented saved sets but are not measured by the CPU tests; MoE, QK-norm and
encoder models are refused, as the reference model refuses them.
"""

from __future__ import annotations

from trainmem.estimate.ctx import Ctx, promote
from trainmem.estimate.graph import Sym
from trainmem.estimate.loss_value import loss_value
from trainmem.estimate.symbols import render
from trainmem.models.reference import check_supported
from trainmem.names import EMBEDDING_INDICES, EMBEDDING_OUTPUT, embedding_output

__all__ = ["reference_forward"]


def reference_forward(ctx: Ctx) -> None:
    """Every tensor the reference model keeps during one forward + loss (``input_ids`` is
    added by the caller: the token embedding keeps exactly that storage)."""
    g, m = ctx.graph, ctx.model
    check_supported(m, ctx.impl)
    H = m.hidden_size
    x = g.new(embedding_output("embed"), (ctx.B, ctx.S, H), ("B", "S", "H"), ctx.param)
    cos = sin = None
    # Reference.forward makes the position ids (torch.arange(S)) and the rotary tables itself: they are
    # the root's (measured names are the innermost module running its forward)
    if m.max_positions:
        ids = g.new(EMBEDDING_INDICES, (ctx.S,), ("S",), "int64")
        with g.module("pos_embed"):
            g.save(ids)
            pos = g.new(EMBEDDING_OUTPUT, (ctx.S, H), ("S", "H"), ctx.param)
        x = ctx.add(x, pos, "embed_sum")
    else:  # rotary tables, built per step in the embedding dtype
        cos = g.new("cos", (ctx.S, m.head_dim), ("S", "hd"), ctx.param)
        sin = g.new("sin", (ctx.S, m.head_dim), ("S", "hd"), ctx.param)
    x = _dropout(ctx, x, m.embd_dropout, "embed_dropout")
    for i in range(m.num_layers):
        with g.module(f"layers.{i}"):
            if ctx.impl.checkpointed(i):
                with g.checkpoint(*(t for t in (x, cos, sin) if t is not None)):
                    x = _block(ctx, x, cos, sin)
            else:
                x = _block(ctx, x, cos, sin)
    h = _norm(ctx, x, "norm")
    with g.module("lm_head"):
        ctx.linear(h, m.vocab_size, "V", weight=(m.vocab_size, H))
    with g.module("loss"):  # F.cross_entropy(logits.float(), shifted labels): log_softmax + nll_loss
        B, S = ctx.B, ctx.S
        # the target is F.pad(labels, (0, 1))[:, 1:].reshape(-1): at B=1 the slice is contiguous (a
        # size-1 dim's stride does not count), so reshape is a view and the padded (S+1) storage is kept;
        # from B=2 reshape copies it into B·S. The padded labels come first
        shape, dims = ((S + 1,), ("S+1",)) if B == 1 else ((B * S,), ("B·S",))
        target = g.new("target", shape, dims, "int64")
        lsm = g.new("log_softmax", (B * S, m.vocab_size), ("B·S", "V"), "float32")
        loss_value(g, "float32")  # nll_loss's output, before its total weight (estimate/loss_value.py)
        g.save(lsm, target, g.new("total_weight", (), (), "float32"))


# --- kernels -----------------------------------------------------------------------------

def _dropout(ctx: Ctx, x: Sym, p: float, label: str) -> Sym:
    """``F.dropout`` (see :meth:`Ctx.dropout`), or with ``fused_dropout`` the reference model's
    packed-bit dropout: a ``uint8`` mask of ⌈n/8⌉ bytes."""
    if p <= 0:
        return x
    if not ctx.impl.fused_dropout:
        return ctx.dropout(x, p, label)
    g = ctx.graph
    g.save(g.new(f"{label}_bits", (-(-x.numel // 8),), (f"⌈{render(x.dims)}/8⌉",), "uint8"))
    return g.new(label, x.shape, x.dims, x.dtype)


def _norm(ctx: Ctx, x: Sym, name: str) -> Sym:
    """Fused: ``F.layer_norm`` (``native_layer_norm``: input, mean, rstd) or ``F.rms_norm``
    (CUDA ``_fused_rms_norm``: input, fp32 rstd; on CPU a composite like the python one,
    but keeping the fp32 normalized tensor). Python composites run in fp32 and keep the
    fp32 input (RMS) or centred input (LayerNorm), rsqrt, and the normalized tensor cast back."""
    g, m = ctx.graph, ctx.model
    stat_shape, stat_dims = x.shape[:-1] + (1,), x.dims[:-1] + ("1",)
    with g.module(name):
        if ctx.impl.fused_norm and m.norm == "layernorm":
            cuda = ctx.impl.device == "cuda"
            stat = "float32" if cuda or x.dtype != ctx.param else x.dtype
            g.save(x, g.new("mean", stat_shape, stat_dims, stat), g.new("rstd", stat_shape, stat_dims, stat))
            return g.new("out", x.shape, x.dims, x.dtype)
        if ctx.impl.fused_norm and ctx.impl.device == "cuda":  # _fused_rms_norm
            g.save(x, g.new("rstd", stat_shape, stat_dims, "float32"))
            return g.new("out", x.shape, x.dims, promote(x.dtype, ctx.param))
        x32 = ctx.cast(x, "float32", "x_fp32")
        if m.norm == "layernorm":
            x32 = g.new("centred", x.shape, x.dims, "float32")
        g.save(x32, g.new("rsqrt", stat_shape, stat_dims, "float32"))
        normed = g.new("normed", x.shape, x.dims, "float32")
        if ctx.impl.fused_norm:  # CPU F.rms_norm: weight multiplies in fp32, cast last
            g.save(normed)
            return g.new("out", x.shape, x.dims, x.dtype)
        nc = ctx.cast(normed, x.dtype, "normed_cast")
        g.save(nc)
        return g.new("out", x.shape, x.dims, promote(ctx.param, x.dtype))


def _rope(ctx: Ctx, x: Sym, cos: Sym, sin: Sym, label: str) -> Sym:
    """``x*cos + rotate_half(x)*sin``: keeps cos and sin (x needs grad, they do not)."""
    ctx.graph.save(cos, sin)
    return ctx.graph.new(label, x.shape, x.dims, promote(x.dtype, cos.dtype))


# --- attention -----------------------------------------------------------------------------

def _kernel(ctx: Ctx) -> str:
    """The SDPA backend that runs: ``sdpa`` lets PyTorch pick (CPU: flash, math with dropout;
    CUDA: flash for 16-bit, memory-efficient for fp32)."""
    kind, m = ctx.impl.attention, ctx.model
    named = {"eager": "eager", "sdpa-math": "math", "flash": "flash", "mem-efficient": "efficient"}
    if kind in named:
        return named[kind]
    if ctx.impl.device == "cpu":
        return "math" if m.attn_dropout > 0 else "flash"
    return "flash" if (ctx.low or ctx.param) != "float32" and m.head_dim <= 256 else "efficient"


def _attention_core(ctx: Ctx, q: Sym, k: Sym, v: Sym, kernel: str) -> Sym:
    """q (B, A, S, hd), k and v (B, Akv, S, hd) -> the o projection's input (B, S, A·hd)."""
    g, m = ctx.graph, ctx.model
    B, S, A, hd = ctx.B, ctx.S, m.num_heads, m.head_dim
    heads, heads_dims = (B, A, S, hd), ("B", "A", "S", "hd")
    scores, scores_dims = (B, A, S, S), ("B", "A", "S", "S")
    out_shape, out_dims = (B, S, A * hd), ("B", "S", "A·hd")
    p = m.attn_dropout
    if ctx.low:  # matmul and SDPA are on autocast's lower-precision list
        q, k, v = (ctx.cast(t, ctx.low, f"{n}_cast") for t, n in ((q, "q"), (k, "k"), (v, "v")))
    if kernel in ("flash", "efficient"):
        if kernel == "efficient" and m.num_kv_heads != A:  # no enable_gqa: K/V are expanded
            k = g.new("k_repeat", heads, heads_dims, k.dtype)
            v = g.new("v_repeat", heads, heads_dims, v.dtype)
        out = g.new("sdpa_out", out_shape, out_dims, q.dtype)  # o reads a view of it
        if kernel == "flash":
            lse = g.new("lse", (B, A, S), ("B", "A", "S"), "float32")
        else:  # memory-efficient pads the log-sum-exp to a multiple of 32 queries
            lse = g.new("lse", (B, A, -(-S // 32) * 32), ("B", "A", "⌈S/32⌉·32"), "float32")
        g.save(q, k, v, out, lse)
        if p > 0:
            g.save(g.new("rng_state", (2,), ("2",), "int64"))
        return out
    out_dtype = q.dtype
    if kernel == "math" and q.dtype != "float32" and ctx.impl.device == "cpu":
        q = ctx.cast(q, "float32", "q_fp32")  # the CPU math kernel computes in fp32
    # bmm operands are fresh (B·A, ., .) copies of the strided/expanded views
    g.save(g.new("q_bmm", heads, heads_dims, q.dtype), g.new("k_bmm", heads, heads_dims, q.dtype))
    probs = g.new("softmax", scores, scores_dims, "float32")
    g.save(probs)
    v_dtype = "float32" if kernel == "math" and ctx.impl.device == "cpu" else v.dtype
    if kernel == "eager":
        probs = ctx.cast(probs, v.dtype, "probs")
        probs = _dropout(ctx, probs, p, "attn_dropout")
    else:
        probs = ctx.dropout(probs, p, "attn_dropout")
    g.save(probs, g.new("v_bmm", heads, heads_dims, v_dtype))
    return g.new("attn_out", out_shape, out_dims, out_dtype)  # transpose + reshape: a copy


def _attention(ctx: Ctx, h: Sym, cos: Sym | None, sin: Sym | None) -> Sym:
    g, m = ctx.graph, ctx.model
    H, qs, kvs = m.hidden_size, m.q_size, m.kv_size
    with g.module("attn"):
        projs = {}
        for n, width, sym in (("q", qs, "A·hd"), ("k", kvs, "Akv·hd"), ("v", kvs, "Akv·hd")):
            with g.module(n):
                projs[n] = ctx.linear(h, width, sym, weight=(width, H))
        q, k, v = projs["q"], projs["k"], projs["v"]
        if cos is not None:
            q, k = _rope(ctx, q, cos, sin, "q_rope"), _rope(ctx, k, cos, sin, "k_rope")
        kernel = _kernel(ctx)
        if ctx.impl.recompute == "selective":
            with g.checkpoint(q, k, v):
                o = _attention_core(ctx, q, k, v, kernel)
        else:
            o = _attention_core(ctx, q, k, v, kernel)
        with g.module("o"):
            return ctx.linear(o, H, "H", weight=(H, qs))


# --- MLP and block ---------------------------------------------------------------------------

def _mlp(ctx: Ctx, h: Sym) -> Sym:
    g, m, impl = ctx.graph, ctx.model, ctx.impl
    H, F = m.hidden_size, m.ffn_size
    with g.module("mlp"):  # MLP.forward runs the activation and the product itself: they are mlp's
        with g.module("gate" if m.gated else "up"):
            u = ctx.linear(h, F, "F", weight=(F, H))
        up = None
        if m.gated:
            with g.module("up"):
                up = ctx.linear(h, F, "F", weight=(F, H))
        if impl.fused_bias_act:  # keeps its inputs, recomputes act(u + b) in backward
            g.save(u, up)
            dtype = promote(u.dtype, ctx.param) if m.mlp_bias else u.dtype
            a = g.new("act", u.shape, u.dims, promote(dtype, up.dtype) if up else dtype)
        else:
            a = g.new("act", u.shape, u.dims, u.dtype)
            g.save(a if m.activation == "relu" else u)  # relu keeps its result, the rest their input
            if up is not None:
                a = ctx.mul(a, up, "mul_up")
        with g.module("down"):
            return ctx.linear(a, H, "H", weight=(H, F))


def _block(ctx: Ctx, x: Sym, cos: Sym | None, sin: Sym | None) -> Sym:
    m = ctx.model
    a = _dropout(ctx, _attention(ctx, _norm(ctx, x, "attn_norm"), cos, sin), m.hidden_dropout, "attn_dropout_resid")
    if m.parallel_residual:
        y = _dropout(ctx, _mlp(ctx, _norm(ctx, x, "mlp_norm")), m.hidden_dropout, "mlp_dropout_resid")
        return ctx.add(ctx.add(x, a, "residual_attn"), y, "residual_mlp")
    x = ctx.add(x, a, "residual_attn")
    y = _dropout(ctx, _mlp(ctx, _norm(ctx, x, "mlp_norm")), m.hidden_dropout, "mlp_dropout_resid")
    return ctx.add(x, y, "residual_mlp")

"""The ``megatron`` profile: the activation accounting of Korthikanti et al. 2022.

"Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198), Section 4.1:
16-bit activations, 1-byte dropout masks, a GELU MLP of width 4h, dropout everywhere. Per layer,
with s = sequence, b = micro-batch, h = hidden, a = heads::

    attention   11sbh + 5as²b   QKV input 2sbh, Q and K 4sbh, softmax 2as²b, its dropout mask
                                as²b and output 2as²b, V 2sbh, output-projection input 2sbh,
                                output dropout mask sbh
    MLP         19sbh           fc1 input 2sbh, GELU input 8sbh, fc2 input 8sbh, dropout mask sbh
    layernorms   4sbh           two inputs of 2sbh
    total       sbh(34 + 5as/h)

Selective recompute (Section 5) recomputes the attention core (softmax, its dropout mask and
output): 34sbh. Full recompute keeps only the layer input: 2sbh. Outside the layers (Section 4.4):
the embedding dropout mask sbh, the final layernorm and output-projection inputs 2sbh each, and the
fp32 logits 4sbv of the cross-entropy.

Known limitations: the paper's model, not the ``ModelSpec``'s: the MLP is 4h GELU whatever
``ffn_size`` and ``activation`` say, activations are 16-bit even for ``fp32`` steps, and the
dropout masks are counted even at zero dropout. Under tensor parallelism (``ctx.shard.tp`` = t,
``ctx.model`` being the rank-local model with a/t heads) the layernorm, dropout and
linear-input tensors are replicated (10sbh) and the rest split (24sbh/t); with sequence
parallelism everything is split (34sbh/t), Megatron keeping the sharded linear inputs and
all-gathering them again in backward.
"""

from __future__ import annotations

from trainmem.errors import SpecError
from trainmem.estimate.ctx import Ctx
from trainmem.estimate.graph import Sym

__all__ = ["megatron_forward", "megatron_layer_bytes"]

_MASK = "uint8"  # the paper's 1-byte dropout masks


def megatron_layer_bytes(s: int, b: int, h: int, a: int, *, tp: int = 1, sp: bool = False,
                         recompute: str = "none") -> int:
    """Activation bytes of one layer on one device: Korthikanti et al. 2022, Table 2.

    The extension point for tensor (``tp`` = t) and sequence (``sp``) parallelism. Without
    sequence parallelism the layernorm and dropout inputs (10sbh) are replicated on every rank.

    ===============================  ==========================
    no parallelism                   sbh(34 + 5as/h)
    tensor parallel (t)              sbh(10 + 24/t + 5as/(ht))
    tensor + sequence parallel       sbh(34/t + 5as/(ht))
    selective recompute              drops the 5as/(ht) term
    full recompute                   sbh·2 (sbh·2/t with SP: the input is split)
    ===============================  ==========================
    """
    for name, value in (("s", s), ("b", b), ("h", h), ("a", a), ("tp", tp)):
        if not isinstance(value, int) or value <= 0:
            raise SpecError(name, value, "must be a positive integer")
    if recompute not in ("none", "selective", "full"):
        raise SpecError("recompute", recompute, "must be one of none, selective, full")
    if h % tp or a % tp or (sp and s % tp):
        raise SpecError("tp", tp, f"must divide h={h}, a={a}" + (f" and s={s} (sequence parallel)" if sp else ""))
    sbh = s * b * h
    if recompute == "full":  # only the layer input, itself split by sequence parallelism
        return 2 * sbh // tp if sp else 2 * sbh
    linear = 34 * sbh // tp if sp else 10 * sbh + 24 * sbh // tp
    quadratic = 5 * a * s * s * b // tp
    return linear if recompute == "selective" else linear + quadratic


def _seq(ctx: Ctx) -> tuple[tuple[int, int, int], tuple[str, str, str]]:
    """Shape of the tensors sequence parallelism splits (replicated without it)."""
    t = ctx.shard.tp
    if ctx.shard.sp and t > 1:
        return (ctx.S // t, ctx.B, ctx.model.hidden_size), ("S/tp", "B", "H")
    return (ctx.S, ctx.B, ctx.model.hidden_size), ("S", "B", "H")


def megatron_forward(ctx: Ctx) -> None:
    g, m = ctx.graph, ctx.model
    B, S, V = ctx.B, ctx.S, m.vocab_size
    act = ctx.step.dtypes.activation if ctx.step.dtypes.activation != "float32" else "bfloat16"
    seq = _seq(ctx)
    g.save(g.new("embedding.dropout_mask", *seq, _MASK))
    for i in range(m.num_layers):
        with g.module(f"layers.{i}"):
            # the residual stream entering layer i: named for the layer that keeps it
            x = g.new("input", *seq, act)
            if ctx.impl.checkpointed(i):
                with g.checkpoint(x):
                    _layer(ctx, x)
            else:
                _layer(ctx, x)
    with g.module("final_layernorm"):
        g.save(g.new("input", *seq, act))
    with g.module("output_layer"):
        g.save(g.new("input", *seq, act))
    with g.module("loss"):
        g.save(g.new("logits_fp32", (S, B, V), ("S", "B", "V"), "float32"))


def _layer(ctx: Ctx, x: Sym) -> None:
    g, m = ctx.graph, ctx.model
    B, S, H, t = ctx.B, ctx.S, m.hidden_size, ctx.shard.tp
    seq, dt = _seq(ctx), x.dtype
    split = ((S, B, H // t), ("S", "B", "H/tp" if t > 1 else "H"))  # heads split over TP ranks
    with g.module("input_layernorm"):
        g.save(x)  # 2sbh
        h = g.new("out", *seq, dt)
    with g.module("self_attention"):
        g.save(h)  # QKV input 2sbh
        q, k, v = (g.new(n, *split, dt) for n in ("q", "k", "v"))
        if ctx.impl.recompute == "selective":
            with g.checkpoint(q, k, v):
                core = _core(ctx, q, k, v)
        else:
            core = _core(ctx, q, k, v)
        with g.module("dense"):
            g.save(core)  # 2sbh
        g.save(g.new("dropout_mask", *seq, _MASK))  # sbh
    x = g.new("residual_attn", *seq, dt)
    with g.module("post_attention_layernorm"):
        g.save(x)  # 2sbh
        h = g.new("out", *seq, dt)
    with g.module("mlp"):
        wide = ((S, B, 4 * H // t), ("S", "B", "4H/tp" if t > 1 else "4H"))
        with g.module("fc1"):
            g.save(h)  # 2sbh
            u = g.new("out", *wide, dt)
        with g.module("gelu"):
            g.save(u)  # 8sbh
            y = g.new("out", *wide, dt)
        with g.module("fc2"):
            g.save(y)  # 8sbh
        g.save(g.new("dropout_mask", *seq, _MASK))  # sbh


def _core(ctx: Ctx, q: Sym, k: Sym, v: Sym) -> Sym:
    """QKᵀ keeps Q and K (4sbh), softmax its output (2as²b), dropout a mask (as²b), the
    attention over values the dropout output (2as²b) and V (2sbh)."""
    g, m = ctx.graph, ctx.model
    B, S, A, dt = ctx.B, ctx.S, m.num_heads, q.dtype
    scores, dims = (B, A, S, S), ("B", "A", "S", "S")
    g.save(q, k)
    g.save(g.new("softmax", scores, dims, dt), g.new("attn_dropout_mask", scores, dims, _MASK))
    g.save(g.new("attn_dropout", scores, dims, dt), v)
    t = ctx.shard.tp
    return g.new("context", (S, B, m.hidden_size // t), ("S", "B", "H/tp" if t > 1 else "H"), dt)

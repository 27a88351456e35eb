"""``ImplSpec.compile`` with ``--attention eager``: what a compiled block keeps of transformers'
``eager_attention_forward`` (``modeling_llama.py``: ``repeat_kv``, ``q @ kᵀ · scaling + mask``, an
fp32 ``softmax`` cast back to q's dtype, ``probs @ v``), read from the partitioned graphs (``trainmem
trace --compile --attention eager``; inductor's ``min_cut_rematerialization_partition``,
``torch/_functorch/partitioners.py``) of a tiny Llama (H=64, A=4, Akv=2, hd=16, B=2, S=64, bf16).

A 16-bit compiled block keeps:

* both bmms' operands heads-wide (B·A·S·hd each): q, and the K and V copies ``repeat_kv`` makes;
  an input a bmm reads in backward is never recomputed (``should_ban_recomputation``,
  "materialized in backward"), and the copies are those inputs;
* the 16-bit probabilities (B·A·S·S), the second bmm's input, for the same reason;
* the first bmm's output, the 16-bit scores (B·A·S·S), and the fp32 softmax's row max and sum
  (B·A·S·1 each, reductions the min-cut does not recompute: "reduction op"), from which the fp32
  softmax is recomputed in backward (eager keeps it: 4·B·A·S·S);
* the attention output (``o_proj``'s input, B·S·A·hd).

    per block   a·(4·B·A·S·hd + 2·B·A·S·S) + 8·B·A·S

In fp32 the softmax's own output is the second bmm's input: the block keeps it (4·B·A·S·S) and
neither the scores nor the reductions:

    per block   4·(4·B·A·S·hd + B·A·S·S)                        fp32

Per block (``--compile-scope block``) a 16-bit step keeps the eager causal mask (B·1·S·S, in the
activation dtype; one per layer type), built once outside the blocks and read by every block's
recomputed softmax; fp32 does not need it. A whole-model graph builds it from ``iota`` and
recomputes it. Read at S=16, 64 and 128 in bf16 and S=64 in fp32, with grouped (1 < Akv < A) and
full (Akv = A) K/V heads; one K/V head is refused (``repeat_kv`` may be a view there, not traced).
"""

from __future__ import annotations

from trainmem.estimate.ctx import Ctx
from trainmem.estimate.graph import Sym
from trainmem.families import family_of

__all__ = ["compiled_eager_attention", "eager_checked", "eager_mask"]


def eager_checked(ctx: Ctx) -> bool:
    """Where the rule was read: bf16 (fp32 without soft-capping), no recompute, more than one K/V head,
    the Llama block (no q/k norms, no MoE, not a ``compiled_narrow`` family), no Float8 or fine-tuning."""
    m, impl = ctx.model, ctx.impl
    return ((ctx.step.recipe == "bf16" or (ctx.step.recipe == "fp32" and not m.attn_softcap))
            and impl.recompute == "none" and 1 < m.num_kv_heads <= m.num_heads
            and not (m.qk_norm or m.is_moe or family_of(m).compiled_narrow) and impl.float8 == "none"
            and ctx.finetune_linear is None)


def compiled_eager_attention(ctx: Ctx, q: Sym) -> Sym:
    """The compiled eager attention's saved set in the current (``self_attn``) scope, the rotated
    ``q`` (B·S·A·hd) included; returns its output."""
    g, m = ctx.graph, ctx.model
    B, S, A, hd, a = ctx.B, ctx.S, m.num_heads, m.head_dim, ctx.param
    heads, heads_dims = (B, A, S, hd), ("B", "A", "S", "hd")
    scores, scores_dims = (B, A, S, S), ("B", "A", "S", "S")
    g.save(q, g.new("k_repeat", heads, heads_dims, a), g.new("v_repeat", heads, heads_dims, a))
    if a != "float32":  # the scores and the softmax's reductions, from which the fp32 softmax is recomputed
        g.save(g.new("scores", scores, scores_dims, a, op="bmm"),
               g.new("row_max", (B, A, S, 1), ("B", "A", "S", "1"), "float32"),
               g.new("row_sum", (B, A, S, 1), ("B", "A", "S", "1"), "float32"))
    g.save(g.new("probs", scores, scores_dims, a))  # the second bmm's input (fp32: the softmax's own output)
    out = g.new("attn_out", (B, S, A * hd), ("B", "S", "A·hd"), a)
    g.save(out)
    return out


def eager_mask(ctx: Ctx) -> None:
    """Per block: the causal masks transformers builds eagerly, one per attention type of the layers
    (``masking_utils.create_causal_mask``, and ``create_sliding_window_causal_mask`` for Gemma-2's
    sliding layers, even with a window not shorter than S), each passed to its blocks and kept once."""
    g, B, S = ctx.graph, ctx.B, ctx.S
    if ctx.param == "float32":  # fp32 keeps the softmax's output, not what recomputes it (the masked scores)
        return
    types = sorted({k.attention for k in ctx.model.kinds})
    with g.module("model"):
        for t in types:
            g.save(g.new("causal_mask" + (f"_{t}" if len(types) > 1 else ""), (B, 1, S, S), ("B", "1", "S", "S"),
                         ctx.param, False))

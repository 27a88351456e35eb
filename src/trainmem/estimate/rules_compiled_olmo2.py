"""``ImplSpec.compile`` for OLMo-2 (``modeling_olmo2.py``): what a compiled ``Olmo2DecoderLayer``
keeps for backward, read from its partitioned graphs (``trainmem trace --compile``, inductor's
``min_cut_rematerialization_partition``; ``torch/_functorch/partitioners.py``).

OLMo-2 has no norm before attention or the MLP; an ``Olmo2RMSNorm`` follows each (on ``o_proj``'s
and ``down_proj``'s outputs, before the residual add), and q/k are normalized over the whole
projection. The min-cut keeps, per block (a the activation dtype, B batch, S sequence):

* the block input (the q/k/v projections' input; no pre-norm to recompute it from);
* ``q_proj``'s and ``k_proj``'s outputs (the q/k norms' inputs) and each norm's fp32 ``rsqrt``
  (B·S·1): the normalized products are recomputed, as in the Llama rules' RMSNorm;
* what the SDPA kernel keeps (rotated q and k cast back to ``a``, v, output, log-sum-exp;
  ``estimate/attention.py``);
* ``o_proj``'s output and ``post_attention_layernorm``'s ``rsqrt``; the residual sum after it,
  which the MLP reads (its gate/up projections' input);
* ``gate``, ``up`` and ``act(gate)·up`` (the SiLU output is recomputed), ``down_proj``'s output
  and ``post_feedforward_layernorm``'s ``rsqrt``.

    per block   a·B·S·(4H + 3·A·hd + 3·Akv·hd + 3F) + 4·B·S·4 + 4·B·A·S

Tiny OLMo-2 (H=64, F=176, A=4, Akv=2, hd=16, B=2, S=64): fp32 552,960 bytes per block
(``tests/estimate/test_compiled_families.py``). The rotary table stays fp32 (``rope_fp32``).
"""

from __future__ import annotations

from trainmem.estimate.attention import attention_core, resolve_kernel
from trainmem.estimate.ctx import Ctx
from trainmem.estimate.graph import Sym

__all__ = ["olmo2_block"]


def olmo2_block(ctx: Ctx, x: Sym) -> Sym:
    """One compiled ``Olmo2DecoderLayer``'s saved set, its input ``x`` included."""
    g, m = ctx.graph, ctx.model
    B, S, H, F, a = ctx.B, ctx.S, m.hidden_size, m.ffn_size, ctx.param
    g.save(x)
    with g.module("self_attn"):
        for proj, norm, width, sym in (("q_proj", "q_norm", m.q_size, "A·hd"),
                                       ("k_proj", "k_norm", m.kv_size, "Akv·hd")):
            with g.module(proj):
                g.save(g.new("out", (B, S, width), ("B", "S", sym), a))
            _rsqrt(ctx, norm)
        q = g.new("q_rope", (B, S, m.q_size), ("B", "S", "A·hd"), a)
        k = g.new("k_rope", (B, S, m.kv_size), ("B", "S", "Akv·hd"), a)
        with g.module("v_proj"):
            v = g.new("out", (B, S, m.kv_size), ("B", "S", "Akv·hd"), a)
        attention_core(ctx, q, k, v, kernel=resolve_kernel(ctx), gqa_native=m.head_dim <= 256)
        with g.module("o_proj"):
            g.save(g.new("out", (B, S, H), ("B", "S", "H"), a))
    _rsqrt(ctx, "post_attention_layernorm")
    g.save(g.new("residual_attn", (B, S, H), ("B", "S", "H"), a))  # the MLP's input
    with g.module("mlp"):
        for name in ("gate_proj", "up_proj"):
            with g.module(name):
                g.save(g.new("out", (B, S, F), ("B", "S", "F"), a))
        g.save(g.new("act_mul_up", (B, S, F), ("B", "S", "F"), a))  # down_proj's input
        with g.module("down_proj"):
            g.save(g.new("out", (B, S, H), ("B", "S", "H"), a))
    _rsqrt(ctx, "post_feedforward_layernorm")
    return g.new("residual_mlp", (B, S, H), ("B", "S", "H"), a)


def _rsqrt(ctx: Ctx, norm: str) -> None:
    with ctx.graph.module(norm):
        ctx.graph.save(ctx.graph.new("rsqrt", (ctx.B, ctx.S, 1), ("B", "S", "1"), "float32", False))

"""The ``hf`` profile's mixture-of-experts block: the top-k router (Mixtral, Qwen3-MoE) and
transformers 5's ``grouped_mm`` experts (``integrations/moe.py``), with DeepSeek's shared experts.
Every routed tensor has T·k rows (T = B·S tokens), so the total does not depend on how tokens
spread over experts.
"""

from __future__ import annotations

from trainmem.estimate.ctx import Ctx, promote
from trainmem.estimate.graph import Sym
from trainmem.estimate.rules_hf_parts import _gated_mlp, _rules


def _moe(ctx: Ctx, h: Sym) -> Sym:
    """Mixtral sparse MoE, transformers 5 ``grouped_mm`` experts.

    Every routed tensor has T·k rows (T = B·S tokens), so the total is independent of how
    tokens spread over experts.
    """
    g, m = ctx.graph, ctx.model
    H, E, k = m.hidden_size, m.num_experts, m.top_k
    T = ctx.B * ctx.S
    with g.module("gate"):
        logits = ctx.linear(h, E, "E", weight=(E, H))
        probs = g.new("probs", (T, E), ("B·S", "E"), "float32")  # softmax keeps its fp32 output
        # torch.topk's values and indices (MixtralTopKRouter.forward, Qwen3MoeTopKRouter.forward): an
        # op-level policy keeps both (aten.topk is on op_sac_context's save list); autograd the indices
        top_val = g.new("top_val", (T, k), ("B·S", "k"), "float32", op="topk")
        g.save(probs, g.new("top_idx", (T, k), ("B·S", "k"), "int64", False, op="topk"))
        # the in-place renormalization keeps the sum and the top-k values (Qwen3-MoE may skip it)
        g.save(g.new("top_sum", (T, 1), ("B·S", "1"), "float32"), top_val, when=m.router_norm_topk)
        # Qwen3MoeTopKRouter.forward casts the weights to the logits' dtype; Mixtral's stay fp32
        w_dtype = logits.dtype if _rules(ctx).router_cast else "float32"
        del logits
    return _routed_experts(ctx, h, w_dtype)


def _routed_experts(ctx: Ctx, h: Sym, w_dtype: str) -> Sym:
    """The ``grouped_mm`` experts (``integrations/moe.py``) after a router whose top-k weights are
    ``w_dtype``, and the shared experts' dense MLP where the model has them."""
    g, m = ctx.graph, ctx.model
    H, E, k, F = m.hidden_size, m.num_experts, m.top_k, m.expert_ffn_size
    T = ctx.B * ctx.S
    # grouped_mm is on CUDA autocast's lower-precision list, not on CPU's
    low = ctx.low if ctx.impl.device == "cuda" else None
    act = low or (ctx.param if ctx.low else h.dtype)
    Tk = (T * k,)
    with g.module("experts"):
        Tks = ("B·S·k",)
        g.save(g.new("sort_idx", Tk, Tks, "int64"), g.new("token_idx", Tk, Tks, "int64"),
               g.new("counts", (E,), ("E",), "int32"), g.new("routed_idx", Tk, Tks, "int64"))
        x_in = g.new("gathered", (T * k, H), Tks + ("H",), act)
        gu = g.new("gate_up", (T * k, 2 * F), Tks + ("2Fe",), act)
        with g.module("act_fn"):
            a = g.new("out", (T * k, F), Tks + ("Fe",), act)
        p = g.new("act_mul_up", (T * k, F), Tks + ("Fe",), act)
        w = g.new("weights", (T * k, 1), Tks + ("1",), w_dtype)
        d = g.new("down", (T * k, H), Tks + ("H",), act)
        g.save(x_in, gu, a, p, w, d)
        if low:
            g.save(g.new("gate_up_weight_cast", (E, 2 * F, H), ("E", "2Fe", "H"), ctx.low),
                   g.new("down_weight_cast", (E, H, F), ("E", "H", "Fe"), ctx.low))
    y = g.new("moe_out", h.shape, h.dims, promote(act, "float32") if low else act)
    if m.num_shared_experts:
        # DeepSeek (modeling_deepseek_v3.py, DeepseekV3MoE.forward): routed output +
        # shared_experts(input), one dense MLP as wide as all shared experts; the sum keeps nothing
        with g.module("shared_experts"):
            shared = _gated_mlp(ctx, h, (m.num_shared_experts * F, "Es·Fe"))
        y = ctx.add(y, shared, "moe_shared_sum")
    return y


def load_balancing_items(ctx: Ctx) -> None:
    """The routers' load-balancing loss (``output_router_logits``), after the cross-entropy: transformers'
    ``load_balancing_loss_func`` (``models/qwen3_moe/modeling_qwen3_moe.py``, Mixtral's the same) runs,
    per MoE block, ``softmax`` on the router logits the model returned (the activation dtype a: softmax keeps its
    output, a·T·E), a ``topk`` whose values are dropped (its node and indices die with them) and
    ``histc`` counts (no gradient); ``probs.float().sum(0)`` keeps nothing. After the blocks,
    ``tokens_per_expert * router_prob_per_expert`` keeps the counts over the rows (fp32, E): the other factor
    has no gradient. ``loss += coef * aux`` is in place and keeps nothing.

        kept   Σ over MoE blocks a·T·E  +  4·E

    In backward this branch runs before the cross-entropy's (higher sequence numbers): its kept tensors are
    released and each block's router-logit gradient (a·T·E) waits for that block's router backward
    (estimate/peak.py ``router_logits_grad``)."""
    from trainmem.errors import SpecError

    g, m = ctx.graph, ctx.model
    if ctx.step.loss != "ce" or ctx.low or ctx.shard.tp > 1 or ctx.shard.cp > 1:
        raise SpecError("output_router_logits", True, "the load-balancing loss is modelled with --loss ce, a pure "
                                                        "precision (fp32/bf16/fp16) and no tp or cp (here loss="
                                                        f"{ctx.step.loss}, precision={ctx.step.precision}, "
                                                        f"tp={ctx.shard.tp}, cp={ctx.shard.cp})")
    T, E = ctx.B * ctx.S, m.num_experts
    with g.module("loss.load_balancing"):
        for i, kind in enumerate(m.kinds):
            if kind.mlp == "moe":
                g.save(g.new(f"probs_layer{i}", (T, E), ("B·S", "E"), ctx.step.dtypes.activation))
        g.save(g.new("tokens_per_expert", (E,), ("E",), "float32", False))

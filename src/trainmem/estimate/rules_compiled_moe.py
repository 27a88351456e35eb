"""``ImplSpec.compile`` for the top-k MoE MLP of Qwen3-MoE and Mixtral (transformers 5.x): what a
compiled block keeps for its router and its ``grouped_mm`` experts, read from the partitioned
graphs (``trainmem trace --compile``; inductor's ``min_cut_rematerialization_partition``,
``torch/_functorch/partitioners.py``) and from the same compiled block on real tensors with the
router's own (unforced) expert ids.

The router (``Qwen3MoeTopKRouter.forward``, ``MixtralTopKRouter.forward``: a linear, an fp32
softmax, ``torch.topk``, the renormalization Mixtral always and Qwen3-MoE with ``norm_topk_prob``
does) keeps ``topk``'s int64 indices (T·k) and:

* the router logits in the activation dtype (T·E), from which the fp32 softmax is recomputed,
  while E <= 4; for E > 4 the softmax's amax and sum are reductions the min-cut does not recompute
  (``should_ban_recomputation``, "reduction op": input over four times the output), and the cut
  keeps the fp32 probabilities (4·T·E; read at E = 8, 16) or the logits with both reductions'
  fp32 outputs (a·T·E + 8·T; read at E = 32, 64, 128); which one follows the min-cut's weights, so
  routers of 17 to 31 experts are refused;
* with the renormalization, the fp32 top-k values (T·k) and, for k > 4, their fp32 sum (T·1, the
  same ban); without it, the sorted weights ``sample_weights[perm]`` in the activation dtype (T·k).

The experts (``transformers/integrations/moe.py`` ``grouped_mm_experts_forward``) keep the sort
permutation ``perm`` and the token index ``perm // k`` (int64, T·k each: ``sort`` is not
recomputed), the offsets ``cumsum(histc(...))`` (int32, E), the gathered input (T·k·H), the
first ``grouped_mm``'s output (T·k·2Fe), ``act(gate)·up`` (T·k·Fe, the second ``grouped_mm``'s
input), the second's output (T·k·H, read by the weighting's backward) and the inverse permutation
``inv_perm`` (int64, T·k); ``act(gate)`` and the weighted, unsorted rows are recomputed.

    per MoE block   a·T·k·(2H + 3Fe) + 32·T·k + 4·E             experts; top-k ids, perm, perm // k, inv_perm
                  + a·T·E (E <= 4), 4·T·E (4 < E <= 16), a·T·E + 8·T (E >= 32)   router
                  + 4·T·k (+ 4·T if k > 4)  renormalized, else a·T·k  top-k values (and sum), or sorted weights

The rest of the block is the Llama compiled block (``estimate/rules_compiled.py``), with Qwen3's
per-head q/k norms for Qwen3-MoE. Checked in bf16 only: ``grouped_mm`` is the experts'
implementation in bf16, and torch 2.13's meta kernel of ``aten._grouped_mm`` refuses other dtypes
(transformers falls back to its own ``grouped_mm_fallback`` op there, which keeps another set).
"""

from __future__ import annotations

from trainmem.estimate.ctx import Ctx

__all__ = ["compiled_moe", "checkpointed_moe_arange", "router_checked", "compiled_load_balancing"]

# the router's softmax (fp32, over E experts): its amax and sum are reductions the min-cut never recomputes
# once their input is over 4x their output (partitioners.py should_ban_recomputation, "reduction op"), so
# for E > 4 the cut keeps either the fp32 probabilities or the logits with both reductions' outputs; which
# is cheaper depends on the min-cut's weights (get_node_weight: bytes x 1.1 ** distance from backward),
# read at E = 8, 16 (probabilities) and 32, 64, 128 (logits and reductions; 128: Qwen3-30B-A3B); 17..31 not read
PROBS_MAX_E, LOGITS_MIN_E = 16, 32


def router_checked(num_experts: int) -> bool:
    """Whether the compiled router's saved set was read at this many experts (see above)."""
    return num_experts <= PROBS_MAX_E or num_experts >= LOGITS_MIN_E


def compiled_moe(ctx: Ctx) -> None:
    """The router's and the experts' saved set inside a compiled block (T = B·S tokens)."""
    g, m = ctx.graph, ctx.model
    H, E, k, F = m.hidden_size, m.num_experts, m.top_k, m.expert_ffn_size
    T, a = ctx.B * ctx.S, ctx.low or ctx.param
    Tk, Tks = (T * k,), ("B·S·k",)
    with g.module("gate"):
        g.save(g.new("top_idx", (T, k), ("B·S", "k"), "int64", False))
        if E <= 4 or E >= LOGITS_MIN_E:  # the softmax recomputed from the logits
            g.save(g.new("logits", (T, E), ("B·S", "E"), a))
        if E >= LOGITS_MIN_E:  # ... and its banned reductions' outputs
            g.save(g.new("row_max", (T, 1), ("B·S", "1"), "float32"), g.new("row_sum", (T, 1), ("B·S", "1"), "float32"))
        g.save(g.new("probs", (T, E), ("B·S", "E"), "float32"), when=4 < E <= PROBS_MAX_E)
        # the renormalization keeps topk's fp32 values; without it the sorted weights are kept in the router's
        # output dtype (Qwen3MoeTopKRouter casts them to the logits' dtype; Mixtral always renormalizes)
        g.save(g.new("top_val", (T, k), ("B·S", "k"), "float32"), when=m.router_norm_topk)
        # the sum over k, the same reduction ban once k > 4: kept, and the normalized values instead of topk's
        g.save(g.new("top_sum", (T, 1), ("B·S", "1"), "float32"), when=m.router_norm_topk and k > 4)
    with g.module("experts"):
        g.save(g.new("sort_idx", Tk, Tks, "int64", False), g.new("token_idx", Tk, Tks, "int64", False),
               g.new("offsets", (E,), ("E",), "int32", False),
               g.new("gathered", (T * k, H), Tks + ("H",), a),
               g.new("gate_up", (T * k, 2 * F), Tks + ("2Fe",), a),
               g.new("act_mul_up", (T * k, F), Tks + ("Fe",), a),
               g.new("down", (T * k, H), Tks + ("H",), a),
               g.new("inv_perm", Tk, Tks, "int64", False))
        g.save(g.new("weights_sorted", (T * k, 1), Tks + ("1",), a), when=not m.router_norm_topk)


def checkpointed_moe_arange(ctx: Ctx) -> None:
    """Whole-model compile around checkpointed blocks (``--recompute full``): the ``arange(T·k)`` that
    ``grouped_mm_experts_forward`` scatters into ``inv_perm`` is a constant of the graph, hoisted out of
    the checkpointed regions and kept once for all MoE blocks (int64, T·k; a real compiled step)."""
    m = ctx.model
    if any(kind.mlp == "moe" for kind in m.kinds):
        with ctx.graph.module("model"):
            Tk = ctx.B * ctx.S * m.top_k
            ctx.graph.save(ctx.graph.new("experts_arange", (Tk,), ("B·S·k",), "int64", False))


def compiled_load_balancing(ctx: Ctx) -> None:
    """Whole-model compile with the load-balancing loss (``output_router_logits``; eager:
    ``estimate/rules_hf_moe.py`` ``load_balancing_items``): the router logits leave the model graph as outputs
    (transformers' OutputRecorder), a second region runs ``load_balancing_loss_func`` and keeps each MoE
    block's softmax in fp32 (the decomposed softmax upcasts the logits; the cut keeps its fp32 output, not the
    16-bit cast eager keeps) and the counts (fp32, E). Inside the blocks nothing changes: a router's kept
    logits (E <= 4, E >= 32) are the region's output, the same storage. Read at E = 4, 8, 16 and 128 (k = 2,
    2, 8, 8), bf16, B=2, S=64:

        kept   Σ over MoE blocks 4·B·S·E  +  4·E"""
    g, m = ctx.graph, ctx.model
    T, E = ctx.B * ctx.S, m.num_experts
    with g.module("loss.load_balancing"):
        for i, kind in enumerate(m.kinds):
            if kind.mlp == "moe":
                g.save(g.new(f"probs_layer{i}", (T, E), ("B·S", "E"), "float32"))
        g.save(g.new("tokens_per_expert", (E,), ("E",), "float32", False))

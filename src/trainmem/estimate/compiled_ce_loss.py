"""The backward of a compiled ``ForCausalLMLoss`` (``--compile --compile-scope block-loss``: the loss is its own
region, ``rules_compiled.py`` ``_compiled_loss``; whole-model compile keeps the same set, ``_head_and_loss``).

The compiled forward keeps the logits in their own dtype, the row max and the log-sum-exp (B·S fp32 each), not
the fp32 log-softmax eager autograd saves. Its backward graph (the partitioner recomputes the pointwise
log-softmax: ``torch/_functorch/partitioners.py`` ``min_cut_rematerialization_partition``) runs inductor's
decompositions op by op (``torch/_decomp/decompositions.py`` ``_nll_loss_backward``: the one-hot ``where``, then
the product with the incoming gradient; ``_log_softmax_backward_data``), each value freed after its last use
(the boxed calling convention, ``torch/_functorch/_aot_autograd/runtime_wrappers.py``), so the logits, a graph
input, are freed by their last reader. The moment is the recomputed log-softmax's first ``sub``: beside the
log-softmax's gradient (B·S·V fp32) it reads the logits as fp32 (``logits.float()``: their upcast copy, the
16-bit logits freed once it exists; fp32 logits are read as they are) and writes ``logits - row_max``
(B·S·V fp32): three fp32 B·S·V values, the logits no longer counted among the kept activations. Every later
step of the backward (``exp``, ``exp·sum``, the difference, the cast back) holds no more than three.

Read off the trace of a tiny Llama (V 1000, block-loss, bf16: the 256,000 B the eager-style formula
under-counted) and checked per precision in tests/estimate/test_compiled_ce_loss.py.

Under whole-model compile the loss is the end of the one graph, whose backward starts with the zero-filled
tangents of the outputs the loss does not read (:func:`graph_tangents`): the logits, which the model returns
beside the loss, and without checkpointing every block's KV cache entries (estimate/compiled_block_moment.py
``cache_tangents``). In fp32 the moment is ``_nll_loss_backward``'s product (:func:`compiled_ce_backward`).
Tiny Llama (V 256, 2 blocks) B 2 S 64, no recompute: estimate = trace 1,784,264 B bf16 (0.912 before; the loss's
kept set, named under ``lm_head`` there, was not read as a compiled loss's either) and 3,167,048 B fp32 (0.938)
(tests/estimate/test_compiled_block_moment.py).
"""

from __future__ import annotations

from trainmem.estimate.compiled_block_moment import cache_tangents
from trainmem.inventory import Inventory, MemoryItem
from trainmem.names import layer_of

__all__ = ["compiled_ce_backward", "graph_tangents"]

_FP32 = 4  # ForCausalLMLoss upcasts the logits (transformers/loss/loss_utils.py: logits.float())
_IN_GRAPH = "lm_head.loss."  # the loss inside the whole-model graph, after lm_head (rules_compiled.py _head_and_loss)


def compiled_ce_backward(tokens_vocab: int, logits_bytes: int = 0, tokens: int = 0) -> int:
    """The bytes the compiled loss's backward moment holds beside the kept activations less the logits: the
    recomputed log-softmax's first ``sub`` (three fp32 B·S·V), or, when larger, ``_nll_loss_backward``'s
    product before it, which holds the one-hot ``where`` (fp32 B·S·V), the product and the per-row weights
    (fp32 B·S) beside the logits as kept (``logits_bytes``; ``tokens``: B·S). In fp32 that one is the larger by
    B·S·4 (read off the whole-model trace: estimate/compiled_block_moment.py's tests)."""
    return max(3 * tokens_vocab * _FP32, logits_bytes + 2 * tokens_vocab * _FP32 + tokens * _FP32)


def graph_tangents(items: "Inventory | list[MemoryItem]", logits_bytes: int) -> int:
    """The zero-filled tangents alive at the loss's backward when the loss ends the whole-model graph: the
    logits' (the model's output beside the loss; ``torch/autograd/function.py`` ``set_materialize_grads``,
    default on) and every block's KV cache entries (none under checkpointing, which turns the cache off)."""
    inv = items if isinstance(items, Inventory) else Inventory(items)
    if not any(i.name.startswith(_IN_GRAPH) for i in inv.base):
        return 0  # the loss is a region of its own (GPT-2's graph break before it: rules_compiled_gpt2.py)
    blocks = {b for i in inv.base if (b := layer_of(i.name)) is not None} | {
        d for r in inv.repeats for d in (r.src, *r.dsts)}
    return logits_bytes + cache_tangents(inv, tuple(sorted(blocks)))

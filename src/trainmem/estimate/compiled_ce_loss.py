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
"""

from __future__ import annotations

__all__ = ["compiled_ce_backward"]

_FP32 = 4  # ForCausalLMLoss upcasts the logits (transformers/loss/loss_utils.py: logits.float())


def compiled_ce_backward(tokens_vocab: int) -> int:
    """The bytes the compiled loss's backward moment holds beside the kept activations less the logits."""
    return 3 * tokens_vocab * _FP32

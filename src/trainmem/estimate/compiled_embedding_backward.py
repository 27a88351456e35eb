"""The token embedding's backward inside one compiled graph (``--compile --compile-scope model``).

With the whole model compiled, the embedding's backward is AOTAutograd's decomposition of
``aten.embedding_dense_backward`` (torch/_decomp/decompositions.py ``embedding_dense_backward``), run as
partitioned ops: the output gradient is cast to the computation dtype (``elementwise_dtypes``, DEFAULT
promotion: fp32 for bf16/fp16), a (B, S) bool mask of valid, non-padding ids is made, a zero-filled
(V, H) table in that dtype (``new_zeros``) and the out-of-place ``_unsafe_masked_index_put_accumulate``
result beside it, which is then cast back to the parameter's dtype. At the index-put both (V, H) tables are
alive beside every other gradient: 8 B per embedding element for a 16-bit model (the estimate had 2, the
gradient), 4 B more than the gradient in fp32 (the put's result is the gradient itself there, the cast a
no-op). It is the last node of the backward, so it stands for ``backward_end`` where it is larger
(estimate/peak.py). A Llama with V 32,000 and H 256 (bf16, B1 S64, whole model compiled) read 49,184,832 B
under the trace without it (Llama-2-7B widths, 2 layers, S 4096: 79,155,200 B under, found by
bench/gpu_validate.py's compile-model-full row); now equal, also tied, GPT-2 (tied, with its position table)
and Qwen2 (tests/estimate/test_compiled_embedding_backward.py). With accumulation and ``--recompute full``
the estimate reads one fp32 (V, H) table over the trace (fp32 V 8,000: 4,096,000 B; not explained; the safe side).

The trace runs inductor's partition op by op (trace/compiled.py); real inductor lowers the put in place
into the zero table, so on a GPU this moment is an upper bound by one fp32 table (not checked on a GPU).
Per-block compile leaves the embedding eager: not this moment.
"""

from __future__ import annotations

import math

from trainmem.inventory import Category, dtype_bytes
from trainmem.names import is_token_embedding

__all__ = ["embedding_backward_parts"]


def embedding_backward_parts(base, *, B: int, S: int, stored_grads: int, grad_accum: int, tied: bool,
                             activations: int, loss_scalars: int) -> dict[str, int] | None:
    """The live bytes at the compiled embedding backward's index-put (module docstring), or ``None`` when the
    token embedding has no gradient (frozen) or none is in the inventory. ``stored_grads``: every stored
    ``.grad`` at the end of backward."""
    grads = [i for i in base if i.category is Category.GRADIENT and is_token_embedding(i.name) and len(i.shape) == 2]
    if not grads:
        return None
    g = max(grads, key=lambda i: i.bytes)
    comp = max(4, int(dtype_bytes(g.dtype)))  # float32 for 16-bit gradients, their own dtype otherwise
    table = math.prod(g.shape) * comp
    hidden = g.shape[1]
    # the output gradient in the computation dtype (a new tensor when upcast; in fp32 the incoming one)
    upcast = B * S * hidden * comp
    ids_mask = B * S  # valid & (ids != padding_idx): one byte per id
    # the graph returns every gradient at its end: the others' new ones (a tied head's part of this weight's
    # among them) are alive here, and with accumulation every earlier micro-batch's .grad beside them
    new = stored_grads if tied else stored_grads - g.bytes
    # with accumulation estimate/grad_accum.py adds this embedding's new gradient to backward_end
    # (``new_gradient``, with the divided loss): at the index-put it is not made yet (16-bit: the cast comes
    # after) or is one of the two tables (fp32), so it is taken off here
    before = new + (stored_grads - g.bytes if grad_accum > 1 else 0)
    return {"gradients": before, "activations": activations, "embedding_grad_tables": 2 * table,
            "work": upcast, "embedding_ids_mask": ids_mask, "loss_scalars": loss_scalars}


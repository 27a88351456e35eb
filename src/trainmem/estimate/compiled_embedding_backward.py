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
and Qwen2 (tests/estimate/test_compiled_embedding_backward.py).

With accumulation every earlier micro-batch's ``.grad`` is alive here too (this one's included: this moment
counts the embedding's new gradient itself, so estimate/grad_accum.py adds none to it). The new gradients
beside them are those of the graph's other parameters, not an untied head's under transformers' gradient
checkpointing: ``merge_with_config_defaults`` (transformers/utils/generic.py) calls ``logger.warning_once``
when ``use_cache`` meets checkpointing in training, a Dynamo graph break (``logging.Logger`` is not traced), so
the decoder runs as a graph of its own and the head and loss as another, whose backward runs first and returns
the head's gradient, added into its ``.grad`` there (``head_graph_apart``). Tied, that gradient waits in the
shared weight's input buffer for this one's: alive either way. Before, with accumulation and ``--recompute
full``, the estimate read one head gradient over the trace (fp32 V 8,000: 4,096,000 B).

The trace runs inductor's partition op by op (trace/compiled.py); real inductor lowers the put in place
into the zero table, so on a GPU this moment is an upper bound by one fp32 table (not checked on a GPU).
Per-block compile leaves the embedding eager: not this moment.
"""

from __future__ import annotations

import math

from trainmem.estimate.grad_items import token_embedding_grad
from trainmem.inventory import dtype_bytes

__all__ = ["TABLES", "embedding_backward_parts", "head_graph_apart"]

TABLES = "embedding_grad_tables"  # the moment's part: estimate/grad_accum.py reads it


def embedding_backward_parts(base, *, B: int, S: int, stored_grads: int, grad_accum: int, tied: bool,
                             activations: int, loss_scalars: int, head_grad: int = 0,
                             head_graph_apart: bool = False) -> dict[str, int] | None:
    """The live bytes at the compiled embedding backward's index-put (module docstring), or ``None`` when the
    token embedding has no gradient (frozen) or none is in the inventory. ``stored_grads``: every stored
    ``.grad`` at the end of backward; ``head_grad``: the output weight's gradient bytes; ``head_graph_apart``:
    the head runs in a graph of its own (transformers' gradient checkpointing, the module docstring)."""
    g = token_embedding_grad(base)
    if g is None or len(g.shape) != 2:
        return None
    comp = max(4, int(dtype_bytes(g.dtype)))  # float32 for 16-bit gradients, their own dtype otherwise
    table = math.prod(g.shape) * comp
    hidden = g.shape[1]
    # the output gradient in the computation dtype (a new tensor when upcast; in fp32 the incoming one)
    upcast = B * S * hidden * comp
    ids_mask = B * S  # valid & (ids != padding_idx): one byte per id
    # the graph returns every gradient at its end: the others' new ones (a tied head's part of this weight's
    # among them) are alive here; this one is not made yet (16-bit: the cast comes after) or is one of the tables
    new = stored_grads if tied else stored_grads - g.bytes
    accumulating = grad_accum > 1
    if accumulating and head_graph_apart and not tied:
        new -= head_grad  # already added into its .grad by the head's graph
    return {"gradients": new + (stored_grads if accumulating else 0), "activations": activations,
            TABLES: 2 * table, "work": upcast, "embedding_ids_mask": ids_mask, "loss_scalars": loss_scalars}


def head_graph_apart(impl) -> bool:
    """Whether whole-model compile runs the head in a graph of its own: transformers' gradient checkpointing
    (``trace/recompute.py`` ``enable_recompute``: full, every-k and op) breaks the graph (module docstring)."""
    return (impl.compile and impl.compile_scope == "model" and impl.recompute in ("full", "every-k", "op")
            and impl.profile in ("hf", "traced") and impl.framework == "hf")

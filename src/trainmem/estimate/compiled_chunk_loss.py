"""torchtune's chunked cross-entropy with its per-chunk function compiled (``--loss
torchtune-chunked-ce --compile --compile-scope block-loss``).

With ``compile=True`` torchtune's recipes call ``training.compile_loss(loss_fn)``
(torchtune/training/_compile.py ``compile_loss``, at 1814feb17 and later), which for
``CEWithChunkedOutputLoss`` compiles ``compute_cross_entropy`` alone: per chunk,
``F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")``
(torchtune/modules/loss/ce_chunked_output_loss.py). The chunking, the count of unmasked tokens and
the division stay eager.

What inductor makes of one chunk (r rows, V columns; read from its generated code and checked on
real tensors, ``tests/estimate/test_compiled_chunk_loss.py``): the forward reads the chunk's logits
once and writes the row max and the log-sum-exp ((r, 1) fp32 each) and the summed loss; no fp32
copy of the chunk and no log-softmax exist. The backward is handed the chunk's logits (its input,
in their own dtype), its labels, the row max and the log-sum-exp, and writes the logits' gradient
(r, V) in the logits' dtype beside one (r, 1) fp32 buffer.

Kept for backward, over all chunks: the logits B·S·V·d (the compiled functions' inputs: the eager
rule's fp32 log-softmax B·S·V·4 is not kept), row max and log-sum-exp B·S·4 each, the labels
B·S·8 (copies of the label chunks from B=2, views of the shifted labels at B=1) and the token count
the mean divides by (int64). No per-chunk total weight (reduction ``sum``).

Phases beside that kept set (:func:`compiled_chunk_phases`):

* forward, at the last chunk: the shifted (B, S) labels from B=2 (as the eager rule) and the running
  sum and the last chunk's loss;
* loss backward, newest chunk first: chunk j's backward writes its gradient (d·V·r_j) and a (r_j, 1)
  fp32 buffer while the gradients of the chunks after j exist in place of their logits, row
  statistics and (from B=2) labels, which their backward released;
* the head's chunk matmuls backward: as the eager rule (:func:`trainmem.estimate.losses.framework_loss_phases`),
  whose phase already leaves out every item the loss kept.

The tracer (``trace --compile --compile-scope block-loss``) runs the same partition unfused, each
node allocating its output: its loss phases are an upper bound (fp32 chunk temporaries inductor
never allocates; ``trace/compiled.py`` known limitations). The generated code read here is
inductor's C++ (CPU) wrapper; its CUDA (Triton) wrapper comes from the same scheduler, not checked
on a GPU.
"""

from __future__ import annotations

from trainmem.estimate.loss_value import loss_value
from trainmem.estimate.losses import LossPhases, _rows, check_framework_loss, framework_loss_phases
from trainmem.inventory import dtype_bytes

__all__ = ["LOSS", "compiled_chunk_items", "compiled_chunk_phases"]

LOSS = "torchtune-chunked-ce"


def compiled_chunk_items(ctx, logits) -> None:
    """What the compiled chunks keep, on ``ctx.graph`` under module ``loss``."""
    check_framework_loss(ctx)
    g, B, S, V = ctx.graph, ctx.B, ctx.S, ctx.model.vocab_size
    rg = logits.requires_grad
    with g.module("loss"):
        g.save(g.new("logits", (B * S, V), ("B·S", "V"), logits.dtype), when=rg)
        g.save(g.new("row_max", (B * S, 1), ("B·S", "1"), "float32", False),
               g.new("logsumexp", (B * S, 1), ("B·S", "1"), "float32", False),
               g.new("target", (B * S,), ("B·S",), "int64", False),
               g.new("token_count", (), (), "int64", False), when=rg)
        loss_value(g, "float32")  # total_loss / total_elements (estimate/loss_value.py)


def compiled_chunk_phases(loss: str, *, B: int, S: int, V: int, logits_dtype: str, hidden_row_bytes: int = 0,
                          head_weight_grad: int = 0, lora_head_input: int | None = None) -> LossPhases:
    """The arithmetic of the module docstring (same signature as ``framework_loss_phases``; torchtune's
    recipe frees its logits, so ``lora_head_input`` adds no head-forward moment)."""
    if loss != LOSS:
        raise ValueError(f"loss={loss!r}: only {LOSS} compiles its chunk function alone")
    d = dtype_bytes(logits_dtype)
    rows = _rows(loss, B, S)
    scalar = 4  # fp32 loss scalars
    fwd = {"labels": B * S * 8 if B > 1 else 0, "loss_scalars": 2 * scalar}
    # chunk j's backward (newest first): its gradient and (r_j, 1) buffer; the chunks after j have
    # traded their logits (d·V per row), row max and log-sum-exp (8 per row) and, from B=2, their
    # label copies (8 per row) for their gradients (d·V per row); the loss's seed and (j > 0) the
    # gradient still to reach the earlier chunks (the loss value itself is an activation item)
    per_row_freed = 8 + (8 if B > 1 else 0)
    bwd = max(d * V * r + 4 * r - per_row_freed * sum(rows[j + 1:]) + (2 if j else 1) * scalar
              for j, r in enumerate(rows))
    eager = framework_loss_phases(loss, B=B, S=S, V=V, logits_dtype=logits_dtype,
                                  hidden_row_bytes=hidden_row_bytes, head_weight_grad=head_weight_grad)
    return LossPhases({k: int(v) for k, v in fwd.items() if v}, {"logits_grad": int(bwd)}, 0, eager.head_backward)


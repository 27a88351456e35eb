"""Gradient accumulation's transients: what a micro-batch after the first holds in backward beyond
the stored gradients (``--grad-accum N``, N > 1; estimate/peak.py counts every ``.grad`` in every
phase from the second micro-batch on).

From the second micro-batch on every trainable parameter already has a ``.grad``. Backward still
makes each new gradient as a tensor of its own, and the parameter's ``AccumulateGrad`` node adds it
in place (``torch/csrc/autograd/functions/accumulate_grad.h`` ``AccumulateGrad::accumulateGrad``,
case 2.3: ``variable_grad += new_grad`` when a dense ``.grad`` exists and grad mode is off), after
which the engine frees the new one. On the first micro-batch (and at N = 1) the same tensor is
stolen as the ``.grad`` (case 1.1), so the new gradient is never counted twice there. The moments
this adds, per tensor (T: a weight's gradient bytes, BSV: batch·seq·vocab, R: the residual-sized
gradient B·S·H in the compute dtype):

* ``head_backward`` (plain cross-entropy, a trainable output weight): the head's ``MmBackward``
  holds its output gradient (the logits' gradient, BSV in the logits' dtype), its new weight
  gradient T and its input gradient R beside every stored gradient and every activation but the
  loss's (freed by the loss's nodes). Under autocast the weight gradient is made in the low dtype
  and ``ToCopyBackward0`` casts it to the parameter's: the larger of the matmul's moment (T_low,
  the logits' gradient and the low input gradient) and the cast's (T_low + T, R; the head's cast
  weight and input, saved by the matmul, were released after it ran:
  ``torch/csrc/autograd/engine.cpp`` ``Node::release_variables``).
* A tied head: the head's new gradient waits in the shared weight's ``InputBuffer`` until the
  embedding's arrives at the end of backward (``torch/csrc/autograd/input_buffer.cpp``
  ``InputBuffer::add``/``accumulate``), so it is alive through every block's backward
  (``tied_pending`` in ``backward``/``backward_first_block``); the head's moment is the same one.
  (At N = 1 the phases already count it: the gradients outside the blocks.)
* An untied token embedding: ``embedding_dense_backward`` makes a new vocab-sized gradient at the
  end of backward beside its output gradient (``backward_end``, ``new_gradient``), but where that
  phase is whole-model compile's index-put (estimate/compiled_embedding_backward.py), which counts
  what is alive there itself.
* The final Llama-style RMSNorm's backward (16-bit; estimate/block_backward.py's five fp32 temporaries
  of its input's size, no residual gradient beside them: the norm is on no residual path), with every
  ``.grad`` stored, every block's activations still alive and the norm's fp32 input saved
  (``head_backward`` when larger): with all the gradients held it outgrows the last block's norm moments.
* The loop divides the loss (``(loss / N).backward()``: trace/step.py ``one_step``): the quotient,
  one loss-dtype scalar, is alive through backward beside the loss and its seed gradient
  (``accum_loss`` in every backward phase).

Not modelled: the per-linear new gradients inside the blocks (each block moment that peak.py
models runs after its weights' ``AccumulateGrad``); framework losses' chunked heads; under
FSDP/DDP (estimate/parallel.py does not ask for these transients).
"""

from __future__ import annotations

from dataclasses import replace

from trainmem.estimate.phase import Phase
from trainmem.estimate.compiled_embedding_backward import TABLES
from trainmem.estimate.grad_items import base_items, token_embedding_grad
from trainmem.estimate.block_backward import FP32_NORM_TRANSIENTS, OTHER_NORM_KINDS, llama_norm_indices
from trainmem.inventory import Category, dtype_bytes
from trainmem.names import is_head, layer_of

__all__ = ["with_accumulation"]

#: phases that run inside a micro-batch's backward (the divided loss is alive in each)
_BACKWARD = ("backward_start", "head_backward", "backward", "backward_first_block",
             "backward_end")


def _head_casts(items) -> tuple[int, int]:
    """(weight, input) bytes of the head's autocast copies that its matmul saves (0, 0 without autocast)."""
    base = base_items(items)
    w = sum(i.bytes for i in base if i.category is Category.ACTIVATION and i.name == "lm_head.weight_cast")
    x = sum(i.bytes for i in base if i.category is Category.ACTIVATION and i.name == "lm_head.input_cast")
    return w, x


def _final_norm_input(items) -> int:
    """The fp32 input copy a Llama-style final RMSNorm saves (0: another norm, or none in fp32)."""
    acts = [i for i in base_items(items) if i.category is Category.ACTIVATION and layer_of(i.name) is None
            and is_head(i.name) and not i.name.startswith("loss.")]
    if any(i.name.rpartition(".")[2] in OTHER_NORM_KINDS for i in acts):
        return 0
    at = llama_norm_indices(acts)
    return acts[at[-1]].bytes if at else 0


def head_moment(*, head_grad: int, logits_grad: int, acts: int, residual_bytes: int, casts: tuple[int, int]
                ) -> tuple[dict[str, int], str]:
    """The head's backward with a ``.grad`` already stored: parts beside the stored gradients
    (``acts``: every activation but the loss's). ``casts``: the autocast weight and input copies."""
    w_low, x_low = casts
    mm = {"activations": acts, "logits_grad": logits_grad, "new_gradient": w_low or head_grad,
          "work": x_low or residual_bytes}
    note = ("the head's matmul backward with its .grad stored: its new weight gradient (added in place by "
            "AccumulateGrad after), the logits' gradient and its input gradient")
    if not w_low:
        return mm, note
    cast = {"activations": acts - w_low - x_low, "new_gradient": w_low + head_grad, "work": residual_bytes}
    if sum(cast.values()) > sum(mm.values()):
        return cast, ("the head's weight gradient cast back to the parameter's dtype (ToCopyBackward0) with its "
                      ".grad stored: the low-precision gradient and its cast, the input gradient")
    return mm, note


def with_accumulation(out: list, items, *, grad_accum: int, loss: str, loss_dtype: str, logits_grad: int,
                      residual_bytes: int, head_grad: int, tied: bool, gradients: int, head_acts: int,
                      block_acts: int, static: dict[str, int], bufs: dict[str, int]) -> list:
    """``out`` (peak.py's phases) with gradient accumulation's transients (the module docstring).
    ``head_grad``: the output weight's gradient bytes (0: frozen); ``tied``: that weight is the input
    embedding's and the head runs; ``head_acts``: activations alive at the head's backward;
    ``block_acts``: every activation but the head's and the loss's; ``gradients``: every stored
    ``.grad``; ``static``/``bufs``: what every phase holds besides."""
    if grad_accum <= 1:
        return out
    scalar = dtype_bytes(loss_dtype) if loss != "none" else 0
    pending = head_grad if tied else 0
    g = None if tied else token_embedding_grad(items)
    emb = g.bytes if g else 0
    new: list = []
    for ph in out:
        parts = dict(ph.parts)
        note = ph.note
        if ph.name in _BACKWARD and scalar:
            parts["accum_loss"] = parts.get("accum_loss", 0) + scalar
        if ph.name in ("backward", "backward_first_block") and pending:
            parts["tied_pending"] = pending
            note += "; the tied head's new gradient waits for the embedding's"
        if ph.name == "backward_end" and emb and TABLES not in parts:
            parts["new_gradient"] = parts.get("new_gradient", 0) + emb
            note += "; the embedding's new gradient, added in place into its .grad"
        new.append(replace(ph, bytes=sum(parts.values()), parts=parts, note=note))
        if ph.name == "backward_start" and loss == "ce" and head_grad:
            new.append(_head_phase(items, static, bufs, gradients=gradients, scalar=scalar, pending=pending,
                                   block_acts=block_acts, moment=head_moment(
                                       head_grad=head_grad, logits_grad=logits_grad, acts=head_acts,
                                       residual_bytes=residual_bytes, casts=_head_casts(items))))
    return new


def _head_phase(items, static, bufs, *, gradients: int, scalar: int, pending: int, block_acts: int,
                moment: tuple[dict[str, int], str]):
    """``head_backward``: the larger of the head's moment and the final norm's (the module docstring)."""
    parts, note = {"gradients": gradients, **moment[0], "loss_scalars": 2 * scalar, "accum_loss": scalar}, moment[1]
    x = _final_norm_input(items)
    norm = {"gradients": gradients, "tied_pending": pending, "activations": block_acts + x,
            "node_work": FP32_NORM_TRANSIENTS * x, "loss_scalars": 2 * scalar, "accum_loss": scalar}
    if x and sum(norm.values()) > sum(parts.values()):
        parts, note = norm, ("the final RMSNorm's backward with every .grad stored: every block's activations, its "
                             "fp32 input and five fp32 temporaries of that size" +
                             ("; the tied head's new gradient" if pending else ""))
    return _phase("head_backward", static, bufs, parts, note)


def _phase(name: str, static: dict[str, int], bufs: dict[str, int], parts: dict[str, int], note: str):
    full = {k: v for k, v in {**static, **parts, **bufs}.items() if v or k in static}
    return Phase(name, sum(full.values()), full, note)

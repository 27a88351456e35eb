"""The loss value: the 0-dim tensor a training step's forward returns, an item of its own.

Autograd does not save it; the caller holds it (``loss = model(...).loss; loss.backward()``) from
the end of the forward until its backward is done, then drops it (``del loss`` or the next
micro-batch's rebinding), so it is alive in the ``forward`` phase and through backward, as the
trace and the measured step hold it (``trace/step.py`` ``one_step``, ``measure/workload.py``: each
micro-batch deletes its loss after ``backward()``, before the optimizer step). Its bytes are one
element of the dtype the framework computes the loss in:

* transformers' ``ForCausalLMLoss`` (transformers/loss/loss_utils.py): ``logits.float()`` then
  ``fixed_cross_entropy``, whose ``reduction="mean"`` (no ``num_items_in_batch``) returns
  ``nll_loss``'s first output itself: fp32, 4 B, made before nll_loss's ``total_weight``
  (aten ``nll_loss_forward`` allocates ``output`` first), so the estimate creates it first too and
  the join keys (``(root):4B:0`` the loss, ``:1`` the total weight) name the same tensors. Where a
  family's loss runs in the logits' dtype (no upcast, no autocast) it is that dtype.
* torchtune's ``CEWithChunkedOutputLoss.forward`` (torchtune/modules/loss/ce_chunked_output_loss.py):
  ``total_loss / total_elements`` after every chunk's fp32 summed cross-entropy: fp32, 4 B, made
  after the chunks' total weights (``(root):4B:8`` with 8 chunks).
* LitGPT's ``chunked_cross_entropy`` (litgpt/utils.py): ``torch.cat(losses).sum() / count`` on
  per-row losses in the logits' dtype: 2 B in bf16, 4 B in fp32.
* trainmem's own ``chunked-ce`` / ``fused-ce`` accumulate in fp32: 4 B; the reference model's
  ``F.cross_entropy(logits.float(), ...)``: fp32, 4 B.

Formula: ``1·d`` (d the loss dtype's item size). The phases (``estimate/peak.py``) count it with the
activations: it is a ``loss.*`` item, in the head's activations, whose backward phases add the
loss and its gradient seed (``loss_scalars``) once the head's saved set is gone.

Where checked: ``tests/measure/test_loss_value_join.py`` (estimate, trace and a measured CPU step
join on it per key, tiny Llama and GPT-2, fp32 and bf16) and ``tests/measure/test_measure_join.py``.
"""

from __future__ import annotations

from trainmem.estimate.graph import Graph, Sym

__all__ = ["LOSS_VALUE", "loss_value"]

LOSS_VALUE = "value"
"""The item's label under the loss scope: ``loss.value``."""


def loss_value(g: Graph, dtype: str) -> Sym:
    """The 0-dim loss the caller holds until backward is done, kept as an item on ``g`` (call it
    inside the ``loss`` module scope, where the framework makes it)."""
    t = g.new(LOSS_VALUE, (), (), dtype)
    g.save(t)
    return t

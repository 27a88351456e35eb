"""The LM loss under tensor parallelism: vocab-sharded (``loss_parallel``) or gathered logits.

torchtitan (``torchtitan/models/llama3/infra/parallelize.py``, ``apply_tp`` at 238fa99) makes the
output projection ``ColwiseParallel(output_layouts=Shard(-1) if loss_parallel else Replicate(),
use_local_output=not loss_parallel)`` and runs the step inside
``torch.distributed.tensor.parallel.loss_parallel()`` when TP is on and
``[parallelism] disable_loss_parallel`` is false (``torchtitan/train.py``, ``Trainer.__init__``;
``torchtitan/distributed/utils.py``, ``get_train_context``):

* **loss parallel** (``ParallelSpec.loss_parallel``, the default): each rank keeps its B·S·V/tp
  logits; ``torch/distributed/tensor/parallel/loss.py`` (``_log_softmax``, ``_nll_loss_forward``)
  computes the log-softmax on the local shard with all-reduced max and sum, so the logits, the
  saved log-softmax and its gradient are all V/tp wide: the rank-local model's vocabulary
  (``parallel_tp.apply_tp``) already gives these items, nothing more is needed here;
* **gathered logits** (``loss_parallel=False``; also Hugging Face's ``colwise_gather_output``
  head): the local B·S·V/tp matmul output is all-gathered (``Replicate``: funcol
  ``all_gather_into_tensor`` into a rank-major buffer, then ``cat`` along the vocabulary) into a
  plain B·S·V tensor on every rank, and the loss is the single-device loss over the full
  vocabulary. Its items and phases are those of the model with the full vocabulary
  (:func:`loss_model`), plus one moment (:func:`gather_phase`): the local logits, the gather
  buffer and the concatenated logits alive at once, before the loss's own tensors exist.

Checked on CPU against torchrun (gloo, 2 ranks, DTensor TP, tiny Llama):
tests/parallel/test_loss_parallel_dist.py.
"""

from __future__ import annotations

from dataclasses import replace

from trainmem.estimate.peak import Phase
from trainmem.inventory import MemoryItem, dtype_bytes
from trainmem.specs import ModelSpec, ParallelSpec

__all__ = ["check", "gathered_logits", "loss_model", "with_loss_items", "gather_phase", "sharded_loss_phases", "fused_backward_rows"]


def gathered_logits(par: ParallelSpec) -> bool:
    """True when every TP rank holds the full-vocabulary logits (TP without ``loss_parallel``)."""
    return par.tp > 1 and not par.loss_parallel


def loss_model(model: ModelSpec, local: ModelSpec, par: ParallelSpec) -> ModelSpec:
    """The model whose logits the loss reads: the TP-local one (V/tp) under loss parallel, the
    TP-local one with the full vocabulary when the logits are gathered."""
    return replace(local, vocab_size=model.vocab_size) if gathered_logits(par) else local


def with_loss_items(acts, full_acts, outputs) -> tuple[MemoryItem, ...]:
    """``acts`` with the output layer's and the loss's items (those whose module is one of
    ``outputs``) taken from ``full_acts``, the same rules run on :func:`loss_model`. The head's
    saved input does not depend on the vocabulary; the loss's log-softmax does."""
    full = {it.name: it for it in full_acts if it.name.split(".")[0] in outputs}
    out = tuple(full.get(it.name, it) for it in acts)
    missing = set(full) - {it.name for it in out}
    if missing:  # the two runs differ only in the vocabulary: the same items, by name
        raise AssertionError(f"head items differ between the local and the full-vocabulary rules: {sorted(missing)}")
    return out


def gather_phase(forward: Phase, *, B: int, S: int, vocab: int, tp: int, logits_dtype: str,
                 loss_act: int) -> Phase:
    """The all-gather of the logits, at the end of the forward: the local shard (B·S·⌈V/tp⌉), the
    gather's output buffer and the concatenated logits (B·S·V each) alive together, the loss's own
    saved tensors (``loss_act``: log-softmax, target) not made yet. ``forward``: the end-of-forward
    phase (the loss running on the gathered logits), whose other parts are alive here too.

    torch/distributed/tensor/_redistribute.py and placement_types.py (``Shard._to_replicate_tensor``):
    ``funcol.all_gather_tensor`` gathers along dim 0 and, for a shard dim other than 0, splits the
    result by rank and ``cat``s it along the shard dim, so both B·S·V tensors exist when ``cat`` returns."""
    lb = dtype_bytes(logits_dtype)
    local, full = int(B * S * -(-vocab // tp) * lb), int(B * S * vocab * lb)
    parts = {k: v for k, v in forward.parts.items() if k != "logits"}
    parts["activations"] = parts.get("activations", 0) - loss_act
    parts["logits_gather"] = local + 2 * full
    return Phase("logits_all_gather", sum(parts.values()), parts,
                 "TP without loss_parallel: the local logits, the all-gather buffer and the gathered logits "
                 f"(B·S·V/tp + 2·B·S·V, {lb:g} B each), before the loss")


def check(profile: str, par: ParallelSpec) -> None:
    """Megatron's cross-entropy is always vocab-parallel (megatron/core/tensor_parallel/cross_entropy.py,
    ``vocab_parallel_cross_entropy``): gathered logits are not one of its choices."""
    if gathered_logits(par) and profile == "megatron":
        from trainmem.errors import SpecError

        raise SpecError("loss_parallel", False, "the megatron profile's cross-entropy is always vocab-parallel")


def sharded_loss_phases(ph: list[Phase], *, B: int, S: int, local_vocab: int, loss_dtype: str) -> list[Phase]:
    """The single-device ``ce`` phases (estimate/peak.py) with the vocab-parallel loss's own
    temporaries, each ``u`` = B·S·V/tp in the loss dtype (torch/distributed/tensor/parallel/loss.py):

    * forward, ``_log_softmax``: ``shifted = x - max`` stays alive beside ``exp(shifted)`` and then
      beside the result (the saved log-softmax): one more ``u`` than the fused single-device kernel;
    * ``backward_start``, ``_nll_loss_and_log_softmax_backward`` (nll and log-softmax backward fused,
      ``_log_softmax_backward_handler`` only casts): ``zeros_like(x)``, ``exp(x)`` and their sum are
      alive at once, then the zeros, the sum and the product: three ``u`` where the single-device
      rule has two (the log-softmax output's gradient and the logits'). Beside them, per target row
      (:func:`fused_backward_rows`), the handler's index tensors, and the target and total weight
      ``NllLossBackward0`` saved: the fused backward runs inside that node, which releases them only when
      it returns (one device's moment is ``LogSoftmaxBackward0``'s, after it did).

    Inside one DTensor op: a dispatch mode above DTensor (measure_dist's op-boundary tracker) sees none of
    these; the CPU allocator's profile (torch.profiler, profile_memory) does (tests/estimate/test_loss_parallel.py),
    and so does the trace (trace/parallel_tp.py ``loss_handlers_seen``)."""
    u = int(B * S * local_vocab * dtype_bytes(loss_dtype))
    out = []
    for p in ph:
        parts = dict(p.parts)
        if p.name == "forward":
            parts["log_softmax_shifted"] = u
            p = replace(p, bytes=sum(parts.values()), parts=parts,
                        note=p.note + "; loss_parallel: the shifted logits beside exp and the result (B·S·V/tp)")
        elif p.name == "backward_start" and "logits_grad" in parts:
            parts["logits_grad"] = 3 * u
            parts["loss_parallel_rows"] = fused_backward_rows(B * S, loss_dtype)
            p = replace(p, bytes=sum(parts.values()), parts=parts,
                        note="loss_parallel backward (nll and log-softmax fused): zeros, exp and their sum, "
                             "3·B·S·V/tp, beside the handler's per-row index tensors and nll's saved target")
        out.append(p)
    return out


def fused_backward_rows(rows: int, loss_dtype: str) -> int:
    """The bytes per target row alive at the fused backward's ``(grad_input + exp(x)) * grad_output``
    (torch/distributed/tensor/parallel/loss.py ``_nll_loss_and_log_softmax_backward``), beside the three
    B·S·V/tp tensors: ``safe_target`` (``where``, int64), ``_MaskPartial._partition_value``'s mask (bool,
    kept as the placement's ``mask_buffer``) and its shifted target (int64), ``grad_update`` (the mask
    cast to the loss dtype, minus one), ``arange_1d`` (int64) and the masked ``grad_output`` (``where``,
    the loss dtype); and what ``NllLossBackward0`` still holds: its saved target (the shifted labels,
    int64, transformers ``ForCausalLMLoss``) and total weight (0-d, the loss dtype). Tiny Llama B2 S64
    (128 rows, fp32): 128·(8 + 1 + 8 + 4 + 8 + 4) + 128·8 + 4 = 5,252 B, the trace's (and a real
    step's) moment over the three tensors."""
    lb = dtype_bytes(loss_dtype)
    return rows * (8 + 1 + 8 + lb + 8 + lb) + rows * 8 + lb

"""The chunked losses of torchtune and LitGPT, run by the tracer on a Hugging Face causal LM.

``StepSpec.loss`` picks how the step turns the last hidden state into a loss:

* ``ce``: the model's own ``labels=`` loss (transformers' ``ForCausalLMLoss``), not handled here.
* ``torchtune-chunked-ce``: torchtune's ``TransformerDecoder.chunked_output`` (the output projection
  per chunk of the sequence, ``h.chunk(8, dim=1)``; torchtune/modules/transformer.py, set by
  ``set_num_output_chunks``) and ``CEWithChunkedOutputLoss`` (torchtune/modules/loss/
  ce_chunked_output_loss.py, ``forward`` and ``compute_cross_entropy``: each chunk upcast with
  ``.float()`` and passed to ``F.cross_entropy(..., reduction="sum")``), after the recipe's label
  shift (recipes/full_finetune_single_device.py ``_loss_step``: ``hstack`` of ``labels[..., 1:]``
  and the ``ignore_labels_cache`` column, then ``del logits`` before backward).
* ``litgpt-chunked-ce``: LitGPT's ``GPT.forward(lm_head_chunk_size=128)`` (litgpt/model.py: the
  head per 128-token split) and ``chunked_cross_entropy`` (litgpt/utils.py, the list branch: one
  ``F.cross_entropy(reduction="none")`` per chunk on the logits as they are, bf16 under
  ``bf16-true``: no upcast), as litgpt/finetune/lora.py calls them (the last chunk sliced
  ``[..., :-1, :]``, targets ``[..., 1:]``). The training loop keeps ``logits`` bound through
  backward and the optimizer step: the trace holds them there too (:class:`HeldLogits`).

The code is trainmem's own, written from those functions; ``tests/trace/test_trace_framework_losses.py``
checks it against torchtune's real ``CEWithChunkedOutputLoss`` on CPU where torchtune is installed.

Known limitations: LitGPT's loop also holds the previous step's logits through the next forward
(the name is rebound only when the new forward returns); the tracer drops them after the optimizer
step. Models with a final logit softcap (Gemma-2) are refused: neither framework's chunked path is
written for them here.
"""

from __future__ import annotations

from trainmem.errors import UnsupportedError
from trainmem.specs.step import FRAMEWORK_LOSSES, LITGPT_CHUNK, TORCHTUNE_CHUNKS  # not estimate/: no cycle

__all__ = ["FRAMEWORK_LOSSES", "TORCHTUNE_CHUNKS", "LITGPT_CHUNK", "HeldLogits", "framework_loss"]

IGNORE_INDEX = -100


class HeldLogits:
    """What the training loop keeps bound after the loss: LitGPT's ``logits`` list."""

    def __init__(self) -> None:
        self.logits: list = []

    def clear(self) -> None:
        self.logits = []


def _parts(model):
    """(the decoder that returns the last hidden state, the output projection) of a causal LM,
    under peft's wrapper too."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    if head is None or getattr(hf, "base_model", hf) is hf:
        raise UnsupportedError(f"{type(hf).__name__} has no output projection over a base model: the chunked "
                               "losses are LM-head losses (use loss='ce')")
    if getattr(hf.config, "final_logit_softcapping", None):
        raise UnsupportedError("the chunked losses are not modelled with a final logit softcap (Gemma-2)")
    return hf.base_model, head


def chunk_cross_entropy(logits, labels):
    """CEWithChunkedOutputLoss.compute_cross_entropy: the upcast, then a summed CE (what torchtune's
    ``compile_loss`` compiles alone)."""
    import torch.nn.functional as F
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def framework_loss(name: str, model, ids, *, ignore_labels=None, held: HeldLogits | None = None,
                   chunk_ce=chunk_cross_entropy):
    """One forward and loss of ``model`` on ``ids`` as the framework ``name`` runs it; ``chunk_ce``:
    torchtune's per-chunk function (compiled under ``compile_scope='block-loss'``)."""
    decoder, head = _parts(model)
    if name not in FRAMEWORK_LOSSES:
        raise UnsupportedError(f"loss={name!r} is not a framework loss ({', '.join(FRAMEWORK_LOSSES)})")
    # the model returns the chunks' logits and drops h (B, S, H), as both frameworks' forward does:
    # from B=2 a chunk along the sequence is not contiguous, so each head matmul keeps its own copy
    split = (lambda h: h.chunk(TORCHTUNE_CHUNKS, dim=1)) if name == "torchtune-chunked-ce" else (
        lambda h: h.split(LITGPT_CHUNK, dim=1))
    logits = [head(x) for x in split(decoder(input_ids=ids).last_hidden_state)]
    if name == "torchtune-chunked-ce":  # TransformerDecoder.chunked_output
        return _torchtune(logits, ids, ignore_labels, chunk_ce)
    return _litgpt(logits, ids, held)  # GPT.forward(lm_head_chunk_size=128)


def _torchtune(logits, ids, ignore_labels, chunk_ce):
    import torch

    if ignore_labels is None:
        ignore_labels = torch.full((ids.shape[0], 1), IGNORE_INDEX, dtype=ids.dtype)
    labels = torch.hstack((ids[..., 1:], ignore_labels[: ids.shape[0]]))  # _loss_step's shift
    # CEWithChunkedOutputLoss.forward, in its order: the count, the label chunks, the logit rows
    total = (labels != IGNORE_INDEX).sum()
    label_chunks = [c.reshape(-1) for c in labels.chunk(TORCHTUNE_CHUNKS, dim=1)]
    rows = [lg.reshape(-1, lg.size(-1)) for lg in logits]
    loss = 0.0
    for lg, lb in zip(rows, label_chunks):
        loss += chunk_ce(lg, lb)
    del rows, label_chunks
    loss = loss / total
    del logits  # _loss_step: "free logits otherwise it peaks backward memory"
    return loss


def _litgpt(logits, ids, held: HeldLogits | None):
    import torch
    import torch.nn.functional as F

    logits[-1] = logits[-1][..., :-1, :]  # finetune/lora.py: output n predicts token n+1
    targets = ids[..., 1:]
    chunks = [lg.reshape(-1, lg.size(-1)) for lg in logits]
    target_chunks = [t.reshape(-1) for t in targets.split(logits[0].size(1), dim=1)]
    losses = [F.cross_entropy(lg, t, ignore_index=IGNORE_INDEX, reduction="none")
              for lg, t in zip(chunks, target_chunks)]
    kept = (targets != IGNORE_INDEX).sum()
    loss = torch.cat(losses).sum() / kept.maximum(torch.ones_like(kept))
    if held is not None:
        held.logits = logits
    return loss

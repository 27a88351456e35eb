"""What torchtune's fine-tuning loop keeps on the device besides the model, its states and the batch.

torchtune's supervised fine-tuning recipes (``recipes/full_finetune_single_device.py``,
``lora_finetune_single_device.py`` and their distributed versions, ``_setup_data``/``setup``) make
``self.ignore_labels_cache = torch.full((cfg.batch_size, 1), self._loss_fn.ignore_index,
device=self._device)`` once and keep it: ``_loss_step`` shifts the labels with ``torch.hstack((labels[...,
1:], self.ignore_labels_cache[: labels.shape[0]]))``. One (B, 1) int64 tensor, B·8 bytes, alive in every
phase of every step, the optimizer's included. trainmem models torchtune's loop where the step uses its
loss (``--loss torchtune-chunked-ce``, what ``--torchtune`` reads from ``CEWithChunkedOutputLoss``); the tracer
makes the same tensor before the step (``trace/step.py``, ``trace/losses.py`` ``_torchtune``).

Known limitations: a torchtune recipe run with ``torch.nn.CrossEntropyLoss`` (``--loss ce``) keeps it too, but
the estimate cannot tell that step from a Hugging Face one, so it is not counted there.
"""

from __future__ import annotations

from trainmem.inventory import Category, MemoryItem

__all__ = ["IGNORE_LABELS_CACHE", "torchtune_loop_items"]

IGNORE_LABELS_CACHE = "ignore_labels_cache"
TORCHTUNE_LOSS = "torchtune-chunked-ce"  # specs/step.py: the loss only torchtune's loop runs


def torchtune_loop_items(step) -> list[MemoryItem]:
    """The recipe's ``ignore_labels_cache``, (B, 1) int64, under torchtune's loss; [] otherwise."""
    if step.loss != TORCHTUNE_LOSS:
        return []
    return [MemoryItem(name=IGNORE_LABELS_CACHE, category=Category.BUFFER, shape=(step.batch, 1), dtype="int64",
                       bytes=step.batch * 8, formula="B·1·8", dims=("B", "1"),
                       note="torchtune recipe's ignore_labels_cache (torch.full((batch_size, 1), ignore_index)), made "
                            "at setup and kept all step; not a registered buffer")]

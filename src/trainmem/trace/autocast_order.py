"""Autocast's cast-cache frees, recorded in allocation order.

A recording must not depend on what ran before it in the process. The one order found to depend on
memory addresses (NeoX and Llama, fp32 and amp-bf16, LoRA and full, selective and full recompute:
tests/trace/test_trace_process_independent.py) is that of autocast's cast cache:
``torch.clear_autocast_cache`` (called by ``torch.autocast.__exit__`` at nesting 0,
torch/amp/autocast_mode.py, in forward and in each checkpoint's recompute) empties ``cached_casts``, a
``ska::flat_hash_map`` keyed by ``TensorImpl*`` (aten/src/ATen/autocast_mode.cpp ``clear_cache``), so its
16-bit copies die in an order set by where the allocator placed them. While recording, the frees made by
that call are recorded in allocation order instead: the same set of frees between the same two
allocations, in one order (no op, so no allocation, runs inside it).
"""

from __future__ import annotations

import torch

from trainmem.trace.block_book import BlockBook

__all__ = ["AutocastFreesInOrder"]


class AutocastFreesInOrder:
    """While entered, ``torch.clear_autocast_cache`` is torch's own with its frees held by ``book`` and
    recorded in allocation order."""

    def __init__(self, book: BlockBook) -> None:
        self._book = book
        self._torch_clear = None  # torch's own, while it is patched

    def _clear(self) -> None:
        with self._book.frees_in_allocation_order():
            self._torch_clear()

    def __enter__(self) -> "AutocastFreesInOrder":
        self._torch_clear = torch.clear_autocast_cache
        torch.clear_autocast_cache = self._clear
        return self

    def __exit__(self, *exc) -> None:
        if self._torch_clear is not None:
            torch.clear_autocast_cache, self._torch_clear = self._torch_clear, None

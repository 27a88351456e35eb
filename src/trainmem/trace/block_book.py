"""The recorder's bookkeeping: live storages as :class:`~trainmem.trace.recording.Block` s, their
allocations, frees and resizes as events of a :class:`~trainmem.trace.recording.Recording`.

Storages live in a :class:`trainmem.trace.storages.StorageTracker` (keyed by
``untyped_storage()._cdata``, held only through weak references, so recording never changes a
lifetime; DTensors read through their local shard). A storage seen at a new size (an op
output after ``aten.resize_``) is recorded as the caching allocator serves it: the old block is
freed and a block of the new size allocated. Two kinds of storage are never device-allocator blocks:
Adam's host-side ``step`` counters, and bitsandbytes' paged optimizer states (CUDA unified memory,
trace/low_bit_optim.py), which get blocks of their own list (``Recording.paged``) and no events.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from trainmem.trace.recording import CUDA_MIN_BLOCK_BYTES, ORIGIN_STATE, Block, Recording, round_up
from trainmem.trace.storages import Entry, StorageTracker

__all__ = ["BlockBook"]


class BlockBook:
    """Blocks of ``rec`` for the storages it is shown; ``active_modules`` (innermost last) get the
    per-module peaks. ``phase`` and ``op`` are set by the recorder as ops run; nothing is recorded
    unless ``open``."""

    def __init__(self, rec: Recording, active_modules: list[str]) -> None:
        self.rec = rec
        self.phase = "forward"
        self.op: str | None = None  # the op running now: a storage it resizes is reallocated by it
        self.open = False
        self.follow_streams = False  # number each block's stream (FSDP2's side streams)
        self._active = active_modules
        # entry.data: the storage's current Block (id -1 while it has no bytes)
        self.storages = StorageTracker(granularity=CUDA_MIN_BLOCK_BYTES, on_free=self._on_free,
                                       on_resize=self._on_resize)
        self._default_stream = torch.cpu.current_stream()
        self._streams: dict[int, int] = {}  # id of a side stream -> its number (stream)
        self._paged: dict[int, Block] = {}  # unified-memory storages (paged optimizer states), by storage key
        self._host_steps: set[int] = set()  # storages of Adam's host-side step counters: never device bytes
        self._held_frees: list[Block] | None = None  # frees held by frees_in_allocation_order

    def set_phase(self, phase: str) -> None:
        if phase != self.phase:
            self.phase = phase
            self.rec.marks.append((len(self.rec.events), phase))

    def register(self, t: torch.Tensor, origin: str, module: str, op: str = "", name: str = "") -> Block | None:
        """``t``'s storage, a block allocated now if it is new; its block (None while it has no bytes)."""
        entry, new = self.storages.add(t)
        if new:
            entry.data = Block(-1, 0, 0, op, module, self.phase, origin, tuple(t.shape),
                               str(t.dtype).removeprefix("torch."), -1, name=name)
            if entry.nbytes:
                self._open_block(entry)
        return entry.data if entry.data.id >= 0 else None

    def claim(self, t: torch.Tensor, origin: str, module: str, name: str) -> None:
        """Register ``t`` as ``origin`` named ``name``, even if an op made its storage."""
        blk = self.register(t, origin, module, name=name)
        if blk is not None:
            blk.origin, blk.name = origin, name

    def block_of(self, t: torch.Tensor) -> Block | None:
        """The current block of ``t``'s storage, if it is followed and has bytes."""
        entry = self.storages.get(t)
        return entry.data if entry is not None and entry.data.id >= 0 else None

    def mark_saved(self, t: torch.Tensor) -> torch.Tensor:
        """The saved-tensor pack hook: ``t``'s block is saved for backward."""
        blk = self.block_of(t)
        if blk is not None:
            blk.saved = True
        return t

    def stream(self) -> int:
        """The CPU stream current now, numbered in order of first use (0: the default stream). FSDP2 enters
        its all-gather and reduce-scatter streams with ``device_handle.stream``, which on CPU is
        ``torch.cpu.stream`` and sets ``torch.cpu.current_stream()`` where a CUDA run switches streams."""
        current = torch.cpu.current_stream()
        if current is self._default_stream:
            return 0
        return self._streams.setdefault(id(current), len(self._streams) + 1)

    def _open_block(self, entry: Entry, op: str | None = None, in_flight: int = 0) -> None:
        """A block of the storage's current size, allocated now (by ``op``), like ``entry.data``
        otherwise; ``in_flight``: bytes of the block it replaces, alive until the copy is done."""
        blk = replace(entry.data, id=len(self.rec.blocks), nbytes=entry.nbytes, size=round_up(entry.nbytes),
                      op=entry.data.op if op is None else op, phase=self.phase, alloc_at=len(self.rec.events),
                      free_at=None, saved=False, stream=self.stream() if self.follow_streams else 0)
        entry.data = blk
        self.rec.blocks.append(blk)
        self.rec.events.append(blk.id)
        total = self.storages.live_bytes + in_flight
        for mod in self._active:
            k = (mod, self.phase)
            if total > self.rec.module_peaks.get(k, 0):
                self.rec.module_peaks[k] = total

    def _close_block(self, blk: Block) -> None:
        if blk.id >= 0 and blk.free_at is None:
            blk.free_at = len(self.rec.events)
            self.rec.events.append(~blk.id)

    def _on_free(self, entry: Entry) -> None:
        if self.open:
            if self._held_frees is not None:
                self._held_frees.append(entry.data)
            else:
                self._close_block(entry.data)

    @contextlib.contextmanager
    def frees_in_allocation_order(self):
        """The frees made inside the block are recorded at its end, in allocation order (for a call that
        frees several storages in an order set by their addresses and allocates none: trace/autocast_order.py)."""
        self._held_frees = []
        try:
            yield
        finally:
            held, self._held_frees = self._held_frees, None
            for blk in sorted(held, key=lambda b: b.id):
                self._close_block(blk)

    def _on_resize(self, entry: Entry, old_nbytes: int) -> None:
        """Like the caching allocator's ``resize_bytes_cuda`` (aten/src/ATen/native/cuda/Resize.cpp):
        the new block is allocated and the contents copied before the old block is freed."""
        if not self.open:
            return
        old = entry.data
        if entry.nbytes:
            self._open_block(entry, self.op, in_flight=old.size if old.id >= 0 else 0)
        self._close_block(old)

    # -- storages that are not device-allocator blocks ---------------------------------
    def add_host_step(self, t: torch.Tensor) -> None:
        """Adam's 0-dim ``step`` lives on the host on CUDA unless capturable/fused."""
        self._host_steps.add(t.untyped_storage()._cdata)

    def is_host_step(self, t: torch.Tensor) -> bool:
        return bool(self._host_steps) and t.untyped_storage()._cdata in self._host_steps

    def is_paged(self, t: torch.Tensor) -> bool:
        return bool(self._paged) and t.untyped_storage()._cdata in self._paged

    def register_paged(self, t: torch.Tensor, *, name: str = "", op: str = "get_paged") -> None:
        """A paged optimizer state (``F.get_paged``'s managed buffer): a block of its own list,
        never an allocation event, so allocated and reserved leave it out."""
        key = t.untyped_storage()._cdata
        blk = self._paged.get(key)
        if blk is None:
            nbytes = t.untyped_storage().nbytes()
            blk = Block(len(self.rec.paged), nbytes, nbytes, op, "optimizer", self.phase, ORIGIN_STATE,
                        tuple(t.shape), str(t.dtype).removeprefix("torch."), -1)
            self._paged[key] = blk
            self.rec.paged.append(blk)
        if name:
            blk.name = name

"""A model of PyTorch's CUDA caching allocator, replayed on a recorded alloc/free trace.

Pure Python, no torch. It follows ``c10/cuda/CUDACachingAllocator.cpp``:

* every request is rounded up to 512 bytes (``kMinBlockSize``);
* requests of at most 1 MiB (``kSmallSize``) use the small pool, larger ones the large pool;
* a new segment is 2 MiB (``kSmallBuffer``) for small requests, 20 MiB (``kLargeBuffer``) for
  requests under 10 MiB (``kMinLargeAlloc``), and the request rounded up to 2 MiB
  (``kRoundLarge``) above that;
* a free block is found best-fit (smallest size, then lowest address) within the pool;
* a block is split when the remainder is at least 512 bytes (small pool, or any pool with
  expandable segments) or more than 1 MiB (large pool); freed blocks merge with free neighbours;
* each stream has its own pools: a block freed on one stream is never handed to a request made on
  another (``BlockPool`` orders blocks by stream first and ``get_free_block`` stops at a block of
  another stream; a segment belongs to the stream that made it), so ``malloc(..., stream=s)``
  searches and grows stream ``s``'s pools only (default stream ``0``);
* segments are never returned (no ``empty_cache``), so reserved bytes only grow; unless
  ``capacity_bytes`` is given: then a new segment that would take reserved bytes past it first
  releases every cached segment that is wholly free (not split), as ``DeviceCachingAllocator::malloc``
  does when cudaMalloc fails (``release_cached_blocks``, then ``alloc_block`` again); if it still
  does not fit, ``out_of_memory`` is set and the replay goes on (the real one raises);
* with ``expandable_segments`` each pool is one segment that grows at its end in pages of
  2 MiB (small pool) or 20 MiB (large pool), extending a free block at the end when there is one.

Known limitations:
  - Streams are pools only: no events, no ``record_stream``; no CUDA graphs, no
    ``max_split_size_mb``/``roundup_power2_divisions`` and
    unlimited device memory unless ``capacity_bytes`` (then without expandable segments only;
    ``release_available_cached_blocks`` is a no-op at the default ``max_split_size``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Hashable, Iterable

__all__ = ["CachingAllocator", "Replay", "replay", "round_size", "allocation_size",
           "MIN_BLOCK", "SMALL_SIZE", "SMALL_BUFFER", "LARGE_BUFFER", "MIN_LARGE_ALLOC", "ROUND_LARGE"]

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(nbytes: int) -> int:
    """Bytes the allocator hands out for a request: 512-byte multiples, at least 512."""
    if nbytes < MIN_BLOCK:
        return MIN_BLOCK
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def allocation_size(size: int) -> int:
    """Size of the segment cudaMalloc'ed for a (rounded) request that found no free block."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False, slots=True)
class _Block:
    addr: int
    size: int
    segment: "_Segment"
    requested: int = 0
    allocated: bool = False
    prev: "_Block | None" = None
    next: "_Block | None" = None


@dataclass(eq=False)
class _Segment:
    addr: int
    size: int
    small: bool
    first: _Block | None = None
    stream: Hashable = 0

    def blocks(self) -> list[_Block]:
        out, b = [], self.first
        while b is not None:
            out.append(b)
            b = b.next
        return out


@dataclass
class _Pool:
    small: bool
    stream: Hashable = 0
    free: list[tuple[int, int, _Block]] = field(default_factory=list)  # (size, addr, block), sorted
    segments: list[_Segment] = field(default_factory=list)

    def add_free(self, b: _Block) -> None:
        bisect.insort(self.free, (b.size, b.addr, b), key=lambda e: (e[0], e[1]))

    def remove_free(self, b: _Block) -> None:
        i = bisect.bisect_left(self.free, (b.size, b.addr), key=lambda e: (e[0], e[1]))
        assert self.free[i][2] is b
        del self.free[i]

    def best_fit(self, size: int) -> _Block | None:
        i = bisect.bisect_left(self.free, (size, -1), key=lambda e: (e[0], e[1]))
        return self.free[i][2] if i < len(self.free) else None


class CachingAllocator:
    """Allocate and free by key; read ``reserved_bytes`` and ``allocated_bytes`` at any time."""

    def __init__(self, *, expandable_segments: bool = False, capacity_bytes: int | None = None) -> None:
        if capacity_bytes is not None and expandable_segments:
            raise ValueError("capacity_bytes is modelled without expandable segments only")
        self.expandable = expandable_segments
        self.capacity = capacity_bytes
        self.out_of_memory = False  # a segment did not fit capacity_bytes even after the release
        self.released_bytes = 0  # segments given back by the release (cudaFree)
        self._pools = {True: _Pool(True), False: _Pool(False)}  # stream 0's; others keyed (small, stream)
        self._live: dict[Hashable, _Block] = {}
        self._next_addr = 1 << 40  # fake device addresses, segments never overlap
        self.reserved_bytes = 0
        self.allocated_bytes = 0  # block sizes, as torch.cuda.memory_allocated() counts them
        self.requested_bytes = 0  # rounded requests

    # -- public -------------------------------------------------------------------
    def malloc(self, key: Hashable, nbytes: int, stream: Hashable = 0) -> tuple[int, int]:
        """Allocate ``nbytes`` for ``key`` on ``stream``; returns ``(address, block size)``."""
        if key in self._live:
            raise ValueError(f"key {key!r} is already allocated")
        size = round_size(nbytes)
        pool = self._pool(size <= SMALL_SIZE, stream)
        block = pool.best_fit(size)
        if block is None:
            block = self._grow(pool, size)
        else:
            pool.remove_free(block)
        if self._should_split(block, size, pool.small):
            rest = _Block(block.addr + size, block.size - size, block.segment, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            pool.add_free(rest)
        block.allocated = True
        block.requested = size
        self._live[key] = block
        self.allocated_bytes += block.size
        self.requested_bytes += size
        return block.addr, block.size

    def free(self, key: Hashable) -> None:
        block = self._live.pop(key)
        pool = self._pool(block.segment.small, block.segment.stream)
        self.allocated_bytes -= block.size
        self.requested_bytes -= block.requested
        block.allocated = False
        block.requested = 0
        for other in (block.prev, block.next):
            if other is not None and not other.allocated:
                pool.remove_free(other)
                block = self._merge(block, other)
        pool.add_free(block)

    def segments(self) -> list[dict]:
        """Every segment with its blocks, in address order (the shape of a memory snapshot)."""
        out = []
        for small in (True, False):
            for seg in (s for p in self._pools.values() if p.small is small for s in p.segments):
                blocks = [{"address": b.addr, "size": b.size, "requested_size": b.requested,
                           "allocated": b.allocated} for b in seg.blocks()]
                out.append({"address": seg.addr, "total_size": seg.size,
                            "segment_type": "small" if small else "large", "blocks": blocks})
        return out

    # -- internals -------------------------------------------------------------------
    def _pool(self, small: bool, stream: Hashable) -> _Pool:
        if stream == 0:
            return self._pools[small]
        return self._pools.setdefault((small, stream), _Pool(small, stream))

    def _should_split(self, block: _Block, size: int, small: bool) -> bool:
        remaining = block.size - size
        if small or self.expandable:
            return remaining >= MIN_BLOCK
        return remaining > SMALL_SIZE

    def _grow(self, pool: _Pool, size: int) -> _Block:
        if not self.expandable:
            seg_size = allocation_size(size)
            if self.capacity is not None and self.reserved_bytes + seg_size > self.capacity:
                self._release_cached()
                self.out_of_memory |= self.reserved_bytes + seg_size > self.capacity
            seg = _Segment(self._next_addr, seg_size, pool.small, stream=pool.stream)
            seg.first = _Block(seg.addr, seg_size, seg)
            self._next_addr += seg_size
            pool.segments.append(seg)
            self.reserved_bytes += seg_size
            return seg.first
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        if not pool.segments:
            seg = _Segment(self._next_addr, 0, pool.small, stream=pool.stream)
            self._next_addr += 1 << 44  # address space for a whole device
            pool.segments.append(seg)
        seg = pool.segments[0]
        last = seg.blocks()[-1] if seg.first is not None else None
        tail = last if last is not None and not last.allocated else None
        have = tail.size if tail is not None else 0
        grow = -(-(size - have) // page) * page
        self.reserved_bytes += grow
        seg.size += grow
        if tail is not None:
            pool.remove_free(tail)
            tail.size += grow
            return tail
        block = _Block(seg.addr + seg.size - grow, grow, seg, prev=last)
        if last is None:
            seg.first = block
        else:
            last.next = block
        return block

    def _release_cached(self) -> None:
        """cudaFree every segment that is one free block (``release_cached_blocks``)."""
        for pool in self._pools.values():
            keep = []
            for seg in pool.segments:
                b = seg.first
                if b.next is None and not b.allocated:
                    pool.remove_free(b)
                    self.reserved_bytes -= seg.size
                    self.released_bytes += seg.size
                else:
                    keep.append(seg)
            pool.segments = keep

    @staticmethod
    def _merge(a: _Block, b: _Block) -> _Block:
        first, second = (a, b) if a.addr < b.addr else (b, a)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        return first


@dataclass(frozen=True)
class Replay:
    """Allocator state after each event of a replayed trace."""

    reserved_bytes: list[int]
    allocated_bytes: list[int]
    reserved_peak_bytes: int
    reserved_peak_index: int
    allocated_peak_bytes: int
    fragmentation: float
    """Share of reserved bytes not in allocated blocks when allocated bytes peak (first time)."""
    addresses: dict[Hashable, int]
    segments: list[dict]


def replay(events: Iterable[tuple], *, expandable_segments: bool = False) -> Replay:
    """Replay ``("alloc", key, nbytes[, stream])`` and ``("free", key)`` events through the allocator
    (a request on a stream other than 0 is served from that stream's pools)."""
    alloc = CachingAllocator(expandable_segments=expandable_segments)
    reserved: list[int] = []
    allocated: list[int] = []
    addresses: dict[Hashable, int] = {}
    peak, peak_at, frag, top = 0, -1, 0.0, 0
    for i, ev in enumerate(events):
        if ev[0] == "alloc":
            addresses[ev[1]], _ = alloc.malloc(ev[1], ev[2], stream=ev[3] if len(ev) > 3 else 0)
        elif ev[0] == "free":
            alloc.free(ev[1])
        else:
            raise ValueError(f"unknown event {ev!r}; expected ('alloc', key, nbytes) or ('free', key)")
        reserved.append(alloc.reserved_bytes)
        allocated.append(alloc.allocated_bytes)
        if alloc.reserved_bytes > peak:
            peak, peak_at = alloc.reserved_bytes, i
        if alloc.allocated_bytes > top:
            top = alloc.allocated_bytes
            frag = 1 - top / alloc.reserved_bytes
    return Replay(reserved, allocated, peak, peak_at, top, frag,
                  addresses, alloc.segments())

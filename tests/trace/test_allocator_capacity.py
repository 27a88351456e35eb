"""The allocator model's release-and-retry at a capacity (``CachingAllocator(capacity_bytes=...)``):
c10/cuda/CUDACachingAllocator.cpp ``DeviceCachingAllocator::malloc`` frees every cached segment that
is not split (``release_cached_blocks``) when cudaMalloc fails, then tries again."""

from __future__ import annotations

import pytest

from trainmem.trace.allocator import CachingAllocator

MiB = 1 << 20


def _activations_then_temporaries(alloc: CachingAllocator) -> None:
    """Three freed 98 MiB segments, too small for three 112 MiB requests (docs/plan.md's case)."""
    for i in range(3):
        alloc.malloc(("act", i), 98 * MiB)
    for i in range(3):
        alloc.free(("act", i))
    for i in range(3):
        alloc.malloc(("tmp", i), 112 * MiB)


def test_unlimited_keeps_the_smaller_segments_cached():
    a = CachingAllocator()
    _activations_then_temporaries(a)
    assert a.reserved_bytes == (3 * 98 + 3 * 112) * MiB and a.released_bytes == 0


def test_capacity_releases_wholly_free_segments_and_fits():
    a = CachingAllocator(capacity_bytes=400 * MiB)
    _activations_then_temporaries(a)
    assert a.reserved_bytes == 3 * 112 * MiB
    assert a.released_bytes == 3 * 98 * MiB and not a.out_of_memory


def test_a_split_segment_is_not_released():
    a = CachingAllocator(capacity_bytes=200 * MiB)
    a.malloc("a", 60 * MiB)   # one 60 MiB segment
    a.malloc("b", 100 * MiB)  # one 100 MiB segment
    a.free("b")
    a.malloc("c", 40 * MiB)   # best fit: splits the 100 MiB segment (60 MiB left > 1 MiB)
    a.malloc("d", 80 * MiB)   # no free block fits; the split segment stays: 160 + 80 > 200
    assert a.released_bytes == 0 and a.out_of_memory
    assert a.reserved_bytes == 240 * MiB  # the replay goes on past the failure


def test_capacity_with_expandable_segments_is_refused():
    with pytest.raises(ValueError, match="expandable"):
        CachingAllocator(expandable_segments=True, capacity_bytes=1 << 30)

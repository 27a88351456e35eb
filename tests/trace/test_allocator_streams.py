"""The allocator model's per-stream pools (trace/allocator.py): c10/cuda/CUDACachingAllocator.cpp
never hands a block freed on one stream to a request made on another."""

from trainmem.trace.allocator import CachingAllocator

MiB = 1 << 20


def test_freed_block_stays_with_its_stream():
    a = CachingAllocator()
    a.malloc("x", 64 * MiB)  # a 64 MiB segment on the default stream
    a.free("x")
    a.malloc("y", 64 * MiB, stream="side")  # cannot take the cached block: a new segment
    assert a.reserved_bytes == 128 * MiB
    a.malloc("z", 64 * MiB)  # the default stream's cached block again
    assert a.reserved_bytes == 128 * MiB and a.allocated_bytes == 128 * MiB
    a.free("y")
    a.malloc("w", 32 * MiB, stream="side")  # split from the side stream's own segment
    assert a.reserved_bytes == 128 * MiB
    assert sorted(s["total_size"] for s in a.segments()) == [64 * MiB, 64 * MiB]


def test_expandable_segments_per_stream():
    a = CachingAllocator(expandable_segments=True)
    a.malloc("x", 30 * MiB)
    a.malloc("y", 30 * MiB, stream=1)
    # each stream grows its own segment in 20 MiB pages: 40 + 40
    assert a.reserved_bytes == 80 * MiB

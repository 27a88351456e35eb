"""The CUDA caching allocator model, on tiny hand-written traces with exact integers."""

from trainmem.trace.allocator import CachingAllocator, allocation_size, replay, round_size

MiB = 1 << 20


def test_rounding_and_segment_sizes():
    assert round_size(1) == 512
    assert round_size(1000) == 1024  # ceil(1000 / 512) * 512
    assert round_size(1536) == 1536  # 3 * 512
    assert allocation_size(1024) == 2 * MiB  # small pool: 2 MiB segments
    assert allocation_size(MiB) == 2 * MiB  # exactly 1 MiB is still small
    assert allocation_size(MiB + 512) == 20 * MiB  # 1 MiB < size < 10 MiB: one 20 MiB segment
    assert allocation_size(12 * MiB + 512) == 14 * MiB  # above 10 MiB: rounded up to 2 MiB


def test_small_requests_share_a_segment():
    a = CachingAllocator()
    addr1, size1 = a.malloc("x", 1000)
    addr2, size2 = a.malloc("y", 1536)
    assert (size1, size2) == (1024, 1536)
    assert addr2 == addr1 + 1024
    assert a.reserved_bytes == 2 * MiB  # 2097152
    assert a.allocated_bytes == 2560  # 1024 + 1536


def test_large_request_splits_a_20_mib_segment():
    a = CachingAllocator()
    a.malloc("x", 3 * MiB // 2)
    assert a.reserved_bytes == 20 * MiB  # 20971520
    assert a.allocated_bytes == 1572864  # 1.5 MiB, the 18.5 MiB rest is a free block
    a.malloc("y", 18 * MiB)
    assert a.reserved_bytes == 20 * MiB  # fits the 18.5 MiB rest; 0.5 MiB left, not split
    assert a.allocated_bytes == 20 * MiB  # 1572864 + 19398656 (the unsplit block) = 20971520


def test_best_fit_and_no_split_below_one_mib():
    a = CachingAllocator()
    a_addr, _ = a.malloc("a", 4 * MiB)  # new 20 MiB segment, 16 MiB rest
    a.malloc("b", 6 * MiB)  # from the 16 MiB rest, 10 MiB rest
    a.free("a")  # free blocks: 4 MiB (a) and 10 MiB (tail)
    c_addr, c_size = a.malloc("c", 3 * MiB)
    assert c_addr == a_addr  # best fit: the 4 MiB block, not the 10 MiB one
    assert c_size == 4 * MiB  # remainder 1 MiB is not > 1 MiB: no split
    assert a.allocated_bytes == 10 * MiB  # 4 MiB + 6 MiB = 10485760
    assert a.reserved_bytes == 20 * MiB


def test_frees_merge_neighbours():
    a = CachingAllocator()
    for key in "abc":
        a.malloc(key, 512)
    a.free("a")
    a.free("c")
    a.free("b")
    (seg,) = a.segments()
    assert seg["total_size"] == 2 * MiB
    assert [(b["size"], b["allocated"]) for b in seg["blocks"]] == [(2 * MiB, False)]


def test_reuse_after_free_needs_no_new_segment():
    r = replay([("alloc", 1, 30 * MiB), ("free", 1), ("alloc", 2, 30 * MiB), ("alloc", 3, 30 * MiB)])
    assert r.reserved_bytes == [30 * MiB, 30 * MiB, 30 * MiB, 60 * MiB]  # 31457280, ..., 62914560
    assert r.reserved_peak_bytes == 60 * MiB
    assert r.addresses[2] == r.addresses[1]


def test_expandable_segments_grow_in_place():
    events = [("alloc", 1, 3 * MiB // 2), ("alloc", 2, 30 * MiB)]
    fixed = replay(events)
    grown = replay(events, expandable_segments=True)
    assert fixed.reserved_peak_bytes == 50 * MiB  # 20 MiB segment + a 30 MiB segment
    # one segment: 20 MiB page, 18.5 MiB free at its end, 11.5 MiB more needs one more page
    assert grown.reserved_peak_bytes == 40 * MiB  # 2 * 20 MiB = 41943040
    assert grown.addresses[2] == grown.addresses[1] + 3 * MiB // 2


def test_expandable_small_pool_uses_2_mib_pages():
    r = replay([("alloc", 1, MiB), ("alloc", 2, MiB), ("alloc", 3, 512)], expandable_segments=True)
    assert r.reserved_bytes == [2 * MiB, 2 * MiB, 4 * MiB]  # 2 x 1 MiB fill one page; 512 B maps another


def test_fragmentation_at_the_allocated_peak():
    r = replay([("alloc", 1, 3 * MiB // 2)])
    # 1.5 MiB allocated of a 20 MiB segment: 1 - 1572864 / 20971520 = 0.925
    assert r.fragmentation == 0.925
    assert r.allocated_peak_bytes == 1572864

"""Placement at the pool's documented boundaries, each checked directly on a constructed layout:
the small/large boundary (exactly 1 MiB), splitting when exactly min_block (512 bytes) would be
left, best fit taking an exact-size block, ties going to the oldest segment and lowest offset,
and the expandable small pool's page fit preferring the lowest address among equal candidates.

pad_bytes=0 so that a request of n bytes (a multiple of 512) occupies exactly n bytes."""

import pytest

import ascend_pool as ap

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def exact_pool():
    """Classic pool without padding: requests of 512-byte multiples occupy exactly their size."""
    p = ap.Pool(0, backend="sim", pad_bytes=0, release_policy="never")
    yield p
    p.close()


def segment_of(pool, ptr):
    for seg in pool.snapshot()["segments"]:
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg
    raise AssertionError(f"{ptr:#x} is in no segment")


def test_exactly_1MiB_is_a_small_pool_request(exact_pool):
    p = exact_pool
    small = p.malloc(1 * MiB)
    seg = segment_of(p, small)
    assert seg["segment_type"] == "small" and seg["total_size"] == 2 * MiB
    large = p.malloc(1 * MiB + 1)  # rounds to 1 MiB + 512: the large pool, a 20 MiB segment (torch_npu's)
    seg = segment_of(p, large)
    assert seg["segment_type"] == "large" and seg["total_size"] == 20 * MiB
    st = p.memory_stats()
    assert st["segment.small_pool.current"] == 1 and st["segment.large_pool.current"] == 1
    p.free(small)
    p.free(large)


def test_padding_counts_toward_the_1MiB_boundary():
    p = ap.Pool(0, backend="sim")  # the acl backend pads every request by 32 bytes
    try:
        assert p.round_size(1 * MiB - 32) == 1 * MiB
        a = p.malloc(1 * MiB - 32)
        b = p.malloc(1 * MiB - 31)
        assert segment_of(p, a)["segment_type"] == "small"
        assert segment_of(p, b)["segment_type"] == "large"
        p.free(a)
        p.free(b)
    finally:
        p.close()


def test_small_block_is_split_when_exactly_min_block_is_left(exact_pool):
    p = exact_pool
    a = p.malloc(1 * MiB)              # first half of a 2 MiB small segment
    b = p.malloc(1 * MiB - 512)        # leaves exactly 512 bytes of the second half
    assert b == a + 1 * MiB
    assert p.block_info(b)[1] == 1 * MiB - 512, "the 512-byte rest must be split off"
    c = p.malloc(1)                    # 512 bytes: exactly that rest, no new segment
    assert c == a + 2 * MiB - 512
    assert p.memory_stats()["segment.all.current"] == 1
    for x in (a, b, c):
        p.free(x)


def test_large_block_is_split_when_exactly_large_split_min_is_left(exact_pool):
    p = exact_pool
    a = p.malloc(12 * MiB - 512)       # a 12 MiB segment: 512 bytes left over, split off
    seg = segment_of(p, a)
    assert [(b["size"], b["state"]) for b in seg["blocks"]] == [(12 * MiB - 512, "active_allocated"), (512, "inactive")]
    p.free(a)


def test_best_fit_takes_a_free_block_of_exactly_the_requested_size(exact_pool):
    p = exact_pool
    twelve, fourteen = p.malloc(12 * MiB), p.malloc(14 * MiB)  # two large segments of exactly these sizes
    p.free(twelve)
    p.free(fourteen)
    reserved = p.memory_stats()["reserved_bytes.all.current"]
    again = p.malloc(12 * MiB)
    assert again == twelve, "the exact-size block must win over the larger one"
    assert p.block_info(again)[1] == 12 * MiB
    other = p.malloc(14 * MiB)
    assert other == fourteen
    st = p.memory_stats()
    assert st["reserved_bytes.all.current"] == reserved and st["num_device_alloc"] == 2
    p.free(again)
    p.free(other)


def test_best_fit_ties_go_to_the_oldest_segment_then_the_lowest_offset(exact_pool):
    p = exact_pool
    first, second, third = (p.malloc(4 * MiB) for _ in range(3))
    for x in (third, first, second):  # freed in an order unlike their age
        p.free(x)
    assert p.malloc(4 * MiB) == first
    assert p.malloc(4 * MiB) == second
    assert p.malloc(4 * MiB) == third
    # within one segment: two equal holes, the lower offset wins
    head = p.malloc(8 * MiB)
    p.free(head)
    parts = [p.malloc(2 * MiB) for _ in range(4)]          # carve the 8 MiB segment
    assert parts == [head + i * 2 * MiB for i in range(4)]
    p.free(parts[3])
    p.free(parts[1])
    assert p.malloc(2 * MiB) == parts[1]
    for x in (first, second, third, parts[0], parts[1], parts[2]):
        p.free(x)


def test_expandable_page_fit_prefers_the_lowest_address_among_equal_candidates():
    p = ap.Pool(0, backend="sim", pad_bytes=0, expandable_segments=True, release_policy="never")
    try:
        blocks = [p.malloc(4 * KiB) for _ in range(5)]
        assert blocks == [blocks[0] + i * 4 * KiB for i in range(5)], "packed in one page"
        p.free(blocks[1])
        p.free(blocks[3])
        p.empty_cache()  # the holes leave the recent-free cache for the trees; their page stays (live data)
        # two equal 4 KiB holes in the same live page: same size, same score -> the lower one
        got = p.malloc(2 * KiB)
        assert got == blocks[1]
        assert p.malloc(2 * KiB) == blocks[1] + 2 * KiB  # the rest of that hole: still the lowest
        assert p.malloc(4 * KiB) == blocks[3]
    finally:
        p.close()


def test_oversize_request_takes_a_cached_block_only_under_20MiB_bigger():
    """max_split_size (PyTorch's rule): a request of max_split_size or more may take a cached
    block only if it is less than 20 MiB larger; such a block is handed out whole."""
    p = ap.Pool(0, backend="sim", pad_bytes=0, release_policy="never", max_split_size_mb=24)
    try:
        big = p.malloc(50 * MiB)
        p.free(big)
        exact_edge = p.malloc(30 * MiB)        # 50 MiB is exactly 20 MiB more: refused, a new segment
        assert exact_edge != big and p.memory_stats()["num_device_alloc"] == 2
        p.free(exact_edge)
        under = p.malloc(30 * MiB + 512)       # 50 MiB is less than 20 MiB more: taken, not split
        assert under == big and p.block_info(under)[1] == 50 * MiB
        small = p.malloc(4 * MiB)              # below max_split_size: never a block of 24 MiB or more
        assert small not in (big, exact_edge) and p.memory_stats()["num_device_alloc"] == 3
        for x in (under, small):
            p.free(x)
    finally:
        p.close()

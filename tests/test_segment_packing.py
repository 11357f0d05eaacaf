"""Large segments for a recurring size whose page rounding wastes much (cython/core/classic_policy.c,
ap_classic_segment_size; docs/placement-policy.md, "Growth size"): under both trading policies the
second growth for such a size makes room for several, so that they share a segment instead of each
stranding most of a 2 MiB page; a size that rounds well keeps one segment per request."""

import pytest

import ascend_pool as ap

MiB = 1 << 20


def _grow(policy, size, n):
    pool = ap.Pool(0, backend="sim", release_policy=policy)
    ptrs = [pool.malloc(size) for _ in range(n)]
    st = pool.memory_stats()
    for p in ptrs:
        pool.free(p)
    pool.close()
    return st


@pytest.mark.parametrize("policy", ["under_peak", "budgeted"])
def test_a_recurring_badly_rounded_size_shares_a_segment(policy):
    # 2.03 MiB rounds to a 4 MiB segment alone (49 % wasted). Its first growth is its own; the
    # second finds the size seen before and makes room for 7 in 16 MiB (11 % wasted, <= 1/8).
    st = _grow(policy, int(2.03 * MiB), 8)
    assert st["num_device_alloc"] == 2
    assert st["segment.large_pool.current"] == 2
    assert st["reserved_bytes.all.current"] == 20 * MiB  # 4 + 16; one segment each would be 32


@pytest.mark.parametrize("policy", ["under_peak", "budgeted"])
def test_a_well_rounded_size_keeps_one_segment_per_request(policy):
    # 3.9 MiB wastes under 1/8 of its 4 MiB segment: each request gets its own, so that freeing it
    # leaves a wholly free segment.
    st = _grow(policy, int(3.9 * MiB), 4)
    assert st["segment.large_pool.current"] == 4
    assert st["reserved_bytes.all.current"] == 16 * MiB


"""Large segments for medium requests (cython/core/segments.c, segment_size_for;
docs/placement-policy.md, "Growth size"): under every classic policy a large request below 10 MiB
gets a 20 MiB segment that later medium requests share, as torch_npu's allocator does, so a pool
growing through medium sizes makes one device call per 20 MiB instead of one per request; a
request of 10 MiB or more keeps a segment of its own size in whole 2 MiB pages, which is wholly
free again once it is freed. release_policy=never (torch_npu's behaviour) does the same; under a
byte limit a medium request shares one while the limit has room for it, else gets its own size;
under a tenant quota it gets its own size."""

import pytest

import ascend_pool as ap
from ascend_pool import sim

MiB = 1 << 20


def _grow(sizes, **knobs):
    pool = ap.Pool(0, backend="sim", **knobs)
    ptrs = [pool.malloc(s) for s in sizes]
    st = pool.memory_stats()
    for p in ptrs:
        pool.free(p)
    pool.close()
    return st


@pytest.mark.parametrize("policy", ["under_peak", "budgeted"])
def test_medium_requests_share_20_mib_segments(policy):
    # 2.03 MiB alone would strand half of a 4 MiB segment; 3.9 MiB rounds well but still costs a
    # device call each. Nine of the first and two of the second fill two 20 MiB segments.
    st = _grow([int(2.03 * MiB)] * 9 + [int(3.9 * MiB)] * 5, release_policy=policy)
    assert st["num_device_alloc"] == 2, st["num_device_alloc"]
    assert st["segment.large_pool.current"] == 2
    assert st["reserved_bytes.all.current"] == 40 * MiB  # one segment each: 9 * 4 + 5 * 4 = 56


@pytest.mark.parametrize("policy", ["under_peak", "budgeted"])
def test_a_request_of_10_mib_or_more_gets_its_own_segment(policy):
    # (the 32 bytes of padding the ACL backend adds, as torch_npu, put 10 MiB in 12)
    st = _grow([10 * MiB - 32, 10 * MiB, int(12.5 * MiB)], release_policy=policy)
    assert st["segment.large_pool.current"] == 3
    assert st["reserved_bytes.all.current"] == (10 + 12 + 14) * MiB


def test_the_never_release_policy_shares_them_too():
    # release_policy=never is torch_npu's behaviour, its segment sizes included.
    st = _grow([int(3.9 * MiB)] * 4, release_policy="never")
    assert st["segment.large_pool.current"] == 1
    assert st["reserved_bytes.all.current"] == 20 * MiB


def test_a_shared_segment_the_device_refuses_falls_back_to_the_requests_own_size():
    pool = ap.Pool(0, backend="sim", release_policy="budgeted")
    try:
        first = [pool.malloc(int(4.9 * MiB)) for _ in range(4)]   # one 20 MiB segment
        sim.set_faults(fail_malloc_nth=1)                       # the next device malloc fails once
        extra = pool.malloc(int(4.9 * MiB))                     # its 20 MiB refused: 6 MiB of its own
        st = pool.memory_stats()
        assert st["segment.large_pool.current"] == 2
        assert st["reserved_bytes.all.current"] == 26 * MiB
        assert st["num_alloc_retries"] == 1 and st["num_ooms"] == 0
        for p in first + [extra]:
            pool.free(p)
    finally:
        sim.reset_faults()
        pool.close()


@pytest.mark.parametrize("cap", ["limit", "quota"])
def test_under_a_limit_medium_requests_share_a_segment_while_it_has_room_under_a_quota_never(cap, tmp_path,
                                                                                              monkeypatch):
    # While a byte limit has room for a shared 20 MiB segment, medium requests share one as
    # uncapped (each alone in its own pages filled half a limit with 1 MiB requests: RMM's, CuPy's
    # and torch's limit tests fill theirs); past that, the request's own size: a shared segment
    # refused where the request's 6 MiB fits would cost a retry. Under a tenant quota, always its
    # own size (the room is node-wide; a refused shared growth would be a refusal in the ledger).
    monkeypatch.setenv("ASCEND_POOL_LEDGER_DIR", str(tmp_path))
    base = ap.Pool(0, backend="sim", release_policy="budgeted")
    pool = base
    try:
        if cap == "limit":
            base.set_limit(26 * MiB)
        else:
            pool = base.context("capped", quota=26 * MiB)
        n = 5 if cap == "limit" else 4
        ptrs = [pool.malloc(int(4.9 * MiB)) for _ in range(n)]
        st = pool.memory_stats()
        if cap == "limit":  # four in 20 MiB, the fifth in its own 6 MiB
            assert (st["segment.large_pool.current"], st["reserved_bytes.all.current"]) == (2, 26 * MiB)
        else:
            assert (st["segment.large_pool.current"], st["reserved_bytes.all.current"]) == (4, 24 * MiB)
        assert st["num_alloc_retries"] == 0
        if cap == "quota":
            assert st["quota_refusals"] == 0
        for p in ptrs:
            pool.free(p)
    finally:
        if pool is not base:
            pool.close()
        base.close()


def test_a_limit_holds_as_many_1mib_requests_as_an_uncapped_pool_would_fit_in_it():
    # RMM's limiting adaptor and CuPy's set_limit tests allocate up to the limit: 150 x 1 MiB
    # need 160 MiB uncapped; under a 200 MiB limit only 100 fitted (each alone in a 2 MiB page).
    base = pool = ap.Pool(0, backend="sim")
    try:
        base.set_limit(200 * MiB)
        ptrs = [pool.malloc(MiB) for _ in range(150)]
        st = pool.memory_stats()
        assert st["reserved_bytes.all.current"] <= 160 * MiB
        assert st["num_ooms"] == 0
        for p in ptrs:
            pool.free(p)
    finally:
        base.close()

"""A byte limit whose room is below the segment the pool would grow, and a preallocated reserve
that fills its cap (docs/placement-policy.md, "Growth size", "The preallocated reserve under a
cap").

Ports of CuPy's TestSingleDeviceMemoryPool::test_alloc_limit and RMM's limiting adaptor tests
(python test_limiting_resource_adaptor, cpp PoolTest.ForceGrowth) and RMM's pool whose initial
size is its maximum (PoolTest.InitialAndMaxPoolSizeEqual). Sizes are the peers' minus the
documented 32-byte pad, so that a request rounds to the peer's figure (pool.round_size).
Before the fix a small request always grew a 2 MiB segment and a large one at least 2 MiB in
whole pages, so every request was refused once less than 2 MiB was left under the limit; and the
first small request under a cap filled by the reserve gave the whole reserve back."""

import pytest

import ascend_pool as ap
from ascend_pool import sim

MiB = 1 << 20
UNIT = 512
PAD = 32


def u(k):
    """a request that rounds to k units, as CuPy's unit*k"""
    return UNIT * k - PAD


def reserved(p):
    return p.memory_stats()["reserved_bytes.all.current"]


def test_round_size_is_the_peers_unit(pool):
    assert [pool.round_size(u(k)) for k in (1, 5)] == [UNIT, 5 * UNIT]


def test_cupy_alloc_limit(pool):
    # CuPy TestSingleDeviceMemoryPool::test_alloc_limit (unit 512). Before: "OutOfMemoryError: ...
    # Tried to allocate 2.47 KiB (2528 bytes) ... out of the pool's limit. Pool: 0 bytes reserved"
    pool.set_limit(size=UNIT * 6)
    p1 = pool.malloc(u(5))
    p2 = pool.malloc(u(1))
    with pytest.raises(ap.OutOfMemoryError, match="limit"):
        pool.malloc(u(1))
    pool.set_limit(size=UNIT * 7)
    p3 = pool.malloc(u(1))
    pool.set_limit(size=UNIT * 8)
    with pytest.raises(ap.OutOfMemoryError):
        pool.malloc(u(2))
    assert reserved(pool) == UNIT * 7  # exact sizes, nothing beyond the limit
    for x in (p1, p2, p3):
        pool.free(x)
    pool._check_invariants()


def test_rmm_limiting_resource_adaptor(pool):
    # rmm python test_limiting_resource_adaptor: limit 1 MiB, two 512 KiB buffers, one byte more
    # raises MemoryError. Before: the first 512 KiB buffer was refused ("0 bytes reserved").
    limit = 1 << 20
    pool.set_limit(size=limit)
    assert pool.get_limit() == limit
    held = sim.stats(0)["bytes_held"]
    bufs = [pool.malloc(limit // 2 - PAD) for _ in range(2)]
    assert pool.used_bytes() == limit  # get_allocated_bytes() == the sum of the buffers
    assert reserved(pool) == limit
    assert sim.stats(0)["bytes_held"] - held == limit  # what the device really holds
    with pytest.raises(MemoryError):
        pool.malloc(1)
    for b in bufs:
        pool.free(b)
    pool._check_invariants()


def test_rmm_limiting_adaptor_small_buffers(pool):
    # ten 100 KiB buffers under 1 MiB (each rounds to 100.5 KiB)
    pool.set_limit(size=1 << 20)
    bufs = [pool.malloc(100 * 1024) for _ in range(10)]
    assert reserved(pool) <= 1 << 20
    for b in bufs:
        pool.free(b)
    # freed, they serve again without growing
    allocs = pool.memory_stats()["num_device_alloc"]
    bufs = [pool.malloc(100 * 1024) for _ in range(10)]
    assert pool.memory_stats()["num_device_alloc"] == allocs
    for b in bufs:
        pool.free(b)
    pool._check_invariants()


def test_rmm_force_growth(pool):
    # RMM cpp PoolTest.ForceGrowth: a pool with a 4000-byte maximum serves 1000 bytes
    pool.set_limit(size=4096)
    pool.free(pool.malloc(1000))
    assert reserved(pool) == pool.round_size(1000)


def test_small_request_with_under_2mib_of_room(pool):
    # 62 MiB reserved of a 63 MiB limit: malloc(512) was refused with 1 MiB of room
    pool.set_limit(size=63 * MiB)
    big = pool.malloc(61 * MiB)
    assert reserved(pool) == 62 * MiB
    x = pool.malloc(512)
    assert reserved(pool) == 62 * MiB + pool.round_size(512)
    pool.free(x)
    pool.free(big)
    pool._check_invariants()


def test_large_request_with_room_below_its_page_rounded_size(pool):
    # 1.75 MiB of room: a 1.5 MiB request (2 MiB in whole pages) gets its exact size
    pool.set_limit(size=62 * MiB + 1792 * 1024)
    big = pool.malloc(61 * MiB)
    x = pool.malloc(1536 * 1024 - PAD)
    assert reserved(pool) == 62 * MiB + 1536 * 1024
    with pytest.raises(ap.OutOfMemoryError):
        pool.malloc(512 * 1024)  # 256 KiB of room left
    pool.free(x)
    pool.free(big)
    pool._check_invariants()


def test_memory_fraction_counts_the_same_way():
    # The fraction path is the same cap (C cannot tell set_limit from a fraction); with room for
    # a 2 MiB small segment it still grows one, as PyTorch does.
    total = sim.stats(0)["total_bytes"]
    p = ap.Pool(0, backend="sim", memory_fraction=3 * MiB / total)
    try:
        assert p.get_limit() == 3 * MiB
        a = p.malloc(512)
        assert reserved(p) == 2 * MiB  # room for the small segment: torch's layout
        b = p.malloc(MiB - PAD)  # in that segment
        c = p.malloc(MiB - PAD)  # 1 MiB of room left: a segment of exactly 1 MiB
        assert reserved(p) == 3 * MiB
        with pytest.raises(ap.OutOfMemoryError):
            p.malloc(MiB - PAD)  # 1 MiB - 512 free in the small segment, no room
        for x in (a, b, c):
            p.free(x)
        p._check_invariants()
    finally:
        p.close()


def test_an_unlimited_pool_and_a_roomy_limit_keep_whole_segments(pool):
    x = pool.malloc(512)
    assert reserved(pool) == 2 * MiB
    y = pool.malloc(11 * MiB + 1)
    assert reserved(pool) == 2 * MiB + 12 * MiB
    pool.free(x)
    pool.free(y)
    pool.empty_cache()
    pool.set_limit(size=64 * MiB)
    x = pool.malloc(512)
    y = pool.malloc(3 * MiB)
    assert reserved(pool) == 2 * MiB + 20 * MiB  # a small segment and a shared medium one
    pool.free(x)
    pool.free(y)


def test_a_reserve_equal_to_the_cap_serves_small_requests():
    # RMM PoolTest.InitialAndMaxPoolSizeEqual: the pool allocates its size once and serves every
    # later request, small ones included, from it. Before: the first malloc(1000) gave the whole
    # reserve back ("after malloc(1000): reserved 2 MiB, device allocations 2, device frees 1"),
    # and four 8 MiB requests then grew 4 more segments.
    total = sim.stats(0)["total_bytes"]
    p = ap.Pool(0, backend="sim", reserve="64MiB", memory_fraction=64 * MiB / total)
    try:
        assert p.get_limit() == 64 * MiB
        st0 = p.memory_stats()
        xs = [p.malloc(1000)]
        xs += [p.malloc(8 * MiB) for _ in range(4)]
        xs += [p.malloc(u(k)) for k in range(1, 50)]
        st = p.memory_stats()
        assert st["num_device_alloc"] == st0["num_device_alloc"] == 1
        assert st["num_device_free"] == 0
        assert reserved(p) == 64 * MiB
        for x in xs:
            p.free(x)
        p._check_invariants()
        # freed, the carved blocks merge back: the reserve is whole again
        assert p.memory_stats()["inactive_split.all.current"] == 0
        big = p.malloc(64 * MiB - PAD)  # all of it in one block
        p.free(big)
        p.empty_cache()
        assert reserved(p) == 0
    finally:
        p.close()


def test_a_reserve_serves_a_small_request_the_device_refuses(peers_idle_released):
    # Without a limit: the device is full, the reserve idle; a small request is carved from the
    # reserve instead of the reserve going back to the device.
    p = ap.Pool(0, backend="sim", reserve="64MiB")
    try:
        sim.set_faults(fail_after_bytes=sim.stats(0)["bytes_held"])  # no segment can be had
        x = p.malloc(1000)
        st = p.memory_stats()
        assert st["num_device_free"] == 0 and reserved(p) == 64 * MiB
        p.free(x)
        p._check_invariants()
    finally:
        sim.set_faults(fail_after_bytes=-1)
        p.close()


def test_a_limit_set_after_a_trade_keeps_the_refill_credit(pool):
    # A trade's room under the peak, then a limit whose room is below 2 MiB: exact-size refills
    # must still count a growth unit of room each, or the credit falls below the refills owed.
    # Only a debug build (AP_DEBUG, ASCEND_POOL_SANITIZE) sees that: without the fix it aborts with
    # "invariant failed at cython/core/classic_policy.c:121: p->trade_credit >=
    # ap_classic_refills_owed(p) * 1000".
    xs = [pool.malloc(40 * MiB) for _ in range(4)]
    for x in xs:
        pool.free(x)
    y = pool.malloc(100 * MiB)  # a trade: three idle 42 MiB segments released for it, one stays
    assert pool.memory_stats()["num_device_free"] == 3
    pool.set_limit(size=reserved(pool) + MiB)
    zs = [pool.malloc(u(k)) for k in range(1, 40)]
    for z in zs:
        pool.free(z)
    pool.free(y)
    pool._check_invariants()

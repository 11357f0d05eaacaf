"""Expandable mode's device-call bounds (cython/core/vmm_policy.c, docs/placement-policy-expandable.md),
checked after every allocation of adversarial sequences:

- trades (discretionary calls): D(t) = 2 * unmaps(t) <= RHO * A(t) + B, A(t) = allocations so far
  (each unmap is charged with the map or free of its spare that follows it);
- growth: the calls that map new physical memory, 2 * device_allocs(t), grow with the number of
  growths to a new peak, and past their budget those growths are geometric, so growing to R bytes in
  many small steps costs O(log R) of them, with at most 1/128 of reserved memory mapped beyond need;
  a growth's chunks hold up to 1/32 of reserved memory, so its calls shrink with its share of the pool.

The constants mirror vmm_policy.c and pool.h."""

import math

import numpy as np
import pytest

import ascend_pool as ap

MiB = 1 << 20
RHO, B = 0.004, 200            # AP_VMM_TRADE_PER_1000 / 1000, AP_VMM_TRADE_BURST
RHO_G, B_G = 0.005, 64         # AP_VMM_GROW_PER_1000 / 1000, AP_VMM_GROW_BURST
CHUNKS, OVERSHOOT = 16, 128    # AP_VMM_GROWTH_CHUNKS, AP_VMM_OVERSHOOT_DIV
SHARE = 32                     # AP_VMM_CHUNK_SHARE: a chunk may hold 1/32 of reserved memory
GROWTH_CALLS = 2 * (CHUNKS + 1)  # the most one growth costs


@pytest.fixture
def xpool(clean_faults):
    p = ap.Pool(0, backend="sim", expandable_segments=True)
    yield p
    p.close()


def run(pool, steps):
    """Plays steps ((+1, key, bytes) allocates, (-1, key, 0) frees) and returns, after every
    allocation, (allocations so far, mallocs, maps, unmaps, frees, reserved, reserved peak)."""
    live, rows, allocs = {}, [], 0
    for op, key, size in steps:
        if op > 0:
            live[key] = pool.malloc(size)
            allocs += 1
            st = pool.memory_stats()
            rows.append((allocs, st["num_device_alloc"], st["num_device_map"], st["num_device_unmap"],
                         st["num_device_free"], st["reserved_bytes.all.current"], st["reserved_bytes.all.peak"]))
        else:
            pool.free(live.pop(key))
    for p in live.values():
        pool.free(p)
    return rows


def cyclic_above_watermark(steps=3000, seed=3):
    """A working set that each step frees its oldest block and allocates one whose size differs
    (five sizes), so that the hole left never fits and, with unlimited trades, every step would
    unmap idle chunks and map them again at the top: an unbudgeted policy ping-pongs."""
    rng = np.random.default_rng(seed)
    out, ring, k = [], [], 0
    for _ in range(steps):
        if len(ring) == 12:
            out.append((-1, ring.pop(0), 0))
        k += 1
        out.append((1, k, int(rng.choice((18, 22, 26, 30, 34))) * MiB - 32))
        ring.append(k)
    return out


def alternating_mixes(phases=60, per_phase=48):
    """Phases of two size mixes (3 MiB blocks, then 10 MiB ones), each phase freeing three blocks
    of four at its end and the fourth at the end of the next phase: the holes one phase leaves
    between its pinned blocks never fit the other's blocks."""
    out, k, pinned = [], 0, []
    for ph in range(phases):
        size = 3 * MiB if ph % 2 == 0 else 10 * MiB
        keys = []
        for _ in range(per_phase if ph % 2 == 0 else per_phase // 3):
            k += 1
            out.append((1, k, size - 32))
            keys.append(k)
        out += [(-1, x, 0) for x in pinned]
        pinned = keys[::4]
        out += [(-1, x, 0) for i, x in enumerate(keys) if i % 4]
    return out


def sawtooth(teeth=40, seed=5):
    """Grow to a varying height, then shrink, with another block size each tooth; every fifth block
    of a tooth lives through the next one, so each tooth finds the last one's memory in pieces.
    Blocks of 16-96 MiB, so that the freed ones between the survivors span whole chunks."""
    rng = np.random.default_rng(seed)
    out, k, pinned = [], 0, []
    for _ in range(teeth):
        size = int(rng.integers(16, 96)) * MiB + int(rng.integers(0, 1 << 20))
        keys = []
        for _ in range(int(rng.integers(20, 80))):
            k += 1
            out.append((1, k, size))
            keys.append(k)
        out += [(-1, x, 0) for x in pinned]
        pinned = keys[::5]
        out += [(-1, x, 0) for i, x in enumerate(keys) if i % 5]
    return out


def creeping_high(steps=2000):
    """The cyclic working set with each block 128 KiB larger than the one before: every step is a
    new high of live bytes and the freed block never fits the next one, the moments a policy that
    trades freely at new highs would pay for on every step."""
    out, ring = [], []
    for k in range(steps):
        if len(ring) == 12:
            out.append((-1, ring.pop(0), 0))
        out.append((1, k, 20 * MiB + k * 128 * 1024 - 32))
        ring.append(k)
    return out


@pytest.mark.parametrize("sequence", [cyclic_above_watermark, alternating_mixes, sawtooth, creeping_high])
def test_trades_stay_within_rho_a_plus_b_on_every_prefix(xpool, sequence):
    rows = run(xpool, sequence())
    assert rows[-1][3] > 0, "the sequence must make the policy trade, or this test proves nothing"
    for a, mallocs, maps, unmaps, frees, _, _ in rows:
        assert 2 * unmaps <= RHO * a + B, (a, unmaps)
        # every call is a growth's (an allocation and its map) or a trade's (an unmap, then the
        # map or free of its spare): nothing else spends device calls on the allocation path
        assert mallocs + maps + unmaps + frees <= 2 * mallocs + 2 * unmaps, (a, mallocs, maps, unmaps, frees)


def test_an_unbudgeted_policy_would_ping_pong_here(xpool):
    """The cyclic sequence needs the budget: over its second half, with trades cut at the budget,
    device calls stay under 1 % of allocations plus what the burst left; the unbudgeted count
    (one trade per step, 2 calls or more) would be 100 %."""
    rows = run(xpool, cyclic_above_watermark(steps=4000))
    half = rows[len(rows) // 2]
    end = rows[-1]
    calls = lambda r: r[1] + r[2] + r[3] + r[4]
    steady = calls(end) - calls(half)
    assert steady <= 0.01 * (end[0] - half[0]) + B, (steady, end[0] - half[0])


def test_growing_in_small_steps_costs_logarithmically_many_growths(xpool):
    """3,000 allocations of 5 MiB, never freed (15 GiB): with 2 calls per exact growth this would be
    6,000 calls. Past the growth budget each growth maps 1/128 of reserved memory more, so the
    growths number O(log R), and the memory mapped beyond need stays under reserved / 128."""
    steps = [(1, k, 5 * MiB - 32) for k in range(3000)]
    rows = run(xpool, steps)
    a, mallocs, maps, unmaps, frees, reserved, peak = rows[-1]
    live = 3000 * 5 * MiB
    assert unmaps == 0 and frees == 0
    geometric = math.log(reserved / (5 * MiB)) / math.log(1 + 1 / OVERSHOOT)
    assert 2 * mallocs <= RHO_G * a + B_G + GROWTH_CALLS * (1 + geometric), (mallocs, geometric)
    assert mallocs < 3000 / 2, "well under one growth per allocation"
    assert reserved - live <= reserved / OVERSHOOT + 2 * MiB, (reserved, live)


def test_one_large_growth_costs_at_most_seventeen_chunks(xpool):
    p = xpool.malloc(1000 * MiB - 32)
    st = xpool.memory_stats()
    assert st["reserved_bytes.all.current"] == 1000 * MiB     # in budget: exactly what it needs
    assert st["num_device_alloc"] == st["num_device_map"] <= CHUNKS + 1
    xpool.free(p)


def test_a_growth_in_a_large_pool_costs_calls_in_proportion_to_its_share_of_the_pool(xpool):
    """Chunks of up to 1/32 of reserved memory: a growth of x times reserved costs at most
    2 * (1 + 32 x) calls, so a 200 MiB growth of a 3.2 GiB pool maps 2 chunks (32 MiB chunks: 7)."""
    held = [xpool.malloc(3200 * MiB - 32)]                        # 16 chunks, within the budget
    st0 = xpool.memory_stats()
    reserved = st0["reserved_bytes.all.current"]
    assert reserved == 3200 * MiB
    p = xpool.malloc(200 * MiB - 32)
    st = xpool.memory_stats()
    chunks = st["num_device_alloc"] - st0["num_device_alloc"]
    assert chunks == st["num_device_map"] - st0["num_device_map"]
    assert chunks <= 1 + SHARE * 200 * MiB / reserved, chunks
    assert st["reserved_bytes.all.current"] == reserved + 200 * MiB  # the chunk size maps no more than the need
    for q in held + [p]:
        xpool.free(q)


def test_no_extra_bytes_past_a_limits_room():
    """Under a memory limit a growth maps extra bytes only while they fit the limit's room: extra
    bytes past it could make a request that fits fail. Every request that fits is served, without
    a retry, and reserved memory stays under the limit."""
    pool = ap.Pool(0, backend="sim", expandable_segments=True)
    try:
        pool.set_limit(2048 * MiB)
        ptrs = [pool.malloc(5 * MiB - 32) for _ in range(409)]       # 2,045 MiB of a 2,048 MiB limit
        st = pool.memory_stats()
        assert st["allocated_bytes.all.current"] == 409 * 5 * MiB
        assert st["reserved_bytes.all.current"] <= 2048 * MiB
        assert st["num_alloc_retries"] == 0 and st["num_ooms"] == 0
        for p in ptrs:
            pool.free(p)
    finally:
        pool.close()


@pytest.mark.parametrize("sequence", [cyclic_above_watermark, alternating_mixes, sawtooth])
def test_a_trade_at_a_new_high_of_live_bytes_maps_all_its_chunks_again(xpool, sequence):
    """A trade at a new high of live bytes hands every chunk it unmapped to its growth, past the
    need if they hold more: a spare freed there leaves room under the peak that later growths map
    again on no credit (the refill gap). So no device free happens at such a step (on these
    sequences the address space after each growth holds the spares; creeping_high's does not
    twice, where the spare that does not fit is still freed)."""
    live, high, frees, at_high, n = {}, 0, 0, [], 0
    for op, key, size in sequence():
        if op > 0:
            live[key] = xpool.malloc(size)
            n += 1
            st = xpool.memory_stats()
            cur = st["allocated_bytes.all.current"]
            if st["num_device_free"] > frees and cur > high:
                at_high.append(n)
            frees, high = st["num_device_free"], max(high, cur)
        else:
            xpool.free(live.pop(key))
    for p in live.values():
        xpool.free(p)
    assert xpool.memory_stats()["num_device_unmap"] > 0, "the sequence must make the policy trade"
    assert at_high == [], f"trades at a new high of live bytes freed a spare at allocations {at_high}"


def test_room_under_the_peak_is_mapped_again_in_logarithmically_many_growths(xpool):
    """Growths under the peak (refills of released room) map, beyond their need, what such growths
    mapped since the last new peak, at most a chunk and never past the peak: after an empty_cache
    at a 256 MiB peak, 64 blocks of 4 MiB came back in 64 growths (128 calls, one growth per block);
    doubling takes the first growths to a whole 32 MiB chunk in log2(32 / 4) + 1 steps, then a chunk
    per 8 blocks. The peak, and so the waste at it, does not move."""
    held = xpool.malloc(256 * MiB - 32)
    xpool.free(held)
    xpool.empty_cache()
    st0 = xpool.memory_stats()
    assert st0["reserved_bytes.all.current"] == 0
    ptrs = [xpool.malloc(4 * MiB - 32) for _ in range(64)]
    st = xpool.memory_stats()
    growths = st["num_device_alloc"] - st0["num_device_alloc"]
    assert growths == st["num_device_map"] - st0["num_device_map"]
    chunk = 32
    assert growths <= math.log2(chunk / 4) + 1 + 256 / chunk, growths     # 12 at most; 64 before
    assert st["reserved_bytes.all.peak"] == 256 * MiB                      # never past the peak
    assert st["reserved_bytes.all.current"] == 256 * MiB
    for p in ptrs:
        xpool.free(p)

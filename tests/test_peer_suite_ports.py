"""Ports of the peers' own allocator tests to ascend_pool's API (PyTorch test/test_cuda.py,
torch_npu test/npu/test_npu.py and test_mempool_destructor.py, CuPy test_memory.py), each under
the knobs a user of that peer sets: what those suites check holds here too. Sizes in bytes."""
import collections
import gc
import math
import random

import pytest

import ascend_pool as ap
from ascend_pool import sim

MiB = 1 << 20
KNOBS = [{}, dict(expandable_segments=True), dict(max_split_size_mb=21),
         dict(garbage_collection_threshold=0.5, memory_fraction=0.05), dict(release_policy="never")]
IDS = ["default", "expandable", "max_split", "gc", "never"]


def _expected_from_snapshot(segments):
    """torch's _check_memory_stat_consistency: the current figures a snapshot's segments imply."""
    expected = collections.defaultdict(int)
    for seg in segments:
        kind = seg["segment_type"] + "_pool"
        for key, field in (("segment", None), ("allocated_bytes", "allocated_size"), ("reserved_bytes", "total_size"),
                           ("active_bytes", "active_size"), ("requested_bytes", "requested_size")):
            for k in ("all", kind):
                expected[f"{key}.{k}.current"] += 1 if field is None else seg[field]
        split = len(seg["blocks"]) > 1
        for b in seg["blocks"]:
            for k in ("all", kind):
                expected[f"allocation.{k}.current"] += b["state"] == "active_allocated"
                expected[f"active.{k}.current"] += b["state"].startswith("active_")
                if b["state"] == "inactive" and split:
                    expected[f"inactive_split.{k}.current"] += 1
                    expected[f"inactive_split_bytes.{k}.current"] += b["size"]
    return expected


@pytest.mark.parametrize("knobs", KNOBS, ids=IDS)
def test_torch_memory_stats_generator_with_snapshot_consistency(knobs):
    # torch's (and torch_npu's) test_memory_stats: _test_memory_stats_generator's allocations,
    # frees, empty_cache and reset_peak steps, each followed by _check_memory_stat_consistency
    pool = ap.Pool(0, backend="sim", **knobs)
    last = {"m": pool.memory_stats()["allocated_bytes.all.current"], "r": 0, "max_m": 0, "max_r": 0}

    def figures():
        st = pool.memory_stats()
        return (st["allocated_bytes.all.current"], st["allocated_bytes.all.peak"], st["reserved_bytes.all.current"],
                st["reserved_bytes.all.peak"])

    def assert_change(comp, empty_cache=False, reset_peak=False):
        m, max_m, r, max_r = figures()
        assert (m > last["m"]) if comp > 0 else (m < last["m"]) if comp < 0 else (m == last["m"])
        assert m <= max_m and max_m >= last["max_m"] and r <= max_r and max_r >= last["max_r"]
        last.update(m=m, max_m=max_m, r=r, max_r=max_r)
        if empty_cache:
            pool.empty_cache()
            _, _, r, new_max_r = figures()
            assert r <= last["r"] and new_max_r == last["max_r"]
            last["r"] = r
        if reset_peak:
            pool.reset_peak_stats()
            m, max_m, r, max_r = figures()
            assert (m, max_m, r, max_r) == (last["m"], last["m"], last["r"], last["r"])
            last.update(max_m=m, max_r=r)
        st = pool.memory_stats()
        for key, value in _expected_from_snapshot(pool.snapshot()["segments"]).items():
            assert st[key] == value, (key, st[key], value)

    def alloc(*shape):  # torch.FloatTensor(*shape): 4 bytes an element; none for an empty one
        n = 4 * math.prod(shape)
        return pool.malloc(n) if n else None

    def free(p):
        if p is not None:
            pool.free(p)

    try:
        for kw in ({}, dict(reset_peak=True), dict(empty_cache=True), dict(reset_peak=True)):
            assert_change(0, **kw)
        first = [alloc(1), alloc(10, 20), alloc(200, 300, 2000)]
        m1 = pool.memory_stats()["allocated_bytes.all.current"]
        assert_change(1)
        second = []
        for i in range(1, 18):
            second.append(alloc(i, i * 4))
            assert_change(1)
        for i in range(5, 22):
            second.append(alloc(i, i * 7, i * 9, i * 11))
            assert_change(1, reset_peak=i % 2 == 0)
        second.append(alloc(0, 0, 0))
        assert_change(0)
        random.Random(7).shuffle(second)
        assert_change(0, reset_peak=True)
        for i in range(17):
            p = second.pop(i)
            free(p)
            assert_change(0 if p is None else -1)
        for i in range(2, 25):
            second.append(alloc(i, i * 3, i * 8))
            assert_change(1)
        for p in second:
            free(p)
        assert_change(-1, reset_peak=True)
        assert pool.memory_stats()["allocated_bytes.all.current"] == m1
        for p in first:
            free(p)
        assert_change(-1, reset_peak=True)
        assert_change(0, empty_cache=True)
        assert_change(0, reset_peak=True)
        assert pool.memory_stats()["reserved_bytes.all.current"] == 0 or knobs.get("expandable_segments")
    finally:
        pool.close()


@pytest.mark.parametrize("knobs", KNOBS, ids=IDS)
def test_torch_allocator_fuzz_keeps_every_live_block_intact(knobs):
    # torch's test_allocator_fuzz: random 2-20 MiB allocations, frees and empty_cache calls under
    # a 100 MiB live cap; every block still holds what was written to it when it is freed
    pool = ap.Pool(0, backend="sim", **knobs)
    rng = random.Random(123)
    live, total, n = [], 0, 0
    try:
        def alloc():
            nonlocal total, n
            size = 4 * rng.randrange(2 * MiB // 4, 20 * MiB // 4)
            ptr = pool.malloc(size)
            sim.launch_fill(0, ptr, size, n % 251)
            live.append((n % 251, ptr, size))
            n += 1
            total += size

        def free():
            nonlocal total
            value, ptr, size = live.pop(rng.randrange(len(live)))
            pool.synchronize(0)
            for offset in (0, size // 2, size - 8):
                assert sim.read(ptr + offset, 8) == bytes([value]) * 8, (hex(ptr), offset)
            pool.free(ptr)
            total -= size

        for _ in range(1500):
            while total >= 100 * MiB:
                free()
            rng.choices([alloc, free, pool.empty_cache], weights=[1, 1 if live else 0, 0.1])[0]()
        pool._check_invariants()
        while live:
            free()
    finally:
        pool.close()


def _rand(n):
    return ap.malloc(n, device=0)


def test_torch_memory_snapshot_finds_the_block_its_frames_and_the_last_segment_free():
    # torch's test_memory_snapshot: history "state" with Python stacks; a block tiled among
    # 1000 freed 512-byte ones is found by its requested size, with this file in its frames;
    # every segment carries "frames"; after empty_cache the trace ends with a segment_free
    ap.empty_cache(0)
    ap.record_memory_history("state", stacks="python")
    try:
        held = [_rand(2 * 311 * 411 * 4), _rand(310 * 410 * 4)]
        x = _rand(311 * 411 * 4)
        tensors = [_rand(128 * 4) for _ in range(1000)]
        rng = random.Random(0)
        while tensors:
            ap.free(tensors.pop(rng.randrange(len(tensors))), device=0)
        held.append(_rand(128 * 5 * 4))
        found = False
        for seg in ap.snapshot(0)["segments"]:
            assert "frames" in seg
            for b in seg["blocks"]:
                if b["requested_size"] == 311 * 411 * 4:
                    assert "test_peer_suite_ports" in b["frames"][0]["filename"]
                    assert b["address"] == x
                    found = True
        assert found
        for p in held + [x]:
            ap.free(p, device=0)
        ap.empty_cache(0)
        assert ap.snapshot(0)["device_traces"][0][-1]["action"] in ("segment_free", "segment_unmap")
    finally:
        ap.record_memory_history(None)


@pytest.mark.parametrize("knobs", KNOBS[:3] + [dict(page_size="1g")], ids=IDS[:3] + ["1g"])
def test_torch_memory_fraction_and_oom_retry_and_cupy_large_chunks(knobs):
    # CuPy's test_alloc_large_chunk (70% of the device, freed, then 30%), torch's
    # test_out_of_memory_retry (half, half again refused, the first freed, half again) and
    # test_set_per_process_memory_fraction (0.499 of the device minus the reserved peak fits
    # under 0.5, half does not, and the pool keeps serving the small block it held)
    pool = ap.Pool(0, backend="sim", **knobs)
    try:
        total = pool.mem_get_info()[1]
        pool.free(pool.malloc(int(0.7 * total)))
        pool.free(pool.malloc(int(0.3 * total)))
        half = pool.malloc(total // 2)
        with pytest.raises(ap.OutOfMemoryError, match="Tried to allocate"):
            pool.malloc(total // 2)
        pool.free(half)
        pool.free(pool.malloc(total // 2))
        pool.empty_cache()
        pool.reset_peak_stats()
        small = pool.malloc(4096)
        pool.set_limit(fraction=0.5)
        pool.free(pool.malloc(int(total * 0.499) - pool.memory_stats()["reserved_bytes.all.peak"]))
        pool.empty_cache()
        with pytest.raises(ap.OutOfMemoryError, match="out of memory"):
            pool.malloc(int(total * 0.5))
        assert pool.block_info(small) is not None
        pool.free(small)
    finally:
        pool.close()


def test_torch_npu_mempool_destruction_gives_its_cache_back():
    # torch_npu's test_empty_cache_mempool_destruction: a pool's cached 1 GiB survives the
    # default pool's empty_cache and goes back to the device when the pool is dropped; the
    # default pool then allocates and empties as before
    base = ap.default_pool(0)

    def used():
        free, total = base.mem_get_info()
        return total - free

    before = used()
    ctx = base.context("torch-npu-mempool")
    with ctx:
        ap.free(ap.malloc(1 << 30))
    ap.empty_cache(0)
    assert used() - before >= 1 << 30
    del ctx
    gc.collect()
    assert used() - before < 1 << 29
    ap.free(ap.malloc(1 << 30, device=0), device=0)
    ap.empty_cache(0)
    assert used() - before < 1 << 29

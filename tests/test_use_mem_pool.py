"""ap.use_mem_pool(pool): torch.cuda.use_mem_pool's routing of the calling thread's allocations
to a pool (module-level calls and the C ABI), with torch's MemPool.id and use_count(); the tests
of torch's test_cuda.py (and torch_npu's test_mempool.py) that do not need a custom allocator,
ported."""

import ctypes
import gc
import threading
import time
import weakref

import pytest

import ascend_pool as ap
from ascend_pool import registry, sim
from ascend_pool.tenants import Context

MiB = 1 << 20


@pytest.fixture
def lib():
    lib = ctypes.CDLL(ap.library_path())
    lib.ascend_pool_malloc.restype = ctypes.c_void_p
    lib.ascend_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ascend_pool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    return lib


def test_use_mem_pool_routes_module_calls_and_the_c_abi_and_counts_its_use(lib):
    # torch's test_mempool_with_allocator / torch_npu's test_mempool_public_api: use_count() is 1
    # for the pool object, 2 inside use_mem_pool, 1 again after it
    pool = ap.Pool(0)
    try:
        assert pool.use_count() == 1
        with ap.use_mem_pool(pool):
            assert pool.use_count() == 2
            assert ap.default_pool(0) is pool
            a = ap.malloc(MiB)
            b = ap.caching_allocator_alloc(MiB)
            c = lib.ascend_pool_malloc(MiB, 0, None)
            assert c, "the C ABI refused an allocation"
        assert pool.use_count() == 1
        assert all(pool.block_info(p) is not None for p in (a, b, c))
        assert ap.default_pool(0) is not pool
        d = lib.ascend_pool_malloc(MiB, 0, None)  # the default pool again, for the C ABI too
        assert pool.block_info(d) is None
        lib.ascend_pool_free(d, MiB, 0, None)
        for p in (a, b, c):
            ap.caching_allocator_delete(p)  # found on the pool that made it, outside the block too
        assert pool.memory_stats()["allocated_bytes.all.current"] == 0
    finally:
        pool.close()


def test_module_level_figures_inside_the_block_are_the_devices_as_outside_it():
    # torch.cuda.memory_stats() and co. answer the device's allocator inside use_mem_pool as
    # outside it (the MemPool one of its private pools); they answered the MemPool's own figures,
    # the default pool's 8 MiB read as 0 there
    mp = ap.Pool(0)
    a = ap.malloc(8 * MiB)
    try:
        def figures():
            s = ap.memory_stats(0)
            return (s["allocated_bytes.all.current"], ap.memory_allocated(), ap.memory_reserved(),
                    ap.max_memory_allocated(), ap.memory_stats_as_nested_dict()["allocated_bytes"]["all"]["current"],
                    len(ap.snapshot()["segments"]))
        outside = figures()
        assert outside[0] >= 8 * MiB
        with ap.use_mem_pool(mp):
            b = ap.malloc(30 * MiB)
            assert figures() == outside
            stats = ap.memory_stats()
            assert stats[f"reserved_bytes_by_private_pools.{mp.id[0]}_{mp.id[1]}.all.current"] >= 30 * MiB
            ap.reset_peak_stats()  # the default pool's peaks, as outside
        assert mp.memory_stats()["allocated_bytes.all.peak"] >= 30 * MiB
        mp.free(b)
    finally:
        ap.free(a)
        mp.close()


def test_mempool_ids_are_torchs_and_unique_across_threads():
    # torch's test_mempool_id and test_mempool_multithread
    ids, pools = [], []

    def create():
        p = ap.Pool(0)
        pools.append(p)
        ids.append(p.id)

    threads = [threading.Thread(target=create) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(set(ids)) == 4 and all(i[0] == 0 and i[1] > 0 for i in ids)
        assert all(p.id == p.pool_id for p in pools)
        assert ap.default_pool(0).id == (0, 0)
    finally:
        for p in pools:
            p.close()


def test_nested_mempools_route_to_the_innermost():
    # torch's test_nested_mempool: 20 MiB allocations, one segment each; pool1 gets 2, pool2 2, pool3 1
    pools = [ap.Pool(0) for _ in range(3)]
    data = []

    def allocate():
        data.append(ap.malloc(20 * MiB))

    try:
        with ap.use_mem_pool(pools[0]):
            allocate()
            with ap.use_mem_pool(pools[1]):
                allocate()
                with ap.use_mem_pool(pools[2]):
                    allocate()
                    assert [p.use_count() for p in pools] == [2, 2, 2]
                allocate()
            allocate()
        assert [len(ap.memory_snapshot(p.id)) for p in pools] == [2, 2, 1]
        for ptr in data:
            ap.caching_allocator_delete(ptr)
    finally:
        for p in pools:
            p.close()


def test_only_the_calling_thread_allocates_from_the_pool(lib):
    # torch's note: a thread spawned inside the block allocates from its own current pool
    pool = ap.Pool(0)
    seen = {}

    def other():
        seen["python"] = ap.default_pool(0)
        ptr = lib.ascend_pool_malloc(MiB, 0, None)
        seen["c"] = pool.block_info(ptr)
        lib.ascend_pool_free(ptr, MiB, 0, None)

    try:
        with ap.use_mem_pool(pool):
            t = threading.Thread(target=other)
            t.start()
            t.join()
        assert seen["python"] is not pool and seen["c"] is None
    finally:
        pool.close()


def test_mixes_with_tenant_contexts_and_counts_their_with_blocks():
    pool = ap.Pool(0)
    ctx = pool.context("mempool-mix")
    try:
        with ap.use_mem_pool(pool):
            with ctx:
                assert ap.default_pool(0) is ctx and ctx.use_count() == 2
                with ap.use_mem_pool(pool):
                    assert ap.default_pool(0) is pool and pool.use_count() == 3
                assert ap.default_pool(0) is ctx
            assert ap.default_pool(0) is pool and ctx.use_count() == 1
        with ap.use_mem_pool(ctx):  # a context is a pool too
            assert ap.default_pool(0) is ctx
    finally:
        ctx.close()
        pool.close()


def test_a_pool_closed_inside_the_block_is_refused_until_the_block_ends(lib):
    pool = ap.Pool(0)
    with ap.use_mem_pool(pool):
        pool.close()
        with pytest.raises(ap.PoolError, match="closed"):
            ap.malloc(MiB)
        assert not lib.ascend_pool_malloc(MiB, 0, None), "the C ABI must not fall back to the default unawares"
    ptr = lib.ascend_pool_malloc(MiB, 0, None)
    assert ptr
    lib.ascend_pool_free(ptr, MiB, 0, None)


def test_bad_arguments_are_typed_errors():
    pool = ap.Pool(0)
    try:
        with pytest.raises(ap.InvalidDeviceError, match="device 0, not device 1"):
            with ap.use_mem_pool(pool, device=1):
                pass
        with ap.use_mem_pool(pool, device="npu:0"):
            assert ap.default_pool(0) is pool
        with pytest.raises(ap.ConfigTypeError, match="pool must be"):
            with ap.use_mem_pool(pool.id):
                pass
        assert pool.use_count() == 1
    finally:
        pool.close()
    with pytest.raises(ap.PoolError, match="closed"):
        with ap.use_mem_pool(pool):
            pass


def test_pool_id_in_snapshot(tmp_path):
    # torch's (and torch_npu's) test_pool_id_in_snapshot: each segment and each trace entry of the
    # process snapshot names its pool (torch's TraceEntry.pool_id); the default pool's are (0, 0)
    import pickle

    pool = ap.Pool(0)
    try:
        ap.record_memory_history("all")
        with ap.use_mem_pool(pool):
            x = ap.malloc(64)
        y = ap.malloc(64)
        ap.dump_snapshot(str(tmp_path / "s.pickle"))
        ss = pickle.loads((tmp_path / "s.pickle").read_bytes())
        assert any(seg["segment_pool_id"] == pool.id for seg in ss["segments"])
        allocs = {te["addr"]: te["pool_id"] for te in ss["device_traces"][0] if te["action"] == "alloc"}
        assert allocs[x] == pool.id and allocs[y] == (0, 0)
        ap.free(x)
        ap.free(y)
    finally:
        ap.record_memory_history(None)
        pool.close()


def test_empty_cache_inside_the_block_keeps_the_mempools_cache_and_empties_the_one_beneath():
    # torch's empty_cache() passes the default pool id: release_cached_blocks empties the device's
    # own pools and the private pools no longer in use, never a MemPool in use; inside a
    # `with ctx:` beneath the block, the context is the thread's pool to empty
    pool = ap.Pool(0)
    default = ap.default_pool(0)
    ctx = default.context("mempool-empty")
    reserved = lambda p: p.memory_stats()["reserved_bytes.all.current"]  # noqa: E731
    try:
        ap.free(ap.malloc(8 * MiB, device=0))
        with ctx:
            ap.free(ap.malloc(8 * MiB))
            with ap.use_mem_pool(pool):
                ap.free(ap.malloc(8 * MiB))
                held = reserved(pool)
                assert held and reserved(ctx)
                ap.empty_cache()
                assert reserved(pool) == held
                assert reserved(ctx) == 0
                ap.free(ap.malloc(8 * MiB))
                ap.empty_cache(0)
                assert reserved(pool) == held
        ap.free(ap.malloc(8 * MiB, device=0))
        assert reserved(default)
        with ap.use_mem_pool(pool):
            ap.empty_cache()
            assert reserved(pool) == held and reserved(default) == 0
            pool.empty_cache()  # the pool's own call empties it
            assert reserved(pool) == 0
    finally:
        ctx.close()
        pool.close()


def test_empty_cache_while_another_thread_reaps_gives_a_dropped_pools_memory_back(monkeypatch):
    # torch's test_mempool_empty_cache_inactive: a MemPool dropped while its tensor lives; after
    # `del x; empty_cache()` its memory is back. The stats thread reaps dropped pools every tick;
    # when its pass was under way, empty_cache skipped the reap and returned with the pool still
    # open and its segment held (until that thread's next pass). Its pass is made slow here to
    # hit that window every time.
    pool = ap.Pool(0)
    with ap.use_mem_pool(pool):
        x = ap.malloc(8 * MiB)
    ref = weakref.ref(pool)
    del pool
    gc.collect()
    assert registry.is_orphan(ref())
    real_pass, entered = registry._reap_pass, threading.Event()

    def slow_pass():
        entered.set()
        time.sleep(0.5)
        return real_pass()

    monkeypatch.setattr(registry, "_reap_pass", slow_pass)
    reaper = threading.Thread(target=registry.reap_orphans)
    reaper.start()
    try:
        assert entered.wait(10)
        ap.free(x)
        ap.empty_cache()
        dropped = ref()
        assert dropped is None or dropped.closed, "the dropped pool's segment is still held"
    finally:
        reaper.join()


def test_the_c_abis_empty_cache_keeps_live_mempools_caches_as_torchs_empty_cache(lib):
    # torch.npu.empty_cache() under the pluggable allocator calls the reset hook
    # (ascend_pool_reset -> ascend_pool_empty_cache). torch's emptyCache passes the default pool
    # id: release_cached_blocks empties each device's own pools and the private pools no longer
    # in use, never a live MemPool, in use_mem_pool or not; the C ABI emptied every live pool (a
    # MemPool's warm segments, other threads' tenant contexts), unlike ap.empty_cache().
    lib.ascend_pool_empty_cache.argtypes = []
    pool = ap.Pool(0)
    default = ap.default_pool(0)
    mine, theirs = default.context("c-empty-mine"), default.context("c-empty-theirs")
    reserved = lambda p: p.memory_stats()["reserved_bytes.all.current"]  # noqa: E731
    try:
        for p in (pool, mine, theirs):
            p.free(p.malloc(8 * MiB))
        ap.free(ap.malloc(8 * MiB, device=0))
        held = {p: reserved(p) for p in (pool, mine, theirs)}
        assert all(held.values()) and reserved(default)
        with mine:
            with ap.use_mem_pool(pool):
                lib.ascend_pool_empty_cache()  # a framework thread inside both blocks
        assert reserved(default) == 0 and reserved(mine) == 0  # the device's own, the thread's context
        assert reserved(pool) == held[pool] and reserved(theirs) == held[theirs]
        lib.ascend_pool_empty_cache()  # outside any block: the MemPool still keeps its cache
        assert reserved(pool) == held[pool] and reserved(theirs) == held[theirs]
    finally:
        theirs.close()
        mine.close()
        pool.close()


def test_a_memory_fraction_set_inside_the_block_caps_the_device_not_the_mempool(lib):
    # torch's set_per_process_memory_fraction caps the device's allocator: set inside
    # use_mem_pool, it holds after the block. It capped the MemPool in use instead (Python and
    # the C ABI's memory_fraction hook alike), and the default pool, uncapped, took half the device.
    lib.ascend_pool_set_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
    pool = ap.Pool(0)
    default = ap.default_pool(0)
    total = ap.mem_get_info(0)[1]
    try:
        for set_fraction in (lambda: ap.set_per_process_memory_fraction(0.25, 0),
                             lambda: lib.ascend_pool_set_memory_fraction(0.25, 0)):
            with ap.use_mem_pool(pool):
                set_fraction()
                assert ap.get_per_process_memory_fraction(0) == 0.25
            assert ap.get_per_process_memory_fraction(0) == 0.25
            assert default.get_limit() == int(0.25 * total) and pool.get_limit() == 0
            with pytest.raises(ap.OutOfMemoryError):
                ap.malloc(total // 2, device=0)
            ap.set_per_process_memory_fraction(1.0, 0)
            default.set_limit()  # no cap, for the next round and the other tests
    finally:
        pool.close()


def test_a_memory_fraction_caps_the_mempools_with_the_default_pool(lib):
    # torch's TestMemPool._setup_mempool_limited_memory_test: set_per_process_memory_fraction caps
    # the device's allocator, whose total counts every MemPool's segments; two MemPools holding
    # the room leave none for the default pool. The MemPools' bytes were outside the cap (the
    # default pool took 30 MiB more past an 80 MiB fraction, held 96 MiB in all).
    lib.ascend_pool_set_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
    ap.empty_cache()
    default = ap.default_pool(0)
    total = ap.mem_get_info(0)[1]
    pre = default.total_bytes()
    for set_fraction in (lambda f: ap.set_per_process_memory_fraction(f, 0),
                         lambda f: lib.ascend_pool_set_memory_fraction(f, 0)):
        p1, p2 = ap.Pool(0), ap.Pool(0)
        try:
            set_fraction((80 * MiB + pre) / total)
            with ap.use_mem_pool(p1):
                a = ap.malloc(30 * MiB)        # a 32 MiB segment each
            with ap.use_mem_pool(p2):
                b = lib.ascend_pool_malloc(30 * MiB, 0, None)
            with pytest.raises(ap.OutOfMemoryError, match="memory fraction"):
                ap.malloc(30 * MiB)
            assert not lib.ascend_pool_malloc(30 * MiB, 0, None)
            with pytest.raises(ap.OutOfMemoryError):  # a MemPool's own growth too
                with ap.use_mem_pool(p1):
                    ap.malloc(30 * MiB)
            # a tenant context keeps its own caps: its bytes are not the device allocator's
            with ap.Pool(0).context("peer25-fraction") as ctx:
                ctx.free(ctx.malloc(30 * MiB))
            p1.free(a)
            p1.empty_cache()                   # its segment back to the device: room again
            c = ap.malloc(30 * MiB)
            ap.free(c)
            lib.ascend_pool_free(b, 30 * MiB, 0, None)
            p2.close()                         # a closed MemPool's bytes leave the sum
            d = ap.malloc(60 * MiB)
            ap.free(d)
        finally:
            ap.set_per_process_memory_fraction(1.0, 0)
            default.set_limit()
            p1.close()
            p2.close()
            ap.empty_cache()


def test_use_on_oom_lends_a_mempools_idle_cache_and_a_mempool_without_it_keeps_its_own():
    # torch's test_mempool_limited_memory_with_allocator (without the custom allocator): under a
    # memory fraction the MemPools fill, the default pool's request is served from a free block
    # of the MemPool made with use_on_oom=True, in place (torch's use_on_oom_pools: no device call,
    # the block stays the MemPool's), never from the other's. Pool(use_on_oom=True) was a
    # ConfigError (unknown knob), and a device out of memory took every live pool's idle cache;
    # then the lender's segment went back to the device and the default pool grew a new one.
    keep, lend = ap.Pool(0), ap.Pool(0, use_on_oom=True)
    default = ap.default_pool(0)
    ap.empty_cache()
    total = ap.mem_get_info(0)[1]
    try:
        ap.set_per_process_memory_fraction((64 * MiB + default.total_bytes()) / total, 0)
        with ap.use_mem_pool(keep):
            a = ap.malloc(30 * MiB)
        with ap.use_mem_pool(lend):
            b = ap.malloc(30 * MiB)
        with pytest.raises(ap.OutOfMemoryError):
            ap.malloc(30 * MiB)
        keep.free(a)
        lend.free(b)
        grown = default.memory_stats()["num_device_alloc"]
        c = ap.malloc(30 * MiB)  # lend's free block, in place
        assert c == b and default.memory_stats()["num_device_alloc"] == grown
        assert lend.total_bytes() == 32 * MiB and keep.total_bytes() == 32 * MiB
        assert lend.memory_stats()["allocated_bytes.all.current"] > 30 * MiB  # counted where it lives
        with pytest.raises(ap.OutOfMemoryError):
            ap.malloc(30 * MiB)  # keep's cache is its own
        assert keep.total_bytes() == 32 * MiB
        ap.free(c)
        with ap.use_mem_pool(lend):  # lend still serves its own block, where c was
            e = ap.malloc(20 * MiB)
        assert e == c
        lend.free(e)
    finally:
        ap.set_per_process_memory_fraction(1.0, 0)
        default.set_limit()
        keep.close()
        lend.close()
    # without a fraction: a full device takes the default pool's idle cache, a use_on_oom pool
    # lends its free block in place, a live MemPool keeps its own
    keep, lend = ap.Pool(0), ap.Pool(0, use_on_oom=True)
    try:
        keep.free(keep.malloc(40 * MiB))
        lend.free(lend.malloc(40 * MiB))
        held = lend.total_bytes()
        ap.empty_cache()
        sim.set_faults(fail_after_bytes=sim.stats(0)["bytes_held"])  # the device: full at what is held now
        try:
            c = ap.malloc(30 * MiB)
            default.free(c)  # the pool it was asked of frees it: the block goes back to its lender
        finally:
            sim.set_faults(fail_after_bytes=-1)
        assert keep.total_bytes() >= 40 * MiB and lend.total_bytes() == held
        assert lend.memory_stats()["allocated_bytes.all.current"] == 0
    finally:
        keep.close()
        lend.close()


def test_no_split_gives_each_allocation_a_segment_of_its_own():
    # torch's test_mempool_no_split: Pool(no_split=True) was a ConfigError (unknown knob)
    split, whole = ap.Pool(0), ap.Pool(0, no_split=True)
    try:
        for p in (split, whole):
            with ap.use_mem_pool(p):
                ap.malloc(4 * MiB)
                ap.malloc(4 * MiB)
        segs = {p: ap.memory_snapshot(p.id) for p in (split, whole)}
        assert len(segs[whole]) > len(segs[split])
        assert all(len(s["blocks"]) == 1 for s in segs[whole])
        assert sum(len(s["blocks"]) for s in segs[whole]) < sum(len(s["blocks"]) for s in segs[split])
        with pytest.raises(ap.ConfigTypeError, match="no_split"):
            ap.Pool(0, no_split="yes")
        with pytest.raises(ap.ConfigError, match="tenant context"):
            Context("peer25-nosplit", 0, use_on_oom=True)
    finally:
        split.close()
        whole.close()


def test_a_no_split_pool_hands_no_request_a_cached_block_far_bigger_than_it():
    # a no_split pool's blocks are never split, so each is as torch's oversize blocks, which a
    # request takes only within kLargeBuffer (20 MiB) of its size: a 2 MiB request took a free
    # 100 MiB block whole (98 MiB of it serving no one), or, once that segment was traded away,
    # a new segment grown past its size (66 MiB: it absorbed the trade's room)
    whole = ap.Pool(0, no_split=True)
    try:
        big = whole.malloc(100 * MiB)
        whole.free(big)
        small = whole.malloc(2 * MiB)
        assert whole.block_info(small)[1] < 22 * MiB
        near = whole.malloc(90 * MiB)
        assert whole.block_info(near)[1] < 110 * MiB
        assert whole.memory_stats()["reserved_bytes.all.current"] < 132 * MiB
    finally:
        whole.close()


def test_a_pools_snapshot_takes_torchs_include_traces():
    # torch's MemPool.snapshot(include_traces=True): False gives the segments without trace
    # entries (a lightweight snapshot); it was a TypeError (unexpected keyword argument)
    pool = ap.Pool(0, record_history=True)
    try:
        pool.free(pool.malloc(MiB))
        full = pool.snapshot()
        assert any(full["device_traces"])
        light = pool.snapshot(include_traces=False)
        assert not any(light["device_traces"]) and len(light["device_traces"]) == len(full["device_traces"])
        assert light["segments"] == pool.snapshot(include_traces=True)["segments"]
    finally:
        pool.close()


_INIT_INSIDE = """
import ctypes, sys
import ascend_pool as ap
from ascend_pool import registry
lib = ctypes.CDLL(ap.library_path())
mp = ap.Pool(0)
with ap.use_mem_pool(mp):
    lib.ascend_pool_init(0)
    inside = registry.default_pool(0) is not None
print(inside, mp.memory_stats()["reserved_bytes.all.current"])
"""


def test_ascend_pool_init_inside_the_block_makes_the_process_default_pool():
    """ascend_pool_init(d) (torch's lazy init, run at a first tensor made in a MemPool block) makes
    the process's default pool of d, as the header promises threads that must never wait for the
    GIL: inside use_mem_pool it took the thread's MemPool for it and made none (a fresh process:
    no default pool of device 0 yet)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(ap.__file__))))
    proc = subprocess.run([sys.executable, "-c", _INIT_INSIDE], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "0"]


def test_the_memory_fraction_serves_what_fits_as_a_pools_own_limit_does():
    # The placement's limit rules go by the device's memory fraction too: near it a request's
    # segment is its exact size, and an expandable growth maps no more than it needs. They went by
    # the pool's own limit alone, so a MemPool under the fraction (no limit of its own), or the
    # default pool beside MemPools that hold most of it, was refused requests that fit: a
    # 1000-byte one for a 2 MiB segment, the last 1 MiB ones for a growth's overshoot.
    MiB_ = MiB

    def fill(pool):
        held = []
        while len(held) < 200:
            try:
                held.append(pool.malloc(MiB_))
            except ap.OutOfMemoryError:
                break
        for a in held:
            pool.free(a)
        return len(held)

    default = ap.default_pool(0)
    ap.empty_cache()
    total = ap.mem_get_info(0)[1]
    pre = default.total_bytes()
    grows = ap.Pool(0, expandable_segments=True)  # fresh: past its growth budget at a new peak
    try:
        grows.set_limit(100 * MiB)
        own_limit = fill(grows)
    finally:
        grows.close()
    grows = ap.Pool(0, expandable_segments=True)
    try:
        ap.set_per_process_memory_fraction((100 * MiB + pre) / total, 0)
        assert fill(grows) == own_limit == 99
    finally:
        ap.set_per_process_memory_fraction(1.0, 0)
        default.set_limit()
        grows.close()
    mp = ap.Pool(0)
    try:
        ap.set_per_process_memory_fraction((39 * MiB + pre) / total, 0)
        a = mp.malloc(37 * MiB)  # a 38 MiB segment: 1 MiB of the fraction left
        ap.free(ap.malloc(1000))
        with ap.use_mem_pool(mp):
            ap.free(ap.malloc(1000))
        mp.free(a)
    finally:
        ap.set_per_process_memory_fraction(1.0, 0)
        default.set_limit()
        mp.close()


_DEFAULT_MADE_TWICE = """
import ascend_pool as ap
from ascend_pool import api
real, nested = api._create_default, []
def create(device):
    pool = real(device)
    if not nested:  # a signal handler's call, inside the creating thread's lock
        nested.append(1)
        api.process_default_pool(device)
    return pool
api._create_default = create
d = ap.default_pool(0)
limit = d._limit()
mp = ap.Pool(0)
a = d.malloc(limit * 6 // 10)
try:
    mp.malloc(limit * 6 // 10)
except ap.OutOfMemoryError:
    print("capped")
else:
    print("not capped")
"""


def test_a_default_pool_made_while_another_was_made_keeps_the_fraction_over_the_mempools():
    """api.process_default_pool closes the default it made when a signal handler made one
    meanwhile: that close lifted the device's memory fraction (its memory_fraction knob) over every
    MemPool, although the handler's pool owned the cap by then; a MemPool then took 60% of the
    fraction beside the default pool's 60%."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, ASCEND_POOL_CONF="memory_fraction:0.001",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(ap.__file__))))
    proc = subprocess.run([sys.executable, "-c", _DEFAULT_MADE_TWICE], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["capped"]


def _growth_calls(expandable, n=600, own_limit=False):
    pool = ap.Pool(0, backend="sim", expandable_segments=expandable)
    try:
        if own_limit:
            pool.set_limit(fraction=1.0)
        held = [pool.malloc(5 * MiB - 32) for _ in range(n)]
        calls = pool.memory_stats()["num_device_alloc"]
        for p in held:
            pool.free(p)
        return calls
    finally:
        pool.close()


@pytest.mark.parametrize("expandable", [False, True])
def test_a_memory_fraction_far_from_full_leaves_a_pools_growth_policy_as_it_is(expandable):
    # A fraction caps every plain pool of the device; the placement's limit rules (exact growths,
    # no overshoot, no absorbed room) are for a pool near it. They were applied under any fraction,
    # 1.0 included (a framework's "no cap"): 600 growing 5 MiB requests of an expandable pool then
    # made a device call each, not the geometric growths they make without a fraction (~170).
    free = _growth_calls(expandable)
    ap.set_per_process_memory_fraction(1.0, 0)
    try:
        assert _growth_calls(expandable) == free < 600 / 2
    finally:
        ap.default_pool(0).set_limit()


@pytest.mark.parametrize("expandable", [False, True])
def test_a_pools_own_limit_far_from_full_leaves_its_growth_policy_as_it_is(expandable):
    # The same for a pool's own limit (set_limit, or the default pool's memory fraction, which is
    # its own limit): an expandable growth dropped its overshoot under any own limit, so 600
    # growing 5 MiB requests made 600 device calls against 229 without a limit.
    assert _growth_calls(expandable, own_limit=True) == _growth_calls(expandable) < 600 / 2


def test_use_mem_pool_decorates_a_function_as_torchs_context_manager_does():
    # torch's use_mem_pool is a contextlib context manager, so it decorates too: each call of the
    # function runs in a block of its own, and the pool is current only during the call
    pool = ap.Pool(0)
    got = []

    @ap.use_mem_pool(pool)
    def allocate(n):
        """allocates n bytes"""
        got.append((ap.malloc(n), pool.use_count()))
        return len(got)

    try:
        assert allocate.__doc__ == "allocates n bytes" and allocate.__name__ == "allocate"
        assert allocate(MiB) == 1 and allocate(2 * MiB) == 2
        assert [count for _, count in got] == [2, 2]    # the pool's own reference and the call's block
        assert pool.use_count() == 1
        assert {b["address"] for s in ap.memory_snapshot(pool.id) for b in s["blocks"]
                if b["state"] == "active_allocated"} == {ptr for ptr, _ in got}
        outside = ap.malloc(MiB)
        assert outside not in {b["address"] for s in ap.memory_snapshot(pool.id) for b in s["blocks"]}
        ap.free(outside)
        for ptr, _ in got:
            ap.caching_allocator_delete(ptr)
    finally:
        pool.close()

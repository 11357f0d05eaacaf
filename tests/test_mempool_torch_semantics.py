"""torch's TestMemPool / memory-fraction tests of test/test_cuda.py, ported to ascend_pool's names
(torch.cuda.MemPool -> ap.Pool(0, ...), use_mem_pool -> ap.use_mem_pool, torch.empty on the device
-> ap.malloc, set_per_process_memory_fraction -> ap.set_per_process_memory_fraction). Sizes: the
acl pad (32 bytes) makes a 40 MiB request a 42 MiB segment, so the fractions leave 42 MiB a block
where torch's leave 40."""

import gc
import os
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401

import ascend_pool as ap  # noqa: E402

MiB = 1 << 20


@pytest.fixture
def limited():
    """torch's _setup_mempool_limited_memory_test: a fraction of what the default pool holds plus
    `extra` bytes; undone (and the cache emptied) after the test."""
    default = ap.default_pool(0)
    ap.empty_cache()
    total = ap.mem_get_info(0)[1]

    def setup(extra):
        ap.set_per_process_memory_fraction((extra + default.total_bytes()) / total, 0)
        return default

    yield setup
    ap.set_per_process_memory_fraction(1.0, 0)
    default.set_limit()
    ap.empty_cache()


def test_mempool_limited_memory_use_on_oom_lends_in_place(limited):
    # torch's test_mempool_limited_memory_with_allocator: the default pool's request takes the
    # use_on_oom MemPool's free block (same address, no device allocation, the MemPool keeps its
    # segment), never the other MemPool's. ascend_pool released the lender's segment and grew the
    # default pool a new one elsewhere (repros/use_on_oom_lends_in_place.py).
    keep, lend = ap.Pool(0), ap.Pool(0, use_on_oom=True)
    try:
        default = limited(84 * MiB)
        with ap.use_mem_pool(keep):
            a = ap.malloc(40 * MiB)
        with ap.use_mem_pool(lend):
            b = ap.malloc(40 * MiB)
        with pytest.raises(ap.OutOfMemoryError):
            ap.malloc(40 * MiB)
        keep.free(a)
        lend.free(b)
        allocs, held = default.memory_stats()["num_device_alloc"], lend.total_bytes()
        c = ap.malloc(30 * MiB)
        assert c == b
        assert default.memory_stats()["num_device_alloc"] == allocs and lend.total_bytes() == held
        with pytest.raises(ap.OutOfMemoryError):
            ap.malloc(30 * MiB)  # the MemPool without use_on_oom keeps its free block
        default.free(c)  # freed by the pool it was asked of: back to the lender
        with ap.use_mem_pool(lend):
            e = ap.malloc(20 * MiB)
        assert e == c
        lend.free(e)
    finally:
        keep.close()
        lend.close()


def test_deleted_mempool_not_used_on_oom(limited):
    # torch's test_deleted_mempool_not_used_on_oom: dropped use_on_oom pools lend nothing; the
    # live one lends two blocks of its free segment
    limited(42 * MiB)
    for _ in range(10):
        pool = ap.Pool(0, use_on_oom=True)
        with ap.use_mem_pool(pool):
            a = ap.malloc(40 * MiB)
        pool.free(a)
        del pool
        gc.collect()
    new = ap.Pool(0, use_on_oom=True)
    try:
        with ap.use_mem_pool(new):
            new.free(ap.malloc(40 * MiB))
        b = ap.malloc(20 * MiB)
        c = ap.malloc(20 * MiB)
        assert new.block_info(b) is not None and new.block_info(c) is not None
        ap.free(b)
        ap.free(c)
    finally:
        new.close()


def test_a_lent_block_takes_record_stream_through_the_pool_it_was_asked_of(limited):
    # torch's record_stream works on any block of the allocator; a lent block is the lender's, and
    # the default pool's record_stream of it was an InvalidPointerError
    lend = ap.Pool(0, use_on_oom=True)
    try:
        default = limited(42 * MiB)
        with ap.use_mem_pool(lend):
            lend.free(ap.malloc(40 * MiB))
        c = default.malloc(30 * MiB)
        assert lend.block_info(c) is not None
        s = lend.create_stream()
        default.record_stream(c, s)
        default.free(c)
        lend.synchronize(s)
        assert lend.memory_stats()["allocated_bytes.all.current"] == 0
    finally:
        lend.close()


_GC_UNDER_FRACTION = """
import ascend_pool as ap
MiB = 1 << 20
default = ap.default_pool(0)
mp = ap.Pool(0)
ap.set_per_process_memory_fraction(100 * MiB / ap.mem_get_info(0)[1], 0)
ap.set_allocator_settings("garbage_collection_threshold:0.5")
with ap.use_mem_pool(mp):
    live = ap.malloc(40 * MiB)
ap.free(ap.malloc(10 * MiB))
b = ap.malloc(20 * MiB)
print(default.memory_stats()["num_device_free"], (default.total_bytes() + mp.total_bytes()) // MiB)
"""


def test_garbage_collection_under_a_fraction_counts_the_mempools_segments():
    """torch's garbage_collect_cached_blocks: past garbage_collection_threshold * the fraction's
    allowed bytes, counted over the device's allocator (total_allocated_memory: MemPools' segments
    too), the default pool's idle segments go. Its own reserved bytes were counted: a MemPool held
    42 MiB of a 100 MiB fraction (gc 0.5), the default pool kept its idle 12 MiB segment and grew
    22 MiB beside it, 76 MiB in all (repros/gc_threshold_counts_the_mempools.py). A fresh process:
    the default pool holds nothing else, and release_policy never leaves the release to the gc."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(ap.__file__))),
               ASCEND_POOL_CONF="release_policy:never")
    proc = subprocess.run([sys.executable, "-c", _GC_UNDER_FRACTION], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "64"]


def test_set_per_process_memory_fraction(sim_node):
    # torch's test_set_per_process_memory_fraction and test_get_per_process_memory_fraction, on a
    # 1 GiB simulated device (a fresh process: nothing else holds memory there)
    out = sim_node.run_json("""
        import json, random
        import ascend_pool as ap
        errors = []
        try:
            ap.set_per_process_memory_fraction(1)
        except TypeError as e:
            errors.append("Invalid type" in str(e))
        for bad in (-0.1, 2.0):
            try:
                ap.set_per_process_memory_fraction(bad)
            except ValueError as e:
                errors.append("Invalid fraction value" in str(e))
        total = ap.mem_get_info(0)[1]
        keep = ap.malloc(4096)
        ap.empty_cache()
        ap.set_per_process_memory_fraction(0.5, 0)
        tmp = ap.malloc(int(total * 0.499) - ap.max_memory_reserved(0))
        ap.free(tmp)
        ap.empty_cache()
        try:
            ap.malloc(int(total * 0.5))
            oom = "none"
        except ap.OutOfMemoryError as e:
            oom = "out of memory" in str(e)
        ap.free(keep)
        got = []
        for value in [1.0, 0.0] + [random.random() for _ in range(3)]:
            ap.set_per_process_memory_fraction(value)
            got.append(ap.get_per_process_memory_fraction() == value)
        print(json.dumps({"errors": errors, "oom": oom, "get": got}))
    """)
    assert out == {"errors": [True, True, True], "oom": True, "get": [True] * 5}


def test_a_fraction_on_device_1_does_not_cap_device_0(sim_node):
    # torch's fraction is per device (setMemoryFraction of that device's allocator): a fraction set
    # on device 1, from Python or the C ABI's hook, leaves device 0's default pool and MemPools alone
    out = sim_node.run_json("""
        import ctypes, json
        import ascend_pool as ap
        MiB = 1 << 20
        lib = ctypes.CDLL(ap.library_path())
        lib.ascend_pool_set_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
        res = []
        for setter in (lambda: ap.set_per_process_memory_fraction(0.1, 1),
                       lambda: lib.ascend_pool_set_memory_fraction(0.1, 1)):
            setter()
            a = ap.malloc(300 * MiB, device=0)
            mp = ap.Pool(0)
            with ap.use_mem_pool(mp):
                b = ap.malloc(300 * MiB)
            try:
                ap.malloc(300 * MiB, device=1)
                one = "served"
            except ap.OutOfMemoryError:
                one = "refused"
            res.append([ap.get_per_process_memory_fraction(0), ap.get_per_process_memory_fraction(1), one])
            ap.free(a, device=0)
            mp.free(b)
            mp.close()
            ap.set_per_process_memory_fraction(1.0, 1)
            ap.empty_cache(0)
        print(json.dumps(res))
    """)
    assert out == [[1.0, 0.1, "refused"], [1.0, 0.1, "refused"]]


def test_mempool_emptycache_multithread():
    # torch's test_mempool_emptycache_multithread: empty_cache inside each thread's use_mem_pool
    # block keeps that MemPool's cache
    pools = [ap.Pool(0) for _ in range(4)]

    def work(pool):
        with ap.use_mem_pool(pool):
            ap.free(ap.malloc(16))
            ap.empty_cache()

    threads = [threading.Thread(target=work, args=(p,)) for p in pools]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [len(ap.memory_snapshot(p.id)) for p in pools] == [1] * 4
    finally:
        for p in pools:
            p.close()


def test_mempool_ctx_multithread():
    # torch's test_mempool_ctx_multithread: another thread's allocation while this one is inside
    # use_mem_pool goes to the default pool; the MemPool's block, freed, holds nothing active
    mp = ap.Pool(0)
    inside, done = threading.Event(), threading.Event()
    seen = {}

    def main():
        with ap.use_mem_pool(mp):
            ap.free(ap.malloc(MiB))
            inside.set()
            done.wait(10)

    def side():
        inside.wait(10)
        seen["ptr"] = ap.malloc(MiB)
        seen["default"] = ap.default_pool(0).block_info(seen["ptr"]) is not None
        done.set()

    threads = [threading.Thread(target=main), threading.Thread(target=side)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert seen["default"] and mp.memory_stats()["active_bytes.all.current"] == 0
        assert all(s["active_size"] == 0 for s in ap.memory_snapshot(mp.id))
    finally:
        if "ptr" in seen:
            ap.free(seen["ptr"])
        mp.close()


def test_the_c_abi_borrows_and_frees_a_lent_block(limited):
    # torch's allocator serves a framework's tensors (the C ABI here) as its Python calls: the
    # default pool's refused request takes the use_on_oom MemPool's free block, and the C ABI's
    # free finds it there
    import ctypes

    lib = ctypes.CDLL(ap.library_path())
    lib.ascend_pool_malloc.restype = ctypes.c_void_p
    lib.ascend_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ascend_pool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lend = ap.Pool(0, use_on_oom=True)
    try:
        limited(42 * MiB)
        with ap.use_mem_pool(lend):
            b = ap.malloc(40 * MiB)
        lend.free(b)
        c = lib.ascend_pool_malloc(30 * MiB, 0, None)
        assert c == b and lend.block_info(c) is not None
        lib.ascend_pool_free(c, 30 * MiB, 0, None)
        assert lend.memory_stats()["allocated_bytes.all.current"] == 0
    finally:
        lend.close()


def test_a_tenant_context_never_lends_its_blocks_to_the_default_pool(limited):
    # A context's blocks count under its tenant's quota: the default pool refused by its fraction
    # must not take one in place, as it takes a use_on_oom MemPool's (a context is no MemPool;
    # the combined setter once derived "lends" from "keeps_idle", which a context has off).
    plain = ap.Pool(0)
    ctx = plain.context("lend-check")
    try:
        limited(0)
        with ctx:
            a = ap.malloc(40 * MiB)
        ctx.free(a)
        held = ctx.total_bytes()
        with pytest.raises(ap.OutOfMemoryError):
            ap.malloc(30 * MiB)
        assert ctx.total_bytes() == held and ctx.memory_stats()["active_bytes.all.current"] == 0
    finally:
        ctx.close()
        plain.close()


def test_a_lenders_close_keeps_the_blocks_it_lent_until_their_free(limited, caplog):
    # torch's MemPool outlives the blocks allocated from it, the ones the default pool's requests
    # took under use_on_oom too. Its close gave their memory back to the device under the caller
    # of ap.malloc, whose free was then an InvalidPointerError
    # (repros/lender_close_frees_lent_block.py). The lender is closed to its user; the lent block
    # stays valid (no warning: nothing of it is lost), its free works, then the memory goes back.
    from ascend_pool import sim

    lend = ap.Pool(0, use_on_oom=True)
    free0 = None
    try:
        limited(42 * MiB)
        with ap.use_mem_pool(lend):
            lend.free(ap.malloc(40 * MiB))
        free0 = ap.mem_get_info(0)[0] + lend.total_bytes()
        c = ap.malloc(30 * MiB)
        assert lend.block_info(c) is not None
        with caplog.at_level("WARNING", logger="ascend_pool"):
            lend.close()
        assert lend.closed and not [r for r in caplog.records if "closed with" in r.getMessage()]
        with pytest.raises(ap.PoolError):
            lend.malloc(MiB)
        sim.launch_fill(0, c, 30 * MiB, 7)
        ap.synchronize()
        assert sim.read(c + 30 * MiB - 4, 4) == b"\x07" * 4  # still device memory of the process
        ap.free(c)
        ap.empty_cache()
        assert ap.mem_get_info(0)[0] == free0  # the closed lender's segment went back once freed
        with pytest.raises(ap.InvalidPointerError):
            ap.free(c)
    finally:
        lend.close()


def test_a_lenders_close_gives_back_its_own_blocks_and_keeps_the_lent_ones(limited, caplog):
    # What the lender's own user left allocated goes back at close, as any close's (warned, those
    # blocks only); the lent block is freed afterwards by the C ABI
    import ctypes

    lib = ctypes.CDLL(ap.library_path())
    lib.ascend_pool_malloc.restype = ctypes.c_void_p
    lib.ascend_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ascend_pool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lend = ap.Pool(0, use_on_oom=True)
    try:
        limited(64 * MiB)  # the lender's 20 MiB segment of its 2 MiB block, and its 42 MiB one
        with ap.use_mem_pool(lend):
            own = lend.malloc(2 * MiB)
            lend.free(ap.malloc(40 * MiB))
        c = lib.ascend_pool_malloc(30 * MiB, 0, None)
        assert c and lend.block_info(c) is not None
        own_size, c_size, held = lend.block_info(own)[1], lend.block_info(c)[1], lend.total_bytes()
        with caplog.at_level("WARNING", logger="ascend_pool"):
            lend.close()
        said = [r.getMessage() for r in caplog.records if "closed with" in r.getMessage()]
        assert len(said) == 1 and f"closed with 1 block(s) still allocated ({own_size} bytes)" in said[0], said
        orphan = [p for p in ap.registry.live_pools() if p.pool_id == lend.pool_id]
        assert len(orphan) == 1 and orphan[0].block_info(own) is None  # its own block given back
        assert orphan[0].memory_stats()["allocated_bytes.all.current"] == c_size
        assert orphan[0].total_bytes() == held - 20 * MiB  # the own block's segment went back
        lib.ascend_pool_free(c, 30 * MiB, 0, None)
        ap.empty_cache()
        assert not [p for p in ap.registry.live_pools() if p.pool_id == lend.pool_id]
    finally:
        lend.close()


def test_threads_free_lent_blocks_while_the_lender_closes(limited):
    # Eight blocks lent to the default pool's requests, freed by eight threads (ap.free, the
    # default pool's free, the C ABI's) while two others close the lender: every free finds its
    # block, and once all are freed the lender's memory is back on the device
    import ctypes

    lib = ctypes.CDLL(ap.library_path())
    lib.ascend_pool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    default = limited(42 * MiB)
    for round_ in range(20):
        lend = ap.Pool(0, use_on_oom=True)
        try:
            with ap.use_mem_pool(lend):
                lend.free(ap.malloc(40 * MiB))
            free0 = ap.mem_get_info(0)[0] + lend.total_bytes()
            blocks = [ap.malloc(4 * MiB) for _ in range(8)]
            assert all(lend.block_info(b) is not None for b in blocks)
            start, errors = threading.Barrier(10), []

            def free(i, b):
                start.wait()
                try:
                    if i % 3 == 0:
                        ap.free(b)
                    elif i % 3 == 1:
                        default.free(b)
                    else:
                        lib.ascend_pool_free(b, 4 * MiB, 0, None)
                except Exception as e:
                    errors.append(repr(e))

            def close():  # a second close() at the same time: harmless
                start.wait()
                lend.close()

            threads = [threading.Thread(target=free, args=(i, b)) for i, b in enumerate(blocks)]
            threads.append(threading.Thread(target=close))
            for t in threads:
                t.start()
            start.wait()
            lend.close()
            for t in threads:
                t.join(30)
            assert not errors, (round_, errors)
            assert not any(p.block_info(b) for p in ap.registry.live_pools() for b in blocks), round_
            ap.empty_cache()
            assert ap.mem_get_info(0)[0] == free0, round_
            assert not [p for p in ap.registry.live_pools() if p.pool_id == lend.pool_id], round_
        finally:
            lend.close()


def test_a_lenders_close_waits_for_its_calls_in_flight_before_handing_its_pool_over(limited):
    # close() of a use_on_oom pool with a block still lent hands its C pool to an orphan object,
    # which the registry closes once the lent block is freed. A call in flight on the lender
    # (counted on the lender, not the orphan) went on after close() returned: the orphan's reap
    # then destroyed the pool under it (ASan: heap-use-after-free in ap_pool_stop_lending).
    # close() now returns only once such calls are done.
    default = limited(42 * MiB)
    for round_ in range(4):
        lend = ap.Pool(0, use_on_oom=True)
        try:
            with ap.use_mem_pool(lend):
                lend.free(ap.malloc(40 * MiB))
            lent = ap.malloc(4 * MiB)
            assert lend.block_info(lent) is not None
            order = []
            holder = threading.Thread(target=lend._hold_lock_for_test, args=(0.6,))
            reader = threading.Thread(target=lambda: (lend.memory_stats(), order.append("in-flight call done")))
            holder.start()
            time.sleep(0.1)
            reader.start()    # waits for the pool's mutex, counted as a call in flight on lend
            time.sleep(0.15)
            lend.close()
            order.append("close returned")
            holder.join(10)
            reader.join(10)
            assert order == ["in-flight call done", "close returned"], (round_, order)
            default.free(lent)
            assert not [p for p in ap.registry.live_pools() if p.pool_id == lend.pool_id], round_
        finally:
            lend.close()


# -- torch_npu test/npu/test_mempool.py TestMemPool (its regressions of torch's diversion rules) --

def test_mempool_release_cached_blocks_during_diversion(limited):
    # 60 MiB cached in the default pool under an 80 MiB fraction: a 60 MiB request inside
    # use_mem_pool gives that cache back and is served (torch_npu's gate skipped the release
    # while any MemPool diverted allocations)
    limited(80 * MiB)
    ap.free(ap.malloc(60 * MiB))
    pool = ap.Pool(0)
    with ap.use_mem_pool(pool):
        b = ap.malloc(60 * MiB)
    assert pool.block_info(b) is not None
    pool.free(b)
    pool.close()


@pytest.mark.parametrize("diverted", [False, True], ids=["default_pool", "user_mempool"])
def test_mempool_oom_recovery_releases_cached_blocks(diverted):
    # half the device's free memory cached by the default pool, then 7/8 of it asked for (in a
    # MemPool, or not): the cache goes back and the request is served, no out of memory
    ap.empty_cache()
    free_before = ap.mem_get_info(0)[0]
    ap.free(ap.malloc((free_before // 2) & ~(2 * MiB - 1)))
    pool = ap.Pool(0) if diverted else None
    try:
        with ap.use_mem_pool(pool) if diverted else _nothing():
            ap.free(ap.malloc((free_before - free_before // 8) & ~(2 * MiB - 1)))
    finally:
        if pool is not None:
            pool.close()
        ap.empty_cache()


def _nothing():
    import contextlib
    return contextlib.nullcontext()


@pytest.mark.parametrize("diverted", [False, True], ids=["default_pool", "user_mempool"])
def test_mempool_block_free_not_deferred(diverted, block_freed_behind_a_stream):
    # a block marked with another stream, whose work is then waited for, is reused by the next
    # request of its size: its free is not deferred as under graph capture (torch_npu's
    # synchronize() is the device's: tests/test_device_synchronize.py; here the stream's own)
    a, b, _ = block_freed_behind_a_stream(diverted, ap.synchronize)
    assert b == a

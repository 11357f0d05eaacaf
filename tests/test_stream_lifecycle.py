"""Streams that die (issue 15, point 2): destroy_stream retires the slot, frees made later go to
the "any stream" state, and a stream the runtime no longer knows (destroyed behind the pool's
back, or a garbage handle) degrades safely: typed errors, nothing pinned, empty_cache never
wedged. The simulator refuses such handles with ACL_ERROR_RT_PARAM_INVALID (107000), as CANN's
rt_error_codes.h names a handle the runtime does not know ("param invalid")."""
import ctypes
import os
import sys
import threading

import numpy as np
import pytest

import ascend_pool as ap
from ascend_pool import sim

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401  (pytest fixture)

MiB = 1 << 20
INVALID_STREAM = 5  # the C ABI's code (ascend_pool_last_error_code)


@pytest.fixture(params=[False, True], ids=["classic", "expandable"])
def pool(request):
    """A fresh pool on simulated device 0, classic or expandable segments (streams die the same
    way in both: the retire path is the pool's, the memory underneath differs)."""
    p = ap.Pool(0, backend="sim", expandable_segments=request.param)
    yield p
    p.close()


def test_blocks_freed_after_destroy_stream_go_back_to_the_device(pool):
    s = pool.create_stream()
    ptrs = [pool.malloc(10 * MiB, stream=s) for _ in range(4)]
    pool.destroy_stream(s)
    for p in ptrs:
        pool.free(p)                  # on the stream they were allocated on: destroyed
    pool.empty_cache()
    st = pool.memory_stats()
    assert st["reserved_bytes.all.current"] == 0, "blocks of a destroyed stream stayed pinned"


def test_destroy_stream_settles_what_is_pending_on_it(pool):
    s = pool.create_stream()
    y = pool.malloc(2 * MiB)
    sim.launch_fill(s, y, 2 * MiB, 0x5A, delay_s=0.2)
    pool.record_stream(y, s)
    pool.free(y)                      # pending on an event of s
    assert pool.memory_stats()["pending_free_bytes"] > 0
    pool.destroy_stream(s)
    st = pool.memory_stats()
    assert st["pending_free_bytes"] == 0 and st["pending_free_blocks"] == 0
    pool.empty_cache()
    assert pool.memory_stats()["reserved_bytes.all.current"] == 0


def test_a_stream_destroyed_behind_the_pools_back_never_wedges_empty_cache(pool):
    s = pool.create_stream()
    ptrs = [pool.malloc(10 * MiB, stream=s) for _ in range(4)]
    for p in ptrs:
        pool.free(p, stream=s)        # free blocks tagged with s
    pool.backend.stream_destroy(s)    # the framework destroys it; the pool is not told
    try:
        pool.empty_cache()            # finds out: may say so once ...
    except ap.InvalidStreamError:
        pass
    assert pool.memory_stats()["reserved_bytes.all.current"] == 0, "memory pinned by a dead stream"
    pool.empty_cache()                # ... and later calls work
    pool.free(pool.malloc(MiB))


@pytest.mark.parametrize("expandable", [False, True], ids=["classic", "expandable"])
def test_a_stream_retired_while_its_allocation_waits_for_memory_is_an_invalid_stream_error(expandable):
    """An allocation that finds no memory waits (the pool lock dropped) for pending frees; the
    framework destroys the allocation's stream meanwhile and another call of the pool finds out
    (the slot is retired). The call must name the stream, not build an out-of-memory message from
    the stream table with a negative slot (a read before the table: garbage in the message, a
    heap-buffer-overflow under ASan)."""
    import threading
    import time

    pool = ap.Pool(0, backend="sim", expandable_segments=expandable, sync_timeout_ms=20_000)
    s, hung = pool.create_stream(), pool.create_stream()
    x = pool.malloc(8 * MiB)
    pool.record_stream(x, hung)
    sim.hang_stream(hung)
    pool.free(x)                          # pending on hung's event
    reserved = pool.memory_stats()["reserved_bytes.all.current"]
    pool.set_limit(reserved)              # nothing more can be had
    whole = reserved - 4096               # fits only once x's block is back
    seen = []

    def framework():
        try:
            time.sleep(0.3)               # the malloc below is waiting by now
            pool.backend.stream_destroy(s)
            try:
                pool.synchronize(s)       # finds out: the pool retires the stream
            except ap.InvalidStreamError as e:
                seen.append(e)
        finally:
            sim.release_stream(hung)

    t = threading.Thread(target=framework)
    t.start()
    try:
        with pytest.raises(ap.InvalidStreamError, match="not a stream the runtime knows"):
            pool.malloc(whole, stream=s)
        assert seen, "the other thread's synchronize retired the stream first"
    finally:
        t.join(30)
        pool.set_limit(None)
        pool._check_invariants()
        pool.free(pool.malloc(whole))     # and the pool keeps serving
        pool.close()


def test_destroy_stream_of_a_busy_stream_never_used_with_the_pool_is_bounded_by_sync_timeout():
    """destroy_stream waits for the stream within sync_timeout_ms; for a stream the pool had never
    ordered anything on it waited for nothing, and the runtime's destroy then waited for the
    stream's work without limit (a hung stream: forever). Found by fuzzing."""
    import time

    pool = ap.Pool(0, backend="sim", sync_timeout_ms=200)
    try:
        fresh = pool.create_stream()
        sim.hang_stream(fresh)
        t0 = time.monotonic()
        try:
            with pytest.raises(ap.DeviceTimeoutError):
                pool.destroy_stream(fresh)
            assert time.monotonic() - t0 < 10
        finally:
            sim.release_stream(fresh)    # the stream is still there: nothing was destroyed
        pool.destroy_stream(fresh)       # once idle, it goes
        with pytest.raises(ap.InvalidStreamError):
            pool.malloc(512, stream=fresh)
        pool.free(pool.malloc(512))
    finally:
        pool.close()


def test_synchronize_on_a_stream_destroyed_elsewhere_is_an_invalid_stream_error(pool):
    s = pool.create_stream()
    p = pool.malloc(MiB, stream=s)
    pool.free(p, stream=s)
    pool.backend.stream_destroy(s)
    with pytest.raises(ap.InvalidStreamError):
        pool.synchronize(s)
    pool.empty_cache()
    assert pool.memory_stats()["reserved_bytes.all.current"] == 0


def test_c_abi_free_with_a_garbage_stream_sets_the_error_and_still_frees():
    lib = ctypes.CDLL(ap.library_path())
    lib.ascend_pool_malloc.restype = ctypes.c_void_p
    lib.ascend_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ascend_pool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ascend_pool_last_error.restype = ctypes.c_char_p
    pool = ap.default_pool(0)
    before = pool.memory_stats()["allocation.all.current"]
    lib.ascend_pool_clear_last_error()
    p = lib.ascend_pool_malloc(3 * MiB, 0, None)
    assert p
    lib.ascend_pool_free(p, 3 * MiB, 0, 0xDEAD0000)   # not a stream
    assert lib.ascend_pool_last_error_code() == INVALID_STREAM, lib.ascend_pool_last_error()
    assert b"0xdead0000" in lib.ascend_pool_last_error()
    assert pool.memory_stats()["allocation.all.current"] == before, "the block was not freed"
    lib.ascend_pool_clear_last_error()
    pool.empty_cache()
    q = lib.ascend_pool_malloc(3 * MiB, 0, None)
    assert q
    lib.ascend_pool_free(q, 3 * MiB, 0, None)
    assert lib.ascend_pool_last_error_code() == 0


def test_free_on_a_destroyed_stream_through_python_raises_and_frees_nothing(pool):
    # An error means nothing happened: had the block been freed, a caller that retries would free
    # whatever was allocated at that address meanwhile (another thread's block).
    s = pool.create_stream()
    t = pool.create_stream()
    p = pool.malloc(MiB, stream=t)
    pool.backend.stream_destroy(s)     # destroyed before the pool ever saw it
    with pytest.raises(ap.InvalidStreamError, match="stays allocated"):
        pool.free(p, stream=s)
    assert pool.memory_stats()["allocation.all.current"] == 1
    assert pool.block_info(p) is not None
    pool._check_invariants()
    other = pool.malloc(MiB, stream=t)
    assert other != p                  # the address is still p's
    pool.free(p)                       # the retry on its allocation stream frees p, not `other`
    assert pool.block_info(other) is not None and pool.block_info(p) is None
    pool.free(other)
    assert pool.memory_stats()["allocation.all.current"] == 0
    pool.destroy_stream(t)
    pool.empty_cache()
    assert pool.memory_stats()["reserved_bytes.all.current"] == 0


def test_empty_cache_after_a_stream_died_behind_the_pool_succeeds_and_empties(pool):
    s = pool.create_stream()
    pool.free(pool.malloc(3 * MiB, stream=s), stream=s)  # cached, tied to s
    pool.backend.stream_destroy(s)                       # the framework destroys it, not the pool
    pool.empty_cache()                                   # nothing failed: no error
    assert pool.memory_stats()["reserved_bytes.all.current"] == 0
    pool._check_invariants()


def test_empty_cache_returns_a_block_freed_after_all_its_streams_died_behind_the_pool(pool):
    # Allocated on a, used by b (record_stream), both destroyed by the framework, then freed: no
    # event can be recorded on either, so the free owes them a wait. empty_cache found no event to
    # wait for and returned before asking about them: the block stayed pending, its segment
    # reserved, until the next malloc that missed the cache.
    a, b = pool.create_stream(), pool.create_stream()
    x = pool.malloc(24 * MiB, stream=a)
    pool.record_stream(x, b)
    pool.backend.stream_destroy(a)
    pool.backend.stream_destroy(b)
    pool.free(x)
    pool.empty_cache()
    st = pool.memory_stats()
    assert st["reserved_bytes.all.current"] == 0, [[bl["state"] for bl in s["blocks"]] for s in pool.snapshot()["segments"]]
    assert st["requested_bytes.all.current"] == 0
    pool._check_invariants()


def test_destroy_stream_of_a_stream_already_destroyed_is_an_invalid_stream_error_twice(pool):
    s = pool.create_stream()
    pool.free(pool.malloc(4096, stream=s), stream=s)
    pool.backend.stream_destroy(s)
    with pytest.raises(ap.InvalidStreamError, match="not usable"):
        pool.destroy_stream(s)
    with pytest.raises(ap.InvalidStreamError, match="not a live stream of this pool"):
        pool.destroy_stream(s)  # forgotten by the first call (was: DeviceError from the runtime)
    pool.empty_cache()
    assert pool.memory_stats()["reserved_bytes.all.current"] == 0


def test_the_default_stream_cannot_be_destroyed_and_a_bad_stream_is_named(pool):
    """destroy_stream(None) is refused before the runtime is asked (it used to reach
    aclrtDestroyStream and come back as a DeviceError 100000); free_all_blocks takes cupy's stream
    argument and refuses one that is not a stream of the pool instead of ignoring it."""
    ptr = pool.malloc(MiB)
    events = pool.memory_stats()["events_created"]
    for default in (None, 0, np.uint64(0)):  # 0 too: the null handle, as every other call reads it
        with pytest.raises(ap.InvalidStreamError, match="default stream"):
            pool.destroy_stream(default)
    assert pool.memory_stats()["events_created"] == events, "refused before anything is done on the stream"
    for wrong in ("not a stream", [0], {}, np.array([1, 2]), 1.5, True):  # a bare TypeError named nothing
        with pytest.raises(ap.StreamTypeError, match="stream must be None, 0 .* or an int stream handle"):
            pool.free_all_blocks(wrong)
        with pytest.raises(ap.StreamTypeError, match="stream must be"):
            pool.malloc(64, stream=wrong)
    with pytest.raises(ap.InvalidStreamError, match="not a live stream"):
        pool.free_all_blocks(12345)
    s = pool.create_stream()
    pool.free(ptr)
    pool.free_all_blocks(s)  # cupy's: only what s's allocations created (nothing here)
    assert pool.memory_stats()["reserved_bytes.all.current"] > 0
    pool.free_all_blocks(0)
    assert pool.memory_stats()["reserved_bytes.all.current"] == 0
    for handle in (np.uint64(s), np.int64(s)):  # a handle kept in a numpy array, as pointers may be
        pool.register_stream(handle)
        pool.free(pool.malloc(64, stream=handle), stream=handle)
        pool.synchronize(handle)
    pool.destroy_stream(np.uint64(s))
    pool.malloc(MiB)  # still serving


def test_close_destroys_the_idle_streams_it_created_and_leaves_a_busy_one():
    # a framework that opens and closes pools in a loop leaked a runtime stream per
    # create_stream: streams are a limited device resource
    from ascend_pool import sim
    from ascend_pool.backend import open_backend

    open_backend("sim")  # the simulator's counters need its runtime started (an earlier test may not have)
    before = sim.stats(0)["live_streams"]
    for _ in range(5):
        pool = ap.Pool(0, backend="sim")
        s = pool.create_stream()
        pool.free(pool.malloc(1 << 20, stream=s), stream=s)
        pool.close()
    assert sim.stats(0)["live_streams"] == before
    pool = ap.Pool(0, backend="sim", sync_timeout_ms=200)
    busy, registered = pool.create_stream(), ap.default_pool(0).create_stream()
    pool.register_stream(registered)
    sim.hang_stream(busy)
    try:
        pool.close()  # returns: a busy stream is not waited for, and is left to the runtime
    finally:
        sim.release_stream(busy)
    assert sim.stats(0)["live_streams"] == before + 2, "a busy created stream and a registered one are not destroyed"
    ap.default_pool(0).backend.stream_destroy(busy)
    ap.default_pool(0).destroy_stream(registered)
    assert sim.stats(0)["live_streams"] == before


def test_a_stream_of_another_pool_of_the_device_serves_its_contexts_and_the_default_pool(pool):
    # Streams belong to the device, not to a pool (the C ABI takes any): a tenant context, or the
    # device's default pool, takes a stream its parent pool created without register_stream, as
    # it takes one registered there. A stream no open pool knows is still refused by name.
    import ascend_pool as ap
    s = pool.create_stream()
    ctx = pool.context("stream-sharer")
    try:
        p = ctx.malloc(4096, stream=s)
        ctx.free(p, stream=s)
        with ctx:
            ap.free(ap.malloc(4096, stream=s), stream=s)
        ap.free(ap.malloc(4096, stream=s), stream=s)  # the default pool of device 0
        with pytest.raises(ap.InvalidStreamError, match="not a live stream of this pool"):
            ctx.malloc(4096, stream=s + 0x1000)
    finally:
        ctx.close()
        pool.destroy_stream(s)


def _framework_stream(pool):
    """A stream the framework creates itself and names to the pool (register_stream), as
    torch_npu's side streams are: the pool is never told when it is destroyed."""
    s = pool.backend.stream_create(pool.device)
    pool.register_stream(s)
    return s


def test_streams_destroyed_behind_the_pools_back_never_fill_its_stream_table(pool):
    # A framework process creates and destroys streams for its whole life. Blocks used on each
    # (record_stream) stay allocated; the streams are gone. The table holds 1,023 streams: the
    # pool must find the dead ones when it is full (before: "too many streams (limit 1023)" at
    # the 1,024th stream, with one stream alive).
    held = []
    for _ in range(1100):
        s = _framework_stream(pool)
        x = pool.malloc(4096)
        pool.record_stream(x, s)
        held.append(x)
        pool.backend.stream_destroy(s)
    for x in held:
        pool.free(x)
    assert pool.memory_stats()["allocated_bytes.all.current"] == 0
    pool.empty_cache()
    assert pool.memory_stats()["reserved_bytes.all.current"] == 0


def test_blocks_freed_on_a_destroyed_framework_stream_serve_the_next_stream(pool):
    # Each request of a server runs on a stream of its own, destroyed when the request is done.
    # The blocks freed on it belong to no stream once it is gone: the next stream must reuse
    # them rather than grow the pool (before: the dead stream kept them, and a pool serving one
    # 1 MiB request at a time grew a segment every few requests).
    sizes = [MiB, 3 * MiB, 12 * MiB]
    for i in range(120):
        s = _framework_stream(pool)
        ptrs = [pool.malloc(n, stream=s) for n in sizes]
        for p in ptrs:
            pool.free(p, stream=s)
        pool.backend.stream_destroy(s)
        if i == 0:
            first = pool.memory_stats()
    st = pool.memory_stats()
    assert st["num_device_alloc"] == first["num_device_alloc"], (
        f"{st['num_device_alloc'] - first['num_device_alloc']} device allocations after the first request")
    assert st["reserved_bytes.all.peak"] == first["reserved_bytes.all.peak"]


@pytest.mark.parametrize("expandable", [False, True], ids=["classic", "expandable"])
@pytest.mark.parametrize("owner", ["pool", "context"])
def test_close_returns_memory_only_after_the_work_queued_on_its_freed_blocks(expandable, owner):
    # A block freed stream-ordered while a kernel on that stream still writes it, then the pool
    # (or a tenant context, a request ending) closes. Its memory must reach the device, and the
    # next owner, only after that kernel (before: close freed it at once; the next pool's blocks
    # were overwritten, or the kernel ran on freed memory).
    import time

    base = ap.Pool(0, backend="sim", expandable_segments=expandable)
    try:
        s = base.create_stream()
        pool = base.context("closing-request") if owner == "context" else base
        n = 8 * MiB
        x = pool.malloc(n, stream=s)
        dropped = sim.stats(0)["dropped_fills"]
        sim.launch_fill(s, x, n, 0xAA, delay_s=0.3)
        pool.free(x, stream=s)
        pool.close()                                   # the stream is busy: close leaves it alive
        other = ap.Pool(0, backend="sim", expandable_segments=expandable)
        try:
            ys = [other.malloc(n) for _ in range(3)]
            for y in ys:
                sim.launch_fill(None, y, n, 0x33)
            other.synchronize()
            time.sleep(0.4)
            assert all(sim.read(y, n) == b"\x33" * n for y in ys), "the old kernel wrote the next owner's memory"
            assert sim.stats(0)["dropped_fills"] == dropped, "the old kernel ran on freed memory"
        finally:
            other.close()
    finally:
        base.close()


def test_a_wait_begun_on_a_destroyed_stream_is_not_taken_for_its_handles_next_stream(sim_node):
    # empty_cache waits (the lock dropped) for the streams whose free blocks it would release,
    # and then releases only blocks no stream tagged since (the slot's epoch). Meanwhile the
    # framework destroys one of those streams and the runtime gives its handle to a new stream
    # (CANN's handles are heap pointers), whose blocks land in the old stream's slot. Before, the
    # slot's epoch restarted at 0 and, after as many frees, matched again: the wait on the old
    # stream was taken for the new stream's later work, and a block that a kernel still had to
    # write went back to the device.
    out = sim_node.run_json("""
        import ascend_pool as ap
        from ascend_pool import sim
        MiB = 1 << 20
        p = ap.Pool(0, backend="sim")
        n = 4 * MiB
        sa = p.create_stream()
        xa = p.malloc(n, stream=sa)
        s1 = p.backend.stream_create(0)
        p.register_stream(s1)
        for b in [p.malloc(n, stream=s1) for _ in range(3)]:
            p.free(b, stream=s1)                       # s1's slot: 3 free blocks
        sim.launch_fill(sa, xa, n, 0x01, delay_s=0.5)
        p.free(xa, stream=sa)                          # sa busy for 0.5 s: empty_cache waits
        log = {}
        def framework():
            time.sleep(0.15)                           # empty_cache is waiting for sa by now
            p.backend.stream_destroy(s1)
            try:
                p.synchronize(s1)                      # the pool finds out: s1's slot retired
            except ap.InvalidStreamError:
                pass
            s2 = p.backend.stream_create(0)
            log["reused"] = s2 == s1
            p.register_stream(s2)
            b2 = p.malloc(n, stream=s2)
            sim.launch_fill(s2, b2, n, 0xBB, delay_s=0.6)
            time.sleep(0.5)
            sim.launch_fill(s2, b2, n, 0xCC, delay_s=0.6)   # queued after the wait began
            p.free(b2, stream=s2)
        t = threading.Thread(target=framework)
        t.start()
        p.empty_cache()
        t.join()
        q = ap.Pool(0, backend="sim")
        ys = [q.malloc(n) for _ in range(4)]
        for y in ys:
            sim.launch_fill(None, y, n, 0x33)
        q.synchronize()
        time.sleep(1.5)                                # the last kernel has run by now
        print(json.dumps({"reused": log["reused"], "dropped": sim.stats(0)["dropped_fills"],
                          "overwritten": sum(sim.read(y, n) != bytes([0x33]) * n for y in ys)}))
    """, ASCEND_SIM_REUSE_STREAM_HANDLES="1", ASCEND_SIM_HBM="4GiB")
    assert out == {"reused": True, "dropped": 0, "overwritten": 0}


# A child's start: device 0's pool p0 made stream s1 and used it; the framework destroyed s1 with
# the runtime, behind the pool's back (the runtime may give its handle to the next stream made).
POOL_STREAM_DESTROYED_BEHIND_ITS_BACK = """
        import ascend_pool as ap
        MiB = 1 << 20
        p0 = ap.Pool(0, backend="sim")
        s1 = p0.create_stream()
        p0.free(p0.malloc(MiB, stream=s1), stream=s1)
        p0.synchronize(s1)
        ok("aclrtSetDevice", 0)
        ok("aclrtDestroyStream", C.c_void_p(s1))
"""


def test_a_handle_the_runtime_gave_to_another_devices_stream_serves_that_devices_pool(sim_node):
    # pool.create_stream() makes s1 on device 0 (the backend notes its device); the framework
    # destroys it with the runtime and the runtime gives its handle to a new stream on device 1.
    # The note must not make device 1's pool refuse that stream as device 0's (it did).
    out = sim_node.run_json(POOL_STREAM_DESTROYED_BEHIND_ITS_BACK + """
        ok("aclrtSetDevice", 1)
        s2 = stream()
        p1 = ap.Pool(1, backend="sim")
        try:
            p1.register_stream(s2)
            p1.free(p1.malloc(MiB, stream=s2), stream=s2)
            served = True
        except ap.InvalidStreamError as e:
            served = str(e)
        print(json.dumps({"reused": s2 == s1, "served": served}))
    """, ASCEND_SIM_REUSE_STREAM_HANDLES="1")
    assert out == {"reused": True, "served": True}


def test_a_pool_whose_stream_handle_another_pool_got_anew_no_longer_destroys_it_at_close(sim_node):
    # Pool A made s; the framework destroyed it behind A's back and the runtime gave the handle
    # to pool B's new stream. A.close() destroyed "its" idle stream, which was B's (bad11 3).
    out = sim_node.run_json(POOL_STREAM_DESTROYED_BEHIND_ITS_BACK + """
        b = ap.Pool(0, backend="sim")
        t = b.create_stream()
        x = b.malloc(3 * MiB, stream=t)
        p0.close()
        try:
            b.free(x, stream=t)
            b.free(b.malloc(5 * MiB, stream=t), stream=t)
            b.synchronize(t)
            survived = True
        except ap.PoolError as e:
            survived = str(e)
        b.destroy_stream(t)
        b.close()
        print(json.dumps({"reused": t == s1, "survived": survived}))
    """, ASCEND_SIM_REUSE_STREAM_HANDLES="1")
    assert out == {"reused": True, "survived": True}


@pytest.mark.parametrize("use", ["register_stream", "c_abi"])
def test_a_pool_leaves_at_close_a_reused_handle_another_pool_orders_on(sim_node, use):
    # The framework destroyed p0's stream behind its back and made one of its own, which the
    # runtime gave the same handle; another pool orders work on it (registered, or through the
    # C ABI as torch does). p0.close() destroyed it as its own idle stream (frame11 3).
    out = sim_node.run_json(POOL_STREAM_DESTROYED_BEHIND_ITS_BACK + f"""
        from ascend_pool import _core
        t = stream()
        other = ap.Pool(0, backend="sim")
        if "{use}" == "register_stream":
            other.register_stream(t)
            other.free(other.malloc(MiB, stream=t), stream=t)
        else:
            _core.capi_free(_core.capi_malloc(MiB, 0, t), 0, 0, t)
        p0.close()
        print(json.dumps({{"reused": t == s1, "alive": code("aclrtSynchronizeStream", C.c_void_p(t)) == 0}}))
    """, ASCEND_SIM_REUSE_STREAM_HANDLES="1")
    assert out == {"reused": True, "alive": True}


# A child's start: device 0's pool with a framework stream s1 (registered) holding one cached
# block, the child's thread on device 0 (sim_child helpers).
FRAMEWORK_STREAM_CACHED_ON_DEVICE_0 = """
        import ascend_pool as ap
        MiB = 1 << 20
        p0 = ap.Pool(0, backend="sim")
        ok("aclrtSetDevice", 0)
        s1 = stream()
        p0.register_stream(s1)
        p0.free(p0.malloc(MiB, stream=s1), stream=s1)
"""


def test_a_pool_told_its_streams_handle_is_another_devices_now_forgets_it(sim_node):
    # A framework stream registered with device 0's pool is destroyed behind its back and the
    # runtime gives its handle to a stream on device 1. register_stream refuses it as device 1's
    # (right); from then on the pool must not serve it either (it did: device 0's memory ordered
    # on device 1's queue, through the stale record), and the blocks cached on the old stream
    # serve device 0's other streams without a new device allocation.
    out = sim_node.run_json(FRAMEWORK_STREAM_CACHED_ON_DEVICE_0 + """
        allocs = p0.memory_stats()["num_device_alloc"]
        ok("aclrtDestroyStream", C.c_void_p(s1))       # behind the pool's back
        ok("aclrtSetDevice", 1)
        s2 = stream()
        out = {"reused": s2 == s1}
        for what, call in (("register", lambda: p0.register_stream(s2)), ("malloc", lambda: p0.malloc(MiB, stream=s2))):
            try:
                call()
                out[what] = "served"
            except ap.InvalidStreamError:
                out[what] = "refused"
        p0.free(p0.malloc(MiB))
        out["new_device_allocs"] = p0.memory_stats()["num_device_alloc"] - allocs
        print(json.dumps(out))
    """, ASCEND_SIM_REUSE_STREAM_HANDLES="1")
    assert out == {"reused": True, "register": "refused", "malloc": "refused", "new_device_allocs": 0}


def test_a_miss_on_a_handle_the_runtime_gave_to_another_devices_stream_is_refused(sim_node):
    # Without register_stream (the C ABI's path), device 0's pool still has a live record for
    # the handle: its cached blocks are served unasked (the hot path), but a request that would
    # grow asks the stream first, and a device-1 stream gets no device-0 segment (it did).
    out = sim_node.run_json(FRAMEWORK_STREAM_CACHED_ON_DEVICE_0 + """
        ok("aclrtDestroyStream", C.c_void_p(s1))       # behind the pool's back
        ok("aclrtSetDevice", 1)
        s2 = stream()
        reserved = p0.memory_stats()["reserved_bytes.all.current"]
        try:
            p0.malloc(64 * MiB, stream=s2)
            miss = "served"
        except ap.InvalidStreamError as e:
            miss = str(e)
        grew = p0.memory_stats()["reserved_bytes.all.current"] - reserved
        print(json.dumps({"reused": s2 == s1, "miss": miss, "grew": grew}))
    """, ASCEND_SIM_REUSE_STREAM_HANDLES="1")
    assert out["reused"] and "another device" in out["miss"] and out["grew"] == 0, out


def test_a_pool_forgets_the_handles_of_streams_destroyed_behind_its_back(pool):
    # A server registers a stream per request and the framework destroys it: the pool kept every
    # handle for the process's life (memory without bound). It asks its streams when its set
    # has doubled and forgets those the runtime no longer knows; live ones stay.
    live = _framework_stream(pool)
    dead = []
    for _ in range(600):
        s = _framework_stream(pool)
        pool.free(pool.malloc(4096, stream=s), stream=s)
        pool.backend.stream_destroy(s)
        dead.append(s)
    assert pool._knows_stream(live)
    remembered = sum(pool._knows_stream(h) for h in dead)
    assert remembered < 64, f"{remembered} of 600 destroyed streams still known"
    pool.free(pool.malloc(4096, stream=live), stream=live)
    pool.backend.stream_destroy(live)


def test_a_stream_made_while_the_pool_forgets_destroyed_handles_is_kept(sim_node):
    # The forgetting asks each handle with the GIL released and then dropped it: a stream another
    # thread made meanwhile, which the runtime gave a destroyed stream's handle, was dropped with
    # it (the pool then refused its own new stream, and close() would not destroy it) (frame17 3).
    out = sim_node.run_json("""
        import ascend_pool as ap
        pool = ap.Pool(0, backend="sim")
        ok("aclrtSetDevice", 0)
        lost, rounds, reused = 0, 0, 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < 8 and rounds < 1000 and not lost:
            rounds += 1
            dead = [stream() for _ in range(60)]
            for h in dead:
                pool.register_stream(h)
            for h in dead:
                ok("aclrtDestroyStream", C.c_void_p(h))   # behind the pool's back: handles recycled
            new = []
            go = threading.Event()
            def creator():
                go.wait()
                for _ in range(60):
                    new.append(pool.create_stream())
            t = threading.Thread(target=creator)
            t.start()
            go.set()
            pool._forget_destroyed_streams()
            t.join()
            reused += len(set(new) & set(dead))
            lost += sum(not pool._knows_stream(s) for s in new)
            for s in new:
                pool.destroy_stream(s)
        pool.close()
        print(json.dumps({"lost": lost, "reused": reused > 0}))
    """, ASCEND_SIM_REUSE_STREAM_HANDLES="1", timeout=60)
    assert out == {"lost": 0, "reused": True}, out


def test_a_stream_made_while_the_pool_closes_is_destroyed_not_leaked():
    # create_stream makes its stream with the GIL released, then adds it to the pool: a close()
    # on another thread that had listed the streams to destroy meanwhile closed the pool without
    # it, and the stream outlived the pool with its device reference. Driven step by step: the
    # creation finishes while close() is in its loop.
    in_create, in_close, created = threading.Event(), threading.Event(), threading.Event()

    class SlowBackend(ap._core.Backend):
        armed, made = False, None

        def stream_create(self, device):
            h = super().stream_create(device)
            if self.armed:
                self.armed, self.made = False, h
                in_create.set()
                assert in_close.wait(10)  # made, not yet added: close() runs now
            return h

    class ClosingPool(ap.Pool):
        def _stream_used_elsewhere(self, handle):  # close() is in its loop, its list made
            in_close.set()
            assert created.wait(10)
            return False

    be = SlowBackend("sim")
    pool = ClosingPool(0, backend=be)
    pool.create_stream()  # close() has a stream to ask about
    out = {}

    def creator():
        try:
            out["stream"] = pool.create_stream()
        except ap.PoolError as e:
            out["error"] = str(e)
        created.set()

    be.armed = True
    t = threading.Thread(target=creator)
    t.start()
    assert in_create.wait(10)
    pool.close()
    t.join()
    assert out == {"error": "this pool is closed"}
    with pytest.raises(ap.DeviceError):  # destroyed already, by create_stream
        be.stream_destroy(be.made)


def test_close_does_not_destroy_a_stream_registered_with_the_handle_of_one_it_made(sim_node):
    # close() asked each stream it made whether it was idle with the GIL released, then destroyed
    # it: when another thread destroyed that stream through the pool meanwhile and the runtime gave
    # its handle to a framework stream registered since, close destroyed the framework's stream.
    # Driven step by step: the other thread's steps run in the hook close() calls after asking.
    out = sim_node.run_json("""
        import ascend_pool as ap
        from ascend_pool._core import Backend
        be = Backend("sim")
        fw = []

        class P(ap.Pool):
            def _stream_used_elsewhere(self, handle):
                if not fw:
                    self.destroy_stream(handle)
                    fw.append(be.stream_create(0))  # the framework's stream: the handle anew
                    self.register_stream(fw[0])
                return super()._stream_used_elsewhere(handle)

        pool = P(0, backend=be)
        s = pool.create_stream()
        pool.close()
        try:
            be.stream_destroy(fw[0])
            alive = True
        except ap.DeviceError as e:
            alive = str(e)
        print(json.dumps({"reused": fw[0] == s, "alive": alive}))
    """, ASCEND_SIM_REUSE_STREAM_HANDLES="1")
    assert out == {"reused": True, "alive": True}, out


def test_register_stream_keeps_a_stream_made_meanwhile_with_the_handle_it_refuses(sim_node):
    # register_stream asks the runtime the stream's device with the GIL released; another device's
    # stream holding the handle of one this pool made (destroyed behind its back) makes the pool
    # forget that handle. A stream this pool made meanwhile, which the runtime gave the handle
    # anew, was forgotten with it (refused by the pool, left by close()). Driven step by step.
    out = sim_node.run_json("""
        import ascend_pool as ap
        from hooked_backend import HookedBackend as B

        be = B("sim")
        pool = ap.Pool(0, backend=be)
        s1 = pool.create_stream()
        be.stream_destroy(s1)                  # behind the pool's back
        s2 = be.stream_create(1)               # the handle anew, on device 1
        made = []

        def meanwhile():
            be.stream_destroy(s2)
            made.append(pool.create_stream())  # the handle anew, on this pool's device

        be.hook = meanwhile
        try:
            pool.register_stream(s2)
            refused = False
        except ap.InvalidStreamError:
            refused = True
        out = {"reused": s2 == s1 == made[0], "refused": refused, "known": pool._knows_stream(made[0])}
        pool.close()
        print(json.dumps(out))
    """, ASCEND_SIM_REUSE_STREAM_HANDLES="1")
    assert out == {"reused": True, "refused": True, "known": True}, out


def test_a_stream_the_c_abi_orders_on_with_the_handle_register_stream_refuses_keeps_its_blocks(sim_node):
    # register_stream asks the runtime the stream's device with the GIL released; a handle that
    # names another device's stream makes the pool forget it, in C too (its slot retired: its
    # cached blocks serve every stream). Meanwhile the framework destroyed that stream, made one
    # of this device that got the handle anew and ordered a block on it through the C ABI (which
    # Python's serials never see): its slot was retired on the stale answer, and the block, still
    # written by that stream's kernel, went to the next allocation on the default stream.
    out = sim_node.run_json("""
        import ascend_pool as ap
        from ascend_pool import _core, sim
        from hooked_backend import HookedBackend as B

        be = B("sim")
        pool = ap.Pool(0, backend=be)
        ctx = pool.context("framework")
        s1 = ctx.create_stream()
        be.stream_destroy(s1)                  # behind the pool's back
        s2 = be.stream_create(1)               # the handle anew, on device 1
        made = []

        def meanwhile():
            be.stream_destroy(s2)
            h = be.stream_create(0)            # the framework's stream: the handle anew, on device 0
            with ctx:
                x = _core.capi_malloc(1 << 20, 0, h)
                sim.launch_fill(h, x, 1 << 20, 0x11, delay_s=0.5)  # its kernel, still queued
                _core.capi_free(x, 0, 0, h)    # cached for h: only h's later work may reuse it
            made.append((h, x))

        be.hook = meanwhile
        try:
            ctx.register_stream(s2)
            refused = False
        except ap.InvalidStreamError:
            refused = True
        (h, x), = made
        y = ctx.malloc(1 << 20)                # the default stream
        sim.launch_fill(0, y, 1 << 20, 0x22)
        ctx.synchronize(None)
        be.stream_sync(h)                      # its kernel done: it wrote its block
        out = {"reused": s2 == s1 == h, "refused": refused,
               "intact": sim.read(y, 1 << 20) == bytes([0x22]) * (1 << 20)}
        ctx.free(y)
        ctx.close()
        be.stream_destroy(h)
        pool.close()
        print(json.dumps(out))
    """, ASCEND_SIM_REUSE_STREAM_HANDLES="1")
    assert out == {"reused": True, "refused": True, "intact": True}, out


def test_a_pool_forgets_the_streams_it_created_that_the_runtime_destroyed(pool):
    # A framework takes a stream from create_stream per request and destroys it with the runtime
    # (aclrtDestroyStream), never telling the pool: create_stream kept every handle in the pool's
    # sets for its life (about 60 B per stream, without bound), as register_stream did before.
    lib = sim.attach()
    lib.aclrtDestroyStream.argtypes, lib.aclrtDestroyStream.restype = [ctypes.c_void_p], ctypes.c_int
    live = pool.create_stream()
    before = sim.stats(0)["live_streams"]
    dead, errors = [], []

    def framework():
        # a thread of its own on device 0, as the framework's: the test's thread is in whatever
        # context earlier tests left it (after test_backend_devices', none that knows the streams:
        # aclrtDestroyStream answered 107003)
        assert lib.aclrtSetDevice(0) == 0
        try:
            for _ in range(600):
                s = pool.create_stream()
                pool.free(pool.malloc(4096, stream=s), stream=s)
                assert lib.aclrtDestroyStream(s) == 0
                dead.append(s)
        except BaseException as e:  # noqa: BLE001 - raised below, on the test's thread
            errors.append(e)
        finally:
            assert lib.aclrtResetDevice(0) == 0

    t = threading.Thread(target=framework)
    t.start()
    t.join()
    if errors:
        raise errors[0]
    assert pool._knows_stream(live)
    remembered = sum(pool._knows_stream(h) for h in dead)
    assert remembered < 64, f"{remembered} of 600 streams destroyed with the runtime still known"
    assert sim.stats(0)["live_streams"] == before
    pool.free(pool.malloc(4096, stream=live), stream=live)
    pool.close()  # the live one it made is still destroyed at close
    assert sim.stats(0)["live_streams"] == before - 1


def test_a_malloc_that_would_grow_for_a_stream_destroyed_elsewhere_is_refused(pool):
    # The cached path asks no runtime (as PyTorch's), but before the pool spends a device
    # allocation for a stream it asks the stream once: one destroyed behind its back gets
    # InvalidStreamError, and nothing is reserved for it (before: a new segment, ordered on a
    # stream that was no more).
    s = _framework_stream(pool)
    pool.free(pool.malloc(4096, stream=s), stream=s)
    pool.backend.stream_destroy(s)
    reserved = pool.memory_stats()["reserved_bytes.all.current"]
    with pytest.raises(ap.InvalidStreamError, match="not a stream the runtime knows"):
        pool.malloc(64 << 20, stream=s)
    st = pool.memory_stats()
    assert st["reserved_bytes.all.current"] == reserved and st["allocated_bytes.all.current"] == 0
    pool.free(pool.malloc(4096))                   # still serving; the old stream's block serves all


def test_destroy_stream_of_a_stream_destroyed_elsewhere_is_an_invalid_stream_error(pool):
    # Whether or not another call found out first, destroy_stream on a stream the framework
    # already destroyed names the stream (before: a DeviceError once another call had retired it).
    s = _framework_stream(pool)
    pool.free(pool.malloc(4096, stream=s), stream=s)
    pool.backend.stream_destroy(s)
    with pytest.raises(ap.InvalidStreamError):
        pool.synchronize(s)                        # the pool finds out
    with pytest.raises(ap.InvalidStreamError, match="not a stream the runtime knows"):
        pool.destroy_stream(s)
    pool.free(pool.malloc(4096))


def test_close_waits_for_busy_streams_within_one_sync_timeout():
    # Every host wait of the pool shares one sync_timeout_ms, whatever the number of streams in
    # it; close's wait for the streams its free blocks are tagged with too (it took one limit
    # per busy stream: 6 hung request streams, 6 x the limit).
    import time

    p = ap.Pool(0, backend="sim", sync_timeout_ms=2000)  # 6 limits would be 12 s
    streams = [p.create_stream() for _ in range(6)]
    xs = [p.malloc(2 * MiB, stream=s) for s in streams]
    for s, x in zip(streams, xs):
        sim.hang_stream(s)                     # a kernel that does not finish
        p.free(x, stream=s)                    # six free blocks, each tagged with its busy stream
    t0 = time.monotonic()
    p.close()
    took = time.monotonic() - t0
    for s in streams:
        sim.release_stream(s)
    assert took < 6.0, f"close took {took:.2f} s with a 2 s limit"  # one limit; room for load


def test_interpreter_exit_does_not_wait_for_hung_streams_pool_by_pool(sim_node):
    # A job whose collective hangs (a peer rank died) and that exits normally: the pools closed at
    # interpreter teardown waited sync_timeout_ms for the hung stream each, one after another
    # (3 pools: 3 x the limit; 60 s each by default). At exit no pool waits: the memory goes
    # back with the process. An explicit close() still waits (the test above).
    import subprocess
    import time

    child = sim_node.spawn("""
        import ascend_pool as ap
        from ascend_pool import sim
        MiB = 1 << 20
        base = ap.Pool(0, backend="sim")
        s = base.create_stream()
        sim.hang_stream(s)
        keep = [base]
        for i in range(3):
            pool = base.context(f"t{i}") if i else base
            keep.append(pool)
            pool.register_stream(s)
            pool.free(pool.malloc(4 * MiB, stream=s), stream=s)   # tagged with the hung stream
        print("exiting", flush=True)
    """, ASCEND_POOL_CONF="sync_timeout_ms:10000")
    assert child.stdout.readline().strip() == "exiting", child.stderr.read()
    t0 = time.monotonic()
    try:
        child.wait(timeout=60)
    except subprocess.TimeoutExpired:
        child.kill()
        raise
    took = time.monotonic() - t0
    assert child.returncode == 0, child.stderr.read()
    # a single wait costs the 10 s limit; the bound leaves a loaded machine room for the exit
    assert took < 5.0, f"exit took {took:.1f} s with 3 pools on a hung stream and a 10 s limit"


def test_c_abi_empty_cache_waits_for_streams_without_holding_the_registry_lock(sim_node):
    # torch's empty_cache (the C ABI's ascend_pool_empty_cache, a framework thread) waits for a
    # stream whose next work needs a Python thread (a host-side producer). It held the C ABI's
    # registry lock through the wait, and opening a pool (under the GIL) needs that lock: the
    # Python thread that would release the stream could not run, so both ran to sync_timeout_ms
    # (20 s here). The pools are now held, not the lock, while their waits run.
    out = sim_node.run_json("""
        import ascend_pool as ap
        from ascend_pool import sim
        abi = capi()
        abi.ascend_pool_init(0)
        s = ap.default_pool(0).create_stream()
        p = abi.ascend_pool_malloc(64 << 20, 0, C.c_void_p(s))
        sim.hang_stream(s)                           # its next work waits for the host
        abi.ascend_pool_free(p, 64 << 20, 0, C.c_void_p(s))
        res = {}
        def producer():
            time.sleep(0.5)
            sim.release_stream(s)                    # needs the GIL
        def framework_empty_cache():
            t = time.monotonic()
            abi.ascend_pool_empty_cache()
            res["empty_cache_s"] = time.monotonic() - t
            res["code"] = abi.ascend_pool_last_error_code()
        threads = [threading.Thread(target=producer), threading.Thread(target=framework_empty_cache)]
        for t in threads:
            t.start()
        time.sleep(0.1)
        t = time.monotonic()
        ap.Pool(1, backend="sim").close()
        res["open_s"] = time.monotonic() - t
        for t in threads:
            t.join()
        print(json.dumps(res))
    """, ASCEND_POOL_CONF="sync_timeout_ms:20000")
    # deadlocked, both run to the 20 s limit; half of it leaves room for a loaded machine
    assert out["code"] == 0 and out["empty_cache_s"] < 10.0 and out["open_s"] < 10.0, out


def test_a_close_in_an_exit_handler_still_waits_for_its_streams(sim_node):
    # Only the interpreter's teardown skips the waits: a program's own close() in an atexit
    # handler (one registered before ascend_pool was imported runs after the package's own
    # handlers) gave back a block a kernel still wrote, and the next pool got it.
    out = sim_node.run_json("""
        import atexit
        def cleanup():
            t = time.monotonic()
            pool.close()
            took = time.monotonic() - t
            q = ap.Pool(0, backend="sim")
            y = q.malloc(n)
            sim.launch_fill(None, y, n, 0x33)
            q.synchronize()
            time.sleep(0.6)                            # the old kernel has run by now
            print(json.dumps({"close_s": took, "intact": sim.read(y, n) == bytes([0x33]) * n}), flush=True)
        atexit.register(cleanup)
        import ascend_pool as ap
        from ascend_pool import sim
        n = 4 << 20
        pool = ap.Pool(0, backend="sim")
        s = pool.create_stream()
        x = pool.malloc(n, stream=s)
        sim.launch_fill(s, x, n, 0xAA, delay_s=0.5)
        pool.free(x, stream=s)                         # the kernel still writes it
    """)
    assert out["intact"] and out["close_s"] >= 0.3, out


def test_closing_the_devices_last_pool_with_a_hung_stream_returns(sim_node):
    # The last aclrtResetDevice waits for the work queued in the device's default context
    # (CANN). Closing the device's last pool while a stream of it hangs (a dead peer's collective)
    # waited sync_timeout_ms for the stream, then for ever in the reset. The reference is left
    # to the process's end instead; a pool whose streams are idle still gives it back.
    out = sim_node.run_json("""
        import time
        import ascend_pool as ap
        from ascend_pool import sim
        pool = ap.Pool(0, backend="sim", sync_timeout_ms=300)
        s = pool.create_stream()
        sim.hang_stream(s)
        pool.free(pool.malloc(4 << 20, stream=s), stream=s)      # tagged with the hung stream
        t0 = time.monotonic()
        pool.close()
        took = time.monotonic() - t0
        refs_after_hung = sim.stats(0)["device_refs"]
        sim.release_stream(s)
        idle = ap.Pool(0, backend="sim")
        idle.free(idle.malloc(4 << 20))
        idle.close()
        print(json.dumps({"took": took, "refs_after_hung": refs_after_hung,
                          "refs_after_idle": sim.stats(0)["device_refs"]}))
    """, timeout=60)
    assert out["took"] < 10.0, out  # before: for ever in the reset; room for load
    # the hung pool's reference and its stream's (which lives on) stay; the idle pool's went back
    assert out["refs_after_hung"] == 2 and out["refs_after_idle"] == 2, out


def test_a_cross_device_use_whose_stream_handle_went_to_a_third_device_does_not_pin_the_block(sim_node):
    # A framework's record_stream (the C ABI) named device 1's stream X for a device-2 block; X
    # was destroyed and the runtime gave its handle to a new stream of device 0 before the free.
    # The free's event could not be recorded on X (another context now): the block owed a wait
    # on X that no event of device 2 could ever give, and stayed pending for good (20 rounds: 20
    # MiB of device 2 held, after empty_cache too). The handle naming another device says X is gone.
    out = sim_node.run_json("""
        import ascend_pool as ap
        from ascend_pool import sim
        VP = C.c_void_p
        acl = sim.attach()
        acl.aclrtSetDevice.argtypes = [C.c_int32]
        acl.aclrtCreateStream.argtypes = [C.POINTER(VP)]
        acl.aclrtDestroyStream.argtypes = [VP]
        lib = C.CDLL(ap.library_path())
        lib.ascend_pool_malloc.restype = VP
        lib.ascend_pool_malloc.argtypes = [C.c_ssize_t, C.c_int, VP]
        lib.ascend_pool_free.argtypes = [VP, C.c_ssize_t, C.c_int, VP]
        lib.ascend_pool_record_stream.argtypes = [VP, VP]
        assert acl.aclInit(None) in (0, 100002)        # the framework's own
        lib.ascend_pool_init(3)

        def stream(dev):
            assert acl.aclrtSetDevice(dev) == 0
            s = VP()
            assert acl.aclrtCreateStream(C.byref(s)) == 0
            return s.value

        keep, reused = [], 0
        for _ in range(5):
            x = stream(1)
            p = lib.ascend_pool_malloc(1 << 20, 2, None)
            lib.ascend_pool_record_stream(p, x)       # a cross-device use
            acl.aclrtSetDevice(1)
            assert acl.aclrtDestroyStream(VP(x)) == 0
            y = stream(0)
            reused += y == x                          # the runtime gave x's handle to device 0
            acl.aclrtSetDevice(2)
            lib.ascend_pool_free(p, 1 << 20, 2, None)
            keep.append(y)                            # a framework's stream: it lives on
        lib.ascend_pool_empty_cache()
        st = ap.default_pool(2).memory_stats()
        print(json.dumps({"reused": reused, "active": st["active_bytes.all.current"],
                          "held": sim.stats(2)["bytes_held"]}))
    """, ASCEND_SIM_REUSE_STREAM_HANDLES="1", ASCEND_SIM_DEVICES="3")
    assert out == {"reused": 5, "active": 0, "held": 0}, out


def test_probes_of_unknown_stream_handles_do_not_use_up_the_idle_events():
    # A probe's event whose record the runtime refuses was never recorded: it goes back to the
    # cache. Parked, it stayed for the pool's life (CANN answers NOT_READY for an event never
    # recorded), and 80 such probes took the device's idle-event budget: every later cross-stream
    # free made a new event (81 over 40 frees).
    p = ap.Pool(0, backend="sim")
    try:
        for i in range(80):
            h = 0x7000000 + 64 * i  # handles the runtime does not know (a framework's destroyed streams)
            p.register_stream(h)
            with pytest.raises(ap.InvalidStreamError):
                p.malloc(MiB, stream=h)
        s, s2 = p.create_stream(), p.create_stream()
        p.free(p.malloc(MiB, stream=s))
        before = p.memory_stats()["events_created"]
        for _ in range(40):
            x = p.malloc(MiB, stream=s)
            p.record_stream(x, s2)
            p.free(x)
            p.synchronize()
        assert p.memory_stats()["events_created"] - before <= 4
        p._check_invariants()
    finally:
        p.close()


def test_a_free_owed_to_a_stream_force_destroyed_behind_the_pools_back_settles_safely(pool):
    """aclrtDestroyStreamForce (CANN) drops the stream's work that has not started: the pool's
    pending free on it settles (the event recorded there completes), the block comes back without
    a late write from the dropped work, and the pool's memory all goes back at empty_cache."""
    import time
    lib = ctypes.CDLL(sim.library_path())
    lib.aclrtDestroyStreamForce.argtypes = [ctypes.c_void_p]
    s = pool.create_stream()
    y = pool.malloc(2 * MiB)
    sim.hang_stream(s)                          # a kernel that never ends, then a write of y
    sim.launch_fill(s, y, 2 * MiB, 0x77)
    pool.record_stream(y, s)
    pool.free(y)
    assert pool.memory_stats()["pending_free_bytes"] >= 2 * MiB
    lib.aclrtSetDevice(0)                       # the stream's context current on this thread
    assert lib.aclrtDestroyStreamForce(s) == 0  # the framework's; the pool is not told
    try:
        z = pool.malloc(2 * MiB)
    except ap.InvalidStreamError:               # may find out once
        z = pool.malloc(2 * MiB)
    sim.launch_fill(None, z, 2 * MiB, 0x11)
    assert lib.aclrtSynchronizeStream(None) == 0
    time.sleep(0.2)                             # a late write from s would land meanwhile
    assert sim.read(z, 2 * MiB) == b"\x11" * 2 * MiB, "the dropped write landed"
    pool.free(z)
    pool.empty_cache()
    st = pool.memory_stats()
    assert st["pending_free_bytes"] == 0 and st["reserved_bytes.all.current"] == 0

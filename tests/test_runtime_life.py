"""The framework owns the runtime's life: torch_npu calls aclFinalize at its exit (and tests
finalize and aclInit again mid-run), resets devices, destroys its contexts and streams. A pool
must then never hand out, use or free memory of the runtime that released it: the backend learns
of it from the calls it makes (ACL_ERROR_UNINITIALIZE, or the device's default context released
and taken anew; ap_backend_life), and the pool forgets that memory before its next device call,
without a runtime call, says so once on stderr, and accepts the frees of the blocks it wrote off.
Each test runs in a fresh process (sim_node): aclFinalize ends every pool of its process."""
import json
import os
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401

WARNING = "ascend_pool: warning: the runtime released device 0's memory behind its pools"


@pytest.mark.parametrize("expandable", [False, True], ids=["classic", "expandable"])
def test_after_finalize_and_init_the_pool_serves_memory_of_the_new_runtime_only(sim_node, expandable):
    """aclFinalize then aclInit with no pool call between: the pool's cached segment (and the block
    still allocated in it) belong to the finalized runtime. The next request that reaches the
    device finds the runtime renewed; from then on every block served is live memory of the new
    runtime (before: the old segment's free part served 4 of the 4 MiB requests, dead memory; an
    expandable pool's growth mapped into the finalized runtime's reservation and raised
    DeviceError 107000), the block allocated before is freed without error, and the close frees
    nothing twice."""
    p = sim_node.spawn(f"""
        import ascend_pool as ap
        from ascend_pool import sim
        acl = C.CDLL(sim.library_path())
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        pool = ap.Pool(0, backend="sim", expandable_segments={expandable})
        before = pool.malloc(2 << 20)
        pool.free(pool.malloc(8 << 20))            # cached beside it: room for 4 MiB blocks
        assert acl.aclFinalize() == 0
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        dead = []
        got = [pool.malloc(64 << 20)] + [pool.malloc(4 << 20) for _ in range(4)]
        for q in got:
            try:
                sim.read(q, 64)
            except Exception as e:
                dead.append(hex(q))
        pool._check_invariants()                   # blocks, trees and stats, old memory gone
        for q in got:
            pool.free(q)
        pool.free(before)                           # written off: accepted
        pool._check_invariants()
        pool.empty_cache()
        allocated = pool.memory_stats()["allocated_bytes.all.current"]
        pool.close()
        print(json.dumps({{"dead": dead, "allocated": allocated, "held": sim.stats(0)["bytes_held"],
                          "refs": sim.stats(0)["device_refs"]}}))
    """)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert res["dead"] == [], res
    assert res["allocated"] == 0 and res["held"] == 0, res
    assert res["refs"] == 1, res                     # the framework's own reference, as before
    assert err.count(WARNING) == 1, err


def test_empty_cache_after_finalize_forgets_the_cache_and_a_request_names_the_runtimes_code(sim_node):
    """torch_npu's exit: aclFinalize, then the allocator's empty_cache and the pools' close. The
    cache is forgotten (said once for the process's two pools), empty_cache does not raise (before:
    DeviceError "waiting for stream (nil) on device 0 failed" for aclrtSetDevice's 100001), a
    request then fails with the runtime's code and name, and the process exits cleanly."""
    p = sim_node.spawn("""
        import ascend_pool as ap
        from ascend_pool import sim
        acl = C.CDLL(sim.library_path())
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        pools = [ap.Pool(0, backend="sim") for _ in range(2)]
        live = [q.malloc(1 << 20) for q in pools]
        for q in pools:
            q.free(q.malloc(3 << 20))
        assert acl.aclFinalize() == 0
        for q in pools:
            q.empty_cache()
        try:
            pools[0].malloc(256 << 20)
            request = "served"
        except ap.PoolError as e:
            request = f"{type(e).__name__}: {e}"
        reserved = [q.memory_stats()["reserved_bytes.all.current"] for q in pools]
        print(json.dumps({"request": request, "reserved": reserved}))
    """)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert "100001" in res["request"] and "ACL_ERROR_UNINITIALIZE" in res["request"], res
    assert res["reserved"] == [0, 0], res
    assert err.count(WARNING) == 1 and "Traceback" not in err, err


def test_finalize_then_python_exit_with_live_blocks_and_pending_frees(sim_node):
    """aclFinalize with blocks allocated, a free pending on a busy stream, the process's default
    pool in use, then the interpreter's exit closes the pools: no crash, no hang, no error."""
    p = sim_node.spawn("""
        import ascend_pool as ap
        from ascend_pool import sim
        acl = C.CDLL(sim.library_path())
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        pool = ap.Pool(0, backend="sim")
        s = pool.create_stream()
        keep = pool.malloc(1 << 20)
        q = pool.malloc(3 << 20)
        pool.record_stream(q, s)
        sim.launch_fill(s, q, 3 << 20, 7, delay_s=0.5)
        pool.free(q)
        kept = ap.malloc(4096)
        assert acl.aclFinalize() == 0
        print("finalized", flush=True)
    """, ASCEND_POOL_BACKEND="sim")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and "finalized" in out, err
    assert "Traceback" not in err and "Error" not in err, err


def test_a_forced_reset_under_live_blocks_leaves_their_memory_to_the_old_runtime(sim_node):
    """aclrtResetDeviceForce (a framework's teardown, or its recovery after a device error) takes
    the pools' references with its own and releases the default context: the pool renews its
    reference, and the memory it held there, which CANN does not promise to keep, is neither
    served nor freed again: requests after it come from new segments (before: the old segment's
    free part served them), the block allocated before is freed without error, and the device's
    references pair at close."""
    out = sim_node.run_json("""
        import ascend_pool as ap
        from ascend_pool import sim
        acl = C.CDLL(sim.library_path())
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        pool = ap.Pool(0, backend="sim")
        before = pool.malloc(2 << 20)
        pool.free(pool.malloc(8 << 20))
        old = pool.snapshot()["segments"][0]
        lo, hi = old["address"], old["address"] + old["total_size"]
        assert acl.aclrtResetDeviceForce(0) == 0 and acl.aclrtSetDevice(0) == 0
        got = [pool.malloc(64 << 20)] + [pool.malloc(4 << 20) for _ in range(4)]
        inside = [hex(q) for q in got if lo <= q < hi]
        for q in got:
            pool.free(q)
        pool.free(before)
        pool._check_invariants()
        pool.close()
        print(json.dumps({"inside": inside, "refs": sim.stats(0)["device_refs"]}))
    """)
    assert out["inside"] == [] and out["refs"] == 1, out


def test_after_finalize_and_init_a_new_stream_orders_frees_with_events_of_the_new_runtime(sim_node):
    """The events a pool caches idle are the finalized runtime's too. Once the pool found the
    runtime renewed, a stream made in the new runtime is taken by record_stream and its frees are
    ordered with fresh events (before: the asking record took a dead cached event, the runtime
    refused it, and the new stream was refused as 'not a stream the runtime knows')."""
    out = sim_node.run_json("""
        import ascend_pool as ap
        from ascend_pool import sim
        acl = C.CDLL(sim.library_path())
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        pool = ap.Pool(0, backend="sim")
        def cross_frees(n):
            s = pool.create_stream()
            for _ in range(n):
                q = pool.malloc(1 << 20)
                pool.record_stream(q, s)
                sim.launch_fill(s, q, 1 << 20, 3, delay_s=0.05)
                pool.free(q)
            pool.synchronize(s)
        cross_frees(4)                               # leaves idle events cached
        assert acl.aclFinalize() == 0
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        pool.free(pool.malloc(64 << 20))             # a device call: the runtime renewed
        created = sim.stats(0)["events_created"]
        try:
            cross_frees(4)
            error = None
        except ap.PoolError as e:
            error = f"{type(e).__name__}: {e}"
        created = sim.stats(0)["events_created"] - created
        pool.empty_cache()
        pool.close()
        print(json.dumps({"error": error, "created": created, "live_events": sim.stats(0)["live_events"]}))
    """)
    assert out["error"] is None and out["created"] >= 1, out
    assert out["live_events"] == 0, out


HOST_WARNING = "ascend_pool: warning: the runtime released the pinned host memory of device 0's host pool"


def test_after_finalize_and_init_the_host_pool_serves_pinned_memory_of_the_new_runtime_only(sim_node):
    """The pinned HostPool caches aclrtMallocHost buffers, which aclFinalize releases (the simulator
    unmaps them, as CANN does). After aclFinalize and aclInit, once a request reaches the runtime
    (a miss), every buffer served is live pinned memory of the new runtime (before: the cached
    1 MiB, 8 MiB and 4 KiB buffers were served again, and the first write to one ended the process
    with SIGSEGV), the buffer handed out before is freed without error, and the close frees
    nothing of the old runtime: a second host pool's buffers, pinned in the new runtime where the
    old ones were, stay writable after the first pool's close."""
    p = sim_node.spawn("""
        import ascend_pool as ap
        from ascend_pool import sim
        from ascend_pool._core import HostPool
        from ascend_pool.backend import Backend
        acl = C.CDLL(sim.library_path())
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        b = Backend("sim")
        hp = HostPool(b, 0)
        keep = hp.malloc(4096)
        hp.free(hp.malloc(1 << 20))
        hp.free(hp.malloc(8 << 20))
        assert acl.aclFinalize() == 0
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        other = HostPool(b, 0)
        theirs = [other.malloc(n) for n in (4096, 1 << 20, 8 << 20)]
        got = [hp.malloc(3 << 20)] + [hp.malloc(n) for n in (1 << 20, 8 << 20, 4096)]
        for q in got + theirs:
            C.memset(q, 1, 64)
        for q in got:
            hp.free(q)
        hp.free(keep)                                   # written off: accepted
        st = hp.memory_stats()
        hp.empty_cache()
        hp.close()
        for q in theirs:
            C.memset(q, 2, 64)                          # the first pool's close freed none of them
            other.free(q)
        other.close()
        print(json.dumps({"allocated": st["allocated_bytes.all.current"], "invalid": st["num_invalid_frees"]}))
    """)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, (p.returncode, err)
    res = json.loads(out.strip().splitlines()[-1])
    assert res == {"allocated": 0, "invalid": 0}, res
    assert err.count(HOST_WARNING) == 1, err


def test_host_pool_empty_cache_and_close_after_finalize_with_a_buffer_parked_on_a_busy_stream(sim_node):
    """torch_npu's exit: aclFinalize under a host pool holding a buffer handed out and one parked
    for a copy still queued on a stream, then empty_cache, a request and close: nothing raises but
    the request (the runtime's own code), nothing of the old runtime is freed, the process exits
    cleanly, and the loss is said once."""
    p = sim_node.spawn("""
        import ascend_pool as ap
        from ascend_pool import sim
        from ascend_pool._core import HostPool
        from ascend_pool.backend import Backend
        acl = C.CDLL(sim.library_path())
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        b = Backend("sim")
        pool = ap.Pool(0, backend=b)
        s = pool.create_stream()
        hp = HostPool(b, 0)
        keep = hp.malloc(1 << 20)
        q = hp.malloc(2 << 20)
        hp.record_stream(q, s)
        d = pool.malloc(2 << 20)
        sim.launch_fill(s, d, 2 << 20, 7, delay_s=0.5)
        hp.free(q)
        parked = hp.memory_stats()["pending_free_blocks"]
        assert acl.aclFinalize() == 0
        hp.empty_cache()
        st = hp.memory_stats()
        try:
            hp.malloc(64 << 20)
            request = "served"
        except ap.PoolError as e:
            request = f"{type(e).__name__}: {e}"
        hp.free(keep)
        hp.close()
        print(json.dumps({"parked": parked, "request": request, "reserved": st["reserved_bytes.all.current"],
                          "pending": st["pending_free_blocks"]}))
    """)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, (p.returncode, err)
    res = json.loads(out.strip().splitlines()[-1])
    assert res["parked"] == 1 and res["reserved"] == 0 and res["pending"] == 0, res
    assert "100001" in res["request"], res
    assert err.count(HOST_WARNING) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("first", ["stream", "host_pool"])
def test_a_reference_taken_first_in_the_new_runtime_does_not_hide_it_from_the_pool(sim_node, first):
    """After aclFinalize and aclInit, the first call of the process's pools to take a device
    reference may be a new stream's or a new host pool's rather than the old pool's: that
    reference records the new default context, and the old pool must still learn that its cached
    memory is the finalized runtime's (before: the reference recorded the new context without
    moving the runtime's life on, and the old pool served its dead cached segment)."""
    out = sim_node.run_json(f"""
        import ascend_pool as ap
        from ascend_pool import sim
        from ascend_pool._core import HostPool
        from ascend_pool.backend import Backend
        acl = C.CDLL(sim.library_path())
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        b = Backend("sim")
        pool = ap.Pool(0, backend=b)
        pool.free(pool.malloc(8 << 20))
        assert acl.aclFinalize() == 0
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        other = pool.create_stream() if {first!r} == "stream" else HostPool(b, 0)
        got = [pool.malloc(64 << 20)] + [pool.malloc(4 << 20) for _ in range(2)]
        dead = []
        for q in got:
            try:
                sim.read(q, 64)
            except Exception:
                dead.append(hex(q))
        print(json.dumps({{"dead": dead}}))
    """)
    assert out["dead"] == [], out


def test_the_c_abi_accepts_the_free_of_a_written_off_block_from_outside_its_pool(sim_node):
    """A block allocated through the C ABI in a tenant context (`with ctx:`), written off when the
    context's pool found the runtime finalized and initialised again, is freed (and marked with
    record_stream) from outside the context, where the thread's current pool is the default: the
    C ABI finds the pool that wrote it off and its free is accepted, no last error (before: code 4
    'pointer ... was not allocated by this pool', and record_stream's 'not a live block of any
    pool', since the search for the owning pool asked for live blocks only)."""
    out = sim_node.run_json("""
        import ascend_pool as ap
        from ascend_pool import sim
        acl = C.CDLL(sim.library_path())
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        lib = C.CDLL(ap.library_path())
        lib.ascend_pool_malloc.restype = C.c_void_p
        lib.ascend_pool_malloc.argtypes = [C.c_ssize_t, C.c_int, C.c_void_p]
        lib.ascend_pool_free.argtypes = [C.c_void_p, C.c_ssize_t, C.c_int, C.c_void_p]
        lib.ascend_pool_record_stream.argtypes = [C.c_void_p, C.c_void_p]
        lib.ascend_pool_last_error.restype = C.c_char_p
        def error():
            e = (lib.ascend_pool_last_error_code(), lib.ascend_pool_last_error().decode())
            lib.ascend_pool_clear_last_error()
            return e
        ctx = ap.default_pool(0).context("t")
        with ctx:
            p = lib.ascend_pool_malloc(1 << 20, 0, None)
            q = lib.ascend_pool_malloc(1 << 20, 0, None)
        assert acl.aclFinalize() == 0
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        with ctx:
            lib.ascend_pool_free(lib.ascend_pool_malloc(256 << 20, 0, None), 0, 0, None)  # the loss learned
        error()
        lib.ascend_pool_free(p, 1 << 20, 0, None)
        freed = error()
        lib.ascend_pool_record_stream(q, None)
        recorded = error()
        lib.ascend_pool_free(q, 1 << 20, 0, None)
        freed2 = error()
        lib.ascend_pool_free(q, 1 << 20, 0, None)     # twice: refused as any double free
        twice = error()
        allocated = ctx.memory_stats()["allocated_bytes.all.current"]
        ctx.close()
        print(json.dumps({"freed": freed, "recorded": recorded, "freed2": freed2, "twice": twice[0],
                          "allocated": allocated}))
    """, ASCEND_POOL_BACKEND="sim")
    assert out["freed"] == [0, ""] and out["recorded"] == [0, ""] and out["freed2"] == [0, ""], out
    assert out["twice"] == 4 and out["allocated"] == 0, out


def test_after_finalize_and_init_a_use_on_oom_mempool_lends_no_block_of_the_released_memory(sim_node):
    """The default pool's request refused by the fraction after aclFinalize and aclInit: the
    use_on_oom MemPool's idle 42 MiB segment is the finalized runtime's, so it lends no block of it
    (before: the 30 MiB block lent in place was unreadable memory); the MemPool forgets it, which
    gives the fraction its room back, and the default pool grows in the new runtime."""
    p = sim_node.spawn("""
        import ascend_pool as ap
        from ascend_pool import sim
        MiB = 1 << 20
        acl = C.CDLL(sim.library_path())
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        default = ap.default_pool(0)
        lend = ap.Pool(0, use_on_oom=True)
        with ap.use_mem_pool(lend):
            lend.free(ap.malloc(40 * MiB))
        assert acl.aclFinalize() == 0
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        ap.set_per_process_memory_fraction((42 * MiB + default.total_bytes()) / ap.mem_get_info(0)[1], 0)
        c = ap.malloc(30 * MiB)
        lent = lend.block_info(c) is not None
        sim.launch_fill(0, c, 30 * MiB, 7)
        ap.synchronize()
        ok = sim.read(c + 30 * MiB - 4, 4) == bytes([7]) * 4
        ap.free(c)
        print(json.dumps({"lent": lent, "ok": ok}))
    """)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert res == {"lent": False, "ok": True}, (res, err)


def test_after_finalize_and_init_the_out_of_memory_release_forgets_a_peers_cache_without_freeing_it(sim_node):
    """The default pool's request refused by the fraction after aclFinalize and aclInit has the
    use_on_oom MemPool (no block of it fits) give back its idle segment: the finalized runtime's
    memory, whose address the new runtime may have given the application meanwhile. It is forgotten,
    not freed, and the fraction has its room back: before, aclrtFree of the old address freed the
    application's buffer there (1 runtime free), or, with nothing there, the dead segment stayed
    booked and the request was refused."""
    p = sim_node.spawn("""
        import ascend_pool as ap
        from ascend_pool import sim
        MiB = 1 << 20
        acl = C.CDLL(sim.library_path())
        acl.aclrtMalloc.argtypes = [C.POINTER(C.c_void_p), C.c_size_t, C.c_int]
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        default = ap.default_pool(0)
        lend = ap.Pool(0, use_on_oom=True)
        with ap.use_mem_pool(lend):
            lend.free(ap.malloc(10 * MiB))
        old = [s["address"] for s in lend.snapshot()["segments"]]
        assert acl.aclFinalize() == 0
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        raw = C.c_void_p()
        assert acl.aclrtMalloc(C.byref(raw), 12 * MiB, 0) == 0   # the application's, perhaps at old[0]
        ap.set_per_process_memory_fraction((32 * MiB + default.total_bytes()) / ap.mem_get_info(0)[1], 0)
        try:
            c = ap.malloc(30 * MiB)
        except ap.OutOfMemoryError as e:
            c = str(e)
        frees = sim.stats(0)["frees"]
        readable = sim.read(raw.value + 12 * MiB - 4, 4) is not None
        print(json.dumps({"c": c if isinstance(c, str) else "ok", "frees": frees, "readable": readable,
                          "lender_reserved": lend.memory_stats()["reserved_bytes.all.current"]}))
    """)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert res == {"c": "ok", "frees": 0, "readable": True, "lender_reserved": 0}, (res, err)


@pytest.mark.parametrize("exported", [False, True], ids=["allocated", "exported"])
def test_after_finalize_and_init_a_shared_block_is_forgotten_neither_freed_nor_exported(sim_node, exported):
    """A share_malloc'ed block (exported or not) when the runtime is finalized and initialised
    again: aclFinalize freed it and closed its key, and the new runtime may put an application's
    buffer at its address. share() refuses it naming the finalized runtime (before: it exported
    the application's buffer), share_free forgets it (True) without freeing that buffer (before:
    aclrtFree'd it; exported, share_free raised DeviceError 107000 for the closed key and its
    8 MiB stayed reserved for good), and the pool closes cleanly. The pool's first runtime call
    after the renewal takes it out of its reservation and quota, as the rest of that runtime's
    memory (before: 8 MiB reserved and allocated until share_free)."""
    res = sim_node.run_json(f"""
        import ascend_pool as ap
        from ascend_pool import sim
        acl = C.CDLL(sim.library_path())
        acl.aclrtMalloc.argtypes = [C.POINTER(C.c_void_p), C.c_size_t, C.c_int]
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        pool = ap.Pool(0, backend="sim")
        ptr = pool.share_malloc(8 << 20)
        if {exported}:
            pool.share(ptr, any_process=True)
        assert acl.aclFinalize() == 0
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        app = C.c_void_p()
        assert acl.aclrtMalloc(C.byref(app), 8 << 20, 0) == 0
        res = {{"same_address": app.value == ptr}}
        pool.empty_cache()                          # a runtime call: the pool finds the runtime renewed
        pool._check_invariants()
        st = pool.memory_stats()
        res["renewed"] = [st["reserved_bytes.all.current"], st["allocated_bytes.all.current"],
                          st["shared_allocated_bytes"]]
        if not {exported}:
            try:
                pool.share(ptr, any_process=True)
                res["share"] = "exported"
            except ap.PoolError as e:
                res["share"] = f"{{type(e).__name__}}: {{e}}"
        res["share_free"] = pool.share_free(ptr)
        sim.read(app.value, 64)                     # raises where it was freed
        res["reserved"] = pool.memory_stats()["reserved_bytes.all.current"]
        pool.close()
        print(json.dumps(res))
    """, ASCEND_POOL_STATS="0")
    assert res["share_free"] is True and res["reserved"] == 0, res
    assert res["renewed"] == [0, 0, 0], res          # its memory left the pool with the runtime's
    if not exported:
        assert res["share"].startswith("InvalidPointerError") and "released by the runtime" in res["share"], res


EXPORTER = """
    import pickle, base64
    import ascend_pool as ap
    from ascend_pool import sim
    acl = C.CDLL(sim.library_path())
    assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
    pool = ap.Pool(0, backend="sim")
    ptr = pool.share_malloc(4 << 20)
    h = pool.share(ptr, any_process=True)
    print(base64.b64encode(pickle.dumps(h)).decode(), flush=True)
    sys.stdin.readline()                            # the worker maps it
    if FINALIZE:
        assert acl.aclFinalize() == 0
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
    freed = pool.share_free(ptr)
    res = {"freed": freed, "records": len([s for s in ap.sharing.shares() if s["key"] == h.key]),
           "reserved": pool.memory_stats()["reserved_bytes.all.current"]}
    print(json.dumps(res), flush=True)
    sys.stdin.readline()
"""

IMPORTER = """
    import pickle, base64
    import ascend_pool as ap
    from ascend_pool import sim
    acl = C.CDLL(sim.library_path())
    assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
    h = pickle.loads(base64.b64decode(sys.stdin.readline()))
    pool = ap.Pool(0, backend="sim")
    b = ap.open_shared(h, pool=pool)
    print("mapped", flush=True)
    res = {}
    if FINALIZE:
        assert acl.aclFinalize() == 0
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        res["imported"] = pool.memory_stats()["shared_imported_bytes"]
        again = ap.open_shared(h, pool=pool)       # mapped again in the new runtime
        b.close()
        res["read_again"] = len(sim.read(again.ptr, 64))
        again.close()
    else:
        sys.stdin.readline()                        # the exporter finalized and gave it back
        b.close()
    print(json.dumps(res), flush=True)
"""


def _exporter_and_worker(sim_node, exporter_finalizes):
    env = dict(ASCEND_SIM_DEVICES="1", ASCEND_POOL_STATS="0", ASCEND_POOL_LEDGER_DIR=sim_node.shm_dir)
    e = sim_node.spawn(f"FINALIZE = {exporter_finalizes}\n" + textwrap.dedent(EXPORTER), **env)
    i = sim_node.spawn(f"FINALIZE = {not exporter_finalizes}\n" + textwrap.dedent(IMPORTER), **env)
    try:
        i.stdin.write(e.stdout.readline())
        i.stdin.flush()
        assert i.stdout.readline().strip() == "mapped", i.stderr.read()
        if exporter_finalizes:
            e.stdin.write("mapped\n")
            e.stdin.flush()
            exp = json.loads(e.stdout.readline() or "{}")
            i.stdin.write("freed\n")
            i.stdin.flush()
            imp = json.loads(i.stdout.readline() or "{}")
        else:
            imp = json.loads(i.stdout.readline() or "{}")
            e.stdin.write("closed\n")
            e.stdin.flush()
            exp = json.loads(e.stdout.readline() or "{}")
        e.stdin.write("done\n")
        e.stdin.flush()
        errs = [p.communicate(timeout=60)[1] for p in (e, i)]
    finally:
        for p in (e, i):
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert e.returncode == 0 and i.returncode == 0, errs
    return exp, imp


def test_a_workers_import_closes_after_its_runtime_was_finalized_and_leaves_its_new_import(sim_node):
    """A worker's runtime is finalized and initialised again while it maps a shared block: the
    runtime closed that import with its life. The block no longer counts as imported, its close
    raises nothing (before: DeviceError 107000, the key 'neither exported nor imported') and
    leaves the import the worker made of the same key in the new runtime (before: closed it, and
    reading it raised SimError 'not inside one live device allocation'); the exporter frees it."""
    exp, imp = _exporter_and_worker(sim_node, exporter_finalizes=False)
    assert imp == {"imported": 0, "read_again": 64}, imp
    assert exp == {"freed": True, "records": 0, "reserved": 0}, exp


def test_an_exporters_finalize_under_a_workers_import_lets_share_free_forget_the_block(sim_node):
    """The exporter's runtime is finalized and initialised again while a worker maps its block:
    aclFinalize freed it and closed its key. share_free forgets it at once (True), its record
    goes and its pool reserves nothing (before: False, deferred on the worker, then the key's
    close failed for good: 4 MiB reserved and the record left); the worker's close works."""
    exp, imp = _exporter_and_worker(sim_node, exporter_finalizes=True)
    assert exp == {"freed": True, "records": 0, "reserved": 0}, exp
    assert imp == {}, imp


def test_the_host_pools_errors_after_finalize_name_the_runtime(sim_node):
    """The pinned HostPool after aclFinalize: a request before aclInit fails as the device pools'
    does, DeviceError with the runtime's 100001 (before: OutOfMemoryError, though nothing ran out),
    and after aclInit realloc of a buffer written off with the runtime says so (before: the generic
    'is not a pinned host buffer handed out by this pool'); its free is still accepted."""
    res = sim_node.run_json("""
        import ascend_pool as ap
        from ascend_pool import sim
        from ascend_pool._core import HostPool
        from ascend_pool.backend import Backend
        acl = C.CDLL(sim.library_path())
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        hp = HostPool(Backend("sim"), 0)
        keep = hp.malloc(4096)
        assert acl.aclFinalize() == 0
        res = {}
        try:
            hp.malloc(1 << 20)
        except ap.PoolError as e:
            res["before_init"] = [type(e).__name__, str(e)]
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        hp.free(hp.malloc(1 << 20))                     # the miss that finds the new runtime
        try:
            hp.realloc(keep, 1 << 20)
        except ap.PoolError as e:
            res["realloc"] = [type(e).__name__, str(e)]
        hp.free(keep)
        res["invalid"] = hp.memory_stats()["num_invalid_frees"]
        hp.close()
        print(json.dumps(res))
    """, ASCEND_POOL_STATS="0")
    kind, msg = res["before_init"]
    assert kind == "DeviceError" and "100001" in msg and "ACL_ERROR_UNINITIALIZE" in msg, res
    kind, msg = res["realloc"]
    assert kind == "InvalidPointerError" and "the runtime released" in msg and "aclFinalize" in msg, res
    assert res["invalid"] == 0, res


def test_a_share_malloc_after_finalize_and_init_forgets_the_old_cache_before_giving_it_back(sim_node):
    """share_malloc after aclFinalize and aclInit, the pool still caching a segment of the old
    runtime whose address the new runtime gave an application's buffer: the device cannot serve
    the shared block at first, so the pool gives back its idle segments and retries. The old one
    is forgotten, not freed (before: aclrtFree freed the application's 20 MiB buffer, and the
    retried shared block then covered its address)."""
    res = sim_node.run_json("""
        import ascend_pool as ap
        from ascend_pool import sim
        acl = C.CDLL(sim.library_path())
        acl.aclrtMalloc.argtypes = [C.POINTER(C.c_void_p), C.c_size_t, C.c_int]
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        pool = ap.Pool(0, backend="sim")
        pool.free(pool.malloc(8 << 20))                 # cached: a 20 MiB segment of this runtime
        seg = pool.snapshot()["segments"][0]
        assert acl.aclFinalize() == 0
        assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
        app = C.c_void_p()
        assert acl.aclrtMalloc(C.byref(app), seg["total_size"], 0) == 0
        res = {"same_address": app.value == seg["address"]}
        try:
            ptr = pool.share_malloc(1020 << 20)          # 1020 + 20 MiB: more than the 1 GiB device
            res["app_inside_share"] = ptr <= app.value < ptr + (1020 << 20)
        except ap.OutOfMemoryError:
            res["app_inside_share"] = False
        sim.read(app.value, 64)                          # raises where it was freed
        print(json.dumps(res))
    """, ASCEND_SIM_DEVICES="1", ASCEND_POOL_STATS="0")
    assert res["app_inside_share"] is False, res


def test_a_framework_pairing_acl_init_with_finalize_reference_ends_its_runtime_there(sim_node):
    """CANN counts every aclInit, a refused one (ACL_ERROR_REPEAT_INITIALIZE) too, and
    aclFinalizeReference finalises at the count's last. A program that pairs its aclInit with
    aclFinalizeReference, pools open and closed between (several backends: each aclInit'ed), finds
    the count at 0 after it and the runtime finalised, as without ascend_pool (before: 1 left per
    backend opened, the runtime running until exit); a pool opened in the new runtime works."""
    res = sim_node.run_json("""
        import ascend_pool as ap
        from ascend_pool import sim
        acl = C.CDLL(sim.library_path())
        assert acl.aclInit(None) == 0
        pools = [ap.Pool(0, backend="sim"), ap.Pool(0, backend="sim", expandable_segments=True)]
        for p in pools:
            p.free(p.malloc(1 << 20))
            p.close()
        n = C.c_uint64(99)
        rc = acl.aclFinalizeReference(C.byref(n))
        res = {"rc": rc, "left": n.value, "set_device": acl.aclrtSetDevice(0), "init_again": acl.aclInit(None)}
        pool = ap.Pool(0, backend="sim")
        pool.free(pool.malloc(1 << 20))
        pool.close()
        res["again"] = acl.aclFinalizeReference(C.byref(n))
        res["left_again"] = n.value
        print(json.dumps(res))
    """, ASCEND_SIM_DEVICES="1")
    assert res == {"rc": 0, "left": 0, "set_device": 100001, "init_again": 0, "again": 0, "left_again": 0}, res


def test_the_simulator_counts_acl_init_references_as_cann(sim_node):
    """hicann/runtime aclInitImpl / aclFinalizeReferenceImpl: each aclInit adds one (100002 after
    the first), aclFinalizeReference takes one and finalises at the last, one more is refused
    with ACL_ERROR_REPEAT_FINALIZE; aclFinalize clears the count whatever it is."""
    res = sim_node.run_json("""
        from ascend_pool import sim
        acl = C.CDLL(sim.library_path())
        n = C.c_uint64(99)
        r = [acl.aclInit(None), acl.aclInit(None), acl.aclInit(None)]
        r.append(acl.aclFinalizeReference(C.byref(n))); r.append(n.value)
        r.append(acl.aclrtSetDevice(0)); acl.aclrtResetDevice(0)
        r.append(acl.aclFinalizeReference(C.byref(n))); r.append(n.value)
        r.append(acl.aclFinalizeReference(C.byref(n))); r.append(n.value)
        r.append(acl.aclrtSetDevice(0))
        r.append(acl.aclFinalizeReference(None))
        r += [acl.aclInit(None), acl.aclInit(None), acl.aclFinalize(), acl.aclFinalizeReference(None)]
        print(json.dumps(r))
    """, ASCEND_SIM_DEVICES="1")
    assert res == [0, 100002, 100002, 0, 2, 0, 0, 1, 0, 0, 100001, 100037, 0, 100002, 0, 100037], res

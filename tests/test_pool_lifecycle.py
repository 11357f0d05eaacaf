"""One lifecycle for every pool: close() and the object's death (no close) end the same way for a
Pool and a tenant context: device memory back to the device, the tenant's quota booking back to
the ledger, the pool gone from the C ABI, and no thread able to reach it.

Run in fresh processes (sim_node): device accounting is the node's, and a use of a freed pool
would crash the process rather than pytest.
"""
import os
import sys
import textwrap
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401

MiB = 1 << 20


def test_closing_and_dropping_a_pool_or_context_end_the_same_way(sim_node):
    out = sim_node.run_json(textwrap.dedent("""
        import gc
        import ascend_pool as ap
        from ascend_pool import _core
        from ascend_pool.backend import open_backend
        from ascend_pool.tenants.ledger import open_ledger

        be = open_backend("sim")
        ledger = open_ledger(0, be)
        free0 = be.mem_info(0)[0]
        res = {}
        for kind in ("pool", "context"):
            for end in ("close", "drop"):
                pool = ap.Pool(0, backend="sim")
                obj = pool if kind == "pool" else pool.context(f"life{end}", quota="64MiB")
                with obj if kind == "context" else open(os.devnull):
                    ptr = _core.capi_malloc(8 << 20, 0) if kind == "context" else obj.malloc(8 << 20)
                live = obj.malloc(3 << 20)  # never freed: closing returns it too
                held = ledger.tenant(f"life{end}")["held_bytes"] if kind == "context" else None
                if end == "close":
                    obj.close()
                    obj.close()           # twice is harmless
                else:
                    del obj
                if kind == "context":
                    pool.close()
                del pool
                gc.collect()
                kept = be.mem_info(0)[0] < free0
                try:
                    _core.capi_free(ptr, 0, 0)
                    freed = "freed"
                except ap.PoolError as e:
                    freed = type(e).__name__
                if end == "drop":  # its blocks kept it open: the last one freed, it closes
                    ap.free(live)
                res[f"{kind} {end}"] = {
                    "kept_while_allocated": kept,
                    "device_back": be.mem_info(0)[0] == free0,
                    "booking_back": None if held is None else (held >= 11 << 20 and
                                                               ledger.tenant(f"life{end}")["held_bytes"] == 0),
                    "c_abi": freed,
                }
        print(json.dumps(res))
    """), ASCEND_POOL_STATS="0")  # no publisher thread holding a dropped pool for a moment
    # A close gives everything back at once (blocks still allocated included, said in the log).
    # A drop keeps the pool while blocks of it are allocated, as torch's MemPool outlives its
    # tensors (it gave their memory back under them): the C ABI's free and ap.free find it, and
    # its last free closes it.
    for case, got in out.items():
        drop = case.endswith("drop")
        assert got["device_back"], (case, got)
        assert got["booking_back"] in (None, True), (case, got)
        assert got["kept_while_allocated"] is drop, (case, got)
        assert got["c_abi"] == ("freed" if drop else "InvalidPointerError"), (case, got)


@pytest.mark.parametrize("expandable", [False, True], ids=["classic", "expandable"])
@pytest.mark.parametrize("reset", ["aclrtResetDevice(0)", "aclrtResetDeviceForce(0)"])
def test_a_device_reset_behind_the_pools_does_not_break_them(sim_node, reset, expandable):
    """A framework that resets device 0 once more than it set it, or force-resets it
    (aclrtResetDeviceForce, as CANN's samples do at teardown), takes the pools' references with
    its own (CANN counts them per process) and the default context goes. The pools take their
    references again on the device's new context: an open pool keeps growing (it used to raise
    DeviceError "not a live context"; before that OutOfMemoryError), a pool opened meanwhile works
    (it used to fail until the first was closed), and once both are closed the device holds
    exactly the framework's own reference again."""
    out = sim_node.run_json(f"""
        import ascend_pool as ap
        from ascend_pool import sim
        acl = C.CDLL(sim.library_path())
        acl.aclInit(None)
        assert acl.aclrtSetDevice(0) == 0  # the framework's own reference
        pool = ap.Pool(0, backend="sim", expandable_segments={expandable})
        keep = pool.malloc(1 << 20)
        refs_before = sim.stats(0)["device_refs"]
        assert acl.{reset} == 0            # the pool's reference goes too: the context is released
        acl.aclrtSetDevice(0)              # the framework carries on: a new default context
        grown = pool.malloc(30 << 20)      # a growth: a device call in the new context
        fresh = ap.Pool(0, backend="sim", expandable_segments={expandable})
        fresh.free(fresh.malloc(30 << 20))
        fresh.close()
        pool.free(grown)
        pool.free(keep)
        ooms = pool.memory_stats()["num_ooms"]
        pool.close()
        print(json.dumps({{"ooms": ooms, "refs_before": refs_before, "refs_after": sim.stats(0)["device_refs"]}}))
    """)
    assert out["ooms"] == 0
    assert out["refs_before"] == 2 and out["refs_after"] == 1, out


@pytest.mark.parametrize("expandable", [False, True], ids=["classic", "expandable"])
def test_threads_on_two_devices_renew_their_contexts_once_each(sim_node, expandable):
    """Forced resets of both devices under four threads (two per device), each with a pool of its
    own, that use their pools before and after it, as a framework's workers do (each sets its
    device again after the reset, as it must for its own work): every thread carries on, the two
    pools' references on each device are taken again exactly once although both find the dead
    context at about the same time, and after close each device holds only the references the
    framework's threads took."""
    out = sim_node.run_json(f"        EXPANDABLE = {expandable}\n" + """
        import ascend_pool as ap
        from ascend_pool import sim
        acl = C.CDLL(sim.library_path())
        acl.aclInit(None)
        pools = {(d, k): ap.Pool(d, backend="sim", expandable_segments=EXPANDABLE) for d in (0, 1) for k in (0, 1)}
        before, after_reset, errors, done = threading.Barrier(5), threading.Barrier(5), [], []

        def worker(d, k):
            pool = pools[(d, k)]
            acl.aclrtSetDevice(d)
            pool.free(pool.malloc(12 << 20))
            before.wait()                         # the main thread force-resets both devices
            after_reset.wait()
            acl.aclrtSetDevice(d)                 # a live context for the worker's own work
            try:
                for i in range(20):
                    p = pool.malloc((12 + i % 5) << 20)   # growths: device calls each time
                    pool.free(p)
                    pool.empty_cache()
                done.append(d)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))

        threads = [threading.Thread(target=worker, args=(d, k)) for d in (0, 1) for k in (0, 1)]
        for t in threads:
            t.start()
        before.wait()
        for d in (0, 1):
            assert acl.aclrtResetDeviceForce(d) == 0
        after_reset.wait()
        for t in threads:
            t.join()
        during = [sim.stats(d)["device_refs"] for d in (0, 1)]
        for p in pools.values():
            p.close()
        after = [sim.stats(d)["device_refs"] for d in (0, 1)]
        print(json.dumps({"errors": errors, "done": sorted(done), "during": during, "after": after}))
    """, timeout=60)
    assert out["errors"] == [] and out["done"] == [0, 0, 1, 1], out
    assert out["during"] == [4, 4], out  # the two workers' aclrtSetDevice + the two pools', taken again once
    assert out["after"] == [2, 2], out


def test_a_dropped_pool_whose_close_fails_is_forgotten_and_the_others_are_still_reaped(caplog):
    # reap_orphans raised out of the pass: the stats publisher's thread hit the same orphan every
    # tick (and stopped publishing), and the orphans after it were never closed.
    from ascend_pool import registry

    class Failing:
        closed, device = False, 0

        def _active_blocks(self):
            return 0

        def _work_queued(self):
            return False

        def _disown_streams(self):
            pass

        def close(self):
            raise RuntimeError("the device went away")

    class Fine(Failing):
        def close(self):
            self.closed = True

    failing, fine = Failing(), Fine()
    registry.keep_orphan(failing)
    registry.keep_orphan(fine)
    try:
        with caplog.at_level("WARNING", logger="ascend_pool"):
            assert registry.reap_orphans() == 2
        assert fine.closed
        assert "closing a dropped pool on device 0 failed" in caplog.text
        assert failing not in registry._orphans and fine not in registry._orphans
    finally:
        registry.forget_orphan(failing)
        registry.forget_orphan(fine)


def test_a_reap_builds_no_dropped_pools_stats(monkeypatch):
    # Each reap built every dropped pool's stats dict (and asked the device's free memory) to read
    # its active blocks, 16 us a pool: a process with 1,000 dropped pools still holding a block
    # paid 32 ms at each module-level free, pool open and empty_cache (bench/reap_orphans.py).
    import gc

    import ascend_pool as ap
    from ascend_pool import registry

    blocks = []
    for _ in range(20):
        q = ap.Pool(0, backend="sim")
        blocks.append(q.malloc(512))
        del q
    # The stats thread may hold a pool while it reads the pools' stats: that pool is dropped (and
    # becomes an orphan) when the stats thread lets go of it.
    deadline = time.monotonic() + 10
    while True:
        gc.collect()
        dropped = [p for p in registry._orphans if not p.closed]
        if len(dropped) >= 20 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert len(dropped) >= 20
    calls = []
    real = ap.Pool._raw_stats
    me = threading.get_ident()  # this thread's reap only: the stats thread reads pools' stats meanwhile

    def counted(self, *a, **k):
        if threading.get_ident() == me:
            calls.append(self)
        return real(self, *a, **k)

    monkeypatch.setattr(ap.Pool, "_raw_stats", counted)
    try:
        assert registry.reap_orphans() == 0  # each still holds its block
        assert calls == []
    finally:
        for ptr in blocks:
            ap.free(ptr)  # the module-level free finds each block's dropped pool
    registry.reap_orphans(wait=True)  # (the stats thread may be reaping: wait for it, as empty_cache does)
    assert all(p.closed for p in dropped)  # reaped once their blocks were freed, as before


def test_a_pool_collected_in_a_garbage_cycle_keeps_its_backend_until_it_is_destroyed(sim_node):
    """An open pool of a Backend object only it holds, in a reference cycle, collected with a block
    still allocated (its pool lives on as an orphan to the interpreter's teardown). The
    collector's clearing of the pool (Cython's tp_clear) dropped its Backend first, freed, and the
    pool's destruction then read it (ap_pool_destroy_ex -> ap_backend_life): the process crashed
    at exit (SIGSEGV; MALLOC_PERTURB_ makes the freed memory garbage at once, as reuse would)."""
    out = sim_node.run("""
        import gc
        import ascend_pool as ap
        from ascend_pool._core import Backend

        pool = ap.Pool(0, backend=Backend("sim"))
        live = pool.malloc(1 << 20)
        pool.cycle = pool
        del pool
        gc.collect()
        print("collected", flush=True)
    """, PYTHONMALLOC="malloc", MALLOC_PERTURB_="204")
    assert "collected" in out

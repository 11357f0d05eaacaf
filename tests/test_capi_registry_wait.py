"""The C ABI's registry lock is never held over a free that waits (pool.h's lock table).

ascend_pool_free of a block that another pool of the device made (allocated while a tenant
context was current) finds that pool under the registry lock. The free itself may wait for a
stream, under that pool's lock, when no event can be had (the one wait the lock table allows
there, rare). Before, the registry lock was held through that wait too, so opening or closing any
other pool of the process (both take the registry lock, with the GIL held) stalled until the
stream's work was done: 1.7 s of a 2 s wait here, the whole interpreter frozen with it. Now the
owner is held (capi_calls) and the lock dropped before the free."""

import subprocess
import sys
import textwrap

import pytest

sys.path.insert(0, __import__("os").path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401

SCRIPT = textwrap.dedent("""
    import ctypes, threading, time
    import ascend_pool as ap
    from ascend_pool import sim
    lib = ctypes.CDLL(ap.library_path())
    lib.ascend_pool_malloc.restype = ctypes.c_void_p
    lib.ascend_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ascend_pool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    ap.default_pool(0)
    ctx = ap.default_pool(0).context("t")
    s1, s2 = ctx.create_stream(), ctx.create_stream()
    n = 1 << 20
    with ctx:
        ptr = lib.ascend_pool_malloc(n, 0, s1)   # the context's block, through the C ABI
    ctx.record_stream(ptr, s2)
    sim.launch_fill(s2, ptr, n, 7, delay_s=6.0)  # s2 busy for 6 s: the rest of it tells a wait from load
    sim.set_faults(fail_event_create_nth=1)      # no event for the free: it waits for s2
    t0 = time.monotonic()
    t = threading.Thread(target=lib.ascend_pool_free, args=(ptr, n, 0, None))  # ctypes: GIL released
    t.start()
    time.sleep(0.3)
    a = time.monotonic()
    other = ap.Pool(0)                           # the registry lock, with the GIL held
    other.close()
    b = time.monotonic()
    t.join()
    print(round(time.monotonic() - t0, 2), round(b - a, 2), ctx.memory_stats()["allocated_bytes.all.current"])
""")


@pytest.mark.parametrize("stats", ["0", "1"])
def test_opening_a_pool_while_a_c_abi_free_waits_for_a_stream_does_not_wait_with_it(sim_node, tmp_path, stats):
    # stats "1": the publisher's thread reads every pool each 0.1 s, so it waits on the context's
    # lock through the free's wait; it did so holding the metrics aggregator's lock, which each
    # pool's close takes (registry.closing): the other pool's close waited 2.7 s (frame17 5).
    env = sim_node.env(ASCEND_POOL_BACKEND="sim", ASCEND_POOL_STATS=stats, ASCEND_POOL_STATS_INTERVAL="0.1",
                       ASCEND_POOL_STATS_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    free_s, open_s, left = r.stdout.split()
    assert float(free_s) >= 5.5, r.stdout  # the free did wait for the stream (the scenario holds)
    assert int(left) == 0, r.stdout        # and freed the block
    assert float(open_s) < 3.0, r.stdout   # before: the rest of the wait (about 5.7 s); room for load


LOOKUP_SCRIPT = textwrap.dedent("""
    import ctypes, sys, threading, time
    import ascend_pool as ap
    from ascend_pool import sim
    lib = ctypes.CDLL(ap.library_path())
    lib.ascend_pool_malloc.restype = ctypes.c_void_p
    lib.ascend_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ascend_pool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ascend_pool_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.ascend_pool_base_alloc.restype = ctypes.c_void_p
    lib.ascend_pool_base_alloc.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
    pool = ap.default_pool(0)
    s1, s2 = pool.create_stream(), pool.create_stream()
    n = 1 << 20
    ptr, other = lib.ascend_pool_malloc(n, 0, s1), lib.ascend_pool_malloc(n, 0, s1)
    lib.ascend_pool_record_stream(ptr, s2)
    sim.launch_fill(s2, ptr, n, 7, delay_s=6.0)  # s2 busy for 6 s: the rest of it tells a wait from load
    sim.set_faults(fail_event_create_nth=1)      # no event for the free: it waits for s2, pool lock held
    t0 = time.monotonic()
    t = threading.Thread(target=lib.ascend_pool_free, args=(ptr, n, 0, None))
    t.start()
    time.sleep(0.3)
    size = ctypes.c_size_t()
    lookup = {"record_stream": lambda: lib.ascend_pool_record_stream(other, s2),
              "base_alloc": lambda: lib.ascend_pool_base_alloc(other, ctypes.byref(size))}[sys.argv[1]]
    r = threading.Thread(target=lookup)          # a framework thread's lookup (ctypes: GIL released)
    r.start()
    time.sleep(0.2)
    a = time.monotonic()
    q = ap.Pool(0)                               # the registry lock, with the GIL held
    q.close()
    b = time.monotonic()
    t.join(); r.join()
    print(round(time.monotonic() - t0, 2), round(b - a, 2), size.value, pool.memory_stats()["allocation.all.current"])
""")


@pytest.mark.parametrize("lookup", ["record_stream", "base_alloc"])
def test_a_c_abi_lookup_never_waits_for_a_pool_lock_under_the_registry_lock(sim_node, lookup):
    # ascend_pool_record_stream and ascend_pool_base_alloc find a pointer's pool under the registry
    # lock; asking each pool took its lock there. A pool whose free waited for a stream under its
    # lock (no event to be had) held the lookup, and with it the registry lock: opening and closing
    # another pool waited 2.5 s of the 3 s, GIL held (frame17 6). Now the candidates are held
    # (capi_calls) under the registry lock and asked after it is dropped.
    env = sim_node.env(ASCEND_POOL_BACKEND="sim", ASCEND_POOL_STATS="0")
    r = subprocess.run([sys.executable, "-c", LOOKUP_SCRIPT, lookup], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    free_s, open_s, size, left = r.stdout.split()
    assert float(free_s) >= 5.5, r.stdout   # the free did wait for the stream (the scenario holds)
    assert float(open_s) < 3.0, r.stdout    # before: the rest of the wait (about 5.5 s); room for load
    assert int(left) == 1, r.stdout         # the waiting free freed its block; `other` is live
    assert (int(size) >= 1 << 20) == (lookup == "base_alloc"), r.stdout  # base_alloc found the segment

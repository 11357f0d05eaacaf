"""Concurrency stress: 8 threads making thousands of random allocations, frees, cross-stream frees
and record_stream calls at once, across several streams and tenant contexts. Each allocation is
filled with its own byte pattern by the simulator's stream workers (asynchronously, sometimes
after a delay) and read back before its free: a block handed out twice (overlap) or reused while
an earlier stream's work still writes it (use-after-free) shows up as a wrong byte. At the end
every pool is empty, and after empty_cache and close the simulator holds what it held before,
with no event left alive.

The Python API runs its slow paths and every simulator call with the GIL released; a second
variant calls the C ABI through ctypes (which releases the GIL around each call), with threads
in different tenant contexts (`with ctx:` makes a context current for the C ABI).
Sizes are bytes; KiB = 1 << 10, MiB = 1 << 20."""

import ctypes
import random
import threading
import time

import pytest

import ascend_pool as ap
from ascend_pool import sim

KiB, MiB = 1 << 10, 1 << 20
THREADS = 8
OPS = 1500  # per thread
SIZES = [1, 100, 512, 4 * KiB, 20 * KiB, 64 * KiB, 200 * KiB, 1 * MiB, 3 * MiB]
COUNTS = {"ops": 0, "allocations": 0, "verified": 0, "cross_stream": 0, "record_stream": 0}


@pytest.fixture(autouse=True)
def own_ledger_dir(tmp_path, monkeypatch, clean_faults):
    monkeypatch.setenv("ASCEND_POOL_LEDGER_DIR", str(tmp_path))


class Corruption(AssertionError):
    pass


def verify(ptr, n, value, what):
    data = sim.read(ptr, n)
    if data != bytes([value]) * n:
        bad = next(i for i, b in enumerate(data) if b != value)
        raise Corruption(f"{what}: block {ptr:#x} ({n} B) holds {data[bad]:#04x} at +{bad}, expected "
                         f"{value:#04x} (overlap or use-after-free)")


def run_threads(worker, n=THREADS):
    errors = []
    acl = ctypes.CDLL(sim.library_path())  # the runtime the pool uses (one dlopen handle)

    def guarded(i):
        try:
            assert acl.aclrtSetDevice(0) == 0  # the default stream of a thread is its device's
            worker(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
        assert not t.is_alive(), "a stress thread hung"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("expandable", [False, True], ids=["classic", "expandable"])
def test_threads_streams_and_contexts_never_corrupt(expandable):
    held0, events0 = sim.stats(0)["bytes_held"], sim.stats(0)["live_events"]
    knobs = {"expandable_segments": True} if expandable else {}
    base = ap.Pool(0, backend="sim", **knobs)
    pools = [base, base.context("rel-stress-a", quota="256MiB"), base.context("rel-stress-b")]
    streams = [base.create_stream() for _ in range(4)]
    for p in pools[1:]:
        for s in streams:
            p.register_stream(s)
    counts = [dict(ops=0, allocations=0, verified=0, cross_stream=0, record_stream=0, quota=0)
              for _ in range(THREADS)]

    def worker(tid):
        rnd = random.Random(1000 + tid)
        c = counts[tid]
        live = []  # (pool, ptr, n, stream, value)
        serial = 0

        def retire(entry, free_stream=None, other=None):
            pool, ptr, n, s, value = entry
            pool.synchronize(s)                      # the fill has run
            verify(ptr, n, value, f"thread {tid}")
            c["verified"] += 1
            if other is not None:
                # another stream still writes the block (the same bytes) when it is freed
                sim.launch_fill(other, ptr, n, value, delay_s=rnd.random() * 0.0005)
                pool.record_stream(ptr, other)
                c["record_stream"] += 1
            pool.free(ptr, stream=free_stream)
            if free_stream is not None:
                c["cross_stream"] += 1

        for _ in range(OPS):
            c["ops"] += 1
            if live and (len(live) >= 12 or rnd.random() < 0.45):
                entry = live.pop(rnd.randrange(len(live)))
                r = rnd.random()
                if r < 0.2:
                    retire(entry, free_stream=rnd.choice(streams))
                elif r < 0.35:
                    retire(entry, other=rnd.choice(streams))
                else:
                    retire(entry)
            else:
                pool = rnd.choice(pools)
                n = rnd.choice(SIZES) + rnd.randrange(0, 512)
                s = rnd.choice(streams + [None])
                try:
                    ptr = pool.malloc(n, stream=s)
                except ap.QuotaExceededError:
                    c["quota"] += 1
                    continue
                serial += 1
                value = (tid * 37 + serial) % 254 + 1
                # fill on the allocation's stream, sometimes after a delay: the stream is still
                # writing when other threads allocate and free around it
                delay = rnd.random() * 0.0005 if rnd.random() < 0.1 else 0.0
                sim.launch_fill(s, ptr, n, value, delay_s=delay)
                live.append((pool, ptr, n, s, value))
                c["allocations"] += 1
        for entry in live:
            retire(entry)

    try:
        run_threads(worker)
        for p in pools:
            st = p.memory_stats()
            assert st["allocation.all.current"] == 0 and st["allocated_bytes.all.current"] == 0
            assert st["requested_bytes.all.current"] == 0
            for s in streams:
                p.synchronize(s)
            p.empty_cache()
            assert p.memory_stats()["reserved_bytes.all.current"] == 0
        assert sim.stats(0)["bytes_held"] == held0, "device memory leaked"
    finally:
        for s in streams:
            base.destroy_stream(s)
        for p in reversed(pools):
            p.close()
    after = sim.stats(0)
    assert after["bytes_held"] == held0 and after["live_events"] == events0, "leak after close"
    total = {k: sum(c[k] for c in counts) for k in counts[0]}
    assert total["ops"] == THREADS * OPS and total["verified"] == total["allocations"]
    assert total["cross_stream"] > 100 and total["record_stream"] > 100
    for k in COUNTS:
        COUNTS[k] += total[k]
    print(f"\nstress ({'expandable' if expandable else 'classic'}):", total)


def test_close_while_other_threads_allocate_is_refused_cleanly():
    """Closing a pool while threads are inside its calls (device calls made slow): each call
    finishes or raises PoolError("... closed"), never a crash, and the device gets every byte
    back."""
    held0 = sim.stats(0)["bytes_held"]
    sim.set_faults(malloc_latency_us=300, free_latency_us=100)  # keep the threads inside device calls
    closed = ok = 0
    try:
        for _ in range(5):
            pool = ap.Pool(0, backend="sim", release_policy="never")
            outcomes = []

            def worker(tid):
                rnd = random.Random(tid)
                while True:
                    try:
                        p = pool.malloc(rnd.choice([3 * MiB, 5 * MiB, 700 * KiB]))
                        pool.free(p)
                        pool.empty_cache()
                        outcomes.append("ok")
                    except ap.PoolError as e:
                        assert "closed" in str(e), f"{type(e).__name__}: {e}"
                        outcomes.append("closed")
                        return

            failures = []

            def run():
                try:
                    run_threads(worker, 4)
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    failures.append(e)

            t = threading.Thread(target=run)
            t.start()
            time.sleep(0.02)
            pool.close()
            t.join(timeout=60)
            assert not t.is_alive(), "threads hung after close()"
            if failures:
                raise failures[0]
            assert sim.stats(0)["bytes_held"] == held0, "close() with calls in flight leaked device memory"
            closed += outcomes.count("closed")
            ok += outcomes.count("ok")
    finally:
        sim.reset_faults()
    assert closed == 20 and ok > 0, (closed, ok)


def _capi():
    lib = ctypes.CDLL(ap.library_path())
    lib.ascend_pool_malloc.restype = ctypes.c_void_p
    lib.ascend_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ascend_pool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ascend_pool_free.restype = None
    lib.ascend_pool_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.ascend_pool_record_stream.restype = None
    lib.ascend_pool_last_error.restype = ctypes.c_char_p
    return lib


def test_c_abi_threads_streams_and_contexts_never_corrupt():
    """The same stress through the exported C functions, called via ctypes with the GIL released:
    threads 0-1 on the default pool, 2-4 in tenant context A, 5-7 in context B; frees on other
    streams and from other threads' contexts' blocks go through ascend_pool_free's lookup."""
    lib = _capi()
    default = ap.default_pool(0)
    default.empty_cache()
    held0 = sim.stats(0)["bytes_held"] - default.memory_stats()["reserved_bytes.all.current"]
    base_alloc0 = default.memory_stats()["allocation.all.current"]
    ctxs = [default.context("rel-capi-a", quota="512MiB"), default.context("rel-capi-b")]
    streams = [default.create_stream() for _ in range(3)]
    for p in ctxs:
        for s in streams:
            p.register_stream(s)
    counts = [dict(ops=0, allocations=0, verified=0, cross_stream=0, record_stream=0) for _ in range(THREADS)]
    handoff = []          # blocks one thread allocated and another frees (C ABI finds the owner)
    handoff_lock = threading.Lock()

    def worker(tid):
        rnd = random.Random(7000 + tid)
        c = counts[tid]
        ctx = None if tid < 2 else ctxs[0] if tid < 5 else ctxs[1]
        live = []

        def retire(ptr, n, s, value):
            default.synchronize(s)  # the fill on the allocation's stream has run
            verify(ptr, n, value, f"C ABI thread {tid}")
            c["verified"] += 1
            r = rnd.random()
            if r < 0.2:
                other = rnd.choice(streams)
                sim.launch_fill(other, ptr, n, value, delay_s=rnd.random() * 0.0003)
                lib.ascend_pool_record_stream(ptr, other)
                c["record_stream"] += 1
                lib.ascend_pool_free(ptr, n, 0, s)
            elif r < 0.4:
                lib.ascend_pool_free(ptr, n, 0, rnd.choice(streams))
                c["cross_stream"] += 1
            else:
                lib.ascend_pool_free(ptr, n, 0, s)

        def body():
            for _ in range(OPS):
                c["ops"] += 1
                if live and (len(live) >= 12 or rnd.random() < 0.45):
                    entry = live.pop(rnd.randrange(len(live)))
                    if rnd.random() < 0.1:
                        with handoff_lock:
                            handoff.append(entry)   # some other thread frees it
                    else:
                        retire(*entry)
                    with handoff_lock:
                        theirs = handoff.pop() if handoff and rnd.random() < 0.5 else None
                    if theirs:
                        retire(*theirs)
                else:
                    n = rnd.choice(SIZES) + rnd.randrange(0, 512)
                    s = rnd.choice(streams + [None])
                    ptr = lib.ascend_pool_malloc(n, 0, s)
                    if not ptr:
                        code = lib.ascend_pool_last_error_code()
                        assert code == 10, (code, lib.ascend_pool_last_error())  # quota only
                        continue
                    value = (tid * 41 + c["allocations"]) % 254 + 1
                    sim.launch_fill(s, ptr, n, value)
                    live.append((ptr, n, s, value))
                    c["allocations"] += 1
            for entry in live:
                retire(*entry)

        if ctx is None:
            body()
        else:
            with ctx:
                body()

    try:
        run_threads(worker)
        for entry in handoff:
            ptr, n, s, value = entry
            default.synchronize(s)
            verify(ptr, n, value, "handoff")
            counts[0]["verified"] += 1
            lib.ascend_pool_free(ptr, n, 0, s)
        assert default.memory_stats()["allocation.all.current"] == base_alloc0
        for p in ctxs:
            assert p.memory_stats()["allocated_bytes.all.current"] == 0
        for p in ctxs:
            for s in streams:
                p.synchronize(s)
            p.empty_cache()
            assert p.memory_stats()["reserved_bytes.all.current"] == 0
    finally:
        for s in streams:
            default.destroy_stream(s)
        for p in ctxs:
            p.close()
    default.empty_cache()
    assert sim.stats(0)["bytes_held"] - default.memory_stats()["reserved_bytes.all.current"] == held0, \
        "device memory leaked"
    total = {k: sum(c[k] for c in counts) for k in counts[0]}
    assert total["verified"] == total["allocations"]
    for k in COUNTS:
        COUNTS[k] += total[k]
    print("\nstress (C ABI):", total)

"""Fault matrix on the simulated NPU. Every injected fault ends in a successful retry or a typed
error, with consistent stats, no corrupted data and no leak:

- device malloc failing at every point of a bundled replay: for each N from 1 to the number of
  device mallocs the replay makes, the Nth fails once (fail_malloc_nth=N), in the classic and the
  expandable mode;
- event creation and event query failing at every point of a workload of cross-stream frees
  (record_stream, frees ordered on other streams, borrowing across streams), the data checked
  with per-allocation patterns;
- slow device malloc and free (latency), single-threaded replay and threads.

After each run the simulator holds exactly the bytes, events and streams it held before.
Sizes are bytes; KiB = 1 << 10, MiB = 1 << 20."""

import ctypes
import random
import threading

import pytest

import ascend_pool as ap
from ascend_pool import sim
from ascend_pool.replay import replay
from ascend_pool.traces import bundled_traces_dir, load_trace

KiB, MiB = 1 << 10, 1 << 20
COUNTS = {"malloc_faults": 0, "retried": 0, "typed_oom": 0, "event_create_faults": 0, "event_query_faults": 0,
          "latency_runs": 0}


@pytest.fixture(autouse=True)
def faults(clean_faults):
    return clean_faults


def device_state():
    """(bytes held, live events, live streams) on device 0 (the default stream counts once it
    exists: take the baseline after the first pool has used it)."""
    s = sim.stats(0)
    return s["bytes_held"], s["live_events"], s["live_streams"]


# -- device malloc failing at every point of a replay --------------------------------------------

TRACES = ["resnet18_train_prefetch_2stream_prefix"]


@pytest.mark.parametrize("expandable", [False, True], ids=["classic", "expandable"])
@pytest.mark.parametrize("name", TRACES)
def test_device_malloc_failing_at_every_point_of_a_replay(name, expandable):
    trace = load_trace(bundled_traces_dir() / f"{name}.npz")
    knobs = {"expandable_segments": True} if expandable else {}
    clean = replay(trace, backend="sim", pool_knobs=knobs)  # also creates the default stream
    before = device_state()
    n_device = clean["device_mallocs"]
    assert n_device > 10 and clean["final_allocated_bytes"] == 0
    outcomes = {"retried": 0, "oom": 0}
    for n in range(1, n_device + 1):
        sim.set_faults(fail_malloc_nth=n)
        try:
            r = replay(trace, backend="sim", pool_knobs=knobs)
        except ap.OutOfMemoryError as e:
            assert not isinstance(e, ap.QuotaExceededError)
            assert "out of" in str(e)
            outcomes["oom"] += 1
        else:
            st = r["pool_stats"]
            assert r["allocs"] == trace.n_allocs and r["frees"] == trace.n_frees
            assert r["final_allocated_bytes"] == 0
            assert st["allocation.all.current"] == 0 and st["allocated_bytes.all.current"] == 0
            assert st["requested_bytes.all.current"] == 0
            assert st["num_alloc_retries"] >= 1, f"fault {n} of {n_device} fired but no retry was counted"
            assert st["allocation.all.allocated"] == trace.n_allocs
            assert r["device_mallocs"] > 0
            outcomes["retried"] += 1
        finally:
            sim.reset_faults()
        assert device_state() == before, f"leak after fault {n} of {n_device}"
    assert outcomes["retried"] + outcomes["oom"] == n_device
    assert outcomes["retried"] > 0
    COUNTS["malloc_faults"] += n_device
    COUNTS["retried"] += outcomes["retried"]
    COUNTS["typed_oom"] += outcomes["oom"]


def test_persistent_device_failure_is_a_typed_error_and_the_pool_recovers(pool, peers_idle_released):
    """Not a one-shot fault: the device refuses everything past a byte cap (fail_after_bytes)."""
    held0 = sim.stats(0)["bytes_held"]
    sim.set_faults(fail_after_bytes=held0 + 8 * MiB)
    live = [pool.malloc(3 * MiB), pool.malloc(3 * MiB)]  # 4 + 4 MiB segments: at the cap
    with pytest.raises(ap.OutOfMemoryError) as info:
        pool.malloc(3 * MiB)
    assert "out of device memory" in str(info.value)
    st = pool.memory_stats()
    assert st["allocation.all.current"] == 2 and st["num_ooms"] == 1
    pool.free(live.pop())
    live.append(pool.malloc(3 * MiB))  # the cached segment serves it
    sim.reset_faults()
    live.append(pool.malloc(3 * MiB))
    for p in live:
        pool.free(p)
    pool.empty_cache()
    assert sim.stats(0)["bytes_held"] == held0


# -- event creation / query failing during cross-stream frees -------------------------------------

class Probe:
    """Tells whether an armed one-shot event fault already fired, by making the same calls
    directly through the runtime until one fails (a fault not yet fired fires within the armed
    count of calls)."""

    def __init__(self):
        lib = ctypes.CDLL(sim.library_path())
        for fn in ("aclrtCreateEvent", "aclrtDestroyEvent", "aclrtQueryEventStatus", "aclrtRecordEvent",
                   "aclrtSynchronizeEvent", "aclrtSetDevice", "aclrtResetDevice"):
            getattr(lib, fn).restype = ctypes.c_int
        self.lib = lib

    def fired(self, kind, n):
        # The calls need a current device, which the pool never gives the calling thread (it
        # did, as a side effect of reading its figures): chosen here, as a framework's thread does.
        assert self.lib.aclrtSetDevice(0) == 0
        try:
            return self._fired(kind, n)
        finally:
            self.lib.aclrtResetDevice(0)

    def _fired(self, kind, n):
        lib = self.lib
        ev = ctypes.c_void_p()
        if kind == "fail_event_create_nth":
            for _ in range(n):
                if lib.aclrtCreateEvent(ctypes.byref(ev)) != 0:
                    return False
                lib.aclrtDestroyEvent(ev)
            return True
        assert lib.aclrtCreateEvent(ctypes.byref(ev)) == 0
        try:
            assert lib.aclrtRecordEvent(ev, None) == 0
            assert lib.aclrtSynchronizeEvent(ev) == 0
            status = ctypes.c_int()
            for _ in range(n):
                if lib.aclrtQueryEventStatus(ev, ctypes.byref(status)) != 0:
                    return False
            return True
        finally:
            lib.aclrtDestroyEvent(ev)


def cross_stream_workload(pool, streams, seed, steps=60, delay=0.0003):
    """Allocations filled on their stream, used by other streams (record_stream, delayed fills),
    freed on their own or another stream, reallocated on others (borrowing). Returns the typed
    errors met; raises AssertionError on corrupted data."""
    rnd = random.Random(seed)
    live = []  # (ptr, n, stream, value)
    errors = []
    for step in range(steps):
        if live and rnd.random() < 0.5:
            ptr, n, s, value = live.pop(rnd.randrange(len(live)))
            pool.synchronize(s)
            assert sim.read(ptr, n) == bytes([value]) * n, f"block {ptr:#x} corrupted (step {step})"
            try:
                if rnd.random() < 0.5:
                    other = rnd.choice([x for x in streams if x != s])
                    sim.launch_fill(other, ptr, n, value, delay_s=rnd.random() * delay)
                    pool.record_stream(ptr, other)
                pool.free(ptr, stream=rnd.choice([None, rnd.choice(streams)]))
            except ap.PoolError as e:
                errors.append(e)
                if pool.block_info(ptr) is not None:  # still live: the caller may free it later
                    live.append((ptr, n, s, value))
        else:
            s = rnd.choice(streams)
            n = rnd.choice([4 * KiB, 64 * KiB, 3 * MiB])
            try:
                ptr = pool.malloc(n, stream=s)
            except ap.PoolError as e:
                errors.append(e)
                continue
            value = step % 250 + 1
            sim.launch_fill(s, ptr, n, value, delay_s=rnd.random() * delay if rnd.random() < 0.3 else 0.0)
            live.append((ptr, n, s, value))
    return live, errors


@pytest.mark.parametrize("kind, steps, delay, cap", [
    ("fail_event_create_nth", 100, 0.002, 100),  # events are pooled: few creations, make them overlap
    ("fail_event_query_nth", 60, 0.0005, 60),    # queries are many: the first 60 of them
])
def test_event_faults_at_every_point_of_cross_stream_frees(kind, steps, delay, cap):
    probe = Probe()
    probe.fired(kind, 1)  # (nothing armed) creates the default stream the probe uses
    before = device_state()
    fired = not_fired_in_a_row = 0
    typed = 0
    n = 0
    while not_fired_in_a_row < 3 and n < cap:
        n += 1
        pool = ap.Pool(0, backend="sim", stream_reuse="borrow")
        streams = [pool.create_stream() for _ in range(4)]
        sim.set_faults(**{kind: n})
        try:
            live, errors = cross_stream_workload(pool, streams, seed=n, steps=steps, delay=delay)
            for e in errors:
                assert isinstance(e, ap.DeviceError), f"untyped or unexpected error: {type(e).__name__}: {e}"
            typed += len(errors)
        finally:
            hit = probe.fired(kind, n)
            sim.reset_faults()
        fired += hit
        not_fired_in_a_row = 0 if hit else not_fired_in_a_row + 1
        # everything still live is intact and can be freed; the pool ends empty and consistent
        for ptr, size, s, value in live:
            pool.synchronize(s)
            assert sim.read(ptr, size) == bytes([value]) * size
            pool.free(ptr)
        for s in streams:
            pool.synchronize(s)
        st = pool.memory_stats()
        assert st["allocation.all.current"] == 0 and st["allocated_bytes.all.current"] == 0
        for s in streams:
            pool.destroy_stream(s)
        pool.empty_cache()
        assert pool.memory_stats()["reserved_bytes.all.current"] == 0
        pool.close()
        assert device_state() == before, f"leak after {kind}={n}"
    assert fired >= 3, f"only {fired} {kind} faults fired: the workload makes too few event calls"
    COUNTS["event_create_faults" if kind == "fail_event_create_nth" else "event_query_faults"] += fired
    print(f"\n{kind}: {fired} faults fired in {n} runs, {typed} typed errors")


# -- slow device calls ------------------------------------------------------------------------------

def test_slow_device_malloc_and_free_replay_correctly():
    trace = load_trace(bundled_traces_dir() / "resnet18_train_prefetch_2stream_prefix.npz")
    fast = replay(trace, backend="sim")
    before = device_state()
    sim.set_faults(malloc_latency_us=400, free_latency_us=200)
    try:
        slow = replay(trace, backend="sim")
    finally:
        sim.reset_faults()
    assert slow["final_allocated_bytes"] == 0 and slow["allocs"] == fast["allocs"]
    assert slow["device_mallocs"] == fast["device_mallocs"], "latency must not change the pool's decisions"
    assert slow["peak_reserved_bytes"] == fast["peak_reserved_bytes"]
    assert slow["seconds"] > fast["seconds"]
    assert device_state() == before
    COUNTS["latency_runs"] += 1


def test_slow_device_calls_under_threads_keep_data_intact():
    ap.Pool(0, backend="sim").close()
    before = device_state()
    sim.set_faults(malloc_latency_us=500, free_latency_us=300)
    acl = ctypes.CDLL(sim.library_path())
    pool = ap.Pool(0, backend="sim", release_policy="under_peak")
    streams = [pool.create_stream() for _ in range(2)]
    errors = []

    def worker(tid):
        try:
            assert acl.aclrtSetDevice(0) == 0
            live, errs = cross_stream_workload(pool, streams, seed=100 + tid, steps=120)
            assert not errs, errs[:3]
            for ptr, n, s, value in live:
                pool.synchronize(s)
                assert sim.read(ptr, n) == bytes([value]) * n
                pool.free(ptr)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors[0]
        assert pool.memory_stats()["allocation.all.current"] == 0
    finally:
        sim.reset_faults()
        for s in streams:
            pool.destroy_stream(s)
        pool.close()
    assert device_state() == before
    COUNTS["latency_runs"] += 1

"""The operations of test_pool_stateful_knobs.py from 4 threads on 2 simulated devices at once
(threads 0 and 2 on device 0, 1 and 3 on device 1), on shared pools: per device a Pool with
drawn knobs (expandable segments, max_split_size_mb, garbage_collection_threshold, release policy,
cross-stream reuse), a tenant context of it with a quota, and the process's default pool
(module-level calls). Hypothesis draws each thread's program: malloc of boundary sizes (0, tiny,
about 1/2/10/20 MiB, more than the device) on a shared or an own stream, free on the allocating
stream or another, record_stream on a shared stream (perhaps with work still queued there), own
streams created, used and destroyed mid-run, synchronize, empty_cache, the pool's consistency check
and stats read while the others run.

Each thread owns its blocks: every new block is checked against every live block of every thread
on its device (no block handed out twice, no overlap; a block leaves the shared map before its
free, so an address handed out again is never a false alarm), and its bytes are read back before
it is freed. A refusal must be the typed error of its cause. At the end (all threads joined,
everything freed, caches emptied): each pool passes its consistency check with no allocation left
(the default pool back to its count at the start), and each device holds what it held at the
start, with no event left alive.

The schedule is the threads', so a failure may not replay: its message names the operations."""

import os
import threading

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import ascend_pool as ap
from ascend_pool import registry, sim
from ascend_pool.backend import open_backend

MiB = 1 << 20
EDGE = 64
THREADS = 4
DEVICES = (0, 1)
TENANT = "threads-model"
HUGE = 1 << 40

BOUNDARIES = [1 * MiB, 2 * MiB, 10 * MiB, 20 * MiB]
sizes = st.one_of(
    st.just(0),
    st.integers(1, 600),
    st.sampled_from(BOUNDARIES).flatmap(lambda b: st.integers(b - 1100, b + 1100)),
    st.integers(1 * MiB, 12 * MiB),
    st.just(HUGE),
)

ops = st.one_of(
    st.tuples(st.just("malloc"), st.integers(0, 2), sizes, st.integers(0, 3)),
    st.tuples(st.just("malloc"), st.integers(0, 2), sizes, st.integers(0, 3)),
    st.tuples(st.just("free"), st.integers(0, 1 << 16), st.integers(-1, 3)),
    st.tuples(st.just("free"), st.integers(0, 1 << 16), st.integers(-1, 3)),
    st.tuples(st.just("record"), st.integers(0, 1 << 16), st.integers(1, 2), st.booleans()),
    st.tuples(st.just("stream"), st.booleans()),
    st.tuples(st.just("sync"), st.integers(0, 2), st.integers(0, 3)),
    st.tuples(st.just("empty"), st.integers(0, 2)),
    st.tuples(st.just("check"), st.integers(0, 2)),
)
programs = st.lists(st.lists(ops, min_size=15, max_size=40), min_size=THREADS, max_size=THREADS)
knob_sets = st.fixed_dictionaries({}, optional={
    "expandable_segments": st.booleans(),
    "max_split_size_mb": st.sampled_from([21, 64]),
    "garbage_collection_threshold": st.sampled_from([0.3, 0.8]),
    "release_policy": st.sampled_from(["never", "under_peak", "budgeted"]),
    "stream_reuse": st.sampled_from(["borrow", "tied"]),
    "roundup_power2_divisions": st.sampled_from([2, 8]),
    "large_segment_size_mb": st.sampled_from([12, 40]),
}).filter(lambda k: k.get("max_split_size_mb", 1 << 20) >= k.get("large_segment_size_mb", 20))


@pytest.fixture(autouse=True, scope="module")
def own_ledger_dir(module_ledger_dir):
    """The tenant's quota ledger lives in this module's own directory (conftest.module_ledger_dir)."""


class Shared:
    """What the threads share: pools and streams per device, every live block (address ->
    (end, owner thread)) per device, under one lock that no pool call is made under."""

    def __init__(self, knobs, quota):
        self.lock = threading.Lock()
        self.go = threading.Barrier(THREADS)  # the programs start together, to overlap
        self.history = []
        self.live = {d: {} for d in DEVICES}
        self.pools, self.streams = {}, {}
        for d in DEVICES:
            base = ap.Pool(d, backend="sim", **knobs)
            ctx = base.context(TENANT, quota=quota)
            default = ap.default_pool(d)
            streams = [None, base.create_stream(), base.create_stream()]
            for s in streams[1:]:
                ctx.register_stream(s)
                default.register_stream(s)
            self.pools[d] = [base, ctx, default]
            self.streams[d] = streams

    def claim(self, d, ptr, size, who):
        with self.lock:
            live = self.live[d]
            assert ptr not in live, f"device {d}: {ptr:#x} handed to thread {who} while thread {live[ptr][1]} holds it"
            for q, (end, owner) in live.items():
                assert not (q < ptr + size and ptr < end), (
                    f"device {d}: new block [{ptr:#x}, +{size}) of thread {who} overlaps [{q:#x}, {end:#x}) of "
                    f"thread {owner}")
            live[ptr] = (ptr + size, who)
            self.history.append(("claim", d, ptr, ptr + size, who))

    def release(self, d, ptr):
        with self.lock:
            end = self.live[d].pop(ptr)[0]
            self.history.append(("release", d, ptr, end))

    def note(self, *what):
        with self.lock:
            self.history.append(what)

    def history_of(self, d, lo, hi):
        """What touched addresses in [lo, hi) on device d, and the streams made and destroyed."""
        with self.lock:
            return [h for h in self.history if h[0] in ("created", "destroyed") or (h[1] == d and h[2] < hi and lo < h[3])]


class Worker:
    def __init__(self, shared, who, program, knobs):
        self.sh, self.who, self.program, self.knobs = shared, who, program, knobs
        self.d = DEVICES[who % len(DEVICES)]
        self.pools = shared.pools[self.d]
        self.own = []           # streams this thread made (known to all three pools of its device)
        self.blocks = {}        # ptr -> (pool index, size, stream, pattern)
        self.log = []
        self.error = None
        self.serial = who * 1000

    def streams(self):
        return self.sh.streams[self.d] + self.own

    def fill(self, ptr, size, value, stream):
        n = min(size, EDGE)
        sim.launch_fill(stream, ptr, n, value)
        sim.launch_fill(stream, ptr + size - n, n, value)
        self.pools[0].synchronize(stream)

    def check_bytes(self, ptr):
        pi, size, stream, pattern = self.blocks[ptr]
        n = min(size, EDGE)
        want = bytes([pattern]) * n
        head, tail = sim.read(ptr, n), sim.read(ptr + size - n, n)
        assert head == want and tail == want, (
            f"thread {self.who}: live block {ptr:#x} ({size} B, pool {pi}, stream {stream}) holds "
            f"{head[:8].hex()}..{tail[-8:].hex()}, expected {pattern:#04x}; history: "
            f"{self.sh.history_of(self.d, ptr, ptr + size)[-40:]}")

    def malloc(self, pi, size, si):
        pool = self.pools[pi]
        streams = self.streams()
        stream = streams[si % len(streams)]
        try:
            ptr = ap.malloc(size, stream=stream, device=self.d) if pi == 2 else pool.malloc(size, stream=stream)
        except ap.InvalidSizeError:
            assert size == 0, f"{size} bytes refused as an invalid size"
            return
        except ap.QuotaExceededError as e:
            assert pi == 1, f"a pool without a quota refused on quota grounds: {e}"
            return
        except ap.OutOfMemoryError as e:
            assert size == HUGE, f"{size} bytes refused on a device with gigabytes free: {e}"
            return
        assert size > 0
        base, bsize, req = pool.block_info(ptr)
        assert base == ptr and req == size and bsize >= pool.round_size(size)
        self.sh.claim(self.d, ptr, bsize, self.who)
        self.serial += 1
        pattern = self.serial % 200 + 1
        self.blocks[ptr] = (pi, size, stream, pattern)
        self.sh.note("malloc", self.d, ptr, ptr + bsize, self.who, pi, stream, pattern)
        self.fill(ptr, size, pattern, stream)

    def free(self, pick, si):
        if not self.blocks:
            return
        ptr = sorted(self.blocks)[pick % len(self.blocks)]
        self.check_bytes(ptr)
        pi = self.blocks.pop(ptr)[0]
        streams = self.streams()
        on = None if si < 0 else streams[si % len(streams)]
        self.sh.release(self.d, ptr)  # before the free: the address may be handed out at once
        self.sh.note("free", self.d, ptr, ptr + 1, self.who, pi, on)
        if pi == 2:
            ap.free(ptr, stream=on, device=self.d)
        else:
            self.pools[pi].free(ptr, stream=on)

    def record(self, pick, si, slow):
        if not self.blocks:
            return
        ptr = sorted(self.blocks)[pick % len(self.blocks)]
        pi, size, _, pattern = self.blocks[ptr]
        s = self.sh.streams[self.d][si]
        # The block's bytes rewritten, unchanged, by work queued on s. Not on its allocation stream:
        # record_stream adds nothing there, and a free on another stream promises that the block's
        # work is done or ordered before it (cudaFreeAsync's contract), which the test keeps by
        # synchronizing at allocation.
        if slow and s != self.blocks[ptr][2]:
            sim.launch_fill(s, ptr, min(size, EDGE), pattern, delay_s=0.002)
        self.sh.note("record", self.d, ptr, ptr + 1, self.who, pi, s, slow)
        if pi == 2:
            ap.record_stream(ptr, s, device=self.d)
        else:
            self.pools[pi].record_stream(ptr, s)

    def stream(self, make):
        if make and len(self.own) < 2:
            s = self.pools[0].create_stream()
            self.pools[1].register_stream(s)
            self.pools[2].register_stream(s)
            self.own.append(s)
            self.sh.note("created", self.who, s)
        elif self.own:
            # Destroyed through the base pool, with blocks of it perhaps still live or freed on
            # it: the context and the default pool learn of it only from the runtime.
            s = self.own.pop(0)
            self.pools[0].destroy_stream(s)
            self.sh.note("destroyed", self.who, s)
            for ptr, (pi, size, stream, pattern) in list(self.blocks.items()):
                if stream == s:
                    self.blocks[ptr] = (pi, size, None, pattern)

    def sync(self, pi, si):
        streams = self.streams()
        self.pools[pi].synchronize(streams[si % len(streams)])

    def empty(self, pi):
        ap.empty_cache(device=self.d) if pi == 2 else self.pools[pi].empty_cache()

    def check(self, pi):
        pool = self.pools[pi]
        pool._check_invariants()
        st = pool.memory_stats()
        assert st["reserved_bytes.all.current"] >= st["allocated_bytes.all.current"], st

    def run(self):
        try:
            assert sim.attach().aclrtSetDevice(self.d) == 0
            self.sh.go.wait(30)
            try:
                for op in self.program:
                    self.log.append(op)
                    getattr(self, op[0])(*op[1:])
                self.log.append(("finish",))
                while self.blocks:
                    self.free(0, -1)
                for s in self.own:
                    self.pools[0].destroy_stream(s)
                self.own.clear()
            finally:
                sim.attach().aclrtResetDevice(self.d)
        except BaseException as e:  # noqa: BLE001  (reported by the main thread)
            self.error = e


@settings(max_examples=30, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(knobs=knob_sets, quota=st.sampled_from([8 * MiB, 40 * MiB, None]), programs=programs)
def test_four_threads_on_two_devices_keep_the_pools_consistent(knobs, quota, programs):
    open_backend("sim")
    registry.reap_orphans()
    start = {}
    for d in DEVICES:
        ap.default_pool(d).empty_cache()
    default_live0 = {d: ap.default_pool(d).memory_stats()["allocation.all.current"] for d in DEVICES}
    for d in DEVICES:
        start[d] = (sim.stats(d)["bytes_held"], sim.stats(d)["live_events"])
    shared = Shared(knobs, quota)
    workers = [Worker(shared, i, programs[i], knobs) for i in range(THREADS)]
    threads = [threading.Thread(target=w.run, name=f"model-{i}") for i, w in enumerate(workers)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
            assert not t.is_alive(), f"{t.name} hung; its last operations: {workers[threads.index(t)].log[-8:]}"
        for w in workers:
            if w.error is not None:
                raise AssertionError(f"thread {w.who} (device {w.d}, knobs {knobs}, quota {quota}) failed after "
                                     f"{w.log[-8:]}: {type(w.error).__name__}: {w.error}") from w.error
        for d in DEVICES:
            assert not shared.live[d], f"device {d}: blocks left in the model: {shared.live[d]}"
            for pi, pool in enumerate(shared.pools[d]):
                pool._check_invariants()
                st = pool.memory_stats()
                want = default_live0[d] if pi == 2 else 0
                assert st["allocation.all.current"] == want, (d, pi, st["allocation.all.current"], want)
    finally:
        for d in DEVICES:
            base, ctx, default = shared.pools[d]
            for s in shared.streams[d][1:]:
                base.synchronize(s)
                base.destroy_stream(s)
            ctx.set_quota(None)
            ctx.close()
            base.close()
            default.empty_cache()
    for d in DEVICES:
        after = sim.stats(d)
        assert (after["bytes_held"], after["live_events"]) == start[d], (
            f"device {d}: (bytes held, live events) {(after['bytes_held'], after['live_events'])} after close, "
            f"{start[d]} at the start (knobs {knobs}, quota {quota})")

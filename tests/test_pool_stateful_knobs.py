"""Stateful property test over the knobs and stream lifecycles that test_reliability_property.py
(one pool and a tenant, default knobs, sizes up to 9 MiB, fixed streams) leaves out: a
hypothesis RuleBasedStateMachine draws one pool's knobs (expandable segments on or off,
max_split_size_mb, garbage_collection_threshold, a memory-fraction limit, the release policy, the
cross-stream reuse, roundup_power2_divisions, a preallocated reserve, large_segment_size_mb), opens a tenant context of it with a quota, and drives them and the process's
default pool of the device (module-level calls) through random sequences of: malloc of sizes at
the boundaries that change the pool's behaviour (0, tiny, about 1 MiB, 2 MiB, 10 MiB, 20 MiB, and
more than the device holds), free on the allocating stream or another one, record_stream, streams
created, used and destroyed mid-run (by any of the pools that know them, with blocks of them still
live), synchronize, empty_cache, a stream's cache emptied, the idle release, limits set and lifted
(a trim), quotas up and down.

After every step, for every pool: its own consistency check (ap_pool_check, cython/core/check.c);
the stats equal the model (allocation count, allocated bytes = the sum of the live blocks, each
its request's round_size or PyTorch's oversize block, requested bytes, reserved = the segments'
bytes >= allocated); no two live blocks of any pool overlap and each lies in its pool's segments; the device holds exactly the pools' segments
(the simulator's bytes_held against the start). Refusals must be the typed error of their cause
(size 0: InvalidSizeError; over the quota: QuotaExceededError, only when the growth needed does not
fit; over a limit or the device: OutOfMemoryError) and change nothing, and the pool goes on serving.
At the end, after freeing everything and closing: the device holds what it held at the start, and
no event is left alive.

tests/test_pool_threads_model.py drives the same operations from 4 threads on 2 devices.
Sizes are bytes; MiB = 1 << 20.
"""

import os
import sys

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import ascend_pool as ap
from ascend_pool import registry, sim
from ascend_pool.backend import open_backend
from ascend_pool.units import parse_bytes

sys.path.insert(0, os.path.dirname(__file__))
from snapshot_walk import walk_segments  # noqa: E402

MiB = 1 << 20
PAGE = 2 * MiB
EDGE = 64  # bytes of pattern written at each end of a block (a full fill would cost ms)
TENANT = "stateful-knobs"
QUOTAS = [6 * MiB, 24 * MiB, 48 * MiB, None]

EXAMPLES = 40
STEPS = 40

# The boundaries where the pool changes behaviour: the small pool's 1 MiB (with the 32-byte pad),
# its 2 MiB segment and the large pages, torch_npu's 10 MiB medium bound and 20 MiB medium segment.
BOUNDARIES = [1 * MiB, 2 * MiB, 10 * MiB, 20 * MiB]
sizes = st.one_of(
    st.just(0),                                                     # refused: InvalidSizeError
    st.integers(1, 600),                                            # tiny: one 512-byte block
    st.sampled_from(BOUNDARIES).flatmap(lambda b: st.integers(b - 1100, b + 1100)),
    st.integers(1 * MiB, 24 * MiB),                                 # anywhere in between
    st.sampled_from([1 << 40, 200 * MiB]),                          # more than the device / a limit
)


def growth_bound(pool, nbytes):
    """The most device bytes one request needs to be able to grow a pool (as in
    test_reliability_property.py): a small request one 2 MiB segment, a large one whole pages."""
    r = pool.round_size(nbytes)
    return PAGE if r <= MiB else -(-r // PAGE) * PAGE


@pytest.fixture(autouse=True, scope="module")
def own_ledger_dir(module_ledger_dir):
    """The tenant's quota ledger lives in this module's own directory (conftest.module_ledger_dir)."""


knob_sets = st.fixed_dictionaries({}, optional={
    "expandable_segments": st.booleans(),
    "max_split_size_mb": st.sampled_from([21, 40, 64]),
    "garbage_collection_threshold": st.sampled_from([0.3, 0.8]),
    "memory_fraction": st.sampled_from([0.002, 0.01]),  # 137 MB, 687 MB of the 64 GiB device
    "release_policy": st.sampled_from(["never", "under_peak", "budgeted"]),
    "stream_reuse": st.sampled_from(["borrow", "tied"]),
    "roundup_power2_divisions": st.sampled_from([2, 4, 8]),
    "reserve": st.sampled_from(["24MiB", "64MiB"]),  # preallocated, kept until empty_cache
    "large_segment_size_mb": st.sampled_from([12, 40]),
}).filter(lambda k: k.get("max_split_size_mb", 1 << 20) >= k.get("large_segment_size_mb", 20))


class Live:
    __slots__ = ("pi", "size", "bsize", "stream", "pattern", "recorded")

    def __init__(self, pi, size, bsize, stream, pattern):
        self.pi, self.size, self.bsize, self.stream, self.pattern = pi, size, bsize, stream, pattern
        self.recorded = set()


def block_size_ok(knobs, r, bsize):
    """A block is the request rounded (round_size), except PyTorch's oversize rule: with
    max_split_size set, a request of that size or more keeps its block whole, a cached one of up to
    20 MiB (kLargeBuffer) more or its fresh segment (whole pages or chunks)."""
    if bsize == r:
        return True
    ms = knobs.get("max_split_size_mb")
    return ms is not None and r >= ms * MiB and r < bsize < r + 20 * MiB + PAGE


class KnobsMachine(RuleBasedStateMachine):
    """pools[0]: a Pool with the drawn knobs; pools[1]: a tenant context of it (quota);
    pools[2]: the process's default pool of device 0 (module-level calls)."""

    @initialize(knobs=knob_sets, quota=st.sampled_from(QUOTAS))
    def setup(self, knobs, quota):
        open_backend("sim")
        assert sim.attach().aclrtSetDevice(0) == 0
        self.on_device = True
        sim.reset_faults()
        registry.reap_orphans()
        self.default = ap.default_pool(0)
        self.default.empty_cache()
        self.default_live0 = self.default.memory_stats()["allocation.all.current"]
        self.default_reserved0 = self.default.memory_stats()["reserved_bytes.all.current"]
        self.held0 = sim.stats(0)["bytes_held"]
        self.events0 = sim.stats(0)["live_events"]
        self.knobs = knobs
        self.streams = [None]      # live streams, known to every pool (None: the default stream)
        self.live = {}             # ptr -> Live
        self.base = ap.Pool(0, backend="sim", **knobs)
        try:
            self.ctx = self.base.context(TENANT, quota=quota)  # with the base's knobs
        except ap.QuotaExceededError:
            # The context preallocates its reserve: refused, typed, by a smaller quota.
            assert quota is not None and parse_bytes(knobs.get("reserve", "0")) > quota
            self.ctx = self.base.context(TENANT, quota=None)
        self.pools = [self.base, self.ctx, self.default]
        self.serial = 0
        self.held_before = self.ctx.held

    def teardown(self):
        if not hasattr(self, "base"):
            if getattr(self, "on_device", False):
                sim.attach().aclrtResetDevice(0)
            return
        try:
            sim.reset_faults()
            for ptr, e in list(self.live.items()):
                self.check_pattern(ptr, e)
                self.pools[e.pi].free(ptr)
            self.live.clear()
            for s in self.streams:
                self.base.synchronize(s)
            for p in self.pools:
                p.empty_cache()
                p._check_invariants()
        finally:
            for s in self.streams[1:]:
                self.base.destroy_stream(s)
            if hasattr(self, "ctx"):
                self.ctx.set_quota(None)
                self.ctx.close()
            self.base.close()
            self.default.empty_cache()
            sim.attach().aclrtResetDevice(0)
        after = sim.stats(0)
        assert after["bytes_held"] == self.held0, (
            f"device memory not back after close: {after['bytes_held']} held, {self.held0} at the start "
            f"(knobs {self.knobs})")
        assert after["live_events"] == self.events0, "events leaked after close"

    # -- helpers ---------------------------------------------------------------------------------

    def fill(self, ptr, size, value, stream):
        n = min(size, EDGE)
        sim.launch_fill(stream, ptr, n, value)
        sim.launch_fill(stream, ptr + size - n, n, value)
        self.base.synchronize(stream)

    def check_pattern(self, ptr, e):
        n = min(e.size, EDGE)
        want = bytes([e.pattern]) * n
        assert sim.read(ptr, n) == want, f"head of live block {ptr:#x} ({e.size} B) was overwritten"
        assert sim.read(ptr + e.size - n, n) == want, f"tail of live block {ptr:#x} ({e.size} B) was overwritten"

    def pick_live(self, pick):
        return sorted(self.live)[pick % len(self.live)]

    # -- rules -----------------------------------------------------------------------------------

    @rule(pi=st.integers(0, 2), size=sizes, si=st.integers(0, 7))
    def malloc(self, pi, size, si):
        pool = self.pools[pi]
        stream = self.streams[si % len(self.streams)]
        before = pool.memory_stats()
        try:
            if pi == 2:
                ptr = ap.malloc(size, stream=stream, device=0)
            else:
                ptr = pool.malloc(size, stream=stream)
        except ap.InvalidSizeError:
            assert size == 0, f"{size} bytes refused as an invalid size"
            self.unchanged(pool, before)
            return
        except ap.QuotaExceededError as e:
            assert pi == 1, f"a pool without a quota refused on quota grounds: {e}"
            quota = self.ctx.quota
            assert quota is not None, f"refused on quota grounds without a quota: {e}"
            assert quota - self.ctx.held < growth_bound(pool, size), (
                f"refused although {quota - self.ctx.held} bytes of quota were free for a request needing at "
                f"most {growth_bound(pool, size)} (knobs {self.knobs}): {e}")
            self.unchanged(pool, before)
            return
        except ap.OutOfMemoryError as e:
            limit = pool._limit()
            r = pool.round_size(size)
            after = pool.memory_stats()
            assert size >= 200 * MiB or limit is not None, f"{size} bytes refused with no limit set: {e}"
            if limit is not None and size < 200 * MiB:
                # Refused by the limit: only if a fresh segment for it would not fit beside what
                # the pool keeps after trimming for it.
                assert after["reserved_bytes.all.current"] + growth_bound(pool, size) > limit, (
                    f"{size} bytes ({r} rounded) refused although {limit - after['reserved_bytes.all.current']} "
                    f"bytes are left under the limit {limit} (knobs {self.knobs}): {e}")
            self.unchanged(pool, before, reserved=False)
            return
        assert size > 0
        assert ptr not in self.live, f"{ptr:#x} handed out twice"
        self.serial += 1
        pattern = self.serial % 200 + 1  # never 0 or 0xDD
        self.fill(ptr, size, pattern, stream)
        base, bsize, req = pool.block_info(ptr)
        assert base == ptr and req == size
        assert block_size_ok(self.knobs if pi < 2 else {}, pool.round_size(size), bsize), (
            f"{size} bytes ({pool.round_size(size)} rounded) got a {bsize}-byte block (knobs {self.knobs}); segments " + repr([(s["segment_type"], s["total_size"], s["stream"], [(b["size"], b["state"]) for b in s["blocks"]]) for s in pool.snapshot()["segments"]]))
        self.live[ptr] = Live(pi, size, bsize, stream, pattern)

    def unchanged(self, pool, before, reserved=True):
        after = pool.memory_stats()
        # (requested bytes count blocks freed after record_stream until their streams' work is
        # done: the retry of a refused malloc may settle them)
        keys = ["allocation.all.current", "allocated_bytes.all.current"]
        if not reserved:  # a refusal may have trimmed the cache first
            assert after["reserved_bytes.all.current"] <= before["reserved_bytes.all.current"]
        for k in keys:
            assert after[k] == before[k], f"a refused malloc changed {k}: {before[k]} -> {after[k]}"

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1 << 20), si=st.integers(-1, 7))
    def free(self, pick, si):
        ptr = self.pick_live(pick)
        e = self.live.pop(ptr)
        self.check_pattern(ptr, e)
        pool = self.pools[e.pi]
        on = None if si < 0 else self.streams[si % len(self.streams)]
        # A free on another stream is the caller's promise that the block's work is ordered
        # before it: the fills were synchronized.
        if e.pi == 2:
            ap.free(ptr, stream=on, device=0)
        else:
            pool.free(ptr, stream=on)

    @precondition(lambda self: self.live and len(self.streams) > 1)
    @rule(pick=st.integers(0, 1 << 20), si=st.integers(1, 7), slow=st.booleans())
    def record_stream(self, pick, si, slow):
        ptr = self.pick_live(pick)
        e = self.live[ptr]
        s = self.streams[1 + si % (len(self.streams) - 1)]
        # Work still queued on s when the block is freed: the free waits for it. Not on the
        # allocation stream, which record_stream adds nothing for: a free on another stream
        # promises that the block's work there is done or ordered before it (cudaFreeAsync's).
        if slow and s != e.stream:
            sim.launch_fill(s, ptr, min(e.size, EDGE), e.pattern, delay_s=0.002)
        if e.pi == 2:
            ap.record_stream(ptr, s, device=0)
        else:
            self.pools[e.pi].record_stream(ptr, s)
        e.recorded.add(s)

    @precondition(lambda self: len(self.streams) < 5)
    @rule(maker=st.integers(0, 2))
    def create_stream(self, maker):
        s = ap.create_stream(device=0) if maker == 2 else self.pools[maker].create_stream()
        assert s not in self.streams, f"stream {s:#x} handed out while live"
        for p in self.pools:
            if p is not self.pools[maker]:
                p.register_stream(s)
        self.streams.append(s)

    @precondition(lambda self: len(self.streams) > 1)
    @rule(pick=st.integers(0, 7), by=st.integers(0, 2))
    def destroy_stream(self, pick, by):
        """Destroys a stream mid-run, perhaps with blocks allocated on it or recorded on it still
        live (their frees later go on the allocating stream, which is gone): through one of the
        pools that know it, as a framework destroys its stream once, whatever pools use it."""
        s = self.streams[1 + pick % (len(self.streams) - 1)]
        self.pools[by].destroy_stream(s)
        self.streams.remove(s)
        for e in self.live.values():
            e.recorded.discard(s)
            if e.stream == s:
                e.stream = None

    @rule(si=st.integers(0, 7), pi=st.integers(0, 2))
    def synchronize(self, si, pi):
        self.pools[pi].synchronize(self.streams[si % len(self.streams)])

    @rule(pi=st.integers(0, 2), what=st.sampled_from(["empty_cache", "stream_cache", "idle"]),
          si=st.integers(0, 7))
    def trim(self, pi, what, si):
        pool = self.pools[pi]
        if what == "empty_cache":
            ap.empty_cache(device=0) if pi == 2 else pool.empty_cache()
            for seg in pool.snapshot()["segments"]:
                assert any(b["state"] != "inactive" for b in seg["blocks"]) or pool.memory_stats().get(
                    "expandable", False), "empty_cache kept a wholly free segment"
        elif what == "stream_cache":
            pool.empty_stream_cache(self.streams[si % len(self.streams)])
        else:
            pool._release_idle()

    @rule(pi=st.integers(0, 1), limit=st.sampled_from([None, 8 * MiB, 32 * MiB, 96 * MiB]))
    def set_limit(self, pi, limit):
        """A cap below current use trims the cache only (pool.set_limit's promise)."""
        pool = self.pools[pi]
        before = pool.memory_stats()
        pool.set_limit(limit_bytes=limit) if limit is not None else pool.set_limit(None)
        after = pool.memory_stats()
        assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
        assert after["reserved_bytes.all.current"] <= before["reserved_bytes.all.current"]

    @rule(quota=st.sampled_from(QUOTAS))
    def set_quota(self, quota):
        held = self.ctx.held
        self.ctx.set_quota(quota)
        assert self.ctx.quota == quota
        assert self.ctx.held <= held, "changing a quota must never grow the tenant"

    # -- invariants -------------------------------------------------------------------------------

    @invariant()
    def consistent(self):
        if not hasattr(self, "base"):
            return
        seg_spans, live_spans = [], []
        reserved_total = 0
        for pi, pool in enumerate(self.pools):
            pool._check_invariants()  # ap_pool_check (cython/core/check.c)
            snap = pool.snapshot()
            stats = pool.memory_stats()
            mine = {p: e for p, e in self.live.items() if e.pi == pi}
            active, pending_requested, seg_bytes = walk_segments(snap, pi, live_spans, seg_spans)
            if pi == 2:  # the default pool may hold blocks of earlier tests: compare what this test added
                assert stats["allocation.all.current"] == self.default_live0 + len(mine)
                assert set(mine) <= active, "a live block of the model is not live in the default pool"
            else:
                assert active == set(mine), "the pool's live blocks differ from the model's"
                want = {"allocation.all.current": len(mine),
                        "requested_bytes.all.current": sum(e.size for e in mine.values()) + pending_requested,
                        "allocated_bytes.all.current": sum(e.bsize for e in mine.values())}
                got = {k: stats[k] for k in want}
                assert got == want, f"pool {pi} (knobs {self.knobs}): stats {got}, model {want}"
            for ptr, e in mine.items():
                assert pool.block_info(ptr) == (ptr, e.bsize, e.size)
                assert any(a <= ptr and ptr + e.bsize <= b for a, b, q in seg_spans if q == pi), \
                    "a live block lies outside its pool's segments"
            assert stats["reserved_bytes.all.current"] == seg_bytes
            assert stats["reserved_bytes.all.current"] >= stats["allocated_bytes.all.current"]
            assert stats["segment.all.current"] == len(snap["segments"])
            reserved_total += seg_bytes
        for spans, what in ((seg_spans, "segments"), (live_spans, "live blocks")):
            spans.sort()
            for (a0, a1, p), (b0, b1, q) in zip(spans, spans[1:]):
                assert a1 <= b0, f"{what} overlap: [{a0:#x}, {a1:#x}) of pool {p} and [{b0:#x}, {b1:#x}) of pool {q}"
        # (the default pool's cache was emptied at the start; segments of its older live blocks stay)
        assert sim.stats(0)["bytes_held"] - self.held0 == reserved_total - self.default_reserved0, \
            "the device holds other bytes than the pools' segments"
        # The tenant holds exactly its context's reserve, within its quota unless a lowered quota
        # caught it holding live blocks (and then it did not grow).
        held = self.ctx.held
        assert held == self.ctx.memory_stats()["reserved_bytes.all.current"]
        q = self.ctx.quota
        if q is not None:
            assert held <= q or held <= self.held_before, f"tenant grew to {held} past its quota {q}"
        self.held_before = held


_settings = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

TestKnobs = KnobsMachine.TestCase
TestKnobs.settings = _settings

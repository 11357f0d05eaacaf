"""One randomized run of pool operations on the simulated NPU (tests/test_fuzz_sequences.py runs
it in a child process per seed, so that an abort or a hang is a failed test, not a dead suite).

    python fuzz_sequences.py SEED OPS

A seed picks the device size, the mode (classic or expandable), the release policy, the
cross-stream reuse, up to two tenant contexts with quotas, and 1-3 streams; then OPS operations
drawn at random: malloc on any stream (each block is filled on its stream by a simulated kernel,
sometimes a slow one), free on its own stream or (after its work is synchronised) on another,
record_stream after a second stream wrote it too, streams hung and released, streams created,
destroyed through the pool and destroyed behind its back, empty_cache, set_limit, synchronize,
and one-shot device faults (a failed malloc, a device that runs out, failed event creation and
queries). Every pool's invariants are checked after each operation (`_check_invariants`), every
new block is checked against the live ones (no block handed out twice, no overlap), and every
block's bytes are read back before it is freed (no block reused while its work was pending). At
the end everything is freed, the caches emptied and the pools closed: the simulator must then
hold no device memory and no event.

Exit status 0: the run held; 3: a finding (printed with the last operations); 5: a hang (the
watchdog prints every thread's stack). Sizes are bytes.
"""
import faulthandler
import os
import random
import sys
import threading
import time

import ascend_pool as ap
from ascend_pool import sim

KiB, MiB = 1 << 10, 1 << 20
SMALL = [1, 100, 512, 4 * KiB, 100 * KiB, 700 * KiB, MiB - 32, MiB]
MEDIUM = [MiB + 1, 2 * MiB, 3 * MiB, 5 * MiB, 9 * MiB, 11 * MiB]
LARGE = [20 * MiB, 25 * MiB, 40 * MiB, 64 * MiB, 90 * MiB]
HANG_AFTER_S = 90  # the watchdog's limit for the whole run


class Finding(Exception):
    """A broken promise of the pool: corruption, a double hand-out, a leak."""


class Run:
    def __init__(self, seed):
        self.r = random.Random(seed)
        self.log = []
        r = self.r
        sim.configure(devices=1, hbm=r.choice(["256MiB", "1GiB", "4GiB"]))
        knobs = dict(release_policy=r.choice(["never", "under_peak", "budgeted"]),
                     stream_reuse=r.choice(["borrow", "tied"]), sync_timeout_ms=r.choice([30, 80]))
        if r.random() < 0.5:
            knobs["expandable_segments"] = True
        self.note("config", knobs)
        self.base = ap.Pool(0, backend="sim", **knobs)
        self.pools = [self.base] + [self.base.context(f"fz{seed}x{i}", quota=r.choice(["64MiB", "200MiB", None]))
                                    for i in range(r.choice([0, 1, 2]))]
        self.streams, self.hung, self.dead = [], set(), set()
        self.live = {}  # ptr -> {pool, n, stream, value, writers: streams whose fills may be pending}
        self.serial = 0
        for _ in range(r.randint(1, 3)):
            self.new_stream()

    def note(self, *words):
        self.log.append(" ".join(str(w) for w in words))

    # -- helpers -----------------------------------------------------------------------------

    def new_stream(self):
        if len(self.streams) >= 5:
            return
        s = self.base.create_stream()
        for p in self.pools[1:]:
            p.register_stream(s)
        self.streams.append(s)
        self.note("create_stream", hex(s))

    def usable(self, s):
        return s is None or (s in self.streams and s not in self.dead)

    def size(self):
        c = self.r.random()
        n = self.r.choice(SMALL if c < 0.5 else MEDIUM if c < 0.95 else LARGE)
        return n + (self.r.randrange(4096) if self.r.random() < 0.5 else 0)

    def sync(self, pool, s, tries):
        for i in range(tries):
            try:
                pool.synchronize(s)
                return
            except ap.DeviceTimeoutError:
                if i == tries - 1:
                    raise

    def verify(self, ptr, why, tries=3):
        """Reads the block back once every stream that wrote it is done (skipped while one hangs)."""
        e = self.live[ptr]
        if any(w in self.hung or w in self.dead for w in e["writers"]):
            return
        try:
            for w in e["writers"]:
                if self.usable(w):
                    self.sync(e["pool"], w, tries)
        except ap.DeviceTimeoutError:
            return
        data = sim.read(ptr, e["n"])
        if data != bytes([e["value"]]) * e["n"]:
            at = next(i for i, b in enumerate(data) if b != e["value"])
            raise Finding(f"corruption ({why}): block {ptr:#x} of {e['n']} B holds {data[at]:#04x} at +{at}, "
                          f"expected {e['value']:#04x}")
        e["writers"] = set()

    # -- operations --------------------------------------------------------------------------

    def op_malloc(self):
        p, n = self.r.choice(self.pools), self.size()
        s = self.r.choice(self.streams + [None, None])
        s = s if self.usable(s) else None
        try:
            ptr = p.malloc(n, stream=s)
        except ap.PoolError as ex:
            self.note("malloc", n, s and hex(s), "->", type(ex).__name__)
            return
        self.note("malloc", n, s and hex(s), "->", hex(ptr), "pool", self.pools.index(p))
        if ptr in self.live:
            raise Finding(f"block {ptr:#x} handed out twice")
        for q, e in self.live.items():
            if q < ptr + n and ptr < q + e["n"]:
                raise Finding(f"new block {ptr:#x}+{n} overlaps live block {q:#x}+{e['n']}")
        self.serial += 1
        value = self.serial % 254 + 1
        slow = self.r.random() * 0.003 if self.r.random() < 0.3 else 0.0
        sim.launch_fill(s, ptr, n, value, delay_s=slow)
        self.live[ptr] = dict(pool=p, n=n, stream=s, value=value, writers={s})

    def op_free(self):
        if not self.live:
            return
        ptr = self.r.choice(list(self.live))
        e = self.live[ptr]
        self.verify(ptr, "before free")
        c, on = self.r.random(), None
        if c < 0.25 and self.streams:
            other = self.r.choice(self.streams)
            if other not in self.dead:  # a second stream writes it too, marked with record_stream
                sim.launch_fill(other, ptr, e["n"], e["value"], delay_s=self.r.random() * 0.003)
                try:
                    e["pool"].record_stream(ptr, other)
                    self.note("record_stream", hex(ptr), hex(other))
                except ap.PoolError as ex:
                    self.note("record_stream", hex(ptr), hex(other), "->", type(ex).__name__)
                    e["writers"].add(other)
                    return
        elif c < 0.5 and self.streams and not any(w in self.hung or w in self.dead for w in e["writers"]):
            try:  # a free on another stream is the caller's promise that the work is ordered: sync first
                for w in e["writers"]:
                    if self.usable(w):
                        e["pool"].synchronize(w)
                on = self.r.choice(self.streams + [None])
                on = on if on not in self.dead else None
            except ap.DeviceTimeoutError:
                on = None
        try:
            e["pool"].free(ptr, stream=on) if on is not None else e["pool"].free(ptr)
            self.note("free", hex(ptr), "on", on and hex(on))
        except ap.PoolError as ex:
            self.note("free", hex(ptr), "->", type(ex).__name__, str(ex)[:100])
        del self.live[ptr]

    def op_hang(self):
        can = [s for s in self.streams if s not in self.hung and s not in self.dead]
        if can:
            s = self.r.choice(can)
            sim.hang_stream(s)
            self.hung.add(s)
            self.note("hang", hex(s))

    def op_release(self):
        if not self.hung:
            return
        s = self.r.choice(sorted(self.hung))
        sim.release_stream(s)
        self.hung.discard(s)
        self.note("release", hex(s))
        for ptr in list(self.live):
            self.verify(ptr, f"after releasing {s:#x}")

    def op_empty_cache(self):
        p = self.r.choice(self.pools)
        try:
            p.empty_cache()
            self.note("empty_cache", self.pools.index(p))
        except ap.PoolError as ex:
            self.note("empty_cache ->", type(ex).__name__)

    def op_limit(self):
        p = self.r.choice(self.pools)
        limit = self.r.choice([0, 16 * MiB, 64 * MiB, 128 * MiB, 300 * MiB, None])
        p.set_limit(limit_bytes=limit) if limit is not None else p.set_limit(None)
        self.note("set_limit", limit, self.pools.index(p))

    def op_sync(self):
        s = self.r.choice(self.streams + [None])
        if self.usable(s):
            try:
                self.r.choice(self.pools).synchronize(s)
                self.note("sync", s and hex(s))
            except ap.PoolError as ex:
                self.note("sync", s and hex(s), "->", type(ex).__name__)

    def op_destroy(self):
        can = [s for s in self.streams if s not in self.dead]
        if not can:
            return
        s = self.r.choice(can)
        if self.r.random() < 0.4:
            if self.hung:
                return  # the runtime's destroy waits for the stream's work: forever behind a hung one
            self.base.backend.stream_destroy(s)  # behind the pool's back (its work is done then)
            self.dead.add(s)
            self.note("backend.stream_destroy", hex(s))
            for e in self.live.values():
                e["writers"].discard(s)
            return
        try:
            self.base.destroy_stream(s)
        except ap.PoolError as ex:
            self.note("destroy_stream", hex(s), "->", type(ex).__name__, str(ex)[:120])
            return
        self.note("destroy_stream", hex(s))
        self.streams.remove(s)
        for e in self.live.values():
            e["writers"].discard(s)

    def op_fault(self):
        c = self.r.random()
        if c < 0.25:
            sim.set_faults(fail_malloc_nth=self.r.randint(1, 3))
        elif c < 0.4:
            sim.set_faults(fail_after_bytes=sim.stats(0)["bytes_held"] + self.r.choice([0, 8 * MiB, 40 * MiB]))
        elif c < 0.6:
            sim.set_faults(fail_event_create_nth=self.r.randint(1, 3))
        elif c < 0.8:
            sim.set_faults(fail_event_query_nth=self.r.randint(1, 3))
        else:
            sim.reset_faults()
        self.note("fault", c)

    OPS = [("op_malloc", 30), ("op_free", 25), ("op_hang", 4), ("op_release", 5), ("op_empty_cache", 5),
           ("op_limit", 3), ("op_sync", 3), ("op_destroy", 2), ("op_fault", 3), ("new_stream", 2)]

    def step(self):
        name = self.r.choices([n for n, _ in self.OPS], [w for _, w in self.OPS])[0]
        try:
            getattr(self, name)()
        except ap.PoolError as ex:  # a typed error is an allowed outcome of any operation
            self.note(name, "->", type(ex).__name__, str(ex)[:100])
        for p in self.pools:
            p._check_invariants()

    def finish(self):
        sim.reset_faults()
        for s in list(self.hung):
            sim.release_stream(s)
        self.hung.clear()
        for s in self.streams:
            if s not in self.dead:
                self.sync(self.base, s, 100)
        self.sync(self.base, None, 100)
        for ptr in list(self.live):
            self.verify(ptr, "at the end", 100)
        for ptr, e in list(self.live.items()):
            try:
                e["pool"].free(ptr)
            except ap.PoolError as ex:  # e.g. its stream was destroyed behind the pool's back: close() frees it
                self.note("final free", hex(ptr), "->", type(ex).__name__, str(ex)[:100])
            del self.live[ptr]
        for p in self.pools:
            p._check_invariants()
            p.set_limit(None)
            p.empty_cache()
            p._check_invariants()
        for p in reversed(self.pools):
            p.close()
        st = sim.stats(0)
        if st["bytes_held"] or st["phys_bytes"] or st["mapped_bytes"] or st["live_events"]:
            raise Finding(f"closed pools left device memory or events behind: {st}")


def _watchdog(run):
    time.sleep(HANG_AFTER_S)
    print(f"hang: the run did not end within {HANG_AFTER_S} s; last operations:\n" + "\n".join(run.log[-40:]),
          flush=True)
    faulthandler.dump_traceback(all_threads=True)
    os._exit(5)


def main(seed, ops):
    run = Run(seed)
    threading.Thread(target=_watchdog, args=(run,), daemon=True).start()
    try:
        for _ in range(ops):
            run.step()
        run.finish()
    except (Finding, AssertionError, ap.PoolError) as ex:  # a PoolError here came from the checks themselves
        print(f"finding, seed {seed}: {type(ex).__name__}: {ex}\nlast operations:\n" + "\n".join(run.log[-60:]),
              flush=True)
        os._exit(3)
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))

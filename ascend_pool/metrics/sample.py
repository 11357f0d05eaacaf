"""Reading the pools of this process into per-(device, tenant) records, at scrape or publish time.

Nothing here runs on the allocation path: a record is built from pool.memory_stats(), which copies
the C counters under the pool's lock and holds nothing else.
"""

import collections
import gc
import logging
import threading
import weakref
from dataclasses import dataclass, field

from .. import registry
from ..pool import Pool
from .schema import (
    COUNTER_FIELDS,
    DEVICE_GAUGES,
    FIELDS,
    NO_QUOTA,
    WARN_PPM,
    PLAIN_COUNTERS,
    PLAIN_GAUGES,
    POOL_COUNTERS,
    POOL_GAUGES,
    POOL_KINDS,
)

log = logging.getLogger(__name__)

# How aggregation combines one field across the pools of a (device, tenant).
_MAX_FIELDS = frozenset(("largest_free_block_bytes", "quota_bytes", "quota_warn_ppm", "device_free_bytes", "device_total_bytes"))


@dataclass
class TenantSample:
    """The figures of one (device, tenant) in one process (device: the node's number of it,
    Pool.node_device): values[field] for every schema field
    (int, base units). pid and instance (the process's id unique on the node: pids are per pid
    namespace) and uid (the process's user: quotas are per user, so one tenant name used by two
    users is two tenants) are set by the node service (None in-process). live: False for a
    (device, tenant) whose pools are all closed (only its counters remain: the gauges read zero).
    idle_rank: for such a pair, its place among them, higher for one closed more recently (what
    a full stats file keeps first); 0 for a live one."""

    device: int
    tenant: str
    values: dict = field(default_factory=dict)
    pid: int = None
    instance: str = None
    live: bool = True
    uid: int = None
    idle_rank: int = 0

    @property
    def key(self):
        return (self.device, self.tenant)


class _Collection:
    """Whether the cycle collector is in a collection now (gc.callbacks). A pool leaves the
    registry only there (its weak reference cleared before its finalizer runs), and comes back
    (an orphan, or closed and folded in) before the collection ends."""

    running = False

    @classmethod
    def phase(cls, phase, info):
        cls.running = phase == "start"


gc.callbacks.append(_Collection.phase)


def pool_values(pool, wait_ms=-1):
    """The schema fields of one pool (dict of int). Raises whatever memory_stats() raises (a pool
    closed meanwhile; with wait_ms >= 0, TimeoutError when an ascend_pool.Pool's lock is not had
    within it). Counters over the pool's life: reset_accumulated_stats() is the user's view
    (torch's), never a drop in an exported counter."""
    if wait_ms >= 0 and isinstance(pool, Pool):
        s = pool.lifetime_stats(wait_ms)
    else:
        s = pool.lifetime_stats() if hasattr(pool, "lifetime_stats") else pool.memory_stats()
    v = {}
    for prefix, stem in POOL_GAUGES:
        for kind in POOL_KINDS:
            v[f"{prefix}.{kind}"] = int(s[f"{stem}.{kind}_pool.current"])
    for prefix, stem in POOL_COUNTERS:
        for kind in POOL_KINDS:
            v[f"{prefix}.{kind}"] = int(s[f"{stem}.{kind}_pool.allocated"])
    for name, key in PLAIN_GAUGES + DEVICE_GAUGES + PLAIN_COUNTERS:
        if key is not None:
            v[name] = int(s.get(key, 0))
    v["quota_bytes"] = pool_quota(pool)
    v["quota_warn_ppm"] = pool_warn_ppm(pool)
    return v


def pool_warn_ppm(pool):
    """The tenant's warn ratio in millionths (tenant contexts tell it as `warn`), 0 when none."""
    w = getattr(pool, "warn", None)
    if isinstance(w, (int, float)) and not isinstance(w, bool) and 0 < w <= 1:
        return int(round(w * WARN_PPM))
    return 0


def pool_quota(pool):
    """The pool's tenant quota in bytes, or NO_QUOTA. Tenant contexts tell it as `quota` (read
    live from the node ledger); `quota_bytes` is accepted too."""
    for attr in ("quota_bytes", "quota"):
        q = getattr(pool, attr, None)
        if isinstance(q, int) and not isinstance(q, bool):
            return q
    return NO_QUOTA


def _merge(into, v):
    for f in FIELDS:
        if f in _MAX_FIELDS:
            into[f] = max(into.get(f, NO_QUOTA if f == "quota_bytes" else 0), v[f])
        else:
            into[f] = into.get(f, 0) + v[f]


def _identity(pool):
    """The key a pool's last-read counters are kept under: its serial (Pool.serial, never reused
    in a process), else its id."""
    serial = getattr(pool, "serial", None)
    return ("serial", serial) if serial is not None else ("id", id(pool))


def _key(pool):
    """A pool's (device, tenant): the node's device number (Pool.node_device: a container's device
    0 may be the node's NPU 3, and the node service adds processes' figures by device)."""
    return (int(getattr(pool, "node_device", pool.device)), str(getattr(pool, "tenant", "default")))


class PoolAggregator:
    """Turns the live pools of the process into TenantSamples, one per (device, tenant).

    Keeps the last-seen counters of every pool it has read; when a pool disappears (closed or
    collected), those are folded into a per-(device, tenant) "retired" sum, so the exported
    counters never go down while the process lives (a live pool's are its lifetime counters,
    pool_values: reset_accumulated_stats does not lower them) (a replay loop that opens and closes pools
    would otherwise look like a counter reset at every pool). A pool closed with close() is read
    once more just before (registry.on_close), so what it counted after its last read is kept: a
    per-request tenant context that lives between two reads counted nothing before (its quota
    refusals never reached the alert); so is one dropped without close() (Pool.__del__, before its
    dealloc closes it).

    A (device, tenant) with no open pool keeps its series (counters as they were, gauges at 0)
    while it is one of the RETIRED_KEEP most recently active such pairs; older ones are dropped
    (their series end, as a deleted pod's do): a service that names a tenant per job kept every
    name's series for the process's life (5,721 series after 300 jobs). The stats file that
    `ascend-pool serve` reads keeps the same number.

    Thread-safe: the HTTP server may scrape from several threads at once. A closing pool never
    waits for a read (its close may run in a finalizer, see _pool_closing).
    """

    RETIRED_KEEP = 64
    FOLDED_KEEP = 1024  # closings remembered: a pool's second close comes right after its first
    # How long a read waits for a pool's lock: a free may hold it over a stream wait (no event to
    # be had, rare), and the stats publisher's cycle, which a fork waits for, must not wait with it.
    # A pool not read in time counts with its last-read figures.
    READ_WAIT_MS = 100

    def __init__(self, pools=registry.live_pools):
        self._pools = pools
        self._lock = threading.RLock()  # re-entrant: a signal handler may read inside a read
        self._busy = False  # the lock's holder is in the middle of a read: a close inside it queues
        # One samples() at a time (its reads happen before self._lock: a later read must not be
        # merged before an earlier one); a pool's close never takes it.
        self._reading = threading.RLock()
        self._depth = 0  # samples() calls under way in the thread holding _reading (2: a signal handler's inside)
        self._seen = {}     # _identity(pool) -> (weakref to pool, (device, tenant), counters dict)
        self._retired = {}  # (device, tenant) -> counters dict
        self._vanished = {}  # serial identity -> (key, counters) retired without a close (may come back)
        self._final = weakref.WeakSet()  # closing pools already folded in: never read again
        self._closing = collections.deque()  # (weakref, identity, key, counters) of closing pools, until folded in
        self._folded = collections.OrderedDict()  # serial identities folded in lately (FOLDED_KEEP)
        self._last = {}     # _identity(pool) -> its last-read values (for a read that timed out)
        registry.on_close(self._pool_closing)

    def _pool_closing(self, pool):
        """A pool is about to close: its final counters go to the retired sums (in place of its
        last-read ones), when it is one of the pools this aggregator reads."""
        pools = list(self._pools())
        if not any(p is pool for p in pools):
            return
        try:
            v = pool_values(pool)
        except Exception:
            if getattr(pool, "closed", False):
                # Closed meanwhile by another thread (the orphan reaper, while this one's finalizer
                # decided; or a second close()): that close read it first. Logged as a failed
                # listener before, a warning on the user's stderr.
                return
            raise
        self._closing.append((weakref.ref(pool), _identity(pool), _key(pool), {f: v[f] for f in COUNTER_FIELDS}))
        # Never waits for the lock: this runs from Pool.__del__ too, in whatever thread a
        # collection finalizes the pool, maybe one holding a lock (sharing's, which pool_values
        # takes) that a reader holding ours waits for. Queued, it is folded in by whoever holds
        # the lock next (samples() first thing), before the pool can be read again.
        # Nor does it touch the sums in the middle of this thread's own read (a finalizer or a
        # signal handler running inside samples()).
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._busy:
                return
            self._busy = True
            try:
                self._fold_closing()
                # The pairs open now (not those of the last scrape: a tenant reopened since is live)
                self._forget_idle({_key(p) for p in pools if p is not pool})  # bounded between scrapes too
            finally:
                self._busy = False
        finally:
            self._lock.release()

    def _fold_closing(self):
        while self._closing:
            ref, ident, key, counters = self._closing.popleft()
            pool = ref()  # None: finalized since
            if ident in self._folded or (pool is not None and pool in self._final):
                # Closed twice at once: by two threads, or by the orphan reaper while its
                # finalizer (Pool.__del__, which keeps it as an orphan while it looks) was deciding.
                continue
            if pool is not None:
                self._final.add(pool)
            if ident[0] == "serial":  # never reused; an id is, once its pool is gone
                self._folded[ident] = None
                while len(self._folded) > self.FOLDED_KEEP:
                    self._folded.popitem(last=False)
            self._unretire(ident)  # retired when a read missed it: this reading replaces it
            self._add_retired(key, counters)
            self._seen.pop(ident, None)

    def samples(self):
        """A list of TenantSample, sorted by (device, tenant)."""
        with self._reading:
            self._depth += 1
            try:
                return self._samples(nested=self._depth > 1)
            finally:
                self._depth -= 1

    def _samples(self, nested=False):
        # The registry's lock is never taken under this one (the pools are listed first), and
        # nothing under it waits for a pool to close: a close queues (_pool_closing). Nor are the
        # pools read under it: a pool's lock may be held over a free's stream wait (rare: no
        # event could be made).
        read = []
        for pool in self._pools():
            if pool in self._final:
                continue  # closing: its final counters are in the retired sums
            try:
                read.append((pool, pool_values(pool, self.READ_WAIT_MS), _key(pool)))
            except TimeoutError:  # its lock held over a stream wait: as last read (if ever)
                if _identity(pool) in self._last:
                    read.append((pool, self._last[_identity(pool)], _key(pool)))
            except Exception as e:  # closed meanwhile, or a pool type we cannot read
                log.debug("skipping pool %r: %s", pool, e)
        with self._lock:
            outer, self._busy = self._busy, True
            try:
                if nested:  # a read inside a read (a signal handler's) leaves the sums to it
                    return self._view(read)
                self._fold_closing()
                return self._sum(read)
            finally:
                self._busy = outer

    def _view(self, read):
        """The samples of `read` with the retired counters, changing nothing: a read inside a
        read (a signal handler's) may run in the middle of the outer one's _sum, whose
        retirements it would make a second time (counted twice for good), or whose dict
        iterations it would break; and its newer reads must not be merged before the outer's
        older ones."""
        out = {}
        for pool, v, key in read:
            if pool not in self._final:
                _merge(out.setdefault(key, {}), v)
        live = set(out)
        for key, counters in self._retired.items():
            vals = out.get(key)
            if vals is None:
                vals = out[key] = {f: 0 for f in FIELDS}
                vals["quota_bytes"] = NO_QUOTA
            for f, n in counters.items():
                vals[f] += n
        return [TenantSample(d, t, vals, live=(d, t) in live) for (d, t), vals in sorted(out.items())]

    def _sum(self, read):
        """samples() under the lock: the pools read, with the retired counters."""
        current = {}
        out = {}
        last = {}
        for pool, v, key in read:
            if pool in self._final:
                continue  # closed since it was read: its final counters are in the retired sums
            current[_identity(pool)] = (weakref.ref(pool), key, {f: v[f] for f in COUNTER_FIELDS})
            last[_identity(pool)] = v
            _merge(out.setdefault(key, {}), v)
        self._last = last
        self._retire(current)
        live = set(out)
        self._forget_idle(live)
        for key, counters in self._retired.items():
            vals = out.setdefault(key, None)
            if vals is None:  # no live pool left: the counters stay, the gauges read zero
                vals = out[key] = {f: 0 for f in FIELDS}
                vals["quota_bytes"] = NO_QUOTA
            for f, n in counters.items():
                vals[f] += n
        rank = {key: i + 1 for i, key in enumerate(self._retired)}  # dict order: least recently active first
        return [TenantSample(d, t, vals, live=(d, t) in live, idle_rank=0 if (d, t) in live else rank[(d, t)])
                for (d, t), vals in sorted(out.items())]

    def _add_retired(self, key, counters):
        """Adds a gone pool's counters to key's retired sums (and makes key the most recent)."""
        acc = self._retired.pop(key, None) or {f: 0 for f in COUNTER_FIELDS}
        for f in COUNTER_FIELDS:
            acc[f] += counters[f]
        self._retired[key] = acc

    def _forget_idle(self, live):
        """Keeps the retired sums of at most RETIRED_KEEP (device, tenant) pairs with no open
        pool, the most recently active ones (dict order: a pair moves to the end while live)."""
        for key in live & self._retired.keys():
            self._retired[key] = self._retired.pop(key)
        idle = [key for key in self._retired if key not in live]
        forgotten = idle[:max(0, len(idle) - self.RETIRED_KEEP)]
        for key in forgotten:
            del self._retired[key]
        if forgotten:  # their vanished pools' counters went with the sums: nothing to take back off
            forgotten = set(forgotten)
            for ident in [i for i, (key, _) in self._vanished.items() if key in forgotten]:
                del self._vanished[ident]

    def _unretire(self, ident):
        """Takes the counters of a pool retired when a read missed it back off the retired sums."""
        key, counters = self._vanished.pop(ident, (None, None))
        acc = self._retired.get(key)
        if acc is not None:
            for f in COUNTER_FIELDS:
                acc[f] -= counters[f]

    def _retire(self, current):
        # A pool that comes back after a read missed it (the cycle collector keeping it as an
        # orphan: out of the registry for a moment) was retired meanwhile: its counters come off
        # the retired sums again, since it is read live now.
        for ident in current.keys() & self._vanished.keys():
            self._unretire(ident)
        for ident, (ref, key, counters) in self._seen.items():
            now = current.get(ident)
            # A serial names one pool for the process's life: present now, it is the same pool (a
            # pool the collector resurrected as an orphan has a new weak reference, the old one
            # dead: it was counted twice). Without one (a pool type of a test), the same id but
            # another object means the old pool was collected and its id reused.
            if now is None or (ident[0] == "id" and (now[0]() is not ref() or ref() is None)):
                self._add_retired(key, counters)
                if now is None and ident[0] == "serial":
                    self._vanished[ident] = (key, counters)
                    # Its close (or its finalizer's) folds it in soon and takes these back off:
                    # many may be pending at once (a read slowed while request threads churn
                    # contexts); one dropped here is counted twice.
        # Bounded only outside a collection: inside one, each pool it finalizes may still come
        # back (a read in the middle of a collection of 3,000 pools in cycles dropped the oldest
        # 1,976 of them, then their finalizers' closes counted them a second time, for good).
        while len(self._vanished) > self.FOLDED_KEEP and not _Collection.running:
            del self._vanished[next(iter(self._vanished))]  # the oldest: gone for good
        self._seen = current

"""The demo workload of `ascend-pool serve --replay`: traces replayed in a loop, in a background
thread, on long-lived pools (one per tenant), so that one command shows the pool, the quotas and
the exporter working together.

The pools live as long as the loop: like a real service's, their caches persist between traces,
and the figures Prometheus scrapes are those of a warm pool, not of one opened and closed within
a few milliseconds. Each trace is driven through the public malloc/free API (as an application
would); a request that fails (out of memory, over quota) ends that run: what it had allocated is
freed and the loop goes on, so failures show up in the metrics instead of stopping the demo.
"""

import logging
import threading

from prometheus_client.core import CounterMetricFamily

from ..backend import open_backend
from ..errors import OutOfMemoryError, PoolError, QuotaExceededError
from ..pool import Pool
from ..tenants import Context
from ..traces import live_bytes_series, load_trace

log = logging.getLogger("ascend_pool.service")


class _Prepared:
    """A trace as plain Python lists (fast to index from a Python loop)."""

    def __init__(self, trace):
        self.name = trace.name
        self.op = trace.op.tolist()
        self.slot = trace.slot.tolist()
        self.size = trace.size.tolist()
        self.stream = trace.stream.tolist()
        self.n_slots = int(trace.n_slots)
        self.streams = sorted(set(self.stream))
        # The event after which the most bytes are live: the loop holds there for a while, so
        # scrapes see a pool in use (allocated > 0), not only the idle cache between runs.
        self.peak = int(live_bytes_series(trace).argmax()) if len(self.op) else 0


class ReplayLoop:
    """Replays `traces` (paths or Trace objects) on device `device` of `backend` (None: the
    environment's choice), for each tenant in `tenants` (a list of (name, quota, warn); None: the
    plain pool, tenant "default") in a thread of its own, holding `pause_s` seconds at each
    trace's peak and a quarter of that between runs, until stop()."""

    def __init__(self, traces, backend=None, device=0, tenants=None, pause_s=0.1):
        self.traces = [_Prepared(t if hasattr(t, "op") else load_trace(t)) for t in traces]
        if not self.traces:
            raise ValueError("no traces to replay")
        self.backend, self.device, self.tenants, self.pause_s = backend, device, tenants, pause_s
        self.runs = {}  # (trace, tenant, result) -> count; result: ok | oom | quota | error
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = []
        self._pools = []

    def open_pools(self):
        """Opens the pools (done by start(); separate so that configuration errors surface early)."""
        be = self.backend if hasattr(self.backend, "device_count") else open_backend(self.backend)
        if not self.tenants:
            self._pools = [Pool(self.device, backend=be)]
        else:
            self._pools = []
            for name, quota, warn in self.tenants:
                self._pools.append(Context(name, device=self.device, backend=be, quota=quota, warn=warn))
        self._streams = [{n: (None if n == 0 else p.create_stream()) for t in self.traces for n in t.streams}
                         for p in self._pools]
        return self._pools

    def backend_name(self):
        """The name of the backend the pools run on ("sim", "acl", "cuda"), or "none" before open_pools()."""
        for pool in self._pools:
            return str(getattr(pool.backend, "name", "none"))
        return "none"

    def health(self):
        """None while every pool can be read and every replay thread runs, else the reason."""
        for pool in list(self._pools):
            try:
                pool.memory_stats()
            except Exception as e:
                return f"cannot read the replay pool of tenant {pool.tenant}: {e}"
        for t in self._threads:
            if not t.is_alive() and not self._stop.is_set():
                return f"the replay thread {t.name} has stopped"
        return None

    def start(self):
        """Starts one thread per tenant: tenants are separate services, running at the same time."""
        if not self._pools:
            self.open_pools()
        self._threads = [threading.Thread(target=self._run, args=(pool, streams), daemon=True,
                                          name=f"ascend-pool-replay:{pool.tenant}")
                         for pool, streams in zip(self._pools, self._streams)]
        for t in self._threads:
            t.start()

    def stop(self, timeout=10):
        """Stops the loop and closes its pools."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
            if t.is_alive():
                return  # stuck in a device call: leave the pools to process exit
        for pool in self._pools:
            try:
                pool.close()
            except Exception as e:
                log.debug("closing pool %r: %s", pool, e)
        self._pools = []

    def _run(self, pool, streams):
        errors_logged = 0
        while not self._stop.is_set():
            for trace in self.traces:
                if self._stop.is_set():
                    return
                try:
                    result = replay_once(pool, trace, streams, at_peak=self._hold)
                except Exception:
                    result = "error"
                    if errors_logged < 5:
                        errors_logged += 1
                        log.exception("replaying %s for tenant %s failed", trace.name, pool.tenant)
                key = (trace.name, str(pool.tenant), result)
                with self._lock:
                    self.runs[key] = self.runs.get(key, 0) + 1
                self._stop.wait(self.pause_s / 4)

    def _hold(self):
        # At the trace's peak: what a scrape sees most of the time is a pool in use.
        self._stop.wait(self.pause_s)

    def collect(self):
        """A prometheus_client collector method: the runs so far, by trace, tenant and result."""
        fam = CounterMetricFamily("ascend_pool_replay_runs", "Trace replays run by `ascend-pool serve --replay`.",
                                  labels=["trace", "tenant", "result"])
        with self._lock:
            runs = sorted(self.runs.items())
        for (trace, tenant, result), n in runs:
            fam.add_metric([trace, tenant, result], n)
        yield fam

    def describe(self):
        return []


def replay_once(pool, trace, streams, at_peak=None):
    """Runs trace on pool through malloc/free, calling at_peak() (if given) at its peak of live
    bytes. Returns "ok", or "oom"/"quota" when a request failed; whatever the outcome, what the run
    still holds is then freed. streams: trace stream number -> stream handle."""
    ptrs = [0] * trace.n_slots
    owner = [None] * trace.n_slots
    malloc, free = pool.malloc, pool.free
    op, slot, size, stream = trace.op, trace.slot, trace.size, trace.stream

    def run(events):
        for i in events:
            s = slot[i]
            if op[i]:
                st = streams[stream[i]]
                ptrs[s] = malloc(size[i], st)
                owner[s] = st
            else:
                free(ptrs[s], owner[s])
                ptrs[s] = 0

    try:
        run(range(0, trace.peak + 1))
        if at_peak is not None:
            at_peak()
        run(range(trace.peak + 1, len(op)))
        return "ok"
    except OutOfMemoryError as e:
        return "quota" if isinstance(e, QuotaExceededError) else "oom"
    finally:
        # a trace that ends with allocations live (a memory snapshot's tensors, a dump_trace of a
        # running program) or a run stopped by another error: they stayed in the warm pool, more
        # at every loop, until the demo ran out of memory
        # (each alone: one refused, e.g. its stream destroyed, must neither keep the others nor
        # hide the error that stopped the run)
        for s, p in enumerate(ptrs):
            if p:
                try:
                    free(p, owner[s])
                except PoolError as e:
                    log.warning("replay loop: a block the run left could not be freed: %s", e)


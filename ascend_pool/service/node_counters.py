"""The node's counters per (device, tenant, uid): ascend_pool_node_<counter>_total.

A process's own counter series (pid and instance labels) end with it: Prometheus never sees
what it counted after the last scrape before it exited, and of a process that lived less than
two scrapes nothing at all (rate() needs two samples of a series). These add every process's
increments as the service reads them, an exited process's final ones included (its stats file
keeps them, statsfile.StatsFile.close; a killed one's keeps its last publish): they only go up
while the service runs (its restart is a counter reset, as any exporter's), so rate() over them
counts what the node's processes counted.
"""

import collections
import threading
import time

from prometheus_client.core import CounterMetricFamily

from ..metrics.schema import FAMILIES, POOL_KINDS
from . import layout as L

# (exported name without _total, help, source field or prefix, split by pool): one per counter
# family of schema.py, with its `pool` label where it has one
NODE_COUNTERS = tuple(
    (name.replace("ascend_pool_", "ascend_pool_node_", 1), f"{doc} Summed over the node's processes, exited ones included.",
     src, split)
    for name, kind, doc, src, split in FAMILIES if kind == "counter")
_FIELDS = tuple(f for _, _, src, split in NODE_COUNTERS for f in ([f"{src}.{k}" for k in POOL_KINDS] if split else [src]))


def _key(s):
    return (str(s.device), s.tenant, "" if s.uid is None else str(s.uid))


def _values(s):
    return tuple(s.values[f] for f in _FIELDS)


class NodeCounters:
    """Adds up the processes' counters read at each scan. Thread-safe."""

    IDLE_KEEP = 256     # (device, tenant, uid) keys no live process has, most recently active kept
    FORGET_S = 600.0    # a process not read for this long (its file removed by someone else) is forgotten
    FOLDED_KEEP = 8192  # exited processes remembered: a file the service may not remove is read again,
                        # a publisher started again (the same instance) goes on from their counts

    def __init__(self):
        self._lock = threading.Lock()
        self._last = {}  # instance -> (monotonic time read, {key: counter values at that read})
        self._totals = collections.OrderedDict()  # key -> [total per NODE_COUNTERS], least recently active first
        self._folded = collections.OrderedDict()  # instance -> {key: values} of those whose final counters are in
        self._started = False

    def update(self, live, exited=()):
        """live: the ProcessStats of a scan; exited: the last publishes of the dead processes' files
        it read (scanner.StatsScanner.scan(exited=))."""
        with self._lock:
            now = time.monotonic()
            if not self._started:
                # The first scan (NodeCollector's, at the service's start): what the processes
                # running then counted before it is not
                # counted again: after a restart of the service, its counters (a reset to
                # Prometheus) would have counted their whole lives once more, and increase() seen
                # yesterday's OOMs as new ones. From 0, only what they count from now on.
                self._started = True
                for p in live:
                    self._last[p.instance] = (now, {_key(s): _values(s) for s in p.samples})
                    for s in p.samples:
                        self._totals.setdefault(_key(s), [0] * len(_FIELDS))
                self._folded.update((p.instance, {_key(s): _values(s) for s in p.samples}) for p in exited)
                return
            active = set()
            for p in live:
                # Folded, and live again: its publisher was stopped (stop_publisher, its file marked
                # exited) and started again, the same instance in the same file, its counters
                # going on from the folded ones. Counted from {}, they were all added twice.
                folded = self._folded.pop(p.instance, None)
                if folded is not None and p.instance not in self._last:
                    self._last[p.instance] = (now, folded)
                # A file over its capacity leaves pairs out for a while: their counts are kept, not
                # counted again when they come back. Otherwise a pair gone was forgotten by the
                # process (PoolAggregator.RETIRED_KEEP) and starts again from 0.
                active |= self._add(p, now, keep_missing=bool(p.flags & L.FLAG_OVERFLOW))
            for p in exited:
                if p.instance in self._folded:
                    continue
                self._add(p, now, keep_missing=False)
                self._folded[p.instance] = self._last.pop(p.instance)[1]  # its counts, should it go on
                while len(self._folded) > self.FOLDED_KEEP:
                    self._folded.popitem(last=False)
            for inst in [i for i, (t, _) in self._last.items() if now - t > self.FORGET_S]:
                del self._last[inst]
            for key in active:
                self._totals.move_to_end(key)
            idle = [k for k in self._totals if k not in active]
            for key in idle[:max(0, len(idle) - self.IDLE_KEEP)]:  # their series end, as a process's do
                del self._totals[key]

    def _add(self, p, now, keep_missing):
        prev = self._last.get(p.instance, (0, {}))[1]
        cur = dict(prev) if keep_missing else {}
        for s in p.samples:
            key, values = _key(s), _values(s)
            before = prev.get(key, (0,) * len(values))
            total = self._totals.setdefault(key, [0] * len(values))
            for i, (v, b) in enumerate(zip(values, before)):
                total[i] += v - b if v >= b else v  # lower: the pair started again from 0
            self._totals.move_to_end(key)
            cur[key] = values
        self._last[p.instance] = (now, cur)
        return set(cur)

    def families(self):
        with self._lock:
            totals = sorted((key, dict(zip(_FIELDS, values))) for key, values in self._totals.items())
        for name, doc, src, split in NODE_COUNTERS:
            fam = CounterMetricFamily(name, doc, labels=["device", "tenant", "uid"] + (["pool"] if split else []))
            for key, values in totals:
                if split:
                    for kind in POOL_KINDS:
                        fam.add_metric([*key, kind], values[f"{src}.{kind}"])
                else:
                    fam.add_metric(list(key), values[src])
            yield fam

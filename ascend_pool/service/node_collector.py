"""NodeCollector: the node service's prometheus_client collector over every publishing process.

At each scrape it reads the stats directory (StatsScanner) and exports
  - the per-tenant families of metrics/schema.py with `pid` and `instance` labels, one series per
    process (the pid is in the process's own pid namespace: two containers' workers are both pid
    1; `instance` is unique on the node), and `pid_here`, its pid in the service's pid namespace
    ('' where the service does not see into the process's: a DaemonSet without hostPID);
  - node totals per (device, tenant, uid) over the live processes (quotas are per user: one
    tenant name used by two users is two tenants): ascend_pool_node_{reserved,allocated,
    requested,cached_free}_bytes and ascend_pool_node_processes (separate names, so that a
    sum() over the per-pid series never counts a total twice);
  - node counters per (device, tenant, uid), ascend_pool_node_<counter>_total: every process's
    counts, those of exited processes included (node_counters.py); rate() over the per-pid
    series misses a process's last counts;
  - the device-wide free/total memory (labels: device), from the most recent publish;
  - the age of each process's last publish, the count of stats files by state, who shares what
    (ascend_pool_shared_bytes, ascend_pool_shared_importers), and the quota ledger's state.
"""

import threading
import time

from prometheus_client.core import GaugeMetricFamily

from ..identity import pids_here
from ..metrics.families import device_families, tenant_families
from ..metrics.ledger import ReclaimedTotals, ledger_families
from ..sharing import shares
from .node_counters import NodeCounters
from .processes import in_use
from .scanner import StatsScanner

NODE_TOTALS = (
    ("ascend_pool_node_reserved_bytes", "Device memory the tenant's processes hold on the node (bytes).",
     ("reserved_bytes.small", "reserved_bytes.large")),
    ("ascend_pool_node_allocated_bytes", "Bytes the tenant's processes have allocated on the node (bytes).",
     ("allocated_bytes.small", "allocated_bytes.large")),
    ("ascend_pool_node_requested_bytes", "Bytes the tenant's processes requested on the node (bytes).",
     ("requested_bytes.small", "requested_bytes.large")),
    ("ascend_pool_node_cached_free_bytes", "Bytes cached free in the tenant's processes on the node (bytes).",
     ("cached_free_bytes",)),
)


class NodeCollector:
    """Collects every live process's published figures. scanner: a StatsScanner (default: the
    stats directory of this environment, files of our own uid)."""

    def __init__(self, scanner=None, ledger=True):
        self.scanner = scanner or StatsScanner()
        self._ledger = ledger
        self._reclaimed = ReclaimedTotals()  # the reclaimed counter never falls while this collector lives
        self.counters = NodeCounters()
        self._scan_lock = threading.Lock()
        self._here_lock = threading.Lock()
        self._here = {}  # instance -> its pid here, once found (fixed for the process's life)
        self.scan()  # the node counters start from here (node_counters.NodeCounters.update)

    def scan(self):
        """The live processes, their counters and the final counters of those that exited added to
        the node counters (also run between scrapes, by serve's sweep thread, so that exited
        processes' files are read and removed while no one scrapes)."""
        with self._scan_lock:  # one scan at a time: the counters are added in the order read
            exited = []
            procs = self.scanner.scan(exited=exited)
            self.counters.update(procs, exited)
        return procs

    def collect(self):
        procs = self.scan()
        samples = [s for p in procs for s in p.samples]
        here = self._pids_here(procs)
        # pidns: the namespace each `pid` is in; what finds a container's pid-1 worker on the host
        # (`lsns -t pid`) where pid_here is '' (a service in a pid namespace of its own)
        yield from tenant_families(samples, with_pid=True, pids_here=here, pidns={p.instance: p.pidns for p in procs})
        used = {(p.pid, p.instance, s.device, s.tenant) for p in procs for s in in_use(p.samples)}
        yield from self._totals(samples, used)
        yield from self.counters.families()
        latest = {}  # device -> (publish_ns, values): the freshest reading of each device
        for p in procs:
            for s in p.samples:
                if s.values["device_total_bytes"] and p.publish_ns >= latest.get(s.device, (-1,))[0]:
                    latest[s.device] = (p.publish_ns, s.values)
        yield from device_families({d: v for d, (_, v) in latest.items()})
        yield from self._health(procs, here)
        yield from self._shares()
        if self._ledger:
            yield from ledger_families(self.scanner.allowed_uids, self.scanner.allowed_gids, self._reclaimed)

    def describe(self):
        return []

    def _pids_here(self, procs):
        """{instance: pid in this service's pid namespace} of the processes it sees into (as ps's
        PID_HERE, identity.pids_here). A pid found is kept for the process's life: a label value
        that came and went would split its series."""
        with self._here_lock:
            known = {p.instance: self._here[p.instance] for p in procs if p.instance in self._here}
            todo = {p.path: (p.pid, p.pidns) for p in procs if p.instance not in known}
            if todo:
                found = pids_here(todo)
                known.update((p.instance, found[p.path]) for p in procs if p.path in found)
            self._here = known  # the processes gone are forgotten
            return dict(known)

    @staticmethod
    def _totals(samples, in_use_keys):
        sums, procs = {}, {}
        for s in samples:
            key = (s.device, s.tenant, "" if s.uid is None else str(s.uid))
            acc = sums.setdefault(key, [0] * len(NODE_TOTALS))
            for i, (_, _, fields) in enumerate(NODE_TOTALS):
                acc[i] += sum(s.values[f] for f in fields)
            live = procs.setdefault(key, set())
            if (s.pid, s.instance, s.device, s.tenant) in in_use_keys:  # as `ps` lists them (processes.in_use)
                live.add((s.pid, s.instance))
        labels = ["device", "tenant", "uid"]
        for i, (name, doc, _) in enumerate(NODE_TOTALS):
            fam = GaugeMetricFamily(name, doc, labels=labels)
            for (device, tenant, uid), acc in sorted(sums.items()):
                fam.add_metric([str(device), tenant, uid], acc[i])
            yield fam
        fam = GaugeMetricFamily("ascend_pool_node_processes",
                                "Live processes using the device for the tenant: an open pool of it (not a tenant context's "
                                "empty base default pool), as `ascend-pool ps` lists them.", labels=labels)
        for (device, tenant, uid), pids in sorted(procs.items()):
            fam.add_metric([str(device), tenant, uid], len(pids))
        yield fam

    def _shares(self):
        """Who shares what (ascend_pool.sharing's records, of every user and group the service
        trusts): bytes exported and live importers."""
        shared = GaugeMetricFamily("ascend_pool_shared_bytes",
                                   "Device memory exported for other processes, counted once against the "
                                   "exporting tenant (bytes).",
                                   labels=["device", "tenant", "exporter_pid", "exporter_instance", "state"])
        importers = GaugeMetricFamily("ascend_pool_shared_importers",
                                      "Live processes that have a shared block open.",
                                      labels=["device", "tenant", "exporter_pid", "exporter_instance"])
        try:
            records = shares(uids=self.scanner.allowed_uids, gids=self.scanner.allowed_gids)
        except OSError:  # no record directory yet: nothing is shared
            records = []
        # One series per label set: an exporter's blocks add up (Prometheus keeps one sample of
        # duplicates), and its importers count once however many of its blocks they opened.
        nbytes, opened = {}, {}
        for r in records:
            if not r["exporter_alive"]:
                continue  # a dead exporter's record (removed by shares() where it may): shared by nobody
            labels = (str(r["device"]), r["tenant"] or "default", str(r["exporter_pid"]), r["exporter_instance"])
            nbytes[labels + (r["state"],)] = nbytes.get(labels + (r["state"],), 0) + r["nbytes"]
            opened.setdefault(labels, set()).update(r["importer_instances"])  # pids repeat across containers
        for labels, n in sorted(nbytes.items()):
            shared.add_metric(list(labels), n)
        for labels, pids in sorted(opened.items()):
            importers.add_metric(list(labels), len(pids))
        yield shared
        yield importers

    def _health(self, procs, here):
        now = time.time_ns()
        age = GaugeMetricFamily("ascend_pool_stats_age_seconds",
                                "Seconds since the process last published its figures (seconds).",
                                labels=["pid", "instance", "pid_here", "pidns"])
        for p in procs:
            age.add_metric([str(p.pid), p.instance, str(here.get(p.instance, "")), str(p.pidns or "")],
                           max(0.0, (now - p.publish_ns) / 1e9))
        yield age
        files = GaugeMetricFamily("ascend_pool_service_stats_files",
                                  "Stats files seen at the last scrape, by state (live, stale, refused, busy, "
                                  "other_version: another ascend_pool build's live process, a rolling upgrade).",
                                  labels=["state"])
        for state, n in sorted(self.scanner.counts.items()):
            files.add_metric([state], n)
        yield files

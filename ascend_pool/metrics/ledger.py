"""The node quota ledgers' state as metrics: each tenant's node-wide held bytes, quota, peak,
refusals, live processes and quota conflicts per device, as the ledger (ascend_pool.tenants.ledger)
enforces them. Tenants without a live process are not exported (they no longer exist on the node).

The ledger is the authority on quotas across processes; the per-process figures only show each
process's share. Each file is read at each scrape into a private copy (ascend_pool.tenants.ledger.
read_view: pread, never mapped, never locked), so a ledger another user truncates, replaces or
keeps locked costs the scrape nothing but its own series; a ledger that cannot be read is skipped
with one log line: the exporter never fails a scrape over it. Only this user's (or group's) ledgers of the
current node are read: for the simulator, the node of $ASCEND_SIM_NODE.

ascend_pool_tenant_ledgers counts the ledgers a tenant has live processes in: more than one (one
tenant's containers running as several uids without one ASCEND_POOL_LEDGER_GROUP) grants it its
quota once in each, which a node service trusting those users logs once (tenant, uids).

ascend_pool_ledger_reclaimed_bytes adds up the ledgers' own counts; a collector that keeps a
ReclaimedTotals keeps what a ledger removed or replaced since had counted, so the counter never
goes down while it runs (Prometheus would read a fall as a reset: rate() spikes).
"""

import logging
import os
import threading

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .. import identity
from ..tenants import ledger as L

log = logging.getLogger(__name__)
_warned = set()


def _views(uids=(), gids=()):
    """([(backend, scope, view, path, identity)] of the ledgers read, the set of paths listed,
    {(backend, device): paths} of other builds' ledgers (another format version) still held)."""
    out, listed, other = [], set(), {}
    try:
        files = L.ledger_files(None, uids, gids)
    except Exception as e:  # no ledger directory yet, or a bad $ASCEND_POOL_LEDGER_GROUP
        _warn_once(("dir", str(e)), "cannot list the quota ledgers: %s", e)
        return [], listed, other
    for path, device, backend, node, group, owner in files:
        if backend == "sim" and node != L.node_name("sim"):
            continue  # another simulated node (another test run, another demo)
        # Whose ledger: a user's private one (its uid), or a group's shared one (its gid); both the
        # host's, as the file's name (group is this namespace's view of the gid, to open it with).
        scope = ("" if owner is None else str(owner), "" if group is None else str(identity.host_gid(group)))
        listed.add(path)
        try:
            st = os.stat(path, follow_symlinks=False)  # before the read: a file replaced between shows as a fall
            out.append((backend, scope, L.read_view(path, device, backend, node, group, owner), path,
                        (st.st_dev, st.st_ino)))
        except Exception as e:  # foreign, malformed, or of another version: refused by the ledger code
            version = L.other_version_held(path, group)
            if version is not None:  # another build's, in use (a rolling upgrade): counted, its own line
                other.setdefault((backend, str(device)), set()).add(path)
                _warn_once((path, "version", version), "quota ledger %s is of format version %d, another "
                           "ascend_pool build's, which live processes still hold: its tenants are not exported, "
                           "and this build's processes book apart from them until they are gone "
                           "(ascend_pool_ledger_other_versions)", path, version)
                continue
            _warn_once((path, str(e)), "cannot read the quota ledger %s: %s", path, e)
    return out, listed, other


class ReclaimedTotals:
    """ascend_pool_ledger_reclaimed_bytes per (backend, device) over a collector's life: the ledgers'
    counts now, plus what ledgers removed or replaced since had counted (else the sum falls when
    one goes). A ledger listed but unreadable for a scrape counts with its last reading. Memory:
    one entry per ledger listed, per (backend, device), and the last VANISHED_KEEP ledgers gone (a
    directory that could not be listed for one scrape brings them back, not counted twice)."""

    VANISHED_KEEP = 256

    def __init__(self):
        # Held over the read too: two scrapes at once must not book an older reading after a newer one.
        self.lock = threading.Lock()
        self._last = {}      # path -> (identity, backend, device, bytes): its last reading
        self._gone = {}      # (backend, device) -> bytes of ledgers gone
        self._vanished = {}  # path -> its last reading, when it went (oldest first)

    def _fold(self, reading):
        _, backend, dev, n = reading
        self._gone[(backend, dev)] = self._gone.get((backend, dev), 0) + n

    def update(self, readings, listed):
        """readings: [(path, identity, backend, device, bytes)] read now; listed: every path listed
        now. Returns {(backend, device): bytes}. Call with the lock held."""
        for path, ident, backend, dev, n in readings:
            old = self._last.get(path)
            back = self._vanished.pop(path, None)
            if old is None and back is not None and back[0] == ident and n >= back[3]:
                self._gone[(back[1], back[2])] -= back[3]  # the same file, back: counted by its reading again
            elif old is not None and (old[0] != ident or n < old[3]):
                self._fold(old)  # another file at the path (or one reset): the old one's bytes stay
            self._last[path] = (ident, backend, dev, n)
        for path in [p for p in self._last if p not in listed]:  # removed (or its directory unreadable)
            reading = self._last.pop(path)
            self._fold(reading)
            self._vanished[path] = reading
            while len(self._vanished) > self.VANISHED_KEEP:
                del self._vanished[next(iter(self._vanished))]
        totals = dict(self._gone)
        for _, backend, dev, n in self._last.values():
            totals[(backend, dev)] = totals.get((backend, dev), 0) + n
        return totals


def _warn_once(key, fmt, *args):
    if key not in _warned:
        _warned.add(key)
        log.warning(fmt, *args)


def ledger_families(uids=(), gids=(), reclaimed_totals=None):
    """ascend_pool_ledger_* families (labels backend, device, tenant, and whose ledger: uid for a
    user's own, gid for a group's shared one, the other empty; the host's ids, as the files' names
    hold them); empty without ledgers. A quota
    is per ledger, so one tenant name in two users' ledgers is two series. uids, gids: also the
    ledgers of these trusted users and groups (the node service's). reclaimed_totals: the
    collector's ReclaimedTotals (without one, the reclaimed bytes of the ledgers there now)."""
    totals = reclaimed_totals or ReclaimedTotals()
    with totals.lock:
        views, listed, other = _views(uids, gids)
        reclaimed_by = totals.update([(path, ident, backend, str(v["device"]), v["reclaimed_bytes"])
                                      for backend, _, v, path, ident in views], listed)
    if not views and not reclaimed_by and not other:
        return []
    labels = ["backend", "device", "tenant", "uid", "gid"]
    held = GaugeMetricFamily("ascend_pool_ledger_held_bytes",
                             "Bytes the tenant holds on the device across all its processes on the node (quota ledger, bytes).",
                             labels=labels)
    quota = GaugeMetricFamily("ascend_pool_ledger_quota_bytes",
                              "The tenant's node-wide quota on the device as the ledger enforces it (bytes).", labels=labels)
    peak = GaugeMetricFamily("ascend_pool_ledger_peak_bytes",
                             "The most the tenant has held on the device node-wide, over the life of its ledger "
                             "entry (bytes).", labels=labels)
    refusals = CounterMetricFamily("ascend_pool_ledger_refusals",
                                   "Segment reservations the ledger refused for the tenant (over quota), node-wide, "
                                   "over the life of its ledger entry (kept while it has no process).",
                                   labels=labels)
    procs = GaugeMetricFamily("ascend_pool_ledger_processes",
                              "Live processes holding a share of the tenant's quota on the device.", labels=labels)
    conflicts = CounterMetricFamily("ascend_pool_quota_conflicts",
                                    "Quota declarations for the tenant that disagreed with the quota in force on the "
                                    "device (the operator's tenants file wins, else the stricter), node-wide.",
                                    labels=labels)
    ledgers = GaugeMetricFamily("ascend_pool_tenant_ledgers",
                                "Quota ledgers (one per user, or per ASCEND_POOL_LEDGER_GROUP group) holding live "
                                "processes of the tenant on the device: more than 1, each grants the tenant its whole "
                                "quota (containers of one tenant running as several uids without one "
                                "ASCEND_POOL_LEDGER_GROUP).", labels=["backend", "device", "tenant"])
    reclaimed = CounterMetricFamily("ascend_pool_ledger_reclaimed_bytes",
                                    "Bytes given back from processes that died holding them (bytes).",
                                    labels=["backend", "device"])
    versions = GaugeMetricFamily("ascend_pool_ledger_other_versions",
                                 "Quota ledgers of another ascend_pool format version (another build's: a rolling "
                                 "upgrade) that live processes still hold on the device: while more than 0, that "
                                 "build's processes book their tenants apart from this build's, each ledger granting "
                                 "a tenant its whole quota.", labels=["backend", "device"])
    seen = set()
    scopes = {}  # (backend, device, tenant) -> the ledgers (uid, gid) with a live process of it
    for backend, scope, v, _, _ in views:
        dev = str(v["device"])
        alive = {}  # tenant -> instances of its live processes: one slot per context, a process may hold several
        for s in v["slots"]:
            if s.get("alive") is not False:
                alive.setdefault(s["tenant"], set()).add(s["instance"])
        for t in v["tenants"]:
            if not alive.get(t["name"]):
                continue  # no live process: the tenant no longer exists on the node (its entry is reused)
            lv = [backend, dev, t["name"], *scope]
            if tuple(lv) in seen:
                continue  # one ledger listed twice (own directory and a trusted one)
            seen.add(tuple(lv))
            scopes.setdefault((backend, dev, t["name"]), set()).add(scope)
            held.add_metric(lv, t["held_bytes"])
            peak.add_metric(lv, t["peak_bytes"])
            refusals.add_metric(lv, t["refusals"])
            procs.add_metric(lv, len(alive[t["name"]]))
            if t["quota_bytes"] is not None:
                quota.add_metric(lv, t["quota_bytes"])
            conflicts.add_metric(lv, t.get("conflicts", 0))
    for (backend, dev, tenant), where in sorted(scopes.items()):
        ledgers.add_metric([backend, dev, tenant], len(where))
        if len(where) > 1:
            _warn_split(backend, dev, tenant, where)
    for (backend, dev), n in sorted(reclaimed_by.items()):
        reclaimed.add_metric([backend, dev], n)
    devices = {(b, str(v["device"])) for b, _, v, _, _ in views} | set(other)
    for backend, dev in sorted(devices):  # 0 where every ledger is this build's: an alert can watch it
        versions.add_metric([backend, dev], len(other.get((backend, dev), ())))
    return [held, quota, peak, refusals, procs, conflicts, ledgers, reclaimed, versions]


def _warn_split(backend, dev, tenant, scopes):
    """One log line per tenant and set of ledgers: a tenant with live processes in the ledgers of
    several users (or groups) is granted its quota once in each, and no process can tell (none may
    read another user's directory); a node service trusting those users (--allow-uid) can."""
    names = ", ".join(f"uid {u}" if u else f"group {g}" for u, g in sorted(scopes, key=lambda s: (not s[0], s)))
    _warn_once(("split", backend, dev, tenant, frozenset(scopes)),
               "tenant %r on %s device %s has live processes in %d quota ledgers (%s): each grants it its whole "
               "quota, so together they may hold %d times it; if they are one tenant's processes (containers "
               "running as different uids), give them all one ASCEND_POOL_LEDGER_GROUP so that they book in one "
               "ledger (docs/containers.md, \"One quota per tenant on a node\")",
               tenant, backend, dev, len(scopes), names, len(scopes))


def sweep_dead_processes(uids=(), gids=()):
    """Gives back the ledger shares of processes that died (the node service runs this
    periodically). Returns the bytes reclaimed; 0 when there is no ledger support."""
    total = 0
    for r in L.sweep(None, uids, gids):
        if "error" in r:
            _warn_once((r["path"], r["error"]), "cannot sweep the quota ledger %s: %s (skipped for %g s, then "
                       "tried again; logged once)", r["path"], r["error"], L.RETRY_AFTER_S)
        elif r["bytes"]:
            log.info("reclaimed %d bytes of %d dead process(es) in %s", r["bytes"], r["slots"], r["path"])
            total += r["bytes"]
    return total


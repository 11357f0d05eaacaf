"""The node service's counters per (device, tenant, uid), ascend_pool_node_<counter>_total: every
process's counts reach them, the last ones of a process that exits right after them included
(its file is left marked exited with its final counters) and those of a process that lived
less than one scan; they never go down, and tenants no live process has are bounded."""

import os
import subprocess
import sys
import time

from ascend_pool.metrics.sample import TenantSample
from ascend_pool.metrics.schema import FIELDS
from ascend_pool.service import layout as L
from ascend_pool.service.node_collector import NodeCollector
from ascend_pool.service.node_counters import NodeCounters
from ascend_pool.service.reader import ProcessStats
from ascend_pool.service.scanner import StatsScanner

import ascend_pool as _ap

_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(_ap.__file__)))

_OOM_THEN_EXIT = """
import sys, time
import ascend_pool as ap
from ascend_pool.service import publisher
p = ap.Pool(0, backend="sim")
publisher.ensure_publisher()
time.sleep(float(sys.argv[1]))  # a few publishes: the service sees the process (or none)
try:
    p.malloc(1 << 50)
except ap.OutOfMemoryError:
    pass
time.sleep(0.05)  # exits before its next publish
"""


def _node_counter(collector, name):
    for fam in collector.collect():
        if fam.name == name:
            return {(s.labels["device"], s.labels["tenant"]): s.value for s in fam.samples if s.name.endswith("_total")}
    return None


def test_an_exited_processs_last_counts_reach_the_node_counters(tmp_path):
    env = dict(os.environ, ASCEND_POOL_STATS_DIR=str(tmp_path), ASCEND_POOL_STATS_INTERVAL="0.25",
               ASCEND_POOL_STATS="1", ASCEND_POOL_BACKEND="sim",
               PYTHONPATH=os.pathsep.join(filter(None, [_PKG_PARENT, os.environ.get("PYTHONPATH")])))
    env.pop("ASCEND_POOL_TENANT", None)
    collector = NodeCollector(StatsScanner(str(tmp_path)), ledger=False)
    for seen_first in ("0.6", "0"):  # one the service saw live, one it never did
        proc = subprocess.Popen([sys.executable, "-c", _OOM_THEN_EXIT, seen_first], env=env)
        while proc.poll() is None:  # scrapes as often as a busy Prometheus would, and more
            collector.collect()
            time.sleep(0.02)
        assert proc.returncode == 0
    assert _node_counter(collector, "ascend_pool_node_ooms") == {("0", "default"): 2}
    assert [n for _, _, names in os.walk(tmp_path) for n in names] == []  # read, then removed


def _proc(instance, values_by_key, flags=0):
    p = ProcessStats(1, 1000, 0, time.time_ns(), flags, "", instance=instance)
    p.samples = [TenantSample(d, t, {**dict.fromkeys(FIELDS, 0), **v}, 1, instance, uid=1000)
                 for (d, t), v in values_by_key.items()]
    return p


def _ooms(counters):
    fam = next(f for f in counters.families() if f.name == "ascend_pool_node_ooms")
    return {s.labels["tenant"]: s.value for s in fam.samples}


def test_node_counters_add_increments_once_and_never_go_down():
    c = NodeCounters()
    c.update([])  # the service's first scan
    c.update([_proc("a", {(0, "t"): {"ooms": 2}}), _proc("b", {(0, "t"): {"ooms": 1}})])
    c.update([_proc("a", {(0, "t"): {"ooms": 5}}), _proc("b", {(0, "t"): {"ooms": 1}})])
    assert _ooms(c) == {"t": 6}
    # b exits with one more; its final publish is read twice (a file the service may not remove)
    c.update([_proc("a", {(0, "t"): {"ooms": 5}})], [_proc("b", {(0, "t"): {"ooms": 2}}, L.FLAG_EXITED)])
    c.update([_proc("a", {(0, "t"): {"ooms": 5}})], [_proc("b", {(0, "t"): {"ooms": 2}}, L.FLAG_EXITED)])
    assert _ooms(c) == {"t": 7}
    # a's pair was forgotten by the process and opened again: it starts again from 0
    c.update([_proc("a", {(0, "u"): {"ooms": 1}})])
    c.update([_proc("a", {(0, "t"): {"ooms": 1}, (0, "u"): {"ooms": 1}})])
    assert _ooms(c) == {"t": 8, "u": 1}
    # a file over its capacity leaves a pair out for a while: not counted again when it is back
    c.update([_proc("a", {(0, "u"): {"ooms": 1}}, L.FLAG_OVERFLOW)])
    c.update([_proc("a", {(0, "t"): {"ooms": 3}, (0, "u"): {"ooms": 1}}, L.FLAG_OVERFLOW)])
    assert _ooms(c) == {"t": 10, "u": 1}


def test_a_publisher_stopped_and_started_again_is_not_counted_twice():
    # service.stop_publisher() leaves the file marked exited with the process's counters, and the
    # next ensure_publisher() (the next pool's) makes the same instance's file again, its counters
    # going on: read live again after the fold, they were all added once more, and its second
    # exit was taken for the first one's file read again.
    c = NodeCounters()
    c.update([])
    c.update([_proc("a", {(0, "t"): {"ooms": 1}})])
    c.update([], [_proc("a", {(0, "t"): {"ooms": 1}}, L.FLAG_EXITED)])
    c.update([_proc("a", {(0, "t"): {"ooms": 1}})])
    assert _ooms(c) == {"t": 1}
    c.update([_proc("a", {(0, "t"): {"ooms": 2}})])
    c.update([], [_proc("a", {(0, "t"): {"ooms": 3}}, L.FLAG_EXITED)])
    assert _ooms(c) == {"t": 3}


def test_what_processes_counted_before_the_service_started_is_not_counted_again():
    # A restart of the service is a counter reset: had it counted the running processes' whole
    # lives again, increase() would see their old OOMs as new ones (and the OOM alert fire).
    c = NodeCounters()
    c.update([_proc("a", {(0, "t"): {"ooms": 5}})], [_proc("old", {(0, "t"): {"ooms": 3}}, L.FLAG_EXITED)])
    assert _ooms(c) == {"t": 0}
    c.update([_proc("a", {(0, "t"): {"ooms": 6}}), _proc("b", {(0, "t"): {"ooms": 2}})],
             [_proc("old", {(0, "t"): {"ooms": 3}}, L.FLAG_EXITED)])
    assert _ooms(c) == {"t": 3}  # a's new one, and all of b, started since


def test_node_counters_of_tenants_without_processes_are_bounded():
    c = NodeCounters()
    c.update([])
    keep = NodeCounters.IDLE_KEEP
    for i in range(keep + 50):  # a tenant per job, each job a process that exits
        c.update([], [_proc(f"p{i}", {(0, f"job{i}"): {"ooms": 1}}, L.FLAG_EXITED)])
    got = _ooms(c)
    assert len(got) == keep and "job49" not in got and "job50" in got and f"job{keep + 49}" in got
    # a dropped tenant back in a live process: its series starts again (a reset, as a new pod's)
    c.update([_proc("live", {(0, "job0"): {"ooms": 1}})])
    got = _ooms(c)
    assert len(got) == keep + 1 and got["job0"] == 1 and "job50" in got

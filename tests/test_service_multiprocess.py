"""The node service across processes: two tenant processes that only open pools and allocate
appear in `ascend-pool serve`'s /metrics with their pids and exact figures, the quota ledger shows
their tenants, and a process that exits or is SIGKILLed disappears (its stats file removed once
read, its ledger share given back, its counts kept in the node counters)."""

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from metrics_scrape import scrape, series, start_serve  # noqa: E402

import ascend_pool as _ap

# children import the same build as this process (installed package or in-place tree)
_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(_ap.__file__)))

MiB = 1 << 20

TENANT_PROCESS = r"""
import os, sys
import ascend_pool as ap
from ascend_pool.service import publisher


tenant, quota, large, n_large, small, n_small = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
pool = ap.Pool(0, backend="sim")
ctx = pool.context(tenant, quota=quota)
ptrs = [ctx.malloc(large) for _ in range(n_large)] + [ctx.malloc(small) for _ in range(n_small)]
p = publisher.current()
if p is None:
    print("NO-PUBLISHER: opening a pool did not start the stats publisher", flush=True)
    sys.exit(3)
p.publish_now()
print("READY", os.getpid(), flush=True)
sys.stdin.readline()  # until the test says so
"""


def env_for(tmp_path):
    env = dict(os.environ)
    env.update(ASCEND_POOL_STATS="1", ASCEND_POOL_STATS_DIR=str(tmp_path / "stats"), ASCEND_POOL_LEDGER_DIR=str(tmp_path / "ledger"),
               ASCEND_SIM_NODE=f"mp{uuid.uuid4().hex[:10]}", ASCEND_POOL_BACKEND="sim",
               PYTHONPATH=os.pathsep.join(filter(None, [_PKG_PARENT, env.get("PYTHONPATH")])))
    env.pop("ASCEND_POOL_TENANT", None)
    env.pop("ASCEND_POOL_CONFIG", None)
    (tmp_path / "stats").mkdir()
    (tmp_path / "ledger").mkdir()
    return env


def one(samples, name, **labels):
    found = series(samples, name, **labels)
    assert len(found) == 1, f"{name}{labels}: {found}"
    return next(iter(found.values()))


def stats_file(stats, samples, pid):
    """The stats file of the process `pid`: named by its `instance` label (pids repeat across pid
    namespaces), in the user's private directory inside the stats directory."""
    (labels,) = series(samples, "ascend_pool_stats_age_seconds", pid=pid)
    return stats / f"ascend_pool-u{os.geteuid()}" / f"ascend_pool-stats-{dict(labels)['instance']}"


def wait_for(predicate, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def start_tenant(env, tenant, quota, large, n_large, small, n_small):
    proc = subprocess.Popen([sys.executable, "-c", TENANT_PROCESS, tenant, quota, str(large), str(n_large),
                             str(small), str(n_small)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    line = proc.stdout.readline()
    if not line.startswith("READY"):
        proc.kill()
        raise AssertionError(f"tenant process {tenant} failed: {line}{proc.stdout.read()}")
    return proc


@pytest.fixture
def node(tmp_path):
    env = env_for(tmp_path)
    serve, port = start_serve(env, tmp_path / "serve.log", "--sweep-interval", "0.3")
    procs = []
    yield env, port, procs, tmp_path / "stats"
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    serve.send_signal(signal.SIGTERM)
    serve.wait(timeout=10)


def test_two_tenant_processes_then_exit_and_kill(node):
    env, port, procs, stats = node
    a = start_tenant(env, "online", "1GiB", 4 * MiB, 3, 1000, 5)
    b = start_tenant(env, "batch", "512MiB", 8 * MiB, 2, 100, 7)
    procs += [a, b]

    s = wait_for(lambda: (lambda m: m if series(m, "ascend_pool_requested_bytes", pid=a.pid)
                          and series(m, "ascend_pool_requested_bytes", pid=b.pid) else None)(scrape(port)),
                 "both tenant processes in /metrics")
    for proc, tenant, quota, large, n_large, small, n_small in ((a, "online", 1 << 30, 4 * MiB, 3, 1000, 5),
                                                                 (b, "batch", 512 * MiB, 8 * MiB, 2, 100, 7)):
        lab = dict(pid=proc.pid, device=0, tenant=tenant)
        assert one(s, "ascend_pool_requested_bytes", pool="large", **lab) == large * n_large
        assert one(s, "ascend_pool_requested_bytes", pool="small", **lab) == small * n_small
        assert one(s, "ascend_pool_allocations_total", pool="large", **lab) == n_large
        assert one(s, "ascend_pool_allocations_total", pool="small", **lab) == n_small
        allocated = sum(series(s, "ascend_pool_allocated_bytes", **lab).values())
        reserved = sum(series(s, "ascend_pool_reserved_bytes", **lab).values())
        assert large * n_large + small * n_small <= allocated <= reserved
        assert one(s, "ascend_pool_quota_bytes", **lab) == quota
        assert one(s, "ascend_pool_device_mallocs_total", **lab) >= 1
        assert one(s, "ascend_pool_node_processes", device=0, tenant=tenant) == 1
        assert one(s, "ascend_pool_node_requested_bytes", device=0, tenant=tenant) == large * n_large + small * n_small
        assert one(s, "ascend_pool_ledger_held_bytes", device=0, tenant=tenant) == reserved
        assert one(s, "ascend_pool_ledger_quota_bytes", device=0, tenant=tenant) == quota
        assert one(s, "ascend_pool_ledger_processes", device=0, tenant=tenant) == 1
        assert 0 <= one(s, "ascend_pool_stats_age_seconds", pid=proc.pid) < 5
    assert one(s, "ascend_pool_device_total_bytes", device=0) > 0
    assert one(s, "ascend_pool_service_stats_files", state="live") == 2
    file_a, file_b = stats_file(stats, s, a.pid), stats_file(stats, s, b.pid)

    # A exits normally: its series vanish; its file, left marked exited with its final counters,
    # is read into the node counters and removed by the service.
    a.stdin.write("\n")
    a.stdin.flush()
    assert a.wait(timeout=10) == 0
    wait_for(lambda: not series(scrape(port), "ascend_pool_reserved_bytes", pid=a.pid), "exited process gone")
    wait_for(lambda: not file_a.exists(), "the exited process's file removed by the service")
    assert sum(series(scrape(port), "ascend_pool_node_allocations_total", device=0, tenant="online").values()) == 3 + 5

    # B is killed: its file stays behind until the service notices the process is gone.
    assert file_b.exists()
    b.send_signal(signal.SIGKILL)
    b.wait(timeout=10)
    wait_for(lambda: not series(scrape(port), "ascend_pool_reserved_bytes", pid=b.pid), "killed process gone")
    assert not file_b.exists()
    assert sum(series(scrape(port), "ascend_pool_node_allocations_total", device=0, tenant="batch").values()) == 2 + 7
    # And its share of the quota ledger is given back by the service's sweep.
    # Its tenant has no live process left: it no longer exists on the node, and is not exported.
    wait_for(lambda: not series(scrape(port), "ascend_pool_ledger_held_bytes", device=0, tenant="batch"),
             "the killed process's ledger share reclaimed")
    s = scrape(port)
    assert not series(s, "ascend_pool_ledger_processes", device=0, tenant="batch")
    assert not series(s, "ascend_pool_node_processes")
    assert one(s, "ascend_pool_service_stats_files", state="live") == 0

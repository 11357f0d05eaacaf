"""ap.list_gpu_processes(device): torch.cuda.list_gpu_processes' text for the node's ascend_pool
processes (issue 18: what torch has that we lacked), from their stats files and this process's own
pools: a header line, then one line per process with its pid and MB held."""
import os
import re
import subprocess
import sys
import time

import pytest

import ascend_pool as ap

MiB = 1 << 20

CHILD = r"""
import os, sys, ascend_pool as ap
pool = ap.Pool(0)
ctx = pool.context("far", quota="1GiB")
held = ctx.malloc(40 << 20)
print(os.getpid(), ctx.memory_stats()["reserved_bytes.all.current"], flush=True)
sys.stdin.readline()
"""


def _lines(device):
    text = ap.list_gpu_processes(device)
    head, *rest = text.splitlines()
    # the pid here of a process of this pid namespace is its pid
    return head, {int(m.group(1)): (float(m.group(2)), m.group(3)) for m in
                  (re.fullmatch(r"process +(\d+) uses +([\d.]+) MB NPU memory \(tenant (.+), instance [0-9a-f]{16}, "
                                r"pid here \1\)", ln) for ln in rest) if m}, rest


def test_lists_another_processs_memory_and_its_own():
    env = dict(os.environ, ASCEND_POOL_STATS="1", ASCEND_POOL_STATS_INTERVAL="0.1")
    child = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    pool = ap.Pool(1)
    try:
        pid, reserved = map(int, child.stdout.readline().split())
        head, procs, _ = _lines("npu:1")
        assert head == "NPU:1" and procs == {} or pid not in procs  # nothing of ours on device 1 yet
        ptr = pool.malloc(3 * MiB)
        _, procs, _ = _lines(1)
        assert procs[os.getpid()] == (pool.memory_stats()["reserved_bytes.all.current"] / MiB, "default")
        deadline = time.monotonic() + 10
        while _lines(0)[1].get(pid, (0,))[0] != reserved / MiB and time.monotonic() < deadline:  # next publish
            time.sleep(0.1)
        head, procs, rest = _lines(0)
        assert head == "NPU:0" and procs[pid] == (reserved / MiB, "far")
        assert reserved >= 40 * MiB
        # the pool the context was made from holds nothing: no "0 MB (tenant default)" row for it
        assert [ln for ln in rest if f"process {pid:>10d} " in ln] == [ln for ln in rest if "tenant far" in ln]
        from ascend_pool.service.processes import rows
        assert [r["tenant"] for r in rows() if r["instance"] and r["pid"] == pid] == ["far"]
        pool.free(ptr)
    finally:
        child.stdin.close()
        child.wait(timeout=30)
        pool.close()


def test_an_idle_device_says_no_processes_are_running():
    assert ap.list_gpu_processes(7).splitlines() == ["NPU:7", "no processes are running"]


@pytest.mark.parametrize("device", [99, -1, "cpu", True])
def test_a_device_that_does_not_exist_is_refused(device):
    with pytest.raises(ap.InvalidDeviceError):
        ap.list_gpu_processes(device)


CLOSER = r"""
import os, sys, time, ascend_pool as ap
pool = ap.Pool(0)
gone, kept = pool.context("per-request"), pool.context("serving")
x = gone.malloc(4 << 20)
kept.malloc(6 << 20)
time.sleep(0.5)                       # published while open
gone.free(x)
gone.close()                          # the request is done
print(os.getpid(), flush=True)
sys.stdin.readline()
"""


def test_a_tenant_whose_contexts_closed_is_no_longer_listed_or_counted():
    # A process keeps the counters of a tenant whose contexts it closed (exported counters never
    # go down), but it no longer uses the device for that tenant: `ps`, list_gpu_processes and
    # the node service's process count leave it out (before: a 0-byte row and a live process).
    from ascend_pool.service.node_collector import NodeCollector
    from ascend_pool.service.processes import rows

    env = dict(os.environ, ASCEND_POOL_STATS="1", ASCEND_POOL_STATS_INTERVAL="0.1")
    child = subprocess.Popen([sys.executable, "-c", CLOSER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        pid = int(child.stdout.readline())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            tenants = {r["tenant"] for r in rows() if r["pid"] == pid}
            if "per-request" not in tenants and "serving" in tenants:
                break
            time.sleep(0.1)
        assert tenants == {"serving"}  # the open pool the contexts were made from holds nothing: no row
        listed = {(r["pid"], r["instance"]) for r in rows() if r["device"] == 0 and r["tenant"] == "default"}
        counts = {tuple(s.labels[k] for k in ("tenant",)): s.value
                  for fam in NodeCollector(ledger=False).collect() if fam.name == "ascend_pool_node_processes"
                  for s in fam.samples if s.labels["device"] == "0"}
        assert counts.get(("per-request",), 0) == 0 and counts[("serving",)] >= 1
        # the child's empty base pool is no process of tenant "default" here either: `ps` and the
        # count agree (other processes of the node may use tenant "default": counted as listed)
        assert counts.get(("default",), 0) == len(listed), (counts, listed)
    finally:
        child.stdin.close()
        child.wait(timeout=30)


TWO_DEVICES = r"""
import os, sys, ascend_pool as ap
idle, busy = ap.Pool(0), ap.Pool(1)
x = busy.malloc(8 << 20)
print(os.getpid(), flush=True)
sys.stdin.readline()
"""


def test_an_empty_pool_on_one_device_is_listed_there_whatever_the_process_holds_on_another():
    # A process's empty default pool is hidden only beside its tenant contexts on the same device:
    # alone on device 0 it is the process's use of device 0, as for a process with no other pool
    # (before, its busy pool on device 1 hid it from device 0's `ps`, list_gpu_processes and count).
    from ascend_pool.service.node_collector import NodeCollector
    from ascend_pool.service.processes import rows

    env = dict(os.environ, ASCEND_POOL_STATS="1", ASCEND_POOL_STATS_INTERVAL="0.1")
    child = subprocess.Popen([sys.executable, "-c", TWO_DEVICES], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        pid = int(child.stdout.readline())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            listed = sorted((r["device"], r["tenant"]) for r in rows() if r["pid"] == pid)
            if (1, "default") in listed:
                break
            time.sleep(0.1)
        assert listed == [(0, "default"), (1, "default")]
        assert pid in _lines(0)[1] and pid in _lines(1)[1]
        # the node service counts it on both devices, as `ps` lists (other processes may count too)
        table = rows()
        counts = {s.labels["device"]: s.value for fam in NodeCollector(ledger=False).collect()
                  if fam.name == "ascend_pool_node_processes" for s in fam.samples if s.labels["tenant"] == "default"}
        for device in (0, 1):
            assert counts[str(device)] == len([r for r in table if (r["device"], r["tenant"]) == (device, "default")])
    finally:
        child.stdin.close()
        child.wait(timeout=30)

"""Shares of dead processes: reclaimed by the next reserve that needs the room, or by the sweep the
node service runs; a process is identified by its lease (ascend_pool.identity), never by a pid; a
process killed inside a reserve or release leaves bytes whose move nobody can know, counted (never
given away) until the same reclaim makes the tenant's counter exact from its live slots."""

import os
import signal
import struct
import subprocess
import sys
import textwrap
import time

import pytest

import ascend_pool as ap
from ascend_pool.tenants import sweep
from ascend_pool.errors import BackendUnavailableError

sys.path.insert(0, os.path.dirname(__file__))
from quota_fixtures import MiB, base, ledger_dir  # noqa: E402,F401  (pytest fixtures)
from sim_fixtures import NS, needs_unshare  # noqa: E402

PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(ap.__file__)))
TENANTS_AT, TENANT_SIZE, SLOTS_AT, SLOT_SIZE = 256, 128, 256 + 64 * 128, 64

HOLDER = """
    import sys, time
    import ascend_pool as ap
    ctx = ap.Pool(0).context(sys.argv[1], quota=int(sys.argv[2]))
    p = ctx.malloc(int(sys.argv[3]))
    print("ready", flush=True)
    time.sleep(60)
"""


def start_holder(tenant, quota, nbytes):
    env = dict(os.environ, PYTHONPATH=PKG_PARENT)
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), tenant, str(quota), str(nbytes)],
                         stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout.readline().strip() == "ready"
    return p


def proc_state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def start_time(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def test_killed_process_share_is_reclaimed_on_next_attempt(base):
    child = start_holder("shared", 8 * MiB, 6 * MiB - 1024)
    ctx = base.context("shared")  # joins the tenant on the node's terms: 8 MiB
    try:
        assert ctx.quota == 8 * MiB and ctx.held == 6 * MiB
        with pytest.raises(ap.QuotaExceededError) as info:
            ctx.malloc(4 * MiB - 1024)  # the live child's 6 MiB count
        assert info.value.held == 6 * MiB
        child.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 30  # generous: a loaded machine
        while proc_state(child.pid) not in ("Z", None) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert proc_state(child.pid) == "Z"  # not reaped yet: a zombie holds nothing
        t0 = time.monotonic()
        p = ctx.malloc(8 * MiB - 1024)  # the whole quota: only possible once the dead share is back
        # no wait on the dead holder (its lock, or the reclaim's, would cost the ledger's 10 s lock
        # timeout): bounded at half that, not at 1 s, which a loaded machine can exceed
        assert time.monotonic() - t0 < 5.0
        view = ctx.ledger.view()
        assert view["reclaimed_slots"] == 1 and view["reclaimed_bytes"] == 6 * MiB
        assert [s["pid"] for s in view["slots"]] == [os.getpid()]
        assert ctx.held == 8 * MiB
        ctx.free(p)
    finally:
        child.kill()
        child.wait()
        ctx.close()


MAIN_THREAD_EXITS = """
    import ctypes, sys, threading, time
    import ascend_pool as ap
    ctx = ap.Pool(0).context(sys.argv[1], quota=int(sys.argv[2]))
    p = ctx.malloc(int(sys.argv[3]))
    threading.Thread(target=time.sleep, args=(60,)).start()  # the process lives on in this thread
    print("ready", flush=True)
    ctypes.CDLL(None).pthread_exit(None)
"""


def test_a_live_process_whose_main_thread_exited_keeps_its_share(base):
    # A process whose main thread called pthread_exit() (its other threads run on, holding its
    # memory) shows as a zombie in /proc/PID/stat: the reserve before a refusal and the sweep took
    # it for dead and gave its 6 MiB away (4 MiB more granted on an 8 MiB quota).
    from ascend_pool import identity

    env = dict(os.environ, PYTHONPATH=PKG_PARENT)
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(MAIN_THREAD_EXITS), "lives", str(8 * MiB),
                              str(6 * MiB - 1024)], stdout=subprocess.PIPE, text=True, env=env)
    ctx = None
    try:
        assert child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30  # generous: a loaded machine
        while proc_state(child.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.005)
        assert proc_state(child.pid) == "Z" and child.poll() is None  # the leader's state; the process lives
        ctx = base.context("lives")
        assert ctx.held == 6 * MiB
        with pytest.raises(ap.QuotaExceededError):
            ctx.malloc(4 * MiB - 1024)
        assert all(r["slots"] == 0 for r in sweep())
        assert ctx.held == 6 * MiB and ctx.ledger.view()["reclaimed_bytes"] == 0
        assert not identity.gone_here(child.pid)  # the stats reader's and the share records' test
        child.kill()  # a signal ends every thread: dead at once, before its lease drops
        deadline = time.monotonic() + 30  # generous: a loaded machine
        while not identity.gone_here(child.pid) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert proc_state(child.pid) == "Z"  # not reaped yet
        p = ctx.malloc(8 * MiB - 1024)
        ctx.free(p)
    finally:
        child.kill()
        child.wait()
        if ctx is not None:
            ctx.close()


def test_sweep_reclaims_for_the_node_service(base):
    ctx = base.context("swept", quota=16 * MiB)
    child = start_holder("swept", 16 * MiB, 4 * MiB - 1024)
    try:
        assert ctx.held == 4 * MiB
        child.kill()
        child.wait()
        (report,) = [r for r in sweep() if r["path"] == ctx.ledger.path]
        assert (report["slots"], report["bytes"]) == (1, 4 * MiB)
        assert ctx.held == 0
        assert [r["slots"] for r in sweep()] == [0]  # nothing left to reclaim
    finally:
        ctx.close()


def forge_slot(path, index, tenant, pid, instance, held, pending=0, pidns=0, start=0):
    """Writes a used slot into the ledger file (the mapping sees it: MAP_SHARED)."""
    with open(path, "r+b") as f:
        f.seek(SLOTS_AT + index * SLOT_SIZE + 4)
        f.write(struct.pack("<iQIIQqQQ", pid, instance, tenant, 0, held, pending, pidns, start))
        f.seek(SLOTS_AT + index * SLOT_SIZE)
        f.write(struct.pack("<I", 1))  # published last, like the real claim


def add_tenant_held(path, tenant, delta):
    with open(path, "r+b") as f:
        f.seek(TENANTS_AT + tenant * TENANT_SIZE + 80)
        held = struct.unpack("<Q", f.read(8))[0]
        f.seek(TENANTS_AT + tenant * TENANT_SIZE + 80)
        f.write(struct.pack("<Q", held + delta))


LEASE_HOLDER = """
    import sys, time
    from ascend_pool import identity
    print(identity.ensure_lease(sys.argv[1]), flush=True)
    time.sleep(60)
"""


def test_slots_are_named_by_lease_not_by_pid(base):
    ctx = base.context("reuse", quota=16 * MiB)
    try:
        p = ctx.malloc(2 * MiB - 1024)
        path = ctx.ledger.path
        t = ctx.ledger.tenant("reuse")["index"]
        # A process of another pid namespace: its pid (1) means nothing here, its lease is held.
        holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(LEASE_HOLDER), os.path.dirname(path)],
                                  stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=PKG_PARENT))
        other = int(holder.stdout.readline())
        sleeper = subprocess.Popen(["sleep", "30"])
        # Dead processes whose pids are alive now (ours, a sleeper's): no lease holds their instance.
        forge_slot(path, 1000, t, os.getpid(), 0x1234, 3 * MiB)
        forge_slot(path, 1001, t, sleeper.pid, 0x5678, 1 * MiB)
        forge_slot(path, 1002, t, 1, other, 1 * MiB, pidns=12345)  # really alive, elsewhere
        add_tenant_held(path, t, 5 * MiB)
        assert ctx.held == 7 * MiB
        (report,) = sweep()
        assert (report["slots"], report["bytes"]) == (2, 4 * MiB)
        assert ctx.held == 3 * MiB  # ours (2) and the other namespace's (1) remain
        alive = sorted((s["pid"], s["held_bytes"], s["alive"]) for s in ctx.ledger.view()["slots"])
        assert alive == sorted([(os.getpid(), 2 * MiB, True), (1, 1 * MiB, True)])
        holder.kill()
        holder.wait()
        assert sweep()[0]["slots"] == 1
        sleeper.kill()
        sleeper.wait()
        ctx.free(p)
    finally:
        ctx.close()


def test_death_inside_reserve_is_counted_safely_then_settled(base):
    ctx = base.context("crash", quota=16 * MiB)
    path, t = ctx.ledger.path, ctx.ledger.tenant("crash")["index"]
    gone = subprocess.Popen(["true"])
    gone.wait()
    # A process died between its compare-and-swap (tenant += 2 MiB) and its slot update: its slot
    # says 4 MiB held and 2 MiB pending. Nobody can know whether the CAS happened.
    forge_slot(path, 900, t, gone.pid, 12345, 4 * MiB, pending=2 * MiB)  # 12345: no lease
    add_tenant_held(path, t, 6 * MiB)
    (report,) = sweep()
    # The live slots (this context's: nothing) were not inside an update: the counter is made
    # exact from them in the same reclaim, so the 2 MiB come back while the tenant lives.
    assert (report["slots"], report["bytes"]) == (1, 6 * MiB)
    state = ctx.ledger.tenant("crash")
    assert state["held_bytes"] == 0 and state["uncertain_bytes"] == 0
    assert ctx.ledger.view()["uncertain_bytes"] == 2 * MiB  # the node's total, ever
    ctx.close()


# A process with 4 MiB booked, killed inside an update of 2 MiB at each point between its steps:
# (slot held, slot pending, what the tenant's counter holds for it).
BOOKING_POINTS = {
    "reserve-before-cas": (4 * MiB, 2 * MiB, 4 * MiB),
    "reserve-after-cas": (4 * MiB, 2 * MiB, 6 * MiB),
    "reserve-after-slot": (6 * MiB, 2 * MiB, 6 * MiB),
    "release-before-slot": (4 * MiB, -2 * MiB, 4 * MiB),
    "release-after-slot": (2 * MiB, -2 * MiB, 4 * MiB),
    "release-after-tenant": (2 * MiB, -2 * MiB, 2 * MiB),
}


@pytest.mark.parametrize("point", BOOKING_POINTS)
def test_a_process_killed_at_any_point_of_its_booking_gives_its_share_back_while_the_tenant_lives(base, point):
    """Whatever step of its booking a process died at, the next reclaim gives back exactly what
    it held, while another process of the tenant lives (a serving tenant is never idle). Before,
    the bytes of an open update stayed counted as held (uncertain) until every process of the
    tenant had exited: each such kill shrank the tenant's usable quota for good."""
    slot_held, pending, counted = BOOKING_POINTS[point]
    ctx = base.context("serving", quota=16 * MiB)
    try:
        p = ctx.malloc(4 * MiB - 1024)               # the live process: 4 MiB
        path, t = ctx.ledger.path, ctx.ledger.tenant("serving")["index"]
        gone = subprocess.Popen(["true"])
        gone.wait()
        forge_slot(path, 900, t, gone.pid, 12345, slot_held, pending=pending)  # 12345: no lease
        add_tenant_held(path, t, counted)
        sweep()
        state = ctx.ledger.tenant("serving")
        assert (state["held_bytes"], state["uncertain_bytes"]) == (4 * MiB, 0), state
        q = ctx.malloc(12 * MiB - 1024)              # the whole rest of the quota
        ctx.free(q)
        ctx.free(p)
    finally:
        ctx.close()


def test_fresh_tenant_does_not_inherit_a_dead_runs_quota(base):
    child = start_holder("stale", 4 * MiB, 2 * MiB - 1024)
    child.kill()
    child.wait()
    ctx = base.context("stale")  # nobody alive holds "stale": it starts afresh, without the old quota
    try:
        assert ctx.quota is None and ctx.held == 0
        p = ctx.malloc(8 * MiB)
        ctx.free(p)
    finally:
        ctx.close()


def test_a_tenants_node_counters_go_on_across_moments_without_a_context(base):
    # A service opens a tenant context per request: between requests the tenant has no slot on
    # the node. Its exported ledger counters (refusals, conflicts) and peak must go on, not
    # restart at each request (before: the refusals counter read the same value at every scrape
    # while refusals went on, a rate of 0 to Prometheus). Its quota still starts afresh.
    from ascend_pool.metrics.ledger import ledger_families

    def exported(name):
        return {s.labels["tenant"]: s.value for fam in ledger_families() if fam.name == name
                for s in fam.samples}

    seen, conflicts = [], []
    for request in range(3):
        ctx = base.context("per-request", quota="4MiB")
        other = base.context("per-request", quota="8MiB")   # a second declaration: a conflict
        try:
            with pytest.raises(ap.QuotaExceededError):
                ctx.malloc(64 * MiB)
            seen.append(exported("ascend_pool_ledger_refusals")["per-request"])
            conflicts.append(exported("ascend_pool_quota_conflicts")["per-request"])
        finally:
            other.close()
            ctx.close()
    assert seen[0] > 0 and seen == sorted(seen) and seen[2] == 3 * seen[0], seen
    assert conflicts[0] > 0 and conflicts[2] == 3 * conflicts[0], conflicts
    ctx = base.context("per-request")                        # afresh: no quota from the last request
    try:
        assert ctx.quota is None
    finally:
        ctx.close()


def test_forked_child_cannot_use_the_parents_context(base):
    ctx = base.context("forky", quota=64 * MiB)
    try:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: the inherited context must not grow under the parent's slot
            code = 1
            try:
                ctx.malloc(8 * MiB)
            except BackendUnavailableError as e:  # refused before the ledger: no runtime after a fork
                code = 0 if e.code == 990004 and "spawn" in str(e) else 2
            except BaseException:
                code = 3
            os.write(w, bytes([code]))
            os._exit(0)
        os.close(w)
        result = os.read(r, 1)
        os.waitpid(pid, 0)
        os.close(r)
        assert result == b"\0"
        assert ctx.held == 0
        p = ctx.malloc(8 * MiB)  # the parent is unaffected
        ctx.free(p)
    finally:
        ctx.close()


def test_a_process_killed_inside_its_reserve_gives_its_grant_back_while_the_tenant_lives(base, tmp_path):
    """A real death in the crash window: the child stops inside its reserve's pending bracket (the
    test-only pause point), after the tenant counter moved and before its slot did, and is killed
    there. The sweep must notice the open bracket and, no live process of the tenant being inside
    an update, give the grant back exactly. Before, it stayed counted as uncertain until the tenant
    had no live process: the live process here was refused 14 MiB of its 16 MiB quota."""
    marker = tmp_path / "in-bracket"
    env = dict(os.environ, PYTHONPATH=PKG_PARENT, ASCEND_POOL_TEST_PAUSE_IN_RESERVE=str(marker))
    ctx = base.context("window", quota=16 * MiB)
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), "window", str(16 * MiB), str(2 * MiB - 1024)],
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.01)
        assert marker.exists(), "the child never reached the pause point inside its reserve"
        assert ctx.ledger.tenant("window")["held_bytes"] == 2 * MiB  # the counter moved, the slot not
        child.send_signal(signal.SIGKILL)
        child.wait()
        (report,) = [r for r in sweep() if r["slots"]]
        assert (report["slots"], report["bytes"]) == (1, 2 * MiB)  # the counter's 2 MiB, its slot's 0
        state = ctx.ledger.tenant("window")
        assert state["held_bytes"] == 0 and state["uncertain_bytes"] == 0
        p = ctx.malloc(16 * MiB - 1024)  # the whole quota, the dead grant back
        ctx.free(p)
    finally:
        child.kill()
        child.wait()
        ctx.close()
    from ascend_pool.tenants.ledger import open_ledger

    state = open_ledger(0, "sim").tenant("window")
    assert state["held_bytes"] == 0 and state["uncertain_bytes"] == 0  # settled with the last process


CHURNER = """
    import os, sys
    import ascend_pool as ap
    ctx = ap.Pool(0).context("churn", quota=64 * 2**20)
    keep = ctx.malloc(2 * 2**20 - 1024)
    print("ready", flush=True)
    n = 0
    while not os.path.exists(sys.argv[1]):  # a segment booked and given back, again and again
        p = ctx.malloc(2 * 2**20 - 1024)
        ctx.free(p)
        ctx.empty_cache()
        n += 1
    print(n, flush=True)
    sys.stdin.readline()
"""


def test_reclaims_made_exact_while_other_processes_book_leave_the_counter_exact(base, tmp_path):
    """Processes killed inside their reserve, one after another, while three live processes of the
    tenant book and give back a segment as fast as they can: each reclaim runs while updates are
    in flight, and makes the counter exact only from a reading none crossed. Once they stop, the
    counter is what the live slots hold, nothing uncertain (a reading across an update would have
    left it off by a segment for good)."""
    stop = tmp_path / "stop"
    env = dict(os.environ, PYTHONPATH=PKG_PARENT)
    churners = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHURNER), str(stop)], env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    ctx = base.context("churn", quota=64 * MiB)
    try:
        for c in churners:
            assert c.stdout.readline().strip() == "ready"
        exact_during = 0
        for i in range(6):
            marker = tmp_path / f"in-reserve-{i}"
            victim = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), "churn", str(64 * MiB),
                                       str(2 * MiB - 1024)], stdout=subprocess.DEVNULL,
                                      env=dict(env, ASCEND_POOL_TEST_PAUSE_IN_RESERVE=str(marker)))
            deadline = time.monotonic() + 30
            while not marker.exists() and time.monotonic() < deadline and victim.poll() is None:
                time.sleep(0.005)
            assert marker.exists(), "the victim never reached the pause point inside its reserve"
            victim.kill()
            victim.wait()
            for _ in range(3):
                sweep()
            exact_during += ctx.ledger.tenant("churn")["uncertain_bytes"] == 0
        stop.touch()
        rounds = [int(c.stdout.readline()) for c in churners]
        assert min(rounds) > 0, rounds
        sweep()
        view = ctx.ledger.view()
        (tenant,) = [t for t in view["tenants"] if t["name"] == "churn"]
        in_slots = sum(s["held_bytes"] for s in view["slots"] if s["tenant"] == "churn")
        assert in_slots == 3 * 2 * MiB
        assert (tenant["held_bytes"], tenant["uncertain_bytes"]) == (in_slots, 0), (tenant, rounds)
        assert exact_during > 0  # made exact while the churners ran, not only once they stopped
    finally:
        for c in churners:
            c.kill()
            c.wait()
        ctx.close()


def test_the_sweep_lets_go_of_ledgers_that_were_removed(ledger_dir):
    # A node service sweeps every interval for days: a ledger file removed for good (a /dev/shm
    # cleanup, a finished simulated node's) must not stay mapped and open in it. Before, each kept
    # one descriptor and one mapping (and the removed file's memory) for the service's life.
    from ascend_pool._core import Ledger
    from ascend_pool.tenants import ledger as L

    def open_on(paths):
        # descriptors of this process on those files (a removed file reads "PATH (deleted)"); not
        # a count of all descriptors, which other threads of the test process open and close
        gone = set(paths)
        out = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            out += target.removesuffix(" (deleted)") in gone
        return out

    sweep()
    paths = []
    for i in range(20):
        path = L.ledger_path(0, "sim", node=f"gone{i}")
        del_me = Ledger(path, 0, "sim", f"gone{i}")
        del del_me
        sweep()
        assert path in L._swept
        os.unlink(path)
        paths.append(path)
    sweep()
    assert not [p for p in paths if p in L._swept]
    assert open_on(paths) == 0
    # one still there is kept, and swept as before
    kept = L.ledger_path(0, "sim", node="kept")
    led = Ledger(kept, 0, "sim", "kept")
    sweep()
    assert kept in L._swept
    sweep(uids=(os.geteuid(),))
    assert kept in L._swept
    del led


HOLDER_FORKS = """
    import os, sys, time
    import ascend_pool as ap
    ctx = ap.Pool(0).context(sys.argv[1], quota=int(sys.argv[2]))
    p = ctx.malloc(int(sys.argv[3]))
    if os.fork() == 0:  # a child that outlives it, holding copies of its descriptors
        time.sleep(60)
        os._exit(0)
    print("ready", flush=True)
    time.sleep(60)
"""


HOLDER_CLEANED = """
    import sys, time
    import ascend_pool as ap
    pool = ap.Pool(0)
    ctx = pool.context(sys.argv[1], quota=int(sys.argv[2]))
    p = ctx.malloc(int(sys.argv[3]))
    print("ready", flush=True)
    sys.stdin.readline()
    pool.context(sys.argv[1] + "-2")  # its next ledger operation
    print("again", flush=True)
    time.sleep(60)
"""


def test_a_live_process_whose_lease_file_was_removed_keeps_its_share_and_makes_it_again(base, ledger_dir):
    # A cleanup of the ledger directory (an init container, a /dev/shm job) removed a running
    # process's lease file: the next reserve and the sweep took it for dead and gave its 6 MiB
    # away (4 MiB more granted on an 8 MiB quota), and its lease never came back. The holder
    # publishes no stats (ASCEND_POOL_STATS=0): its lease stays missing until its next context.
    from ascend_pool import identity

    env = dict(os.environ, PYTHONPATH=PKG_PARENT, ASCEND_POOL_STATS="0")
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER_CLEANED), "cleaned", str(8 * MiB),
                              str(6 * MiB - 1024)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    ctx = None
    try:
        assert child.stdout.readline().strip() == "ready"
        (priv,) = [p for p in ledger_dir.iterdir() if p.name.startswith("ascend_pool-u")]
        (lease,) = priv.glob(identity.LEASE_PREFIX + "*")
        lease.unlink()
        ctx = base.context("cleaned")
        assert ctx.held == 6 * MiB
        with pytest.raises(ap.QuotaExceededError):
            ctx.malloc(4 * MiB - 1024)
        assert all(r["slots"] == 0 for r in sweep())
        (slot,) = [s for s in ctx.ledger.view()["slots"] if s["pid"] == child.pid]
        assert slot["alive"] is True and slot["held_bytes"] == 6 * MiB
        assert not lease.exists()  # all of that while it was missing
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "again"
        assert identity.lease_alive(str(priv), int(slot["instance"], 16)) is True
        child.kill()  # dead now: its share goes back
        child.wait()
        p = ctx.malloc(8 * MiB - 1024)
        ctx.free(p)
    finally:
        child.kill()
        child.wait()
        if ctx is not None:
            ctx.close()


def children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


@needs_unshare
def test_a_forked_child_does_not_keep_a_killed_parents_share(base, ledger_dir):
    # The proof of life besides the lease (a lock on the ledger file) is dropped by a forked
    # child: a child that outlives its killed parent must not keep the parent's 6 MiB. The parent
    # runs in a pid namespace of its own (under a sleep, pid 1 there, which outlives it and never
    # reaps it), where its pid tells nothing here: only the locks do.
    env = dict(os.environ, PYTHONPATH=PKG_PARENT)
    ns = subprocess.Popen(NS + ["sh", "-c", '"$@" & exec sleep 60', "sh", sys.executable, "-c", textwrap.dedent(HOLDER_FORKS),
                                "forks", str(8 * MiB), str(6 * MiB - 1024)], stdout=subprocess.PIPE, text=True, env=env)
    ctx = None
    try:
        assert ns.stdout.readline().strip() == "ready"
        (shell,) = children(ns.pid)  # pid 1 there
        (parent,) = children(shell)
        assert len(children(parent)) == 1  # its forked child
        ctx = base.context("forks")
        assert ctx.held == 6 * MiB
        for lease in ledger_dir.glob("ascend_pool-u*/ascend_pool-lease-*"):
            lease.unlink()  # the life lock alone tells now
        with pytest.raises(ap.QuotaExceededError):
            ctx.malloc(4 * MiB - 1024)
        os.kill(parent, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not (proc_state(parent) == "Z" and len(children(shell)) == 2) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc_state(parent) == "Z" and len(children(shell)) == 2  # the forked child lives on, in pid 1's care
        while True:  # given back all the same, once the parent's last thread has closed its files
            try:
                ctx.free(ctx.malloc(8 * MiB - 1024))
                break
            except ap.QuotaExceededError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
    finally:
        ns.kill()  # --kill-child: the namespace goes with it
        ns.wait()
        if ctx is not None:
            ctx.close()


def _exported_reclaimed(registry):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(registry).decode()
    return {s.labels["device"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "ascend_pool_ledger_reclaimed_bytes_total"}


def test_the_reclaimed_counter_never_falls_when_a_ledger_is_removed(base):
    # ascend_pool_ledger_reclaimed_bytes_total added up the ledger files there at each scrape: a
    # ledger removed (a cleanup of the directory) and made again by the tenant's next process took
    # its bytes with it, and the counter fell to 0, a counter reset to Prometheus (rate() spikes).
    from prometheus_client import CollectorRegistry

    from ascend_pool.metrics import PoolCollector
    from ascend_pool.metrics.ledger import sweep_dead_processes
    from ascend_pool.tenants import ledger as L

    registry = CollectorRegistry()
    registry.register(PoolCollector(ledger=True))
    child = start_holder("gone", 8 * MiB, 6 * MiB - 1024)
    try:
        child.kill()
        child.wait()
        assert sweep_dead_processes() == 6 * MiB
    finally:
        child.kill()
    assert _exported_reclaimed(registry) == {"0": 6 * MiB}
    [path] = [f[0] for f in L.ledger_files() if f[1] == 0]
    os.unlink(path)
    assert _exported_reclaimed(registry) == {"0": 6 * MiB}   # gone: what it counted stays
    again = start_holder("next", 8 * MiB, 2 * MiB - 1024)    # makes a new ledger at the same path
    try:
        assert os.path.exists(path)
        assert _exported_reclaimed(registry) == {"0": 6 * MiB}
    finally:
        again.kill()
        again.wait()
    sweep_dead_processes()
    assert _exported_reclaimed(registry) == {"0": 8 * MiB}   # the new ledger's reclaim adds on


def test_reclaimed_totals_count_a_ledger_back_from_a_missed_listing_once():
    # A directory that could not be listed for one scrape brings its ledgers back: their bytes
    # are not counted twice; another file at the path (or a reset one) is counted on top.
    from ascend_pool.metrics.ledger import ReclaimedTotals

    t = ReclaimedTotals()
    key = ("sim", "0")
    assert t.update([("/l", (1, 1), "sim", "0", 100)], {"/l"})[key] == 100
    assert t.update([], set())[key] == 100                         # not listed: kept
    assert t.update([("/l", (1, 1), "sim", "0", 150)], {"/l"})[key] == 150  # the same file, back
    assert t.update([], {"/l"})[key] == 150                        # listed, unreadable: its last reading
    assert t.update([("/l", (1, 2), "sim", "0", 10)], {"/l"})[key] == 160   # another file
    assert t.update([("/l", (1, 2), "sim", "0", 5)], {"/l"})[key] == 165    # reset in place


def test_a_reclaimer_killed_inside_its_give_back_never_lets_the_tenant_past_its_quota(base, tmp_path):
    """A real death inside a reclaim: the sweeper stops in apl_slot_clear (the test-only pause
    point) after it lowered the tenant by a dead slot's bytes and before it freed the slot, and is
    killed there. Before, the next reclaim gave the same bytes back again: the tenant's counter
    fell below what its live processes hold, and one of them was granted past the quota."""
    holder = start_holder("twice", 16 * MiB, 8 * MiB - 1024)
    ctx = base.context("twice")
    try:
        ctx.malloc(8 * MiB - 1024)                     # the live process: 8 MiB, 16 MiB with the holder
        holder.kill()
        holder.wait()
        marker = tmp_path / "in-clear"
        env = dict(os.environ, PYTHONPATH=PKG_PARENT, ASCEND_POOL_TEST_PAUSE_IN_RECLAIM=str(marker))
        reclaimer = subprocess.Popen([sys.executable, "-c", "from ascend_pool.tenants import sweep; sweep()"],
                                     env=env)
        try:
            deadline = time.monotonic() + 30
            while not marker.exists() and time.monotonic() < deadline and reclaimer.poll() is None:
                time.sleep(0.01)
            assert marker.exists(), "the reclaimer never reached the pause point inside its give-back"
            assert ctx.ledger.tenant("twice")["held_bytes"] == 8 * MiB  # lowered; the slot still there
        finally:
            reclaimer.kill()
            reclaimer.wait()
        sweep()                                        # the next reclaim finds the dead slot again
        state = ctx.ledger.tenant("twice")
        assert state["held_bytes"] >= 8 * MiB, state   # never below what the live process holds
        with pytest.raises(ap.QuotaExceededError):
            ctx.malloc(16 * MiB - 1024)                # 8 + 16 MiB on a 16 MiB quota
        p = ctx.malloc(8 * MiB - 1024)                 # the room really free
        ctx.free(p)
    finally:
        holder.kill()
        holder.wait()
        ctx.close()

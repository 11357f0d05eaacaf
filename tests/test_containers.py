"""Containers on a shared node (issue 16): workers in separate pid namespaces (`unshare --pid
--fork --mount-proc`: each is pid 1), the node service in another, and a hostile local user.

What a user relies on: a tenant's quota holds across containers and is never decided by the
last process to attach; the service never takes a live worker for dead nor mixes two workers'
figures; a killed worker's share comes back within one sweep; sharing works across namespaces
with node-level ids; another local user cannot stop a tenant from allocating nor slow a scrape.
These tests need `unshare` (and root for pid namespaces) and `runuser`: CI runs as root and has
both; elsewhere they skip, saying which is missing.
"""

import base64
import json
import os
import pickle
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import metrics_scrape  # noqa: E402
from metrics_scrape import scrape, series  # noqa: E402
from other_user import SKIP as OTHER_USER_SKIP, readable_site  # noqa: E402
from sim_fixtures import NS, needs_unshare  # noqa: E402

import ascend_pool as ap

MiB = 1 << 20
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(ap.__file__)))




@pytest.fixture
def node(tmp_path):
    """A fresh node: its own simulated node name, ledger and stats directories."""
    base = tmp_path / "shm"
    base.mkdir()
    env = dict(os.environ, ASCEND_POOL_LEDGER_DIR=str(base), ASCEND_POOL_STATS_DIR=str(base),
               ASCEND_SIM_NODE=f"c{uuid.uuid4().hex[:10]}", ASCEND_POOL_BACKEND="sim", ASCEND_POOL_STATS="1",
               ASCEND_POOL_STATS_INTERVAL="0.1", PYTHONSAFEPATH="1",
               PYTHONPATH=os.pathsep.join(filter(None, [PKG_PARENT, os.environ.get("PYTHONPATH")])))
    for k in ("ASCEND_POOL_CONFIG", "ASCEND_POOL_TENANT", "ASCEND_POOL_LEDGER_GROUP"):
        env.pop(k, None)
    procs = []
    yield env, base, procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


WORKER = r'''
import json, os, sys
import ascend_pool as ap
from ascend_pool import identity
from ascend_pool.errors import QuotaExceededError
tenant, quota = sys.argv[1], (None if sys.argv[2] == "none" else sys.argv[2])
pool = ap.Pool(int(os.environ.get("WORKER_DEVICE", "0")))
ctx = pool.context(tenant, quota=quota)
print(json.dumps({"pid": os.getpid(), "instance": identity.instance_hex(), "quota": ctx.quota,
                  "expandable": bool(pool.knobs.get("expandable_segments"))}), flush=True)
keep = []
for line in sys.stdin:
    cmd, arg = line.split()
    if cmd == "malloc":
        try:
            keep.append(ctx.malloc(int(arg)))
            out = "granted"
        except QuotaExceededError:
            out = "refused"
    elif cmd == "quota":
        out = ctx.quota
    elif cmd == "set_quota":
        ctx.set_quota(int(arg))
        out = ctx.quota
    elif cmd == "context":  # another context: a ledger operation that is not a reserve
        keep.append(pool.context(tenant + arg))
        out = "opened"
    elif cmd == "share":  # a block exported to any process of the node
        ptr = ctx.share_malloc(int(arg))
        keep.append(ctx.share(ptr, any_process=True))
        out = "shared"
    print(json.dumps(out), flush=True)
'''


class Worker:
    """A tenant process (in a pid namespace of its own when ns=True) driven over its stdin."""

    def __init__(self, env, procs, tenant, quota, ns=True, extra_env=None, wrap=()):
        cmd = list(wrap) + (NS if ns else []) + [sys.executable, "-c", WORKER, tenant, quota]
        self.proc = subprocess.Popen(cmd, env=dict(env, **(extra_env or {})), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(self.proc)
        self.hello = self._line()

    def _line(self, timeout=60):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            pytest.fail(f"worker gave no answer: {self.proc.stderr.read()}")
        return json.loads(line)

    def __call__(self, cmd, arg=0):
        self.proc.stdin.write(f"{cmd} {arg}\n")
        self.proc.stdin.flush()
        return self._line()

    def host_pid(self):
        """The worker's pid on the host (the child of unshare), for signals from here."""
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            kids = f.read().split()
        return int(kids[0]) if kids else self.proc.pid


def start_serve(env, procs, log_path, *args, prefix_ns=NS):
    """`ascend-pool serve` in a pid namespace of its own; returns its port."""
    proc, port = metrics_scrape.start_serve(env, log_path, *args, prefix=prefix_ns)
    procs.append(proc)
    return port



@needs_unshare
@pytest.mark.parametrize("conf", ["", "expandable_segments:True"], ids=["classic", "expandable"])
def test_two_workers_in_separate_pid_namespaces_share_one_quota(node, tmp_path, conf):
    env, base, procs = node
    port = start_serve(env, procs, tmp_path / "serve.log", "--sweep-interval", "1")
    mode = {"ASCEND_POOL_CONF": conf}  # expandable: the quota books mapped chunks, not segments
    a = Worker(env, procs, "online", "1GiB", extra_env=mode)
    b = Worker(env, procs, "online", "1GiB", extra_env=mode)
    assert a.hello["expandable"] == b.hello["expandable"] == bool(conf)
    assert a.hello["pid"] == b.hello["pid"] == 1  # the same pid, in two namespaces
    assert a.hello["instance"] != b.hello["instance"]
    # Exactly one of two 600 MiB requests fits a 1 GiB quota, and nothing past it afterwards.
    assert [a("malloc", 600 * MiB), b("malloc", 600 * MiB)] == ["granted", "refused"]
    assert [b("malloc", 500 * MiB), a("malloc", 500 * MiB)] == ["refused", "refused"]
    # The service sweeps every second meanwhile: neither is taken for dead, their figures stay apart.
    deadline = time.monotonic() + 3.5
    while time.monotonic() < deadline:
        s = scrape(port)
        held = series(s, "ascend_pool_ledger_held_bytes", tenant="online")
        assert list(held.values()) == [602 * MiB], held  # 600 MiB + the runtime's padding, in 2 MiB pages
        assert list(series(s, "ascend_pool_ledger_processes", tenant="online").values()) == [2]
        time.sleep(0.2)
    # Two series with pid="1", told apart by `instance` (each process publishes every 0.1 s).
    ages = series(s, "ascend_pool_stats_age_seconds", pid=1)
    assert {dict(lab)["instance"] for lab in ages} == {a.hello["instance"], b.hello["instance"]}, ages
    reserved = {dict(lab)["instance"]: v for lab, v in series(s, "ascend_pool_reserved_bytes", pid=1, tenant="online",
                                                               pool="large").items()}
    assert reserved == {a.hello["instance"]: 602 * MiB, b.hello["instance"]: 0}, reserved
    assert list(series(s, "ascend_pool_service_stats_files", state="live").values()) == [2]
    log = (tmp_path / "serve.log").read_text()
    assert "reclaimed" not in log and "removed stats file" not in log and "damaged" not in log, log
    private = base / f"ascend_pool-u{os.geteuid()}"
    assert sorted(n for n in os.listdir(private) if n.startswith("ascend_pool-stats-")) == sorted(
        f"ascend_pool-stats-{w.hello['instance']}" for w in (a, b))
    # `ascend-pool ps` tells the two pid-1 processes apart too.
    r = subprocess.run([sys.executable, "-m", "ascend_pool.cli", "ps", "--json"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    table = {(row["pid"], row["instance"], row["tenant"], row["device"]): (row["held_bytes"], row["allocated_bytes"])
             for row in json.loads(r.stdout) if row["tenant"] == "online"}  # (each also has a default pool)
    assert set(table) == {(1, w.hello["instance"], "online", 0) for w in (a, b)}, table
    assert table[(1, a.hello["instance"], "online", 0)][0] == 602 * MiB
    assert table[(1, a.hello["instance"], "online", 0)][1] >= 600 * MiB
    # SIGKILL the holder: its share is back within one sweep (1 s), without B asking for it.
    os.kill(a.host_pid(), signal.SIGKILL)
    t0 = time.monotonic()
    while list(series(scrape(port), "ascend_pool_ledger_held_bytes", tenant="online").values()) != [0]:
        # a sweep every 1 s; 10 s of slack for a loaded machine (the killed process's teardown, the
        # scrape): a service that does not sweep on its own never gets there
        assert time.monotonic() - t0 < 10.0, "the killed worker's share was not given back by the service's sweep"
        time.sleep(0.05)
    print(f"the killed worker's share was back {time.monotonic() - t0:.2f} s after SIGKILL (sweep every 1 s)")
    # Its lease file goes with it (the same sweep's identity.remove_dead_leases), the live one's stays.
    lease = private / f"ascend_pool-lease-{a.hello['instance']}"
    while lease.exists():
        assert time.monotonic() - t0 < 10.0, "the killed worker's lease file was not removed by the service's sweep"
        time.sleep(0.05)
    assert (private / f"ascend_pool-lease-{b.hello['instance']}").exists()
    assert b("malloc", 600 * MiB) == "granted"


@needs_unshare
def test_conflicting_quotas_resolve_to_the_stricter_without_a_tenants_file(node):
    env, base, procs = node
    a = Worker(env, procs, "online", "256MiB")
    b = Worker(env, procs, "online", "4GiB")  # declared later, in another namespace: lifts nothing
    assert b.hello["quota"] == 256 * MiB and a("quota") == 256 * MiB
    assert a("malloc", 200 * MiB) == "granted"
    assert [a("malloc", 100 * MiB), b("malloc", 100 * MiB)] == ["refused", "refused"]
    c = Worker(env, procs, "online", "none")  # "no quota" is no declaration to lift it either
    assert c.hello["quota"] == 256 * MiB and c("malloc", 100 * MiB) == "refused"
    b("malloc", 100 * MiB)  # refused again: the conflict is not logged again
    b.proc.stdin.close()
    err = b.proc.stderr.read()
    assert err.count("conflicting quota declarations") == 1, err  # logged once, by the process that met it


@needs_unshare
def test_of_two_tenants_files_that_disagree_the_newer_wins(node):
    # A ConfigMap update reaches pods at different times. The last process to start used to win
    # whatever its file's age (a pod starting late with the old file undid the update; then the
    # stricter file, which kept a raise rolled out by restarting pods from ever applying): the
    # newer file's quota applies to every process of the tenant, an older one changes nothing.
    env, base, procs = node
    old, new = base / "old.toml", base / "new.toml"
    old.write_text('[tenants.t]\nquota = "100MiB"\n')
    new.write_text('[tenants.t]\nquota = "300MiB"\n')
    now = time.time()
    os.utime(old, (now - 600, now - 600))
    a = Worker(env, procs, "t", "none", extra_env={"ASCEND_POOL_CONFIG": str(old)})
    assert a.hello["quota"] == 100 * MiB and a("malloc", 80 * MiB) == "granted"
    b = Worker(env, procs, "t", "none", extra_env={"ASCEND_POOL_CONFIG": str(new)})
    assert b.hello["quota"] == 300 * MiB and a("quota") == 300 * MiB   # the update applies
    c = Worker(env, procs, "t", "none", extra_env={"ASCEND_POOL_CONFIG": str(old)})
    assert c.hello["quota"] == 300 * MiB                               # a late old pod undoes nothing
    assert a("malloc", 150 * MiB) == "granted" and b("malloc", 80 * MiB) == "refused"
    c.proc.stdin.close()
    err = c.proc.stderr.read()
    assert "conflicting quota declarations" in err and "which stays" in err, err


def test_a_process_never_lifts_a_limit_another_relies_on(node):
    env, base, procs = node
    a = Worker(env, procs, "online", "256MiB", ns=False)
    b = Worker(env, procs, "online", "none", ns=False)
    assert b("set_quota", 4 << 30) == 256 * MiB  # A relies on 256 MiB: the stricter stays
    assert b("set_quota", 128 * MiB) == 128 * MiB and a("quota") == 128 * MiB  # lowering always applies
    a.proc.stdin.close()
    assert a.proc.wait(timeout=30) == 0
    assert b("set_quota", 4 << 30) == 4 << 30  # alone now: nobody else relies on the limit


@needs_unshare
def test_with_a_tenants_file_its_quota_holds_for_every_process(node, tmp_path):
    env, base, procs = node
    cfg = tmp_path / "tenants.toml"
    cfg.write_text('[tenants.online]\nquota = "512MiB"\n')
    extra = {"ASCEND_POOL_CONFIG": str(cfg)}
    a = Worker(env, procs, "online", "256MiB", extra_env=extra)
    b = Worker(env, procs, "online", "4GiB", extra_env=extra)
    assert a.hello["quota"] == b.hello["quota"] == 512 * MiB
    assert a("malloc", 400 * MiB) == "granted"
    assert b("malloc", 200 * MiB) == "refused"
    assert b("malloc", 100 * MiB) == "granted"


def test_quota_conflicts_are_exported(node, tmp_path, monkeypatch):
    env, base, procs = node
    a = Worker(env, procs, "online", "256MiB", ns=False)
    b = Worker(env, procs, "online", "1GiB", ns=False)
    assert b.hello["quota"] == 256 * MiB
    for k in ("ASCEND_POOL_LEDGER_DIR", "ASCEND_SIM_NODE"):
        monkeypatch.setenv(k, env[k])
    from ascend_pool.metrics.ledger import ledger_families

    fams = {f.name: f for f in ledger_families()}
    (sample,) = [s for s in fams["ascend_pool_quota_conflicts"].samples if s.labels["tenant"] == "online"]
    assert sample.name == "ascend_pool_quota_conflicts_total" and sample.value == 1
    assert a("quota") == 256 * MiB


# ---- sharing across pid namespaces: the README's weight-sharing example --------------------------

EXPORTER = r'''
import base64, json, pickle, sys
import ascend_pool as ap
from ascend_pool import sim
SIZE, PATTERN = 64 << 20, 0x5A
pool = ap.Pool(0)
ptr = pool.share_malloc(SIZE)
sim.launch_fill(None, ptr, SIZE, PATTERN)
pool.synchronize()
ids = json.loads(sys.stdin.readline())                 # the workers' ap.node_pid()
handle = pool.share(ptr, read_only=True, pids=ids)
print(base64.b64encode(pickle.dumps(handle)).decode(), flush=True)
sys.stdin.readline()                                    # the workers have verified
print(json.dumps(sim.stats(0)["node_bytes_used"]), flush=True)
sys.stdin.readline()                                    # the workers have closed
print(json.dumps(pool.share_free(ptr)), flush=True)
'''

IMPORTER = r'''
import base64, json, os, pickle, sys
import ascend_pool as ap
from ascend_pool import sim
print(json.dumps([os.getpid(), ap.node_pid()]), flush=True)
handle = pickle.loads(base64.b64decode(sys.stdin.readline()))
with ap.open_shared(handle) as w:
    print(json.dumps(sim.read(w.ptr, w.size) == bytes([0x5A]) * w.size), flush=True)
    sys.stdin.readline()
print(json.dumps("closed"), flush=True)
'''


def _spawn(env, procs, code):
    p = subprocess.Popen(NS + [sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    procs.append(p)
    return p


def _say(p, text):
    p.stdin.write(text + "\n")
    p.stdin.flush()


def _hear(p, timeout=60):
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    line = p.stdout.readline() if ready else ""
    assert line, p.stderr.read()
    return line.strip()


@needs_unshare
def test_weight_sharing_with_exporter_and_workers_in_separate_pid_namespaces(node, monkeypatch):
    env, base, procs = node
    exporter = _spawn(env, procs, EXPORTER)
    workers = [_spawn(env, procs, IMPORTER) for _ in range(3)]
    ids = [json.loads(_hear(w)) for w in workers]
    assert all(pid == 1 for pid, _ in ids)                     # every worker is pid 1 ...
    assert len({nid for _, nid in ids}) == 3 and all(nid != 1 for _, nid in ids)  # ... its node-level id is unique
    _say(exporter, json.dumps([nid for _, nid in ids]))
    handle = _hear(exporter)
    assert pickle.loads(base64.b64decode(handle)).exporter_pid == 1
    for w in workers:
        _say(w, handle)
    assert [json.loads(_hear(w)) for w in workers] == [True] * 3
    # The node service counts three importers, though each is pid 1 in its namespace (was 1).
    monkeypatch.setenv("ASCEND_POOL_LEDGER_DIR", str(base))
    from ascend_pool.service.node_collector import NodeCollector

    fams = {f.name: f for f in NodeCollector(ledger=False)._shares()}
    assert [s.value for s in fams["ascend_pool_shared_importers"].samples] == [3]
    _say(exporter, "verified")
    assert json.loads(_hear(exporter)) == 64 * MiB             # one copy for the node
    for w in workers:
        _say(w, "close")
        assert json.loads(_hear(w)) == "closed"
    _say(exporter, "closed")
    assert json.loads(_hear(exporter)) is True                # freed at once: every importer closed


# ---- another local user ------------------------------------------------------------------------

TENANT_USER, SQUATTER = "daemon", "nobody"


def _python_for(user, env):
    """An interpreter `user` may run that imports ascend_pool from env's PYTHONPATH: ours, else the
    system's of the same version (ours may live under a home directory other users cannot enter).
    None if none."""
    if shutil.which("runuser") is None:
        return None
    for exe in (sys.executable, f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"):
        r = subprocess.run(["runuser", "-u", user, "--", exe, "-c", "import ascend_pool._core"], env=env,
                           capture_output=True, text=True)
        if r.returncode == 0:
            return exe
    return None



SQUAT = r'''
import os, sys
base, victim, node, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
names = [f"ascend_pool-u{victim}"] + [f"ascend_pool-u{victim}.{i}" for i in range(1, 21)]
for name in names:  # every directory name the victim's default would take first
    os.mkdir(os.path.join(base, name), 0o700)
for name in (f"ascend_pool-ledger-u{victim}-sim-{node}-dev0", f"ascend_pool-lease-{0:016x}",
             f"ascend_pool-stats-{victim}", "ascend_pool-stats-0000000000000001"):
    os.close(os.open(os.path.join(base, name), os.O_CREAT | os.O_WRONLY, 0o644))
flags = os.O_CREAT | os.O_WRONLY | os.O_EXCL
for i in range(n):  # junk stats files, of both the old and the new naming
    os.close(os.open(os.path.join(base, f"ascend_pool-stats-{i + 2:016x}" if i % 2 else f"ascend_pool-stats-{i}"),
                     flags, 0o644))
print("squatted", flush=True)
'''


@pytest.mark.skipif(OTHER_USER_SKIP is not None, reason=str(OTHER_USER_SKIP))
@needs_unshare
def test_another_user_can_neither_block_a_tenant_nor_slow_the_service():
    import pwd

    root = tempfile.mkdtemp(prefix="ap-hostile-")
    procs = []
    try:
        os.chmod(root, 0o755)
        base, simdir = os.path.join(root, "shm"), os.path.join(root, "sim")
        for d in (base, simdir):
            os.mkdir(d)
            os.chmod(d, 0o1777)  # like /dev/shm: every local user may create names
        uid = pwd.getpwnam(TENANT_USER).pw_uid
        env = dict(os.environ, ASCEND_POOL_LEDGER_DIR=base, ASCEND_POOL_STATS_DIR=base, ASCEND_SIM_SHM_DIR=simdir,
                   ASCEND_SIM_NODE=f"h{uuid.uuid4().hex[:10]}", ASCEND_POOL_BACKEND="sim", ASCEND_POOL_STATS="1",
                   ASCEND_POOL_STATS_INTERVAL="0.1", PYTHONSAFEPATH="1", PYTHONPATH=readable_site(root), HOME=root)
        for k in ("ASCEND_POOL_CONFIG", "ASCEND_POOL_TENANT", "ASCEND_POOL_LEDGER_GROUP"):
            env.pop(k, None)
        exe = _python_for(TENANT_USER, env)
        # runuser is here and we are root: a Python the other user can run must be too.
        assert exe is not None, f"no Python that user {TENANT_USER} may run imports {env['PYTHONPATH']}"
        t0 = time.monotonic()
        r = subprocess.run(["runuser", "-u", SQUATTER, "--", exe, "-c", SQUAT, base, str(uid), env["ASCEND_SIM_NODE"],
                            "30000"], env=env, capture_output=True, text=True, timeout=120)
        assert r.stdout.strip() == "squatted", r.stderr
        print(f"squatted in {time.monotonic() - t0:.2f} s")

        # The service (root, in a namespace of its own) trusts the tenant's uid, nothing else.
        log_path = os.path.join(root, "serve.log")
        port = start_serve(env, procs, log_path, "--allow-uid", str(uid), "--sweep-interval", "1")
        lines_before = len(open(log_path).read().splitlines())
        w = Worker.__new__(Worker)
        w.proc = subprocess.Popen(["runuser", "-u", TENANT_USER, "--", exe, "-c", WORKER, "online", "64MiB"], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(w.proc)
        w.hello = w._line()
        assert w.hello["quota"] == 64 * MiB
        assert w("malloc", 40 * MiB) == "granted"   # allocates under its quota ...
        assert w("malloc", 40 * MiB) == "refused"   # ... which still holds
        private = [n for n in os.listdir(base) if n.startswith(f"ascend_pool-u{uid}")
                   and os.stat(os.path.join(base, n)).st_uid == uid]
        assert private == [f"ascend_pool-u{uid}.21"], private  # the first name nobody had taken
        took, found = [], False
        for _ in range(10):
            t = time.monotonic()
            s = scrape(port)
            took.append(time.monotonic() - t)
            found = found or bool(series(s, "ascend_pool_reserved_bytes", tenant="online"))
            time.sleep(0.1)
        assert found, "the tenant's process is not in the service's figures"
        # the squatter's 30000 files would slow every scrape: the median tells, where the slowest
        # one is also whatever a loaded machine made of one (about 70 ms each when idle)
        took.sort()
        worst, median = took[-1], took[len(took) // 2]
        assert median < 1.0 and worst < 10.0, f"scrapes took {[round(x, 2) for x in took]} s"
        grown = len(open(log_path).read().splitlines()) - lines_before
        assert grown <= 20, open(log_path).read()
        print(f"slowest scrape {worst * 1000:.0f} ms; the service's log grew by {grown} lines")
        # The service sweeps the trusted user's ledger too: a killed tenant process's share comes back.
        assert list(series(s, "ascend_pool_ledger_held_bytes", tenant="online").values()) == [42 * MiB]
        from ascend_pool._core import Ledger

        led = Ledger(os.path.join(base, private[0], f"ascend_pool-ledger-u{uid}-sim-{env['ASCEND_SIM_NODE']}-dev0"),
                     0, "sim", env["ASCEND_SIM_NODE"], None, uid)
        # The service lists the trusted user's share records too, and drops them when the exporter dies.
        assert w("share", 2 * MiB) == "shared"
        shared = series(scrape(port), "ascend_pool_shared_bytes", tenant="online", state="open")
        assert list(shared.values()) == [2 * MiB], shared
        records = [n for n in os.listdir(os.path.join(base, private[0])) if n.startswith("ascend_pool-share-")]
        assert len(records) == 1, records
        held = led.tenant("online")["held_bytes"]
        os.kill(w.host_pid(), signal.SIGKILL)
        t0 = time.monotonic()
        while led.view()["slots"]:
            assert time.monotonic() - t0 < 10.0, led.view()  # a sweep every 1 s; slack for load
            time.sleep(0.05)
        assert led.view()["reclaimed_bytes"] == held
        assert not series(scrape(port), "ascend_pool_shared_bytes", tenant="online")
        assert not os.path.exists(os.path.join(base, private[0], records[0]))  # removed by the service
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
        shutil.rmtree(root, ignore_errors=True)


# ---- stale records -----------------------------------------------------------------------------

def test_a_dead_exporters_share_record_is_removed_by_the_next_reader_and_never_exported(node, monkeypatch):
    env, base, procs = node
    exporter = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys
        import ascend_pool as ap
        from ascend_pool import identity
        pool = ap.Pool(0)
        pool.share(pool.share_malloc(4 << 20), any_process=True)
        print(identity.instance_hex(), flush=True)
        sys.stdin.readline()
    """)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    procs.append(exporter)
    instance = exporter.stdout.readline().strip()
    for k in ("ASCEND_POOL_LEDGER_DIR", "ASCEND_SIM_NODE"):
        monkeypatch.setenv(k, env[k])
    from ascend_pool.service.node_collector import NodeCollector
    from ascend_pool.sharing import shares

    def exported():
        fams = {f.name: f for f in NodeCollector(ledger=False)._shares()}
        return [s.labels["exporter_instance"] for s in fams["ascend_pool_shared_bytes"].samples]

    assert [r["exporter_instance"] for r in shares()] == [instance] and exported() == [instance]
    private = base / f"ascend_pool-u{os.geteuid()}"
    assert [n for n in os.listdir(private) if n.startswith("ascend_pool-share-")]
    exporter.kill()  # SIGKILL: it cleans nothing up
    exporter.wait()
    assert exported() == []  # the service's scrape: not shown, and the record is gone
    assert shares() == []
    assert not [n for n in os.listdir(private) if n.startswith("ascend_pool-share-")]


def test_a_sharing_group_works_in_one_2770_directory_the_service_reads_by_group(node):
    import stat as st_

    from ascend_pool.service.scanner import StatsScanner

    env, base, procs = node
    gid = os.getgid()
    w = Worker(env, procs, "online", "64MiB", ns=False, extra_env={"ASCEND_POOL_LEDGER_GROUP": str(gid)})
    assert w("malloc", 8 * MiB) == "granted"
    shared = base / f"ascend_pool-g{gid}"
    s = os.lstat(shared)
    assert st_.S_IMODE(s.st_mode) == 0o2770 and s.st_gid == gid
    names = os.listdir(shared)
    lease = f"ascend_pool-lease-{w.hello['instance']}"
    stats = f"ascend_pool-stats-{w.hello['instance']}"
    assert lease in names and any(n.startswith(f"ascend_pool-ledger-g{gid}-") for n in names), names
    assert st_.S_IMODE(os.stat(shared / lease).st_mode) == 0o640  # the group can test the lock
    deadline = time.monotonic() + 30  # published every 0.1 s; slack for a loaded machine
    while stats not in os.listdir(shared):
        assert time.monotonic() < deadline, os.listdir(shared)
        time.sleep(0.05)
    assert st_.S_IMODE(os.stat(shared / stats).st_mode) == 0o640
    # A service trusting the group (and not the owner's uid) reads it; one trusting neither does not.
    by_group = StatsScanner(str(base), allowed_uids={4242}, allowed_gids={gid}).scan()
    assert [p.instance for p in by_group] == [w.hello["instance"]]
    assert StatsScanner(str(base), allowed_uids={4242}).scan() == []


# A time namespace of its own (a CRIU-restored or migrated container; `unshare --time`): the
# kernel shows /proc/PID/stat's start time shifted by the *reader's* boot-time offset.
TIMENS = ["unshare", "--time", "--boottime", "100000", "--fork"]
_timens = subprocess.run(TIMENS + ["true"], capture_output=True, text=True)
needs_timens = pytest.mark.skipif(_timens.returncode != 0,
                                  reason=f"unshare --time fails here: {_timens.stderr.strip()}")


@needs_timens
def test_a_worker_in_its_own_time_namespace_is_alive_to_its_peers(node):
    # Same uid, same pid namespace, another time namespace: the start time its peers read for it
    # differs from the one it wrote. That was taken for a reused pid, so a live worker's quota
    # share was given away (80 + 80 MiB under a 100 MiB quota). The lease decides.
    env, base, procs = node
    a = Worker(env, procs, "t", "100MiB", ns=False, wrap=TIMENS)
    assert a("malloc", 80 * MiB) == "granted"
    b = Worker(env, procs, "t", "100MiB", ns=False)
    assert b("malloc", 80 * MiB) == "refused"
    assert a.proc.poll() is None


@needs_unshare
def test_a_quota_follows_the_npu_whatever_number_a_container_gives_it(node):
    # A container given the node's NPU 1 sees it as device 0 (ASCEND_RT_VISIBLE_DEVICES=1); a
    # process that sees every NPU calls it device 1. Their ledgers were keyed by the number each
    # saw (dev0, dev1): one tenant got 80 + 80 MiB on one NPU under a 100 MiB quota, while two
    # containers whose device 0 are different NPUs shared one quota. The node's device decides.
    env, base, procs = node
    on_npu1 = Worker(env, procs, "t", "100MiB", extra_env={"ASCEND_RT_VISIBLE_DEVICES": "1"})
    assert on_npu1("malloc", 80 * MiB) == "granted"
    same_npu = Worker(env, procs, "t", "100MiB", extra_env={"WORKER_DEVICE": "1"})
    assert same_npu("malloc", 80 * MiB) == "refused"
    other_npu = Worker(env, procs, "t", "100MiB", extra_env={"ASCEND_RT_VISIBLE_DEVICES": "2"})
    assert other_npu("malloc", 80 * MiB) == "granted"



@needs_unshare
def test_the_node_service_ps_and_stats_files_name_the_npu_not_the_containers_number(node, tmp_path):
    # A container's device 0 is the node's NPU 1: its stats file, `ascend-pool ps` and the node
    # service's figures say NPU 1, where a host process using NPU 1 (its device 1) is counted too
    # (they said device 0, and the service added it to NPU 0's figures).
    env, base, procs = node
    port = start_serve(env, procs, tmp_path / "serve.log")
    in_container = Worker(env, procs, "npu1", "none", extra_env={"ASCEND_RT_VISIBLE_DEVICES": "1"})
    on_host = Worker(env, procs, "npu1", "none", extra_env={"WORKER_DEVICE": "1"})
    assert in_container("malloc", 8 * MiB) == on_host("malloc", 4 * MiB) == "granted"
    ps = [sys.executable, "-m", "ascend_pool.cli", "ps", "--json", "--stats-dir", str(base)]

    def both_published():
        table = json.loads(subprocess.run(ps, env=env, capture_output=True, text=True, check=True).stdout)
        mine = [r for r in table if r["tenant"] == "npu1"]
        return mine if len(mine) == 2 and all(r["allocated_bytes"] for r in mine) else None

    deadline = time.monotonic() + 30
    while (rows := both_published()) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rows is not None, "both workers' stats files were expected within 30 s"
    assert [r["device"] for r in rows] == [1, 1], rows
    assert sorted(r["allocated_bytes"] // MiB for r in rows) == [4, 8], rows

    def node_figure():
        got = series(scrape(port), "ascend_pool_node_requested_bytes", tenant="npu1")
        return got if sum(got.values()) == 12 * MiB else None

    deadline = time.monotonic() + 30
    while (got := node_figure()) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert got is not None and {dict(k)["device"] for k in got} == {"1"}, got


@needs_unshare
def test_pods_of_one_host_agree_on_the_node_their_share_keys_are_valid_on():
    # On a real device a share handle named its node by the host name, and open_shared refuses a
    # handle of another node; every pod has a UTS namespace of its own (its hostname is the pod's
    # name), so a worker pod could never open a block another pod of the same host exported
    # (docs/containers.md, "Sharing across containers"). Pods share the kernel's boot id.
    from sim_fixtures import PKG_PARENT
    code = ("import socket, sys; socket.sethostname(sys.argv[1]); from ascend_pool import sharing; "
            "print(socket.gethostname(), sharing._node('acl'), sharing._node('cuda'))")
    env = dict(os.environ, PYTHONPATH=PKG_PARENT, PYTHONSAFEPATH="1")
    seen = []
    for pod in ("worker-pod-a", "exporter-pod-b"):
        r = subprocess.run(["unshare", "--uts", sys.executable, "-c", code, pod], capture_output=True, text=True,
                           env=env, cwd="/", timeout=60)
        assert r.returncode == 0, r.stderr
        seen.append(r.stdout.split())
    (host_a, acl_a, cuda_a), (host_b, acl_b, cuda_b) = seen
    assert (host_a, host_b) == ("worker-pod-a", "exporter-pod-b")
    assert acl_a == acl_b == cuda_a == cuda_b and acl_a.startswith("boot-"), seen


def _subset_pid_missing():
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    r = subprocess.run(["unshare", "--mount", "--pid", "--fork", "sh", "-c", "mount -t proc -o subset=pid proc /proc"],
                       capture_output=True, text=True)
    return None if r.returncode == 0 else f"procfs subset=pid cannot be mounted here (Linux 5.8+): {r.stderr.strip()}"


SUBSET_PID_MISSING = _subset_pid_missing()


@pytest.mark.skipif(SUBSET_PID_MISSING is not None, reason=str(SUBSET_PID_MISSING))
def test_a_pod_whose_proc_hides_the_boot_id_opens_its_neighbours_handles(node):
    # A pod hardened with procfs subset=pid (systemd's ProcSubset=pid: no /proc/sys, so no boot id)
    # named its node by its host name, the pod's own: it refused every handle of its neighbours
    # ("shared on node 'boot-...'; this process is on 'pod-a'") and they refused its handles
    # (/work/exp/ns23/repros/r4_share_node_without_boot_id.py). On the simulator the node is
    # ASCEND_SIM_NODE: sharing.node_name is patched in both processes so that the real backends' rule applies.
    env, _, _ = node
    importer = textwrap.dedent("""
        import pickle, socket, sys
        socket.sethostname("pod-a")
        import ascend_pool as ap
        from ascend_pool import sharing
        sharing.node_name = lambda backend: ""
        with ap.open_shared(pickle.loads(bytes.fromhex(sys.argv[1]))) as b:
            print("opened", b.size, flush=True)
    """)
    exporter = textwrap.dedent("""
        import os, pickle, subprocess, sys
        import ascend_pool as ap
        from ascend_pool import sharing
        sharing.node_name = lambda backend: ""
        pool = ap.Pool(0)
        ptr = pool.share_malloc(2 << 20)
        h = pool.share(ptr, any_process=True)
        shell = (f'mount -t proc -o subset=pid proc /proc && '
                 f'exec {sys.executable} -c "$IMPORTER" {pickle.dumps(h).hex()}')
        r = subprocess.run(["unshare", "--uts", "--mount", "--pid", "--fork", "sh", "-c", shell], capture_output=True,
                           text=True, timeout=60)
        print(h.node, r.stdout.strip(), r.stderr.strip()[-600:])
        pool.share_free(ptr)
    """)
    r = subprocess.run([sys.executable, "-c", exporter], env=dict(env, IMPORTER=importer), capture_output=True,
                       text=True, timeout=120, cwd="/")
    assert r.returncode == 0, r.stderr[-1500:]
    assert r.stdout.startswith("boot-") and "opened 2097152" in r.stdout, r.stdout


@needs_unshare
def test_workers_whose_lease_files_a_cleanup_removed_keep_their_shares_and_make_them_again(node, tmp_path):
    # A /dev/shm cleanup (or an init container) removed the lease files of two running workers,
    # pid 1 each in its own namespace: the node service's sweep took the holder for dead and gave
    # its 600 MiB away, and the leases never came back.
    # The workers publish no stats: their leases stay missing until their next context.
    env, base, procs = node
    port = start_serve(env, procs, tmp_path / "serve.log", "--sweep-interval", "1")
    quiet = {"ASCEND_POOL_STATS": "0"}
    a = Worker(env, procs, "cleaned", "1GiB", extra_env=quiet)
    b = Worker(env, procs, "cleaned", "1GiB", extra_env=quiet)
    assert a("malloc", 600 * MiB) == "granted"
    private = base / f"ascend_pool-u{os.geteuid()}"
    leases = [private / f"ascend_pool-lease-{w.hello['instance']}" for w in (a, b)]
    for lease in leases:
        lease.unlink()
    assert b("malloc", 600 * MiB) == "refused"
    time.sleep(2.5)  # two sweeps
    held = series(scrape(port), "ascend_pool_ledger_held_bytes", tenant="cleaned")
    assert list(held.values()) == [602 * MiB], held
    assert b("malloc", 600 * MiB) == "refused"
    assert not any(lease.exists() for lease in leases)  # all of that while they were missing
    assert [a("context", "-2"), b("context", "-2")] == ["opened", "opened"]
    assert all(lease.exists() for lease in leases)  # made again by their next ledger operation
    os.kill(a.host_pid(), signal.SIGKILL)  # dead now: its share is back within one sweep
    t0 = time.monotonic()
    while list(series(scrape(port), "ascend_pool_ledger_held_bytes", tenant="cleaned").values()) != [0]:
        assert time.monotonic() - t0 < 10.0, "the killed worker's share was not given back"  # slack for load
        time.sleep(0.05)
    assert b("malloc", 600 * MiB) == "granted"


CLEANED_EXPORTER = r'''
import base64, json, os, pickle, sys, time
import ascend_pool as ap
from ascend_pool import identity
pool = ap.Pool(0)
ptr = pool.share_malloc(4 << 20)
handle = pool.share(ptr, any_process=True)
child = os.fork()  # a forked child (a data loader, say) must not keep a killed exporter alive
if child == 0:
    time.sleep(600)
    os._exit(0)
print(json.dumps([identity.instance_hex(), base64.b64encode(pickle.dumps(handle)).decode()]), flush=True)
sys.stdin.readline()
print(json.dumps(pool.share_free(ptr)), flush=True)
sys.stdin.readline()
os.kill(os.getpid(), 9)
'''
# pid 1 of the exporter's namespace, which outlives it: the namespace (and the forked child) lives on
STAY = "import subprocess, sys, time; subprocess.call(sys.argv[1:]); time.sleep(600)"

CLEANED_IMPORTER = r'''
import base64, json, pickle, sys
import ascend_pool as ap
from ascend_pool import identity
handle = pickle.loads(base64.b64decode(sys.argv[1]))
block = ap.open_shared(handle)
print(json.dumps(identity.instance_hex()), flush=True)
sys.stdin.readline()
block.close()
print(json.dumps("closed"), flush=True)
'''


@needs_unshare
def test_an_exporter_and_an_importer_whose_lease_files_a_cleanup_removed_stay_alive_to_their_peers(node, monkeypatch):
    # Exporter and importer are pid 1, each in its own namespace, and publish no stats (their
    # leases are not made again until a context opens). A cleanup removed their lease files: a
    # peer's listing took the exporter for dead and removed its record for good (every later
    # open_shared: "no longer shared"), and the exporter dropped the importer and freed the block
    # under it. Their life locks on the record (identity.life_hold) say they are alive.
    env, base, procs = node
    env = dict(env, ASCEND_POOL_STATS="0")
    exporter = subprocess.Popen(NS + [sys.executable, "-c", STAY, sys.executable, "-c", CLEANED_EXPORTER], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(exporter)
    exp_instance, handle = json.loads(_hear(exporter))
    first = subprocess.Popen(NS + [sys.executable, "-c", CLEANED_IMPORTER, handle], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(first)
    imp_instance = json.loads(_hear(first))
    private = base / f"ascend_pool-u{os.geteuid()}"
    for inst in (exp_instance, imp_instance):
        (private / f"ascend_pool-lease-{inst}").unlink()
    for k in ("ASCEND_POOL_LEDGER_DIR", "ASCEND_SIM_NODE"):
        monkeypatch.setenv(k, env[k])
    from ascend_pool.sharing import shares

    (rec,) = shares()
    assert (rec["exporter_instance"], rec["importer_instances"]) == (exp_instance, [imp_instance])
    second = subprocess.run(NS + [sys.executable, "-c", CLEANED_IMPORTER, handle], env=env, input="\n",
                            capture_output=True, text=True, timeout=60)
    assert second.returncode == 0 and second.stdout.splitlines()[-1] == '"closed"', second.stderr
    _say(exporter, "free")
    assert json.loads(_hear(exporter)) is False  # the first importer still maps it
    _say(first, "close")
    assert json.loads(_hear(first)) == "closed"
    (rec,) = shares()
    assert rec["state"] == "closing" and rec["importers"] == []
    # Killed, its forked child alive: the record is a dead exporter's, removed by the next listing.
    _say(exporter, "die")
    t0 = time.monotonic()
    while shares():
        assert time.monotonic() - t0 < 10, "a killed exporter's record stayed alive (its forked child holds its lock?)"
        time.sleep(0.05)
    assert exporter.poll() is None  # the namespace, and the child with it, still lives
    assert not [n for n in os.listdir(private) if n.startswith("ascend_pool-share-")]


TWO_CONTEXTS = r'''
import json, os, sys
import ascend_pool as ap
pool = ap.Pool(0)
ctxs = [pool.context("online") for _ in range(int(sys.argv[1]))]  # a context per model, say
for c in ctxs:
    c.malloc(2 << 20)
print(json.dumps(os.getpid()), flush=True)
sys.stdin.readline()
'''


@needs_unshare
def test_the_ledgers_process_count_counts_processes_not_their_contexts(node, monkeypatch):
    # Two workers, pid 1 each in its own namespace: one with two contexts of the tenant, one with
    # one. ascend_pool_ledger_processes is 2 (it counted ledger slots, one per context: 3).
    env, base, procs = node
    workers = []
    for n in (2, 1):
        w = subprocess.Popen(NS + [sys.executable, "-c", TWO_CONTEXTS, str(n)], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(w)
        workers.append(w)
    assert [json.loads(_hear(w)) for w in workers] == [1, 1]
    for k in ("ASCEND_POOL_LEDGER_DIR", "ASCEND_SIM_NODE"):
        monkeypatch.setenv(k, env[k])
    from ascend_pool.metrics.ledger import ledger_families

    fams = {f.name: f for f in ledger_families()}
    assert [s.value for s in fams["ascend_pool_ledger_processes"].samples if s.labels["tenant"] == "online"] == [2]


MANY_EXPORTS = r'''
import json, sys
import ascend_pool as ap
from ascend_pool import identity
pool = ap.Pool(0)
handles = [pool.share(pool.share_malloc(1 << 20), any_process=True) for _ in range(int(sys.argv[1]))]
print(json.dumps(identity.instance_hex()), flush=True)
sys.stdin.readline()
'''


def test_an_exporter_of_a_hundred_blocks_whose_lease_file_a_cleanup_removed_keeps_them_all_shared(node, monkeypatch):
    # Each share record's life lock needs its descriptor in fork.c's drop table, which had 64
    # entries (the leases and the stats file's too): past some 60 exports identity.life_hold got
    # False, and once a cleanup removed the exporter's lease file a listing removed 37 of its 100
    # live records for good (every later open_shared of them: "no longer shared").
    env, base, procs = node
    env = dict(env, ASCEND_POOL_STATS="0")
    exporter = subprocess.Popen([sys.executable, "-c", MANY_EXPORTS, "100"], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(exporter)
    instance = json.loads(_hear(exporter))
    (base / f"ascend_pool-u{os.geteuid()}" / f"ascend_pool-lease-{instance}").unlink()
    for k in ("ASCEND_POOL_LEDGER_DIR", "ASCEND_SIM_NODE"):
        monkeypatch.setenv(k, env[k])
    from ascend_pool.sharing import shares

    assert len(shares()) == 100
    assert len(shares()) == 100  # the first listing removed none
    _say(exporter, "done")
    assert exporter.wait(timeout=30) == 0, exporter.stderr.read()


@needs_unshare
def test_list_gpu_processes_tells_two_containers_pid_1_workers_apart(node):
    # torch's line has a pid only, and the pid is the worker's own namespace's: two containers'
    # workers both printed "process 1 uses ... (tenant online)", alike. Each line names the
    # process's instance too, as `ps` does.
    env, base, procs = node
    a, b = Worker(env, procs, "online", "1GiB"), Worker(env, procs, "online", "1GiB")
    assert a.hello["pid"] == b.hello["pid"] == 1
    assert a("malloc", 8 * MiB) == b("malloc", 8 * MiB) == "granted"
    code = "import ascend_pool as ap; print(ap.list_gpu_processes(0))"
    deadline = time.monotonic() + 30
    while True:
        text = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=60).stdout
        ones = [ln for ln in text.splitlines() if ln.startswith(f"process {1:>10d} uses")]
        if len(ones) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(ones) == 2, text
    assert all(ln.endswith(")") and "MB NPU memory (tenant online, instance " in ln for ln in ones), text
    # then each one's pid here (the host's: this test runs there), which kill and top take
    got = [re.search(r"instance ([0-9a-f]{16}), pid here (\d+)\)$", ln) for ln in ones]
    assert all(got) and sorted(m.group(1) for m in got) == sorted([a.hello["instance"], b.hello["instance"]]), text
    assert len({m.group(2) for m in got}) == 2 and "1" not in {m.group(2) for m in got}, text


@needs_unshare
def test_ps_and_the_node_service_say_the_pid_namespace_of_each_pid_1_worker(node, tmp_path):
    # Seen from a third pid namespace (the node service's pod, `kubectl exec` into it), two
    # containers' workers were PID 1 twice with PID_HERE "-" (pid_here ""), and nothing said which
    # namespace each 1 was in: neither could be found on the host. PIDNS / pidns is the inode of
    # the namespace, as `lsns -t pid` and /proc/PID/ns/pid give it there.
    env, base, procs = node
    a, b = Worker(env, procs, "online", "1GiB"), Worker(env, procs, "online", "1GiB")
    assert a("malloc", 8 * MiB) == b("malloc", 8 * MiB) == "granted"
    want = {w.hello["instance"]: str(os.stat(f"/proc/{w.host_pid()}/ns/pid").st_ino) for w in (a, b)}
    assert len(set(want.values())) == 2 and str(os.stat("/proc/self/ns/pid").st_ino) not in want.values()
    deadline = time.monotonic() + 30
    while True:  # each worker publishes every 0.1 s
        r = subprocess.run(NS + [sys.executable, "-m", "ascend_pool.cli", "ps"], env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        rows = {ln.split()[1]: ln.split() for ln in lines[1:] if " online " in ln}
        if set(rows) == set(want) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert lines[0].split()[-3:] == ["PID_HERE", "UID", "PIDNS"], r.stdout
    assert {i: (row[0], row[-3], row[-1]) for i, row in rows.items()} == {i: ("1", "-", ns) for i, ns in want.items()}
    rows = json.loads(subprocess.run(NS + [sys.executable, "-m", "ascend_pool.cli", "ps", "--json"], env=env,
                                     capture_output=True, text=True, timeout=60).stdout)
    assert {r["instance"]: str(r["pidns"]) for r in rows if r["tenant"] == "online"} == want
    port = start_serve(env, procs, tmp_path / "serve.log")  # in a pid namespace of its own
    s = scrape(port)
    got = {dict(lab)["instance"]: (dict(lab)["pid"], dict(lab)["pid_here"], dict(lab)["pidns"])
           for lab in series(s, "ascend_pool_reserved_bytes", tenant="online", pool="large")}
    assert got == {i: ("1", "", ns) for i, ns in want.items()}, got
    ages = {dict(lab)["instance"]: dict(lab)["pidns"] for lab in series(s, "ascend_pool_stats_age_seconds", pid=1)}
    assert {i: ages.get(i) for i in want} == want, ages
    # ap.list_gpu_processes there: "pid here -", then the namespace
    code = "import ascend_pool as ap; print(ap.list_gpu_processes(0))"
    text = subprocess.run(NS + [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60).stdout
    got = dict(re.findall(r"instance ([0-9a-f]{16}), pid here -, pid namespace (\d+)\)$", text, re.M))
    assert got == want, text


@needs_unshare
def test_ps_in_a_pid_namespace_without_its_own_proc_gives_no_pid_another_namespace_has(node, tmp_path):
    # `unshare --pid` without a /proc of its own (a container given the host's /proc): /proc/locks
    # names the pids of /proc's namespace. ps gave a host worker its host pid as PID_HERE, which
    # no kill there reaches ("No such process"), and a worker of its own namespace the host's pid
    # instead of its own; so did the node service's pid_here label.
    env, base, procs = node
    host = Worker(env, procs, "online", "1GiB", ns=False)
    assert host("malloc", 8 * MiB) == "granted"
    bare = ["unshare", "--pid", "--fork", "--kill-child"]
    script = (f'mkfifo "$D/in"; {sys.executable} -c "$WORKER" online 1GiB < "$D/in" > "$D/out" & exec 3> "$D/in"; '
              'while [ ! -s "$D/out" ]; do sleep 0.05; done; '  # then until ps lists it beside the host's
              f'for i in $(seq 100); do {sys.executable} -m ascend_pool.cli ps --json > "$D/ps.json"; '
              '[ "$(grep -c \'"tenant": "online"\' "$D/ps.json")" -ge 2 ] && break; sleep 0.1; done')
    r = subprocess.run(bare + ["sh", "-c", script], env=dict(env, D=str(tmp_path), WORKER=WORKER), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    inner = json.loads((tmp_path / "out").read_text().splitlines()[0])
    rows = {row["instance"]: row["pid_here"] for row in json.loads((tmp_path / "ps.json").read_text())
            if row["tenant"] == "online"}
    assert rows == {host.hello["instance"]: None, inner["instance"]: inner["pid"]}, rows  # the pid kill takes there
    port = start_serve(env, procs, tmp_path / "serve.log", prefix_ns=bare)
    got = {dict(lab)["instance"]: dict(lab)["pid_here"]
           for lab in series(scrape(port), "ascend_pool_reserved_bytes", tenant="online", pool="large")}
    assert got == {host.hello["instance"]: ""}, got


@needs_unshare
def test_a_ledger_in_a_containers_own_dev_shm_is_said_to_split_the_quota(tmp_path):
    # Docker and Kubernetes give each container (pod) an IPC namespace with its own /dev/shm, the
    # ledgers' default directory: two pods' workers each booked the tenant in a ledger of their
    # own, 60 + 60 MiB granted under 100 MiB, and nothing said so.
    sim = tmp_path / "sim"
    sim.mkdir()
    env = dict(os.environ, ASCEND_SIM_NODE=f"c{uuid.uuid4().hex[:10]}", ASCEND_SIM_SHM_DIR=str(sim),
               ASCEND_POOL_BACKEND="sim", ASCEND_POOL_STATS="0", PYTHONSAFEPATH="1",
               PYTHONPATH=os.pathsep.join(filter(None, [PKG_PARENT, os.environ.get("PYTHONPATH")])))
    for k in ("ASCEND_POOL_LEDGER_DIR", "ASCEND_POOL_CONFIG", "ASCEND_POOL_TENANT", "ASCEND_POOL_LEDGER_GROUP"):
        env.pop(k, None)
    code = ("import sys\nimport ascend_pool as ap\nctx = ap.Pool(0).context('online', quota='100MiB')\n"
            "p = ctx.malloc(60 << 20)\nctx2 = ap.Pool(0).context('batch', quota='100MiB')\n"
            "print('granted', flush=True)\nsys.stdin.readline()\n")
    said = "IPC namespace of its own"

    def container(ipc=True, extra_env=None):
        inner = f"mount -t tmpfs tmpfs /dev/shm && exec {sys.executable} -c \"$0\""
        return subprocess.Popen(["unshare"] + (["--ipc"] if ipc else []) + ["--mount"] + NS[1:] + ["sh", "-c", inner,
                                                                                                  code],
                                env=dict(env, **(extra_env or {})), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    pods = [container(), container()]
    assert [p.stdout.readline().strip() for p in pods] == ["granted", "granted"]  # the split: each its own ledger
    for p in pods:
        out, err = p.communicate("\n", timeout=60)
        assert p.returncode == 0, err
        assert err.count(said) == 1 and "ASCEND_POOL_LEDGER_DIR" in err, err  # once per process; before: nothing
    # chosen on purpose (a quota per pod), or the host's IPC namespace (hostIPC): nothing said
    for p in (container(extra_env={"ASCEND_POOL_LEDGER_DIR": "/dev/shm"}), container(ipc=False)):
        assert p.stdout.readline().strip() == "granted"
        out, err = p.communicate("\n", timeout=60)
        assert p.returncode == 0 and said not in err, err

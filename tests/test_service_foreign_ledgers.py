"""A root node service (`ascend-pool serve --allow-uid UID`) reading the quota ledgers of another
user: that user owns its files and may truncate, replace or lock them at any time. The service
must never die of it (a mapping read past the end of a truncated file is SIGBUS), must follow a
ledger that was removed and created again (exported, and its dead processes swept), and must keep
its scrapes bounded while a process of that user holds its ledger's lock (stopped inside an
update). Needs root and runuser (tests/other_user.py; CI runs as root)."""
import glob
import os
import pwd
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from metrics_scrape import scrape, series, start_serve  # noqa: E402
from other_user import OTHER, two_users  # noqa: E402,F401

MiB = 1 << 20

HOLDER = """
import ascend_pool as ap
pool = ap.Pool(0)
ctx = pool.context(sys.argv[1], quota=int(sys.argv[2]) << 20)
held = ctx.malloc(int(sys.argv[3]) << 20)
print("ready", flush=True)
sys.stdin.readline()
"""


def _holder(node, user, tenant, quota_mib, size_mib):
    """A process of `user` holding size_mib of tenant's quota; returns its Popen."""
    argv = node.argv(user, "import os, sys\nprint(os.getpid(), flush=True)\n" + HOLDER, prelude=False)
    argv = argv + [tenant, str(quota_mib), str(size_mib)]
    p = subprocess.Popen(argv, env=node.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=node.root)
    pid = p.stdout.readline().strip()
    node.procs.append((p, int(pid) if pid.isdigit() else None))
    line = p.stdout.readline().strip()
    assert line == "ready", p.stderr.read() if p.poll() is not None else line
    p.pid_inside = int(pid)
    return p


def _kill(p):
    os.kill(p.pid_inside, 9)
    if p.poll() is None:
        p.kill()
    p.communicate(timeout=10)


def _ledger_of(node, uid):
    (path,) = glob.glob(os.path.join(node.shm, f"ascend_pool-u{uid}", f"ascend_pool-ledger-u{uid}-*dev0"))
    return path


def _held(samples, uid, tenant):
    return {dict(lab)["tenant"]: v for lab, v in series(samples, "ascend_pool_ledger_held_bytes", device=0,
                                                         uid=uid).items()}.get(tenant)


def _wait(what, fn, timeout=20):
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def _alive_scrape(proc, port, log):
    assert proc.poll() is None, f"the service died (status {proc.poll()}; -7: SIGBUS)\n{log.read_text()}"
    return scrape(port)


def test_a_user_truncating_its_ledger_never_kills_the_service(two_users, tmp_path):
    node = two_users
    other = str(pwd.getpwnam(OTHER).pw_uid)
    mine = _holder(node, None, "mine", 100, 10)       # root's own ledger: still exported after
    theirs = _holder(node, OTHER, "theirs", 64, 8)
    log = tmp_path / "serve.log"
    proc, port = start_serve(node.env(), log, "--allow-uid", other, "--sweep-interval", "0.3")
    node.procs.append((proc, None))
    assert _wait("their ledger", lambda: (_held(scrape(port), other, "theirs") or 0) >= 8 * MiB), scrape(port)
    _kill(theirs)  # it maps the file too; the truncation is the user's own business
    node.run(OTHER, f"import os; os.truncate({_ledger_of(node, other)!r}, 0)", prelude=False)
    time.sleep(1.5)  # several sweeps of the truncated file
    s = _alive_scrape(proc, port, log)
    time.sleep(0.5)
    s = _alive_scrape(proc, port, log)
    assert (_held(s, "0", "mine") or 0) >= 10 * MiB, s  # the other users' figures are still served
    assert _held(s, other, "theirs") is None, s
    assert "ledger" in log.read_text() and other in log.read_text(), log.read_text()


def test_a_ledger_removed_and_created_again_is_followed_by_the_service(two_users, tmp_path):
    node = two_users
    other = str(pwd.getpwnam(OTHER).pw_uid)
    first = _holder(node, OTHER, "online", 64, 8)
    log = tmp_path / "serve.log"
    proc, port = start_serve(node.env(), log, "--allow-uid", other, "--sweep-interval", "0.3")
    node.procs.append((proc, None))
    assert _wait("the first ledger", lambda: (_held(scrape(port), other, "online") or 0) >= 8 * MiB), scrape(port)
    _kill(first)
    time.sleep(1.0)
    path = _ledger_of(node, other)
    node.run(OTHER, f"import os; os.unlink({path!r})", prelude=False)
    second = _holder(node, OTHER, "online", 64, 16)
    seen = _wait("the new ledger", lambda: (_held(_alive_scrape(proc, port, log), other, "online") or 0) >= 16 * MiB)
    assert seen, ("no series for the re-created ledger", _held(scrape(port), other, "online"))
    _kill(second)

    def swept():
        out = node.run(OTHER, f"""
            import json
            from ascend_pool._core import Ledger
            v = Ledger({path!r}, 0, "sim", {node.name!r}).view()
            print(json.dumps([sum(t["held_bytes"] for t in v["tenants"]), len(v["slots"])]))
            """, prelude=False)
        return out.split() and out.strip() == "[0, 0]"
    assert _wait("the sweep", swept, timeout=10), "the killed process's share in the new ledger was never swept"


LOCKER = """
import fcntl
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("ready", flush=True)
sys.stdin.readline()
"""


def test_a_user_holding_its_ledger_lock_never_stalls_a_scrape(two_users, tmp_path):
    node = two_users
    other = str(pwd.getpwnam(OTHER).pw_uid)
    mine = _holder(node, None, "mine", 100, 10)
    theirs = _holder(node, OTHER, "theirs", 64, 8)
    # Stands for a process of theirs stopped (SIGSTOP) inside a ledger update, lock held.
    argv = node.argv(OTHER, "import os, sys\nprint(os.getpid(), flush=True)\n" + LOCKER, prelude=False) + [_ledger_of(node, other)]
    locker = subprocess.Popen(argv, env=node.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=node.root)
    pid = locker.stdout.readline().strip()
    node.procs.append((locker, int(pid) if pid.isdigit() else None))
    assert locker.stdout.readline().strip() == "ready", locker.stderr.read()
    log = tmp_path / "serve.log"
    proc, port = start_serve(node.env(), log, "--allow-uid", other, "--sweep-interval", "0.3")
    node.procs.append((proc, None))
    times = []
    for _ in range(3):
        t = time.monotonic()
        s = _alive_scrape(proc, port, log)
        times.append(round(time.monotonic() - t, 2))
        time.sleep(0.3)
    assert max(times) < 5, times  # before: 10-20 s each (past Prometheus' scrape timeout); room for load
    assert (_held(s, "0", "mine") or 0) >= 10 * MiB, s
    # The ledger needs no lock to be read: their figures are still served.
    assert (_held(s, other, "theirs") or 0) >= 8 * MiB, s

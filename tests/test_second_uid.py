"""A tenant's processes of two uids on one node (root and uid 4242, both of group 4321 shared
through ASCEND_POOL_LEDGER_GROUP), each in a pid namespace of its own (`unshare --pid --fork
--mount-proc`: both are pid 1), and a second uid whose shared directory root made 0755.

What a user relies on: the quota holds across the two uids whichever made the ledger, a killed
holder's bytes come back to the tenant, and a process that cannot join is refused with a typed
error naming the directory and the permission, never left to book apart. The other uid runs
through setpriv (numeric ids, no passwd entry needed), the namespaces through unshare: both need
root, which CI has; elsewhere the tests skip, saying which is missing.
"""
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import NS, UNSHARE_MISSING, UidNode, as_uid, uid_world  # noqa: E402

OTHER, GID = 4242, 4321
MiB = 1 << 20
SKIP = ("setpriv is not installed" if shutil.which("setpriv") is None else
        "running code as another uid needs root" if os.geteuid() != 0 else UNSHARE_MISSING)
pytestmark = pytest.mark.skipif(SKIP is not None, reason=str(SKIP))


@pytest.fixture(scope="module")
def world():
    yield from uid_world("ap-second-uid-", OTHER, (GID,))


def _as(uid):
    """The prefix that runs a command as uid (None: this user, root) in group GID."""
    return as_uid(uid, (GID,))


def Node(world, base_mode=0o1777):
    # the simulator's records in a directory of their own: shm's mode is the test's to choose
    return UidNode(world, "s", shm_mode=base_mode, sim_dir=True, ASCEND_POOL_STATS="1",
                   ASCEND_POOL_STATS_INTERVAL="0.1")


@pytest.fixture
def node(world):
    n = Node(world)
    try:
        yield n
    finally:
        n.close()


WORKER = """
    import json, os, sys
    import ascend_pool as ap
    from ascend_pool import identity
    from ascend_pool.errors import QuotaExceededError
    ctx = ap.Pool(0).context("online", quota="100MiB")
    print(json.dumps({"pid": os.getpid(), "uid": os.geteuid(), "instance": identity.instance_hex()}), flush=True)
    keep = []
    for line in sys.stdin:
        try:
            keep.append(ctx.malloc(int(line)))
            print(json.dumps("granted"), flush=True)
        except QuotaExceededError:
            print(json.dumps("refused"), flush=True)
"""


class Worker:
    def __init__(self, node, uid):
        self.proc = node.start(uid, (GID,), WORKER, ns=True, ASCEND_POOL_LEDGER_GROUP=GID)
        self.hello = self._line()

    def _line(self):
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            pytest.fail(f"worker gave no answer: {self.proc.stderr.read()}")
        return json.loads(line)

    def malloc(self, nbytes):
        self.proc.stdin.write(f"{nbytes}\n")
        self.proc.stdin.flush()
        return self._line()

    def host_pid(self):
        """The worker's pid here (unshare's child: pid 1 of its own namespace)."""
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            return int(f.read().split()[0])

    def kill(self):
        """SIGKILL to the worker itself, which cleans nothing up."""
        os.kill(self.host_pid(), signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.mark.parametrize("creator", ["root", "second uid"])
def test_two_uids_of_a_group_in_two_pid_namespaces_share_a_quota_and_get_a_killed_holders_bytes(node, creator):
    first, second = (None, OTHER) if creator == "root" else (OTHER, None)
    a = Worker(node, first)  # makes the group's directory and ledger
    b = Worker(node, second)  # joins them
    assert (a.hello["pid"], b.hello["pid"]) == (1, 1)
    assert {a.hello["uid"], b.hello["uid"]} == {0, OTHER}
    group_dir = os.path.join(node.shm, f"ascend_pool-g{GID}")
    ledgers = [n for n in os.listdir(group_dir) if n.startswith("ascend_pool-ledger")]
    assert ledgers == [f"ascend_pool-ledger-g{GID}-sim-{node.name}-dev0"]  # one ledger, not one per uid
    assert [a.malloc(60 * MiB), b.malloc(60 * MiB)] == ["granted", "refused"]  # 100 MiB for the two
    a.kill()
    # The holder's lease dropped with it: the tenant's next request takes its share back, whoever
    # made the ledger and whichever uid the dead holder ran as.
    assert b.malloc(60 * MiB) == "granted"


def test_a_second_uid_that_cannot_create_its_directory_is_told_the_directory_and_its_mode(world):
    # A hostPath root made 0755 (kubelet's DirectoryOrCreate) as ASCEND_POOL_LEDGER_DIR of a pod
    # running as another uid: before, the LedgerError named a random temporary name and nothing
    # else ("[Errno 13] Permission denied: '.../.ascend_pool-tmp-u4242-7aff5591b38abb01'"), and so did
    # the stats publisher's warning.
    n = Node(world, base_mode=0o755)
    try:
        p = n.start(OTHER, (GID,), """
            import logging, ascend_pool as ap
            logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
            try:
                ap.Pool(0).context("online", quota="64MiB").malloc(1 << 20)
                print("GRANTED")
            except ap.PoolError as e:
                print("REFUSED", type(e).__name__, getattr(e, "kind", None), e)
        """)
        out, err = p.communicate(timeout=60)
        want = (f"cannot create the private directory of uid {OTHER} in {n.shm} (owner uid 0, group 0, mode 0755): "
                f"this process (uid {OTHER}) may not create entries there")
        assert out.startswith("REFUSED LedgerError permission") and want in out and "1777" in out, (out, err)
        assert ".ascend_pool-tmp" not in out + err
        assert want in err  # the stats publisher's warning
        assert os.listdir(n.shm) == []
    finally:
        n.close()


def test_ps_gives_each_pid_1_worker_its_pid_here_and_none_from_another_namespace(node):
    # Before, ps gave the pid in the worker's own namespace only: on the host two containers' workers
    # were both "1", which no kill, top or npu-smi there takes. PID_HERE is the pid in ps's own pid
    # namespace, from the kernel's /proc/locks (the writer's lock on its stats file).
    a, b = Worker(node, None), Worker(node, OTHER)
    want = {a.hello["instance"]: a.host_pid(), b.hello["instance"]: b.host_pid()}
    args = ["-m", "ascend_pool.cli", "ps", "--json", "--allow-uid", str(OTHER), "--allow-group", str(GID)]

    def ps(prefix=()):
        for _ in range(100):  # the workers publish every 0.1 s
            r = subprocess.run(list(prefix) + [node.exe] + args, env=node.env(ASCEND_POOL_LEDGER_GROUP=GID),
                               capture_output=True, text=True, timeout=60, cwd="/")
            assert r.returncode == 0, r.stderr
            rows = {row["instance"]: row for row in json.loads(r.stdout) if row["tenant"] == "online"}
            if set(rows) == set(want):
                return rows
            time.sleep(0.1)
        pytest.fail(f"ps did not list both workers: {r.stdout}")

    rows = ps()
    assert {i: (r["pid"], r["pid_here"], r["uid"]) for i, r in rows.items()} == {
        a.hello["instance"]: (1, want[a.hello["instance"]], 0),
        b.hello["instance"]: (1, want[b.hello["instance"]], OTHER)}
    # ps in a pid namespace of its own sees into neither worker's: no pid here, the pid as it was.
    rows = ps(NS)
    assert {i: (r["pid"], r["pid_here"]) for i, r in rows.items()} == {i: (1, None) for i in want}
    # The table: PID_HERE ("-" where unknown), then the UID telling the two users' pid-1 workers apart.
    table = subprocess.run([node.exe] + [x for x in args if x != "--json"], env=node.env(ASCEND_POOL_LEDGER_GROUP=GID),
                           capture_output=True, text=True, timeout=60, cwd="/").stdout.splitlines()
    assert table[0].split()[-3:-1] == ["PID_HERE", "UID"]
    cells = {line.split()[1]: (line.split()[0], *line.split()[-3:-1]) for line in table[1:] if " online " in line}
    assert cells == {a.hello["instance"]: ("1", str(want[a.hello["instance"]]), "0"),
                     b.hello["instance"]: ("1", str(want[b.hello["instance"]]), str(OTHER))}, table


@pytest.mark.parametrize("change", ["group", "mode"])
def test_a_member_refused_a_ledger_root_made_is_told_its_group_or_mode(node, change):
    # Root's process made the group's ledger; an admin's chgrp or chmod left it unreadable to the
    # other members. Before, a member's context was refused "cannot open ledger PATH: Permission
    # denied", naming neither the file's group nor its mode (root, which opens anything, was told).
    maker = node.start(None, (GID,), "import ascend_pool as ap; ap.Pool(0).context('online', quota='64MiB')",
                       ASCEND_POOL_LEDGER_GROUP=GID)
    out, err = maker.communicate(timeout=60)
    assert maker.returncode == 0, err
    path = os.path.join(node.shm, f"ascend_pool-g{GID}", f"ascend_pool-ledger-g{GID}-sim-{node.name}-dev0")
    if change == "group":
        os.chown(path, -1, 0)
        want = f"ledger {path} belongs to group 0, not to the configured group {GID}; refusing it"
    else:
        os.chmod(path, 0o600)
        want = f"ledger {path} has permissions 0600; a group ledger must be 0660 (owner and group), refusing it"
    p = node.start(OTHER, (GID,), """
        import os, ascend_pool as ap
        from ascend_pool.tenants.ledger import read_view
        try:
            ap.Pool(0).context("online", quota="64MiB").malloc(1 << 20)
            print("GRANTED")
        except ap.PoolError as e:
            print("REFUSED", type(e).__name__, getattr(e, "kind", None), e)
        try:  # what a member's node service exports of the group's ledgers
            read_view(os.environ["LEDGER"], 0, "sim", os.environ["ASCEND_SIM_NODE"], group=int(os.environ["GID"]))
            print("READ")
        except ap.PoolError as e:
            print("VIEW", type(e).__name__, e)
    """, ASCEND_POOL_LEDGER_GROUP=GID, LEDGER=path, GID=GID)
    out, err = p.communicate(timeout=60)
    refused, view = out.splitlines()
    assert refused.startswith("REFUSED LedgerError permission") and want in refused, (out, err)
    assert view.startswith("VIEW LedgerError") and want in view, (out, err)


def test_the_node_services_per_process_series_and_list_gpu_processes_give_pid_here(node, tmp_path):
    # The node service's per-process series carried only the pid in each worker's own namespace
    # (both 1 here); ps had PID_HERE. pid_here is the worker's pid in the service's namespace, ''
    # for a service in a pid namespace of its own (a DaemonSet without hostPID).
    from metrics_scrape import scrape, series, start_serve

    a, b = Worker(node, None), Worker(node, OTHER)
    want = {a.hello["instance"]: str(a.host_pid()), b.hello["instance"]: str(b.host_pid())}
    env = node.env(ASCEND_POOL_LEDGER_GROUP=GID)
    for prefix, expect in (((), want), (NS, dict.fromkeys(want, ""))):
        proc, port = start_serve(env, tmp_path / "serve.log", "--allow-uid", str(OTHER), prefix=prefix)
        node.procs.append(proc)
        try:
            for _ in range(100):
                s = scrape(port)
                got = {dict(lab)["instance"]: (dict(lab)["pid"], dict(lab)["pid_here"])
                       for lab in series(s, "ascend_pool_reserved_bytes", tenant="online", pool="large")}
                age = {dict(lab)["instance"]: dict(lab)["pid_here"] for lab in series(s, "ascend_pool_stats_age_seconds")}
                if set(got) == set(want):
                    break
                time.sleep(0.1)
            assert got == {i: ("1", h) for i, h in expect.items()}, (prefix, got)
            assert {i: age.get(i) for i in want} == expect
        finally:
            proc.kill()
            proc.wait()
    # ap.list_gpu_processes (on the host: the group's workers) says each one's pid here too
    r = subprocess.run([node.exe, "-c", "import ascend_pool as ap; print(ap.list_gpu_processes(0))"],
                       env=node.env(ASCEND_POOL_LEDGER_GROUP=GID), capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    lines = {i: ln for ln in r.stdout.splitlines() for i in want if f"instance {i}" in ln}
    assert {i: ln.split()[:2] + ln.split(", ")[-1:] for i, ln in lines.items()} == {
        i: ["process", "1", f"pid here {h})"] for i, h in want.items()}, r.stdout

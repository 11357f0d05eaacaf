"""Processes in user namespaces (rootless containers, pods with hostUsers: false): one host user is
one user, inside its namespace and outside it.

A process names its files (the simulator's node records, leases and IPC files; the private
directory, quota ledgers, stats file and share records) and stores its uid in them by its *host*
uid: the uid /proc/self/uid_map maps its euid to (identity.host_uid(), host_ids.h in C). Checks of a
file's owner (st_uid) stay in this namespace's view. Before 2026-12 everything was named by the uid
inside the namespace, so the worker in the namespace shared nothing with the host's processes of
the same host user: the simulated device was over-committed, each side had its own quota ledger,
`ascend-pool ps` outside did not list it (/work/exp/uid14/repros/r03, r04).

Here `unshare --user --map-user=4242` runs a worker as uid 4242 in a namespace whose map says
"4242 <our uid> 1": the host's uid is ours, so the worker is this user.

Needs root (or unprivileged user namespaces) and util-linux's unshare --map-user.
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from other_user import SKIP as OTHER_USER_SKIP, two_users  # noqa: E402,F401
from sim_fixtures import sim_node  # noqa: E402,F401

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "containers.md")
NS = ["unshare", "--user", "--map-user=4242"]


def _can_userns():
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    r = subprocess.run(NS + ["true"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"unshare --user --map-user fails here: {r.stderr.strip()}"


USERNS_MISSING = _can_userns()
pytestmark = pytest.mark.skipif(USERNS_MISSING is not None, reason=str(USERNS_MISSING))

# Allocates MiB on device 0 (in tenant TENANT's context with quota QUOTA when given), prints one
# JSON line, waits for a line on stdin (holding its memory), then exits.
WORKER = textwrap.dedent("""
    import json, os, sys, time
    import ascend_pool as ap
    from ascend_pool import identity
    pool = ap.Pool(0)
    tenant = os.environ.get("TENANT")
    alloc = pool.context(tenant, quota=os.environ["QUOTA"]) if tenant else pool
    try:
        x = alloc.malloc(int(os.environ["MIB"]) << 20); r = "granted"
    except ap.QuotaExceededError:
        r = "over quota"
    except ap.OutOfMemoryError:
        r = "refused"
    time.sleep(float(os.environ.get("SETTLE", "0")))      # the stats file is made
    print(json.dumps({"uid": os.geteuid(), "host_uid": identity.host_uid(), "malloc": r,
                      "instance": identity.instance_hex()}), flush=True)
    sys.stdin.readline()
""")


def _workers(env, argvs, tmp_path):
    """Starts the workers one after the other (each has allocated before the next starts); returns
    (procs, rows). The caller releases them with _finish."""
    procs, rows = [], []
    try:
        for argv, extra in argvs:
            p = subprocess.Popen(argv + [sys.executable, "-c", WORKER], env={**env, **extra}, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
            procs.append(p)
            line = p.stdout.readline()
            assert line, p.communicate(timeout=30)[1][-1200:]
            rows.append(json.loads(line))
    except BaseException:
        _finish(procs)
        raise
    return procs, rows


def _finish(procs):
    return [p.communicate("\n", timeout=30)[1] for p in procs]


def _env(sim_node, tmp_path, **kw):
    os.chmod(tmp_path, 0o755)
    return sim_node.env(ASCEND_POOL_BACKEND="sim", ASCEND_SIM_DEVICES="1", ASCEND_POOL_LEDGER_DIR=tmp_path,
                        ASCEND_POOL_STATS_DIR=tmp_path, **kw)


def test_a_process_in_a_user_namespace_shares_the_simulated_device_with_its_host_user(sim_node, tmp_path):
    # /work/exp/uid14/repros/r03_userns_sim_overcommit.py: before, every 400 MiB below was granted
    # on the 1 GiB device (1200 MiB): the worker in the namespace kept its own node record.
    env = _env(sim_node, tmp_path, ASCEND_POOL_STATS="0", MIB="400")
    me = os.geteuid()
    procs, rows = _workers(env, [([], {}), (NS, {}), ([], {})], tmp_path)
    errs = _finish(procs)
    assert [r["uid"] for r in rows] == [me, 4242, me], rows
    assert [r["host_uid"] for r in rows] == [me] * 3, rows
    assert [r["malloc"] for r in rows] == ["granted", "granted", "refused"], (rows, errs[1][-800:])
    # one node record of this user's, the namespace's worker's slots in it; none named 4242
    records = sorted(n for n in os.listdir(sim_node.shm_dir) if n.startswith("ascendsim-") and "-dev0" in n
                     and ".tmp" not in n)
    assert records == [f"ascendsim-{me}-{sim_node.name}-dev0"], records
    assert not [n for n in os.listdir(sim_node.shm_dir) if "-4242-" in n or n.startswith("ascend_pool-u4242")]
    # the map translates the uid: nothing to warn about, on either side
    for err in errs:
        assert "user namespace" not in err, err[-800:]


def test_a_tenant_quota_holds_across_a_user_namespace_of_the_same_host_user(sim_node, tmp_path):
    # before: the worker in the namespace booked in its own ledger (ascend_pool-u4242/...) and was
    # granted its 80 MiB beside the host's 80 MiB, on a quota of 100 MiB
    env = _env(sim_node, tmp_path, ASCEND_POOL_STATS="0", MIB="80", TENANT="t", QUOTA="100MiB")
    me = os.geteuid()
    for order in ([[], NS], [NS, []]):
        procs, rows = _workers(env, [(order[0], {}), (order[1], {})], tmp_path)
        _finish(procs)
        assert [r["malloc"] for r in rows] == ["granted", "over quota"], (order, rows)
    ledgers = sorted(n for d in os.listdir(tmp_path) if d.startswith("ascend_pool-u")
                     for n in os.listdir(tmp_path / d) if n.startswith("ascend_pool-ledger-"))
    assert ledgers == [f"ascend_pool-ledger-u{me}-sim-{sim_node.name}-dev0"], ledgers
    assert sorted(d for d in os.listdir(tmp_path) if d.startswith("ascend_pool-u")) == [f"ascend_pool-u{me}"]


def test_ps_lists_the_host_users_processes_inside_and_outside_a_user_namespace(sim_node, tmp_path):
    # /work/exp/uid14/repros/r04_userns_invisible_to_ps.py: before, `ascend-pool ps` outside listed
    # the host's process only (the other published in ascend_pool-u4242, with uid 4242 in its file),
    # and inside it the namespace's only.
    env = _env(sim_node, tmp_path, ASCEND_POOL_STATS_INTERVAL="0.1", SETTLE="0.5", MIB="60", TENANT="team",
               QUOTA="500MiB")
    me = os.geteuid()
    procs, rows = _workers(env, [([], {}), (NS, {})], tmp_path)
    try:
        assert [r["malloc"] for r in rows] == ["granted", "granted"], rows
        ps = [sys.executable, "-m", "ascend_pool.cli", "ps", "--json", "--stats-dir", str(tmp_path)]
        for prefix in ([], NS):  # outside the namespace, and inside one
            r = subprocess.run(prefix + ps, env=env, capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
            assert r.returncode == 0, r.stderr[-1200:]
            listed = [row for row in json.loads(r.stdout) if row["tenant"] == "team"]
            assert sorted(row["instance"] for row in listed) == sorted(w["instance"] for w in rows), (prefix, r.stdout)
            assert {row["uid"] for row in listed} == {me}, listed
            assert all(row["allocated_bytes"] >= 60 << 20 for row in listed), r.stdout
    finally:
        errs = _finish(procs)
    assert "user namespace" not in errs[1], errs[1][-800:]


def test_a_process_whose_uid_the_map_leaves_out_is_told_it_shares_nothing(sim_node, tmp_path):
    # `unshare --user` without a map: the euid is the overflow uid, which no map line holds; the
    # process falls back to its geteuid() and both the simulator and the package say so, once each.
    env = _env(sim_node, tmp_path, ASCEND_POOL_STATS="0", MIB="1")
    code = textwrap.dedent("""
        import os
        import ascend_pool as ap
        from ascend_pool import identity
        pool = ap.Pool(0)
        ctx = pool.context("t", quota="100MiB")
        x = ctx.malloc(1 << 20)
        print("uid", os.geteuid(), identity.host_uid(), flush=True)
    """)
    os.chmod(tmp_path, 0o1777)  # the unmapped uid (the overflow uid) makes its files here too
    r = subprocess.run(["unshare", "--user", sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-1200:]
    uid = int(r.stdout.split()[1])
    assert r.stdout.split()[1:] == [str(uid), str(uid)], r.stdout  # the fallback: geteuid()
    err = r.stderr
    assert err.count("ascendsim: warning: this process runs in a user namespace") == 1, err[-1200:]
    assert f"whose map leaves its uid {uid} out" in err and "over-committed" in err and "docs/containers.md" in err, err[-1200:]
    assert err.count("this process runs in a user namespace") == 2, err[-1200:]  # and the package's line
    with open(DOCS) as f:
        doc = f.read()
    assert "user namespace" in doc and "test_sim_userns.py" in doc and "host uid" in doc


@pytest.mark.skipif(os.geteuid() != 0, reason="the parent writes its child's uid map after the child's "
                    "unshare(CLONE_NEWUSER): that needs root (CAP_SETUID in the parent namespace)")
def test_a_forked_child_that_enters_a_user_namespace_reads_the_maps_again_in_c_too(sim_node, tmp_path):
    # /work/exp/review16b/repros/r01: the C cache of the maps (host_ids.h, pthread_once) outlived
    # fork while identity.py's was cleared: a child that entered a user namespace after its parent
    # had read a ledger named the ledger by the host uid (Python) but checked and recorded the uid
    # inside (C) as the host's, and refused its own user's ledger as malformed.
    env = _env(sim_node, tmp_path, ASCEND_POOL_STATS="0")
    subprocess.run([sys.executable, "-c", "import ascend_pool as ap; ap.Pool(0).context('t', quota='100MiB')"
                    ".malloc(1 << 20)"], env=env, check=True, timeout=60, cwd=str(tmp_path))
    code = textwrap.dedent("""
        import ctypes, os
        import ascend_pool as ap
        from ascend_pool.tenants import ledger as L
        L.read_view(*L.ledger_files()[0])                 # C reads (and caches) the initial map
        r, w = os.pipe(); go_r, go_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                assert ctypes.CDLL(None, use_errno=True).unshare(0x10000000) == 0
                os.write(w, b"U"); os.read(go_r, 1)
                ap.Pool(0).context("t", quota="100MiB").malloc(1 << 20)
                msg = "ok"
            except BaseException as e:
                msg = f"{type(e).__name__}: {e}"
            os.write(w, msg.encode()); os._exit(0)
        assert os.read(r, 1) == b"U"
        with open(f"/proc/{pid}/uid_map", "w") as f:
            f.write(f"4242 {os.geteuid()} 1\\n")
        os.write(go_w, b"G"); os.close(w); os.waitpid(pid, 0)
        print(os.read(r, 65536).decode())
    """)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-1200:]
    assert r.stdout.strip() == "ok", r.stdout


NESTED = ["unshare", "--user", "--map-user=4242", "--map-group=4242"]


def _nested_userns_missing():
    if USERNS_MISSING is not None:
        return USERNS_MISSING
    r = subprocess.run(NESTED + ["unshare", "--user", "true"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"a user namespace cannot make another inside it here: {r.stderr.strip()}"


NESTED_MISSING = _nested_userns_missing()


@pytest.mark.skipif(NESTED_MISSING is not None, reason=str(NESTED_MISSING))
def test_a_nested_namespace_shares_with_neither_side_and_the_docs_say_so(sim_node, tmp_path):
    # /work/exp/review16b/repros/r02: the docs said a namespace nested in a rootless container shares
    # with the container's processes; those go by the host's uid, the nested ones by their uid in
    # the container (its map reaches no further), so they share nothing.
    outer = NESTED
    env = _env(sim_node, tmp_path, ASCEND_POOL_STATS="0", MIB="600")
    me = os.geteuid()
    procs, rows = _workers(env, [(outer, {}), (outer + ["unshare", "--user", "--map-user=5000"], {})], tmp_path)
    _finish(procs)
    assert [r["host_uid"] for r in rows] == [me, 4242], rows  # the nested one: its uid in the parent
    assert [r["malloc"] for r in rows] == ["granted", "granted"], rows  # nothing shared: over-committed
    with open(DOCS) as f:
        doc = " ".join(f.read().split())
    assert "share with that container's processes" not in doc
    assert "the two share nothing" in doc


def test_a_process_running_as_the_overflow_uid_is_told(sim_node, tmp_path):
    # review16b 3: inside a namespace whose map holds 65534 (`nobody` in many rootless images),
    # every file of an owner the map leaves out shows as 65534 too, so st_uid == geteuid() takes
    # another host user's files for this process's own. The change to host uids had removed the
    # only word said; now the simulator and the package each say it once.
    overflow = int(open("/proc/sys/kernel/overflowuid").read())
    env = _env(sim_node, tmp_path, ASCEND_POOL_STATS="0")
    code = textwrap.dedent("""
        import os
        import ascend_pool as ap
        pool = ap.Pool(0)
        x = pool.context("t", quota="100MiB").malloc(1 << 20)
        print("uid", os.geteuid(), flush=True)
    """)
    r = subprocess.run(["unshare", "--user", f"--map-user={overflow}", sys.executable, "-c", code], env=env,
                       capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-1200:]
    assert r.stdout.split()[1:] == [str(overflow)], r.stdout
    err = r.stderr
    assert err.count(f"as the overflow uid {overflow}") == 2, err[-1200:]  # the simulator's and the package's
    assert err.count("ascendsim: warning:") == 1, err[-1200:]
    with open(DOCS) as f:
        assert "runs as the overflow uid" in " ".join(f.read().split())


# A sharing group across a user namespace: host gid GROUP is NS_GROUP inside the namespace (a pod
# with hostUsers: false whose fsGroup is mapped). The members are two host users: root outside,
# `nobody` inside as uid 4242.
GROUP, NS_GROUP = 23456, 4343
GROUP_NS = ["setpriv", "--reuid=nobody", f"--regid={GROUP}", "--clear-groups",
            "unshare", "--user", "--map-user=4242", f"--map-group={NS_GROUP}"]


@pytest.mark.skipif(OTHER_USER_SKIP is not None, reason=str(OTHER_USER_SKIP))
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is not installed")
def test_a_groups_quota_holds_across_a_user_namespace_that_maps_the_group(two_users):
    # Was checked by hand only: the group's directory, ledger name and header are the host's gid
    # (identity.host_gid, ap_host_gid), the fchown and the checks of a file's group the gid the
    # namespace sees. Either order: the second 80 MiB of tenant t on a 100 MiB quota is refused.
    node = two_users
    outside = ["setpriv", f"--regid={GROUP}", "--clear-groups"]
    env = node.env(ASCEND_POOL_STATS="0", MIB="80", TENANT="t", QUOTA="100MiB", ASCEND_SIM_DEVICES="1")
    for order in ((outside, GROUP_NS), (GROUP_NS, outside)):
        procs, rows = [], []
        try:
            for prefix in order:
                group = NS_GROUP if prefix is GROUP_NS else GROUP
                p = subprocess.Popen(prefix + [node.exe, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=node.root,
                                     env={**env, "ASCEND_POOL_LEDGER_GROUP": str(group)})
                line = p.stdout.readline()
                if not line:
                    pytest.fail(f"{prefix[:4]}: {p.communicate(timeout=30)[1][-1200:]}")
                procs.append(p)
                rows.append(json.loads(line))
        finally:
            errs = _finish(procs)
        assert [r["malloc"] for r in rows] == ["granted", "over quota"], (rows, errs)
    dirs = sorted(d for d in os.listdir(node.shm) if d.startswith("ascend_pool-g"))
    assert dirs == [f"ascend_pool-g{GROUP}"], dirs
    ledgers = [n for n in os.listdir(os.path.join(node.shm, dirs[0])) if n.startswith("ascend_pool-ledger-")]
    assert ledgers == [f"ascend_pool-ledger-g{GROUP}-sim-{node.name}-dev0"], ledgers


@pytest.mark.skipif(OTHER_USER_SKIP is not None, reason=str(OTHER_USER_SKIP))
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is not installed")
def test_ps_lists_a_groups_processes_inside_and_outside_a_user_namespace_that_maps_the_group(two_users):
    node = two_users
    outside = ["setpriv", f"--regid={GROUP}", "--clear-groups"]
    env = node.env(ASCEND_POOL_STATS_INTERVAL="0.1", SETTLE="0.5", MIB="60", TENANT="team", QUOTA="500MiB",
                   ASCEND_SIM_DEVICES="1")
    procs, rows = [], []
    try:
        for prefix, group in ((outside, GROUP), (GROUP_NS, NS_GROUP)):
            p = subprocess.Popen(prefix + [node.exe, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, cwd=node.root,
                                 env={**env, "ASCEND_POOL_LEDGER_GROUP": str(group)})
            line = p.stdout.readline()
            if not line:
                pytest.fail(f"{prefix[:4]}: {p.communicate(timeout=30)[1][-1200:]}")
            procs.append(p)
            rows.append(json.loads(line))
        assert [r["malloc"] for r in rows] == ["granted", "granted"], rows
        ps = [node.exe, "-m", "ascend_pool.cli", "ps", "--json", "--stats-dir", node.shm]
        for prefix, group in ((outside, GROUP), (GROUP_NS, NS_GROUP)):
            r = subprocess.run(prefix + ps, env={**env, "ASCEND_POOL_LEDGER_GROUP": str(group)}, capture_output=True,
                               text=True, timeout=60, cwd=node.root)
            assert r.returncode == 0, r.stderr[-1200:]
            listed = [row for row in json.loads(r.stdout) if row["tenant"] == "team"]
            assert sorted(row["instance"] for row in listed) == sorted(w["instance"] for w in rows), (prefix, r.stdout)
    finally:
        _finish(procs)


def test_a_sharing_group_given_by_its_host_number_inside_a_namespace_is_refused_naming_the_map(sim_node, tmp_path):
    # The host's gid (ours) is 4343 inside: the worker given the host's number got "cannot have a
    # private ledger directory ...: [Errno 22] Invalid argument" (fchown to an unmapped gid).
    env = _env(sim_node, tmp_path, ASCEND_POOL_STATS="0", MIB="1", TENANT="t", QUOTA="100MiB",
               ASCEND_POOL_LEDGER_GROUP=str(os.getgid()))
    r = subprocess.run(NS + ["--map-group=4343", sys.executable, "-c", WORKER], env=env, input="\n",
                       capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert r.returncode != 0
    assert (f"ASCEND_POOL_LEDGER_GROUP='{os.getgid()}': gid {os.getgid()} is not a group of this user namespace "
            f"(its gid map '4343 {os.getgid()} 1' leaves it out)") in r.stderr, r.stderr[-1200:]


def test_the_ledger_metrics_label_a_groups_ledger_by_the_host_gid_as_its_name_does(sim_node, tmp_path):
    # The uid label is the host's (the name's); the gid label was the namespace's view (4343),
    # so a service inside and one outside labelled one ledger twice over.
    env = _env(sim_node, tmp_path, ASCEND_POOL_STATS="0", ASCEND_POOL_LEDGER_GROUP="4343")
    code = textwrap.dedent("""
        import json
        import ascend_pool as ap
        from ascend_pool.metrics.ledger import ledger_families
        x = ap.Pool(0).context("t", quota="100MiB").malloc(1 << 20)
        fam = {f.name: f for f in ledger_families()}["ascend_pool_ledger_held_bytes"]
        print(json.dumps([s.labels for s in fam.samples]))
    """)
    r = subprocess.run(NS + ["--map-group=4343", sys.executable, "-c", code], env=env, capture_output=True,
                       text=True, timeout=60, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-1200:]
    labels = json.loads(r.stdout)
    assert [(s["tenant"], s["uid"], s["gid"]) for s in labels] == [("t", "", str(os.getgid()))], labels
    assert os.listdir(tmp_path / f"ascend_pool-g{os.getgid()}")


def test_a_process_is_told_when_a_live_process_still_uses_the_earlier_names_by_the_uid_inside(sim_node, tmp_path):
    # Before 2026-12 a process in `--map-user=4242` named its directory ascend_pool-u4242; one
    # still running after an upgrade keeps its quota ledger there, apart from the new processes'
    # (named by the host uid), and nothing said so. A dead one's directory is only junk: no word.
    import fcntl

    env = _env(sim_node, tmp_path, ASCEND_POOL_STATS="0", MIB="1", TENANT="t", QUOTA="100MiB")
    old = tmp_path / "ascend_pool-u4242"
    old.mkdir(mode=0o700)
    lease = old / "ascend_pool-lease-00000000deadbeef"
    fd = os.open(lease, os.O_RDWR | os.O_CREAT, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        r = subprocess.run(NS + [sys.executable, "-c", WORKER], env=env, input="\n", capture_output=True, text=True,
                           timeout=60, cwd=str(tmp_path))
        assert r.returncode == 0, r.stderr[-1200:]
        assert r.stderr.count(f"{old} holds the files of a live process of this user named by its uid 4242") == 1, \
            r.stderr[-1200:]
        assert f"names its files by its host uid {os.geteuid()}" in r.stderr
    finally:
        os.close(fd)  # the earlier process exits
    r = subprocess.run(NS + [sys.executable, "-c", WORKER], env=env, input="\n", capture_output=True, text=True,
                       timeout=60, cwd=str(tmp_path))
    assert r.returncode == 0 and "holds the files of a live process" not in r.stderr, r.stderr[-1200:]


@pytest.mark.skipif(OTHER_USER_SKIP is not None, reason=str(OTHER_USER_SKIP))
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is not installed")
def test_a_groups_share_records_are_listed_inside_a_user_namespace_that_maps_the_group(two_users):
    # A node service (shares(gids=...)) inside a namespace whose map holds the group but not the
    # exporting member (nobody: its record shows as the overflow uid there) refused the record.
    node = two_users
    env = node.env(ASCEND_POOL_STATS="0", ASCEND_SIM_DEVICES="1")
    exporter = subprocess.Popen(
        ["setpriv", "--reuid=nobody", f"--regid={GROUP}", "--clear-groups", node.exe, "-c", textwrap.dedent("""
            import sys
            import ascend_pool as ap
            from ascend_pool import identity
            pool = ap.Pool(0)
            pool.share(pool.share_malloc(4 << 20), any_process=True)
            print(identity.instance_hex(), flush=True)
            sys.stdin.readline()
        """)], env={**env, "ASCEND_POOL_LEDGER_GROUP": str(GROUP)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd=node.root)
    try:
        instance = exporter.stdout.readline().strip()
        assert instance, exporter.communicate(timeout=30)[1][-1200:]
        listing = ("import json; from ascend_pool.sharing import shares; "
                   "print(json.dumps([r['exporter_instance'] for r in shares(uids=(), gids=[int(sys.argv[1])])]))")
        reader_ns = ["setpriv", f"--regid={GROUP}", "--clear-groups", "unshare", "--user", "--map-user=4242",
                     f"--map-group={NS_GROUP}"]
        for prefix, group in (([], GROUP), (reader_ns, NS_GROUP)):
            r = subprocess.run(prefix + [sys.executable, "-c", "import sys; " + listing, str(group)],
                               env={**env, "ASCEND_POOL_LEDGER_GROUP": str(group)}, capture_output=True, text=True,
                               timeout=60, cwd=node.root)
            assert r.returncode == 0, r.stderr[-1200:]
            assert json.loads(r.stdout) == [instance], (prefix, r.stdout, r.stderr[-800:])
    finally:
        exporter.communicate("\n", timeout=30)

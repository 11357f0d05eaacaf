"""Private and group directories (ascend_pool/private_dir.py) and the share records in them
(ascend_pool/sharing.py) as several local users see them: uids 4242 and 4243 of one group 4321
(ASCEND_POOL_LEDGER_GROUP), and 4244 outside it, in one 1777 directory as /dev/shm is.

- Two members starting at once settle on one group directory: it appears whole (mode, group)
  or not at all, so neither takes the other's half-made directory for a squatter's.
- A name squatted by another uid and given back later does not split a user's processes: they
  look past the first free name for a directory of theirs before creating one.
- In a group directory share records are group-readable (0640), so a member's node service lists
  another member's shares and removes those of dead exporters; a record writable by others, or
  not of the group, is still refused.

The other uids run through setpriv (numeric ids, no passwd entries needed); needs root and
setpriv, skipped otherwise. The in-process tests at the top need neither."""
import json
import os
import pickle
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import UidNode, as_uid, uid_world  # noqa: E402

from ascend_pool import private_dir as pd  # noqa: E402

A, B, OUTSIDER, GID = 4242, 4243, 4244, 4321
SKIP = ("setpriv is not installed" if shutil.which("setpriv") is None else
        None if os.geteuid() == 0 else "running code as other uids needs root")
needs_users = pytest.mark.skipif(SKIP is not None, reason=str(SKIP))


# ---- in-process: how a name is chosen -----------------------------------------------------------

@pytest.fixture
def base(tmp_path):
    pd._cache.clear()
    d = tmp_path / "shm"
    d.mkdir()
    os.chmod(d, 0o1777)
    yield str(d)
    pd._cache.clear()


def test_an_existing_directory_past_a_free_name_is_preferred_to_a_new_one(base):
    # As after a squatter gave back the first name: this user's directory is `.3`.
    mine = os.path.join(base, f"ascend_pool-u{os.geteuid()}.3")
    os.mkdir(mine, 0o700)
    assert pd.private_dir(base) == mine
    assert sorted(os.listdir(base)) == [os.path.basename(mine)]


def test_a_new_directory_takes_the_first_free_name_and_is_whole_when_it_appears(base):
    uid = os.geteuid()
    os.symlink(base, os.path.join(base, f"ascend_pool-u{uid}"))   # never followed
    path = pd.private_dir(base)
    assert path == os.path.join(base, f"ascend_pool-u{uid}.1")
    st = os.lstat(path)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == uid
    assert sorted(os.listdir(base)) == [f"ascend_pool-u{uid}", f"ascend_pool-u{uid}.1"]  # no temporary left
    gid = os.getgid()
    gpath = pd.private_dir(base, gid)
    st = os.lstat(gpath)
    assert gpath == os.path.join(base, f"ascend_pool-g{gid}")
    assert stat.S_IMODE(st.st_mode) == 0o2770 and st.st_gid == gid


@pytest.mark.parametrize("renameat2", [True, False], ids=["renameat2", "without"])
def test_creation_never_replaces_a_directory_that_appeared_meanwhile(base, monkeypatch, renameat2):
    # A peer's directory, still empty (plain rename() would replace it), under the chosen name.
    if not renameat2:
        monkeypatch.setattr(pd, "_renameat2", False)
    path = os.path.join(base, f"ascend_pool-u{os.geteuid()}")
    os.mkdir(path, 0o700)
    ino = os.lstat(path).st_ino
    assert pd._create(base, path, "u", os.geteuid()) is False
    assert os.lstat(path).st_ino == ino and os.listdir(base) == [os.path.basename(path)]  # temporary removed
    assert pd.private_dir(base) == path


# ---- as other uids ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def world():
    if SKIP:
        pytest.skip(reason=SKIP)
    yield from uid_world("ap-dirs-users-", A, (GID,))


def _argv(uid, groups, exe, code):
    return as_uid(uid, groups) + [exe, "-c", code]


@pytest.fixture
def node(world):
    n = UidNode(world, "d")
    try:
        yield n
    finally:
        n.close()


LEDGER_DIR = "from ascend_pool.tenants.ledger import ledger_dir\nprint(ledger_dir(), flush=True)\n"

# Every call that could give a directory its group stalls 2 s: the window between creating the
# group's directory and making it the group's, a few microseconds in real life, is 2 s here.
SLOW_CHOWN = """
import os, time
def _slow(f):
    def slow(*a, **k):
        time.sleep(2.0)
        return f(*a, **k)
    return slow
for _n in ("chown", "fchown", "lchown"):
    setattr(os, _n, _slow(getattr(os, _n)))
"""


@needs_users
def test_two_members_starting_at_once_settle_on_one_group_directory(node):
    import time

    slow = node.start(A, (GID,), SLOW_CHOWN + LEDGER_DIR, ASCEND_POOL_LEDGER_GROUP=GID)
    time.sleep(1.0)  # A is inside its creation when B looks
    fast = node.run(B, (GID,), LEDGER_DIR, ASCEND_POOL_LEDGER_GROUP=GID).strip()
    out, err = slow.communicate(timeout=60)
    assert slow.returncode == 0, err
    want = os.path.join(node.shm, f"ascend_pool-g{GID}")
    assert (out.strip(), fast) == (want, want), node.names("ascend_pool-g")
    assert node.names("ascend_pool-g") == [f"ascend_pool-g{GID}"]  # nor a temporary left behind
    st = os.lstat(want)
    assert stat.S_IMODE(st.st_mode) == 0o2770 and st.st_gid == GID


@needs_users
@pytest.mark.parametrize("kind", ["u", "g"])
def test_a_squatted_name_given_back_later_does_not_split_a_users_processes(node, kind):
    num = A if kind == "u" else GID
    env = {"ASCEND_POOL_LEDGER_GROUP": GID} if kind == "g" else {}
    squatted = os.path.join(node.shm, f"ascend_pool-{kind}{num}")
    node.run(OUTSIDER, (OUTSIDER,), f"import os; os.mkdir({squatted!r}, 0o700)", **env)
    first = node.run(A, (GID,), LEDGER_DIR, **env).strip()
    assert first == squatted + ".1"  # the squatted name is skipped
    node.run(OUTSIDER, (OUTSIDER,), f"import os; os.rmdir({squatted!r})", **env)
    # The user's (the group's) next process finds the directory its first one uses.
    second = node.run(A if kind == "u" else B, (GID,), LEDGER_DIR, **env).strip()
    assert second == first, node.names(f"ascend_pool-{kind}{num}")
    assert node.names(f"ascend_pool-{kind}{num}") == [os.path.basename(first)]


EXPORTER = """
import pickle, sys
import ascend_pool as ap
from ascend_pool import identity
pool = ap.Pool(0)
ctx = pool.context("online", quota="256MiB")
h = ctx.share(ctx.share_malloc(4 << 20), any_process=True)
print(identity.instance_hex(), pickle.dumps(h).hex(), flush=True)
sys.stdin.readline()
"""

LIST = """
import json
from ascend_pool.sharing import shares
print(json.dumps([(r["exporter_uid"], r["exporter_instance"], r["size"]) for r in shares(uids=(), gids=[%d])]))
""" % GID

IMPORT = """
import pickle, sys
import ascend_pool as ap
with ap.open_shared(pickle.loads(bytes.fromhex(sys.argv[1]))) as block:
    print(block.size, flush=True)
"""


@needs_users
def test_a_members_service_lists_another_members_shares_and_removes_dead_ones(node):
    env = {"ASCEND_POOL_LEDGER_GROUP": GID}
    exporter = node.start(A, (GID,), EXPORTER, **env)
    line = exporter.stdout.readline().split()
    assert len(line) == 2, exporter.stderr.read() if exporter.poll() is not None else line
    instance, handle = line
    group_dir = os.path.join(node.shm, f"ascend_pool-g{GID}")
    records = [os.path.join(group_dir, n) for n in os.listdir(group_dir) if n.startswith("ascend_pool-share-")]
    assert len(records) == 1, os.listdir(group_dir)
    record = records[0]

    def listed():
        return [tuple(r) for r in json.loads(node.run(B, (GID,), LIST, **env))]

    assert listed() == [(A, instance, 4 << 20)]  # another member's service sees it
    st = os.lstat(record)
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o640, A, GID)  # the group reads it
    # Its exporting user's other processes still open it.
    p = subprocess.Popen(_argv(A, (GID,), node.exe, textwrap.dedent(IMPORT)) + [handle], env=node.env(**env),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
    node.procs.append(p)
    out, err = p.communicate(timeout=60)
    assert (p.returncode, out.strip()) == (0, str(4 << 20)), err

    # Not a record of the group's: refused (not listed, not removed), whoever lists it.
    for change, undo in ((lambda: os.chmod(record, 0o660), lambda: os.chmod(record, 0o640)),
                         (lambda: os.chmod(record, 0o644), lambda: os.chmod(record, 0o640)),
                         (lambda: os.chown(record, -1, OUTSIDER), lambda: os.chown(record, -1, GID)),
                         (lambda: os.chown(record, OUTSIDER, -1), lambda: os.chown(record, A, -1))):
        change()
        try:
            assert listed() == [] and os.path.exists(record)
        finally:
            undo()
    assert listed() == [(A, instance, 4 << 20)]

    exporter.send_signal(signal.SIGKILL)  # it cleans nothing up
    exporter.wait(timeout=10)
    assert listed() == []
    assert not os.path.exists(record)  # removed by the other member's listing


def test_a_temporary_directory_left_by_a_killed_creator_is_removed(base):
    # A process killed between its mkdir and its rename left .ascend_pool-tmp-* in /dev/shm for good.
    uid = os.geteuid()
    stale = os.path.join(base, f".ascend_pool-tmp-u{uid}-00deadbeef00cafe")
    fresh = os.path.join(base, f".ascend_pool-tmp-u{uid}-0123456789abcdef")
    os.mkdir(stale, 0o700)
    os.mkdir(fresh, 0o700)  # a creation that may still be in flight: kept
    old = time.time() - 2 * pd.STALE_TEMPORARY_S
    os.utime(stale, (old, old))
    path = pd.private_dir(base)
    assert os.path.isdir(path) and not os.path.exists(stale) and os.path.isdir(fresh)


@needs_users
def test_a_member_truncating_the_groups_ledger_leaves_the_other_members_working(node):
    # rev16: the group's ledger is 0660, so any member may truncate it; the other members' next
    # reservation read the vanished pages of their mapping and died of SIGBUS. Now the
    # reservation is refused with a LedgerError naming the file, and the process goes on.
    a = node.start(A, (GID,), """
        import sys
        import ascend_pool as ap
        from ascend_pool.errors import LedgerError
        pool = ap.Pool(0)
        ctx = pool.context("team", quota="64MiB")
        x = ctx.malloc(4 << 20)
        print(ctx.ledger.path, flush=True)
        sys.stdin.readline()                       # member B truncates the ledger meanwhile
        try:
            ctx.malloc(32 << 20)
            print("granted", flush=True)
        except LedgerError as e:
            print("refused", e.kind, flush=True)
        pool.free(pool.malloc(8 << 20))            # the process goes on
        print("alive", flush=True)
    """, ASCEND_POOL_LEDGER_GROUP=GID)
    path = a.stdout.readline().strip()
    assert path, a.stderr.read()[-1500:]
    node.run(B, (GID,), f"import os; os.truncate({path!r}, 0)", ASCEND_POOL_LEDGER_GROUP=GID)
    out, err = a.communicate("go\n", timeout=60)
    assert a.returncode == 0, (a.returncode, out, err[-1500:])   # before: -7 (SIGBUS)
    assert "refused malformed" in out and "alive" in out, out


@needs_users
def test_a_lease_whose_temporary_name_another_member_squatted_is_still_renewed(node):
    # Member B creates member A's lease temporary name (.ascend_pool-lease-<A's instance>.tmp, which
    # any member may create in the 2770 group directory); a cleanup then removes A's lease. Before,
    # A's renewals failed on the name (FileExistsError), silently, for the life of the process:
    # its peers took it for dead.
    a = node.start(A, (GID,), """
        import os, sys
        from ascend_pool import identity
        from ascend_pool.tenants.ledger import ledger_dir
        d = ledger_dir()
        identity.ensure_lease(d)
        print(identity.lease_path(d), flush=True)
        sys.stdin.readline()              # B squats the temporary name, the lease is removed
        print(identity.renew_leases(d) == [d], os.path.exists(identity.lease_path(d)), flush=True)
        sys.stdin.readline()
    """, ASCEND_POOL_LEDGER_GROUP=GID)
    lease = a.stdout.readline().strip()
    assert lease.startswith(os.path.join(node.shm, f"ascend_pool-g{GID}")), lease  # (node.close() ends A)
    tmp = os.path.join(os.path.dirname(lease), "." + os.path.basename(lease) + ".tmp")
    node.run(B, (GID,), f"open({tmp!r}, 'x').close()")
    assert os.stat(tmp).st_uid == B
    os.unlink(lease)  # a cleanup of the directory
    a.stdin.write("\n")
    a.stdin.flush()
    assert a.stdout.readline().split() == ["True", "True"]
    assert os.path.exists(lease) and not os.path.exists(tmp)
    a.stdin.write("\n")
    a.stdin.flush()
    a.communicate(timeout=30)


@needs_users
def test_a_process_outside_the_group_is_told_it_is_not_a_member(node):
    # ASCEND_POOL_LEDGER_GROUP naming a group the process is not in: before, the ledger's error
    # was "[Errno 1] Operation not permitted" naming nothing (the group's directory not made yet)
    # or "cannot open ledger ...: Permission denied" (made by a member), and the stats publisher's
    # the same; the membership, the cause, was said nowhere. Nothing is made or changed.
    code = """
        import logging, ascend_pool as ap
        logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
        try:
            ap.Pool(0).context("t", quota="64MiB").malloc(1 << 20)
            print("GRANTED")
        except ap.PoolError as e:
            print("REFUSED", type(e).__name__, e)
    """
    want = f"is not a member of group {GID} ($ASCEND_POOL_LEDGER_GROUP)"
    for made_by_member in (False, True):
        if made_by_member:
            node.run(A, (GID,), LEDGER_DIR, ASCEND_POOL_LEDGER_GROUP=GID)
        before = node.names("ascend_pool-")
        p = node.start(OUTSIDER, (OUTSIDER,), code, ASCEND_POOL_LEDGER_GROUP=GID, ASCEND_POOL_STATS="1")
        out, err = p.communicate(timeout=60)
        assert out.startswith("REFUSED LedgerError") and want in out and f"uid {OUTSIDER}" in out, (made_by_member, out, err)
        assert want in err, (made_by_member, err)  # the stats publisher's warning
        assert node.names("ascend_pool-") == before


def test_a_killed_creators_temporary_directory_goes_once_the_directory_exists(base):
    # The temporary directory of a creator killed between its mkdir and its rename was removed only
    # by a later creation; the next process, starting within a minute (a restarted pod), created the
    # directory while the temporary was too recent to go, and no creation came after: it stayed.
    uid = os.geteuid()
    left = os.path.join(base, f".ascend_pool-tmp-u{uid}-00deadbeef00cafe")
    os.mkdir(left, 0o700)
    path = pd.private_dir(base)           # the next start: kept, it may be a creation in flight
    assert os.path.isdir(left)
    old = time.time() - 2 * pd.STALE_TEMPORARY_S
    os.utime(left, (old, old))
    pd._cache.clear()                     # a later process
    assert pd.private_dir(base) == path
    assert not os.path.exists(left)

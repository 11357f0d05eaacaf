"""The ledger file: created with the owner's permissions (or a group's), and a foreign, corrupted
or malformed file refused with a clear error, never trusted."""

import os
import stat
import struct
import time

import pytest

import ascend_pool as ap
from ascend_pool._core import Ledger
from ascend_pool.errors import PoolError
from ascend_pool.tenants.errors import LedgerError
from ascend_pool.tenants.ledger import ledger_path, node_name

MiB = 1 << 20
# Layout (cython/quota/ledger_format.h): a 256-byte header, 64 tenants of 128 bytes, 1024 slots of 64.
TENANTS_AT, TENANT_SIZE, SLOTS_AT, SLOT_SIZE = 256, 128, 256 + 64 * 128, 64
FILE_SIZE = SLOTS_AT + 1024 * SLOT_SIZE


@pytest.fixture(autouse=True)
def ledger_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ASCEND_POOL_LEDGER_DIR", str(tmp_path))
    monkeypatch.delenv("ASCEND_POOL_LEDGER_GROUP", raising=False)
    return tmp_path


def fresh(tmp_path, name="led", device=0):
    """A valid ledger file at a new path (created by opening it), and the path."""
    path = str(tmp_path / name)
    Ledger(path, device, "sim", "n1")
    return path


def reopen(path, device=0):
    return Ledger(path, device, "sim", "n1")


def poke(path, offset, fmt, *values):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, *values))


def test_private_ledger_is_owner_only(tmp_path):
    pool = ap.Pool(0, backend="sim")
    ctx = pool.context("private", quota=8 * MiB)
    try:
        path = ledger_path(0, "sim", node_name("sim"))
        assert os.path.basename(path) == f"ascend_pool-ledger-u{os.geteuid()}-sim-{node_name('sim')}-dev0"
        # In this user's private directory inside the configured one (no other user can enter it).
        assert os.path.dirname(path) == str(tmp_path / f"ascend_pool-u{os.geteuid()}")
        dst = os.lstat(os.path.dirname(path))
        assert stat.S_ISDIR(dst.st_mode) and stat.S_IMODE(dst.st_mode) == 0o700 and dst.st_uid == os.geteuid()
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
        assert st.st_size == FILE_SIZE
        assert not [f for f in os.listdir(os.path.dirname(path)) if ".tmp." in f]  # the temporary name is gone
        view = ctx.ledger.view()
        assert view["owner_uid"] == os.geteuid() and view["group"] is None
        assert [t["name"] for t in view["tenants"]] == ["private"]
    finally:
        ctx.close()
        pool.close()


def test_group_ledger_is_group_shared(tmp_path, monkeypatch):
    gid = os.getgid()
    monkeypatch.setenv("ASCEND_POOL_LEDGER_GROUP", str(gid))
    pool = ap.Pool(0, backend="sim")
    ctx = pool.context("shared", quota=8 * MiB)
    try:
        path = ledger_path(0, "sim", node_name("sim"), group=gid)
        assert os.path.basename(path).startswith(f"ascend_pool-ledger-g{gid}-sim-")
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == gid
        assert ctx.ledger.view()["group"] == gid
    finally:
        ctx.close()
        pool.close()
    # The same file is not accepted as a private ledger, nor a private one as a group ledger.
    with pytest.raises(LedgerError, match="a private ledger must be 0600"):
        Ledger(path, 0, "sim", node_name("sim"), None)
    private = fresh(tmp_path, "private")
    with pytest.raises(LedgerError, match="a group ledger must be 0660"):
        Ledger(private, 0, "sim", "n1", gid)


def test_wrong_permissions_refused(tmp_path):
    path = fresh(tmp_path)
    os.chmod(path, 0o644)
    with pytest.raises(LedgerError) as info:
        reopen(path)
    assert info.value.kind == "permission"
    assert str(info.value) == (f"ledger {path} has permissions 0644; a private ledger must be 0600 (owner only), "
                               "refusing it")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the file to another user")
def test_foreign_owner_refused(tmp_path):
    path = fresh(tmp_path)
    os.chown(path, 54321, -1)
    with pytest.raises(LedgerError, match=rf"ledger {path} is owned by uid 54321, not by this user"):
        reopen(path)


def test_symlink_and_directory_refused(tmp_path):
    target = fresh(tmp_path, "target")
    link = str(tmp_path / "link")
    os.symlink(target, link)
    with pytest.raises(LedgerError, match="is a symbolic link; refusing it"):
        reopen(link)
    os.mkdir(tmp_path / "dir")
    with pytest.raises(LedgerError):
        reopen(str(tmp_path / "dir"))


CORRUPTIONS = [
    # (what, offset, struct format, value, expected reason)
    ("magic", 0, "<Q", 0x1234, "bad magic number: not a ledger"),
    ("version", 8, "<I", 99, "unsupported version"),
    ("slot size", 20, "<I", 32, "unexpected layout (another version of ascend_pool?)"),
    ("owner", 40, "<I", 4242, "the recorded owner is not the file's owner"),
    ("group", 44, "<I", 7, "it was created for another sharing group"),
    ("device", 48, "<i", 3, "it describes another device"),
    ("backend", 56, "4s", b"acl\0", "it describes another backend or simulated node"),
    ("tenant state", TENANTS_AT, "<I", 7, "a tenant entry has an impossible state"),
    ("slot state", SLOTS_AT + 5 * SLOT_SIZE, "<I", 9, "a process slot has an impossible state"),
]


@pytest.mark.parametrize("what,offset,fmt,value,reason", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_corrupted_header_or_entries_refused(tmp_path, what, offset, fmt, value, reason):
    path = fresh(tmp_path)
    poke(path, offset, fmt, value)
    with pytest.raises(LedgerError) as info:
        reopen(path)
    assert info.value.kind == "malformed"
    assert str(info.value) == (f"ledger {path} is malformed ({reason}); refusing it (remove it when no process "
                               "uses device quotas)")


def test_impossible_contents_refused(tmp_path):
    path = fresh(tmp_path)
    # A used tenant entry named "t" holding more than any device.
    poke(path, TENANTS_AT, "<II64sQQ", 1, 0, b"t", 2**40, 2**62)
    with pytest.raises(LedgerError, match=r"malformed \(a tenant holds an impossible byte count\)"):
        reopen(path)
    path = fresh(tmp_path, "led2")
    poke(path, TENANTS_AT, "<II64s", 1, 0, b"bad name!")
    with pytest.raises(LedgerError, match=r"a tenant name is not a valid name"):
        reopen(path)
    path = fresh(tmp_path, "led3")
    poke(path, TENANTS_AT, "<II64s", 1, 0, b"twin")
    poke(path, TENANTS_AT + TENANT_SIZE, "<II64s", 1, 0, b"twin")
    with pytest.raises(LedgerError, match=r"a tenant appears twice"):
        reopen(path)
    path = fresh(tmp_path, "led4")
    poke(path, SLOTS_AT, "<IiQI", 1, os.getpid(), 1, 17)  # a slot of an unused tenant
    with pytest.raises(LedgerError, match=r"a process slot names no process or an unused tenant"):
        reopen(path)


def test_wrong_size_refused(tmp_path):
    path = fresh(tmp_path)
    os.truncate(path, 100)
    with pytest.raises(LedgerError, match=rf"ledger {path} is 100 bytes, expected {FILE_SIZE}: malformed or from "
                                          "another version; refusing it"):
        reopen(path)


def test_context_on_a_refused_ledger_fails_cleanly(tmp_path):
    pool = ap.Pool(0, backend="sim")
    path = ledger_path(0, "sim", node_name("sim"))
    with open(path, "wb") as f:
        f.write(b"\0" * FILE_SIZE)
    os.chmod(path, 0o600)
    with pytest.raises(LedgerError, match="bad magic number") as info:
        pool.context("victim", quota=MiB)
    assert isinstance(info.value, PoolError)
    assert pool.malloc(MiB)  # the pool itself is unaffected
    pool.close()


def test_a_ledger_removed_while_in_use_is_reported_not_silent(tmp_path, caplog):
    # A cleanup of the ledger directory while a tenant's process runs splits the tenant's quota
    # between this process's copy and the file processes started since create: not repaired
    # (see the warning), but said once, naming the file, when a context opens a ledger and at
    # each stats interval.
    from ascend_pool.tenants import ledger as L
    pool = ap.Pool(0, backend="sim")
    ctx = pool.context("cleaned", quota=8 * MiB)
    path = ledger_path(0, "sim", node_name("sim"))
    assert path not in L.check_files()
    os.unlink(path)
    with caplog.at_level("WARNING", logger="ascend_pool"):
        assert path in L.check_files()
        other = pool.context("after", quota=8 * MiB)  # opens the ledger again (this process's copy)
    warnings = [r.getMessage() for r in caplog.records if "was removed or replaced" in r.getMessage()]
    assert len(warnings) == 1 and path in warnings[0], warnings
    assert ctx.malloc(MiB)  # the process keeps working on its copy
    other.close()
    ctx.close()
    pool.close()


def other_version_ledger(version):
    """The device's ledger as another ascend_pool build (format `version`) left it, its processes
    gone: no lock held on it."""
    path = ledger_path(0, "sim", node_name("sim"))
    Ledger(path, 0, "sim", node_name("sim"))  # created, no slot: nobody holds a lock on it
    poke(path, 8, "<I", version)  # the header's version, after the 8-byte magic
    return path


@pytest.mark.parametrize("version", [ap._core.LEDGER_VERSION - 1, ap._core.LEDGER_VERSION + 1], ids=["older", "newer"])
def test_a_ledger_of_another_version_that_no_process_holds_is_replaced(tmp_path, caplog, version):
    # A node upgraded in place (or rolled back) keeps its ledger directory: the other build's
    # ledger refused every tenant context on the device until someone removed it by hand.
    path = other_version_ledger(version)
    pool = ap.Pool(0, backend="sim")
    with caplog.at_level("WARNING", logger="ascend_pool"):
        ctx = pool.context("t", quota=8 * MiB)
        ctx2 = pool.context("u", quota=8 * MiB)
    assert ctx.ledger.path == path
    with open(path, "rb") as f:
        assert struct.unpack_from("<I", f.read(12), 8)[0] == ap._core.LEDGER_VERSION
    said = [r.getMessage() for r in caplog.records if "was of format version" in r.getMessage()]
    assert said == [f"quota ledger {path} was of format version {version} (another ascend_pool build) and no live "
                    f"process held it: replaced by a version {ap._core.LEDGER_VERSION} ledger"]
    p = ctx.malloc(MiB)
    ctx.free(p)
    ctx.close()
    ctx2.close()
    pool.close()


def test_a_ledger_another_builds_live_processes_hold_is_kept_and_this_build_books_apart(tmp_path, caplog):
    # A rolling upgrade: the old build's pods still run on the node when a new one starts. Its
    # every tenant context was refused ("unsupported version"): new pods crash-looped, and the
    # rollout stalled while old pods ran.
    import fcntl
    from ascend_pool.metrics.ledger import ledger_families
    from ascend_pool.tenants import ledger as L
    path = other_version_ledger(1)
    with open(path, "rb") as f:
        before = f.read()
    old = os.open(path, os.O_RDONLY)  # the old build's live process: its life lock, a read lock on one byte
    fcntl.fcntl(old, fcntl.F_OFD_SETLK, struct.pack("@hhqqi4x", fcntl.F_RDLCK, os.SEEK_SET, 12345, 1, 0))
    pool = ap.Pool(0, backend="sim")
    with caplog.at_level("WARNING", logger="ascend_pool"):
        ctx = pool.context("t", quota=8 * MiB)
        p = ctx.malloc(MiB)
    alt = path + f".v{ap._core.LEDGER_VERSION}"
    assert ctx.ledger.path == alt
    with open(path, "rb") as f:
        assert f.read() == before  # the old build's ledger is left to it
    said = [r.getMessage() for r in caplog.records if "live processes of that ascend_pool build" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"quota ledger {path} is of format version 1 and live processes of "
                                                 f"that ascend_pool build hold it (a rolling upgrade): this build "
                                                 f"(format {ap._core.LEDGER_VERSION}) books its tenants in {alt} ")

    def figures():
        fams = {f.name: f for f in ledger_families()}
        versions = {s.labels["device"]: s.value for s in fams["ascend_pool_ledger_other_versions"].samples}
        held = {s.labels["tenant"]: s.value for s in fams["ascend_pool_ledger_held_bytes"].samples}
        return versions, held

    booked = next(t["held_bytes"] for t in ctx.ledger.view()["tenants"] if t["name"] == "t")
    assert booked >= MiB
    assert figures() == ({"0": 1}, {"t": booked})  # this build's tenants exported from its own ledger
    # another process of this build starting meanwhile books with this one, even once the old are gone
    os.close(old)
    assert L._path_for_this_version(path, None) == alt
    assert os.path.exists(path)
    assert figures() == ({"0": 0}, {"t": booked})
    ctx.free(p)
    ctx.close()
    pool.close()


def test_a_per_version_ledger_nobody_holds_is_given_up_for_the_devices_ledger(monkeypatch):
    # After the upgrade: the other build's processes and this build's in the per-version ledger
    # are gone. The next process removes both files and books in the device's ledger again; a
    # per-version ledger just made (its maker about to take its slot) is kept.
    from ascend_pool.tenants import ledger as L
    path = other_version_ledger(1)
    alt = L.version_path(path)
    Ledger(alt, 0, "sim", node_name("sim"))  # made by a process of this build, now gone
    old = os.open(path, os.O_RDONLY)
    fcntl_lock = struct.pack("@hhqqi4x", 0, os.SEEK_SET, 77, 1, 0)  # F_RDLCK (0): the old build, alive
    import fcntl
    fcntl.fcntl(old, fcntl.F_OFD_SETLK, fcntl_lock)
    assert L._path_for_this_version(path, None) == alt  # just made: kept, and the old build's left alone
    os.close(old)
    assert L._path_for_this_version(path, None) == alt  # under 60 s old: maybe its maker's, not yet slotted
    monkeypatch.setattr(L, "ALT_STALE_S", 0.0)
    assert L._path_for_this_version(path, None) == path
    assert not os.path.exists(alt) and not os.path.exists(path)  # both gone: the open makes the device's anew


def test_processes_starting_while_another_replaces_the_old_ledger_book_in_its_new_one():
    # Pods of the new build starting together: one removes the other build's dead ledger under its
    # update lock and makes the new one; another, finding that lock held, took the old ledger for
    # one in use and booked in the per-version ledger: two ledgers of one build, each granting the
    # whole quota (4 rounds in 10 of 8 processes; repros/simultaneous_starts_split_on_replaced_ledger.py).
    import fcntl
    import threading
    from ascend_pool.tenants import ledger as L
    path = other_version_ledger(1)
    locked, done = threading.Event(), threading.Event()

    def replacer():  # the first process, inside its replacement
        fd = os.open(path, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        locked.set()
        time.sleep(0.2)
        os.unlink(path)
        Ledger(path, 0, "sim", node_name("sim"))
        os.close(fd)
        done.set()

    t = threading.Thread(target=replacer)
    t.start()
    locked.wait(10)
    assert L._path_for_this_version(path, None) == path  # waited for the lock, then looked at the new file
    t.join(10)
    assert done.is_set() and not os.path.exists(L.version_path(path))


def test_a_ledger_of_this_build_is_not_waited_for_by_the_version_probe():
    # The probe waits for the update lock only where it may remove the file (another build's):
    # this build's ledger, its lock held by a peer stopped inside an update, costs it no wait.
    import fcntl
    from ascend_pool.tenants import ledger as L
    path = ledger_path(0, "sim", node_name("sim"))
    Ledger(path, 0, "sim", node_name("sim"))
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the stopped peer
    try:
        t0 = time.monotonic()
        assert L._path_for_this_version(path, None) == path
        assert time.monotonic() - t0 < L.PROBE_LOCK_S / 2
    finally:
        os.close(fd)


def test_a_process_choosing_the_per_version_ledger_and_one_starting_after_the_old_build_exits_book_together(tmp_path):
    # A rolling upgrade's last old pod exits while new ones start: A saw the old ledger held and
    # chose <ledger>.v2, not made yet; B, starting once the old process was gone, found no .v2 and
    # the old ledger free, replaced it and booked there; A then made .v2. Two ledgers of this build,
    # each granting a tenant its whole quota, and no metric told (repros/upgrade_starts_split_alt_and_new_ledger.py).
    import fcntl
    import subprocess
    import sys
    path = other_version_ledger(1)
    old = os.open(path, os.O_RDONLY)  # the old build's live process: its life lock
    fcntl.fcntl(old, fcntl.F_OFD_SETLK, struct.pack("@hhqqi4x", fcntl.F_RDLCK, os.SEEK_SET, 12345, 1, 0))
    ready, go = str(tmp_path / "ready"), str(tmp_path / "go")
    a_code = (f"import os, time\nimport ascend_pool.tenants.ledger as L\nreal = L.Ledger\n"
              f"def paused(p, *a):  # A between its choice and the file's making\n"
              f"    if p.endswith('.v{ap._core.LEDGER_VERSION}'):\n"
              f"        open({ready!r}, 'w').close()\n"
              f"        while not os.path.exists({go!r}):\n            time.sleep(0.01)\n"
              f"    return real(p, *a)\nL.Ledger = paused\nprint(L.open_ledger(0, 'sim').path)\n")
    b_code = "import ascend_pool.tenants.ledger as L; print(L.open_ledger(0, 'sim').path)"
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(ap.__file__)))
    a = subprocess.Popen([sys.executable, "-c", a_code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(ready) and a.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os.path.exists(ready)
        os.close(old)  # the old build's last process exits
        b = subprocess.Popen([sys.executable, "-c", b_code], stdout=subprocess.PIPE, text=True, env=env)
        try:
            b.wait(5)  # done at once where nothing orders its choice after A's making
        except subprocess.TimeoutExpired:
            pass
    finally:
        open(go, "w").close()
    pa, pb = a.communicate(timeout=60)[0].strip(), b.communicate(timeout=60)[0].strip()
    assert a.returncode == 0 and b.returncode == 0
    assert pa == pb == path + f".v{ap._core.LEDGER_VERSION}"  # both in this build's one ledger

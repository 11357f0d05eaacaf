"""A forked child never keeps its parent's proofs of life: the lease (identity.py) and the life
lock on each ledger (cython/quota/ledger_slots.h apl_life_hold). Holding either, a child that
outlives its killed parent (a DataLoader worker, a native library's fork) kept the parent alive to
its peers in other pid namespaces, its quota share never given back while the child lived. Each
test forks (at the worst moment, where a shim, tests/c/slow_locks.c, holds the other thread just
after it took the lock), kills the parent, and asks the ledger or the lease directory whether the
parent's lock is still held.
"""
import fcntl
import glob
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

import ascend_pool as ap
from ascend_pool import identity

PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(ap.__file__)))
CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
needs_cc = pytest.mark.skipif(CC is None, reason="needs a C compiler for the LD_PRELOAD shim")
F_OFD_GETLK = 36
FLOCK = "hhqqi4x"  # struct flock on Linux x86_64 and aarch64: type, whence, start, len, pid


@pytest.fixture
def shim(tmp_path):
    out = tmp_path / "slow_locks.so"
    src = os.path.join(os.path.dirname(__file__), "c", "slow_locks.c")
    subprocess.run([CC, "-shared", "-fPIC", "-O1", "-o", str(out), src, "-ldl"], check=True)
    # the LD_PRELOAD for the parent: after a sanitizer's runtime (scripts/asan.sh preloads it)
    return " ".join(filter(None, [os.environ.get("LD_PRELOAD"), str(out)]))


def _run_parent(tmp_path, code, **env):
    """Runs code (a parent that prints {"instance", "child"} once its child is forked), kills it
    once it printed, and returns what it printed. The forked child is killed by the caller."""
    full = dict(os.environ, PYTHONPATH=PKG_PARENT, ASCEND_POOL_LEDGER_DIR=str(tmp_path),
                ASCEND_SIM_NODE="t" + uuid.uuid4().hex[:12], ASCEND_SIM_SHM_DIR=str(tmp_path),
                ASCEND_SIM_DEVICES="2", ASCEND_SIM_HBM="64MiB", ASCEND_POOL_STATS="0")
    full.update(env)
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=full, stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line, "the parent printed nothing"
        return json.loads(line)
    finally:
        p.kill()
        p.wait(timeout=30)
        p.stdout.close()  # the forked child holds the pipe's other end: no reading to its end


def _still_true(pred, timeout=10.0):
    """pred() after the killed parent's locks had time to go: wait() returns once the process is
    a zombie, which a killed multi-threaded process is before its last thread has closed its
    files (identity.owner_alive), so a lock of the parent's may be held a moment more (on a loaded
    machine, long enough for a check made at once to see it). The child's copy holds it for its
    60 s: True at the end is a kept lock."""
    deadline = time.monotonic() + timeout
    while pred() and time.monotonic() < deadline:
        time.sleep(0.05)
    return pred()


def _life_lock_held(ledger, instance):
    fd = os.open(ledger, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fl = struct.pack(FLOCK, fcntl.F_WRLCK, os.SEEK_SET, (instance >> 2) + 1, 1, 0)
        return struct.unpack(FLOCK, fcntl.fcntl(fd, F_OFD_GETLK, fl))[0] != fcntl.F_UNLCK
    finally:
        os.close(fd)


def _ledgers(tmp_path):
    return sorted(glob.glob(os.path.join(str(tmp_path), "**", "ascend_pool-ledger-*"), recursive=True))


FORK_WHILE = """
    import json, os, threading, time
    import ascend_pool as ap
    from ascend_pool import identity
    t = threading.Thread(target=lambda: {call})
    t.start()
    time.sleep(0.3)  # the thread is just past the open of its new lock's file (the shim keeps it there 1 s)
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    t.join()
    print(json.dumps({{"instance": identity.instance(), "child": pid}}), flush=True)
    time.sleep(60)
"""


@needs_cc
def test_a_fork_while_a_thread_takes_its_life_lock_leaves_the_child_without_it(tmp_path, shim):
    # The life lock's descriptor was opened, then registered for fork.c's drop: a fork between
    # them gave the child a copy, unregistered, of the open file description the parent then
    # locked (a lock of the description, which the copy shares).
    code = FORK_WHILE.format(call='ap.Pool(0, backend="sim").context("t", quota=8 << 20)')
    hello = _run_parent(tmp_path, code, LD_PRELOAD=shim, SLOW_LEDGER_OPEN_MS="1000")
    try:
        [ledger] = _ledgers(tmp_path)
        assert not _still_true(lambda: _life_lock_held(ledger, hello["instance"])), \
            "the killed parent's life lock is held by its child"
    finally:
        os.kill(hello["child"], signal.SIGKILL)


@needs_cc
def test_a_fork_while_a_thread_makes_its_lease_leaves_the_child_without_it(tmp_path, shim):
    # The lease file is locked, then entered in identity._leases, which the child's fork handler
    # closes: a fork between them gave the child the locked descriptor, unknown to the handler.
    code = FORK_WHILE.format(call=f"identity.ensure_lease({str(tmp_path)!r})")
    hello = _run_parent(tmp_path, code, LD_PRELOAD=shim, SLOW_LEASE_MS="1000")
    try:
        assert not _still_true(lambda: identity.lease_alive(str(tmp_path), hello["instance"]) is not False), \
            "the killed parent's lease is held by its child"
    finally:
        os.kill(hello["child"], signal.SIGKILL)


def test_a_process_with_contexts_on_64_devices_leaves_its_forked_child_none_of_its_life_locks(tmp_path):
    # 64 life locks (one per device's ledger) and a lease filled fork.c's table of 64 descriptors
    # to drop in a child: the last ledgers' locks stayed held by a child forked from C.
    hello = _run_parent(tmp_path, """
        import json, time
        import ctypes as C
        import ascend_pool as ap
        from ascend_pool import identity
        ctxs = [ap.Pool(d, backend="sim").context("t", quota=8 << 20) for d in range(64)]
        libc = C.PyDLL(None)  # a native library's fork: no Python fork handler runs
        pid = libc.fork()
        if pid == 0:
            libc.sleep(60)
            libc._exit(0)
        print(json.dumps({"instance": identity.instance(), "child": pid}), flush=True)
        time.sleep(60)
    """, ASCEND_SIM_DEVICES="64")
    try:
        ledgers = _ledgers(tmp_path)
        assert len(ledgers) == 64
        held = [os.path.basename(p) for p in ledgers if _still_true(lambda: _life_lock_held(p, hello["instance"]))]
        assert held == [], f"the killed parent's life lock is held by its child on {len(held)} ledgers"
    finally:
        os.kill(hello["child"], signal.SIGKILL)


def test_a_fork_after_a_share_record_is_opened_leaves_the_child_without_the_life_lock_taken_later(tmp_path):
    # An importer opens the share record, then (its lease made) takes its life lock on it: the lock
    # was taken on the record's own descriptor, which a fork in between had copied into the child
    # (an open file description both share), so the child kept the parent's lock.
    rec = tmp_path / "record"
    hello = _run_parent(tmp_path, f"""
        import json, os, time
        from ascend_pool import identity, sharing
        path = {str(rec)!r}
        with open(path, "wb") as f:
            f.write(bytes(sharing._REC_SIZE))
        os.chmod(path, 0o600)
        record = sharing._Record(path)  # opened as open_shared opens it
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        record.hold_life()
        probe = os.open(path, os.O_RDONLY)
        print(json.dumps({{"instance": identity.instance(), "child": pid,
                           "held": identity.life_held(probe, identity.instance())}}), flush=True)
        time.sleep(60)
    """)
    try:
        assert hello["held"] is True  # the parent took it
        assert not _still_true(lambda: _life_lock_held(str(rec), hello["instance"])), \
            "the killed parent's life lock is held by its child"
    finally:
        os.kill(hello["child"], signal.SIGKILL)


FORK_FROM_C_WHILE = """
    import ctypes, json, os, threading, time
    import ascend_pool as ap
    from ascend_pool import identity
    from ascend_pool.service import publisher
    {setup}
    t = threading.Thread(target=lambda: {call})
    t.start()
    time.sleep(0.3)  # the thread holds its new lock's file (the shim keeps it there 1 s)
    libc = ctypes.CDLL(None)  # a native library's fork, from a thread holding no Python lock: no handler runs
    pid = libc.fork()
    if pid == 0:
        libc.sleep(60)
        libc._exit(0)
    t.join()
    print(json.dumps({{"instance": identity.instance(), "child": pid}}), flush=True)
    time.sleep(60)
"""
SHARE_SETUP = ("pool = ap.Pool(0, backend='sim'); h = pool.share(pool.share_malloc(2 << 20), any_process=True); "
               "blocks = []")


def _stats_file_locked(tmp_path, instance):
    # as the node service in its own pid namespace tells a writer alive: by the file's lock alone
    [path] = glob.glob(os.path.join(str(tmp_path), "**", f"ascend_pool-stats-{instance:016x}"), recursive=True)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _share_life_lock_held(tmp_path, instance):
    [path] = [p for p in glob.glob(os.path.join(str(tmp_path), "**", "ascend_pool-share-*"), recursive=True)
              if ".tmp" not in p]
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return identity.life_held(fd, instance)
    finally:
        os.close(fd)


def _write_locked(path):
    # any write lock on the file: a life lock of the simulator's (cython/sim/proc.c sim_proc_life_hold)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fl = struct.pack(FLOCK, fcntl.F_RDLCK, os.SEEK_SET, 0, 0, 0)
        return struct.unpack(FLOCK, fcntl.fcntl(fd, F_OFD_GETLK, fl))[0] != fcntl.F_UNLCK
    finally:
        os.close(fd)


def _sim_record_write_locked(tmp_path, pattern):
    [path] = [p for p in glob.glob(os.path.join(str(tmp_path), pattern)) if ".tmp" not in p]
    return _write_locked(path)


@needs_cc
@pytest.mark.parametrize("what", ["lease", "stats file", "share record's life lock",
                                  "simulator's node record life lock", "simulator's IPC record life lock"])
def test_a_fork_from_c_while_a_thread_makes_a_proof_of_life_leaves_the_child_without_it(tmp_path, shim, what):
    # A lease, a stats file and a share record's life lock were opened, then marked for fork.c's
    # drop: Python forks wait for identity's lock meanwhile, a fork from C (a native library's, from
    # a thread holding no Python lock) did not, and the child got an unmarked copy of the open file
    # the parent locked, keeping a killed parent alive while it lived: its quota share (lease), its
    # figures in `ps` and the metrics (stats file), its exported block (share record)
    # (/work/exp/ns23/repros/r5_cfork_in_lease_window.py).
    # The simulator's life locks on its node record (cython/sim/node.c) and on an exported block's
    # record (ipc.c) were opened, then entered where the child's fork handler closes them: a fork
    # in between gave the child a copy of the open file the parent then locked, and a killed
    # parent's device memory stayed counted, or its exported block alive, while the child lived.
    setup, call, check, env = {
        "lease": ("", f"identity.ensure_lease({str(tmp_path)!r})",
                  lambda inst: identity.lease_alive(str(tmp_path), inst) is not False, {"SLOW_LEASE_MS": "1000"}),
        "stats file": ("", "publisher.ensure_publisher()", lambda inst: _stats_file_locked(tmp_path, inst),
                       {"SLOW_STATS_MS": "1000", "ASCEND_POOL_STATS": "1", "ASCEND_POOL_STATS_DIR": str(tmp_path)}),
        "share record's life lock": (SHARE_SETUP, "blocks.append(ap.open_shared(h))",
                                     lambda inst: _share_life_lock_held(tmp_path, inst),
                                     {"SLOW_PROC_FD_OPEN_MS": "1000"}),
        "simulator's node record life lock": (
            "", "ap.Pool(0, backend='sim')", lambda inst: _sim_record_write_locked(tmp_path, "ascendsim-*-dev0"),
            {"SLOW_SIM_NODE_OPEN_MS": "1000", "ASCEND_SIM_DEVICES": "1"}),
        "simulator's IPC record life lock": (
            "pool = ap.Pool(0, backend='sim')", "pool.share(pool.share_malloc(2 << 20), any_process=True)",
            lambda inst: _sim_record_write_locked(tmp_path, "ascendsim-*-ipc-*"),
            {"SLOW_SIM_IPC_OPEN_MS": "1000", "ASCEND_SIM_DEVICES": "1"}),
    }[what]
    hello = _run_parent(tmp_path, FORK_FROM_C_WHILE.format(setup=setup, call=call), LD_PRELOAD=shim, **env)
    try:
        assert not _still_true(lambda: check(hello["instance"])), f"the killed parent's {what} is held by its child"
    finally:
        os.kill(hello["child"], signal.SIGKILL)


@needs_cc
@pytest.mark.parametrize("fork", ["from C", "os.fork"])
def test_a_fork_while_a_thread_makes_the_simulators_lease_leaves_the_child_without_it(tmp_path, shim, fork):
    # The simulator's lease (cython/sim/proc.c: created locked, then entered in held_fd[], which
    # the child's fork handler closes) was copied into a child forked in between, from C or from
    # Python (no Python lock covers the runtime's own files): the killed parent's device memory
    # stayed counted, to the node's processes in other pid namespaces, for as long as the child
    # lived (/work/exp/ns23/repros/e9_sim_lease_cfork.py: 700 MiB of 1 GiB).
    sys.path.insert(0, os.path.dirname(__file__))
    from sim_fixtures import UNSHARE_MISSING
    if UNSHARE_MISSING is not None:
        pytest.skip(reason=UNSHARE_MISSING)
    forker = "ctypes.CDLL(None).fork()" if fork == "from C" else "os.fork()"
    hello = _run_parent(tmp_path, f"""
        import ctypes, json, os, threading, time
        import ascend_pool as ap
        box = []
        t = threading.Thread(target=lambda: box.append(ap.Pool(0, backend="sim").malloc(40 << 20)))
        t.start()
        time.sleep(0.3)  # the thread holds its new lease (the shim keeps it there 1 s)
        pid = {forker}
        if pid == 0:
            ctypes.CDLL(None).sleep(60)
            os._exit(0)
        t.join()
        print(json.dumps({{"instance": 0, "child": pid}}), flush=True)
        time.sleep(60)
    """, LD_PRELOAD=shim, SLOW_SIM_LEASE_MS="1000", ASCEND_SIM_DEVICES="1")
    env = dict(os.environ, PYTHONPATH=PKG_PARENT, ASCEND_POOL_LEDGER_DIR=str(tmp_path),
               ASCEND_SIM_SHM_DIR=str(tmp_path), ASCEND_SIM_DEVICES="1", ASCEND_SIM_HBM="64MiB", ASCEND_POOL_STATS="0")
    env["ASCEND_SIM_NODE"] = _node_of(tmp_path)
    probe = ("import ascend_pool as ap, time\n"
             "for _ in range(100):\n"
             "    try:\n        ap.Pool(0, backend='sim').malloc(40 << 20); print('granted'); break\n"
             "    except ap.OutOfMemoryError:\n        time.sleep(0.1)\n"
             "else:\n    print('refused')")
    try:
        r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", probe], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.stdout.strip() == "granted", ("the killed parent's 40 MiB of 64 MiB stay counted", r.stdout,
                                               r.stderr[-800:])
    finally:
        os.kill(hello["child"], signal.SIGKILL)


def _node_of(tmp_path):
    [name] = {n.split("-")[2] for n in os.listdir(str(tmp_path)) if n.startswith("ascendsim-") and "-dev0" in n
              and ".tmp" not in n}
    return name


def _flock_held(path):
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


@needs_cc
def test_a_forked_child_does_not_keep_the_ledger_locked_after_its_parent_died_holding_it(tmp_path, shim):
    # The ledger's update lock is a flock of its descriptor, which a forked child copied (the lock
    # belongs to the open file both share): a parent killed inside an update left the ledger
    # locked while the child lived, and every other process of the node failed after 10 s
    # ("cannot lock ledger") at each context, sweep and quota change.
    hello = _run_parent(tmp_path, """
        import ctypes, json, threading, time
        import ascend_pool as ap
        from ascend_pool import identity
        ctx = ap.Pool(0, backend="sim").context("t", quota=8 << 20)
        libc = ctypes.CDLL(None)
        pid = libc.fork()
        if pid == 0:
            libc.sleep(60)
            libc._exit(0)
        threading.Thread(target=lambda: ap.Pool(0, backend="sim").context("u", quota=8 << 20)).start()
        time.sleep(0.3)  # the thread holds the ledger's lock (the shim keeps it there 5 s)
        print(json.dumps({"instance": identity.instance(), "child": pid}), flush=True)
        time.sleep(60)
    """, LD_PRELOAD=shim, SLOW_LEDGER_LOCK_MS="5000")
    try:
        [ledger] = _ledgers(tmp_path)
        assert not _still_true(lambda: _flock_held(ledger)), "the killed parent's ledger lock is held by its child"
    finally:
        os.kill(hello["child"], signal.SIGKILL)


@needs_cc
def test_a_fork_while_a_thread_creates_the_ledger_leaves_it_unlocked(tmp_path, shim):
    # The ledger was initialised through a mapping of its temporary file's locked descriptor: a
    # child forked meanwhile (here from C) kept that mapping, and with it the open file and its
    # flock, for its life; published, the ledger stayed locked, and the creator's own context
    # failed after 10 s ("cannot lock ledger"), as did every other process's.
    hello = _run_parent(tmp_path, """
        import ctypes, json, threading, time
        import ascend_pool as ap
        from ascend_pool import identity
        err = []
        def open_ctx():
            try:
                ap.Pool(0, backend="sim").context("t", quota=8 << 20)
            except Exception as e:
                err.append(repr(e))
        t = threading.Thread(target=open_ctx)
        t.start()
        time.sleep(0.3)  # the thread is creating the ledger (the shim keeps it there 1 s)
        libc = ctypes.CDLL(None)
        pid = libc.fork()
        if pid == 0:
            libc.sleep(60)
            libc._exit(0)
        t.join()
        print(json.dumps({"instance": identity.instance(), "child": pid, "err": err}), flush=True)
        time.sleep(60)
    """, LD_PRELOAD=shim, SLOW_LEDGER_TMP_MS="1000")
    try:
        assert hello["err"] == []
        [ledger] = _ledgers(tmp_path)
        assert not _still_true(lambda: _flock_held(ledger)), "the ledger stays locked by the forked child"
    finally:
        os.kill(hello["child"], signal.SIGKILL)


def test_a_child_forked_from_c_that_reads_the_ledger_never_makes_its_dead_parents_lease_again(tmp_path):
    # A child forked from C (no Python fork handler) that goes on in Python kept the parent's
    # instance and leases (identity.py): its ledger.view() "renewed" the parent's lease, whose copy
    # is /dev/null, and once the killed parent's lease file was removed (the node service's sweep)
    # it made it again, locked by itself: the dead parent alive again to every peer.
    env = dict(os.environ, PYTHONPATH=PKG_PARENT, ASCEND_POOL_LEDGER_DIR=str(tmp_path),
               ASCEND_SIM_NODE="t" + uuid.uuid4().hex[:12], ASCEND_SIM_SHM_DIR=str(tmp_path),
               ASCEND_SIM_DEVICES="1", ASCEND_SIM_HBM="64MiB", ASCEND_POOL_STATS="0")
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import ctypes, json, os, sys, time
        import ascend_pool as ap
        from ascend_pool import identity
        from ascend_pool.tenants import ledger
        ap.Pool(0, backend="sim").context("t", quota=32 << 20)
        hello = json.dumps({"instance": identity.instance()})
        libc = ctypes.CDLL(None)
        pid = libc.fork()
        if pid == 0:
            sys.stdin.readline()  # the parent is dead, its lease file removed
            ledger.view(0, "sim")
            print(json.dumps({"child": os.getpid()}), flush=True)
            time.sleep(60)
            os._exit(0)
        print(hello, flush=True)
        time.sleep(60)
    """)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    child = None
    try:
        inst = json.loads(p.stdout.readline())["instance"]
        p.kill()
        p.wait(timeout=30)
        [lease_dir] = {os.path.dirname(x) for x in _ledgers(tmp_path)}
        assert not _still_true(lambda: identity.lease_alive(lease_dir, inst) is not False)
        identity.remove_dead_leases(lease_dir)  # as the node service's sweep does
        assert identity.lease_alive(lease_dir, inst) is False
        p.stdin.write("go\n")
        p.stdin.flush()
        child = json.loads(p.stdout.readline())["child"]
        assert identity.lease_alive(lease_dir, inst) is False, "the child made its dead parent's lease again"
    finally:
        if child:
            os.kill(child, signal.SIGKILL)
        p.kill()
        p.stdin.close()
        p.stdout.close()


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs unshare and root for a pid namespace")
def test_a_forked_childs_ledger_view_and_sweep_tell_its_killed_parent_dead_by_its_lease(tmp_path):
    # In a pid namespace whose /proc is not its own (unshare --pid without --mount-proc) the lease
    # alone tells: a forked child took the parent's instance for its own (apl_self_instance), so
    # after the parent was killed its view said alive and its sweep kept the parent's slot.
    env = dict(os.environ, PYTHONPATH=PKG_PARENT, ASCEND_POOL_LEDGER_DIR=str(tmp_path),
               ASCEND_SIM_NODE="t" + uuid.uuid4().hex[:12], ASCEND_SIM_SHM_DIR=str(tmp_path),
               ASCEND_SIM_DEVICES="1", ASCEND_SIM_HBM="64MiB", ASCEND_POOL_STATS="0")
    code = textwrap.dedent("""
        import json, os, signal, time
        import ascend_pool as ap
        from ascend_pool.tenants import ledger
        ctx = ap.Pool(0, backend="sim").context("t", quota=32 << 20)
        with ctx:
            ctx.malloc(4 << 20)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.read(r, 1)
            time.sleep(1.0)  # the parent's lease is dropped by then
            alive = [s["alive"] for s in ledger.view(0, "sim")["slots"]]
            swept = sum(x.get("slots", 0) for x in ledger.sweep())
            print(json.dumps({"alive": alive, "swept": swept}), flush=True)
            os._exit(0)
        os.write(w, b"x")
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    # sh is the namespace's pid 1: the killed worker and its child are not it
    r = subprocess.run(["unshare", "--pid", "--fork", "sh", "-c", '"$0" -c "$1"; sleep 5', sys.executable, code],
                       env=env, capture_output=True, text=True, timeout=120)
    assert json.loads(r.stdout) == {"alive": [False], "swept": 1}, r.stderr[-800:]


def _share_records(tmp_path, tmp):
    return [p for p in glob.glob(os.path.join(str(tmp_path), "**", "ascend_pool-share-*"), recursive=True)
            if (".tmp" in p) == tmp]


@needs_cc
@pytest.mark.parametrize("what", ["record", "record being made"])
def test_a_forked_child_does_not_keep_a_share_record_locked_after_its_parent_died_holding_it(tmp_path, shim, what):
    # A share record's descriptor (every access under its flock) was copied into a forked child
    # (the lock belongs to the open file both share): an exporter killed inside an update left the
    # record locked while the child lived (importers and listings failed after 10 s), and one
    # killed while making it left the temporary file locked, which a scan then never removed.
    update = what == "record"
    hello = _run_parent(tmp_path, f"""
        import ctypes, json, threading, time
        import ascend_pool as ap
        from ascend_pool import identity
        pool = ap.Pool(0, backend="sim")
        h = pool.share(pool.share_malloc(2 << 20), any_process=True)
        blocks = []
        if {update}:  # an import: the record opened, then updated under its lock
            threading.Thread(target=lambda: blocks.append(ap.open_shared(h))).start()
        else:
            threading.Thread(target=lambda: pool.share(pool.share_malloc(2 << 20), any_process=True)).start()
        time.sleep(0.5)  # the thread holds the record's lock (the shim keeps it there 3 s)
        libc = ctypes.CDLL(None)
        pid = libc.fork()
        if pid == 0:
            libc.sleep(60)
            libc._exit(0)
        print(json.dumps({{"instance": identity.instance(), "child": pid}}), flush=True)
        time.sleep(60)
    """, LD_PRELOAD=shim, **{"SLOW_SHARE_LOCK_MS" if update else "SLOW_SHARE_TMP_MS": "3000"})
    try:
        [rec] = _share_records(tmp_path, tmp=not update)
        assert not _still_true(lambda: _flock_held(rec)), f"the killed parent's lock on its {what} is held by its child"
    finally:
        os.kill(hello["child"], signal.SIGKILL)


def test_a_child_forked_from_c_after_the_stats_file_is_made_leaves_it_unlocked_once_the_writer_died(tmp_path):
    # The stats file was mapped through its locked descriptor: the mapping, and mmap's own copy of
    # the descriptor, which a child forked from C (no Python fork handler) inherits, kept the open
    # file and with it the lock, so a killed writer stayed live in `ps` and the metrics while the
    # child lived, whenever it was forked (/work/exp/ns24/repros/n1_stats_file_mapping_cfork.py).
    hello = _run_parent(tmp_path, """
        import ctypes, json, time
        from ascend_pool import identity
        from ascend_pool.service import publisher
        publisher.ensure_publisher()
        libc = ctypes.CDLL(None)
        pid = libc.fork()
        if pid == 0:
            libc.sleep(60)
            libc._exit(0)
        print(json.dumps({"instance": identity.instance(), "child": pid}), flush=True)
        time.sleep(60)
    """, ASCEND_POOL_STATS="1", ASCEND_POOL_STATS_DIR=str(tmp_path))
    try:
        assert not _still_true(lambda: _stats_file_locked(tmp_path, hello["instance"])), \
            "the killed writer's stats file is locked by its child"
    finally:
        os.kill(hello["child"], signal.SIGKILL)

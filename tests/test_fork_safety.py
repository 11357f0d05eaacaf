"""A forked child of a process that uses the pool: every entry point behaves defined there.

A child forked after its parent opened the runtime cannot use it (cython/backend/fork.c), and the
pools it inherits are copies of the parent's: their mutexes may have been held by a parent thread
at the moment of the fork (then nobody in the child will ever release them). So each C-ABI entry
point sets its last error (DEVICE, a message saying the process was forked) and each Python pool
method raises BackendUnavailableError (990004) without touching the pool; close() and the object's
death only forget it. Nothing may hang, crash or "succeed" on the parent's pool.

Each test runs in a fresh process (sim_node), which forks a grandchild with a deadline: a hang is
reported as one (and the grandchild killed), a crash by its signal, and pytest never gets stuck.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401

FORKED = 990004

# Runs in the test's child process. Sets up pools, optionally holds the C ABI's registry lock and
# the pools' mutexes on another thread (inside a call: the pools count it busy), forks, runs CHILD_CALLS in the grandchild (one JSON line per
# call, written as it goes, so a hang shows which call hung) and prints the report as JSON.
WAIT_CHILD = """def wait_child(pid, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return "exit %d" % os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return "hung (killed)"
"""

SCRIPT = WAIT_CHILD.replace("%", "%%") + r"""
import ctypes as C, gc, json, os, select, signal, threading, time, warnings, weakref
import ascend_pool as ap
from ascend_pool import _core

warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12: fork() with threads running
HOLD = %(hold)r
pool = ap.Pool(0, backend="sim", expandable_segments=%(expandable)r)
ctx = pool.context("forktenant", quota="64MiB")
hp = _core.HostPool(pool.backend, 0)
hptr = hp.malloc(4096)
s = pool.create_stream()
ptr = pool.malloc(4096)
cptr = ctx.malloc(1 << 20)
with ctx:
    cabi_ctx_ptr = _core.capi_malloc(4096, 0)
cabi_ptr = _core.capi_malloc(4096, 0)
held_before = ctx.held
lib = C.CDLL(ap.library_path())
lib.ascend_pool_malloc.restype = C.c_void_p
lib.ascend_pool_malloc.argtypes = [C.c_ssize_t, C.c_int, C.c_void_p]
lib.ascend_pool_free.argtypes = [C.c_void_p, C.c_ssize_t, C.c_int, C.c_void_p]
lib.ascend_pool_record_stream.argtypes = [C.c_void_p, C.c_void_p]
lib.ascend_pool_erase_stream.argtypes = [C.c_void_p, C.c_void_p]
lib.ascend_pool_base_alloc.restype = C.c_void_p
lib.ascend_pool_base_alloc.argtypes = [C.c_void_p, C.POINTER(C.c_size_t)]
lib.ascend_pool_set_memory_fraction.argtypes = [C.c_double, C.c_int]
lib.ascend_pool_reset.argtypes = [C.c_bool]
lib.ascend_pool_last_error.restype = C.c_char_p

def cabi(call):
    lib.ascend_pool_clear_last_error()
    out = call()
    return ["C", lib.ascend_pool_last_error_code(), lib.ascend_pool_last_error().decode(), out]

def objects_die():
    # The inherited pools' __dealloc__ runs in the child: it must forget them as close() does,
    # without touching them.
    refs = [weakref.ref(pool), weakref.ref(ctx)]
    for name in ("pool", "ctx", "holder"):
        globals().pop(name, None)
    gc.collect()
    return [r() is None for r in refs]

size = C.c_size_t(0)
CHILD_CALLS = [
    ("C ascend_pool_malloc", lambda: cabi(lambda: lib.ascend_pool_malloc(4096, 0, None))),
    ("C ascend_pool_free", lambda: cabi(lambda: lib.ascend_pool_free(cabi_ptr, 4096, 0, None))),
    ("C ascend_pool_free (context's block)", lambda: cabi(lambda: lib.ascend_pool_free(cabi_ctx_ptr, 4096, 0, None))),
    ("C ascend_pool_record_stream", lambda: cabi(lambda: lib.ascend_pool_record_stream(cabi_ptr, s))),
    ("C ascend_pool_erase_stream", lambda: cabi(lambda: lib.ascend_pool_erase_stream(cabi_ptr, s))),
    ("C ascend_pool_base_alloc", lambda: cabi(lambda: lib.ascend_pool_base_alloc(cabi_ptr, C.byref(size)))),
    ("C ascend_pool_set_memory_fraction", lambda: cabi(lambda: lib.ascend_pool_set_memory_fraction(0.5, 0))),
    ("C ascend_pool_init", lambda: cabi(lambda: lib.ascend_pool_init(0))),
    ("C ascend_pool_empty_cache", lambda: cabi(lambda: lib.ascend_pool_empty_cache())),
    ("C ascend_pool_reset", lambda: cabi(lambda: lib.ascend_pool_reset(False))),
    ("pool.malloc", lambda: pool.malloc(4096)),
    ("pool.free", lambda: pool.free(ptr)),
    ("pool.free(stream)", lambda: pool.free(ptr, s)),
    ("pool.record_stream", lambda: pool.record_stream(ptr, s)),
    ("pool.erase_stream", lambda: pool.erase_stream(ptr, s)),
    ("pool.empty_cache", lambda: pool.empty_cache()),
    ("pool.synchronize", lambda: pool.synchronize(s)),
    ("pool.create_stream", lambda: pool.create_stream()),
    ("pool.register_stream", lambda: pool.register_stream(s + 4096)),
    ("pool.destroy_stream", lambda: pool.destroy_stream(s)),
    ("pool.set_limit", lambda: pool.set_limit(1 << 30)),
    ("pool.reset_peak_stats", lambda: pool.reset_peak_stats()),
    ("pool.round_size", lambda: pool.round_size(100)),
    ("pool.block_info", lambda: pool.block_info(ptr)),
    ("pool.segment_kind", lambda: pool.segment_kind(ptr)),
    ("pool.memory_stats", lambda: pool.memory_stats()),
    ("pool.memory_summary", lambda: pool.memory_summary()),
    ("pool.snapshot", lambda: pool.snapshot()),
    ("pool.context", lambda: pool.context("another")),
    ("ctx.malloc", lambda: ctx.malloc(4096)),
    ("ctx.free", lambda: ctx.free(cptr)),
    ("ctx.empty_cache", lambda: ctx.empty_cache()),
    ("ctx.memory_stats", lambda: ctx.memory_stats()),
    ("ctx.set_quota", lambda: ctx.set_quota("32MiB")),
    ("with ctx", lambda: ctx.__enter__()),
    ("ap.malloc", lambda: ap.malloc(4096)),
    ("host pool malloc", lambda: hp.malloc(4096)),
    ("host pool free", lambda: hp.free(hptr)),
    ("host pool memory_stats", lambda: hp.memory_stats()),
    ("host pool empty_cache", lambda: hp.empty_cache()),
    ("host pool close", lambda: hp.close()),
    ("ctx.close", lambda: ctx.close()),
    ("pool.close", lambda: pool.close()),
    ("closed", lambda: [pool.closed, ctx.closed]),
    ("pool.malloc after close", lambda: pool.malloc(4096)),
    ("objects die", lambda: objects_die()),
]

holder = None
if HOLD:
    holder = threading.Thread(target=_core._test_hold_locks, args=(4.0, pool, ctx))
    holder.start()
    while not _core._test_locks_held():
        time.sleep(0.001)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    for name, call in CHILD_CALLS:
        try:
            out = call()
            line = [name, "returned", out if isinstance(out, (list, int, bool, type(None))) else type(out).__name__]
        except Exception as e:
            line = [name, type(e).__name__, getattr(e, "code", None), str(e)]
        os.write(w, (json.dumps(line) + "\n").encode())
    os._exit(0)
os.close(w)
data, deadline = b"", time.monotonic() + 30
while time.monotonic() < deadline:
    ready, _, _ = select.select([r], [], [], 0.2)
    if ready:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
end = wait_child(pid, 2)
if holder is not None:
    holder.join()
# The parent's pools are untouched: its blocks are live and free normally, its quota booking is whole.
parent = {"held_same": ctx.held == held_before, "block": pool.block_info(ptr) is not None,
          "ctx_block": ctx.block_info(cptr) is not None}
_core.capi_free(cabi_ptr, 0, 0)
_core.capi_free(cabi_ctx_ptr, 0, 0)
pool.free(ptr)
ctx.free(cptr)
parent["host_block"] = hp.block_info(hptr) is not None
hp.free(hptr)
hp.close()
ctx.close()
pool.close()
print(json.dumps({"lines": [json.loads(x) for x in data.decode().splitlines()], "end": end, "parent": parent,
                  "parent_pid": os.getpid()}))
"""


def _run(sim_node, hold, expandable=False):
    return sim_node.run_json(SCRIPT % {"hold": hold, "expandable": expandable}, timeout=90)


def _check_report(rep, held):
    got = {line[0]: line[1:] for line in rep["lines"]}
    missing = [name for name in ("C ascend_pool_malloc", "ctx.close", "pool.close", "objects die") if name not in got]
    assert rep["end"] == "exit 0" and not missing, (
        f"forked child {rep['end']}; last call answered: {rep['lines'][-1][0] if rep['lines'] else None}; "
        f"never answered: {missing}")
    wrong = {}
    for name, result in got.items():
        if name.startswith("C "):
            _returned, (_c, code, msg, _out) = result
            if not (code == 6 and "forked" in msg and "spawn" in msg):  # ASCEND_POOL_E_DEVICE, message why
                wrong[name] = result
        elif name in ("ctx.close", "pool.close", "host pool close"):
            if result != ["returned", None]:
                wrong[name] = result
        elif name == "objects die":
            # With a holder thread, CPython leaks that thread's frame (and its references to the
            # pools) into the child: then only "no hang, no crash" can be checked.
            if result[0] != "returned" or (not held and result[1] != [True, True]):
                wrong[name] = result
        elif name == "closed":
            if result != ["returned", [True, True]]:
                wrong[name] = result
        elif name == "pool.malloc after close":
            if result[0] != "PoolError" or "closed" not in result[2]:
                wrong[name] = result
        elif not (result[0] == "BackendUnavailableError" and result[1] == FORKED
                  and f"forked from pid {rep['parent_pid']}" in result[2]):
            wrong[name] = result
    assert not wrong, "\n".join(f"{k}: {v}" for k, v in wrong.items())
    assert rep["parent"] == {"held_same": True, "block": True, "ctx_block": True, "host_block": True}, rep["parent"]


@pytest.mark.parametrize("expandable", [False, True], ids=["classic", "expandable"])
def test_every_entry_point_refuses_in_a_forked_child(sim_node, expandable):
    """No lock held at the fork: each call refuses (the C ABI's free used to 'succeed' on the
    inherited pool, and a context's close() used to hang). Expandable segments too: the child's
    close must not unmap or free the parent's chunks."""
    _check_report(_run(sim_node, hold=False, expandable=expandable), held=False)


def test_nothing_hangs_when_the_fork_happens_while_a_thread_holds_the_pool_locks(sim_node):
    """A parent thread is inside calls on both pools at the moment of the fork, holding the C ABI's
    registry lock and the pools' mutexes: in the child those locks stay held and the pools busy
    forever, so no call may take them or wait for the calls to end."""
    _check_report(_run(sim_node, hold=True), held=True)


@pytest.mark.parametrize("how", ["close", "del"])
def test_a_context_closed_in_a_forked_child_leaves_the_parents_quota_booking(sim_node, how):
    """The child's close (or the object's death) of an inherited context returns nothing to the
    tenant's node-wide ledger: the bytes are the parent's."""
    rep = sim_node.run_json(r"""
        import gc, json
        import ascend_pool as ap
        WAIT_CHILD
        pool = ap.Pool(0, backend="sim")
        ctx = pool.context("forkbooking", quota="64MiB")
        p = ctx.malloc(8 << 20)
        held = ctx.held
        pid = os.fork()
        if pid == 0:
            rc = 1
            try:
                if %r == "close":
                    ctx.close()
                else:
                    del ctx
                    gc.collect()
                rc = 0
            finally:
                os._exit(rc)
        end = wait_child(pid, 20)
        print(json.dumps({"end": end, "held_before": held, "held_after": ctx.held}))
    """.replace("%r", repr(how)).replace("WAIT_CHILD", WAIT_CHILD.replace("\n", "\n        ")), timeout=60)
    assert rep["end"] == "exit 0", rep
    assert rep["held_after"] == rep["held_before"] > 0, rep


def _fork_while_a_thread_is_inside(sim_node, setup, busy, call, success_ok, **env):
    """Runs setup, starts a thread running `busy` (made slow by setup or env: 300 ms), forks
    150 ms later, while it is inside, and calls `call` in the child, which must end within 15 s:
    with BackendUnavailableError, or by returning where success_ok. Returns the child's end."""
    rep = sim_node.run_json(r"""
        import json, threading, warnings
        import ascend_pool as ap
        warnings.simplefilter("ignore", DeprecationWarning)
        WAIT_CHILD
        SETUP
        busy = threading.Thread(target=lambda: BUSY); busy.start()
        time.sleep(0.15)
        pid = os.fork()
        if pid == 0:
            try:
                CALL
                os._exit(0 if SUCCESS_OK else 3)
            except ap.BackendUnavailableError:
                os._exit(0)
            except BaseException:
                os._exit(4)
        end = wait_child(pid, 15)
        busy.join()
        print(json.dumps({"end": end}))
    """.replace("WAIT_CHILD", WAIT_CHILD.replace("\n", "\n        ")).replace("SETUP", "\n        ".join(setup))
        .replace("BUSY", busy).replace("CALL", call).replace("SUCCESS_OK", str(success_ok)), timeout=60, **env)
    return rep


def test_a_fork_while_another_thread_makes_a_default_pool_refuses_in_the_child(sim_node):
    """A framework's worker thread makes the device's first default pool (api.default_pool holds
    its module lock through Pool(), which calls the runtime: slow here, 300 ms a device malloc)
    while the main thread forks: the child's module-level calls raise BackendUnavailableError,
    they do not wait for ever on the lock's held copy."""
    rep = _fork_while_a_thread_is_inside(
        sim_node, ['ap.Pool(1, backend="sim").close()  # the runtime is open: only the default pool is slow'],
        busy="ap.malloc(4096)", call="ap.malloc(4096)", success_ok=False,
        ASCEND_SIM_MALLOC_LATENCY_US=300000, ASCEND_POOL_CONF="reserve:2097152")
    assert rep == {"end": "exit 0"}, rep


def test_a_fork_while_another_thread_opens_the_runtime_never_hangs_the_child(sim_node):
    """The first Pool() of a process opens the runtime under backend.py's module lock; a fork
    meanwhile copies that lock held. The child must get an answer: its own runtime, or
    BackendUnavailableError when the parent's open had begun in C (fork.c counts an open in
    progress as done), never a wait for ever. The open is made slow in Python to widen the window."""
    rep = _fork_while_a_thread_is_inside(
        sim_node, ["from ascend_pool import backend as B", "slow_open = B._open",
                   "B._open = lambda name, path: (time.sleep(0.3), slow_open(name, path))[1]"],
        busy='ap.Pool(0, backend="sim").close()', call='ap.Pool(0, backend="sim").close()', success_ok=True)
    assert rep == {"end": "exit 0"}, rep


def test_a_child_forked_from_c_does_not_keep_its_killed_parent_alive(sim_node, tmp_path):
    # A native library forks (no exec) in a process that holds a quota share: the child got the
    # parent's lease descriptor, and with it its lock, so when the parent was killed its peers
    # still saw it alive (its share never given back while the child lived). Python's fork
    # handlers do not run on a fork from C; the extension's pthread_atfork handler drops those
    # descriptors in the child.
    import json
    import signal
    import time

    from ascend_pool import identity

    parent = sim_node.spawn(f"""
        import ascend_pool as ap
        from ascend_pool import identity
        inst = identity.ensure_lease({str(tmp_path)!r})
        libc = C.PyDLL(None)                           # keeps the GIL across fork(): no other thread
        pid = libc.fork()
        if pid == 0:
            libc.sleep(60)
            libc._exit(0)
        print(json.dumps({{"instance": inst, "child": pid}}), flush=True)
        time.sleep(60)
    """)
    hello = json.loads(parent.stdout.readline())
    try:
        assert identity.lease_alive(str(tmp_path), hello["instance"]) is True
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 30  # released at its exit; slack for load
        while identity.lease_alive(str(tmp_path), hello["instance"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert identity.lease_alive(str(tmp_path), hello["instance"]) is False, \
            "the killed parent's lease is still held (by its C-forked child)"
    finally:
        os.kill(hello["child"], signal.SIGKILL)
        parent.kill()
        parent.communicate(timeout=10)


@pytest.mark.parametrize("how", ["close", "del"])
def test_a_child_forked_from_c_that_closes_an_inherited_import_leaves_the_parents_slot(sim_node, tmp_path, how):
    # A native library forks (no Python fork handler runs) and the child goes on in Python: its
    # close of the parent's SharedBlock (or the object's death) was refused by the runtime, yet it
    # removed the parent's importer slot from the share record (by the parent's instance id), so
    # the exporter saw nobody importing and freed the block under the live importer
    # (/work/exp/ns23/repros/r1_cfork_child_closes_parents_import.py).
    rep = sim_node.run_json(r"""
        import gc, sys
        # CPython, not ascend_pool: a thread waiting for the GIL asks its holder to drop it after
        # the switch interval, and a child of a fork without PyOS_AfterFork_Child keeps that
        # request: at its next eval-loop check it drops the GIL and waits for ever for a thread
        # to take it (drop_gil's FORCE_SWITCHING). A long interval keeps the request from being
        # made (the child hung so under ASan's slower publisher cycle, 1 in 1).
        sys.setswitchinterval(1000)
        import ascend_pool as ap
        from ascend_pool import sharing
        pool = ap.Pool(0, backend="sim")
        ptr = pool.share_malloc(4 << 20)
        h = pool.share(ptr, any_process=True)
        blk = ap.open_shared(h)
        before = [s["importers"] for s in sharing.shares()]
        libc = C.PyDLL(None)                           # keeps the GIL across fork(): no other thread
        pid = libc.fork()
        if pid == 0:
            try:
                if %r == "close":
                    blk.close()
                else:
                    del blk
                    gc.collect()
            except ap.BackendUnavailableError:
                pass
            libc._exit(0)
        os.waitpid(pid, 0)
        after = [s["importers"] for s in sharing.shares()]
        blk.close()
        print(json.dumps({"before": before, "after": after, "me": os.getpid(), "freed": pool.share_free(ptr)}))
    """.replace("%r", repr(how)), timeout=60, ASCEND_POOL_LEDGER_DIR=str(tmp_path), ASCEND_POOL_STATS="0")
    assert rep["before"] == [[rep["me"]]], rep
    assert rep["after"] == rep["before"], rep
    assert rep["freed"] is True, rep


@pytest.mark.parametrize("lock", ["stats publisher's cycle", "sharing collector's", "stats publisher's module"])
def test_a_child_forked_from_c_exits_through_python_at_once_whatever_thread_held_a_lock(sim_node, tmp_path, lock):
    # A native framework forks (no Python fork handler runs: uWSGI's workers without
    # --py-call-osafterfork) and the child ends through Python's exit. The atexit hooks ran with the parent's state:
    # stop_publisher joined the parent's stats thread, which is not in the child (1.5 s each exit),
    # and took its cycle lock, held for ever in the child when the fork caught the thread
    # mid-cycle; sharing's collect took the lock its collector thread may have held. The child hung
    # at exit (/work/exp/ns23/repros/e3c_cfork_child_exit_time.py). The lock is held here by a
    # daemon thread standing for the parent's. The publisher module's lock, held by a thread making
    # the publisher (ensure_publisher: none yet), hung the child's exit too: stop_publisher told a
    # child by the publisher's pid, and with none took the lock.
    lock_of = {"stats publisher's cycle": "publisher.current()._write_lock", "sharing collector's": "sharing._lock",
               "stats publisher's module": "publisher._lock"}[lock]
    setup = ("" if lock.endswith("module") else
             'pool = ap.Pool(0, backend="sim")\np = pool.malloc(1 << 20)\npublisher.ensure_publisher()')
    rep = sim_node.run_json(r"""
        import sys
        # CPython, not ascend_pool: a thread waiting for the GIL asks its holder to drop it after
        # the switch interval, and a child of a fork without PyOS_AfterFork_Child keeps that
        # request: at its next eval-loop check it drops the GIL and waits for ever for a thread
        # to take it (drop_gil's FORCE_SWITCHING). A long interval keeps the request from being
        # made (the child hung so under ASan's slower publisher cycle, 1 in 1).
        sys.setswitchinterval(1000)
        import ascend_pool as ap
        from ascend_pool import sharing
        from ascend_pool.service import publisher
        WAIT_CHILD
        SETUP
        held, go = threading.Event(), threading.Event()
        def hold():
            with LOCK_OF:
                held.set()
                go.wait()
        threading.Thread(target=hold, daemon=True).start()
        held.wait()
        libc = C.PyDLL(None)                           # keeps the GIL across fork(): no other thread
        t0 = time.monotonic()
        pid = libc.fork()
        if pid == 0:
            sys.exit(0)
        go.set()
        end = wait_child(pid, 15)
        print(json.dumps({"end": end, "seconds": time.monotonic() - t0}))
    """.replace("WAIT_CHILD", WAIT_CHILD.replace("\n", "\n        ")).replace("LOCK_OF", lock_of).replace("SETUP", setup.replace("\n", "\n        ")), timeout=60,
        ASCEND_POOL_LEDGER_DIR=str(tmp_path), ASCEND_POOL_STATS_DIR=str(tmp_path), ASCEND_POOL_STATS_INTERVAL="5")
    assert rep["end"] == "exit 0", rep
    # A join of the parent's thread waits 2 intervals + 1 s (11 s at this interval); half of that
    # leaves a loaded machine room for the child's exit
    assert rep["seconds"] < 5.0, rep


def test_a_fork_while_another_thread_changes_the_allocator_settings_never_hangs_the_childs_pool(sim_node):
    """ap.set_allocator_settings holds the settings' lock through its checks (a pool's
    _set_tunables, with the GIL released, when pools are open), and every Pool() takes it to
    register (settings.register_opened): a fork meanwhile copied it held, and each Pool() of the
    child (a data-loader worker of a process that sets them at start) waited for ever."""
    rep = _fork_while_a_thread_is_inside(
        sim_node, ["from ascend_pool import config as K", "slow_check = K.knobs_to_config",
                   "K.knobs_to_config = lambda *a, **k: (time.sleep(0.3), slow_check(*a, **k))[1]"],
        busy='ap.set_allocator_settings("garbage_collection_threshold:0.5")',
        call='ap.Pool(0, backend="sim").close()', success_ok=True)
    assert rep == {"end": "exit 0"}, rep

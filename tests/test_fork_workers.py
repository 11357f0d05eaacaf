"""Forked workers: a child forked after its parent opened the device runtime gets a clear, typed
error on its first use (BackendUnavailableError, code 990004, telling to use 'spawn'), as CANN and
CUDA cannot be used in such a child; a fork before any runtime was opened works.
"""
import json
import multiprocessing
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401

import ascend_pool as ap  # noqa: E402

MiB = 1 << 20
FORKED = 990004


def _attempts(pool, handle):
    """Each first use a forked worker might make: name -> [exception class, code, message]."""
    from ascend_pool import _core
    from ascend_pool.backend import open_backend

    calls = {
        "Pool()": lambda: ap.Pool(0, backend="sim"),
        "open_backend()": lambda: open_backend("sim"),
        "ap.malloc": lambda: ap.malloc(4096),
        "inherited pool.malloc": lambda: pool.malloc(4096),
        "inherited pool.memory_stats": lambda: pool.memory_stats(),
        "open_shared": lambda: ap.open_shared(handle),
        "open_shared(pool=inherited)": lambda: ap.open_shared(handle, pool=pool),
        "share_malloc": lambda: pool.share_malloc(2 * MiB),
        "C ABI malloc": lambda: _core.capi_malloc(4096, 0),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = ["no error"]
        except Exception as e:
            out[name] = [type(e).__name__, getattr(e, "code", None), str(e)]
    return out


def test_a_forked_child_gets_a_clear_error_on_first_use(pool):
    ptr = pool.share_malloc(2 * MiB)
    handle = pool.share(ptr, any_process=True)
    held = ap.malloc(4096)  # the module-level default pool exists too: the child inherits it
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report every attempt, then leave without running the parent's exit hooks
        code = 1
        try:
            os.close(r)
            os.write(w, json.dumps(_attempts(pool, handle)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    got = json.loads(data)
    for name, (cls, code, msg) in got.items():
        if name == "C ABI malloc":  # the C ABI reports through its last error: DeviceError
            assert cls == "DeviceError" and "forked" in msg and "spawn" in msg, (name, got[name])
            continue
        assert cls == "BackendUnavailableError" and code == FORKED, (name, got[name])
        assert f"forked from pid {os.getpid()}" in msg and "get_context('spawn')" in msg, (name, msg)
    # the parent is untouched: its pool, its shared block and the runtime still work
    p = pool.malloc(4096)
    pool.free(p)
    assert pool.share_free(ptr) is True
    ap.free(held)  # the default pool is the next test's: nothing of this one left in it


def test_multiprocessing_fork_workers_are_told_to_use_spawn(pool):
    """The mistake as users make it: mp.get_context('fork') after the parent opened a pool."""
    import sharing_workers

    ptr = pool.share_malloc(2 * MiB)
    handle = pool.share(ptr, any_process=True)
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=sharing_workers.open_and_report, args=(handle, q))
    p.start()
    pid, err = q.get(timeout=30)
    p.join(timeout=30)
    assert pid == p.pid and err.startswith("BackendUnavailableError: ") and "get_context('spawn')" in err, err
    assert pool.share_free(ptr) is True


def test_a_fork_before_any_runtime_opened_works(sim_node):
    sim_node.run("""
        import ascend_pool as ap
        pid = os.fork()
        if pid == 0:
            rc = 1
            try:
                pool = ap.Pool(0, backend="sim")   # the child opens its own runtime
                pool.free(pool.malloc(4096))
                pool.close()
                rc = 0
            finally:
                os._exit(rc)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        pool = ap.Pool(0, backend="sim")           # and so does the parent, afterwards
        pool.free(pool.malloc(4096))
    """)


def test_reading_figures_before_any_pool_leaves_forked_workers_the_device(sim_node):
    # A launcher logs the allocator's figures (memory_allocated(), memory_stats(d) ...) before it
    # forks its workers (multiprocessing's default start method on Linux). Those calls open no
    # pool, but they opened the runtime (aclInit) to check the device index, which made the
    # launcher a runtime user: every worker was refused the device ("forked ... after that
    # process had opened the device runtime"). torch's readers initialise no device.
    out = sim_node.run_json("""
        import ascend_pool as ap
        reads = [lambda: ap.memory_stats(1), lambda: ap.memory_stats_as_nested_dict(0), lambda: ap.memory_allocated(),
                 lambda: ap.max_memory_reserved(1), lambda: ap.memory_summary(0), lambda: ap.snapshot(1),
                 lambda: ap.memory_snapshot(), lambda: ap.reset_peak_memory_stats(0),
                 lambda: ap.reset_accumulated_memory_stats(1), lambda: ap.get_per_process_memory_fraction(0),
                 lambda: ap.empty_cache()]
        answers = [r() for r in reads]
        zeros = [answers[0]["allocated_bytes.all.current"], answers[2], answers[3], len(answers[6])]
        pid = os.fork()
        if pid == 0:
            rc = 1
            try:
                pool = ap.Pool(1, backend="sim")
                pool.free(pool.malloc(4096))
                ap.free(ap.malloc(4096))
                rc = 0
            finally:
                os._exit(rc)
        _, status = os.waitpid(pid, 0)
        ap.free(ap.malloc(4096))             # the launcher itself may still open the device later
        try:
            ap.memory_stats(7)               # with the runtime open, a device it lacks is refused
            bad = None
        except ap.InvalidDeviceError:
            bad = "InvalidDeviceError"
        print(json.dumps({"child": os.waitstatus_to_exitcode(status),
                          "zeros": zeros, "bad": bad}))
    """)
    assert out == {"child": 0, "zeros": [0, 0, 0, 0], "bad": "InvalidDeviceError"}, out

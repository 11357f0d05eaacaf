"""Helpers for the IPC tests (tests/test_sim_ipc.py, tests/test_sharing*.py): child processes
that run Python sent to them line by line, so that one test can drive an exporter and several
importers step by step, each a separate process of one simulated node.

    with Peer(sim_node) as exporter, Peer(sim_node) as importer:
        key = exporter("out = export(malloc(4 << 20), 4 << 20)[1]")   # returns the child's `out`
        importer(f"out = imp({key!r})")

A step that raises in the child fails the test with the child's traceback; a child that does not
answer within `timeout` seconds fails it too (never hangs the run).
"""
import json
import os
import select
import signal
import textwrap

import pytest

# ctypes prototypes of the four ACL IPC calls and small wrappers returning (aclError, value).
IPC_PRELUDE = r'''
import traceback
lib.aclrtIpcMemGetExportKey.argtypes = [C.c_void_p, C.c_size_t, C.c_char_p, C.c_size_t, C.c_uint64]
lib.aclrtIpcMemSetImportPid.argtypes = [C.c_char_p, C.POINTER(C.c_int32), C.c_size_t]
lib.aclrtIpcMemImportByKey.argtypes = [C.POINTER(C.c_void_p), C.c_char_p, C.c_uint64]
lib.aclrtIpcMemClose.argtypes = [C.c_char_p]
for _f in ("aclrtIpcMemGetExportKey", "aclrtIpcMemSetImportPid", "aclrtIpcMemImportByKey", "aclrtIpcMemClose",
           "ascendsim_read", "ascendsim_launch_fill"):
    getattr(lib, _f).restype = C.c_int
lib.ascendsim_read.argtypes = [C.c_void_p, C.c_void_p, C.c_size_t]
lib.ascendsim_launch_fill.argtypes = [C.c_void_p, C.c_void_p, C.c_size_t, C.c_int, C.c_uint64]
MiB = 1 << 20

def export(ptr, size, flags=0, length=65):
    buf = C.create_string_buffer(max(length, 1))
    rc = lib.aclrtIpcMemGetExportKey(ptr, size, buf, length, flags)
    return rc, buf.value.decode()

def set_pids(key, pids):
    arr = (C.c_int32 * max(len(pids), 1))(*pids)
    return lib.aclrtIpcMemSetImportPid(key.encode() if key is not None else None, arr, len(pids))

def imp(key, flags=0):
    p = C.c_void_p()
    rc = lib.aclrtIpcMemImportByKey(C.byref(p), key.encode() if key is not None else None, flags)
    return rc, p.value

def close(key):
    return lib.aclrtIpcMemClose(key.encode() if key is not None else None)

lib.aclrtDeviceGetBareTgid.argtypes = [C.POINTER(C.c_int32)]
lib.aclrtDeviceGetBareTgid.restype = C.c_int

def bare_tgid():
    """This process's node-level id (aclrtDeviceGetBareTgid): what SetImportPid lists."""
    v = C.c_int32()
    ok("aclrtDeviceGetBareTgid", C.byref(v))
    return v.value

def malloc(n):
    p = C.c_void_p()
    ok("aclrtMalloc", C.byref(p), n, 0)
    return p.value

def free(ptr):
    return lib.aclrtFree(ptr)

def read(ptr, n):
    """(aclError, bytes) of ascendsim_read."""
    buf = C.create_string_buffer(max(n, 1))
    rc = lib.ascendsim_read(ptr, buf, n)
    return rc, buf.raw[:n]

def fill(ptr, n, value):
    """ascendsim_launch_fill on the default stream, then a stream sync: (aclError of the fill)."""
    rc = lib.ascendsim_launch_fill(None, ptr, n, value, 0)
    if rc == 0:
        ok("aclrtSynchronizeStream", None)
    return rc

lib.ascendsim_get_ipc_stats.argtypes = [C.c_int32, C.POINTER(C.c_uint64), C.c_uint32]
lib.ascendsim_get_ipc_stats.restype = C.c_int

def ipc_stats(device=0):
    """sim.stats(device) plus this process's sharing counters (ascendsim_get_ipc_stats)."""
    v = (C.c_uint64 * 4)()
    ok("ascendsim_get_ipc_stats", device, v, 4)
    out = sim.stats(device)
    out.update(zip(("ipc_exports", "ipc_exported_bytes", "ipc_imports", "ipc_imported_bytes"), v))
    return out

def same(ptr, n, value):
    rc, data = read(ptr, n)
    return rc == 0 and data == bytes([value]) * n
'''

def pool_prelude(**knobs):
    """Prelude for a Peer that drives an ascend_pool Pool on device 0 of the sim (knobs passed on):
    `pool`, `ap`, `sharing`, `DeviceError`, dump(handle)/load(text) to pass SharedHandles between
    processes as text, node_used() (the node's device bytes in use)."""
    args = "".join(f", {k}={v!r}" for k, v in knobs.items())
    return f"""
import base64, pickle
import ascend_pool as ap
from ascend_pool import sharing
from ascend_pool.errors import DeviceError
pool = ap.Pool(0, backend="sim"{args})
def dump(h): return base64.b64encode(pickle.dumps(h)).decode()
def load(s): return pickle.loads(base64.b64decode(s))
def node_used(): return sim.stats(0)["node_bytes_used"]
"""


REPL = r'''
import json as _json, sys as _sys
_ns = dict(globals())
print(_json.dumps({"ready": os.getpid()}), flush=True)
for _line in _sys.stdin:
    _ns["out"] = None
    try:
        exec(_json.loads(_line), _ns)
        _reply = {"ok": _ns["out"]}
    except BaseException:
        _reply = {"err": traceback.format_exc()}
    print(_json.dumps(_reply), flush=True)
'''


class Peer:
    """A child process of `node` that executes the Python code passed to it (see module doc)."""

    def __init__(self, node, prelude="", timeout=30, **env):
        self.timeout = timeout
        self.proc = node.spawn(IPC_PRELUDE + textwrap.dedent(prelude) + REPL, **env)
        self.pid = self._reply()["ready"]

    def _reply(self):
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.kill()
            err = self.proc.stderr.read()
            pytest.fail(f"child {self.proc.pid} gave no answer within {self.timeout} s\n--- stderr\n{err}",
                        pytrace=False)
        return json.loads(line)

    def __call__(self, code):
        """Runs code in the child; returns its `out` (JSON-able)."""
        self.proc.stdin.write(json.dumps(textwrap.dedent(code)) + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        if "err" in reply:
            pytest.fail(f"child {self.pid} failed running:\n{textwrap.dedent(code)}\n{reply['err']}", pytrace=False)
        return reply["ok"]

    @property
    def node_pid(self):
        """The child's node-level id (aclrtDeviceGetBareTgid; the runtime must be initialised):
        what an exporter lists for it, never its getpid()."""
        return self("out = bare_tgid()")

    def kill(self):
        """SIGKILL, and reaps the child (it leaves no zombie that would still count as alive)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self):
        try:
            self.proc.stdin.close()  # the child's loop ends: it exits normally
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except Exception:
            self.kill()
        for f in (self.proc.stdout, self.proc.stderr):
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

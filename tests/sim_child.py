"""Helpers for code that runs in a child process against the simulator (see sim_fixtures.run_sim).

The simulator reads its environment at aclInit and keeps node-wide state, so each behavioural
test runs in a fresh process with its own ASCEND_SIM_NODE; this module gives that process thin
ctypes wrappers of the ACL calls. Nothing here initialises the runtime: call init().
"""
import ctypes as C
import os
import sys

import ascend_pool.sim as sim

lib = sim.attach(os.environ.get("SIM_LIB") or None)

_VP, _SZ, _I = C.c_void_p, C.c_size_t, C.c_int
for _name, _args in {
    "aclInit": [C.c_char_p],
    "aclFinalize": [],
    "aclrtSetDevice": [C.c_int32],
    "aclrtGetDevice": [C.POINTER(C.c_int32)],
    "aclrtGetDeviceCount": [C.POINTER(C.c_uint32)],
    "aclrtResetDevice": [C.c_int32],
    "aclrtCreateContext": [C.POINTER(_VP), C.c_int32],
    "aclrtSetCurrentContext": [_VP],
    "aclrtGetCurrentContext": [C.POINTER(_VP)],
    "aclrtDestroyContext": [_VP],
    "aclrtMalloc": [C.POINTER(_VP), _SZ, _I],
    "aclrtFree": [_VP],
    "aclrtGetMemInfo": [_I, C.POINTER(_SZ), C.POINTER(_SZ)],
    "aclrtMallocHost": [C.POINTER(_VP), _SZ],
    "aclrtFreeHost": [_VP],
    "aclrtCreateEvent": [C.POINTER(_VP)],
    "aclrtCreateEventWithFlag": [C.POINTER(_VP), C.c_uint32],
    "aclrtRecordEvent": [_VP, _VP],
    "aclrtQueryEvent": [_VP, C.POINTER(_I)],
    "aclrtSynchronizeEvent": [_VP],
    "aclrtSynchronizeEventWithTimeout": [_VP, C.c_int32],
    "aclrtStreamWaitEvent": [_VP, _VP],
    "aclrtResetEvent": [_VP, _VP],
    "aclrtDestroyEvent": [_VP],
    "aclrtCreateStream": [C.POINTER(_VP)],
    "aclrtSynchronizeStream": [_VP],
    "aclrtSynchronizeStreamWithTimeout": [_VP, C.c_int32],
    "aclrtDestroyStream": [_VP],
    "aclrtDestroyStreamForce": [_VP],
    "aclrtSynchronizeDevice": [],
}.items():
    _f = getattr(lib, _name)
    _f.argtypes, _f.restype = _args, C.c_int
for _name in ("aclrtGetPhyDevIdByLogicDevId", "aclrtGetLogicDevIdByPhyDevId"):  # not in every build
    if hasattr(lib, _name):
        getattr(lib, _name).argtypes, getattr(lib, _name).restype = [C.c_int32, C.POINTER(C.c_int32)], C.c_int
HAS_NEW = hasattr(lib, "aclrtMallocAlign32")
if HAS_NEW:
    lib.aclrtSynchronizeDeviceWithTimeout.argtypes = [C.c_int32]
    lib.aclrtSynchronizeDeviceWithTimeout.restype = C.c_int
    lib.aclrtMallocAlign32.argtypes, lib.aclrtMallocAlign32.restype = [C.POINTER(_VP), _SZ, _I], C.c_int
    lib.aclrtQueryEventStatus.argtypes, lib.aclrtQueryEventStatus.restype = [_VP, C.POINTER(_I)], C.c_int
    lib.aclrtCreateEventExWithFlag.argtypes = [C.POINTER(_VP), C.c_uint32]
    lib.aclrtCreateEventExWithFlag.restype = C.c_int

HBM, DDR = 1, 0


class AclFail(AssertionError):
    def __init__(self, call, code, msg):
        super().__init__(f"{call} -> {code}: {msg}")
        self.code, self.msg = code, msg


def errmsg():
    m = lib.aclGetRecentErrMsg()
    return m.decode() if m else None


def ok(call, *args):
    """Calls lib.<call>(*args); raises AclFail unless it returns 0."""
    rc = getattr(lib, call)(*args)
    if rc != 0:
        raise AclFail(call, rc, errmsg())


def code(call, *args):
    """Calls lib.<call>(*args) and returns its aclError."""
    return getattr(lib, call)(*args)


def init(device=0):
    ok("aclInit", None)
    ok("aclrtSetDevice", device)


def malloc(n, policy=0, align32=False):
    p = C.c_void_p()
    ok("aclrtMallocAlign32" if align32 else "aclrtMalloc", C.byref(p), n, policy)
    return p.value


def free(p):
    ok("aclrtFree", p)


def meminfo(attr=HBM):
    f, t = C.c_size_t(), C.c_size_t()
    ok("aclrtGetMemInfo", attr, C.byref(f), C.byref(t))
    return f.value, t.value


def used():
    f, t = meminfo()
    return t - f


def stream():
    s = C.c_void_p()
    ok("aclrtCreateStream", C.byref(s))
    return s.value


def event(flags=None, ex=False):
    """aclrtCreateEvent, aclrtCreateEventWithFlag(flags), or with ex aclrtCreateEventExWithFlag(flags)."""
    e = C.c_void_p()
    if ex:
        ok("aclrtCreateEventExWithFlag", C.byref(e), flags or 0)
    elif flags is None:
        ok("aclrtCreateEvent", C.byref(e))
    else:
        ok("aclrtCreateEventWithFlag", C.byref(e), flags)
    return e.value


def query_status(ev):
    """aclrtQueryEventStatus: 1 COMPLETE, 0 NOT_READY."""
    st = C.c_int(-1)
    ok("aclrtQueryEventStatus", ev, C.byref(st))
    return st.value


def query_old(ev):
    """Deprecated aclrtQueryEvent: 0 COMPLETE, 1 NOT_READY."""
    st = C.c_int(-1)
    ok("aclrtQueryEvent", ev, C.byref(st))
    return st.value


def capi():
    """ascend_pool's C ABI (a real dlopen of the extension, as a framework loads it), typed:
    malloc/free as torch's pluggable allocators call them, the thread's last error."""
    import ascend_pool

    abi = C.CDLL(ascend_pool.library_path())
    abi.ascend_pool_malloc.restype = C.c_void_p
    abi.ascend_pool_malloc.argtypes = [C.c_ssize_t, C.c_int, C.c_void_p]
    abi.ascend_pool_free.argtypes = [C.c_void_p, C.c_ssize_t, C.c_int, C.c_void_p]
    abi.ascend_pool_last_error.restype = C.c_char_p
    abi.ascend_pool_last_error_code.restype = C.c_int
    return abi


def interrupted_at(n, body, counted):
    """Runs body() raising KeyboardInterrupt at the n-th "call" or "line" trace event of a frame
    counted(frame) is true of, where a signal handler's exception (Ctrl-C; a SIGTERM handler's
    sys.exit) lands between two bytecodes. True when it was raised; False when body() finished
    in fewer such events (n has passed the last point)."""
    seen = [0]

    def tracer(frame, event, arg):
        if event in ("call", "line") and counted(frame):
            seen[0] += 1
            if seen[0] == n:
                raise KeyboardInterrupt
        return tracer
    sys.settrace(tracer)
    try:
        body()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False

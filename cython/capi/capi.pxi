# The drop-in layer: the exported C ABI that frameworks load by name (capi/exports.h, declared for
# users in ascend_pool/include/ascend_pool.h), the registry of live pools it looks pointers up in,
# the module's side of its lazy default-pool creation, and the pinned host pool with the numpy
# handler on top of it.
#
# The exported functions are plain C with default visibility, so `ctypes.CDLL(library_path())`
# and torch's dlsym() find them by name. This file only connects them to Python:
#   - every PoolBase registers here when it opens and unregisters before it is destroyed;
#   - at import, a callback is installed that the C ABI calls (under the GIL, once per device)
#     to create a device's default pool when a framework allocates before Python did;
#   - thin Python wrappers (capi_malloc / capi_free / capi_last_error) for the CuPy integration
#     and for tests that want the C path without ctypes.

from libc.string cimport memcpy

import atexit as _atexit
import weakref as _weakref

from ascend_pool.errors import InvalidDeviceError

import logging as _logging
import threading as _threading

cdef extern from "Python.h":
    int Py_AddPendingCall(int (*func)(void *) except -1, void *arg)

# A KeyboardInterrupt or SystemExit raised in Python code the C ABI runs (an out-of-memory
# observer, a device's default pool being made) must not end in C, where it was dropped: a signal
# handler's (Ctrl-C, a scheduler's SIGTERM handled by sys.exit) runs in the main thread, inside
# whatever Python code runs there, and the program was asked to stop. Raised in the main thread by
# a pending call once the C caller is back in Python, as the signal handler's own would be.
_deferred_raises = []


cdef int _raise_deferred(void *arg) except -1:
    if _deferred_raises:
        raise _deferred_raises.pop(0)
    return 0


cdef bint _raise_when_back_in_python(BaseException e):
    """True when e (caught in a hook the C ABI called, with the GIL) will be raised in the main
    thread once it runs Python again: a KeyboardInterrupt or SystemExit there. Else False: the
    caller reports it as before (another thread's, or a plain exception)."""
    if isinstance(e, Exception) or _threading.get_ident() != _threading.main_thread().ident:
        return False
    _deferred_raises.append(e)
    if Py_AddPendingCall(_raise_deferred, NULL) == 0:
        return True
    _deferred_raises.remove(e)
    return False


cdef class CallbackGuard:
    """Wraps fn for a ctypes callback that C calls (the torch_npu stats hooks): guard(*args) is
    fn(*args), but a KeyboardInterrupt or SystemExit that leaves fn (fn catches its Exceptions) is
    raised in the main thread once the C caller is back in Python, and failed is returned; in
    another thread it is logged, failed returned. In C: no bytecode of the callback runs after the
    exception is set aside (a pending call runs at the next call's return, inside the callback)."""
    cdef object fn, failed

    def __init__(self, fn, failed):
        self.fn = fn
        self.failed = failed

    def __call__(self, *args):
        try:
            return self.fn(*args)
        except BaseException as e:
            if not _raise_when_back_in_python(e):
                _logging.getLogger("ascend_pool").exception("ascend_pool: %r%r failed", self.fn, args)
            return self.failed


include "capi/oom_observers.pxi"
include "host/hostpool.pxi"
include "capi/numpy_handler.pxi"

cdef extern from "capi/last_error.h" nogil:
    # (the codes ASCEND_POOL_OK, ASCEND_POOL_E_* and their names, CAPI_ERRORS, are in core/errors.pxi)
    int ascend_pool_last_error_code()
    const char *ascend_pool_last_error()
    void ascend_pool_clear_last_error()

cdef extern from "capi/registry.h" nogil:
    int apc_register(ap_pool **slot, int device, int device_count)
    void apc_unregister(ap_pool **slot)
    void apc_learn_device_count(int device_count)
    int apc_test_locks_held
    void apc_test_hold_locks(ap_pool **pools, int n, unsigned ms)

cdef extern from "capi/exports.h":
    # Not nogil: the callback runs Python code (exports.h holds the GIL around the call).
    ctypedef int (*apc_create_fn)(int device, int strict, char *msg, size_t len) noexcept
    void apc_set_hooks(apc_create_fn create)
    ctypedef void (*apc_frames_fn)(ap_pool *p, int freeing) noexcept
    void apc_set_frames_hook(apc_frames_fn fn)
    void apc_stacks_changed(int delta)
    void apc_python_close(unsigned ms) nogil

cdef extern from "capi/exports.h" nogil:
    size_t apc_release_peers(ap_pool *self, int mode)
    void ap_set_peer_release_hook(size_t (*hook)(ap_pool *self, int mode))
    void *apc_lend_from_peers(ap_pool *self, size_t size, void *stream)
    void ap_set_peer_lend_hook(void *(*hook)(ap_pool *self, size_t size, void *stream))
    const char *apc_default_backend_name(int device)
    void *ascend_pool_malloc(Py_ssize_t size, int device, void *stream)
    void *apc_torch_malloc(size_t size, int device, void *stream)
    void ascend_pool_free(void *ptr, Py_ssize_t size, int device, void *stream)
    void ascend_pool_init(int device)


# ---- the registry of live pools (called from PoolBase._open / close / __dealloc__) ----------------

cdef int _capi_register(PoolBase pool) except -1:
    # The registry keeps the address of pool.p (see capi/registry.h): a close by any code path
    # that NULLs the field hides the pool from the C ABI at once.
    if apc_register(&pool.p, pool.device, pool.backend.device_count) != 0:
        raise MemoryError("host memory for the C ABI's pool registry exhausted")
    return 0


cdef void _capi_unregister(ap_pool **slot) noexcept nogil:
    # Takes the field's address, not the object: __dealloc__ calls it, when self may no longer be
    # handed to Python code.
    apc_unregister(slot)


# ---- Python frames of C ABI calls (exports.h's apc_note_frames) ---------------------------------------

# Pools recording stacks, by C pool address: weak, so that dropping a pool still closes it.
_stack_pools = {}


cdef void _capi_stacks_on(ap_pool *p, object pool):
    """Registers pool (a PoolBase, whose C pool is p) as one whose C ABI calls file Python frames;
    pool None forgets p."""
    cdef uintptr_t key = <uintptr_t>p
    if pool is not None and key not in _stack_pools:
        _stack_pools[key] = _weakref.ref(pool)
        apc_stacks_changed(1)
    elif pool is None and _stack_pools.pop(key, None) is not None:
        apc_stacks_changed(-1)


cdef void _capi_note_frames(ap_pool *p, int freeing) noexcept with gil:
    """Called by exports.h from a thread that holds the GIL, before the pool's lock is taken;
    a free's frames only under torch's context "all" (else its entries carry the block's)."""
    ref = _stack_pools.get(<uintptr_t>p)
    pool = ref() if ref is not None else None
    if pool is None or (freeing and not (<PoolBase>pool)._free_frames):
        ap_history_set_ctx(0)
        return
    try:
        (<PoolBase>pool)._note_frames()
    except BaseException:
        ap_history_set_ctx(0)  # frames are a diagnostic: never fail the allocation for them


# ---- lazy default pools ----------------------------------------------------------------------------

# The one call from the C ABI up into Python: fn(device) -> (backend, pool or None when the backend
# has no such device), registered by ascend_pool.api at its import (this layer cannot import it).
_default_pool_hook = None


def set_default_pool_hook(fn):
    """Registers fn(device) -> (Backend, default pool of device, or None when the device does not
    exist): what the C ABI calls when a device has no pool yet (ascend_pool.api registers it)."""
    global _default_pool_hook
    _default_pool_hook = fn


cdef int _capi_create_default(int device, int strict, char *msg, size_t msglen) noexcept:
    """Called by exports.h with the GIL held: creates the process default pool of `device` (with
    the backend and knobs a Python user would get), so that a framework that only loaded the
    library can allocate. strict == 0: a device that does not exist is skipped, not an error."""
    cdef bytes text
    cdef size_t n
    try:
        if _default_pool_hook is None:
            raise PoolError("ascend_pool.api has not registered the default-pool hook: import ascend_pool")
        backend, pool = _default_pool_hook(device)
        apc_learn_device_count(backend.device_count)
        if pool is None:
            if not strict:
                return ASCEND_POOL_OK
            raise InvalidDeviceError(
                f"device {device} does not exist: the {backend.name} backend has {backend.device_count} device(s)")
        return ASCEND_POOL_OK
    except BaseException as exc:
        # The runtime's opening can take seconds (aclInit): a Ctrl-C meanwhile fails this call
        # (its caller, which may catch a failed allocation, is told why) and reaches the program.
        _raise_when_back_in_python(exc)
        text = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")
        n = min(<size_t>len(text), msglen - 1)
        memcpy(msg, <const char *>text, n)
        msg[n] = 0
        return ASCEND_POOL_E_INVALID_DEVICE if isinstance(exc, InvalidDeviceError) else ASCEND_POOL_E_NOT_READY


def _capi_shutdown():
    """At interpreter exit: no more Python callbacks from the C ABI (a C thread still allocating on a
    device without a pool then gets ASCEND_POOL_E_NOT_READY instead of waiting on a dying GIL), and
    the calls already waiting for the GIL finish first, with it let go (exports.h, apc_gil_enter):
    one still waiting when finalization starts would be ended by Python with pthread_exit, which
    aborts a C++ caller."""
    apc_set_hooks(NULL)
    apc_set_frames_hook(NULL)
    apc_set_oom_hook(NULL)
    with nogil:
        apc_python_close(10000)  # a hook runs for milliseconds (a pool's opening, an observer)


apc_set_hooks(_capi_create_default)
ap_set_peer_release_hook(apc_release_peers)  # a pool out of device memory: its peers' idle cache first
ap_set_peer_lend_hook(apc_lend_from_peers)   # then a use_on_oom MemPool's free block, for the default pool
apc_set_frames_hook(_capi_note_frames)
_atexit.register(_capi_shutdown)


# ---- Python face of the C ABI ----------------------------------------------------------------------

cdef object _capi_error():
    """The exception for the calling thread's last C-ABI error (errors.pxi's map). The last error
    carries no runtime code: a device failure's exception gets the C ABI's own code."""
    cdef int code = ascend_pool_last_error_code()
    return _c_error(code, code, ascend_pool_last_error().decode("utf-8", "replace"), "C ABI call")


def capi_malloc(Py_ssize_t nbytes, int device=0, stream=None):
    """ascend_pool_malloc from Python (the GIL released, as a framework would call it): nbytes on
    device ordered on stream (an int handle; None: the default stream). Returns the address."""
    cdef void *s = _handle(stream)
    cdef void *p
    ascend_pool_clear_last_error()
    with nogil:
        p = ascend_pool_malloc(nbytes, device, s)
    if p == NULL:
        raise _capi_error()
    return <uintptr_t>p


def _capi_torch_malloc_address():
    """The address of the allocation torch's alloc hook binds to (libascend_pool_torch.so,
    integrations._common.torch_alloc_functions): ascend_pool_malloc's with torch's size_t, so
    that a size from 2**63 on reaches the pool (an out of memory counted and observed there)."""
    return <uintptr_t>&apc_torch_malloc


def capi_free(ptr, Py_ssize_t nbytes=0, int device=0, stream=None):
    """ascend_pool_free from Python: frees ptr ordered on stream (None: its allocation stream).
    Raises the error the C ABI would only record."""
    cdef void *p = _handle(ptr)
    cdef void *s = _handle(stream)
    ascend_pool_clear_last_error()
    with nogil:
        ascend_pool_free(p, nbytes, device, s)
    if ascend_pool_last_error_code() != ASCEND_POOL_OK:
        raise _capi_error()


def capi_init(int device):
    """ascend_pool_init(device): creates device's default pool now if the device exists."""
    ascend_pool_clear_last_error()
    with nogil:
        ascend_pool_init(device)
    if ascend_pool_last_error_code() != ASCEND_POOL_OK:
        raise _capi_error()


def capi_last_error():
    """(code, name, message) of the calling thread's last C-ABI error; code 0 when none."""
    cdef int code = ascend_pool_last_error_code()
    return code, CAPI_ERRORS.get(code, str(code)), ascend_pool_last_error().decode("utf-8", "replace")


def capi_default_backend(int device):
    """The backend name of device's process default pool, or None when it has none yet."""
    cdef const char *name = apc_default_backend_name(device)
    return None if name == NULL else name.decode()


def _test_hold_locks(double seconds, *pools):
    """Test-only: holds the C ABI's registry lock and the mutexes of pools (PoolBase objects, at
    most 4) for `seconds` with the GIL released, as framework threads inside C-ABI calls would,
    each pool counted busy meanwhile; _test_locks_held() is True while they are held. Lets a test
    fork at that moment (tests/test_fork_safety.py)."""
    cdef ap_pool *ps[4]
    cdef unsigned ms = <unsigned>(seconds * 1000)
    cdef int n = 0
    cdef PoolBase pool
    if len(pools) > 4:
        raise ValueError("at most 4 pools")
    try:
        for pool in pools:
            ps[n] = pool._enter()  # counted busy: close() waits for it
            n += 1
        with nogil:
            apc_test_hold_locks(ps, n, ms)
    finally:
        for pool in pools[:n]:
            pool._leave()


def _test_locks_held():
    """True while _test_hold_locks holds its locks."""
    return apc_test_locks_held != 0

# Out-of-memory observers, as torch's torch._C._cuda_attach_out_of_memory_observer: a program
# (or a framework integration) asks to be told when an allocation fails for want of memory, to
# dump a snapshot or log the pool's state at that moment. Each observer is called as
#     observer(device, requested bytes, allowed bytes, device free bytes)
# (allowed: the pool's cap when one is set, else the device's total, as torch passes its memory
# fraction's maximum or the device total; a tenant context's quota bounds both, as HAMi's limited
# device and the context's mem_get_info do), after the pool gave up and before the error reaches
# the caller, with no pool lock held: from Pool.malloc (and a tenant context's) and from the C
# ABI's ascend_pool_malloc (exports.h takes the GIL for it, on that failure path only). An
# observer that raises is logged and skipped: the allocation's own error still reaches its caller.
# A KeyboardInterrupt or SystemExit (a signal handler's, run inside an observer) ends the
# observers and reaches the program: from Pool.malloc at once, from the C ABI in the main thread
# once its caller is back in Python (a pending call), as the signal's own would.

import logging as _logging

cdef extern from "capi/exports.h":
    ctypedef void (*apc_oom_fn)(int device, size_t size, size_t allowed, size_t free_b) noexcept
    void apc_set_oom_hook(apc_oom_fn fn)
    void apc_oom_watchers_set(int n)
    bint apc_oom_watched(int rc)  # an out-of-memory status with observers attached

cdef extern from "pool.h" nogil:
    void ap_pool_oom_figures(ap_pool *p, size_t *allowed, size_t *free_b)

_oom_observers = []  # in attach order; replaced, never mutated, so a notify in flight keeps its list
_oom_log = _logging.getLogger("ascend_pool")


def attach_out_of_memory_observer(observer):
    """Calls observer(device, requested bytes, allowed bytes, device free bytes) whenever an
    allocation of this process fails for want of memory (OutOfMemoryError, QuotaExceededError,
    or NULL from the C ABI), before the error is raised, as torch's
    torch._C._cuda_attach_out_of_memory_observer. allowed (at most a tenant's quota, free then at
    most what is left of it): the pool's cap in bytes when set, else
    the device's total. ConfigTypeError (a TypeError) if observer is not callable."""
    global _oom_observers
    if not callable(observer):
        raise _errors_module.ConfigTypeError(f"an out-of-memory observer must be callable, got {observer!r}")
    _oom_observers = _oom_observers + [observer]
    apc_oom_watchers_set(len(_oom_observers))


def detach_out_of_memory_observer(observer):
    """Stops calling observer (attached with attach_out_of_memory_observer); ConfigError (a
    ValueError) if it is not attached."""
    global _oom_observers
    if observer not in _oom_observers:
        raise ConfigError(f"{observer!r} is not an attached out-of-memory observer")
    kept = list(_oom_observers)
    kept.remove(observer)
    _oom_observers = kept
    apc_oom_watchers_set(len(_oom_observers))


def _notify_oom_observers(int device, size_t size, size_t allowed, size_t free_b):
    for observer in _oom_observers:
        try:
            observer(device, size, allowed, free_b)
        except Exception:
            _oom_log.exception("out-of-memory observer %r raised; the allocation's own error is raised as usual",
                               observer)


cdef void _capi_oom(int device, size_t size, size_t allowed, size_t free_b) noexcept:
    # called by exports.h with the GIL held
    try:
        _notify_oom_observers(device, size, allowed, free_b)
    except BaseException as e:
        if not _raise_when_back_in_python(e):  # nothing may escape into C
            _oom_log.exception("out-of-memory observers failed")


cdef tuple _pool_oom_figures(ap_pool *p):
    """(allowed, free) bytes for the observers, read while the caller holds the pool (a runtime
    call: the GIL is released); the observers run once it is let go (one may close the pool)."""
    cdef size_t allowed = 0, free_b = 0
    with nogil:
        ap_pool_oom_figures(p, &allowed, &free_b)
    return allowed, free_b


apc_set_oom_hook(_capi_oom)

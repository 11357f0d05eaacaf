# A forked child of a process that had opened a device runtime cannot use it (backend/fork.c says
# why). These helpers turn that state into BackendUnavailableError(990004) telling to use 'spawn';
# the backend (Backend._fail), the pool (PoolBase._check/_enter) and ascend_pool.backend /
# ascend_pool.sharing call them before touching the runtime.

from ascend_pool.errors import BackendUnavailableError as _BackendUnavailableError

cdef extern from "backend.h" nogil:
    int AP_ERR_FORKED
    int ap_forked_from
    void ap_backend_forked_message(char *buf, size_t len)
    int ap_fork_drop_fd(int fd, int on)


cdef int _raise_forked() except -1:
    cdef char msg[512]
    msg[0] = 0
    ap_backend_forked_message(msg, sizeof(msg))
    raise _BackendUnavailableError(AP_ERR_FORKED, msg.decode("utf-8", "replace"))


def check_not_forked():
    """Raises BackendUnavailableError (code 990004) when this process was forked after its parent
    had opened a device runtime (no runtime can be used here: start workers with 'spawn');
    returns None otherwise."""
    if ap_forked_from:
        _raise_forked()


def forked_from():
    """The parent's pid when this process was forked after that parent had opened a device
    runtime, else 0."""
    return ap_forked_from


def fork_drops_fd(int fd, bint on=True):
    """Marks fd (on) or unmarks it as a descriptor whose flock proves this process alive (a lease,
    a stats file): a child forked from C code, where Python's fork handlers do not run, drops it,
    so that it cannot keep the lock after this process died. False when the table is full."""
    return ap_fork_drop_fd(fd, 1 if on else 0) == 0


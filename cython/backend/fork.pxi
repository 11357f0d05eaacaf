# A forked child of a process that had opened a device runtime cannot use it (backend/fork.c says
# why). These helpers turn that state into BackendUnavailableError(990004) telling to use 'spawn';
# the backend (Backend._fail), the pool (PoolBase._check/_enter) and ascend_pool.backend /
# ascend_pool.sharing call them before touching the runtime.

from libc.errno cimport errno as _errno, EINTR as _EINTR
from posix.fcntl cimport open as _posix_open, O_CLOEXEC as _O_CLOEXEC
from posix.unistd cimport close as _posix_close

import os as _fork_os

from ascend_pool.errors import BackendUnavailableError as _BackendUnavailableError

cdef extern from "backend.h" nogil:
    int AP_ERR_FORKED
    int ap_forked_from
    void ap_backend_forked_message(char *buf, size_t len)
    int ap_fork_drop_fd(int fd, int on)
    void ap_fork_window_enter()
    void ap_fork_window_leave()


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



def fork_dropped_open(path, int flags, int mode=0o600):
    """os.open(path, flags, mode) (close-on-exec), the descriptor marked as fork_drops_fd does with
    no fork in between, from Python or from C: the open and the mark run inside fork.c's fork
    window, which a fork's prepare handler waits for. For a descriptor that will hold a lock
    proving this process alive (a lease, a stats file, a share record's life lock): opened, then
    marked, a fork from C between the two (a native library's; Python forks wait for identity's
    lock) gave the child a copy unmarked of the open file the parent then locked, and the child
    kept a killed parent alive. Returns (fd, marked); raises OSError. Close it with
    fork_dropped_close."""
    cdef bytes raw = _fork_os.fsencode(path)
    cdef const char *c_path = raw
    cdef int fd, err = 0, marked = 0
    ap_fork_window_enter()
    while True:
        fd = _posix_open(c_path, flags | _O_CLOEXEC, <int>mode)
        if fd >= 0 or _errno != _EINTR:
            break
    if fd < 0:
        err = _errno
    else:
        marked = ap_fork_drop_fd(fd, 1) == 0
    ap_fork_window_leave()
    if fd < 0:
        raise OSError(err, _fork_os.strerror(err), path)
    return fd, bool(marked)


def fork_dropped_close(int fd):
    """Unmarks fd (fork_drops_fd) and closes it with no fork in between (fork.c's window)."""
    ap_fork_window_enter()
    ap_fork_drop_fd(fd, 0)
    _posix_close(fd)
    ap_fork_window_leave()

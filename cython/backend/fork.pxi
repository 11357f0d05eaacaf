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


cdef extern from "<fcntl.h>" nogil:
    int _LEASE_O_NOFOLLOW "O_NOFOLLOW"
cdef extern from "<sys/file.h>" nogil:
    int _lease_flock "flock"(int fd, int op)
    int _LEASE_LOCK_EX "LOCK_EX"
    int _LEASE_LOCK_NB "LOCK_NB"
from libc.errno cimport EEXIST as _EEXIST, ENOENT as _ENOENT
from posix.fcntl cimport O_RDWR as _O_RDWR, O_CREAT as _O_CREAT, O_EXCL as _O_EXCL
from posix.stat cimport fchmod as _fchmod
from posix.unistd cimport link as _link, unlink as _unlink


cdef int _open_lease_tmp(const char *tmp) noexcept nogil:
    # O_EXCL; a file already under the name is a leftover (or another group member's): removed,
    # made again (identity._create_tmp). Inside the fork window: opened and marked as one step.
    cdef int flags = _O_RDWR | _O_CREAT | _O_EXCL | _LEASE_O_NOFOLLOW | _O_CLOEXEC
    cdef int fd, tries
    for tries in range(2):
        while True:
            fd = _posix_open(tmp, flags, 0o640)
            if fd >= 0 or _errno != _EINTR:
                break
        if fd >= 0 or _errno != _EEXIST or tries == 1 or _unlink(tmp) != 0:
            break
    if fd >= 0:
        ap_fork_drop_fd(fd, 1)
    return fd


def fork_dropped_lease(dict leases, str directory, tmp, path, int old_fd=-1):
    """identity._make_lease's system calls and the bookkeeping after them, compiled: creates the
    lease file `path` of this process, locked before it appears under its name (created as tmp,
    flock LOCK_EX, linked, tmp removed), marked as fork_drops_fd from its creation, then sets
    leases[directory] = (fd, path) and closes old_fd (a replaced lease's, -1: none) the
    fork_dropped_close way. Returns fd; raises OSError, leaving nothing made. Python runs a signal
    handler only between bytecodes: a Ctrl-C landing between the link and the record (Python
    lines) left a lease on disk that this process no longer knew it held, and every later
    ensure_lease there failed for good (FileExistsError on the link)."""
    cdef bytes btmp = _fork_os.fsencode(tmp), bpath = _fork_os.fsencode(path)
    cdef const char *c_tmp = btmp
    cdef const char *c_path = bpath
    cdef int fd = -1, err = 0, attempt, on_link = 0
    for attempt in range(3):
        ap_fork_window_enter()
        fd = _open_lease_tmp(c_tmp)
        err = _errno if fd < 0 else 0
        ap_fork_window_leave()
        if fd < 0:
            raise OSError(err, _fork_os.strerror(err), tmp)
        on_link = 0
        # at once, never waiting: a scan tells a killed maker's tmp by its lock
        if _lease_flock(fd, _LEASE_LOCK_EX | _LEASE_LOCK_NB) != 0 or _fchmod(fd, 0o640) != 0:
            err = _errno
        else:
            on_link = 1
            err = 0 if _link(c_tmp, c_path) == 0 else _errno  # appears locked; never overwrites
        _unlink(c_tmp)
        if err == 0:
            break
        ap_fork_window_enter()
        ap_fork_drop_fd(fd, 0)
        _posix_close(fd)
        ap_fork_window_leave()
        fd = -1
        # ENOENT: a scan removed tmp (this process stopped for a minute before it locked it)
        if not (on_link and err == _ENOENT) or attempt == 2:
            if on_link:
                raise OSError(err, _fork_os.strerror(err), tmp, None, path)
            raise OSError(err, _fork_os.strerror(err), tmp)
    leases[directory] = (fd, path)
    if old_fd >= 0:
        ap_fork_window_enter()
        ap_fork_drop_fd(old_fd, 0)
        _posix_close(old_fd)
        ap_fork_window_leave()
    return fd


from posix.time cimport clock_gettime as _lk_clock_gettime, timespec as _lk_timespec, CLOCK_MONOTONIC as _LK_MONOTONIC
from cpython.exc cimport PyErr_CheckSignals as _lk_check_signals
cdef extern from "<fcntl.h>" nogil:
    int _LK_O_DIRECTORY "O_DIRECTORY"
    int _LK_O_RDONLY "O_RDONLY"
cdef extern from "<unistd.h>" nogil:
    int _lk_usleep "usleep"(unsigned int usec)
cdef extern from "<errno.h>" nogil:
    int _LK_EWOULDBLOCK "EWOULDBLOCK"


cdef class DroppedLock:
    """A descriptor that holds a lock (flock) and is closed the fork_dropped_close way by close()
    or when this object goes, whichever comes first: a compiled step each, so that no signal
    handler's exception (a Ctrl-C) lands between the close and its record, and a descriptor an
    exception dropped on its way out is closed with it, never left holding its lock."""
    cdef int _fd

    def __cinit__(self):
        self._fd = -1

    cdef void _close(self) noexcept:
        cdef int fd = self._fd
        self._fd = -1
        if fd >= 0:
            ap_fork_window_enter()
            ap_fork_drop_fd(fd, 0)
            _posix_close(fd)
            ap_fork_window_leave()

    def close(self):
        self._close()

    @property
    def fd(self):
        return self._fd

    def __dealloc__(self):
        self._close()


cdef double _lk_now() noexcept nogil:
    cdef _lk_timespec ts
    _lk_clock_gettime(_LK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


def fork_dropped_dir_lock(directory, double wait_s):
    """Opens `directory` read-only, marked for a forked child's drop from its opening (as
    fork_dropped_open), and takes flock LOCK_EX on it, waiting at most wait_s for another
    process's: (DroppedLock, True) once held; (None, True) when it stayed held wait_s (a stopped
    holder) or cannot be taken (no flock there): nothing is kept then. Raises OSError when it
    cannot be opened, and a signal handler's exception raised while waiting, the descriptor
    closed. The lock lives in the DroppedLock (tenants/ledger.py _choosing): a Ctrl-C landing
    after the flock and before the caller had the descriptor left the directory locked for the
    process's life."""
    cdef bytes bdir = _fork_os.fsencode(directory)
    cdef const char *c_dir = bdir
    cdef DroppedLock lock = DroppedLock()
    cdef int fd, err = 0
    cdef double deadline
    ap_fork_window_enter()
    while True:
        fd = _posix_open(c_dir, _LK_O_RDONLY | _LK_O_DIRECTORY | _O_CLOEXEC)
        if fd >= 0 or _errno != _EINTR:
            break
    err = _errno if fd < 0 else 0
    if fd >= 0:
        ap_fork_drop_fd(fd, 1)
        lock._fd = fd
    ap_fork_window_leave()
    if fd < 0:
        raise OSError(err, _fork_os.strerror(err), directory)
    deadline = _lk_now() + wait_s
    while _lease_flock(fd, _LEASE_LOCK_EX | _LEASE_LOCK_NB) != 0:
        err = _errno
        if (err != _LK_EWOULDBLOCK and err != _EINTR) or _lk_now() >= deadline:
            lock._close()
            return None, err == _LK_EWOULDBLOCK
        with nogil:
            _lk_usleep(2000)
        _lk_check_signals()  # a Ctrl-C while waiting: raised here, `lock` closing its descriptor
    return lock, False

"""This process's identity on the node: a random instance id and a lease, not a pid.

Pids are per pid namespace: workers of two containers are both pid 1, and a pid read from another
namespace names nobody, or another process. So every record this package writes for other
processes to read (quota ledger slots, stats files, share records) names its writer by a random
64-bit *instance* id, and liveness is told by a *lease*: the process holds flock(LOCK_EX) on its
own file

    <dir>/ascend_pool-lease-<instance as 16 hex digits>

in each directory it writes records to. The kernel drops the lock when the process dies, in
whatever namespace it or the checker runs, so `lease_alive()` never mistakes a live process for a
dead one or the reverse. A lease appears under its name already locked (created under a temporary
name, locked, then link()ed), so a checker never sees a live process's lease unlocked.

The pid stays as a label for people, with the pid namespace it belongs to (`pidns()`, the inode
of /proc/self/ns/pid). A forked child is another process: it gets a new instance and new leases.

Within one pid namespace a pid plus its start time (field 22 of /proc/PID/stat, clock ticks after
boot; a later process with the same pid starts later) and the kernel's boot id name a process
(start_time, boot_id, is_alive): the stats files use that to tell a dead writer sooner.

The uid a process goes by on the node is its host uid (host_uid(): os.geteuid() translated by
/proc/self/uid_map), so that the processes of one host user inside and outside a user namespace
(a rootless container, a pod with hostUsers: false) name the same files; a file's owner is checked
as this namespace shows it (owned_by).

This is the one Python home of process identity; the C ledger code has its own in
cython/quota/proc_identity.h (given the instance and pid namespace from here), and the C side of
host ids is cython/common/host_ids.h.
"""

import errno
import fcntl
import logging
import os
import re
import stat
import struct
import threading
import time

LEASE_PREFIX = "ascend_pool-lease-"
log = logging.getLogger("ascend_pool")
_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"

_lock = threading.RLock()
_instance = 0
_leases = {}  # directory -> (fd, path) of this process's lease there
_renew_failed = set()  # directories whose removed lease could not be made again (said once)
_pid = os.getpid()  # the process the state above is of: a child forked from C keeps the parent's


def _adopt():
    """In a child forked from C (no Python fork handler ran: uWSGI's workers, a native library's
    fork) that goes on in Python, forgets the parent's instance and leases, as a Python fork does:
    taking them for its own, it made the parent's lease again whenever the file was gone (its copy
    is /dev/null, fork.c), so a killed parent whose lease the node service had removed was alive
    again to every peer while the child lived, and it told the parent alive by its instance."""
    if _pid != os.getpid():
        _after_fork_in_child()


def instance():
    """This process's instance id: a random non-zero 64-bit int, unique on the node."""
    global _instance
    _adopt()
    if not _instance:
        with _lock:
            while not _instance:
                _instance = int.from_bytes(os.urandom(8), "little")
    return _instance


def instance_hex(value=None):
    """An instance id as the 16 hex digits used in file names and the `instance` label."""
    return f"{instance() if value is None else value:016x}"


def pidns():
    """The inode of this process's pid namespace (0 where /proc does not tell): the namespace a
    `pid` label belongs to."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def pid_here(ns):
    """True when a pid recorded with pid namespace `ns` can be looked up in this process's /proc:
    the same namespace, and /proc shows it (not the case under `unshare --pid` without a /proc of
    its own). Only then may a pid be used, and only to tell a dead process sooner than its lease."""
    if not ns or ns != pidns():
        return False
    try:
        return int(os.readlink("/proc/self")) == os.getpid()
    except (OSError, ValueError):
        return False


def lease_path(directory, value=None):
    return os.path.join(directory, LEASE_PREFIX + instance_hex(value))


def ensure_lease(directory):
    """Holds this process's lease in `directory` (created on first call; kept for the life of the
    process). Returns the instance id. Raises OSError when the directory is not writable."""
    inst = instance()  # _adopt()s first
    directory = os.path.abspath(directory)
    if directory in _leases:
        renew_leases(directory)
        return inst
    with _lock:
        if directory in _leases:
            return inst
        _make_lease(directory, inst)  # made and listed in _leases, or nothing made
    remove_dead_leases(directory, limit=256)  # those of processes gone before us (bounded work)
    return inst


def _make_lease(directory, inst, old_fd=-1):
    """Creates the lease file of instance inst in directory, locked before it appears under its
    name, and lists it in _leases (closing old_fd, the lease it replaces, after); returns its
    descriptor, marked for a forked child's drop (fork_guard) from its creation where the
    extension is loaded. There the whole of it is compiled (fork_dropped_lease): a Ctrl-C (a
    signal handler's exception, run between Python lines) landing after the link and before the
    listing left a lease this process did not know it held, and every later ensure_lease in
    that directory (every tenant context it opened) failed for good on the link (File exists)."""
    path = lease_path(directory, inst)
    tmp = os.path.join(directory, f".{LEASE_PREFIX}{instance_hex(inst)}.tmp")
    if _fork_lease is not None:
        return _fork_lease(_leases, directory, tmp, path, old_fd)
    fd = _make_lease_file(tmp, path)
    _leases[directory] = (fd, path)
    if _fork_guard is not None:
        _fork_guard(fd, True)
    if old_fd >= 0:
        close_dropped(old_fd)
    return fd


def _make_lease_file(tmp, path):
    # without the extension (nothing here is loaded but this module): the same, in Python
    for attempt in range(3):
        fd = _create_tmp(tmp)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # at once: a scan tells a killed maker's tmp by it
            # Readable by the group (a shared ASCEND_POOL_LEDGER_GROUP directory): testing the lock
            # needs only a read-only open. It holds no data; the directory keeps others out.
            os.fchmod(fd, 0o640)
            os.link(tmp, path)  # appears locked; never overwrites
            return fd
        except FileNotFoundError:
            # a scan removed tmp (remove_dead_leases: this process was stopped for a minute before
            # it locked it): make it again
            close_dropped(fd)
            if attempt == 2:
                raise
        except BaseException:
            close_dropped(fd)
            raise
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass


def _create_tmp(tmp):
    """Creates the lease's temporary file tmp (O_EXCL). The name is this instance's, which only
    this process makes, under _lock: a file already there is not a live maker's but a leftover or
    another group member's (in a 2770 group directory any member may create it; before, it made
    every renewal fail silently, FileExistsError): it is removed and the file made again."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return open_dropped(tmp, flags, 0o640)
    except FileExistsError:
        os.unlink(tmp)  # PermissionError in a sticky directory: said by the caller
        return open_dropped(tmp, flags, 0o640)


def renew_leases(directory=None):
    """Makes again this process's lease files that were removed (or replaced) under it, in
    `directory` or in every directory it holds one in; returns the directories concerned. A
    cleanup of /dev/shm or an init container clearing a hostPath removes them while the process
    runs: its peers then go by its life locks (life_hold) on the ledgers it books in and the share
    records it writes, and anything else of it is taken for a dead process's. Called by ensure_lease and, through
    tenants.ledger.check_files, when a context opens a ledger and at each stats interval."""
    _adopt()
    with _lock:
        items = [(d, v) for d, v in _leases.items() if directory is None or d == directory]
        out = []
        for d, (fd, path) in items:
            try:
                st, own = os.stat(path, follow_symlinks=False), os.fstat(fd)
                if (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino):
                    continue
            except FileNotFoundError:
                pass
            except OSError:
                continue  # cannot tell: keep what is held
            try:
                _make_lease(d, instance(), fd)  # listed, then fd closed
            except OSError as e:  # FileExistsError: another file holds the name, not ours to replace
                if d not in _renew_failed:  # once: this is tried again at every stats interval
                    _renew_failed.add(d)
                    log.warning("this process's lease %s was removed and cannot be made again: %s", path, e)
                continue
            _renew_failed.discard(d)
            out.append(d)
            log.warning("this process's lease %s was removed while it runs (a cleanup of the directory?): made "
                        "again", path)
    return out


_fork_guard = None  # fork_drops_fd of the extension, set by the backend layer (set_fork_guard)
_fork_open = None   # fork_dropped_open, likewise
_fork_close = None  # fork_dropped_close, likewise
_fork_lease = None  # fork_dropped_lease, likewise


def set_fork_guard(guard, opener=None, closer=None, lease_maker=None):
    """Hook from the layer that loads the extension: guard(fd, on) marks a descriptor whose lock
    proves this process alive, so that a child forked from C (no Python fork handler) drops it:
    holding the lock, it kept a killed parent alive to its peers (its quota share never given
    back). opener(path, flags, mode) -> (fd, marked) opens and marks with no fork in between,
    closer(fd) unmarks and closes so (open_dropped, close_dropped); lease_maker makes and lists a
    lease in one compiled step (_make_lease). Marks the leases held so far."""
    global _fork_guard, _fork_open, _fork_close, _fork_lease
    _fork_guard, _fork_open, _fork_close, _fork_lease = guard, opener, closer, lease_maker
    for fd, _ in list(_leases.values()):
        guard(fd, True)


def fork_guard(fd, on=True):
    """guard(fd, on) when the hook is set (a stats file's descriptor, say); else nothing."""
    if _fork_guard is not None:
        _fork_guard(fd, on)


def open_dropped(path, flags, mode=0o600):
    """os.open(path, flags, mode) for a descriptor that will hold a lock proving this process alive
    (a lease, a stats file, a life lock), marked for a forked child's drop (fork_guard) in the same
    step where the extension is loaded: opened, then marked, a fork from C in between (a native
    library's, from any thread: Python's forks wait for _lock, C's do not) gave the child an
    unmarked copy of the open file the parent then locked, and the child kept a killed parent
    alive to its peers. Close it with close_dropped."""
    if _fork_open is None:
        return os.open(path, flags, mode)
    return _fork_open(path, flags, mode)[0]


def close_dropped(fd):
    """Unmarks fd (fork_guard) and closes it, with no fork in between where the extension is loaded."""
    if _fork_close is None:
        os.close(fd)
    else:
        _fork_close(fd)


# struct flock of Linux's 64-bit ABI (short l_type, l_whence; off_t l_start, l_len; pid_t l_pid)
_FLOCK = struct.Struct("@hhqqi4x")


def _life_range(value, kind):
    # the byte cython/quota/proc_identity.h apl_life_offset names: past the data, nearly always
    # past the end of the file (a lock is allowed there and touches nothing)
    return _FLOCK.pack(kind, os.SEEK_SET, (value >> 2) + 1, 1, 0)


def life_hold(fd, value=None):
    """Takes this process's life lock on the file open as fd: a read lock on one byte named by its
    instance (an open-file-description lock, F_OFD_SETLK), which the kernel drops when the process
    dies, in any namespace, as it drops a lease's. A record's writer holds it while it keeps fd
    open, so that the record's readers see it alive when its lease file was removed under it (a
    /dev/shm cleanup; cython/quota/proc_identity.h is the ledger's side). Taken only when a child
    forked from C is sure to drop fd (fork_guard): holding the lock, it would keep a killed parent
    alive; where not (the table full, a kernel before 3.15), False, and the lease alone tells.
    Closing fd drops the lock: close it with close_dropped."""
    if _fork_guard is None or not _fork_guard(fd, True):
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _life_range(instance() if value is None else value, fcntl.F_RDLCK))
    except (OSError, AttributeError):
        _fork_guard(fd, False)
        return False
    return True


def life_open(fd, value=None):
    """Opens the file open as fd once more (read-only: a descriptor and open file description of
    its own) and takes this process's life lock on it (life_hold). Returns that descriptor, or -1
    where the lock cannot be had (the lease alone tells); release it with life_close. A lock on fd
    itself would be shared by every copy of fd a fork made since fd was opened: a child forked
    then (before the lock, so unknown to fork.c's drop) kept the lock its parent took later, a
    killed parent alive to its peers while the child lived. The open and the registration for
    the drop are one step (open_dropped), which a fork from C waits for too."""
    with _lock:
        try:
            own = open_dropped(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return -1
        if not life_hold(own, value):
            close_dropped(own)
            return -1
        return own


def life_close(fd):
    """Drops a life lock life_open took (closing its descriptor), after its drop registration."""
    with _lock:
        close_dropped(fd)


def life_held(fd, value):
    """True when some process holds the life lock of instance `value` on the file open as fd (by
    another open file description: any process's, including this one's other ones), False when
    nobody does, None when it cannot be told (fd < 0, no OFD locks)."""
    if fd is None or fd < 0 or not value:
        return None
    try:
        out = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _life_range(value, fcntl.F_WRLCK))
    except (OSError, AttributeError):
        return None
    return _FLOCK.unpack(out)[0] != fcntl.F_UNLCK


def any_lock_held(fd):
    """True when some process holds a record lock (POSIX or OFD) anywhere on the file open as fd (by
    another open file description), False when nobody does, None when it cannot be told. What tells,
    without reading the file, that a ledger is in use: each process with a slot in it holds its life
    lock there (cython/quota/ledger_format.h: a rule every format version keeps)."""
    if fd is None or fd < 0:
        return None
    try:
        out = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
    except (OSError, AttributeError):
        return None
    return _FLOCK.unpack(out)[0] != fcntl.F_UNLCK


def whoami(directory):
    """This process as the records of `directory` name it: (pid, instance, pidns, start time),
    with its lease held there (ensure_lease)."""
    return os.getpid(), ensure_lease(directory), pidns(), self_start_time()


def lease_alive(directory, value):
    """True when the process of instance `value` holds its lease in `directory`, False when it does
    not (exited, in any namespace), None when it cannot be told (then keep its records)."""
    if not value:
        return False
    _adopt()
    if value == _instance:
        return True
    try:
        fd = os.open(lease_path(directory, value), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # also drops a lock we took
    return False


def owner_alive(directory, value, pid=0, ns=0, start=0, record_fd=-1):
    """The liveness of a record's writer: its lease in `directory` decides (True, False, None for
    cannot tell), or, where the lease does not say alive, its life lock on the record open as
    record_fd (life_held: a live writer whose lease file was removed). One refinement, for a writer
    of this process's own pid namespace only (pid_here(ns)): a pid that is gone or a zombie is dead
    even while its lease is held for a moment more (a killed multi-threaded process is a zombie
    before its last thread has closed its files). start (the start time it wrote) is a label,
    never proof of death (gone_here)."""
    lease = lease_alive(directory, value)
    if lease is not True and life_held(record_fd, value):
        lease = True
    if lease and pid > 0 and pid_here(ns) and gone_here(pid):
        return False
    return lease


def gone_here(pid):
    """True when pid (of this pid namespace) is surely gone: no such process, or one that has
    exited and awaits its reaping. A zombie state alone is not that: it is the state of the
    leader thread, also after the main thread called pthread_exit() while the process's other
    threads run on (alive, holding its memory); so a zombie is dead only when no other thread is
    left (num_threads, field 20) or a signal ended it (exit_code, field 52: a fatal signal ends
    every thread), as cython/common/proc_exit.h. A start time other than the one the process
    wrote is not proof (the kernel shifts it by the reader's time namespace: a CRIU-restored
    container's workers read other values than their peers), nor is a /proc entry this reader
    cannot see while the process exists (hidepid=2)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass  # EPERM: it exists, another user's
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False  # cannot tell
    rest = data[data.rindex(b")") + 2:].split()  # rest[k] is field k + 3
    if not rest or rest[0] not in (b"Z", b"X"):
        return False
    try:
        threads = int(rest[17])
        exit_code = int(rest[49]) if len(rest) > 49 else 0  # 0 where not shown (kernel < 3.5, not ptrace-able)
    except (IndexError, ValueError):
        return False
    return threads == 1 or bool(exit_code & 0x7F)


def start_time(pid):
    """The start time of pid in this pid namespace (clock ticks after boot), or None when there is
    no such process or it has exited (a zombie)."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # comm (field 2) is in parentheses and may itself hold spaces and ')': split after the last ')'.
    rest = data[data.rindex(b")") + 2:].split()
    return None if rest[0] in (b"Z", b"X") else int(rest[19])  # field 22 overall; rest starts at 3


def self_start_time():
    """This process's start time (/proc/self/stat field 22), or 0."""
    return start_time(os.getpid()) or 0


_UID_MAP_PATH = "/proc/self/uid_map"
_GID_MAP_PATH = "/proc/self/gid_map"
_OVERFLOW_UID_PATH = "/proc/sys/kernel/overflowuid"
_OVERFLOW_GID_PATH = "/proc/sys/kernel/overflowgid"
_IDENTITY_MAP = [(0, 0, 4294967295)]
_maps = {}  # path -> [(inside, outside, count)], [] for a map without lines, None where /proc does not tell


def _read_map(path):
    """The lines of an id map ("inside outside count"), read once per process and cached: the
    maps of a user namespace never change once written, and a process changes user namespace only
    by unshare(CLONE_NEWUSER) (forgotten after fork, see _after_fork_in_child)."""
    try:
        return _maps[path]
    except KeyError:
        pass
    try:
        with open(path) as f:
            rows = [line.split() for line in f.read().splitlines() if line.strip()]
        rows = [tuple(int(x) for x in row[:3]) for row in rows if len(row) >= 3]
    except (OSError, ValueError):
        rows = None
    _maps[path] = rows
    return rows


def _overflow(path):
    key = ("overflow", path)
    if key not in _maps:
        try:
            with open(path) as f:
                _maps[key] = int(f.read().strip())
        except (OSError, ValueError):
            _maps[key] = 65534
    return _maps[key]


def _outward(rows, num):
    """num (an id inside the namespace) outside it, by the map's lines; None when they leave it out.
    rows None (no /proc) or the initial namespace's identity: num itself."""
    if rows is None or rows == _IDENTITY_MAP:
        return num
    return next((out + num - inside for inside, out, count in rows if inside <= num < inside + count), None)


def _inward(rows, num):
    """The id inside the namespace of num outside it; None when the map leaves it out."""
    if rows is None or rows == _IDENTITY_MAP:
        return num
    return next((inside + num - out for inside, out, count in rows if out <= num < out + count), None)


def host_uid():
    """This process's uid on the host: the uid os.geteuid() maps to outside its user namespace
    (/proc/self/uid_map; the parent namespace's view for a nested one), os.geteuid() itself in the
    initial namespace, or where the map leaves it out (then user_namespace() says so). Every file
    this package shares between processes (private directory, quota ledgers, stats files, share
    records, the simulator's records and leases) is NAMED by it and stores it; so one host user is
    one user inside and outside a user namespace (docs/containers.md). Ownership checks of a file
    (st_uid) compare with os.geteuid(), as this namespace shows it: see owner_host_uid()."""
    me = os.geteuid()
    out = _outward(_read_map(_UID_MAP_PATH), me)
    return me if out is None else out


def host_gid(gid):
    """The host's gid of `gid` as this namespace sees it (/proc/self/gid_map), gid itself where the
    map leaves it out: what a group's directory and ledger are named by and store."""
    out = _outward(_read_map(_GID_MAP_PATH), gid)
    return gid if out is None else out


def gid_mapped(gid):
    """True when this namespace's gid map holds gid (always in the initial namespace): a gid it
    leaves out names no group here (a process cannot be in it, nor give a file to it), and
    host_gid() would take it for the host's own number."""
    return _outward(_read_map(_GID_MAP_PATH), gid) is not None


def gid_map_text():
    """/proc/self/gid_map's lines joined by "; " (for messages), "" where /proc does not tell."""
    rows = _read_map(_GID_MAP_PATH) or []
    return "; ".join(" ".join(map(str, row)) for row in rows)


def in_namespace(kind="u"):
    """True when this process's uid (kind "u") or gid ("g") map is not the initial namespace's."""
    rows = _read_map(_UID_MAP_PATH if kind == "u" else _GID_MAP_PATH)
    return rows is not None and rows != _IDENTITY_MAP


def owner_host_uid(st_uid):
    """The host uid of a file owned by st_uid (an fstat result, this namespace's view), or None when
    it cannot be told: the map leaves st_uid out, or st_uid is the overflow uid that every unmapped
    owner shows as (even where the map holds that uid)."""
    if st_uid == os.geteuid():
        return host_uid()  # this user's own file, as the kernel shows it
    rows = _read_map(_UID_MAP_PATH)
    if rows is not None and rows != _IDENTITY_MAP and st_uid == _overflow(_OVERFLOW_UID_PATH):
        return None
    return _outward(rows, st_uid)


def owner_host_gid(st_gid):
    """As owner_host_uid, for a file's group."""
    rows = _read_map(_GID_MAP_PATH)
    if rows is not None and rows != _IDENTITY_MAP and st_gid == _overflow(_OVERFLOW_GID_PATH):
        return None
    return _outward(rows, st_gid)


def gid_here(host):
    """The gid this namespace sees for the host's gid `host`, or None when its map leaves it out."""
    return _inward(_read_map(_GID_MAP_PATH), host)


def owned_by(st_uid, host):
    """True when a file of owner st_uid (this namespace's view) belongs to the host's uid `host`.
    This user's own: st_uid == os.geteuid(), the kernel's view, never translated; another user's:
    owner_host_uid(st_uid) == host."""
    if host == host_uid():
        return st_uid == os.geteuid()
    out = owner_host_uid(st_uid)
    return out is not None and out == host


def runs_as_overflow_uid():
    """True when this process runs in a user namespace as the overflow uid (65534, `nobody` in
    many rootless containers whose map holds it): every file of an owner the map leaves out shows
    as that uid, so an ownership check (st_uid == os.geteuid()) cannot tell such a file from its
    own. private_dir() warns once per process."""
    return in_namespace() and os.geteuid() == _overflow(_OVERFLOW_UID_PATH)


def user_namespace():
    """None in the initial user namespace (/proc/self/uid_map the identity "0 0 4294967295") or
    where /proc does not tell; else (map, outside): the map's lines ("inside outside count")
    joined by "; " ("" for a map without lines: nothing written yet), and host_uid() when the map
    holds os.geteuid(), None when it leaves it out. Only in that last case does this process share
    nothing with the host user's processes outside the namespace: it names its files by
    os.geteuid() then (docs/containers.md), and private_dir() says so once per process."""
    rows = _read_map(_UID_MAP_PATH)
    if rows is None or rows == _IDENTITY_MAP:
        return None
    return "; ".join(" ".join(map(str, row)) for row in rows), _outward(rows, os.geteuid())


_LOCKS_PATH = "/proc/locks"


def pids_here(files):
    """{path: pid} for those of files (path -> (recorded pid, recorded pidns)) whose writer holds
    flock(LOCK_EX) on them (a stats file, its writer's for life): the writer's pid in the pid
    namespace of this process's /proc, the one kill, top and npu-smi take there (the host's pid
    of a container's pid-1 worker when read on the host). The kernel's /proc/locks gives the
    locker's pid in that namespace, and leaves out the locks of processes outside it (a worker of
    another container, read from inside one): those files have no entry. An entry is kept only
    when /proc/PID/status's NSpid ends with the pid the writer recorded (its own namespace's), and
    /proc/PID/ns/pid, where readable, is the namespace it recorded.
    A writer of this process's own pid namespace is the pid it recorded, and where /proc is not
    this namespace's (`unshare --pid` without a /proc of its own, a container given the host's
    /proc) only those are given: /proc/locks there names the pids of /proc's namespace, which no
    kill here takes (before, a host worker got its host pid, "No such process" to kill here, and
    a worker of this namespace the host's pid instead of its own)."""
    own = pidns()
    out = {path: pid for path, (pid, ns) in files.items() if ns and ns == own and pid > 0}
    if not pid_here(own):
        return out
    want = {}
    for path, (pid, ns) in files.items():
        if path in out:
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue
        want[(os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)] = (path, pid, ns)
    if not want:
        return out
    try:
        with open(_LOCKS_PATH) as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        f = line.split()
        # "N: FLOCK  ADVISORY  WRITE PID MAJ:MIN:INODE 0 EOF"; a waiter's line has "->" after "N:"
        if len(f) < 6 or f[1] != "FLOCK" or f[3] != "WRITE":
            continue
        try:
            here = int(f[4])
            major, minor, ino = f[5].split(":")
            key = (int(major, 16), int(minor, 16), int(ino))
        except ValueError:
            continue
        if here <= 0 or key not in want:
            continue
        path, pid, ns = want[key]
        if _same_process(here, pid, ns):
            out[path] = here
    return out


def _same_process(here, pid, ns):
    """True when /proc/<here> is the process that recorded pid in pid namespace ns."""
    try:
        with open(f"/proc/{here}/status") as f:
            nspid = next((ln.split()[1:] for ln in f if ln.startswith("NSpid:")), None)
    except OSError:
        return False
    if not nspid or nspid[-1] != str(pid):
        return False
    try:
        return not ns or os.stat(f"/proc/{here}/ns/pid").st_ino == ns
    except OSError:
        return True  # another user's process (no ptrace access): NSpid said enough


def boot_id():
    """The kernel's boot id as 16 raw bytes (zeros where /proc does not tell it)."""
    try:
        with open(_BOOT_ID_PATH) as f:
            return bytes.fromhex(f.read().strip().replace("-", ""))[:16].ljust(16, b"\0")
    except (OSError, ValueError):
        return b"\0" * 16


TMP_STALE_S = 60.0  # a temporary file lives microseconds: an older one's maker was killed (or is stopped)
_LEDGER_TMP = re.compile(r"ascend_pool-ledger-[^/]*\.tmp\.\d+\.[0-9a-f]{16}\.\d+")  # cython/quota/ledger_file.h
_LEASE_TMP = re.compile(r"\." + LEASE_PREFIX + r"[0-9a-f]{16}\.tmp")  # _make_lease
_SHARE_TMP = re.compile(r"ascend_pool-share-[^/]*\.tmp\.[0-9a-f]{16}")  # sharing._Record


def remove_dead_leases(directory, limit=10000):
    """Removes the lease files of exited processes in `directory` (at most `limit` looked at), and
    the temporary files of processes killed while making a lease, a quota ledger (a ledger's is
    ~74 KB of /dev/shm: pods killed while starting left them for good) or a share record. Returns how many lease
    files were removed. Instance ids are never reused, so a dead lease is garbage."""
    removed = 0
    try:
        listed = os.listdir(directory)
    except OSError:
        return 0
    names = [n for n in listed if n.startswith(LEASE_PREFIX)][:limit]
    _remove_dead_temporaries(directory, [n for n in listed if any(r.fullmatch(n) for r in (_LEDGER_TMP, _LEASE_TMP,
                                                                                           _SHARE_TMP))][:limit])
    for name in names:
        try:
            value = int(name[len(LEASE_PREFIX):], 16)
        except ValueError:
            continue
        if lease_alive(directory, value) is False:
            try:
                os.unlink(os.path.join(directory, name))
                removed += 1
            except OSError as e:
                if e.errno != errno.ENOENT:
                    continue
    return removed


def _remove_dead_temporaries(directory, names):
    """Removes those of names (temporary files) whose maker is gone (remove_abandoned)."""
    for name in names:
        try:
            remove_abandoned(os.path.join(directory, name))
        except OSError:
            continue  # gone meanwhile, or not ours to read


def remove_abandoned(path):
    """Removes path, a file this user's process was making, if its maker is gone; True when
    removed, OSError when it cannot be looked at. The name's pid may be another pid namespace's,
    so the proof is the maker's lock: each such file is made locked (flock LOCK_EX, right after
    its creation) and stays locked until it is renamed or removed; the kernel drops the lock when
    its maker dies, in any namespace. Only this user's files, unlocked and older than TMP_STALE_S
    (seconds; a maker stopped between creating and locking its file loses it, and makes it again:
    ensure_lease, ledger_file.h's apl_create) are removed; one whose maker holds it stays."""
    st = os.lstat(path)
    if not (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and time.time() - st.st_mtime > TMP_STALE_S):
        return False
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fst = os.fstat(fd)
        if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            return False  # replaced since the lstat: looked at again next time
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its maker is alive, still making it
        os.unlink(path)
        return True
    finally:
        os.close(fd)


def _before_fork():
    # A fork waits for a lease being made (_make_lease: locked, then registered in _leases) or
    # replaced: a fork between the two copied the locked descriptor into the child unknown to
    # _after_fork_in_child, and the child kept the parent's lease (a killed parent alive) as long
    # as it lived. Held for a few system calls; never held over a wait.
    _lock.acquire()


def _after_fork_in_parent():
    _lock.release()


def _after_fork_in_child():
    # The child is another process: the parent's leases stay the parent's (closing our copies of
    # the descriptors keeps the locks, which belong to the parent's open files). Also run by
    # _adopt() in a child forked from C, where the parent's threads may have held _lock.
    global _lock, _instance, _pid
    _pid = os.getpid()
    _lock = threading.RLock()
    for fd, _ in _leases.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _leases.clear()
    _renew_failed.clear()
    _instance = 0
    _maps.clear()  # read again if asked: the child may unshare(CLONE_NEWUSER) before it asks


# Never released at exit: the process's records (ledger slots, device memory) outlive the atexit
# handlers (contexts are closed when the interpreter finalises), and a lease dropped early would let
# another process take the process for dead while it still holds memory. The kernel drops the lock
# when the process is gone; the file is removed by the next process that looks (ensure_lease, the
# node service's sweep).
os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)

"""Where the node-wide quota ledgers live, and this process's handle on each.

One ledger file per device of the node (the physical NPU: a container's device 0 may be the node's
NPU 3, Backend.physical_device) and per user, or per group when $ASCEND_POOL_LEDGER_GROUP is set,
in the user's (or group's) private directory inside $ASCEND_POOL_LEDGER_DIR or /dev/shm
(ascend_pool/private_dir.py: another local user cannot take its names or write its files):

    ascend_pool-ledger-u<uid>-<backend>[-<sim node>]-dev<N>     private: mode 0600
    ascend_pool-ledger-g<gid>-<backend>[-<sim node>]-dev<N>     shared with a group: mode 0660

and, while another ascend_pool build's live processes hold that file (another format version: a
rolling upgrade), this build's ledger beside it, the same name + ".v<format version>" (version_path).

uid and gid are the host's (identity.host_uid, identity.host_gid; the header records them too): a
tenant's processes of one host user share one ledger inside and outside a user namespace
(docs/containers.md).

The simulated backend adds its node name ($ASCEND_SIM_NODE) because each simulated node is a
separate machine. The file layout and its concurrency rules are described in
cython/quota/ledger_format.h, ledger_slots.h and ledger_reserve.h; this module only names files,
opens them once per process (ascend_pool._core.Ledger validates them) and offers the sweep the
node service runs.

The node service also reads other users' ledgers (--allow-uid, --allow-group), files their owners
may truncate, replace or keep locked at any time: it exports them from a private copy read with
pread (read_view: never mapped, never locked), and its sweep keeps its own mappings apart from this
process's contexts', checks each against the path's file before use (dropped when replaced or
shrunk), waits at most SWEEP_LOCK_S for a file's lock, reads the mapping under a SIGBUS guard
(cython/quota/ledger_guard.h) and skips a file that failed for RETRY_AFTER_S.
"""

import contextlib
import fcntl
import grp
import logging
import os
import re
import stat
import struct
import threading
import time

from .. import identity
from .._core import LEDGER_VERSION, Ledger, fork_dropped_dir_lock, read_ledger_view, set_operator_quota_hook
from ..backend import open_backend
from ..private_dir import candidates, private_dir
from .config import operator_quota
from .errors import LedgerError

DIR_ENV = "ASCEND_POOL_LEDGER_DIR"
GROUP_ENV = "ASCEND_POOL_LEDGER_GROUP"
DEFAULT_DIR = "/dev/shm"
# fullmatch; ".v<N>": a per-version ledger (version_path)
_NAME = re.compile(r"ascend_pool-ledger-(u|g)(\d+)-(acl|sim|cuda)(?:-(.+))?-dev(\d+)(?:\.v\d+)?")

log = logging.getLogger("ascend_pool")
_lock = threading.RLock()
_cache = {}  # path -> Ledger, for the life of the process (a mapping costs ~80 KiB)
_mapped = {}  # path -> (st_dev, st_ino) of the file this process mapped there
_replaced_logged = set()
# The sweep's own mappings (sweep(): this user's ledgers and the trusted users' and groups'),
# apart from _cache: path -> Ledger, checked against the path's file (st_dev, st_ino) before each
# use and dropped when the path names another file or the file shrank. A file that could not be
# opened or swept is skipped until _retry_at[path] (time.monotonic()): a process stopped holding
# its lock must not cost every sweep a lock wait.
_swept = {}
_retry_at = {}
SWEEP_LOCK_S = 1.0    # the longest a sweep waits for one ledger's lock (its holders keep it microseconds)
RETRY_AFTER_S = 30.0  # a ledger that could not be opened or swept is skipped this long


def _forget_after_fork():
    # The child must not share the parent's open file (its flock would be the parent's).
    global _lock
    _lock = threading.RLock()
    _cache.clear()
    _mapped.clear()
    _swept.clear()
    _retry_at.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


# The ledger code (in the extension, a lower layer) asks the tenants file for the operator's
# quota through this hook: the file's quota wins over any process's own declaration.
set_operator_quota_hook(operator_quota)


def base_dir(directory=None):
    """The shared directory ledgers live under: `directory`, else $ASCEND_POOL_LEDGER_DIR, else /dev/shm."""
    d = directory or os.environ.get(DIR_ENV) or DEFAULT_DIR
    if not os.path.isabs(d):
        # read from each process's working directory: processes started in different ones would
        # book a tenant's quota in different ledgers, each under the whole quota
        raise LedgerError(f"ledger directory {d!r} is a relative path; processes in other working directories would "
                          f"book in other ledgers (set {DIR_ENV} to an absolute directory on tmpfs, shared by the "
                          "processes of a node)", kind="argument")
    if not os.path.isdir(d):
        raise LedgerError(f"ledger directory {d!r} does not exist or is not a directory (set {DIR_ENV} to a "
                          "directory on tmpfs, shared by the processes of a node)", kind="io")
    return d


INIT_IPC_NS = 0xEFFFFFFF  # the inode of the kernel's initial IPC namespace (PROC_IPC_INIT_INO): the host's
_private_shm_said = []


def _say_if_container_shm(directory):
    """Says once per process (a warning) that the quota ledgers are in the default /dev/shm of a
    process in an IPC namespace of its own: Docker and Kubernetes give each container (pod) such a
    namespace with its own /dev/shm, which no other container sees, so each books the tenant in a
    ledger of its own under the whole quota (60 + 60 MiB granted under 100 MiB), and nothing said
    so. Not said where the directory was chosen ($ASCEND_POOL_LEDGER_DIR, even /dev/shm: a quota
    per pod on purpose) or where the IPC namespace is the host's (hostIPC, --ipc=host)."""
    if directory or os.environ.get(DIR_ENV) or _private_shm_said:
        return
    try:
        ipc = os.stat("/proc/self/ns/ipc").st_ino
    except OSError:
        return  # no /proc to tell by
    if ipc == INIT_IPC_NS:
        return
    _private_shm_said.append(ipc)
    log.warning("quota ledgers are in %s, the default, and this process runs in an IPC namespace of its own (a "
                "container's or pod's), whose /dev/shm is usually its own: processes of other containers or pods "
                "then book their tenants in ledgers of their own, each under the whole quota. Set %s to a directory "
                "shared by the node's containers (a hostPath, as deploy/example-tenant.yaml's /run/ascend-pool), or to %s to keep "
                "quotas per pod on purpose", DEFAULT_DIR, DIR_ENV, DEFAULT_DIR)


def ledger_dir(directory=None, group=None):
    """The directory of this user's (or group's) ledger files, share records and leases: a private
    directory inside base_dir(directory), created if needed (ascend_pool.private_dir)."""
    base = base_dir(directory)
    gid = ledger_group(group)
    try:
        return private_dir(base, gid)
    except OSError as e:
        raise LedgerError(f"cannot have a private ledger directory in {base}: {e}", kind="permission") from None


def ledger_group(value=None):
    """The gid ledgers are shared with (from `value` or $ASCEND_POOL_LEDGER_GROUP: a group name or
    number), or None for private ledgers."""
    value = value if value is not None else os.environ.get(GROUP_ENV, "").strip()
    if value in ("", None):
        return None
    if isinstance(value, int) and not isinstance(value, bool) or (isinstance(value, str) and value.isascii()
                                                                   and value.isdigit()):
        gid = int(value)
        if not 0 <= gid < 2**32 - 1:  # 2**32-1 is (gid_t)-1: chown's "leave the group as it is"
            raise LedgerError(f"{GROUP_ENV}={value!r} is not a group id (0 to {2**32 - 2})", kind="argument")
    else:
        try:
            gid = grp.getgrnam(str(value)).gr_gid
        except (KeyError, ValueError):
            raise LedgerError(f"{GROUP_ENV}={value!r} is not a group on this system", kind="argument") from None
    if not identity.gid_mapped(gid):
        # Taken for the host's number, it named another group's directory, then failed with EINVAL
        # (fchown) or "belongs to group N" far from the cause.
        raise LedgerError(f"{GROUP_ENV}={value!r}: gid {gid} is not a group of this user namespace (its gid map "
                          f"'{identity.gid_map_text()}' leaves it out); give the group as this namespace sees it",
                          kind="argument")
    return gid


def node_name(backend_name):
    """The simulated node's name for the sim backend ($ASCEND_SIM_NODE, default "default"); "" else."""
    return os.environ.get("ASCEND_SIM_NODE", "default") if backend_name == "sim" else ""


def ledger_path(device, backend_name, node="", group=None, directory=None):
    """The ledger file of device on backend_name (see the module docstring)."""
    # the host's ids (identity.host_uid/host_gid): the same file inside and outside a user namespace
    who = f"g{identity.host_gid(group)}" if group is not None else f"u{identity.host_uid()}"
    suffix = f"-{node}" if node else ""
    return os.path.join(ledger_dir(directory, group), f"ascend_pool-ledger-{who}-{backend_name}{suffix}-dev{int(device)}")


def _backend_name(backend):
    return backend if isinstance(backend, str) else backend.name


# The first two fields of every format version's header (cython/quota/ledger_format.h): what tells
# a ledger of another ascend_pool build without reading the rest of its layout.
_LEDGER_MAGIC = 0x31524744454c5041  # APL_MAGIC, "APLEDGR1"
_HEAD = struct.Struct("<QI")        # magic, version
_versions_said = set()


PROBE_LOCK_S = 1.0  # the longest a probe waits for a ledger's update lock (held microseconds by a live peer)


def _probe(path, group, removable):
    """Looks at the ledger file at path without mapping it (another build's layout is not read):
    ("none", None) when there is none, or it is no ledger (left to the open's checks); else
    (state, version) with state "held" (a record lock on it: each process with a slot there holds
    its life lock, in every format version; or its update lock held past PROBE_LOCK_S), "free", or
    "removed": nobody held it and removable(version, stat) said so (only a file of this user's,
    or of group `group`). Looked at and removed under its update lock, the path checked to name
    the file looked at: a file another process's probe replaced meanwhile is looked at anew (two
    processes starting at once both book in the new one, never one in a per-version ledger)."""
    for _ in range(3):
        state = _probe_once(path, group, removable)
        if state is not None:
            return state
    return "held", None  # replaced at every look: in use (the caller books apart rather than wait)


def _probe_once(path, group, removable):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return "none", None
    try:
        st = os.fstat(fd)
        mine = (st.st_gid == group) if group is not None else identity.owned_by(st.st_uid, identity.host_uid())
        head = os.pread(fd, _HEAD.size, 0)
        if not stat.S_ISREG(st.st_mode) or len(head) < _HEAD.size:
            return "none", None
        magic, version = _HEAD.unpack(head)
        if magic != _LEDGER_MAGIC:
            return "none", None
        if not mine or not removable(version, st):  # only looked at (another user's, or this build's
            # ledger): no wait for its update lock, which a stopped peer may hold
            return ("held" if identity.any_lock_held(fd) is not False else "free"), version
        deadline = time.monotonic() + PROBE_LOCK_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # an update (or another probe) in progress
                if time.monotonic() >= deadline:
                    return "held", version
                time.sleep(0.002)
            except OSError:
                return "held", version
        try:
            now = os.stat(path, follow_symlinks=False)
        except OSError:
            return None  # removed meanwhile: look again
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return None  # replaced meanwhile (another process's probe): look again
        if identity.any_lock_held(fd) is not False:  # held, or cannot be told: in use
            return "held", version
        try:
            os.unlink(path)
        except OSError:
            return "free", version
        return "removed", version
    finally:
        os.close(fd)  # drops the update lock


def _say_version_once(key, text, *args):
    if key not in _versions_said:
        _versions_said.add(key)
        log.warning(text, *args)


ALT_STALE_S = 60.0  # a per-version ledger nobody holds is removed once this old (its maker slots in microseconds)


def version_path(path, version=LEDGER_VERSION):
    """The ledger a build of format `version` books in while the device's ledger at path is another
    build's, still held by live processes: path + ".v<version>" (docs/containers.md, "Rolling upgrades")."""
    return f"{path}.v{int(version)}"


def _path_for_this_version(path, group):
    """The ledger path this build books in: path, unless another build's (another format version)
    live processes hold the ledger there (a rolling upgrade: old and new pods side by side), then
    version_path(path), said once: the tenants' quotas then hold in each ledger apart until the
    other build's processes are gone (before: every context of this build refused). Processes of
    this build stay together: the per-version ledger is used while any process holds it or it is
    under ALT_STALE_S old, and removed after. A ledger of another format version that no live
    process holds is removed, said once, and a new one made in its place; before, it refused
    every tenant context on the device until someone removed it by hand."""
    alt = version_path(path)
    astate, _ = _probe(alt, group, lambda v, st: v == LEDGER_VERSION and time.time() - st.st_ctime > ALT_STALE_S)
    # held, or made under ALT_STALE_S ago (its maker about to take its slot): this build books there,
    # and the other build's ledger is left as it is
    alt_held = astate in ("held", "free")
    state, version = _probe(path, group, lambda v, st: v != LEDGER_VERSION and not alt_held)
    if state == "removed":
        _say_version_once(("replaced", path), "quota ledger %s was of format version %d (another ascend_pool build) "
                          "and no live process held it: replaced by a version %d ledger", path, version,
                          LEDGER_VERSION)
    elif state == "held" and version != LEDGER_VERSION:
        _say_version_once(("split", path), "quota ledger %s is of format version %d and live processes of that "
                          "ascend_pool build hold it (a rolling upgrade): this build (format %d) books its tenants in "
                          "%s until they are gone, so meanwhile each tenant's quota holds in each ledger apart (the "
                          "node may grant it twice; ascend_pool_ledger_other_versions counts such ledgers). Finish "
                          "the upgrade (stop that build's processes on the node) to have one ledger again",
                          path, version, LEDGER_VERSION, alt)
        return alt
    return alt if alt_held else path


CHOOSE_LOCK_S = 10.0  # the longest an open waits for another process's choice of ledger (held milliseconds)


@contextlib.contextmanager
def _choosing(path):
    """Held while this process chooses the ledger it books in (_path_for_this_version) and makes
    the chosen file: flock on the ledger's directory, which every process of a build with
    per-version ledgers takes. Without it, a process that chose the per-version ledger while the
    other build's last process ran, but had not made it yet, and one starting after that process
    exited (no per-version ledger yet, the old ledger free: replaced) booked in two ledgers of this
    build, each granting a tenant its whole quota, for as long as either lived. Not waited for past
    CHOOSE_LOCK_S (a stopped process holding it): the choice is then made as before."""
    lock = None
    try:
        try:
            # opened and locked in one compiled step, the lock held by the object: a Ctrl-C landing
            # after the flock and before the yield kept the directory's descriptor open, locked, for
            # the process's life, and every later opening on the node (its own and every other
            # process's) waited CHOOSE_LOCK_S for it
            lock, waited_out = fork_dropped_dir_lock(os.path.dirname(path) or ".", CHOOSE_LOCK_S)
            if lock is None and waited_out:
                log.debug("ledger directory of %s stayed locked %.0f s: choosing without it", path, CHOOSE_LOCK_S)
        except OSError:
            pass  # no directory yet, or no flock there: chosen as before
        yield
    finally:
        if lock is not None:
            lock.close()  # drops the lock (compiled: no signal lands between the close and its record)


def open_ledger(device, backend, directory=None, group=None):
    """This process's Ledger of device (created on first use, validated, then kept). backend: a
    Backend object or its name ("acl", "sim", "cuda"). Raises LedgerError on a foreign or
    malformed file."""
    name = _backend_name(backend)
    gid = ledger_group(group)
    node = node_name(name)
    path = ledger_path(device, name, node, gid, directory)
    _say_if_container_shm(directory)
    with _lock:
        led = _cache.get(path)
        if led is not None and led.path != path and _file_identity(led.path) != led.identity:
            # this process's per-version ledger, removed since (nobody held it): choose again
            del _cache[path]
            _mapped.pop(led.path, None)
            led = None
        if led is not None and not led.usable:
            # a group's ledger that shrank under this process (truncated by another member): its
            # mapping is not used again; contexts opened from now on validate the file anew
            del _cache[path]
            _mapped.pop(led.path, None)
            led = None
        if led is None:
            with _choosing(path):
                use = _path_for_this_version(path, gid)
                led = _cache[path] = Ledger(use, int(device), name, node, gid)
            st = os.stat(use)
            _mapped[use] = (st.st_dev, st.st_ino)
    check_files()
    return led


def check_files():
    """Logs a warning, once per file, for each ledger this process uses whose file was removed
    or replaced since it mapped it (a cleanup of /dev/shm or of the ledger directory): this
    process's tenants stay booked in its copy, and processes started since book in a new file
    apart from them, so each tenant's quota then holds per copy, not node-wide, until this process
    restarts. Returns the paths concerned. Called when a context opens a ledger and by the stats
    publisher at each interval; makes again this process's lease files removed meanwhile
    (identity.renew_leases)."""
    identity.renew_leases()
    out = []
    with _lock:
        mapped = list(_mapped.items())
    for path, ident in mapped:
        try:
            st = os.stat(path)
            same = (st.st_dev, st.st_ino) == ident
        except OSError:
            same = False
        if same:
            continue
        out.append(path)
        if path not in _replaced_logged:
            _replaced_logged.add(path)
            log.warning("quota ledger %s was removed or replaced while this process uses it: its tenants stay "
                        "booked in its own copy and processes started since book apart from them, so their quotas "
                        "hold per copy, not node-wide, until this process restarts", path)
    return out


def other_version_held(path, group=None):
    """The format version of the ledger at path when it is another build's (not this one's) and
    live processes hold it, else None. Reads its first 12 bytes and tests its locks, nothing more."""
    state, version = _probe(path, group, lambda v, st: False)
    return version if state == "held" and version != LEDGER_VERSION else None


def ledger_files(directory=None, uids=(), gids=()):
    """[(path, device, backend, node, group, owner)] of this user's (or group's) ledger files in
    the directory, and of the trusted uids' and gids' private directories there (a node service's
    --allow-uid / --allow-group). owner: the host uid a private ledger belongs to (its name's);
    None for a group ledger, whose group is given as this namespace sees it."""
    gid = ledger_group()
    own = ledger_dir(directory, gid)
    # names hold the host's ids; a group's ledger is opened with its gid as this namespace sees it
    here = {identity.host_gid(g): g for g in set(gids) | ({gid} if gid is not None else set())}
    dirs = {own: ("g", identity.host_gid(gid)) if gid is not None else ("u", identity.host_uid())}
    for path, kind, num in candidates(base_dir(directory), set(uids), set(gids)):
        dirs.setdefault(path, (kind, num))
    out = []
    for d, (dkind, dnum) in sorted(dirs.items()):
        try:
            entries = sorted(os.listdir(d))
        except OSError:
            continue
        for entry in entries:
            m = _NAME.fullmatch(entry)
            if not m:
                continue
            kind, num, backend, node, dev = m.groups()
            if kind != dkind or int(num) != dnum:
                continue  # only the directory's own user's (or group's) ledgers
            out.append((os.path.join(d, entry), int(dev), backend, node or "", here[int(num)] if kind == "g" else None,
                        int(num) if kind == "u" else None))
    return out


def _owner_arg(owner):
    return None if owner in (None, identity.host_uid()) else owner


def _file_identity(path):
    """(st_dev, st_ino) of the file at path (a symlink's own), None when there is none: what tells a
    cached mapping's file from one removed or created anew at the same path."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _open_file(path, device, backend, node, group, owner=None, lock_timeout_s=SWEEP_LOCK_S):
    """The sweep's mapping of the ledger at path: the cached one while the path still names the
    file it maps (st_dev, st_ino) and that file was not truncated, else a new one (a user may
    remove its ledger and a new process create another there). The open (it validates under the
    file's lock, at most lock_timeout_s) runs outside the module lock."""
    ident = _file_identity(path)
    with _lock:
        led = _swept.get(path)
        if led is not None and (not led.usable or led.identity != ident):
            del _swept[path]  # replaced, removed or shrunk: this mapping describes no live ledger
            led = None
    if led is not None or ident is None:
        return led  # None: removed since it was listed (a new one is seen at the next sweep)
    led = Ledger(path, device, backend, node, group, _owner_arg(owner),
                 lock_timeout_ms=max(1, int(lock_timeout_s * 1000)))
    with _lock:
        _swept[path] = led
    return led


def read_view(path, device, backend, node="", group=None, owner=None):
    """The view (as Ledger.view()) of the ledger file at path, read into a private copy: never
    mapped, never locked (ascend_pool._core.read_ledger_view). What the node service exports of
    every ledger, its own and other users': another user may truncate its file (a mapping would
    then be a SIGBUS) or hold its lock (a process stopped inside an update) at any time, and the
    path is read again at each call, so a ledger removed and created again is followed."""
    try:
        path = os.fspath(path)
    except TypeError:
        path = None
    if not isinstance(path, str) or not path or "\0" in path:
        raise LedgerError(f"{path!r} is not a ledger path", kind="argument")
    if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < 2**31:
        raise LedgerError(f"{device!r} is not a device number", kind="argument")
    if not isinstance(backend, str) or not isinstance(node, str):
        raise LedgerError(f"backend and node must be names, got {backend!r} and {node!r}", kind="argument")
    for what, value in (("group", group), ("owner", owner)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32 - 1):
            raise LedgerError(f"{what} {value!r} is not a {'group' if what == 'group' else 'user'} id "
                              f"(0 to {2**32 - 2}, or None)", kind="argument")
    return read_ledger_view(path, device, backend, node, group, _owner_arg(owner))


def _forget_removed(listed):
    """Drops the sweep's mappings (and retry times) of ledgers that are no longer there: a path not
    listed now whose file is gone or is another file. Without this a service kept, for its life,
    one descriptor and one mapping per ledger ever swept and since removed (and the removed
    file's memory, which a mapping keeps allocated); one still there (another directory's, swept
    with other arguments) is kept."""
    with _lock:
        unlisted = [p for p in set(_swept) | set(_retry_at) if p not in listed]
    for path in unlisted:
        ident = _file_identity(path)
        with _lock:
            led = _swept.get(path)
            if led is not None and (ident is None or led.identity != ident):
                del _swept[path]
            if ident is None:
                _retry_at.pop(path, None)


def sweep(directory=None, uids=(), gids=()):
    """Gives back the shares of dead processes in every ledger of this user (or group) in the
    directory, and in those of the trusted uids and gids (see ledger_files): what the node service
    runs periodically. Returns a list of dicts {"path", "device", "slots", "bytes"}; a file that is
    refused is reported with "error" and skipped for RETRY_AFTER_S seconds (then "skipped": True)."""
    out = []
    now = time.monotonic()
    files = ledger_files(directory, uids, gids)
    _forget_removed({f[0] for f in files})
    for path, device, backend, node, group, owner in files:
        with _lock:
            retry = _retry_at.get(path)
        if retry is not None and now < retry:
            out.append({"path": path, "device": device, "slots": 0, "bytes": 0, "skipped": True})
            continue
        try:
            led = _open_file(path, device, backend, node, group, owner)
            if led is None:
                continue
            slots, nbytes = led.sweep(lock_timeout_ms=int(SWEEP_LOCK_S * 1000))
            identity.remove_dead_leases(os.path.dirname(path))
            with _lock:
                _retry_at.pop(path, None)
            out.append({"path": path, "device": device, "slots": slots, "bytes": nbytes})
        except LedgerError as e:
            with _lock:
                _retry_at[path] = time.monotonic() + RETRY_AFTER_S
                if path in _swept and not _swept[path].usable:
                    del _swept[path]
            out.append({"path": path, "device": device, "slots": 0, "bytes": 0, "error": str(e)})
    return out


def view(device=0, backend=None, directory=None):
    """The ledger of device as a dict (see ascend_pool._core.Ledger.view): tenants with quota and
    held bytes node-wide, and process slots. backend: name or object (default: this process's).
    device: this process's number for it; the ledger is the node device's behind it (a container's
    device 0 may be the node's NPU 3), as every process of the node names it."""
    if backend is None:
        backend = open_backend()
    if not isinstance(backend, str):
        device = backend.physical_device(int(device))
    return open_ledger(device, backend, directory).view()

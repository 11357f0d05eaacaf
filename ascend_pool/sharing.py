"""Sharing device memory between the processes of a node: load model weights once, serve them
from many workers.

Exporter (the process that owns the memory):

    ptr = pool.share_malloc(nbytes)            # a block in a segment of its own (whole 2 MiB pages)
    ...  fill it ...
    handle = pool.share(ptr, pids=[w1, w2])    # or any_process=True; picklable SharedHandle
    ...  send `handle` to the workers (pipe, queue, pickle) ...
    pool.share_free(ptr)                       # True: freed; False: freed once importers close

Importer (any process of the same user on the node, allowed by the exporter):

    with ascend_pool.open_shared(handle) as block:   # SharedBlock: block.ptr, block.size
        ...  use block.ptr on block.device ...

Devices are named by the node's number (handle.node_device: ASCEND_RT_VISIBLE_DEVICES and
CUDA_VISIBLE_DEVICES renumber them in each process, and containers see different subsets): an
importer maps the block on its own device of that number, block.device.

Accounting: the shared block is counted once, in the exporting pool's reserved bytes, its limit and
its tenant's quota (a tenant Context that shares 8 GiB holds 8 GiB, however many workers map it).
Importers add nothing to their pool's reservation or quota: their memory_stats() show it as
"shared_imported_bytes". Device memory use stays that of one copy.

Order of closing: importers close before the exporter frees (the runtime's rule). share_free() never
breaks it: while importers still map the block, the release is deferred (share_free returns False)
and completed in the background once they have all closed - or have died: importers are recorded
by their instance id and lease (ascend_pool.identity), never by pid alone, so a killed importer
never pins a block, and processes in different pid namespaces (containers) are told apart. If
the exporter dies, the
importers' next use of the memory fails with the runtime's error (ACL_ERROR_RT_IPC_ERROR 507022 on
the simulator), never a crash; they should close their blocks.

Each shared block has a small record, readable by the node's processes of the same user (0600;
0640 in the directory of $ASCEND_POOL_LEDGER_GROUP, whose members' services list and clean it), in the
user's private directory (ascend_pool.private_dir) inside $ASCEND_POOL_LEDGER_DIR (default /dev/shm):
    ascend_pool-u<uid>/ascend_pool-share-u<uid>-<backend>[-<node>]-<key>
naming the exporter (instance id, pid and pid namespace, tenant), the size, and the importing
processes. It is how the pool knows importers on every backend (CANN's runtime does not report
them), and what shares() lists ("who shares what" on this node). A record whose exporter has died
is removed by the next process that looks (shares(), the node service).

pids: the runtime checks importers by node-level process ids (aclrtIpcMemSetImportPid takes what
aclrtDeviceGetBareTgid returns, the host's tgid inside a container), so `pids=` takes the values
that each importer gets from ascend_pool.node_pid(), never os.getpid().

read_only=True makes the importers' mappings read-only where the runtime can: the simulator maps
them PROT_READ and refuses device writes there (sim.launch_fill: SimError 207006,
ACL_ERROR_RT_NO_PERMISSION, naming the key), while the exporter keeps writing and the importers
read its writes. CANN's and CUDA's IPC calls have no read-only mode (aclrtIpcMemImportByKey and
cudaIpcOpenMemHandle map read-write), so on a real device read_only is the exporter's statement of
intent, carried in the handle and on SharedBlock, and not enforced: SharedBlock.read_only_enforced
says which holds (Backend.has_ipc_read_only).
"""

import atexit
import dataclasses
import errno
import fcntl
import logging
import os
import re
import stat
import struct
import threading
import time
import weakref

from . import identity
from ._core import _share_alloc, check_not_forked
from .api import default_pool
from .backend import open_backend
from .errors import ConfigError, DeviceError, InvalidDeviceError, InvalidPointerError, PoolError
from .pool import Pool, set_sharing
from .private_dir import candidates, is_trusted
from .tenants.ledger import base_dir, ledger_dir, node_name
from .units import as_index

log = logging.getLogger("ascend_pool")

__all__ = ["SharedHandle", "SharedBlock", "SharingError", "NotShareableError", "NotAHandleError", "open_shared", "share_malloc",
           "share", "share_free", "allow", "collect", "shares", "pool_stats", "node_pid"]


def node_pid(backend=None):
    """This process's node-level id (int), the one the runtime's IPC checks know it by: on the acl
    backend aclrtDeviceGetBareTgid (inside a container the host's tgid, not getpid()), on cuda
    getpid(). An importer sends it to the exporter, which passes it in share(ptr, pids=[...]) or
    allow(handle, [...]). backend: name or Backend (default: this process's)."""
    be = backend if hasattr(backend, "node_pid") else open_backend(backend)  # else a name: ConfigError if unknown
    return be.node_pid()


class SharingError(PoolError, RuntimeError):
    """A sharing request cannot be served: the block is not shareable, the handle is no longer
    shared (its exporter released it, closed its pool, or exited), or it belongs to another node,
    backend or user (sharing is between processes of the exporting user). Runtime refusals (e.g. a pid the exporter did not allow: 207006) are DeviceErrors."""


class NotShareableError(SharingError, InvalidPointerError):
    """pool.share(ptr) of a block that cannot be exported: not from pool.share_malloc (exporting
    its segment would expose its neighbours), or inside an expandable (virtual-memory) segment,
    which the runtime's IPC key calls cannot export. The message says which, and what to do."""


class NotAHandleError(SharingError, TypeError):
    """open_shared(h) or allow(h, pids) with `h` not a SharedHandle (what Pool.share() returns):
    an ap.PoolError, as every error of the package (CONTRACT.md), and a TypeError."""


@dataclasses.dataclass(frozen=True)
class SharedHandle:
    """What an importer needs to map a shared block: picklable, safe to send to any process of the
    node (the key is a capability only for processes of the same user the exporter allowed)."""

    device: int         # the device the memory is on, as the exporter numbers it
    size: int           # bytes the exporter asked for
    key: str            # the runtime's key (acl: <= 64 characters)
    read_only: bool     # importers may only read (enforced where Backend.has_ipc_read_only)
    exporter_pid: int
    nbytes: int         # bytes mapped: whole 2 MiB pages
    backend: str        # "acl", "sim" or "cuda": importers must use the same
    node: str           # the simulated node, or the host name: keys are valid on one node only
    exporter_uid: int = None  # its host uid (identity.host_uid): share records are per user, only its processes open it
    node_device: int = None   # the node's number of the device (None: pickled by an earlier version,
    #                           whose record open_shared refuses, naming the versions)

    def local_device(self, backend=None):
        """This process's number of the device the block is on (processes number the node's devices
        after their ASCEND_RT_VISIBLE_DEVICES or CUDA_VISIBLE_DEVICES); InvalidDeviceError when
        this process does not see it. backend: name or Backend (default: this process's)."""
        be = backend if hasattr(backend, "physical_device") else open_backend(backend)
        return _local_device(be, self.device if self.node_device is None else self.node_device)


# ---- the node-wide record of one shared block --------------------------------------------------

_MAGIC = b"APSHARE1"
_VERSION = 3                              # 2: processes named by instance (lease), not pid; 3: node's device
_OPEN, _CLOSING = 1, 2
# magic version state device exporter_pid exporter_instance size nbytes read_only tenant node key
# exporter_pidns exporter_start
_HDR = struct.Struct("<8sIIiiQQQB7x64s64s160sQQ")
_SLOT = struct.Struct("<iIQQQ")           # pid, imports in that process, instance, pidns, start time
_NSLOTS = 256
_REC_SIZE = _HDR.size + _NSLOTS * _SLOT.size
_PREFIX = "ascend_pool-share-"


def _me():
    """This process as a slot: [pid, count, instance, pidns, start]."""
    pid, inst, ns, start = identity.whoami(_record_dir())
    return [pid, 0, inst, ns, start]


def _alive(directory, inst, pid=0, ns=0, start=0, record_fd=-1):
    # By lease: a pid may belong to another namespace. None (cannot tell) counts as alive. A lease
    # file a cleanup removed: by the life lock its process holds on the record (record_fd's file).
    return identity.owner_alive(directory, inst, pid, ns, start, record_fd) is not False


def _node(backend_name):
    """The node keys are valid on: the simulated node's name, else the kernel's boot id, which
    every container of the host shares (their hostnames differ: each pod has its own UTS
    namespace), else "" (not known: _same_node) where /proc does not tell it (no /proc/sys:
    procfs subset=pid, systemd's ProcSubset=pid). The host name it fell back to before is the
    pod's own: such a pod and its neighbours refused each other's handles."""
    sim_node = node_name(backend_name)
    if sim_node:
        return sim_node
    boot = identity.boot_id()
    return f"boot-{boot.hex()}" if any(boot) else ""


def _same_node(theirs, ours):
    """False when two nodes are known to differ; a node not known ("") matches any (the runtime
    refuses a key of another node)."""
    return theirs == ours or not theirs or not ours


def _record_dir():
    return ledger_dir()


def _dir_group(directory):
    """The gid of `directory` when it is a group's private directory (mode 2770: records in it are
    0640, readable by the group's members), else None (a user's own: records 0600)."""
    try:
        st = os.lstat(directory)
    except OSError:
        return None
    return st.st_gid if is_trusted(st, "g", identity.host_gid(st.st_gid)) else None


def _record_path(backend_name, key, node=None):
    node = _node(backend_name) if node is None else node
    suffix = f"-{node}" if backend_name == "sim" else ""
    return os.path.join(_record_dir(), f"{_PREFIX}u{identity.host_uid()}-{backend_name}{suffix}-{key}")


class _Record:
    """One record file, opened; every access under flock (released by the kernel if we die). Its
    descriptor is one a forked child drops (identity.open_dropped): the flock belongs to the open
    file, which a child's copy shares, so a process killed inside an update, or while making the
    record (its temporary file, which a scan removes once unlocked), left it locked while its
    child lived: every other process's access failed after lock_wait_s.

    The lock is waited for at most lock_wait_s seconds: a peer stopped inside its update (SIGSTOP,
    a paused or frozen container) holds it for as long as it stays stopped, and that must be an
    error here, not a hang of the exporter, of other importers or of a metrics scrape (the quota
    ledger bounds its lock the same way)."""

    lock_wait_s = 10.0
    writable = True  # False: another member's record in a group directory, opened to be read
    life_fd = -1     # this process's life lock on the record: its own descriptor (hold_life)

    def __init__(self, path, create=None, owner=None):
        self.path = path
        group = _dir_group(os.path.dirname(path))
        if create is None:
            owner = identity.host_uid() if owner is None else owner  # the host's uid, as names hold it
            try:
                self.fd = identity.open_dropped(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except PermissionError:
                if group is None or owner == identity.host_uid():
                    raise
                # Another member's record (0640): read it, never write it.
                self.fd = identity.open_dropped(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                self.writable = False
            st = os.fstat(self.fd)
            # In a user's directory 0600; in a group's 0600 or 0640 (group-readable), of the group:
            # never writable by anyone but its owner, nor readable by others.
            bad_mode = st.st_mode & (0o077 if group is None else 0o037)
            # In a group's directory another member's record whose owner this user namespace's map
            # leaves out (the overflow uid) goes by its name's uid: the group is what is trusted there.
            owned = identity.owned_by(st.st_uid, owner) or (
                group is not None and owner != identity.host_uid() and identity.owner_host_uid(st.st_uid) is None)
            if (not stat.S_ISREG(st.st_mode) or not owned or bad_mode or st.st_size != _REC_SIZE
                    or (group is not None and st.st_gid != group)):
                identity.close_dropped(self.fd)
                want = "mode 0600" if group is None else f"group {group}, mode 0640 or 0600"
                raise SharingError(f"{path} is not a share record of user {owner} ({want}, {_REC_SIZE} bytes); "
                                   "refusing it")
            return
        mode = 0o600 if group is None else 0o640  # a group's service lists its members' records
        tmp = f"{path}.tmp.{identity.instance_hex()}"  # not the pid: pids repeat across pid namespaces
        self.fd = fd = identity.open_dropped(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                             0o600)
        # Locked until published: an exporter killed here leaves tmp, which a scan removes once
        # nobody holds this lock (identity.remove_dead_leases).
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.hold_life()  # before it is published: never seen without the exporter's proof of life
            if group is not None and os.fstat(fd).st_gid != group:
                os.fchown(fd, -1, group)  # the set-gid directory gives it the group; make sure
            os.fchmod(fd, mode)
            os.pwrite(fd, _HDR.pack(*create) + bytes(_NSLOTS * _SLOT.size), 0)
            os.link(tmp, path)
        except BaseException:
            self.close()
            raise
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass  # a scan took it for a dead exporter's (held past TMP_STALE_S): the record is linked
        fcntl.flock(fd, fcntl.LOCK_UN)  # the record's own lock from now on (every access takes it)

    def hold_life(self):
        """Holds this process's life lock on the record while this object keeps it open: the
        exporter from creation, an importer while it maps the block. Its peers then see it alive
        when its lease file was removed (a /dev/shm cleanup; the lease is made again only at the
        next stats interval, or never with ASCEND_POOL_STATS=0): before 2026-12-05 a listing in
        between removed a live exporter's record for good (its handle "no longer shared"), and an
        exporter dropped a live importer's slot (freeing the block under it)."""
        if self.life_fd < 0:
            self.life_fd = identity.life_open(self.fd)

    def close(self):
        if self.life_fd >= 0:
            identity.life_close(self.life_fd)
            self.life_fd = -1
        if self.fd >= 0:
            identity.close_dropped(self.fd)
            self.fd = -1

    def _lock(self):
        deadline = time.monotonic() + self.lock_wait_s
        pause = 0.001
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise SharingError(f"share record {self.path} stayed locked by another process for "
                                       f"{self.lock_wait_s:g} s (one stopped or frozen inside its update?); "
                                       "nothing was changed, try again") from None
                time.sleep(pause)
                pause = min(pause * 2, 0.05)

    def __enter__(self):
        self._lock()
        data = os.pread(self.fd, _REC_SIZE, 0)
        h = _HDR.unpack_from(data)
        if h[0] != _MAGIC or h[1] != _VERSION:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            if h[0] == _MAGIC:  # an exporter of another ascend_pool version on the node
                raise SharingError(f"{self.path} is a share record of version {h[1]}, this ascend_pool reads "
                                   f"version {_VERSION}: exporter and importers must run the same ascend_pool "
                                   "(re-share the block from a process of this version)")
            raise SharingError(f"{self.path} is a malformed share record")
        self.header = {"state": h[2], "device": h[3], "exporter_pid": h[4], "exporter_instance": h[5],
                       "size": h[6], "nbytes": h[7], "read_only": bool(h[8]),
                       "tenant": h[9].rstrip(b"\0").decode("utf-8", "replace"),
                       "node": h[10].rstrip(b"\0").decode("utf-8", "replace"),
                       "key": h[11].rstrip(b"\0").decode("ascii", "replace"),
                       "exporter_pidns": h[12], "exporter_start": h[13]}
        self.slots = [list(_SLOT.unpack_from(data, _HDR.size + i * _SLOT.size)) for i in range(_NSLOTS)]
        self._orig_state = h[2]
        return self

    def __exit__(self, *exc):
        try:
            if exc[0] is None and self.writable:
                out = bytearray()
                for s in self.slots:
                    out += _SLOT.pack(*s)
                os.pwrite(self.fd, out, _HDR.size)
                if self.header["state"] != self._orig_state:
                    os.pwrite(self.fd, struct.pack("<I", self.header["state"]), 12)
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        return False

    def drop_import(self, instance):
        """One import fewer for process `instance` (its slot freed at the last). Call inside `with`."""
        for s in self.slots:
            if s[0] and s[2] == instance:
                s[1] -= 1
                if s[1] <= 0:
                    s[:] = [0, 0, 0, 0, 0]

    def live_importers(self, instances=False):
        """Pids of importers still alive (dead ones are dropped); with instances, their instance
        ids instead (pids repeat across pid namespaces, instances do not). Call inside `with`."""
        live = []
        d = os.path.dirname(self.path)
        for s in self.slots:
            if s[0] and not _alive(d, s[2], s[0], s[3], s[4], self.fd):
                s[:] = [0, 0, 0, 0, 0]
            elif s[0]:
                live.append(f"{s[2]:016x}" if instances else s[0])
        return live

    def exporter_alive(self):
        h = self.header
        return _alive(os.path.dirname(self.path), h["exporter_instance"], h["exporter_pid"], h["exporter_pidns"],
                      h["exporter_start"], self.fd)


def _unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ---- this process's state ----------------------------------------------------------------------

_lock = threading.RLock()
_exports = {}     # ptr -> _Export, every share_malloc'ed block not yet released
_deferred = []    # _Export released by their owner, waiting for importers
_imports = weakref.WeakSet()  # open SharedBlocks
_collector = None
_COLLECT_PERIOD_S = 0.2
_pid = os.getpid()  # the process this state is of (a child forked from C keeps the parent's)
# This process's runtime imports of each key, oldest first (_KeyImport). CANN maps each import of a
# key at an address of its own and aclrtIpcMemClose(key) closes the process's oldest import of the
# key (IpcCloseMemoryByName: its vaList's front), whichever block the caller closes: so a block
# closed while an older one of the same key is open stays mapped until the older ones are closed
# too, and each runtime close is made for the oldest (docs/sharing.md).
_key_imports = {}
_key_lock = threading.RLock()  # the imports and their order; reentrant: a block's __del__ closes it


class _Export:
    def __init__(self, seg):
        self.seg = seg                 # _core.SharedSegment
        self.pool_ref = weakref.ref(seg.pool)
        self.handle = None
        self.record = None             # _Record once exported
        self.deferred = False
        self.busy = None               # why the last release attempt waited


def _forget_after_fork():
    # The child owns none of the parent's exports or imports: it must neither free nor close them.
    global _lock, _collector, _pid
    _lock = threading.RLock()
    _pid = os.getpid()
    _exports.clear()
    _deferred.clear()
    for b in list(_imports):
        b._forget()
    global _key_lock
    _key_lock = threading.RLock()
    _key_imports.clear()
    _collector = None


os.register_at_fork(after_in_child=_forget_after_fork)


def _check_pool(pool):
    check_not_forked()  # a forked child's pools are its parent's (BackendUnavailableError)
    if not isinstance(pool, Pool):
        raise SharingError(f"pool must be an ascend_pool Pool (or tenant context), got {type(pool).__name__}")
    if pool.closed:
        raise SharingError("this pool is closed")


def _export_of(pool, ptr):
    ex = _exports.get(ptr) if isinstance(ptr, int) else None
    if ex is None or ex.deferred or ex.pool_ref() is not pool:
        if isinstance(ptr, int) and ptr > 0 and pool.segment_kind(ptr) == "expandable":
            raise NotShareableError(
                f"0x{ptr:x} lies in an expandable segment (expandable_segments:true): virtual memory mapped in "
                "chunks, which the runtime's IPC keys cannot export (aclrtIpcMemGetExportKey takes aclrtMalloc "
                "memory only), and whose pages may hold other blocks. Use pool.share_malloc(nbytes): it allocates a "
                "dedicated, page-aligned device segment even in an expandable pool")
        raise NotShareableError(
            f"{ptr!r} is not a shareable block of this pool: share only blocks from pool.share_malloc(), which "
            "gives each a segment of its own (sharing an ordinary block would expose its neighbours' memory)")
    return ex


# ---- exporter ----------------------------------------------------------------------------------

def share_malloc(pool, nbytes):
    """A block of nbytes in a device segment of its own (whole 2 MiB pages), counted in the pool's
    reserved bytes and its tenant's quota; returns its device address. Share it with share(), give
    it back with share_free() (pool.free refuses it)."""
    _check_pool(pool)
    seg = _share_alloc(pool, nbytes)
    with _lock:
        _exports[seg.ptr] = _Export(seg)
    return seg.ptr


def _pid_list(pids, what):
    """pids (an iterable of node-level ids) as a list of ints in 1..2**31-1, each checked before
    anything is exported (ConfigError names the first bad one: the runtime's import list holds
    int32 ids, and a float, a string or a wider int would have been cut to one silently)."""
    if isinstance(pids, (str, bytes)) or not hasattr(pids, "__iter__"):
        raise ConfigError(f"{what}: pids must be a list of node-level process ids (ascend_pool.node_pid()), "
                          f"got {pids!r}")
    out = []
    for pid in pids:
        value = as_index(pid)
        if value is None or not 0 < value < 2 ** 31:
            raise ConfigError(f"{what}: {pid!r} is not a node-level process id (an int from 1 to 2**31-1, "
                              "as ascend_pool.node_pid() returns)")
        out.append(value)
    return out


def share(pool, ptr, read_only=False, pids=(), any_process=False):
    """Exports the share_malloc'ed block at ptr; returns its SharedHandle. Importers must be listed
    (pids: node-level ids from each importer's ascend_pool.node_pid(), or allow() later) unless
    any_process=True (then any process of this user on the node
    that has the handle may map it). read_only=True: importers map it read-only (enforced where
    the runtime can: the simulator; see the module doc). Sharing a block twice returns the same
    handle; asking for the other read_only the second time raises SharingError."""
    _check_pool(pool)
    pids = _pid_list(() if pids is None else pids, "share")
    with _lock:
        ex = _export_of(pool, ptr)
        if ex.handle is not None and ex.handle.read_only != bool(read_only):
            mode = "read-only" if ex.handle.read_only else "read-write"
            raise SharingError(f"block 0x{ptr:x} is already shared {mode} (key {ex.handle.key!r}); importers may "
                               "hold it: share_free it and share a new block to change the mode")
        if ex.handle is None:
            be = pool.backend
            if not be.has_ipc:
                raise SharingError(f"the {be.name} backend cannot share device memory between processes: its runtime "
                                   f"({be.path}) lacks the IPC calls")
            key = ex.seg.export(any_process, bool(read_only))
            node = _node(be.name)
            path = _record_path(be.name, key, node)
            tenant = getattr(pool, "tenant", "default") or "default"
            try:
                me = _me()
                ex.record = _Record(path, create=(_MAGIC, _VERSION, _OPEN, pool.node_device, me[0], me[2], ex.seg.size,
                                                  ex.seg.segment_bytes, int(bool(read_only)), tenant.encode()[:64],
                                                  node.encode()[:64], key.encode(), me[3], me[4]))
            except BaseException as e:
                ex.seg.unexport()  # withdraw the key (nobody can know it yet); the block stays the caller's
                if isinstance(e, OSError) and not isinstance(e, PoolError):
                    raise SharingError(f"cannot write the share record {path}: {e.strerror or e} (a full or "
                                       "read-only /dev/shm, or ASCEND_POOL_LEDGER_DIR?); the block stays yours, "
                                       "unshared") from e
                raise
            ex.handle = SharedHandle(device=pool.device, size=ex.seg.size, key=key, read_only=bool(read_only),
                                     exporter_pid=os.getpid(), nbytes=ex.seg.segment_bytes, backend=be.name,
                                     node=node, exporter_uid=identity.host_uid(), node_device=pool.node_device)
        if pids:
            ex.seg.set_pids(pids)
        return ex.handle


def allow(handle, pids):
    """Exporter: lets the processes `pids` (node-level ids from each importer's
    ascend_pool.node_pid(), never os.getpid()) import the block of `handle` (ACL checks them unless
    the block was shared with any_process=True)."""
    if not isinstance(handle, SharedHandle):
        raise NotAHandleError(f"allow needs a SharedHandle from Pool.share(), got {type(handle).__name__}")
    pids = _pid_list(pids, "allow")
    with _lock:
        for ex in _exports.values():
            if ex.handle == handle and not ex.deferred:
                ex.seg.set_pids(pids)
                return
    raise SharingError(f"key {handle.key!r} is not shared by this process (pid {os.getpid()})")


def _try_release(ex):
    """One attempt to free an export: True when done. Lock held."""
    rec = ex.record
    if ex.seg.is_lost():
        # The runtime freed the block and closed its key (aclFinalize, then perhaps aclInit):
        # forgotten with no runtime call, whoever still maps it (their close is theirs); before,
        # its aclrtFree freed what the new runtime had put at its address, or the key's close
        # failed for ever and its bytes stayed in the pool's reservation and quota.
        ex.seg.release()
        if rec is not None:
            with rec:
                rec.header["state"] = _CLOSING
            _unlink(rec.path)
            rec.close()
            ex.record = None
        return True
    if rec is not None and ex.seg.state == "exported":
        with rec:
            live = rec.live_importers()
            if live:
                ex.busy = f"still imported by pid(s) {', '.join(map(str, live[:8]))}"
                return False
            rec.header["state"] = _CLOSING  # no new import through the pool from here on
    if not ex.seg.release():  # the runtime itself says importers remain (e.g. raw ACL imports)
        ex.busy = ex.seg._last_busy
        return False
    if rec is not None:
        _unlink(rec.path)
        rec.close()
        ex.record = None
    return True


def share_free(pool, ptr):
    """Gives back the share_malloc'ed block at ptr. Returns True when its segment was freed now,
    False when other processes still import it: the key stays valid for them and the segment is
    freed (in the background) once every importer has closed it or died; a new open_shared of the
    key is refused from now on (SharingError: being released). Either way the block is no longer
    the caller's."""
    _check_pool(pool)
    with _lock:
        ex = _export_of(pool, ptr)
        if _try_release(ex):
            _exports.pop(ptr, None)
            return True
        if ex.record is not None:  # the importers it has keep it; no new one may join and keep it longer
            with ex.record:
                ex.record.header["state"] = _CLOSING
        ex.deferred = True
        _deferred.append(ex)
        _start_collector()
        return False


def collect():
    """Completes deferred releases whose importers have all closed; returns how many were freed.
    Runs by itself in the background while any are waiting."""
    freed = 0
    with _lock:
        for ex in list(_deferred):
            try:
                done = _try_release(ex)
            except PoolError as e:  # keep trying the others; this one stays deferred
                ex.busy = str(e)
                done = False
            if done:
                _deferred.remove(ex)
                if _exports.get(ex.seg.ptr) is ex:
                    del _exports[ex.seg.ptr]
                freed += 1
    return freed


def _collector_loop():
    global _collector
    while True:
        time.sleep(_COLLECT_PERIOD_S)
        collect()
        with _lock:
            if not _deferred:
                _collector = None
                return


def _start_collector():
    global _collector
    if _collector is None:
        _collector = threading.Thread(target=_collector_loop, name="ascend_pool-share-collector", daemon=True)
        _collector.start()


def _before_pool_close(pool):
    """Pool.close() calls this first: frees the pool's shared blocks that nobody imports, and
    detaches the others from the pool (they leave its accounting and are freed once their
    importers close)."""
    with _lock:
        for ptr, ex in list(_exports.items()):
            if ex.pool_ref() is not pool or ex.seg.detached:
                continue
            try:
                done = _try_release(ex)
            except PoolError as e:
                ex.busy = str(e)
                done = False
            if done:
                del _exports[ptr]
                if ex in _deferred:
                    _deferred.remove(ex)
                continue
            ex.seg.detach()
            if not ex.deferred:
                ex.deferred = True
                _deferred.append(ex)
        if _deferred:
            _start_collector()


@atexit.register
def _at_exit():
    if os.getpid() != _pid:
        # a child forked from C (no Python fork handler ran): the deferred exports are the parent's,
        # and the parent's collector may have held _lock at the fork (the child hung at exit)
        return
    try:
        collect()
    except Exception:
        pass


# ---- importer ----------------------------------------------------------------------------------

class _KeyImport:
    """One runtime import of a key in this process (one SharedBlock's), listed in _key_imports in
    the runtime's order of imports: aclrtIpcMemClose(key) closes the oldest."""

    __slots__ = ("key", "device", "backend", "record", "life", "released")

    def __init__(self, key, device, backend, record, life):
        self.key = key
        self.device = device
        self.backend = backend
        self.record = record
        self.life = life  # the runtime's life it was made in (Backend.runtime_life)
        self.released = False

    def gone(self, probe=False):
        """Its runtime released it (aclFinalize, then perhaps aclInit): nothing to close there."""
        return self.backend.runtime_life(self.device, probe) != self.life

    def release(self):
        """Marks it closed by its block; returns the imports to close now, oldest first: the
        released ones ahead of the key's oldest import still open (none while an older one is).
        Imports of a released runtime leave the list, closed or not: the runtime has none of them."""
        with _key_lock:
            self.released = True
            imports = _key_imports.get(self.key)
            if not imports or self not in imports:  # not listed: a block made otherwise
                return [self]
            ready = []
            while imports and (imports[0].released or imports[0].gone()):
                e = imports.pop(0)
                if e.released:
                    ready.append(e)
            if not imports:
                del _key_imports[self.key]
            return ready

    def close(self):
        """Closes the oldest import of its key in the runtime (the caller made sure it is its
        turn), then gives up the process's share of the record."""
        try:
            # An import of a runtime that released it (aclFinalize, then perhaps aclInit) went
            # with it: its close raised DeviceError (107000, 100001), and, once this process had
            # imported the key again in the new runtime, would have closed that import.
            if not self.gone(probe=True):
                try:
                    self.backend.ipc_close(self.device, self.key)
                except DeviceError:
                    if not self.gone():  # the failed call itself may have found it
                        raise
        finally:
            rec = self.record
            self.record = None
            if rec is not None:
                try:
                    with rec:
                        rec.drop_import(identity.instance())
                        last = not rec.exporter_alive() and not rec.live_importers()
                    if last:  # the exporter is gone and nobody else maps it: nobody will remove it
                        _unlink(rec.path)
                except (OSError, SharingError):
                    pass
                finally:
                    rec.close()


class SharedBlock:
    """Another process's shared block, mapped into this one: ptr (device address on self.device),
    size and nbytes (bytes), read_only (the exporter's choice), read_only_enforced (the runtime
    refuses writes to it: the simulator; CANN and CUDA cannot), handle. close() unmaps it (also
    on `with` exit); the exporter can only free the block once every importer has closed it."""

    def __init__(self, handle, ptr, pool, backend, record, life=0, entry=None):
        self.handle = handle
        self.ptr = ptr
        self.size = handle.size
        self.nbytes = handle.nbytes
        self.read_only = handle.read_only
        self.read_only_enforced = handle.read_only and backend.has_ipc_read_only
        self.device = pool.device  # this process's number of the device (handle.node_device on the node)
        self._pool_ref = weakref.ref(pool) if pool is not None else (lambda: None)
        self._backend = backend
        self._record = record
        self._life = life  # the runtime's life it was imported in (Backend.runtime_life)
        self._pid = os.getpid()  # the importing process: its slot in the record is its own
        self._entry = entry if entry is not None else _KeyImport(handle.key, pool.device, backend, record, life)
        self.closed = False

    @property
    def exporter_alive(self):
        """False once the exporting process has exited (then every use of the memory fails)."""
        try:
            with self._record as rec:
                return rec.exporter_alive()
        except (OSError, SharingError, ValueError, AttributeError, struct.error):
            return False  # struct.error: a child forked from C, whose copy of the record's descriptor was dropped

    def close(self):
        """Unmaps the block from this process (idempotent)."""
        if self.closed:
            return
        if os.getpid() != self._pid:
            # A child forked from C (no Python fork handler: _forget_after_fork did not run) closing,
            # or dropping, the parent's block: the import and its slot in the record are the
            # parent's (its instance id too). Before, the slot was removed here although the
            # runtime refused the close, and the exporter then freed the block under the parent.
            # The record's descriptors here are copies (the life lock's is /dev/null, fork.c): left
            # open, since closing that one takes identity's lock, which a parent's thread may have
            # held at the fork.
            self.closed = True
            self._record = None
            return
        self.closed = True
        _imports.discard(self)
        self._record = None  # the import's (self._entry), closed with it
        mine = None
        for e in self._entry.release():  # this block's import, when no older one of its key is open
            try:
                e.close()
            except DeviceError as err:
                if e is self._entry:
                    mine = err
        if mine is not None:
            raise mine

    def _runtime_gone(self, probe=False):
        return self._backend.runtime_life(self.device, probe) != self._life

    def _forget(self):
        # fork child: the parent's import is not ours to close
        self.closed = True
        self._entry.record = None  # the same record, closed here
        if self._record is not None:
            self._record.close()
            self._record = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        state = "closed" if self.closed else f"ptr=0x{self.ptr:x}"
        return f"<SharedBlock key={self.handle.key!r} device={self.device} size={self.size} {state}>"


def _check_node_device(node_device):
    if isinstance(node_device, bool) or not isinstance(node_device, int):
        raise InvalidDeviceError(f"the handle's node_device {node_device!r} is not a device number (an edited handle?)")


def _local_device(backend, node_device):
    """This process's number of the node's device node_device (the numbering
    ASCEND_RT_VISIBLE_DEVICES or CUDA_VISIBLE_DEVICES gives each process)."""
    _check_node_device(node_device)
    count = backend.device_count
    for device in range(count):
        if backend.physical_device(device) == node_device:
            return device
    raise InvalidDeviceError(f"the shared block is on the node's device {node_device}, which this process does not "
                             f"see (its {count} devices are the node's "
                             f"{[backend.physical_device(d) for d in range(count)]}: ASCEND_RT_VISIBLE_DEVICES or "
                             "CUDA_VISIBLE_DEVICES)")


def open_shared(handle, pool=None):
    """Maps the shared block of `handle` into this process: a SharedBlock (use `with`, or close()).
    pool: the pool whose stats show the import as shared (default: the device's default pool); its
    reservation and quota are not charged. Raises SharingError when the block is no longer shared or
    belongs to another node/backend/user, NotAHandleError (a SharingError and a TypeError) when
    `handle` is no SharedHandle, DeviceError with the runtime's code when the runtime refuses
    (e.g. 207006: this pid was not allowed by the exporter), BackendUnavailableError (990004) in a
    process forked after its parent opened the runtime (start workers with 'spawn')."""
    if not isinstance(handle, SharedHandle):
        raise NotAHandleError(f"open_shared needs a SharedHandle from Pool.share(), got {type(handle).__name__}")
    node_device = handle.device if handle.node_device is None else handle.node_device
    _check_node_device(node_device)  # with or without a pool: False or 0.0 compared equal to device 0
    if pool is None:
        pool = default_pool(_local_device(open_backend(), node_device))
    _check_pool(pool)
    if pool.node_device != node_device:
        raise InvalidDeviceError(f"the shared block is on the node's device {node_device}, the pool on the node's "
                                 f"device {pool.node_device} (this process's device {pool.device})")
    be = pool.backend
    if be.name != handle.backend:
        raise SharingError(f"the block was shared by the {handle.backend} backend; this pool uses {be.name}")
    if not _same_node(handle.node, _node(be.name)):
        raise SharingError(f"the block was shared on node {handle.node!r}; this process is on {_node(be.name)!r}: "
                           "keys are valid on one node only")
    owner = getattr(handle, "exporter_uid", None)  # None: a handle pickled by an earlier version
    me = identity.host_uid()  # handles carry the exporter's host uid: one user inside and outside a user namespace
    if owner is not None and owner != me:
        raise SharingError(f"key {handle.key!r} was shared by another user (uid {owner}); this process runs as uid "
                           f"{me}: share records and the runtime's IPC keys belong to the exporting user "
                           f"(any_process=True admits any process of that user, not other users), so open it "
                           f"from a process of uid {owner}")
    key = handle.key
    if not isinstance(key, str) or not 0 < len(key) < 256 or not key.isprintable() or "/" in key:
        # a corrupted or forged handle: its key names a file (a NUL was a bare ValueError, 5,000
        # characters a bare OSError, a "/" another directory)
        raise SharingError(f"the handle's key {key!r:.80} is not a key Pool.share() makes (a corrupted or edited "
                           "handle)")
    path = _record_path(be.name, key, handle.node)
    try:
        rec = _Record(path)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            raise SharingError(f"key {handle.key!r} is no longer shared: its exporter (pid {handle.exporter_pid}) "
                               "released it, closed its pool, or exited (or it was shared by another user: "
                               "share records are per user)") from None
        if isinstance(e, PoolError):
            raise
        raise SharingError(f"cannot open the share record {path} of key {handle.key!r}: {e.strerror or e}") from e
    try:
        try:
            mine = _me()
        except OSError as e:
            if isinstance(e, PoolError):
                raise
            raise SharingError(f"cannot make this process's lease in {_record_dir()}: {e.strerror or e} (a full "
                               "or read-only /dev/shm, or ASCEND_POOL_LEDGER_DIR?)") from e
        me = mine[2]
        rec.hold_life()  # before its slot is published, for as long as the block is mapped here
        with rec:
            if rec.header["state"] != _OPEN:
                raise SharingError(f"key {handle.key!r} is being released by its exporter (pid {handle.exporter_pid})")
            h = rec.header  # the exporter's own record: a handle must agree with it (an edited one may not)
            wrong = [f"{k} {getattr(handle, k)!r} (the record says {h[k]!r})"
                     for k in ("size", "nbytes", "exporter_pid", "read_only") if getattr(handle, k) != h[k]]
            if node_device != h["device"]:
                wrong.insert(0, f"the node's device {node_device} (the record says {h['device']})")
            if wrong:
                raise SharingError(f"the handle of key {handle.key!r} does not match its share record: "
                                   f"{', '.join(wrong)}")
            if not rec.exporter_alive():
                raise SharingError(f"the exporter of key {handle.key!r} (pid {handle.exporter_pid}) has exited")
            rec.live_importers()
            slot = next((s for s in rec.slots if s[0] and s[2] == me), None) or \
                next((s for s in rec.slots if not s[0]), None)
            if slot is None:
                raise SharingError(f"key {handle.key!r} already has {_NSLOTS} importing processes")
            if not slot[0] or slot[2] != me:
                slot[:] = mine
            slot[1] += 1
        try:
            try:
                with _key_lock:  # listed in the runtime's order of imports
                    ptr, _ = be.ipc_import(pool.device, handle.key)
                    entry = _KeyImport(handle.key, pool.device, be, rec, be.runtime_life(pool.device))
                    _key_imports.setdefault(handle.key, []).append(entry)
            except DeviceError as e:
                if e.code != _NOT_ALLOWED:
                    raise
                npid = be.node_pid()
                raise DeviceError(e.code, f"{e.message}; this process (node-level id {npid}, not its pid) may import "
                                          f"once the exporter shares with pids=[{npid}] (the importer's "
                                          "ascend_pool.node_pid()), calls sharing.allow(handle, "
                                          f"[{npid}]), or shares with any_process=True") from None
        except BaseException:
            with rec:
                rec.drop_import(me)
            raise
    except BaseException:
        rec.close()
        raise
    block = SharedBlock(handle, ptr, pool, be, rec, entry.life, entry)  # on pool.device
    _imports.add(block)
    return block


# ---- accounting and the node view --------------------------------------------------------------

def pool_stats(pool):
    """Sharing figures of one pool, in bytes (merged into Pool.memory_stats()):
    shared_allocated_bytes (share_malloc'ed blocks, included in reserved_bytes),
    shared_exported_bytes / shared_exported_blocks (of those, exported now),
    shared_deferred_bytes (given back by their owner, waiting for importers to close),
    shared_imported_bytes / shared_imported_blocks (other processes' blocks mapped here: not part
    of this pool's reservation or quota)."""
    alloc = exported = nexported = deferred = imported = nimported = 0
    with _lock:
        for ex in _exports.values():
            if ex.pool_ref() is not pool:
                continue
            if ex.seg.is_lost(probe=False):  # out of the pool's reservation too (its runtime check)
                continue
            if ex.deferred:
                deferred += ex.seg.segment_bytes
                continue
            alloc += ex.seg.segment_bytes
            if ex.seg.state == "exported":
                exported += ex.seg.segment_bytes
                nexported += 1
        for b in list(_imports):
            if not b.closed and b._pool_ref() is pool and not b._runtime_gone():
                imported += b.nbytes
                nimported += 1
    return {"shared_allocated_bytes": alloc, "shared_exported_bytes": exported, "shared_exported_blocks": nexported,
            "shared_deferred_bytes": deferred, "shared_imported_bytes": imported,
            "shared_imported_blocks": nimported}


def _trusted_record_dirs(uids, gids):
    """[(directory, owner uids whose records it may hold)] of the trusted users' and groups'
    private directories in the ledger base directory (what a node service reads)."""
    out = []
    for path, kind, num in candidates(base_dir(), uids, gids):
        out.append((path, {num} if kind == "u" else None))  # a group's directory: any member's records
    return out


_LIST_LOCK_WAIT_S = 0.5
_NOT_ALLOWED = 207006  # ACL_ERROR_RT_NO_PERMISSION: an importer the exporter did not list


def shares(directory=None, uids=None, gids=()):
    """Who shares what on this node: a list of dicts with key, backend, node, device, size, nbytes,
    read_only, tenant, exporter_pid (in its own pid namespace), exporter_instance (16 hex digits,
    unique on the node), exporter_uid, exporter_alive, state ("open" or "closing"), importers
    (live pids, each in its own pid namespace) and importer_instances (theirs, unique on the node). By default this user's records; with uids/gids (a node service), the records in the
    private directories of those users and groups. The records of exporters that have died are
    removed (their memory is gone with them) where this user may, and never listed; records
    other processes keep locked (stopped inside an update) are left out once the listing has
    waited half a second for them in all."""
    if uids is None and not gids:
        dirs = [(directory or _record_dir(), {identity.host_uid()})]
    else:
        dirs = _trusted_record_dirs(uids or (), gids)
        own = directory or _record_dir()
        if all(os.path.realpath(d) != os.path.realpath(own) for d, _ in dirs):
            dirs.append((own, {identity.host_uid()}))
    out = []
    deadline = time.monotonic() + _LIST_LOCK_WAIT_S  # for the whole listing: a scrape stays bounded
    for d, owners in dirs:
        out.extend(_shares_in(d, owners, deadline))
    return out


def _remove_other_version(rec):
    """Removes rec's file when it is another ascend_pool build's record (our magic, another version:
    a rolling upgrade) that nobody holds: its update lock free and no record lock on it (an exporter
    holds its life lock there from creation, an importer while it maps the block: hold_life), so its
    exporter is gone, and its memory with it. Told by the first 12 bytes and the locks, not by the
    other build's layout. Before, every listing failed to read such a record and skipped it, and it
    stayed for good. True when removed."""
    try:
        head = os.pread(rec.fd, 12, 0)
        if len(head) < 12 or head[:8] != _MAGIC or struct.unpack_from("<I", head, 8)[0] == _VERSION:
            return False
        fcntl.flock(rec.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    try:
        if identity.any_lock_held(rec.fd) is not False:
            return False  # its exporter or an importer runs (or it cannot be told): left to them
        st, now = os.fstat(rec.fd), os.stat(rec.path, follow_symlinks=False)
        if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
            return False
        _unlink(rec.path)
    except OSError:
        return False  # gone meanwhile, or a directory where this user may not remove it
    finally:
        fcntl.flock(rec.fd, fcntl.LOCK_UN)
    log.info("removed share record %s of version %d (another ascend_pool build's): nobody holds it, its exporter is "
             "gone", rec.path, struct.unpack_from("<I", head, 8)[0])
    return True


def _shares_in(d, owners, deadline):
    out = []
    for name in sorted(os.listdir(d)):
        m = re.match(rf"{re.escape(_PREFIX)}u(\d+)-", name)
        if not m or ".tmp." in name:
            continue
        uid = int(m.group(1))
        if owners is not None and uid not in owners:
            continue
        prefix = m.group(0)
        try:
            rec = _Record(os.path.join(d, name), owner=uid)
        except (OSError, SharingError):
            continue
        rec.lock_wait_s = max(0.0, deadline - time.monotonic())  # a record held too long is skipped
        if _remove_other_version(rec):
            rec.close()
            continue
        try:
            with rec:
                h = rec.header
                importers = rec.live_importers()
                importer_instances = rec.live_importers(instances=True)
                alive = rec.exporter_alive()
                if not alive:  # stale: nobody can use the memory; its importers' close tolerates this
                    try:
                        _unlink(rec.path)
                    except PermissionError:
                        pass  # a directory where this user may not remove it: left to those who may
        except (OSError, SharingError):
            continue
        finally:
            rec.close()
        if not alive:
            continue
        backend = name[len(prefix):].partition("-")[0]
        out.append({"key": h["key"], "backend": backend, "node": h["node"], "device": h["device"], "size": h["size"], "nbytes": h["nbytes"], "read_only": h["read_only"],
                    "tenant": h["tenant"], "exporter_pid": h["exporter_pid"],
                    "exporter_instance": f"{h['exporter_instance']:016x}", "exporter_uid": uid,
                    "exporter_alive": alive,
                    "state": "open" if h["state"] == _OPEN else "closing", "importers": importers,
                    "importer_instances": importer_instances})
    return out


set_sharing(share_malloc, share, share_free, pool_stats, _before_pool_close)

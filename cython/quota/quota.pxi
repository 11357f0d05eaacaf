# Tenant quotas: the node-wide ledger (C, quota/ledger_*.h) as seen from Python, and the quota
# hook that books a pool's device segments in it.
#
# Ledger: one mapped ledger file of one device (see ledger_format.h for its layout and
# ledger_reserve.h for why reserve/release need no lock). attach_ledger(pool, ...): installs on any
# PoolBase the quota hook (pool.h's ap_quota_hook) that reserves every new segment in the ledger
# before the device call; its Python side is a LedgerQuota (pool.quota_hook). The pool's own close
# path gives the booking back (PoolBase._shut). ascend_pool.tenants.Context uses it. Units are
# bytes throughout.

from libc.stdint cimport uint64_t, uint32_t, int64_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy

import logging as _logging

from ascend_pool import identity as _identity
from ascend_pool.errors import QuotaExceededError
from ascend_pool.errors import LedgerError
from ascend_pool.units import format_bytes as _format_bytes

cdef extern from "pool.h" nogil:
    size_t ap_pool_trim_to(ap_pool *p, size_t target)

cdef extern from "stats.h" nogil:
    enum:
        AP_STAT_RESERVED_BYTES, AP_STAT_ALL

cdef extern from "quota/ledger_reserve.h" nogil:
    uint64_t APL_NO_QUOTA
    uint32_t APL_NO_GROUP
    int APL_TENANTS, APL_SLOTS, APL_NAME_MAX, APL_USED, APL_VERSION
    int APL_OK, APL_E_IO, APL_E_PERM, APL_E_MALFORMED, APL_E_FULL, APL_E_LOCK, APL_E_ARG
    ctypedef struct apl_header:
        uint32_t version, owner_uid, group
        int device
        char backend[16]
        char node[64]
        uint64_t reclaimed_slots, reclaimed_bytes, uncertain_bytes
    int APL_SRC_NONE, APL_SRC_DECLARED, APL_SRC_OPERATOR
    ctypedef struct apl_tenant:
        uint32_t state, warn_ppm
        char name[64]
        uint64_t quota, held, peak, refusals, uncertain, conflicts
        uint32_t quota_src
    ctypedef struct apl_slot:
        uint32_t state
        int pid
        uint64_t instance, pidns, start_time
        uint32_t tenant
        uint64_t held
        int64_t pending
    ctypedef struct apl_file:
        apl_header h
        apl_tenant tenants[64]
        apl_slot slots[1024]
    ctypedef struct apl_ledger:
        apl_file *f
        int fd
        int guarded
        unsigned long st_dev, st_ino
        int device
        char path[4096]
        char dir[4096]
    ctypedef struct apl_handle:
        apl_ledger *L
        int tenant, slot, device
    ctypedef struct apl_refusal:
        int valid, forked, broken
        uint64_t quota, held, bytes
    apl_refusal apl_last_refusal
    int apl_open_as(const char *path, int device, const char *backend, const char *node, uint32_t group,
                    uint32_t owner, apl_ledger **out, char *err, size_t len)
    uint32_t APL_NO_OWNER
    void apl_unref(apl_ledger *L)
    int apl_reclaim(apl_ledger *L, int tenant, uint64_t *nbytes, char *err, size_t len)
    int apl_owner_alive(const char *dir, uint64_t instance, int pid, uint64_t pidns, uint64_t start_time,
                        int ledger_fd)
    void apl_set_identity(uint64_t instance, uint64_t pidns)
    apl_handle *apl_handle_open(apl_ledger *L, const char *name, int set_quota, uint64_t quota, int src,
                                uint32_t stamp, int set_warn, uint32_t warn_ppm, int *conflict, char *err, size_t len, int *kind)
    void apl_handle_close(apl_handle *h)
    int apl_reserve(apl_handle *h, uint64_t nbytes, char *why, size_t why_len)
    int apl_set_quota(apl_ledger *L, int tenant, uint64_t quota, uint32_t warn_ppm, int src, uint32_t stamp,
                      char *err, size_t len)
    int apl_hook_reserve(void *ctx, int device, size_t nbytes, char *why, size_t why_len) noexcept
    void apl_hook_release(void *ctx, int device, size_t nbytes) noexcept
    void apl_hook_terms(void *ctx, int device, size_t *quota, size_t *held) noexcept
    int apl_hook_settle(void *ctx, int device) noexcept
    int apl_take_warn(apl_handle *h)
    int apl_is_broken(apl_ledger *L)
    int apl_read_entries(apl_handle *h, apl_tenant *t, apl_slot *s)
    int apl_set_quota_of(apl_ledger *L, int tenant, uint64_t quota, uint32_t warn_ppm, int src, uint32_t stamp,
                         char *err, size_t len)

cdef extern from "quota/ledger_view.h" nogil:
    ctypedef struct apl_tables:
        apl_tenant tenants[64]
        apl_slot slots[1024]
    int apl_copy_tables(const apl_file *f, apl_tables *out, apl_tables *scratch)

cdef extern from "quota/ledger_reserve.h" nogil:
    int apl_copy_tables_of(apl_ledger *L, apl_header *hdr, apl_tables *out, apl_tables *scratch)

cdef extern from "quota/ledger_foreign.h" nogil:
    int apl_open_as_ms(const char *path, int device, const char *backend, const char *node, uint32_t group,
                       uint32_t owner, int lock_ms, apl_ledger **out, char *err, size_t len)
    int apl_read_copy(const char *path, int device, const char *backend, const char *node, uint32_t group,
                      uint32_t owner, apl_file *out, apl_file *scratch, char *err, size_t len)
    int apl_reclaim_checked(apl_ledger *L, int lock_ms, int guard, uint64_t *nbytes, char *err, size_t len)
    int APL_LOCK_TIMEOUT_MS

LEDGER_TENANTS = APL_TENANTS
_QUOTA_SOURCES = {0: None, 1: "declared", 2: "operator"}
_operator_quota_hook = None  # ascend_pool.tenants registers its reader of the operator's file
_conflicts_logged = set()


cdef _ensure_lease(str directory):
    """Holds this process's lease (ascend_pool.identity) in directory and gives the ledger code its
    identity (the slots it claims are named by it)."""
    try:
        inst = _identity.ensure_lease(directory)
    except OSError as e:
        raise LedgerError(f"cannot create this process's lease in {directory}: {e}", kind="io") from None
    apl_set_identity(inst, _identity.pidns())


def set_operator_quota_hook(fn):
    """fn(tenant, device, device_total_bytes_callable) -> (quota bytes, warn, stamp) or None: the
    quota the operator's tenants file sets, which wins over a process's own declaration, and the
    file's modification time (whole seconds: of two files that disagree, the newer wins) (the
    tenants layer registers it; this layer cannot import it)."""
    global _operator_quota_hook
    _operator_quota_hook = fn


def _log_conflict(str tenant, int device, str text):
    if (tenant, device) in _conflicts_logged:
        return
    _conflicts_logged.add((tenant, device))
    _logging.getLogger("ascend_pool.tenants").warning(
        "tenant %r on device %d: conflicting quota declarations: %s (logged once; counted in "
        "ascend_pool_quota_conflicts_total)", tenant, device, text)
LEDGER_SLOTS = APL_SLOTS
LEDGER_VERSION = APL_VERSION
_LEDGER_ERRLEN = 1024


cdef object _ledger_error(int kind, char *err):
    names = {APL_E_IO: "io", APL_E_PERM: "permission", APL_E_MALFORMED: "malformed", APL_E_FULL: "full",
             APL_E_LOCK: "lock", APL_E_ARG: "argument"}
    return LedgerError(err.decode("utf-8", "replace"), kind=names.get(kind, "io"))


cdef uint64_t _quota_arg(object quota) except? 0:
    if quota is None:
        return APL_NO_QUOTA
    if type(quota) is not int or quota <= 0 or quota >= <object>APL_NO_QUOTA:
        raise ValueError(f"internal: quota must be positive bytes or None, got {quota!r}")
    return <uint64_t>quota


cdef uint32_t _warn_arg(object warn) except? 0:
    if warn is None:
        return 0
    if not 0 < warn <= 1:
        raise ValueError(f"internal: warn must be in (0, 1] or None, got {warn!r}")
    return <uint32_t>round(warn * 1000000)


cdef class Ledger:
    """One device's node-wide quota ledger, mapped by this process.

    Ledger(path, device, backend, node="", group=None, owner=None): opens the file (creating it
    0600, or 0660 for the group gid `group`), and refuses one that is foreign or malformed
    (LedgerError). owner: the uid a private ledger must belong to (default: this user); a node
    service sweeping a trusted user's ledger names it, and such a file is never created.
    lock_timeout_ms: how long the validation at open waits for the file's lock (default 10 s).
    Use ascend_pool.tenants.ledger.open_ledger, which names the file and keeps one per process."""
    cdef apl_ledger *L
    cdef readonly str path
    cdef readonly int device
    cdef readonly object group
    cdef bint _usable
    cdef bint guarded  # a file another user can write (a group's, another user's): read under the SIGBUS guard

    def __cinit__(self, str path, int device, str backend, str node="", group=None, owner=None,
                  lock_timeout_ms=None):
        cdef char err[1024]
        cdef int lock_ms = APL_LOCK_TIMEOUT_MS if lock_timeout_ms is None else max(1, <int>lock_timeout_ms)
        cdef uint32_t g = APL_NO_GROUP if group is None else <uint32_t>group
        cdef uint32_t o = APL_NO_OWNER if owner is None else <uint32_t>owner
        cdef bytes bpath = path.encode(), bbackend = backend.encode(), bnode = node.encode()
        cdef const char *cpath = bpath
        cdef const char *cbackend = bbackend
        cdef const char *cnode = bnode
        cdef int rc
        self.L = NULL
        err[0] = 0
        with nogil:
            rc = apl_open_as_ms(cpath, device, cbackend, cnode, g, o, lock_ms, &self.L, err, sizeof(err))
        if rc != APL_OK:
            raise _ledger_error(rc, err)
        self.path = path
        self.device = device
        self.group = group
        self._usable = True
        self.guarded = self.L.guarded

    @property
    def usable(self):
        """False once the file shrank under this mapping (a guarded access faulted, or a sweep
        found it short): every later use is refused; open the file again."""
        return self._usable and not apl_is_broken(self.L)

    @usable.setter
    def usable(self, value):
        self._usable = bool(value)

    @property
    def is_guarded(self):
        """True for a file another user can write (a group's, another user's): every access to
        its mapping runs under the SIGBUS guard (ledger_guard.h)."""
        return bool(self.guarded)

    def __dealloc__(self):
        if self.L != NULL:
            apl_unref(self.L)
            self.L = NULL

    def sweep(self, lock_timeout_ms=None):
        """Gives back the shares of dead processes (all tenants). Returns (slots, bytes) reclaimed.
        The node service calls this periodically; reserve() also does it before refusing.
        lock_timeout_ms: how long to wait for the file's lock (default 10 s). The file's size is
        checked first, and the mapping of a file another user can write is read under a SIGBUS
        guard (ledger_guard.h): a file its owner truncated raises LedgerError (kind "malformed"),
        and this object must then be dropped (self.usable is False)."""
        cdef char err[1024]
        cdef uint64_t nbytes = 0
        cdef int n
        cdef int lock_ms = APL_LOCK_TIMEOUT_MS if lock_timeout_ms is None else max(1, <int>lock_timeout_ms)
        if not self.usable:
            raise LedgerError(f"ledger {self.path} shrank while mapped; open it again", kind="malformed")
        err[0] = 0
        with nogil:
            n = apl_reclaim_checked(self.L, lock_ms, self.guarded, &nbytes, err, sizeof(err))
        if n == -2:
            self._usable = False
            raise _ledger_error(APL_E_MALFORMED, err)
        if n < 0:
            raise _ledger_error(APL_E_LOCK, err)
        return n, nbytes

    @property
    def identity(self):
        """(st_dev, st_ino) of the file this object maps."""
        return (self.L.st_dev, self.L.st_ino)

    def view(self):
        """A lock-free reading of the ledger (each number exact, the whole a moment's picture):
        {"path", "device", "backend", "node", "owner_uid", "group", "reclaimed_slots",
         "reclaimed_bytes", "uncertain_bytes", "tenants": [...], "slots": [...]}; a tenant is
        {"name", "quota_bytes" (None: no quota), "held_bytes", "peak_bytes", "refusals" (segment
         reservations refused, node-wide: one malloc may be refused up to three times as the pool
         trims its cache and retries),
         "uncertain_bytes", "warn" (ratio or None), "conflicts" (declarations that disagreed with
         the quota in force), "quota_source" (None, "declared" or "operator")}; a slot is {"pid" (in
         its own pid namespace "pidns"), "instance" (16 hex digits), "tenant", "held_bytes",
         "alive" (True, False, or None when it cannot be told: by its lease, never by pid)}."""
        if not self.usable:
            raise LedgerError(f"ledger {self.path} shrank while mapped; open it again", kind="malformed")
        cdef apl_tables *t = <apl_tables *>malloc(2 * sizeof(apl_tables))
        cdef apl_header hdr
        cdef int rc
        if t == NULL:
            raise MemoryError("host memory for a ledger view")
        try:
            with nogil:
                rc = apl_copy_tables_of(self.L, &hdr, &t[0], &t[1])  # one moment's picture (ledger_view.h)
            if rc < 0:
                self._usable = False
                raise LedgerError(f"ledger {self.path} shrank while mapped; open it again", kind="malformed")
            return _view_dict(&hdr, t, self.L.dir, self.path, self.L.fd)
        finally:
            free(t)

    def tenant(self, str name):
        """The view of one tenant (dict as in view()), or None."""
        for t in self.view()["tenants"]:
            if t["name"] == name:
                return t
        return None


cdef dict _view_dict(apl_header *h, apl_tables *t, const char *dir, str path, int fd):
    """Ledger.view()'s dict from a copy of the tables (t[0]) and the header. fd: a descriptor of the
    ledger file (-1 none), where live slot owners hold their life locks (proc_identity.h)."""
    cdef int i
    tenants = []
    for i in range(APL_TENANTS):
        if t[0].tenants[i].state != APL_USED:
            continue
        q = t[0].tenants[i].quota
        w = t[0].tenants[i].warn_ppm
        tenants.append({
            "name": t[0].tenants[i].name.decode("ascii", "replace"),
            "quota_bytes": None if q == APL_NO_QUOTA else q,
            "held_bytes": t[0].tenants[i].held, "peak_bytes": t[0].tenants[i].peak,
            "refusals": t[0].tenants[i].refusals, "uncertain_bytes": t[0].tenants[i].uncertain,
            "warn": w / 1e6 if w else None, "index": i,
            "conflicts": t[0].tenants[i].conflicts,
            "quota_source": _QUOTA_SOURCES.get(t[0].tenants[i].quota_src),
        })
    names = {x["index"]: x["name"] for x in tenants}
    slots = []
    for i in range(APL_SLOTS):
        if t[0].slots[i].state != APL_USED:
            continue
        alive = apl_owner_alive(dir, t[0].slots[i].instance, t[0].slots[i].pid,
                                t[0].slots[i].pidns, t[0].slots[i].start_time, fd)
        slots.append({"pid": t[0].slots[i].pid, "instance": f"{t[0].slots[i].instance:016x}",
                      "pidns": t[0].slots[i].pidns, "tenant": names.get(t[0].slots[i].tenant, "?"),
                      "held_bytes": t[0].slots[i].held, "pending_bytes": t[0].slots[i].pending,
                      "alive": None if alive < 0 else bool(alive), "index": i})
    return {
        "path": path, "device": h.device, "backend": h.backend.decode("ascii", "replace"),
        "node": h.node.decode("ascii", "replace"),
        "owner_uid": h.owner_uid, "group": None if h.group == APL_NO_GROUP else h.group,
        "reclaimed_slots": h.reclaimed_slots, "reclaimed_bytes": h.reclaimed_bytes,
        "uncertain_bytes": h.uncertain_bytes, "tenants": tenants, "slots": slots,
    }


def read_ledger_view(str path, int device, str backend, str node="", group=None, owner=None):
    """Ledger(...).view() of the file at path, read into a private copy with pread (never mapped,
    never locked; ledger_foreign.h): what a node service reads of other users' ledgers, which
    their owners may truncate (a mapping would then be a SIGBUS) or keep locked (a process
    stopped inside an update). The file is checked as an open checks it; LedgerError else."""
    cdef char err[1024]
    cdef uint32_t g = APL_NO_GROUP if group is None else <uint32_t>group
    cdef uint32_t o = APL_NO_OWNER if owner is None else <uint32_t>owner
    cdef bytes bpath = path.encode(), bbackend = backend.encode(), bnode = node.encode()
    cdef bytes bdir = (_os.path.dirname(path) or ".").encode()
    cdef const char *cpath = bpath
    cdef const char *cbackend = bbackend
    cdef const char *cnode = bnode
    cdef int rc
    cdef apl_file *f = <apl_file *>malloc(2 * sizeof(apl_file))
    cdef apl_tables *t = <apl_tables *>malloc(sizeof(apl_tables))
    if f == NULL or t == NULL:
        free(f)
        free(t)
        raise MemoryError("host memory for a ledger view")
    try:
        err[0] = 0
        if len(bbackend) >= 16 or len(bnode) >= 64 or len(bpath) >= 4000:
            raise LedgerError(f"ledger {path}: backend, node or path name too long", kind="argument")
        with nogil:
            rc = apl_read_copy(cpath, device, cbackend, cnode, g, o, &f[0], &f[1], err, sizeof(err))
        if rc != APL_OK:
            raise _ledger_error(rc, err)
        memcpy(t.tenants, f[0].tenants, sizeof(t.tenants))
        memcpy(t.slots, f[0].slots, sizeof(t.slots))
        try:  # only to test the slot owners' life locks (proc_identity.h); never mapped nor locked
            fd = _os.open(path, _os.O_RDONLY | _os.O_NOFOLLOW | _os.O_NONBLOCK | _os.O_CLOEXEC)
        except OSError:
            fd = -1
        try:
            return _view_dict(&f[0].h, t, bdir, path, fd)
        finally:
            if fd >= 0:
                _os.close(fd)
    finally:
        free(f)
        free(t)


cdef void _close_ledger_handle(void *ctx) noexcept nogil:
    # The hook's close (PoolBase._shut calls it after destroying the pool): gives the slot back.
    apl_handle_close(<apl_handle *>ctx)


cdef inline apl_handle *_handle_of(PoolBase pool):
    """The pool's ledger handle, NULL when it has none or is closed."""
    return <apl_handle *>pool._quota.ctx if pool.quota_hook is not None else NULL


def attach_ledger(PoolBase pool, Ledger ledger, str tenant, quota, warn, bint set_quota=True):
    """Joins `tenant` in ledger (claims a slot), books the segments pool already holds (the
    `reserve` knob's preallocation) and installs the quota hook on pool. quota: bytes or None
    (with set_quota False: keep the node's value for a live tenant)."""
    pool._check()
    if pool.quota_hook is not None:
        raise PoolError("this pool is already attached to a tenant")
    _ensure_lease(ledger.L.dir.decode())  # the slot is named by this process's lease
    cdef int src = APL_SRC_DECLARED
    cdef uint32_t stamp = 0
    # The operator's file names the node's devices (ledger.device: the NPU behind pool.device).
    op = _operator_quota_hook(tenant, ledger.device, lambda: pool.backend.mem_info(pool.device)[1]) \
        if _operator_quota_hook is not None else None
    if op is not None:  # the operator's tenants file names this tenant's quota: it wins
        if set_quota and quota != op[0]:
            _log_conflict(tenant, pool.device, f"this process declared {quota} bytes, the tenants file "
                                               f"sets {op[0]} bytes, which applies")
        quota, warn, set_quota, src = op[0], (op[1] if op[1] is not None else warn), True, APL_SRC_OPERATOR
        stamp = op[2]  # the file's age: of two operator files, the newer wins (ledger_slots.h)
    cdef char err[1024]
    cdef int kind = 0, conflict = 0
    cdef bytes bname = tenant.encode()
    cdef const char *cname = bname
    cdef uint64_t q = _quota_arg(quota)
    cdef uint32_t w = _warn_arg(warn)
    cdef bint sw = set_quota and warn is not None
    cdef bint sq = set_quota
    cdef apl_handle *h
    cdef apl_tenant te
    cdef apl_slot se
    with nogil:
        h = apl_handle_open(ledger.L, cname, sq, q, src, stamp, sw, w, &conflict, err, sizeof(err), &kind)
    if h == NULL:
        raise _ledger_error(kind, err)
    cdef ap_stats st
    cdef uint64_t held
    cdef int rc = 0
    cdef ap_quota_hook hook
    cdef bint attached = False
    try:  # the slot goes back on any way out before the hook holds it (a Ctrl-C in the log call)
        if conflict:
            now = te.quota if apl_read_entries(h, &te, &se) == 0 else APL_NO_QUOTA
            declared = 'no quota' if quota is None else f"{quota} bytes"
            rule = ("a tenants file wins over declarations; of two tenants files the newer, of two "
                    "declarations the stricter")
            if conflict == 2:
                _log_conflict(tenant, pool.device, f"this process declared {declared}, which replaced the quota in "
                                                   f"force ({rule})")
            else:
                _log_conflict(tenant, pool.device, f"this process declared {declared}, the quota in force is "
                              f"{'none' if now == APL_NO_QUOTA else now} bytes, which stays ({rule})")
        owner = LedgerQuota(ledger, tenant)
        with nogil:
            ap_pool_get_stats(pool.p, &st)
            held = <uint64_t>st.s[AP_STAT_RESERVED_BYTES][AP_STAT_ALL].current
            if held:
                rc = apl_reserve(h, held, err, sizeof(err))
        if rc != 0:
            with nogil:
                apl_handle_close(h)  # before the refusal reads the ledger: this process holds no slot
            h = NULL
            raise owner.refusal(pool, held, None, "the preallocated reserve")
        hook.ctx = <void *>h
        hook.reserve = apl_hook_reserve
        hook.release = apl_hook_release
        hook.terms = apl_hook_terms
        hook.settle = apl_hook_settle
        pool._attach_quota(&hook, _close_ledger_handle, owner)
        attached = True
    finally:
        if not attached and h != NULL:
            with nogil:
                apl_handle_close(h)


def pool_trim_to(PoolBase pool, size_t target):
    """Releases pool's cached free segments until reserved <= target bytes (never live blocks);
    returns the bytes released."""
    pool._check()
    cdef size_t released
    cdef ap_pool *_p = pool._enter()
    with nogil:
        released = ap_pool_trim_to(_p, target)
    pool._leave()
    return released


cdef class LedgerQuota:
    """The Python side of a pool's quota hook booked in a tenant's node-wide ledger entry
    (pool.quota_hook after attach_ledger): its state, quota changes and error messages. The C
    side (the ledger handle) belongs to the pool, which gives it back when it closes."""
    cdef readonly Ledger ledger
    cdef readonly str tenant

    def __cinit__(self, Ledger ledger, str tenant):
        self.ledger = ledger
        self.tenant = tenant

    def set_quota(self, PoolBase pool, quota, warn):
        """Stores the tenant's quota (bytes or None) and warn ratio (or None) node-wide, if it may:
        the quota the operator's tenants file sets always applies; a process's own change applies
        when it lowers the quota, or when no other live process of the tenant relies on it and the
        operator did not set it. Otherwise the quota in force stays, the conflict is logged once and
        counted, and False is returned (True: applied)."""
        cdef apl_handle *h
        cdef int src = APL_SRC_DECLARED
        cdef uint32_t stamp = 0
        cdef char err[1024]
        cdef apl_tenant te
        cdef apl_slot se
        cdef uint64_t now = APL_NO_QUOTA
        # Counted busy throughout: the operator's hook below runs Python (other threads run
        # meanwhile), and a close() of the pool then waits for this call before it gives the
        # ledger handle back (it was freed under apl_set_quota: a crash, or a hang on its lock).
        pool._enter()
        try:
            if _handle_of(pool) == NULL:
                raise PoolError("this pool is not attached to a tenant")
            op = _operator_quota_hook(self.tenant, self.ledger.device, lambda: pool.backend.mem_info(pool.device)[1]) \
                if _operator_quota_hook is not None else None
            if op is not None and op[0] == quota:
                src = APL_SRC_OPERATOR  # e.g. a reload of the tenants file
                stamp = op[2]
            h = _handle_of(pool)  # NULL once a close began: refused as a closed pool's call
            if h == NULL:
                raise PoolError("this pool is closed")
            rc = apl_set_quota_of(h.L, h.tenant, _quota_arg(quota), _warn_arg(warn), src, stamp, err, sizeof(err))
            if rc > 0 and apl_read_entries(h, &te, &se) == 0:  # the handle lives while the pool is held
                now = te.quota
        finally:
            pool._leave()
        if rc == -2:  # a group's ledger that another member truncated (ledger_reserve.h)
            raise _ledger_error(APL_E_MALFORMED, err)
        if rc < 0:
            raise _ledger_error(APL_E_LOCK, err)
        if rc:
            _log_conflict(self.tenant, pool.device, f"this process asked for {'no quota' if quota is None else quota} "
                          f"(bytes), the quota in force is {'none' if now == APL_NO_QUOTA else now} bytes, which "
                          "other processes rely on (or the operator set): it stays")
        return rc == 0

    def state(self, PoolBase pool):
        """pool's tenant as the ledger sees it now: dict with quota_bytes (None: no quota),
        held_bytes (node-wide), slot_bytes (booked by this pool), peak_bytes, refusals,
        uncertain_bytes, warn (ratio or None). None once the pool is closed, or once the
        ledger is broken (a group's ledger that shrank under this process: self.ledger.usable is
        False)."""
        cdef apl_handle *h = _handle_of(pool)
        if h == NULL:
            return None
        cdef apl_tenant te
        cdef apl_slot se
        if apl_read_entries(h, &te, &se) != 0:  # copies, read under the SIGBUS guard where needed
            return None
        q = te.quota
        w = te.warn_ppm
        return {"quota_bytes": None if q == APL_NO_QUOTA else q, "held_bytes": te.held,
                "slot_bytes": se.held, "peak_bytes": te.peak,
                "refusals": te.refusals, "uncertain_bytes": te.uncertain,
                "warn": w / 1e6 if w else None, "conflicts": te.conflicts,
                "quota_source": _QUOTA_SOURCES.get(te.quota_src)}

    def after_growth(self, PoolBase pool):
        """Called by pool.malloc after a miss: runs pool._quota_warn() once each time the pool's
        growth took the tenant past its warn level."""
        cdef apl_handle *h = _handle_of(pool)
        if h != NULL and apl_take_warn(h):
            pool._quota_warn()

    def refusal(self, PoolBase pool, uint64_t requested, object pool_message, str what):
        """The QuotaExceededError for the refusal the calling thread just saw."""
        cdef apl_refusal r = apl_last_refusal
        name = self.tenant
        if r.valid and r.broken:  # a group's ledger truncated under this process (ledger_reserve.h)
            e = LedgerError(f"tenant {name!r} on device {pool.device}: ledger {self.ledger.path} shrank while this "
                            f"process used it (truncated by another process that can write it); {requested} bytes "
                            f"({what}) refused: this process no longer books in that file, so its contexts there "
                            f"get no new device memory (open a new context once the file is whole again)",
                            kind="malformed")
            e.tenant = name
            e.device = pool.device
            e.requested = requested
            e.path = self.ledger.path
            return e
        if r.valid and r.forked:
            e = QuotaExceededError(f"tenant {name!r} on device {pool.device}: this context belongs to another "
                                   f"process (created before a fork); create contexts in the child")
            quota = held = None
        else:
            quota = None if r.quota == APL_NO_QUOTA else r.quota
            held = r.held
            qtext = "none" if quota is None else f"{quota} bytes ({_format_bytes(quota)})"
            msg = (f"tenant {name!r} is over its quota on device {pool.device}: quota {qtext}, held {held} bytes "
                   f"({_format_bytes(held)}) node-wide, requested {requested} bytes ({what}; growing needs "
                   f"{r.bytes} more bytes of device segments, after releasing this context's cached segments)")
            if pool_message:  # the pool's own figures; its "Cause:" repeats what msg says
                msg += ". " + pool_message.split(" Cause: ")[0]
            e = QuotaExceededError(msg)
        e.tenant = name
        e.device = pool.device
        e.quota = quota
        e.held = held
        e.requested = requested
        e.segment_bytes = r.bytes if r.valid else None
        return e

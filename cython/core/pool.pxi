# The caching pool's Python face: a thin cdef class over the C pool (cython/core/pool.c).
# The cached path runs under the GIL with a try-lock (no GIL release/reacquire, ~20 ns saved);
# everything that may block or call the device releases the GIL.

from libc.stdint cimport uintptr_t, int64_t, int8_t, int32_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport malloc as c_malloc, free as c_free
from cpython.long cimport PyLong_AsVoidPtr, PyLong_FromVoidPtr
from cpython.exc cimport PyErr_Occurred, PyErr_Clear

import numbers as _numbers
import os as _os
import sys
import time as _time

from ascend_pool.errors import InvalidSizeError, InvalidPointerError, InvalidStreamError, PoolError, ConfigError
import ascend_pool.errors as _errors_module
from ascend_pool.config import history_settings, history_skip_mask

# The package's directory (with its separator): frames in it are skipped when stacks are recorded.
_PACKAGE_DIR = _os.path.join(_os.path.dirname(_os.path.abspath(_errors_module.__file__)), "")

cdef extern from "py_finalizing.h":
    int ap_py_finalizing()

cdef extern from "pool.h" nogil:
    enum:  # (the statuses AP_OK, AP_E_* are declared in errors.pxi)
        AP_RELEASE_NEVER, AP_RELEASE_UNDER_PEAK, AP_RELEASE_BUDGETED, AP_REUSE_BORROW, AP_REUSE_TIED
    size_t AP_NO_LIMIT
    ctypedef struct ap_error:
        int status
        int device_code
        char message[768]
    ctypedef struct ap_config:
        size_t pad_bytes, min_block, small_size, small_segment, page_size, min_large_segment, large_segment
        size_t large_split_min, max_split_size, limit_bytes, reserve_bytes, history_capacity
        double gc_threshold
        int release_policy, expandable, stream_reuse, sync_timeout_ms
        unsigned roundup_divisions[16]
        int roundup_power2
    ctypedef struct ap_pool:
        pass
    void ap_pool_ptr_clear(ap_pool **slot)
    ctypedef struct ap_quota_hook:
        void *ctx
        int (*reserve)(void *ctx, int device, size_t bytes, char *why, size_t why_len) noexcept nogil
        void (*release)(void *ctx, int device, size_t bytes) noexcept nogil
        void (*terms)(void *ctx, int device, size_t *quota, size_t *held) noexcept nogil
        int (*settle)(void *ctx, int device) noexcept nogil
    void ap_pool_set_quota_hook(ap_pool *p, const ap_quota_hook *hook)
    void ap_config_default(ap_config *c)
    ap_pool *ap_pool_create(ap_backend *backend, int device, const ap_config *cfg, ap_error *err)
    void ap_pool_destroy_ex(ap_pool *p, int wait_streams)
    int ap_pool_malloc(ap_pool *p, size_t size, void *stream, void **out, ap_error *err)
    int ap_pool_free(ap_pool *p, void *ptr, void *stream, int how, ap_error *err)
    int ap_pool_try_malloc(ap_pool *p, size_t size, void *stream, void **out)
    int ap_pool_try_free(ap_pool *p, void *ptr)
    int ap_pool_record_stream(ap_pool *p, void *ptr, void *stream, ap_error *err)
    int ap_pool_erase_stream(ap_pool *p, void *ptr, void *stream, ap_error *err)
    int ap_pool_empty_cache(ap_pool *p, ap_error *err)
    int ap_pool_empty_stream(ap_pool *p, void *stream, ap_error *err)
    int ap_pool_synchronize(ap_pool *p, void *stream, ap_error *err)
    int ap_pool_synchronize_device(ap_pool *p, int device_wait, ap_error *err)
    int ap_pool_release_stream(ap_pool *p, void *stream, ap_error *err)
    size_t ap_pool_release_idle(ap_pool *p)
    int64_t ap_pool_active_blocks(ap_pool *p)
    int ap_pool_work_queued(ap_pool *p)
    void ap_pool_set_orphan(ap_pool *p)
    int ap_pool_knows_stream(ap_pool *p, void *stream)
    int ap_pool_stream_idle(ap_pool *p, void *stream)
    void ap_pool_forget_stream(ap_pool *p, void *stream)
    void ap_pool_set_limit(ap_pool *p, size_t limit_bytes)
    void ap_pool_set_tunables(ap_pool *p, size_t max_split_size, double gc_threshold, const unsigned *divisions)
    size_t ap_pool_get_limit(ap_pool *p)
    int ap_pool_join_device_cap(ap_pool *p, int owner)
    void ap_pool_set_mempool(ap_pool *p, int keeps_idle, int lends, int no_split, uint64_t family)
    int ap_pool_borrows(const ap_pool *p)
    int64_t ap_pool_stop_lending(ap_pool *q, int64_t *bytes)
    int64_t ap_pool_free_unlent(ap_pool *q, int64_t *bytes)
    void ap_pool_reset_peaks(ap_pool *p)
    void ap_pool_hold_lock(ap_pool *p, double seconds)
    int ap_pool_check(ap_pool *p, char *msg, size_t len)
    int ap_pool_block_info(ap_pool *p, void *ptr, uintptr_t *base, size_t *size, size_t *requested)
    int ap_pool_block_ctx(ap_pool *p, void *ptr, uint64_t *ctx)
    int ap_pool_segment_expandable(ap_pool *p, void *ptr)
    size_t ap_pool_round_size(const ap_pool *p, size_t size)
    ctypedef struct ap_snap_block:
        uintptr_t addr
        size_t size, requested
        int state
        uint64_t ctx
    ctypedef struct ap_snap_segment:
        uintptr_t base
        size_t size
        int pool
        int expandable
        void *stream
        uint64_t ctx
        size_t first_block, n_blocks
    ctypedef struct ap_history_entry:
        uint8_t action
        uint32_t meta
        uintptr_t addr
        size_t size
        void *stream
        int64_t time_us
        uint64_t ctx
    ctypedef struct ap_snapshot:
        ap_snap_segment *segments
        size_t n_segments
        ap_snap_block *blocks
        size_t n_blocks
        ap_history_entry *history
        size_t n_history
    int ap_pool_snapshot(ap_pool *p, ap_snapshot *out)
    void ap_snapshot_free(ap_snapshot *s)
    size_t ap_pool_count_free_blocks(ap_pool *p)
    size_t ap_pool_history_copy(ap_pool *p, ap_history_entry **out)
    int ap_pool_set_history(ap_pool *p, size_t capacity, uint32_t skip)
    void ap_history_set_ctx(uint64_t ctx)
    void ap_history_set_meta(uint32_t meta)

cdef extern from "stats.h" nogil:
    ctypedef struct ap_stat:
        int64_t current, peak, freed
    ctypedef struct ap_stats:
        ap_stat s[9][3]
        ap_stat oversize[2]
        int64_t num_alloc_retries, num_ooms, num_sync_all_streams, num_device_alloc, num_device_free
        int64_t num_device_map, num_device_unmap
        int64_t num_quota_exceeded, num_oom_rejections, events_created, stream_migrations, pending_free_bytes
        int64_t pending_free_blocks, largest_free_block, cached_free_bytes
        int64_t device_free_bytes, device_total_bytes
    void ap_pool_get_stats(ap_pool *p, ap_stats *out)
    int ap_pool_get_stats_within(ap_pool *p, ap_stats *out, int wait_ms)

cdef extern from "replay.h" nogil:
    enum:
        AP_REPLAY_POOL, AP_REPLAY_DIRECT
    ctypedef struct ap_replay_result:
        int64_t allocs, frees
        double seconds
        int64_t peak_live_bytes, peak_reserved_bytes, device_mallocs, device_frees
        int64_t device_calls_steady, final_allocated_bytes, failed_index
        double fragmentation_at_peak
        ap_error error
    int ap_replay(ap_pool *p, ap_backend *b, int device, int mode, const int8_t *op, const int32_t *slot,
                  const int64_t *size, const int32_t *stream, size_t n, void **streams, void **ptrs,
                  size_t n_slots, ap_replay_result *r)

_STAT_NAMES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
               "active_bytes", "inactive_split_bytes", "requested_bytes")
_STAT_TYPES = ("all", "small_pool", "large_pool")
_CONFIG_FIELDS = ("pad_bytes", "min_block", "small_size", "small_segment", "page_size", "min_large_segment", "large_segment",
                  "large_split_min", "max_split_size", "limit_bytes", "reserve_bytes", "history_capacity",
                  "gc_threshold", "release_policy", "expandable", "stream_reuse",
                  "sync_timeout_ms", "roundup_divisions")
NO_LIMIT = AP_NO_LIMIT
cdef uint64_t _next_ctx = 0  # context ids of recorded Python stacks (process-wide, under the GIL)
# Distinct call stacks a pool keeps at least, whatever its ring size: live blocks keep their
# allocation's id after the ring has moved on (a few KiB each at most).
_MIN_STACKS = 1024
RELEASE_POLICIES = {"never": AP_RELEASE_NEVER, "under_peak": AP_RELEASE_UNDER_PEAK, "budgeted": AP_RELEASE_BUDGETED}
STREAM_REUSE = {"borrow": AP_REUSE_BORROW, "tied": AP_REUSE_TIED}
BLOCK_STATES = ("inactive", "active_allocated", "active_pending_free")


def config_defaults():
    """ap_config_default's value of each field Pool._open takes, in knobs_to_config's form (bytes;
    release_policy and stream_reuse by name; roundup_divisions a list): what an open pool has for
    a field its knobs did not set."""
    cdef ap_config c
    ap_config_default(&c)
    policies = {v: k for k, v in RELEASE_POLICIES.items()}
    reuses = {v: k for k, v in STREAM_REUSE.items()}
    return {"pad_bytes": c.pad_bytes, "min_block": c.min_block, "small_size": c.small_size,
            "small_segment": c.small_segment, "page_size": c.page_size, "min_large_segment": c.min_large_segment,
            "large_segment": c.large_segment, "large_split_min": c.large_split_min,
            "max_split_size": c.max_split_size, "limit_bytes": c.limit_bytes, "reserve_bytes": c.reserve_bytes,
            "history_capacity": c.history_capacity, "gc_threshold": c.gc_threshold,
            "release_policy": policies[c.release_policy], "expandable": c.expandable,
            "stream_reuse": reuses[c.stream_reuse], "sync_timeout_ms": c.sync_timeout_ms,
            "roundup_divisions": [c.roundup_divisions[i] for i in range(16)]}


cdef object _raise(ap_error *err, int status):
    """Raises the typed exception for a failed pool call (errors.pxi's map)."""
    raise _c_error(status, err.device_code, err.message.decode("utf-8", "replace"), "pool call")


cdef inline size_t _as_size(object nbytes, bint request=False) except? 0:
    """nbytes as a C size, else InvalidSizeError. request (a device allocation's size): from 2**63
    to 2**64-1 too (a size_t, CuPy's and torch's size; no ssize_t holds it), which the pool refuses
    as every size past the device, an OutOfMemoryError (torch's "more than 1EB"), not as a bad
    argument; past 2**64 no C size holds it: InvalidSizeError."""
    cdef Py_ssize_t n
    if type(nbytes) is not int:
        if isinstance(nbytes, bool) or not hasattr(nbytes, "__index__"):
            raise InvalidSizeError(f"size must be an integer number of bytes, got {type(nbytes).__name__} {nbytes!r}")
        try:
            nbytes = nbytes.__index__()
        except TypeError:  # an object whose __index__ refuses, e.g. a numpy array of several items
            raise InvalidSizeError(f"size must be an integer number of bytes, got {type(nbytes).__name__} {nbytes!r}") from None
    try:
        n = nbytes
    except OverflowError:
        if nbytes < 0:  # below any ssize_t: a negative size, not a large one
            raise InvalidSizeError(f"size must be positive, got {nbytes} bytes") from None
        if request and nbytes < 2**64:
            return <size_t>nbytes
        raise InvalidSizeError(f"size {nbytes} bytes is larger than any device") from None
    if n <= 0:
        raise InvalidSizeError(f"size must be positive, got {n} bytes")
    return <size_t>n


cdef extern from "Python.h":
    # Declared here without an exception value, so that the error of an int too large is ours
    # to clear (cpython.long's declaration would report it as unraisable in a noexcept function).
    void *_long_as_void_ptr "PyLong_AsVoidPtr"(object v)


cdef inline void *_long_to_ptr(object ptr) noexcept:
    """The address in an int, or NULL (error cleared) when it does not fit."""
    cdef void *p = _long_as_void_ptr(ptr)
    if PyErr_Occurred():
        PyErr_Clear()
        return NULL
    return p


cdef inline void *_as_ptr(object ptr) except? NULL:
    cdef void *p = NULL
    if type(ptr) is int:
        p = _long_to_ptr(ptr)
    elif type(ptr) is not bool and hasattr(type(ptr), "__index__"):  # numpy integers, as sizes are
        try:
            p = _long_to_ptr(ptr.__index__())
        except TypeError:  # an __index__ that refuses (numpy.array([1, 2])): not an address
            p = NULL
    if p == NULL or <Py_ssize_t>p < 0:  # PyLong_AsVoidPtr maps negatives onto high addresses
        raise InvalidPointerError(f"pointer must be a positive integer device address, got {ptr!r}")
    return p


def _stream_handle(stream):
    """A stream argument that is not an int: its value as one when it is an integer (a numpy
    integer), else StreamTypeError naming it (a list or an array made a bare TypeError)."""
    if type(stream) is not bool and hasattr(type(stream), "__index__"):
        try:
            return type(stream).__index__(stream)
        except TypeError:  # an array of several values, say
            pass
    raise _errors_module.StreamTypeError(f"stream must be None, 0 (the default stream) or an int stream handle, "
                                         f"got {stream!r}")


cdef extern from "current.h" nogil:
    uint64_t AP_NO_TICKET
    int AP_TICKETS
    uint64_t ap_ticket_open(const char *label)
    void ap_ticket_close(uint64_t ticket)
    ctypedef struct ap_current_token:
        ap_pool *pool
        uint64_t ticket
        ap_pool *owner
        uint64_t owner_ticket
    void ap_current_set(int device, ap_pool *p, uint64_t ticket, int mem_pool, ap_current_token *prev)
    void ap_current_restore(int device, const ap_current_token *t)
    void ap_default_set(int device, ap_pool *p)
    void ap_current_forget(ap_pool *p)


# Gives a quota hook's ctx back once its pool is destroyed (PoolBase._attach_quota).
ctypedef void (*ap_quota_close_fn)(void *ctx) noexcept nogil


cimport cython


# no_gc_clear: the garbage collector must not drop `backend` before __dealloc__ destroys the C pool
# through it. A pool in a garbage cycle (every open one at the interpreter's teardown: an orphan of
# a pool dropped with blocks allocated) had its Backend freed by the generated tp_clear, then its
# dealloc read the freed backend (ap_pool_destroy_ex -> ap_backend_life: heap-use-after-free).
# Cycles through a pool are still broken by their other members (its __dict__, frames, lists).
@cython.no_gc_clear
cdef class PoolBase:
    """The compiled pool of one device. Use ascend_pool.Pool, which adds the Python conveniences.

    Lifecycle, one path for every kind of pool (Pool, tenant contexts): _open creates the C pool,
    takes a ticket (core/current.h) and registers it with the C ABI; close() and __dealloc__ both
    end in _shut, which hides the pool from every thread first and then destroys it. A tenant's
    quota is not a subclass but a hook attached with _attach_quota (quota/quota.pxi)."""
    cdef ap_pool *p
    cdef readonly Backend backend
    cdef readonly int device
    cdef readonly dict config
    cdef dict _streams    # stream handles this pool knows (created here or registered) -> their add's serial
    cdef uint64_t _adds   # serials of those adds: a handle added anew (the runtime reuses handles) has a new one
    cdef set _created     # those create_stream made: destroyed at close when idle
    cdef bint _closing    # close() listed _created: create_stream adds none from now on
    cdef Py_ssize_t _prune_at  # _streams size at which handles of destroyed streams are looked for
    cdef int _busy        # calls running with the GIL released (close() waits for them)
    cdef uint64_t _ticket  # liveness seen by threads that made this pool current (core/current.h)
    cdef ap_quota_hook _quota  # the quota hook installed on the C pool (all NULL: none)
    cdef ap_quota_close_fn _quota_close  # gives _quota.ctx back once the pool is gone
    cdef readonly object quota_hook  # the hook's Python side (messages, state); None without a quota
    cdef readonly object _stack_frames  # {context id: Python frames} once stacks were recorded, else None
    cdef object _stack_ids              # {call stack: its context id}, least recently used first
    cdef Py_ssize_t _stack_cap          # most distinct call stacks kept
    cdef bint _stacks_on                # the frames of allocations are recorded now
    cdef readonly bint _free_frames     # and those of frees and empty_cache (torch's context "all")
    cdef readonly bint _entry_frames    # trace entries show frames (context "alloc" or "all"; "state": blocks only)

    def __cinit__(self, *args, **kwargs):
        self.p = NULL
        self._ticket = AP_NO_TICKET

    def _open(self, Backend backend, int device, dict config, str label="pool"):
        """Creates the C pool (called once by ascend_pool.Pool.__init__). label names it in the
        C ABI's messages (e.g. "tenant context 'online'")."""
        cdef ap_config cfg
        if self.p != NULL:
            raise PoolError("pool already open")
        cdef ap_error err
        ap_config_default(&cfg)
        for key, value in config.items():
            if key not in _CONFIG_FIELDS:
                raise PoolError(f"internal: unknown pool field {key!r}")
            if key == "pad_bytes": cfg.pad_bytes = value
            elif key == "min_block": cfg.min_block = value
            elif key == "small_size": cfg.small_size = value
            elif key == "small_segment": cfg.small_segment = value
            elif key == "page_size": cfg.page_size = value
            elif key == "min_large_segment": cfg.min_large_segment = value
            elif key == "large_segment": cfg.large_segment = value
            elif key == "large_split_min": cfg.large_split_min = value
            elif key == "max_split_size": cfg.max_split_size = value
            elif key == "limit_bytes": cfg.limit_bytes = value
            elif key == "reserve_bytes": cfg.reserve_bytes = value
            elif key == "history_capacity": cfg.history_capacity = value
            elif key == "gc_threshold": cfg.gc_threshold = value
            elif key == "release_policy": cfg.release_policy = RELEASE_POLICIES[value]
            elif key == "stream_reuse": cfg.stream_reuse = STREAM_REUSE[value]
            elif key == "expandable": cfg.expandable = value
            elif key == "sync_timeout_ms": cfg.sync_timeout_ms = value
            elif key == "roundup_divisions":  # 16 intervals (config.py checked them)
                for i in range(16):
                    cfg.roundup_divisions[i] = value[i]
                cfg.roundup_power2 = any(v > 1 for v in value)
        self.backend = backend
        self.device = device
        self.config = dict(config)
        self._streams = {}
        self._created = set()
        self._closing = False  # opened again (Pool.__init__, after a settings change) after a close
        self._prune_at = 64
        with nogil:
            self.p = ap_pool_create(backend.b, device, &cfg, &err)
        if self.p == NULL:
            _raise(&err, err.status)
        self._ticket = ap_ticket_open(label.encode("utf-8", "replace"))
        if self._ticket == AP_NO_TICKET:
            self._shut(False)
            raise PoolError(f"too many pools open in this process (at most {AP_TICKETS}); close some first")
        _capi_register(self)  # the C ABI finds pointers of every live pool (capi/capi.pxi)

    cdef int _attach_quota(self, const ap_quota_hook *hook, ap_quota_close_fn close, object owner) except -1:
        """Installs a quota hook on the C pool (quota/quota.pxi attaches a tenant's ledger
        booking this way). close(hook.ctx) runs once the pool is destroyed; owner is the hook's
        Python side (pool.quota_hook)."""
        self._check()
        if self._quota_close != NULL:
            raise PoolError("this pool already has a quota hook")
        self._quota = hook[0]
        self._quota_close = close
        self.quota_hook = owner
        with nogil:
            ap_pool_set_quota_hook(self.p, hook)
        return 0

    cdef void _shut(self, bint wait) noexcept:
        """The one way a pool closes (close() with wait, __dealloc__ without): first hidden from
        every thread (its ticket, the default slot, the C ABI's registry), then, once the calls
        in flight are done, destroyed, and its quota hook's booking given back. In a child forked
        from the process that opened it, the pool is the parent's: forgotten, never touched (its
        locks may be held forever, its memory and quota booking are not this process's)."""
        cdef ap_pool *p = self.p
        cdef void *qctx = self._quota.ctx
        cdef ap_quota_close_fn qclose = self._quota_close
        # Claimed before anything that may let the GIL go (the stack table below, the waits): a
        # second _shut on another thread (the orphan reaper's close and the finalizer's) finds
        # NULL and destroys nothing, and new Python calls and the C ABI's lookups no longer see it.
        ap_pool_ptr_clear(&self.p)
        self._quota_close = NULL
        self._quota.ctx = NULL
        # Collected by the interpreter's teardown: the process is going (its runtime context with
        # it), so no stream wait (each pool waited sync_timeout_ms on a hung collective's stream
        # in turn). A close() the program makes, in an atexit handler too, waits.
        cdef int wait_streams = 0 if not wait and ap_py_finalizing() else 1
        if p != NULL:
            try:
                _capi_stacks_on(p, None)
            except BaseException:      # at interpreter teardown the module's tables may be gone:
                pass                   # the pool is still hidden and destroyed below
        if ap_forked_from:
            return
        ap_ticket_close(self._ticket)  # every thread's `with` entry for it is stale from now on
        if p != NULL:
            ap_current_forget(p)       # nor is it a default any more
        _capi_unregister(&self.p)      # waits for registry lookups in flight (they hold its lock)
        if wait:
            while self._busy:
                _time.sleep(0.0005)    # releases the GIL so that those calls can finish
        with nogil:
            if p != NULL:
                if qclose != NULL:
                    ap_pool_set_quota_hook(p, NULL)  # the booking goes back whole, below
                ap_pool_destroy_ex(p, wait_streams)  # every segment back to the device
            if qclose != NULL:
                qclose(qctx)

    cdef int _stream_idle(self, handle) except -2:
        """What the runtime says of `handle` now, without waiting (ap_pool_stream_idle): 1 its
        queued work is done, 0 not yet (or out of reach), -1 it no longer knows the stream."""
        cdef void *s = PyLong_AsVoidPtr(handle)
        cdef ap_pool *_p = self._enter()
        cdef int idle
        with nogil:  # takes the pool lock (the lock table: never with the GIL held); never waits
            idle = ap_pool_stream_idle(_p, s)
        self._leave()
        return idle

    def close(self):
        """Returns all device memory of this pool (live blocks included) and closes it, with the
        streams create_stream made that have no work queued (a busy one is left to the runtime,
        not destroyed). Blocks freed stream-ordered go back to the device once the work queued on
        their streams is done: waited for, all streams within one sync_timeout_ms, past which
        they are given back anyway. Waits for calls other Python threads are making on it;
        later calls raise PoolError. In a forked child, only forgets the parent's pool."""
        self._destroy_own_streams()
        self._shut(True)

    def _destroy_own_streams(self):
        """close()'s first step: the streams create_stream made that have no work queued are
        destroyed (a busy one, or one another pool uses, is left)."""
        cdef int idle
        cdef bint elsewhere
        if self.p != NULL and not ap_forked_from:
            # Before the list is made: a create_stream on another thread (which made its stream
            # with the GIL released) then destroys its stream itself instead of adding it here.
            self._closing = True
            try:
                for handle in list(self._created):
                    serial = self._streams.get(handle)
                    idle = self._stream_idle(handle)
                    elsewhere = idle > 0 and self._stream_used_elsewhere(handle)
                    # Both asked with the GIL released: if another thread destroyed this stream
                    # through the pool meanwhile, the runtime may have given its handle to a stream
                    # registered since, which is not ours to destroy (its add has a new serial).
                    if handle not in self._created or self._streams.get(handle) != serial:
                        continue
                    try:
                        if elsewhere:
                            self._created.discard(handle)  # another pool orders work on it: it stays
                        elif idle > 0:
                            self.destroy_stream(handle)
                        elif idle < 0:  # destroyed behind our back: nothing to destroy; the backend
                            # gives the stream's device reference back when this pool gives its device
                            # back (acl: acl_device_release asks the device's streams), no lock held
                            self._created.discard(handle)
                    except PoolError:  # the runtime refused: the close goes on
                        self._created.discard(handle)
            except BaseException:  # interrupted: the pool stays open, and makes streams again
                self._closing = False
                raise

    def _stop_lending(self):
        """Stops this use_on_oom pool lending its free blocks (ap_pool_stop_lending) and returns
        (blocks, bytes) it lent that are still allocated."""
        cdef ap_pool *_p = self._enter()
        cdef int64_t n, nbytes
        with nogil:
            n = ap_pool_stop_lending(_p, &nbytes)
        self._leave()
        return n, nbytes

    def _free_unlent(self):
        """Frees the allocated blocks that were not lent, each on its allocation stream
        (ap_pool_free_unlent): (blocks, bytes) freed."""
        cdef ap_pool *_p = self._enter()
        cdef int64_t n, nbytes
        with nogil:
            n = ap_pool_free_unlent(_p, &nbytes)
        self._leave()
        if n < 0:
            raise MemoryError("host memory exhausted while closing the pool")
        return n, nbytes

    def _hand_over(self, PoolBase heir, list keep):
        """Moves the open C pool to heir (a new, never opened object of this class) and closes
        this one to its user: its calls raise PoolError, threads inside `with` it no longer
        allocate from it (its ticket closed; heir takes none). heir is appended to keep (the
        registry's orphans) once open and before this object lets the pool go, and the C ABI's
        registry names heir first: a free on another thread finds the pool all along. No Python
        code runs between the last wait below and the hand-over (no other thread's close of this
        pool makes a second heir, and no call enters this object meanwhile). False when this pool
        was closed already (nothing done). Waits first for the calls in flight on this object
        (they counted themselves here, not on heir: heir, reaped once the lent blocks are freed,
        destroyed the pool under a _stop_lending still walking it, ASan's use-after-free in
        test_threads_free_lent_blocks_while_the_lender_closes)."""
        while self._busy and self.p != NULL:
            _time.sleep(0.0005)        # releases the GIL so that those calls can finish
        if self.p == NULL:
            return False
        self._check()
        if heir.p != NULL:
            raise PoolError("internal: heir already open")
        cdef ap_pool *p = self.p
        heir.backend, heir.device, heir.config = self.backend, self.device, self.config
        heir._streams, heir._adds, heir._created, heir._prune_at = self._streams, self._adds, set(), self._prune_at
        heir._quota, heir._quota_close, heir.quota_hook = self._quota, self._quota_close, self.quota_hook
        heir._stack_frames, heir._stack_ids, heir._stack_cap = self._stack_frames, self._stack_ids, self._stack_cap
        heir._stacks_on, heir._free_frames, heir._entry_frames = self._stacks_on, self._free_frames, self._entry_frames
        heir.p = p
        _capi_register(heir)
        keep.append(heir)
        if self._stacks_on:
            _capi_stacks_on(p, None)
            _capi_stacks_on(p, heir)
        ap_pool_ptr_clear(&self.p)
        self._quota_close = NULL
        self._quota.ctx = NULL
        ap_ticket_close(self._ticket)
        self._ticket = AP_NO_TICKET
        ap_current_forget(p)  # no thread's current or default pool any more
        _capi_unregister(&self.p)
        return True

    def __dealloc__(self):
        self._shut(False)

    def _close_as_dropped(self):
        """Closes the pool as its object's death does (no stream destroyed, no sharing step), but
        waiting for calls other threads are making on it (an orphan reaper's read): for
        Pool.__del__ when nothing is allocated, so that a finalizer of its garbage cycle that
        resurrects it finds it closed (PoolError) instead of an open pool that its dealloc (a
        finalizer runs once) would close later under the blocks allocated since."""
        self._shut(True)

    @property
    def closed(self):
        return self.p == NULL

    cdef inline int _check(self) except -1:
        # The guard of every call: closed, or inherited by a forked child (whose runtime is not
        # this process's, and whose locks may be held forever): refused before touching the pool.
        if self.p == NULL:
            raise PoolError("this pool is closed")
        if ap_forked_from:
            _raise_forked()
        return 0

    cdef inline ap_pool *_enter(self) except NULL:
        # Counted under the GIL, so that close() (which also holds it) never frees the pool
        # while another thread is inside a call that released the GIL.
        if self.p == NULL:
            ap_history_set_ctx(0)  # frames noted for a call refused here must not reach the thread's next one
        self._check()
        self._busy += 1
        return self.p

    cdef inline void _leave(self) noexcept:
        self._busy -= 1

    cdef inline void *_stream(self, object stream) except? NULL:
        if stream is None:
            return NULL
        if type(stream) is not int:  # a numpy integer handle, as sizes and pointers take; else named
            stream = _stream_handle(stream)
        if stream == 0:  # the null handle: the default stream, as CUDA's and ACL's
            return NULL
        if stream not in self._streams and not self._adopt_stream(stream):
            raise InvalidStreamError(f"stream {stream!r} is not a live stream of this pool (device {self.device}); "
                                     "use pool.create_stream() or pool.register_stream(handle)")
        return PyLong_AsVoidPtr(stream)

    def _adopt_stream(self, stream):
        """A stream this pool does not know yet: True when it may be used here anyway (registered
        then). The compiled pool knows no other pool; ascend_pool.Pool looks at the open ones."""
        return False

    def _another_devices_stream(self, stream):
        """True when stream is a live stream of another device's pool (record_stream takes it).
        The compiled pool knows no other pool; ascend_pool.Pool looks at the open ones."""
        return False

    def _knows_stream(self, stream):
        """True when stream was made or registered here (and not destroyed through this pool)."""
        return stream in self._streams

    def malloc(self, nbytes, stream=None):
        """Allocates nbytes (int, bytes) of device memory ordered on stream (None: default
        stream). Returns the device address as an int."""
        self._check()
        cdef ap_pool *_p
        cdef size_t n = _as_size(nbytes, True)
        cdef void *s = self._stream(stream) if stream is not None else NULL
        cdef void *out = NULL
        cdef ap_error err
        cdef int rc
        # Again: converting the size or adopting the stream ran Python code (an __index__, the
        # peers' lookup), during which another thread may have closed the pool. Nothing but C runs
        # from here to the call, so no close can come between.
        self._check()
        if ap_pool_try_malloc(self.p, n, s, &out) == AP_OK:
            return PyLong_FromVoidPtr(out)
        if self._stacks_on:
            self._note_frames()  # before the pool lock: no GIL work under it
        _p = self._enter()
        with nogil:
            rc = ap_pool_malloc(_p, n, s, &out, &err)
            ap_history_set_ctx(0)
        figures = _pool_oom_figures(_p) if rc != AP_OK and apc_oom_watched(rc) else None
        self._leave()
        if figures is not None:  # torch's out-of-memory observers, before the error (oom_observers.pxi)
            _notify_oom_observers(self.device, n, *figures)
        if rc == AP_E_QUOTA and self.quota_hook is not None:  # the hook's own, richer error
            raise self.quota_hook.refusal(self, n, err.message.decode("utf-8", "replace"), "this allocation")
        if rc != AP_OK:
            _raise(&err, rc)
        if self.quota_hook is not None:  # a miss may have grown the pool: the hook may warn
            self.quota_hook.after_growth(self)
        return PyLong_FromVoidPtr(out)

    def free(self, ptr, stream=None):
        """Frees ptr. Ordered on stream when given (the block is reusable at once by that stream,
        by others once its queued work is done); else on the stream it was allocated on."""
        self._check()
        cdef ap_pool *_p
        cdef void *p = _as_ptr(ptr)
        cdef void *s = NULL
        cdef ap_error err
        cdef int rc
        if stream is None:
            self._check()  # again: _as_ptr may have run Python code (malloc says why)
            if ap_pool_try_free(self.p, p) == AP_OK:
                return
            if self._free_frames:
                self._note_frames()
            _p = self._enter()
            with nogil:
                rc = ap_pool_free(_p, p, NULL, 1, &err)
                ap_history_set_ctx(0)
            self._leave()
        else:
            s = self._stream(stream)
            if self._free_frames:
                self._note_frames()
            _p = self._enter()
            with nogil:
                rc = ap_pool_free(_p, p, s, 0, &err)
                ap_history_set_ctx(0)
            self._leave()
        if rc == AP_E_INVALID_PTR:
            lender = self._by_lender(ptr, "free", stream)
            if lender is not None:  # a use_on_oom MemPool's block it lent this pool's request
                self._lent_freed(lender)
                return
        if rc != AP_OK:
            _raise(&err, rc)

    def _by_lender(self, ptr, call, stream):
        """Makes `call` (free, record_stream) of ptr on the pool that lent it, returned; None when
        no pool lent it. A lender closed meanwhile left its open pool to an orphan: asked again."""
        for _ in range(3):
            lender = self._lender_of(ptr)
            if lender is None:
                return None
            try:
                getattr(lender, call)(ptr, stream)
            except PoolError:
                if not lender.closed:
                    raise
                continue
            return lender
        return None

    def _lender_of(self, ptr):
        """The pool whose free block served this pool's allocation at ptr (torch's use_on_oom:
        ap_pool_lend, for the default pool only), else None; asked on the error path alone."""
        if self.closed or not ap_pool_borrows(self.p):
            return None
        return self._lending_peer(ptr)

    def _lending_peer(self, ptr):
        return None  # the compiled pool knows no other pool; ascend_pool.Pool looks at the open ones

    def _lent_freed(self, lender):
        pass  # ascend_pool.Pool closes a closed lender's orphan once its last lent block is back

    def record_stream(self, ptr, stream):
        """Marks ptr as used by stream: after its free, the block is not reused anywhere until the
        work queued on stream before the free has completed. stream may be another device's (one
        of its pools made or registered it: a peer's kernel reading the block), as torch allows."""
        self._check()
        cdef ap_pool *_p
        cdef void *p = _as_ptr(ptr)
        cdef void *s
        if stream is not None and type(stream) is not int:
            stream = _stream_handle(stream)  # a numpy integer handle; else StreamTypeError
        if type(stream) is int and stream not in self._streams and self._another_devices_stream(stream):
            s = PyLong_AsVoidPtr(stream)
        else:
            s = self._stream(stream)
        cdef ap_error err
        cdef int rc
        _p = self._enter()
        with nogil:
            rc = ap_pool_record_stream(_p, p, s, &err)
        self._leave()
        if rc == AP_E_INVALID_PTR:
            if self._by_lender(ptr, "record_stream", stream) is not None:
                return
        if rc != AP_OK:
            _raise(&err, rc)

    def erase_stream(self, ptr, stream):
        """Undoes record_stream(ptr, stream), as torch_npu.erase_stream: the live block's free no
        longer waits for the work queued on stream (the caller ordered it, or knows it is done).
        A stream it was not marked with, its allocation stream included, changes nothing, one
        this pool does not know too (destroyed since, never registered), as the C hook's."""
        self._check()
        cdef ap_pool *_p
        cdef void *p = _as_ptr(ptr)
        cdef void *s
        if stream is not None and type(stream) is not int:
            stream = _stream_handle(stream)  # a numpy integer handle; else StreamTypeError
        if type(stream) is int and stream not in self._streams and (
                self._another_devices_stream(stream) or (0 < stream < 2**64 and not self._adopt_stream(stream))):
            # Matched by handle in C, nothing asked of the runtime: another device's stream, or one
            # unknown here, which holds no mark but by handle (InvalidStreamError before, where
            # torch_npu's erase_stream and the C hook change nothing)
            s = PyLong_AsVoidPtr(stream)
        else:
            s = self._stream(stream)
        cdef ap_error err
        cdef int rc
        _p = self._enter()
        with nogil:
            rc = ap_pool_erase_stream(_p, p, s, &err)
        self._leave()
        if rc == AP_E_INVALID_PTR:
            if self._by_lender(ptr, "erase_stream", stream) is not None:
                return
        if rc != AP_OK:
            _raise(&err, rc)

    def empty_cache(self):
        """Returns every unused cached segment to the device (waits for pending frees first)."""
        self._check()
        cdef ap_pool *_p
        cdef ap_error err
        cdef int rc
        if self._free_frames:
            self._note_frames()  # torch's context "all": the segment_free entries carry the caller's frames
        _p = self._enter()
        with nogil:
            rc = ap_pool_empty_cache(_p, &err)
            ap_history_set_ctx(0)
        self._leave()
        if rc != AP_OK:
            _raise(&err, rc)

    def create_stream(self):
        """Creates a device stream on this pool's device; returns its handle (int). PoolError once
        the pool is closed, by another thread too while the stream was made (then destroyed)."""
        self._check()
        handle = self.backend.stream_create(self.device)  # the GIL released: close() may run
        if self.p == NULL or self._closing:
            # close() made its list of streams to destroy meanwhile: this one is not in it, and
            # would outlive the pool with its device reference
            try:
                self.backend.stream_destroy(handle)
            except PoolError as e:
                raise PoolError(f"this pool is closed (closed while stream {handle:#x} was made, "
                                f"which could not be destroyed: {e})") from None
            raise PoolError("this pool is closed")
        self._add_stream(handle)
        self._created.add(handle)
        self._prune_streams()
        return handle

    cdef _add_stream(self, handle):
        self._adds += 1
        self._streams[handle] = self._adds

    cdef _prune_streams(self):
        # A framework may destroy the streams it got here or registered with the runtime, never
        # telling the pool: their handles were kept for the process's life (memory without bound).
        # Asked when the set has doubled, so each new stream costs O(1) questions on average.
        if len(self._streams) >= self._prune_at:
            self._forget_destroyed_streams()
            self._prune_at = max(64, 2 * len(self._streams))

    def register_stream(self, handle):
        """Lets this pool order frees on a stream created elsewhere (int handle: a pointer)."""
        self._check()
        if type(handle) is not int and type(handle) is not bool and hasattr(type(handle), "__index__"):
            handle = _stream_handle(handle)  # a numpy integer handle, as every other stream argument
        if type(handle) is not int or not 0 < handle <= <uintptr_t>-1:
            raise InvalidStreamError(f"stream handle must be a positive int that fits a pointer, got {handle!r}")
        serial = self._streams.get(handle)
        dev = self.backend.stream_device(handle)  # None: the runtime cannot tell
        if dev is not None and dev != self.device:
            # Ours was destroyed: the runtime gave its handle away. Asked with the GIL released: a
            # stream made or registered here meanwhile that got the handle anew stays (new serial).
            if serial is not None and self._streams.get(handle) == serial:
                self._forget_stream(handle)
            raise InvalidStreamError(f"stream {handle:#x} belongs to device {dev}, not to this pool's "
                                     f"device {self.device}")
        self._add_stream(handle)
        self._prune_streams()

    def _forget_stream(self, handle):
        """Drops a stream the runtime said is gone: its handle no longer reaches this pool, and
        its cached blocks serve every stream, once the runtime says so again under the pool's
        lock (a stream made with the handle since keeps its blocks)."""
        self._streams.pop(handle, None)
        self._created.discard(handle)
        cdef void *s = PyLong_AsVoidPtr(handle)
        cdef ap_pool *_p = self._enter()
        with nogil:
            ap_pool_forget_stream(_p, s)
        self._leave()

    def _join_device_cap(self, bint owner=False):
        """Counts this pool's device memory under its device's memory fraction (ap_device_cap in
        core/pool.h); owner: its own limit is that fraction (the device's default pool)."""
        cdef ap_pool *_p = self._enter()
        with nogil:
            ap_pool_join_device_cap(_p, owner)
        self._leave()

    def _set_mempool(self, bint keeps_idle, bint lends, bint no_split, unsigned long long family):
        """torch's MemPool(use_on_oom=, no_split=) and the pool's family (ap_pool_set_mempool):
        keeps_idle, its idle cache stays its own when another pool runs out of memory; lends
        (use_on_oom), the default pool's refused request takes a free block of it in place; no_split,
        no block is split; family (a plain pool's serial number), whose members take each other's
        idle cache on device out-of-memory even when they keep it from other pools."""
        cdef ap_pool *_p = self._enter()
        with nogil:
            ap_pool_set_mempool(_p, keeps_idle, lends, no_split, family)
        self._leave()

    def _release_idle(self):
        """Returns the wholly free segments no stream's work holds to the device, without waiting
        (an orphan's cache: nothing allocates from it again). Bytes released."""
        cdef ap_pool *_p = self._enter()
        cdef size_t n
        with nogil:
            n = ap_pool_release_idle(_p)
        self._leave()
        return n

    def _active_blocks(self):
        """active.all.current of _raw_stats (blocks allocated, or freed and waiting for a stream's
        work), without building its dict nor asking the device's free memory:
        registry.reap_orphans asks it of every dropped pool at each module-level free, pool open
        and empty_cache, where _raw_stats' 16 us made a process with 1,000 dropped pools holding a
        block pay 32 ms per call."""
        self._check()
        cdef ap_pool *_p = self._enter()
        cdef int64_t n
        with nogil:
            n = ap_pool_active_blocks(_p)
        self._leave()
        return n

    def _work_queued(self):
        """True while work queued on a stream may still touch the pool's free memory (asks the
        runtime, never waits): closing it then would wait for that work."""
        cdef ap_pool *_p = self._enter()
        cdef int queued
        with nogil:
            queued = ap_pool_work_queued(_p)
        self._leave()
        return bool(queued)

    def _orders_on(self, handle):
        """True when this pool has a live slot for stream `handle` (work ordered on it through the
        Python API or the C ABI)."""
        cdef void *s = PyLong_AsVoidPtr(handle)
        cdef ap_pool *_p = self._enter()
        cdef int known
        with nogil:
            known = ap_pool_knows_stream(_p, s)
        self._leave()
        return bool(known)

    def _stream_used_elsewhere(self, handle):
        """True when another pool uses stream `handle` (close then leaves it). The compiled pool
        knows no other pool; ascend_pool.Pool looks at the open ones."""
        return False

    def _mark_orphan(self):
        """Tells the C pool that its owner dropped it with blocks still allocated (registry's
        orphans): a tenant over its quota may then take back its idle cache."""
        cdef ap_pool *_p = self._enter()
        ap_pool_set_orphan(_p)
        self._leave()

    def _disown_streams(self):
        """Forgets which streams create_stream made here: a close then destroys none of them (a
        dropped pool's streams outlive it, as its object's death leaves them)."""
        self._created.clear()

    def _forget_destroyed_streams(self):
        """Drops the handles of streams the runtime no longer knows (a framework destroys its
        streams without telling the pool): a server registering a stream per request kept every
        handle for the process's life. Asks each stream once (an event record, no wait); run when
        the set doubles, so each registration costs O(1) questions on average."""
        for handle, serial in list(self._streams.items()):
            # Asked with the GIL released: another thread may have made or registered a stream
            # that got this handle meanwhile (the runtime reuses a destroyed stream's); it stays.
            if self._stream_idle(handle) < 0 and self._streams.get(handle) == serial:
                del self._streams[handle]
                self._created.discard(handle)

    def destroy_stream(self, stream):
        """Waits for stream, returns its cached blocks to all streams, and destroys it."""
        self._check()
        if stream is not None and type(stream) is not int:
            stream = _stream_handle(stream)
        if stream is None or stream == 0:  # refused before anything is done on the default stream
            raise InvalidStreamError(f"the default stream ({stream}) cannot be destroyed: destroy_stream takes a "
                                     "stream from pool.create_stream() or pool.register_stream(handle)")
        cdef ap_pool *_p
        cdef void *s = self._stream(stream)
        cdef ap_error err
        cdef int rc
        _p = self._enter()
        with nogil:
            rc = ap_pool_release_stream(_p, s, &err)
        self._leave()
        if rc == AP_OK or rc == AP_E_INVALID_STREAM:  # the latter: destroyed already, the pool forgot it
            self._streams.pop(stream, None)
            self._created.discard(stream)
        if rc != AP_OK:
            _raise(&err, rc)
        try:
            self.backend.stream_destroy(stream)
        except _errors_module.DeviceError as e:
            if self._stream_idle(stream) >= 0:  # the runtime still knows it: its own refusal
                raise
            # destroyed elsewhere since the pool last asked: the same error as when it knows (its
            # handle was dropped above; a stream made since may have it again: that one stays)
            raise InvalidStreamError(f"stream {stream:#x} is not a stream the runtime knows on device {self.device} "
                                     f"(destroyed, or not a stream handle): {e}") from None

    def _check_stream(self, stream):
        """Raises InvalidStreamError unless stream is None or 0 (the default stream) or a live
        stream of this pool (for the Python-level methods that take one)."""
        self._check()
        self._stream(stream)

    def empty_stream_cache(self, stream):
        """Returns to the device the unused cached segments that allocations on `stream` created,
        after waiting (bounded by sync_timeout_ms) for its work: CuPy's
        free_all_blocks(stream). Also, as CuPy's arenas (a block is the stream's it was freed
        on), those whose block `stream` freed though another stream made them, and those it made
        whose block another stream freed once that stream's work is done (asked, not waited
        for). Other streams' cached segments stay. With expandable segments
        the unused pages of every stream go (one address space)."""
        self._check()
        cdef ap_pool *_p
        cdef void *s = self._stream(stream)
        cdef ap_error err
        cdef int rc
        if self._free_frames:
            self._note_frames()
        _p = self._enter()
        with nogil:
            rc = ap_pool_empty_stream(_p, s, &err)
            ap_history_set_ctx(0)
        self._leave()
        if rc != AP_OK:
            _raise(&err, rc)

    def synchronize(self, stream=None):
        """Waits (bounded by sync_timeout_ms) for the work queued on stream (None: default)."""
        self._check()
        cdef ap_pool *_p
        cdef void *s = self._stream(stream)
        cdef ap_error err
        cdef int rc
        _p = self._enter()
        with nogil:
            rc = ap_pool_synchronize(_p, s, &err)
        self._leave()
        if rc != AP_OK:
            _raise(&err, rc)

    def synchronize_device(self, device_wait=True):
        """torch.npu.synchronize(device): waits (bounded by sync_timeout_ms) for all work of the
        pool's device, every stream the process has there (aclrtSynchronizeDevice; where the
        runtime has no bounded device wait, every stream this pool knows), then settles the
        pool's frees the wait completed. device_wait=False: this pool's streams and pending frees
        only (another pool of the device after one device wait)."""
        self._check()
        cdef ap_pool *_p
        cdef ap_error err
        cdef int rc
        cdef int dw = 1 if device_wait else 0
        _p = self._enter()
        with nogil:
            rc = ap_pool_synchronize_device(_p, dw, &err)
        self._leave()
        if rc != AP_OK:
            _raise(&err, rc)

    def set_limit(self, size=None, fraction=None, *, limit_bytes=None):
        """Caps reserved bytes, as CuPy's MemoryPool.set_limit(size=None, fraction=None): size in
        bytes (an integer, numpy's included) or fraction of the device's total memory (0..1);
        neither, or 0, lifts the cap (so pool.set_limit(pool.get_limit()) changes nothing).
        limit_bytes= (alone) sets an exact cap, where 0 is a cap of 0 bytes (torch's
        set_per_process_memory_fraction(0.0)). A cap below current use trims cache only."""
        self._check()
        cdef ap_pool *_p
        cdef size_t limit = AP_NO_LIMIT
        # Each refusal names the argument as the caller gave it (size past 2**64-2 said "limit
        # must be None or ...", limit_bytes='s words); a wrong type is a ConfigTypeError (TypeError).
        if limit_bytes is not None:
            if size is not None or fraction is not None:
                raise ConfigError("set_limit takes one of size, fraction and limit_bytes=")
            limit_bytes = _limit_bytes("limit_bytes", limit_bytes, False)
        elif fraction is not None:
            if size is not None:
                raise ConfigError("set_limit: size and fraction cannot be specified at one time")
            if isinstance(fraction, bool) or not isinstance(fraction, _numbers.Real):
                raise _errors_module.ConfigTypeError(
                    f"set_limit: fraction must be a number in [0, 1] of the device's memory, got "
                    f"{type(fraction).__name__} {fraction!r}")
            if not 0 <= fraction <= 1:  # NaN too
                raise ConfigError(f"set_limit: fraction must be a number in [0, 1] of the device's memory, "
                                  f"got {fraction!r}")
            limit_bytes = int(float(fraction) * self.backend.mem_info(self.device)[1]) or None
        elif size is not None:
            limit_bytes = _limit_bytes("size", size, True) or None  # CuPy: 0 is no limit
        if limit_bytes is not None:
            limit = <size_t>int(limit_bytes)
        _p = self._enter()
        with nogil:
            ap_pool_set_limit(_p, limit)
        self._leave()

    def _set_tunables(self, max_split_size, gc_threshold, divisions):
        """Sets max_split_size (bytes, None: off), gc_threshold (0.0: off) and the 16 roundup
        divisions for the calls that follow (ascend_pool.settings checked them), and in
        self.config."""
        self._check()
        cdef size_t split = AP_NO_LIMIT if max_split_size is None else <size_t>max_split_size
        cdef double gc = gc_threshold
        cdef unsigned div[16]
        for i in range(16):
            div[i] = divisions[i]
        cdef ap_pool *_p = self._enter()
        with nogil:
            ap_pool_set_tunables(_p, split, gc, div)
        self._leave()
        config = dict(self.config)
        if max_split_size is None:  # off, as in a pool opened without it (memory_stats: -1, as torch's)
            config.pop("max_split_size", None)
        else:
            config["max_split_size"] = split
        config["gc_threshold"] = gc
        config["roundup_divisions"] = list(divisions)
        self.config = config

    def get_limit(self):
        """The cap on reserved bytes in force (set_limit, set_per_process_memory_fraction, the C
        ABI's memory-fraction hook or the knobs), in bytes; 0 without one, as CuPy's
        MemoryPool.get_limit (whose set_limit(size=0) lifts the cap)."""
        limit = self._limit()
        return 0 if limit is None else limit

    def _limit(self):
        """The cap on reserved bytes in force, in bytes; None without one (a cap of 0 bytes, which
        set_per_process_memory_fraction(0) sets, is 0)."""
        self._check()
        cdef size_t limit
        cdef ap_pool *_p = self._enter()
        with nogil:
            limit = ap_pool_get_limit(_p)
        self._leave()
        return None if limit == AP_NO_LIMIT else limit

    def reset_peak_stats(self):
        """Resets every peak counter to its current value."""
        self._check()
        cdef ap_pool *_p = self._enter()
        with nogil:  # takes the pool mutex: never while holding the GIL (pool.h)
            ap_pool_reset_peaks(_p)
        self._leave()

    def _check_invariants(self):
        """Checks the pool's internal invariants (free trees, block tiling, cache, pending list,
        stats against a recount); raises AssertionError naming the first violation."""
        self._check()
        cdef char msg[400]
        cdef int rc
        cdef ap_pool *_p = self._enter()
        with nogil:
            rc = ap_pool_check(_p, msg, sizeof(msg))
        self._leave()
        if rc != 0:
            raise AssertionError(f"pool invariant violated (device {self.device}): " + msg.decode("utf-8", "replace"))

    def _hold_lock_for_test(self, double seconds):
        """Test hook: holds the pool mutex for `seconds` with the GIL released (to prove that
        no method waits for the mutex while holding the GIL)."""
        self._check()
        cdef ap_pool *_p = self._enter()
        with nogil:
            ap_pool_hold_lock(_p, seconds)
        self._leave()

    def round_size(self, nbytes):
        """Bytes a request of nbytes really occupies in the pool (padding and 512-byte rounding)."""
        cdef size_t n = _as_size(nbytes)
        self._check()  # after the conversion, which may run Python code (malloc says why)
        return ap_pool_round_size(self.p, n)

    def block_info(self, ptr):
        """(base, size, requested) of the live block containing ptr, or None."""
        self._check()
        cdef uintptr_t base = 0
        cdef size_t size = 0, requested = 0
        cdef void *a = _as_ptr(ptr)
        cdef int rc
        cdef ap_pool *_p = self._enter()
        with nogil:
            rc = ap_pool_block_info(_p, a, &base, &size, &requested)
        self._leave()
        if rc != 0:
            return None
        return (base, size, requested)

    def _block_ctx(self, ptr):
        """The frames context id of the allocated block starting at ptr (0: none recorded), or None."""
        self._check()
        cdef uint64_t ctx = 0
        cdef void *a = _as_ptr(ptr)
        cdef int rc
        cdef ap_pool *_p = self._enter()
        with nogil:
            rc = ap_pool_block_ctx(_p, a, &ctx)
        self._leave()
        return None if rc != 0 else ctx

    def segment_kind(self, ptr):
        """Kind of the pool segment containing address ptr: "expandable" (virtual memory mapped
        in chunks, expandable_segments:true), "device" (one device allocation), or None."""
        self._check()
        cdef void *a = _as_ptr(ptr)
        cdef int rc
        cdef ap_pool *_p = self._enter()
        with nogil:
            rc = ap_pool_segment_expandable(_p, a)
        self._leave()
        return None if rc < 0 else ("expandable" if rc else "device")

    def _raw_stats(self, int wait_ms=-1):
        """Counters copied under the lock: PyTorch-schema keys plus the pool's own. wait_ms >= 0:
        TimeoutError when the lock is not had within that many ms (a free may hold it over a
        stream wait when no event can be had)."""
        self._check()
        cdef ap_pool *_p
        cdef ap_stats st
        cdef int rc = 0
        _p = self._enter()
        with nogil:
            if wait_ms < 0:
                ap_pool_get_stats(_p, &st)
            else:
                rc = ap_pool_get_stats_within(_p, &st, wait_ms)
        self._leave()
        if rc != 0:
            raise TimeoutError(f"the pool's lock (device {self.device}) was held for more than {wait_ms} ms")
        return _stats_dict(&st, self.config.get("max_split_size", -1))

    cdef _note_frames(self):
        """Files the caller's Python frames under a context id and sets it for this thread. One id
        per distinct call stack: a block keeps its allocation's id for as long as it lives (as
        torch keeps its context), so ids are kept by call stack, least recently used dropped
        past _stack_cap, rather than one per event, which would drop a long-lived block's."""
        global _next_ctx
        d, ids = self._stack_frames, self._stack_ids
        if not self._stacks_on or d is None:  # turned off by another thread meanwhile (both dicts are set together)
            return
        f = sys._getframe(0)  # Cython methods have no frame: this is the caller's
        # The package's own wrappers (ap.malloc, the framework hooks) are not where the user
        # allocated: frames[0] is the user's line, as in PyTorch's snapshots.
        while f is not None and f.f_code.co_filename.startswith(_PACKAGE_DIR):
            f = f.f_back
        stack = []
        while f is not None:
            stack.append((f.f_code.co_filename, f.f_lineno, f.f_code.co_name))
            f = f.f_back
        stack = tuple(stack)
        ctx = ids.pop(stack, None)
        if ctx is None or ctx not in d:
            _next_ctx += 1
            ctx = _next_ctx
            d[ctx] = [{"filename": fn, "line": line, "name": name} for fn, line, name in stack]
        ids[stack] = ctx  # most recently used last
        while len(ids) > self._stack_cap:
            d.pop(ids.pop(next(iter(ids))), None)
        ap_history_set_ctx(ctx)

    def record_memory_history(self, enabled=True, stacks="python", max_entries=100_000, context="all", *,
                              skip_actions=None):
        """Turns the event history (snapshot()["device_traces"]) on or off at runtime, as
        torch.cuda.memory._record_memory_history: enabled True/"all" to record max_entries
        events, "state" to keep only the latest one (torch's ring of 1), None or False to stop
        (the trace is dropped); stacks "python" files Python frames (captured before the pool
        lock), None or "none" skips them (no cost); context, as torch's, says where frames show:
        "state" on live blocks only, "alloc" on blocks and on the trace's allocation entries (a
        free's entries carry its block's allocation frames), "all" also the frames of each free
        and of the empty_cache that released a segment, None nowhere. A live block shows the
        frames of its allocation in every snapshot for as long as it lives, recording on or off
        since, as torch's; one allocated while frames were not recorded shows none; max_entries:
        ring size in events, at most config.MAX_HISTORY_ENTRIES (larger ones, such as torch's
        default sys.maxsize, are clamped: the ring is allocated up front); skip_actions, as
        torch's: action names ("free_requested", "segment_alloc", ...) left out of the trace."""
        self._check()
        on, frames, entries = history_settings(enabled, stacks, max_entries, context)
        cdef uint32_t skip = history_skip_mask(skip_actions)
        cdef size_t cap = entries
        cdef ap_pool *_p = self._enter()
        cdef int rc
        with nogil:
            rc = ap_pool_set_history(_p, cap, skip)
        self._leave()
        self._check()  # closed meanwhile: its frames settings and the C ABI's count stay as close() left them
        if rc != AP_OK:
            raise MemoryError(f"host memory for a history of {entries} entries exhausted")
        # The frames filed so far stay (within _stack_cap call stacks) while live blocks refer to
        # them, recording or not, as torch keeps each block's allocation context.
        if frames and self._stack_frames is None:
            self._stack_frames, self._stack_ids = {}, {}
        if frames:
            self._stack_cap = max(entries, _MIN_STACKS)
        self._stacks_on = bool(frames)
        self._free_frames = bool(frames) and context == "all"
        self._entry_frames = bool(frames) and context in ("alloc", "all")
        if self.p != NULL:  # the Python above may have let another thread close it
            _capi_stacks_on(self.p, self if self._stacks_on else None)  # C ABI calls too

    def _history_metas(self):
        """The user-metadata ids (history_set_meta) of the history's entries, as a set; unlike
        _raw_snapshot, records no snapshot event."""
        self._check()
        cdef ap_pool *_p
        cdef ap_history_entry *h = NULL
        cdef size_t n, i
        _p = self._enter()
        with nogil:
            n = ap_pool_history_copy(_p, &h)
        self._leave()
        try:
            return {h[i].meta for i in range(n)}
        finally:
            c_free(h)

    def n_free_blocks(self):
        """Number of cached free blocks, as cupy's MemoryPool.n_free_blocks() (the inactive blocks
        a snapshot would show); records nothing in the history."""
        self._check()
        cdef ap_pool *_p
        cdef size_t n
        _p = self._enter()
        with nogil:
            n = ap_pool_count_free_blocks(_p)
        self._leave()
        return n

    def _raw_snapshot(self):
        """(segments, history): segments as tuples (base, size, pool, stream, blocks, expandable, ctx) with blocks
        as tuples (addr, size, requested, state, ctx); history as (action, addr, size, stream, time_us, ctx,
        meta) (ctx: the frames context id, 0 for none; meta: the user-metadata id, history_set_meta)."""
        self._check()
        cdef ap_pool *_p
        cdef ap_snapshot snap
        cdef int rc
        cdef size_t i, j
        _p = self._enter()
        with nogil:
            rc = ap_pool_snapshot(_p, &snap)
        self._leave()
        if rc != AP_OK:
            raise MemoryError("host memory for the snapshot exhausted")
        try:
            segments = []
            for i in range(snap.n_segments):
                seg = snap.segments[i]
                blocks = []
                for j in range(seg.first_block, seg.first_block + seg.n_blocks):
                    blk = snap.blocks[j]
                    blocks.append((blk.addr, blk.size, blk.requested, blk.state, blk.ctx))
                segments.append((seg.base, seg.size, seg.pool, <uintptr_t>seg.stream, blocks, bool(seg.expandable),
                                 seg.ctx))
            history = []
            for i in range(snap.n_history):
                e = snap.history[i]
                history.append((e.action, e.addr, e.size, <uintptr_t>e.stream, e.time_us, e.ctx, e.meta))
        finally:
            ap_snapshot_free(&snap)
        return segments, history



cdef dict _stats_dict(const ap_stats *st, max_split_size):
    """_raw_stats' dict of the counters in st (max_split_size: the pool's, -1 while off)."""
    out = {}
    for i, name in enumerate(_STAT_NAMES):
        for j, kind in enumerate(_STAT_TYPES):
            out[f"{name}.{kind}.current"] = st[0].s[i][j].current
            out[f"{name}.{kind}.peak"] = st[0].s[i][j].peak
            out[f"{name}.{kind}.allocated"] = st[0].s[i][j].current + st[0].s[i][j].freed
            out[f"{name}.{kind}.freed"] = st[0].s[i][j].freed
    # PyTorch's oversize figures (blocks and segments of max_split_size or more, never split),
    # which torch.cuda.memory_summary reads; max_split_size is -1 while it is off, as there.
    for i, name in enumerate(("oversize_allocations", "oversize_segments")):
        out[f"{name}.current"] = st[0].oversize[i].current
        out[f"{name}.peak"] = st[0].oversize[i].peak
        out[f"{name}.allocated"] = st[0].oversize[i].current + st[0].oversize[i].freed
        out[f"{name}.freed"] = st[0].oversize[i].freed
    out["max_split_size"] = max_split_size
    out["num_alloc_retries"] = st[0].num_alloc_retries
    out["num_ooms"] = st[0].num_ooms
    out["num_sync_all_streams"] = st[0].num_sync_all_streams
    out["num_device_alloc"] = st[0].num_device_alloc
    out["num_device_free"] = st[0].num_device_free
    out["num_device_map"] = st[0].num_device_map
    out["num_device_unmap"] = st[0].num_device_unmap
    out["num_quota_exceeded"] = st[0].num_quota_exceeded
    out["num_oom_rejections"] = st[0].num_oom_rejections
    out["events_created"] = st[0].events_created
    out["stream_migrations"] = st[0].stream_migrations
    out["pending_free_bytes"] = st[0].pending_free_bytes
    out["pending_free_blocks"] = st[0].pending_free_blocks
    out["largest_free_block_bytes"] = st[0].largest_free_block
    out["cached_free_bytes"] = st[0].cached_free_bytes
    out["device_free_bytes"] = st[0].device_free_bytes
    out["device_total_bytes"] = st[0].device_total_bytes
    return out


def unopened_raw_stats(max_split_size=-1):
    """_raw_stats() of a pool that was never opened: every key, each 0 (max_split_size as
    given). Built by _raw_stats' own code from zeroed counters, so that the keys stay the same."""
    cdef ap_stats st
    memset(&st, 0, sizeof(st))
    return _stats_dict(&st, max_split_size)


def replay_arrays(PoolBase pool, Backend backend, int device, str mode, const int8_t[::1] op,
                  const int32_t[::1] slot, const int64_t[::1] size, const int32_t[::1] stream,
                  list streams, Py_ssize_t n_slots):
    """Replays a trace (arrays from ascend_pool.traces) with the loop in C. mode: "pool" (through
    pool) or "direct" (one device call per allocation and free). Returns a dict of figures."""
    cdef ap_replay_result r
    cdef size_t n = op.shape[0]
    cdef int m = AP_REPLAY_POOL if mode == "pool" else AP_REPLAY_DIRECT
    cdef ap_pool *p = pool.p if pool is not None else NULL
    cdef int rc
    if m == AP_REPLAY_POOL and p == NULL:
        raise PoolError("pool mode needs a pool")
    if not (<size_t>slot.shape[0] == n and <size_t>size.shape[0] == n and <size_t>stream.shape[0] == n):
        raise ValueError("trace arrays differ in length")
    cdef void **c_streams = <void **>c_malloc((len(streams) + 1) * sizeof(void *))
    cdef void **ptrs = <void **>c_malloc((n_slots + 1) * sizeof(void *))
    if c_streams == NULL or ptrs == NULL:
        c_free(c_streams); c_free(ptrs)
        raise MemoryError("host memory for the replay exhausted")
    for i, s in enumerate(streams):
        c_streams[i] = NULL if s is None else PyLong_AsVoidPtr(s)
    if pool is not None:
        p = pool._enter()
    try:
        with nogil:
            rc = ap_replay(p, backend.b, device, m, &op[0], &slot[0], &size[0], &stream[0], n, c_streams,
                           ptrs, n_slots, &r)
    finally:
        if pool is not None:
            pool._leave()
        c_free(c_streams)
        c_free(ptrs)
    if rc != AP_OK:
        _raise(&r.error, rc)
    return {
        "allocs": r.allocs, "frees": r.frees, "seconds": r.seconds,
        "peak_live_bytes": r.peak_live_bytes, "peak_reserved_bytes": r.peak_reserved_bytes,
        "device_mallocs": r.device_mallocs, "device_frees": r.device_frees,
        "device_calls_steady": r.device_calls_steady, "final_allocated_bytes": r.final_allocated_bytes,
        "fragmentation_at_peak": r.fragmentation_at_peak,
    }


def history_set_meta(uint32_t meta):
    """Sets the user-metadata id (ascend_pool.memory_metadata's) that every pool's history
    entries carry from now on; 0: none."""
    ap_history_set_meta(meta)


def _set_default_pool(PoolBase pool):
    """Makes pool the process default of its device for the C ABI (ascend_pool_malloc ...)."""
    pool._check()
    ap_default_set(pool.device, pool.p)


def _set_thread_current(int device, PoolBase pool, bint mem_pool=False):
    """Makes pool (None: the default) current for device on this thread, for the C ABI (mem_pool:
    by use_mem_pool, whose cache the C ABI's empty_cache keeps). Returns the previous thread-local
    entry (an opaque token) for _restore_thread_current."""
    cdef ap_current_token prev
    if pool is None:
        ap_current_set(device, NULL, AP_NO_TICKET, 0, &prev)
    else:
        pool._check()
        ap_current_set(device, pool.p, pool._ticket, mem_pool, &prev)
    return (<uintptr_t>prev.pool, prev.ticket, <uintptr_t>prev.owner, prev.owner_ticket)


def _restore_thread_current(int device, tuple token):
    """Restores what _set_thread_current returned. A pool closed meanwhile comes back stale: the
    C ABI then reports it closed instead of using it (core/current.h)."""
    cdef ap_current_token t
    t.pool = <ap_pool *><uintptr_t>token[0]
    t.ticket = token[1]
    t.owner = <ap_pool *><uintptr_t>token[2]
    t.owner_ticket = token[3]
    ap_current_restore(device, &t)


def _limit_bytes(name, value, whole_float):
    """set_limit's byte count `value` (argument `name`) as an int from 0 to 2**64-2 (AP_NO_LIMIT
    itself stands for no limit), else ConfigError / ConfigTypeError naming name. whole_float: a
    float with no fraction counts (CuPy's size=1e9)."""
    if isinstance(value, bool) or not (isinstance(value, _numbers.Integral) or
                                       (whole_float and isinstance(value, float))):
        raise _errors_module.ConfigTypeError(f"set_limit: {name} must be a byte count from 0 to 2**64-2, got "
                                             f"{type(value).__name__} {value!r}")
    if isinstance(value, float) and not value.is_integer() or not 0 <= value < <size_t>AP_NO_LIMIT:
        raise ConfigError(f"set_limit: {name} must be a byte count from 0 to 2**64-2"
                          f"{' (0: no limit)' if whole_float else ''}, got {value!r}")
    return int(value)

# The pinned host pool (host/hostpool.c, policy in host/hostpool.h) as a Python object. Backs the
# numpy handler and serves staging buffers for host<->device copies. Addresses are ints, sizes
# bytes, streams the runtime's int handles.

from libc.stdint cimport int64_t
from cpython.ref cimport Py_INCREF
from ascend_pool.units import as_index as _as_index

cdef extern from "host/hostpool.h" nogil:
    ctypedef struct ap_host_pool:
        pass
    ctypedef struct ap_host_stats:
        int64_t allocated_bytes, allocated_bytes_peak, requested_bytes, requested_bytes_peak
        int64_t allocations, allocations_peak, reserved_bytes, reserved_bytes_peak, segments
        int64_t cached_free_bytes, cached_free_blocks, pending_free_bytes, pending_free_blocks, num_allocs, num_frees
        int64_t num_host_alloc, num_host_free, events_created, num_invalid_frees
        int64_t segments_peak, active_requests, active_requests_peak, active_bytes, active_bytes_peak
        int64_t acc_host_alloc, acc_host_free, acc_pinned_bytes, acc_unpinned_bytes
        int64_t acc_requests, acc_request_bytes, acc_released, acc_released_bytes
        int64_t host_alloc_us, host_alloc_us_max, host_alloc_us_min, host_free_us, host_free_us_max, host_free_us_min
    ap_host_pool *ap_host_pool_create(ap_backend *backend, int device, ap_error *err)
    void ap_host_pool_destroy(ap_host_pool *hp)
    size_t ap_host_class_size(size_t size)
    int ap_host_malloc(ap_host_pool *hp, size_t size, void **out, ap_error *err)
    int ap_host_free(ap_host_pool *hp, void *ptr, ap_error *err)
    int ap_host_realloc(ap_host_pool *hp, void *ptr, size_t new_size, void **out, ap_error *err)
    int ap_host_record_stream(ap_host_pool *hp, void *ptr, void *stream, int device, ap_error *err)
    int ap_host_block_info(ap_host_pool *hp, void *ptr, uintptr_t *base, size_t *capacity, size_t *requested)
    void ap_host_empty_cache(ap_host_pool *hp)
    void ap_host_get_stats(ap_host_pool *hp, ap_host_stats *out)
    void ap_host_reset_peaks(ap_host_pool *hp)
    void ap_host_reset_accumulated(ap_host_pool *hp)


cdef inline void *_host_stream(object stream) except? NULL:
    """A record_stream stream argument as the runtime's handle (None or 0: the default stream), as
    the device pools take it: a numpy integer too; StreamTypeError for what is no integer,
    InvalidStreamError for a handle no pointer holds (before: a bare TypeError or OverflowError)."""
    if stream is None:
        return NULL
    if type(stream) is not int:
        stream = _stream_handle(stream)
    if stream == 0:
        return NULL
    if not 0 < stream <= <uintptr_t>-1:
        raise InvalidStreamError(f"stream handle must be None, 0 (the default stream) or a positive int that fits "
                                 f"a pointer, got {stream!r}")
    return PyLong_AsVoidPtr(stream)


# no_gc_clear, as PoolBase's: the collector's tp_clear dropped `backend` (freed, when only this
# pool held it) before __dealloc__ destroyed the C host pool through it (heap-use-after-free).
@cython.no_gc_clear
cdef class HostPool:
    """Pinned (page-locked) host memory, cached: ``HostPool(backend, device=0)``.

    Buffers come from the runtime's pinned allocator (aclrtMallocHost on acl/sim, cudaHostAlloc on
    cuda) in `device`'s context, in power-of-two classes of at least 512 bytes, and are reused
    from free lists. A buffer used by queued device work (an async copy) is marked with
    record_stream(ptr, stream) before its free: it is then reused only once that stream's work
    queued before the free has completed (an event is recorded at free time and polled).

    malloc(nbytes) -> int; free(ptr); realloc(ptr, nbytes) -> int; record_stream(ptr, stream);
    block_info(ptr); empty_cache(); memory_stats(); host_memory_stats() (torch's schema);
    reset_peak_stats(); reset_accumulated_stats(); close(). CuPy's PinnedMemoryPool names too
    (n_free_blocks, free_all_blocks), and its MemoryPool's used_bytes, total_bytes, free_bytes.
    """

    cdef ap_host_pool *hp
    cdef readonly Backend backend
    cdef readonly int device
    cdef bint _immortal

    def __cinit__(self, Backend backend not None, object device=0):
        cdef ap_error err
        cdef int dev
        self.hp = NULL
        index = _as_index(device)  # never a bool, float or string (was Cython's bare TypeError/OverflowError)
        if index is None:
            raise InvalidDeviceError(f"device must be an integer index, got {device!r}")
        if not 0 <= index < backend.device_count:
            raise InvalidDeviceError(
                f"device {index} does not exist: the {backend.name} backend has {backend.device_count} device(s)")
        dev = index
        self.hp = ap_host_pool_create(backend.b, dev, &err)
        if self.hp == NULL:
            _raise(&err, err.status)
        self.backend = backend
        self.device = dev

    def __dealloc__(self):
        self._shut()

    def __repr__(self):
        state = "closed" if self.hp == NULL else f"device={self.device}, backend={self.backend.name!r}"
        return f"<ascend_pool HostPool {state}>"

    cdef inline int _check(self) except -1:
        if self.hp == NULL:
            raise PoolError("this host pool is closed")
        if ap_forked_from:  # inherited from the parent: its runtime is not this process's
            _raise_forked()
        return 0

    def _make_immortal(self):
        """Keeps this pool (and its backend) alive until the process ends. For the pool behind
        the numpy handler: arrays may be freed during interpreter teardown, after every module
        global is gone, and their frees must still find the pool."""
        if not self._immortal:
            self._immortal = True
            Py_INCREF(self)

    @property
    def closed(self):
        return self.hp == NULL

    def close(self):
        """Returns every buffer, handed out or not, to the runtime. Refused for the process's
        numpy pool (arrays may still live in it)."""
        if self._immortal:
            raise PoolError("the host pool behind the numpy handler lives until the process exits")
        self._shut()

    cdef void _shut(self) noexcept:
        # As PoolBase._shut: in a forked child the pool is the parent's (its lock may be held
        # forever, its buffers belong to the parent's runtime): forgotten, never touched.
        cdef ap_host_pool *hp = self.hp
        self.hp = NULL
        if hp != NULL and not ap_forked_from:
            with nogil:
                ap_host_pool_destroy(hp)

    def class_size(self, nbytes):
        """Bytes a request of nbytes occupies (its power-of-two class; 0 if none fits, 0 bytes
        included). A size that is no byte count (negative, a float, a string) is an
        InvalidSizeError as malloc's is (the C conversion's bare OverflowError or TypeError)."""
        index = _as_index(nbytes)
        if index is not None and (index == 0 or index >= 2**63):  # none, or past any C size: no class
            return 0
        return ap_host_class_size(_as_size(nbytes))

    def malloc(self, nbytes):
        """nbytes of pinned host memory; returns its address (int)."""
        self._check()
        cdef size_t n = _as_size(nbytes)
        cdef void *out = NULL
        cdef ap_error err
        cdef int rc
        with nogil:
            rc = ap_host_malloc(self.hp, n, &out, &err)
        if rc != AP_OK:
            _raise(&err, rc)
        return <uintptr_t>out

    def free(self, ptr):
        """Frees a buffer: reusable at once, or after the work of the streams it was marked with."""
        self._check()
        cdef void *p = _as_ptr(ptr)
        cdef ap_error err
        cdef int rc
        with nogil:
            rc = ap_host_free(self.hp, p, &err)
        if rc != AP_OK:
            _raise(&err, rc)

    def realloc(self, ptr, nbytes):
        """Resizes a buffer, keeping its first min(old, new) bytes; returns its (maybe new) address."""
        self._check()
        cdef void *p = _as_ptr(ptr)
        cdef size_t n = _as_size(nbytes)
        cdef void *out = NULL
        cdef ap_error err
        cdef int rc
        with nogil:
            rc = ap_host_realloc(self.hp, p, n, &out, &err)
        if rc != AP_OK:
            _raise(&err, rc)
        return <uintptr_t>out

    def record_stream(self, ptr, stream, device=None):
        """Marks a buffer as used by work queued on stream (an int handle; None: the default
        stream) of device (None: this pool's): after its free, it is not reused until that work
        has completed."""
        self._check()
        cdef void *p = _as_ptr(ptr)
        cdef void *s = _host_stream(stream)
        cdef int dev = self._record_device(device)
        cdef ap_error err
        cdef int rc
        with nogil:
            rc = ap_host_record_stream(self.hp, p, s, dev, &err)
        if rc != AP_OK:
            _raise(&err, rc)

    cdef int _record_device(self, object device) except -1:
        """record_stream's device (None: this pool's) as an index of the backend's devices; anything
        else named, as the device pools' arguments are (before: a bare TypeError or OverflowError,
        and a device past the count accepted, its record then failing at the free)."""
        if device is None:
            return self.device
        index = _as_index(device)  # an int or a numpy integer; never a bool, float or string
        if index is None:
            raise InvalidDeviceError(f"device must be an integer index, got {device!r}")
        if not 0 <= index < self.backend.device_count:
            raise InvalidDeviceError(f"device {index} does not exist: the {self.backend.name} backend has "
                                     f"{self.backend.device_count} device(s)")
        return index

    def block_info(self, ptr):
        """(base, capacity, requested) bytes of the handed-out buffer starting at ptr, or None."""
        self._check()
        cdef uintptr_t base = 0
        cdef size_t capacity = 0, requested = 0
        if ap_host_block_info(self.hp, _as_ptr(ptr), &base, &capacity, &requested) != 0:
            return None
        return (base, capacity, requested)

    def empty_cache(self):
        """Waits for parked buffers' events, then returns every unused buffer and idle slab."""
        self._check()
        with nogil:
            ap_host_empty_cache(self.hp)

    def reset_peak_stats(self):
        """Peaks (memory_stats' and host_memory_stats') back to the current values."""
        self._check()
        ap_host_reset_peaks(self.hp)

    def reset_accumulated_stats(self):
        """Zeroes host_memory_stats' accumulated figures (.allocated, .freed, num_host_alloc/free,
        the call times), as torch's reset_accumulated_host_memory_stats; current values and
        peaks stay."""
        self._check()
        ap_host_reset_accumulated(self.hp)

    def host_memory_stats(self):
        """torch.cuda.host_memory_stats()'s schema (torch_npu.npu's too), sorted by key as torch's:
        allocations / allocated_bytes .{current,peak,allocated,freed}: the runtime allocations
        held (slabs and big buffers) and their bytes; active_requests / active_bytes: buffers handed
        out or parked for their streams' work (not yet reusable) and their class bytes;
        num_host_alloc / num_host_free: runtime calls made; host_alloc_time / host_free_time
        .{total,max,min,count,avg}: microseconds in them. .allocated/.freed and the calls count
        from creation or reset_accumulated_stats()."""
        self._check()
        cdef ap_host_stats st
        ap_host_get_stats(self.hp, &st)
        return _host_stats_dict(&st)

    # -- CuPy's pool names, so that code (and tests) written for cupy.cuda.PinnedMemoryPool port --

    def n_free_blocks(self):
        """Buffers cached ready for reuse, as cupy's PinnedMemoryPool.n_free_blocks(): those freed
        and the unused rest of a slab (a freed buffer parked for its streams' work counts once
        that work is seen done)."""
        return self.memory_stats()["cached_free_blocks"]

    def free_all_blocks(self):
        """Returns the cached buffers to the runtime, as cupy's PinnedMemoryPool.free_all_blocks()
        (empty_cache(): a slab goes once none of its buffers is in use)."""
        self.empty_cache()

    def used_bytes(self):
        """Bytes handed out (class sizes), as cupy's MemoryPool.used_bytes()."""
        return self.memory_stats()["allocated_bytes.all.current"]

    def total_bytes(self):
        """Pinned bytes held from the runtime, as cupy's MemoryPool.total_bytes()."""
        return self.memory_stats()["reserved_bytes.all.current"]

    def free_bytes(self):
        """Bytes held but not handed out (cached, or parked for streams' work), as cupy's
        MemoryPool.free_bytes()."""
        s = self.memory_stats()
        return s["reserved_bytes.all.current"] - s["allocated_bytes.all.current"]

    def memory_stats(self):
        """Counters in the style of PyTorch's memory_stats() (bytes and counts): allocated_bytes,
        requested_bytes, allocation, reserved_bytes (pinned from the runtime) .all.{current,peak},
        segment.all.current, and cached_free_bytes, cached_free_blocks, pending_free_bytes, pending_free_blocks,
        num_allocs, num_frees, num_host_alloc, num_host_free, events_created, num_invalid_frees."""
        self._check()
        cdef ap_host_stats st
        ap_host_get_stats(self.hp, &st)
        return {
            "allocated_bytes.all.current": st.allocated_bytes,
            "allocated_bytes.all.peak": st.allocated_bytes_peak,
            "requested_bytes.all.current": st.requested_bytes,
            "requested_bytes.all.peak": st.requested_bytes_peak,
            "allocation.all.current": st.allocations,
            "allocation.all.peak": st.allocations_peak,
            "reserved_bytes.all.current": st.reserved_bytes,
            "reserved_bytes.all.peak": st.reserved_bytes_peak,
            "segment.all.current": st.segments,
            "cached_free_bytes": st.cached_free_bytes,
            "cached_free_blocks": st.cached_free_blocks,
            "pending_free_bytes": st.pending_free_bytes,
            "pending_free_blocks": st.pending_free_blocks,
            "num_allocs": st.num_allocs,
            "num_frees": st.num_frees,
            "num_host_alloc": st.num_host_alloc,
            "num_host_free": st.num_host_free,
            "events_created": st.events_created,
            "num_invalid_frees": st.num_invalid_frees,
        }


cdef dict _host_stats_dict(const ap_host_stats *st):
    """host_memory_stats() of the counters in st."""
    out = {}
    for name, current, peak, up, down in (
            ("allocations", st[0].segments, st[0].segments_peak, st[0].acc_host_alloc, st[0].acc_host_free),
            ("allocated_bytes", st[0].reserved_bytes, st[0].reserved_bytes_peak, st[0].acc_pinned_bytes, st[0].acc_unpinned_bytes),
            ("active_requests", st[0].active_requests, st[0].active_requests_peak, st[0].acc_requests, st[0].acc_released),
            ("active_bytes", st[0].active_bytes, st[0].active_bytes_peak, st[0].acc_request_bytes, st[0].acc_released_bytes)):
        out.update({f"{name}.current": current, f"{name}.peak": peak, f"{name}.allocated": up, f"{name}.freed": down})
    for name, total, most, least, count in (
            ("host_alloc_time", st[0].host_alloc_us, st[0].host_alloc_us_max, st[0].host_alloc_us_min, st[0].acc_host_alloc),
            ("host_free_time", st[0].host_free_us, st[0].host_free_us_max, st[0].host_free_us_min, st[0].acc_host_free)):
        out.update({f"{name}.total": total, f"{name}.max": most, f"{name}.min": least, f"{name}.count": count,
                    f"{name}.avg": total // count if count else 0})
    out["num_host_alloc"], out["num_host_free"] = st[0].acc_host_alloc, st[0].acc_host_free
    return dict(sorted(out.items()))


def unopened_host_memory_stats():
    """host_memory_stats() of a pinned pool that was never made: every key, each 0 (what a new
    pool reports), from the same code on zeroed counters."""
    cdef ap_host_stats st
    memset(&st, 0, sizeof(st))
    return _host_stats_dict(&st)

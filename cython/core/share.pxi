# Shared blocks: the pool's side of sharing device memory with other processes (core/share.c).
# ascend_pool/sharing.py builds the user-facing API (Pool.share, open_shared) on these.
#
# SharedSegment: one dedicated segment of a pool, for a block other processes will import. It
# keeps its pool (and so the backend) alive; every call that may block releases the GIL.

from libc.stdint cimport int32_t
from libc.string cimport memset

cdef extern from "share.h" nogil:
    size_t AP_SHARE_PAGE
    enum:
        AP_SHARE_ALLOCATED, AP_SHARE_EXPORTED, AP_SHARE_RELEASED
    ctypedef struct ap_share:
        ap_backend *backend
        void *seg
        uintptr_t base
        size_t size
        size_t requested
        int device
        int state
        char key[160]
    int ap_share_alloc(ap_pool *p, size_t size, ap_share *s, ap_error *err)
    int ap_share_export(ap_share *s, unsigned flags, ap_error *err)
    int ap_share_set_pids(ap_share *s, const int32_t *pids, size_t n, ap_error *err)
    int ap_share_unexport(ap_share *s, ap_error *err)
    int ap_share_release(ap_pool *p, ap_share *s, ap_error *err)
    void ap_share_detach(ap_pool *p, ap_share *s)
    int ap_share_lost(ap_share *s, int probe)

SHARE_PAGE = AP_SHARE_PAGE
_SHARE_STATES = {AP_SHARE_ALLOCATED: "allocated", AP_SHARE_EXPORTED: "exported", AP_SHARE_RELEASED: "released"}


cdef class SharedSegment:
    """A block in a segment of its own, counted in its pool's reserved bytes and quota, that other
    processes may import. Made by _share_alloc; driven by ascend_pool.sharing."""
    cdef ap_share s
    cdef readonly PoolBase pool     # the owning pool (kept alive; may be closed meanwhile)
    cdef readonly Backend backend   # outlives the pool: a detached segment is freed through it
    cdef readonly bint detached     # out of its pool's accounting (the pool closed while imported)
    cdef public object _last_busy   # the runtime's words when release() last returned False

    def __cinit__(self):
        memset(&self.s, 0, sizeof(self.s))
        self.detached = False

    @property
    def ptr(self):
        """Device address of the block (the segment's base: 2 MiB aligned)."""
        return self.s.base

    @property
    def size(self):
        """Bytes asked for."""
        return self.s.requested

    @property
    def segment_bytes(self):
        """Bytes of the segment: the request rounded up to whole 2 MiB pages."""
        return self.s.size

    @property
    def device(self):
        return self.s.device

    @property
    def key(self):
        """The runtime's key once exported, else None."""
        return self.s.key.decode("ascii") if self.s.state == AP_SHARE_EXPORTED else None

    @property
    def state(self):
        """"allocated", "exported" or "released"."""
        return _SHARE_STATES[self.s.state]

    def is_lost(self, bint probe=True):
        """True when the runtime released the block's memory and closed its key (aclFinalize, then
        perhaps aclInit; resets that took the pools' device references): release() forgets it
        without a runtime call, whoever still imports it. probe: enter the device's context first,
        which finds such a release (Backend.runtime_life); else what the backend has seen."""
        cdef int lost
        with nogil:
            lost = ap_share_lost(&self.s, probe)
        return bool(lost)

    cdef ap_pool *_pool_or_null(self):
        return NULL if self.detached or self.pool is None else self.pool.p

    def export(self, bint any_process=False, bint read_only=False):
        """Exports the whole segment; returns the key. Only pids allowed with set_pids may import
        it unless any_process; read_only: importers map it read-only where the runtime can
        (Backend.has_ipc_read_only)."""
        cdef ap_error err
        cdef int rc
        cdef unsigned flags = (AP_IPC_ANY_PROCESS if any_process else 0) | (AP_IPC_READ_ONLY if read_only else 0)
        with nogil:
            rc = ap_share_export(&self.s, flags, &err)
        if rc != AP_OK:
            _raise(&err, rc)
        return self.key

    def set_pids(self, pids):
        """Lets the processes `pids` import the exported block."""
        cdef ap_error err
        cdef int rc
        cdef size_t n = len(pids), i
        cdef int32_t *arr = <int32_t *>_c_malloc((n if n > 0 else 1) * sizeof(int32_t))
        if arr == NULL:
            raise MemoryError()
        try:
            for i in range(n):
                arr[i] = <int32_t>int(pids[i])
            with nogil:
                rc = ap_share_set_pids(&self.s, arr, n, &err)
        finally:
            _c_free(arr)
        if rc != AP_OK:
            _raise(&err, rc)

    def unexport(self):
        """Withdraws the key; the block stays allocated (and may be exported again)."""
        cdef ap_error err
        cdef int rc
        with nogil:
            rc = ap_share_unexport(&self.s, &err)
        if rc != AP_OK:
            _raise(&err, rc)

    def release(self):
        """Withdraws the key and frees the segment. Returns True when done, False when the runtime
        refused because other processes still import the block (nothing changed: retry later).
        Other failures raise."""
        cdef ap_error err
        cdef int rc
        cdef ap_pool *p
        if self.s.state == AP_SHARE_RELEASED:
            return True
        if not self.detached and (self.pool is None or self.pool.p == NULL):
            # The pool closed without detaching (its close freed the segment, or tried to).
            self.s.state = AP_SHARE_RELEASED
            return True
        if self.detached:
            with nogil:
                rc = ap_share_release(NULL, &self.s, &err)
        else:
            p = self.pool._enter()
            try:
                with nogil:
                    rc = ap_share_release(p, &self.s, &err)
            finally:
                self.pool._leave()
        if rc == AP_E_BUSY:
            self._last_busy = err.message.decode("utf-8", "replace")
            return False
        if rc != AP_OK:
            _raise(&err, rc)
        return True

    def detach(self):
        """Takes the segment out of its pool's accounting (before the pool closes while the block
        is still imported); release() then frees it through the backend alone."""
        if self.detached or self.s.state == AP_SHARE_RELEASED:
            return
        if self.pool is not None and self.pool.p != NULL:
            with nogil:
                ap_share_detach(self.pool.p, &self.s)
        self.detached = True


def _share_alloc(PoolBase pool, nbytes):
    """A SharedSegment of `pool` for nbytes (rounded up to whole 2 MiB pages)."""
    cdef size_t n = _as_size(nbytes, True)
    cdef SharedSegment seg = SharedSegment()
    cdef ap_error err
    cdef int rc
    cdef ap_pool *p = pool._enter()
    try:
        with nogil:
            rc = ap_share_alloc(p, n, &seg.s, &err)
    finally:
        pool._leave()
    if rc != AP_OK:
        _raise(&err, rc)
    seg.pool = pool
    seg.backend = pool.backend
    seg._last_busy = None
    return seg

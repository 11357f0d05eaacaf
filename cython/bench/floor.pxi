# Microbenchmarks of the cached path and their floors (driven by ascend_pool/bench/micro.py).
#
# Floors: bench_noop, a no-op def (what any call from Python costs), and a trivial mutex-guarded
# free list in C (what any thread-safe cached malloc+free pair costs); the C code is in
# bench/bench_floor.h. Every loop returns nanoseconds per pair (per call for bench_noop loops).

from libc.stdint cimport int64_t

cdef extern from "bench/bench_floor.h" nogil:
    enum:
        APB_KIND_FREELIST, APB_KIND_POOL, APB_MAX_THREADS
    ctypedef struct apb_freelist:
        pass
    apb_freelist *apb_freelist_create(int locked, size_t n_nodes)
    void apb_freelist_destroy(apb_freelist *fl)
    double apb_pool_loop(ap_pool *p, size_t size, int64_t n, int *status)
    int apb_run_threads(int kind, void *obj, size_t size, int64_t n, int nthreads, double *ns_out)


def bench_noop(x=None):
    """Does nothing: the floor of any call from Python into the extension."""
    pass


cdef list _thread_results(int kind, void *obj, size_t size, int64_t n, int threads):
    cdef double ns[APB_MAX_THREADS]
    cdef int rc
    if threads < 1 or threads > APB_MAX_THREADS:
        raise ValueError(f"threads must be 1..{APB_MAX_THREADS}, got {threads}")
    with nogil:
        rc = apb_run_threads(kind, obj, size, n, threads, ns)
    if rc != 0:
        raise RuntimeError(f"benchmark loop failed (status {rc})")
    return [ns[i] for i in range(threads)]


def bench_c_freelist_pairs(int64_t n, size_t size=4096, bint locked=True, int threads=1):
    """The C floor: n malloc+free pairs on a trivial free list (mutex-guarded when locked) in each
    of `threads` threads at once, GIL released. Returns each thread's ns per pair (a list). One
    thread takes a plain mutex, several the pool's adaptive kind (bench_floor.h says why)."""
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    cdef int kind = 0 if not locked else (2 if threads > 1 else 1)
    cdef apb_freelist *fl = apb_freelist_create(kind, <size_t>(threads if threads > 0 else 1))
    if fl == NULL:
        raise MemoryError("host memory for the free list exhausted")
    try:
        return _thread_results(APB_KIND_FREELIST, <void *>fl, size, n, threads)
    finally:
        apb_freelist_destroy(fl)


def bench_c_pool_pairs(PoolBase pool, int64_t n, size_t size=4096, int threads=1):
    """n ap_pool_malloc+ap_pool_free pairs of `size` bytes on pool (its C pool, `pool.p`) in each
    of `threads` threads at once, GIL released. Warm the pool first (one pair per thread) so that
    every pair is a cache hit. Returns each thread's ns per pair (a list)."""
    pool._check()
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    cdef int status = 0
    cdef double ns
    if threads == 1:
        with nogil:
            ns = apb_pool_loop(pool.p, size, n, &status)
        if status != AP_OK:
            raise PoolError(f"pool call failed in the benchmark loop (status {status})")
        return [ns]
    return _thread_results(APB_KIND_POOL, <void *>pool.p, size, n, threads)


cdef extern from "bench/bench_tail.h" nogil:
    ctypedef struct apb_tail:
        pass
    apb_tail *apb_tail_start(int device, size_t size, int64_t n)
    int apb_tail_done(apb_tail *t)
    void apb_tail_stop(apb_tail *t)
    int64_t apb_tail_finish(apb_tail *t, const double *q, int nq, double *out, int *status)


cdef class TailRun:
    """A C thread (never holding the GIL) timing up to n warm ascend_pool_malloc/ascend_pool_free
    pairs of `size` bytes on `device`'s current pool (bench_tail.h). done() polls, stop() ends the
    loop early; finish() joins it and returns {"pairs", "p50_ns", "p99_ns", "p999_ns"}."""
    cdef apb_tail *t

    def __cinit__(self, int device, size_t size, int64_t n):
        if n <= 0:
            raise ValueError(f"n must be positive, got {n}")
        with nogil:
            self.t = apb_tail_start(device, size, n)
        if self.t == NULL:
            raise MemoryError("cannot start the tail-latency thread")

    def done(self):
        return self.t == NULL or apb_tail_done(self.t) != 0

    def stop(self):
        if self.t != NULL:
            apb_tail_stop(self.t)

    def finish(self):
        cdef double q[3]
        cdef double out[3]
        cdef int status = 0
        cdef int64_t n
        if self.t == NULL:
            raise RuntimeError("already finished")
        q[0] = 0.5; q[1] = 0.99; q[2] = 0.999
        with nogil:
            n = apb_tail_finish(self.t, q, 3, out, &status)
        self.t = NULL
        if status != 0:
            raise PoolError("ascend_pool_malloc failed in the tail-latency loop (its last error is the C "
                            "thread's own; is the device's current pool open?)")
        return {"pairs": n, "p50_ns": out[0], "p99_ns": out[1], "p999_ns": out[2]}

    def __dealloc__(self):
        cdef double q[1]
        cdef double out[1]
        cdef int status = 0
        q[0] = 0.5
        if self.t != NULL:
            with nogil:
                apb_tail_finish(self.t, q, 1, out, &status)
            self.t = NULL

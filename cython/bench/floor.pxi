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
    double apb_fl_loop(apb_freelist *fl, size_t size, int64_t n)
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

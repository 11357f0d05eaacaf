/* The workload of hammer.h as a library, for the test process to call through ctypes.PyDLL (which
 * holds the GIL for the whole call): the C ABI's hot path must progress without it. */
#include "hammer.h"

int capi_hammer(void *malloc_fn, void *free_fn, int device, int nthreads, int iters, int timeout_s, long *allocs,
                char *why, size_t whylen) {
    return hm_run((hm_malloc_fn)malloc_fn, (hm_free_fn)free_fn, device, nthreads, iters, timeout_s, allocs, why,
                  whylen);
}

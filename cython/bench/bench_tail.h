/* Tail latency of the C ABI's cached pair while the pool is maintained (floor.pxi, micro.py).
 *
 * A C thread (it never holds the GIL) times each warm ascend_pool_malloc/ascend_pool_free pair of
 * one size on the calling device's current pool, one clock read per pair, into a preallocated
 * array; the percentiles are computed once it stops. Meanwhile Python threads call synchronize,
 * empty_cache, snapshot and a metrics scrape on the same pool: the pair's tail shows whether any
 * of them holds the pool mutex across a device wait.
 */
#ifndef AP_BENCH_TAIL_H
#define AP_BENCH_TAIL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/types.h>
#include <time.h>

void *ascend_pool_malloc(ssize_t size, int device, void *stream);
void ascend_pool_free(void *ptr, ssize_t size, int device, void *stream);

typedef struct apb_tail {
    pthread_t thread;
    int started;
    int device;
    size_t size;
    int64_t n;
    int64_t *ns;        /* one sample per pair (nanoseconds) */
    atomic_int done;
    atomic_int stop;    /* set by the driver: end the loop (also ends when n samples are taken) */
    int status;         /* 0, or 1 when a malloc failed (the pool could not serve the pair) */
} apb_tail;

static inline int64_t apb_tail_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void *apb_tail_body(void *arg)
{
    apb_tail *t = (apb_tail *)arg;
    /* Warm: the block is cached. The guard after it stays live, so that the block has no free
       neighbour to merge with (a block freed beside free space merges at once: free_cache.h). */
    void *p = ascend_pool_malloc((ssize_t)t->size, t->device, NULL);
    void *guard = p ? ascend_pool_malloc((ssize_t)t->size, t->device, NULL) : NULL;
    if (!p || !guard) {
        if (p) ascend_pool_free(p, (ssize_t)t->size, t->device, NULL);
        t->status = 1;
    } else {
        ascend_pool_free(p, (ssize_t)t->size, t->device, NULL);
        int64_t prev = apb_tail_now();
        int64_t i;
        for (i = 0; i < t->n && !atomic_load_explicit(&t->stop, memory_order_relaxed); i++) {
            p = ascend_pool_malloc((ssize_t)t->size, t->device, NULL);
            if (!p) {
                t->status = 1;
                t->n = i;
                break;
            }
            ascend_pool_free(p, (ssize_t)t->size, t->device, NULL);
            int64_t now = apb_tail_now();
            t->ns[i] = now - prev;
            prev = now;
        }
        t->n = i;
        ascend_pool_free(guard, (ssize_t)t->size, t->device, NULL);
    }
    atomic_store(&t->done, 1);
    return NULL;
}

static void apb_tail_stop(apb_tail *t) { atomic_store(&t->stop, 1); }

/* Starts the timing thread for at most n pairs; NULL when out of host memory or threads. */
static apb_tail *apb_tail_start(int device, size_t size, int64_t n)
{
    apb_tail *t = (apb_tail *)calloc(1, sizeof *t);
    if (!t)
        return NULL;
    t->ns = (int64_t *)malloc((size_t)n * sizeof *t->ns);
    t->device = device;
    t->size = size;
    t->n = n;
    if (!t->ns || pthread_create(&t->thread, NULL, apb_tail_body, t) != 0) {
        free(t->ns);
        free(t);
        return NULL;
    }
    t->started = 1;
    return t;
}

static int apb_tail_done(apb_tail *t) { return atomic_load(&t->done); }

static int apb_cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Joins the thread and writes the q-quantiles (q[i] in 0..1) of its samples into out[i].
   Returns the number of samples (0 when the pool failed a malloc), and frees t. */
static int64_t apb_tail_finish(apb_tail *t, const double *q, int nq, double *out, int *status)
{
    pthread_join(t->thread, NULL);
    int64_t n = t->n;
    qsort(t->ns, (size_t)n, sizeof *t->ns, apb_cmp_i64);
    for (int i = 0; i < nq; i++) {
        int64_t k = n ? (int64_t)(q[i] * (double)n) : 0;
        if (k >= n)
            k = n - 1;
        out[i] = n ? (double)t->ns[k] : 0.0;
    }
    *status = t->status;
    free(t->ns);
    free(t);
    return n;
}

#endif

/* A malloc/free workload for the C ABI on several pthreads, checking that no two live blocks ever
 * overlap. Shared by capi_threads.c (a program that embeds Python) and capi_hammer.c (a library
 * the test process loads with ctypes.PyDLL, which keeps the GIL held during the call).
 *
 * The workers never touch Python: if ascend_pool_malloc/free needed the GIL while the caller holds
 * it, they would block, and hm_run reports a timeout instead of hanging the test.
 */
#ifndef HAMMER_H
#define HAMMER_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>

typedef void *(*hm_malloc_fn)(ssize_t size, int device, void *stream);
typedef void (*hm_free_fn)(void *ptr, ssize_t size, int device, void *stream);

#define HM_MAX_THREADS 64
#define HM_SLOTS 16 /* live blocks per worker */
#define HM_MAX_LIVE (HM_MAX_THREADS * HM_SLOTS)

typedef struct hm_range {
    uintptr_t lo, hi;
} hm_range;

/* Every live block of every worker, under one lock: the overlap check. */
static struct {
    pthread_mutex_t lock;
    hm_range live[HM_MAX_LIVE];
    int n;
    long overlaps;
} hm_live = {PTHREAD_MUTEX_INITIALIZER, {{0, 0}}, 0, 0};

static void hm_add(uintptr_t lo, uintptr_t hi) {
    pthread_mutex_lock(&hm_live.lock);
    for (int i = 0; i < hm_live.n; i++)
        if (lo < hm_live.live[i].hi && hm_live.live[i].lo < hi) hm_live.overlaps++;
    if (hm_live.n < HM_MAX_LIVE) hm_live.live[hm_live.n++] = (hm_range){lo, hi};
    pthread_mutex_unlock(&hm_live.lock);
}

static void hm_remove(uintptr_t lo) {
    pthread_mutex_lock(&hm_live.lock);
    for (int i = 0; i < hm_live.n; i++)
        if (hm_live.live[i].lo == lo) {
            hm_live.live[i] = hm_live.live[--hm_live.n];
            break;
        }
    pthread_mutex_unlock(&hm_live.lock);
}

typedef struct hm_job {
    hm_malloc_fn m;
    hm_free_fn f;
    int device, iters, id;
    long allocs, failures;
    volatile int done;
} hm_job;

/* Static, not on hm_run's stack: a worker that outlives a timed-out hm_run must not write into a
   dead frame. */
static hm_job hm_jobs[HM_MAX_THREADS];
static pthread_t hm_threads[HM_MAX_THREADS];

static void *hm_worker(void *arg) {
    hm_job *j = arg;
    void *ptrs[HM_SLOTS] = {0};
    ssize_t sizes[HM_SLOTS] = {0};
    unsigned seed = (unsigned)j->id * 7919u + 1u;
    for (int it = 0; it < j->iters; it++) {
        int k = rand_r(&seed) % HM_SLOTS;
        if (ptrs[k]) {
            hm_remove((uintptr_t)ptrs[k]); /* before the free: the block may be handed out at once */
            j->f(ptrs[k], sizes[k], j->device, NULL);
            ptrs[k] = NULL;
        }
        /* Mostly small blocks (the cached path), sometimes up to 4 MiB (new segments). */
        ssize_t size = 1 + rand_r(&seed) % (rand_r(&seed) % 8 == 0 ? (4 << 20) : 4096);
        void *p = j->m(size, j->device, NULL);
        if (!p) {
            j->failures++;
            continue;
        }
        hm_add((uintptr_t)p, (uintptr_t)p + (uintptr_t)size);
        ptrs[k] = p;
        sizes[k] = size;
        j->allocs++;
    }
    for (int k = 0; k < HM_SLOTS; k++)
        if (ptrs[k]) {
            hm_remove((uintptr_t)ptrs[k]);
            j->f(ptrs[k], sizes[k], j->device, NULL);
        }
    j->done = 1;
    return NULL;
}

/* Runs nthreads workers of iters operations each on device. 0: all finished within timeout_s
   seconds, every malloc succeeded and no live blocks overlapped; else nonzero and why. */
static int hm_run(hm_malloc_fn m, hm_free_fn f, int device, int nthreads, int iters, int timeout_s,
                  long *allocs, char *why, size_t whylen) {
    struct timespec deadline;
    long total = 0, failures = 0;
    int started = 0, rc = 0;
    if (nthreads < 1 || nthreads > HM_MAX_THREADS) {
        snprintf(why, whylen, "nthreads must be 1..%d", HM_MAX_THREADS);
        return 1;
    }
    hm_live.n = 0;
    hm_live.overlaps = 0;
    for (int i = 0; i < nthreads; i++) {
        hm_jobs[i] = (hm_job){m, f, device, iters, i, 0, 0, 0};
        if (pthread_create(&hm_threads[i], NULL, hm_worker, &hm_jobs[i]) != 0) break;
        started++;
    }
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += timeout_s;
    for (int i = 0; i < started; i++) {
        int jr = pthread_timedjoin_np(hm_threads[i], NULL, &deadline);
        if (jr == ETIMEDOUT) {
            snprintf(why, whylen, "worker %d did not finish within %d s (blocked, e.g. on the GIL?)", i, timeout_s);
            return 2; /* the stuck workers are left running; their jobs are static */
        }
    }
    for (int i = 0; i < started; i++) {
        total += hm_jobs[i].allocs;
        failures += hm_jobs[i].failures;
    }
    *allocs = total;
    if (started != nthreads) {
        snprintf(why, whylen, "only %d of %d threads started", started, nthreads);
        rc = 3;
    } else if (failures) {
        snprintf(why, whylen, "%ld allocations failed", failures);
        rc = 4;
    } else if (hm_live.overlaps) {
        snprintf(why, whylen, "%ld overlaps between live blocks", hm_live.overlaps);
        rc = 5;
    }
    return rc;
}

#endif

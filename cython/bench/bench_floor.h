/* Microbenchmarks of the pool's cached path and their floors, in C (used by floor.pxi).
 *
 * Floor: a trivial thread-safe free list (one mutex, one singly linked list of equal blocks):
 * uncontended with a plain mutex (the cheapest: the pool's adaptive kind costs about 3 ns more
 * per pair here), contended with the pool's own adaptive kind (a plain mutex sleeps under
 * contention and is then several times slower than the pool, so it would be no floor).
 * malloc pops the head, free pushes it back, each under the lock, each a real (not inlined)
 * function call, as a call into the pool is. Nothing a caching allocator does on a warm hit
 * can cost less than this; the pool's figures are reported as a ratio to it.
 *
 * Measured: warm cached ap_pool_malloc/ap_pool_free pairs of one size in a C loop (the caller
 * releases the GIL), and the same with several threads on one pool or one free list, each
 * thread timing its own loop after a common start barrier.
 */
#ifndef AP_BENCH_FLOOR_H
#define AP_BENCH_FLOOR_H

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "pool.h"

#if defined(__GNUC__) && !defined(__clang__)
#define APB_NOINLINE __attribute__((noinline, noipa))
#else
#define APB_NOINLINE __attribute__((noinline))
#endif

enum { APB_KIND_FREELIST = 0, APB_KIND_POOL = 1 };
#define APB_MAX_THREADS 64

static inline int64_t apb_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

typedef struct apb_node {
    struct apb_node *next;
    char payload[56];
} apb_node;

enum { APB_UNLOCKED = 0, APB_LOCK_PLAIN = 1, APB_LOCK_ADAPTIVE = 2 };

typedef struct apb_freelist {
    pthread_mutex_t lock;
    int locked;       /* APB_LOCK_*: take the mutex in malloc and in free, as a thread-safe
                         allocator must */
    apb_node *head;
    apb_node *nodes;  /* backing array, freed by apb_freelist_destroy */
} apb_freelist;

static apb_freelist *apb_freelist_create(int locked, size_t n_nodes)
{
    apb_freelist *fl = (apb_freelist *)calloc(1, sizeof *fl);
    if (!fl)
        return NULL;
    fl->nodes = (apb_node *)calloc(n_nodes ? n_nodes : 1, sizeof(apb_node));
    if (!fl->nodes) {
        free(fl);
        return NULL;
    }
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    if (locked == APB_LOCK_ADAPTIVE) pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ADAPTIVE_NP);
    pthread_mutex_init(&fl->lock, &attr);
    pthread_mutexattr_destroy(&attr);
    fl->locked = locked;
    for (size_t i = 0; i < n_nodes; i++) {
        fl->nodes[i].next = fl->head;
        fl->head = &fl->nodes[i];
    }
    return fl;
}

static void apb_freelist_destroy(apb_freelist *fl)
{
    if (!fl)
        return;
    pthread_mutex_destroy(&fl->lock);
    free(fl->nodes);
    free(fl);
}

APB_NOINLINE static void *apb_fl_malloc(apb_freelist *fl, size_t size)
{
    apb_node *n;
    (void)size;
    if (fl->locked)
        pthread_mutex_lock(&fl->lock);
    n = fl->head;
    if (n)
        fl->head = n->next;
    if (fl->locked)
        pthread_mutex_unlock(&fl->lock);
    return n;
}

APB_NOINLINE static void apb_fl_free(apb_freelist *fl, void *p)
{
    apb_node *n = (apb_node *)p;
    if (fl->locked)
        pthread_mutex_lock(&fl->lock);
    n->next = fl->head;
    fl->head = n;
    if (fl->locked)
        pthread_mutex_unlock(&fl->lock);
}

/* ns per malloc+free pair over n pairs; -1 if the list ran dry (cannot happen with a node per
   thread). */
static double apb_fl_loop(apb_freelist *fl, size_t size, int64_t n)
{
    int64_t t0 = apb_now_ns();
    for (int64_t i = 0; i < n; i++) {
        void *p = apb_fl_malloc(fl, size);
        if (!p)
            return -1.0;
        apb_fl_free(fl, p);
    }
    return (double)(apb_now_ns() - t0) / (double)(n ? n : 1);
}

/* ns per ap_pool_malloc+ap_pool_free pair over n pairs; -1 and *status on a failed call. */
static double apb_pool_loop(ap_pool *p, size_t size, int64_t n, int *status)
{
    ap_error err;
    void *out = NULL;
    int rc;
    int64_t t0 = apb_now_ns();
    for (int64_t i = 0; i < n; i++) {
        rc = ap_pool_malloc(p, size, NULL, &out, &err);
        if (rc != AP_OK) {
            *status = rc;
            return -1.0;
        }
        rc = ap_pool_free(p, out, NULL, 1, &err);
        if (rc != AP_OK) {
            *status = rc;
            return -1.0;
        }
    }
    *status = AP_OK;
    return (double)(apb_now_ns() - t0) / (double)(n ? n : 1);
}

typedef struct apb_thread_arg {
    int kind;
    void *obj;
    size_t size;
    int64_t n;
    pthread_barrier_t *start;
    double ns;
    int status;
} apb_thread_arg;

static void *apb_thread_main(void *v)
{
    apb_thread_arg *a = (apb_thread_arg *)v;
    pthread_barrier_wait(a->start);
    if (a->kind == APB_KIND_POOL) {
        a->ns = apb_pool_loop((ap_pool *)a->obj, a->size, a->n, &a->status);
    } else {
        a->ns = apb_fl_loop((apb_freelist *)a->obj, a->size, a->n);
        a->status = a->ns < 0 ? -1 : 0;
    }
    return NULL;
}

/* Runs the loop of kind on obj in nthreads threads at once (all start at one barrier); each
   thread's ns per pair goes to ns_out[i]. Returns 0, a pool status, or -1 (thread creation or a
   dry free list). */
static int apb_run_threads(int kind, void *obj, size_t size, int64_t n, int nthreads, double *ns_out)
{
    pthread_t th[APB_MAX_THREADS];
    apb_thread_arg args[APB_MAX_THREADS];
    pthread_barrier_t start;
    int started = 0, rc = 0;
    if (nthreads < 1 || nthreads > APB_MAX_THREADS)
        return -1;
    if (pthread_barrier_init(&start, NULL, (unsigned)nthreads) != 0)
        return -1;
    for (int i = 0; i < nthreads; i++) {
        args[i].kind = kind;
        args[i].obj = obj;
        args[i].size = size;
        args[i].n = n;
        args[i].start = &start;
        args[i].ns = -1.0;
        args[i].status = 0;
    }
    /* threads 1..n-1 run on their own; the caller's thread is thread 0 */
    for (int i = 1; i < nthreads; i++) {
        if (pthread_create(&th[i], NULL, apb_thread_main, &args[i]) != 0) {
            rc = -1;
            break;
        }
        started++;
    }
    if (rc != 0) {
        /* release the ones waiting at the barrier: they can never complete it, so cancel them */
        for (int i = 1; i <= started; i++) {
            pthread_cancel(th[i]);
            pthread_join(th[i], NULL);
        }
        pthread_barrier_destroy(&start);
        return -1;
    }
    apb_thread_main(&args[0]);
    for (int i = 1; i < nthreads; i++)
        pthread_join(th[i], NULL);
    pthread_barrier_destroy(&start);
    for (int i = 0; i < nthreads; i++) {
        ns_out[i] = args[i].ns;
        if (args[i].status != 0 && rc == 0)
            rc = args[i].status;
    }
    return rc;
}

#endif

/* The per-device bound on idle cached events of all of a process's pools (stream_order.c,
 * AP_EVENT_CACHE_MAX): pools of one device, each under its own lock (here: each in its own thread),
 * put events back at once; together they never keep more than the bound. The bound was checked and
 * then counted in two steps: two pools that both saw one place left both took it.
 * core: stream_order.c */
#include <pthread.h>
#include <stdarg.h>
#include <string.h>

#include "check.h"
#include "pool_internal.h"

/* stream_order.c's other callees: not reached by the event cache. */
__thread uint64_t ap_history_tls_ctx;
void ap_cache_flush(ap_pool *p) { (void)p; }
ap_block *ap_tree_best_fit(const ap_free_tree *t, size_t size) { (void)t; (void)size; return NULL; }
ap_block *ap_free_insert(ap_pool *p, ap_block *b, int tag) { (void)p; (void)tag; return b; }
void ap_free_remove(ap_pool *p, ap_block *b) { (void)p; (void)b; }
void ap_free_retag_slot(ap_pool *p, int from, int to) { (void)p; (void)from; (void)to; }
void ap_history_record_ctx(ap_history *h, int action, uintptr_t addr, size_t size, void *stream, uint64_t ctx) {
    (void)h; (void)action; (void)addr; (void)size; (void)stream; (void)ctx;
}
int ap_set_error(ap_error *err, int status, int device_code, const char *fmt, ...) {
    (void)err; (void)device_code; (void)fmt;
    return status;
}

#define POOLS 8
#define TAKE 24  /* events each pool takes and puts back per round: 8 x 24 > the bound */
#define ROUNDS 3000

static atomic_long next_event = 1;
static int fake_set_device(ap_backend *b, int device) { (void)b; (void)device; return 0; }
static int fake_event_create(ap_backend *b, int device, void **event) {
    (void)b; (void)device;
    *event = (void *)(uintptr_t)atomic_fetch_add(&next_event, 1);
    return 0;
}
static int fake_event_destroy(ap_backend *b, void *event) { (void)b; (void)event; return 0; }

static ap_backend backend;
static ap_pool pools[POOLS];
static pthread_barrier_t barrier;
static int over; /* the most idle events all pools held together after a round, past the bound */

static void *run(void *arg) {
    ap_pool *p = arg;
    void *ev[TAKE];
    for (int r = 0; r < ROUNDS; r++) {
        for (int i = 0; i < TAKE; i++) {
            ev[i] = ap_event_get(p, NULL); /* nothing is parked here: from the cache or new */
            CHECK(ev[i] != NULL);
        }
        pthread_barrier_wait(&barrier);
        for (int i = 0; i < TAKE; i++)
            ap_event_put(p, ev[i]);
        if (pthread_barrier_wait(&barrier) == PTHREAD_BARRIER_SERIAL_THREAD) {
            int idle = 0;
            for (int k = 0; k < POOLS; k++)
                idle += pools[k].n_cached_events;
            if (idle > AP_EVENT_CACHE_MAX && idle > over)
                over = idle;
        }
        pthread_barrier_wait(&barrier);
    }
    return NULL;
}

int main(void) {
    pthread_t t[POOLS];
    backend.set_device = fake_set_device;
    backend.event_create = fake_event_create;
    backend.event_destroy = fake_event_destroy;
    backend.device_count = 1;
    CHECK(pthread_barrier_init(&barrier, NULL, POOLS) == 0);
    for (int k = 0; k < POOLS; k++) {
        pools[k].backend = &backend;
        pools[k].device = 0;
        pools[k].event_cache_max = AP_EVENT_CACHE_MAX;
        CHECK(pthread_create(&t[k], NULL, run, &pools[k]) == 0);
    }
    for (int k = 0; k < POOLS; k++)
        pthread_join(t[k], NULL);
    if (over)
        fprintf(stderr, "the pools of one device held %d idle events together (bound %d)\n", over, AP_EVENT_CACHE_MAX);
    CHECK_EQ(over, 0);
    for (int k = 0; k < POOLS; k++) {
        ap_events_trim(&pools[k], 0);
        free(pools[k].event_cache);
    }
    printf("test_event_cache: ok\n");
    return 0;
}

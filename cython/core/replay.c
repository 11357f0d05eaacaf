#include "replay.h"

#include <string.h>
#include <time.h>

#include "pool_internal.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int64_t device_calls(ap_pool *p, int mode, const ap_replay_result *r) {
    if (mode == AP_REPLAY_DIRECT) return r->device_mallocs + r->device_frees;
    return p->stats.num_device_alloc + p->stats.num_device_free + p->stats.num_device_map + p->stats.num_device_unmap;
}

/* The pool's external fragmentation (the ascend_pool_fragmentation_ratio metric: 1 - largest free
   block / cached free bytes, 0 when nothing is cached), read as the metric would read it. */
static double pool_fragmentation(ap_pool *p) {
    ap_stats st;
    ap_pool_get_stats(p, &st);
    return st.cached_free_bytes > 0 ? 1.0 - (double)st.largest_free_block / (double)st.cached_free_bytes : 0.0;
}

/* A direct device call's failure as the pool's own are (segments.c): status AP_E_DEVICE with the
   runtime's code and reason, not the bare runtime code as the status, which the caller's error map
   does not know (a "pool call failed (207001)" PoolError with no cause). */
static int direct_error(ap_backend *b, int device, ap_error *err, int rc, const char *what, int64_t size) {
    char msg[AP_RUNTIME_MSG];
    b->error_message(b, rc, msg, sizeof msg);
    return ap_set_error(err, AP_E_DEVICE, rc, "%s of %lld bytes on device %d failed (%d): %s", what,
                        (long long)size, device, rc, msg);
}

static void cleanup(ap_pool *p, ap_backend *b, int device, int mode, void **ptrs, size_t n_slots) {
    for (size_t i = 0; i < n_slots; i++) {
        if (!ptrs[i]) continue;
        if (mode == AP_REPLAY_POOL) ap_pool_free(p, ptrs[i], NULL, 1, NULL);
        else b->free(b, device, ptrs[i]);
        ptrs[i] = NULL;
    }
}

int ap_replay(ap_pool *p, ap_backend *b, int device, int mode, const int8_t *op, const int32_t *slot,
              const int64_t *size, const int32_t *stream, size_t n, void **streams, void **ptrs, size_t n_slots,
              ap_replay_result *r) {
    memset(r, 0, sizeof *r);
    r->failed_index = -1;
    memset(ptrs, 0, n_slots * sizeof *ptrs);
    int64_t live = 0, reserved_direct = 0, calls_at_half = 0, reserved_high = 0;
    size_t half = n / 2;
    int64_t mallocs0 = p ? p->stats.num_device_alloc : 0, frees0 = p ? p->stats.num_device_free : 0;
    double t0 = now_s();
    for (size_t i = 0; i < n; i++) {
        if (i == half) calls_at_half = device_calls(p, mode, r);
        int32_t s = slot[i];
        if (op[i]) {
            void *ptr = NULL;
            int rc;
            if (mode == AP_REPLAY_POOL) {
                rc = ap_pool_malloc(p, (size_t)size[i], streams[stream[i]], &ptr, &r->error);
            } else {
                rc = b->malloc(b, device, &ptr, (size_t)size[i]);
                if (rc) rc = direct_error(b, device, &r->error, rc, "device malloc", size[i]);
                else {
                    r->device_mallocs++;
                    reserved_direct += (int64_t)b->device_size(b, (size_t)size[i]);
                    if (reserved_direct > r->peak_reserved_bytes) r->peak_reserved_bytes = reserved_direct;
                }
            }
            if (rc) {
                r->failed_index = (int64_t)i;
                cleanup(p, b, device, mode, ptrs, n_slots);
                return rc;
            }
            ptrs[s] = ptr;
            /* fragmentation at the peak of reserved memory: read each time a malloc sets a new high
               (rare: at most once per growth), so the value kept is the one at the final peak */
            if (mode == AP_REPLAY_POOL && ap_stat_all_current(&p->stats, AP_STAT_RESERVED_BYTES) > reserved_high) {
                reserved_high = ap_stat_all_current(&p->stats, AP_STAT_RESERVED_BYTES);
                r->fragmentation_at_peak = pool_fragmentation(p);
            }
            live += size[i];
            if (live > r->peak_live_bytes) r->peak_live_bytes = live;
            r->allocs++;
        } else {
            int rc;
            if (mode == AP_REPLAY_POOL) {
                rc = ap_pool_free(p, ptrs[s], streams[stream[i]], 0, &r->error);
            } else {
                rc = b->free(b, device, ptrs[s]);
                if (rc) rc = direct_error(b, device, &r->error, rc, "device free", size[i]);
                else {
                    r->device_frees++;
                    reserved_direct -= (int64_t)b->device_size(b, (size_t)size[i]);
                }
            }
            if (rc) {
                r->failed_index = (int64_t)i;
                cleanup(p, b, device, mode, ptrs, n_slots);
                return rc;
            }
            ptrs[s] = NULL;
            live -= size[i];
            r->frees++;
        }
    }
    r->seconds = now_s() - t0;
    r->device_calls_steady = device_calls(p, mode, r) - calls_at_half;
    if (mode == AP_REPLAY_POOL) {
        r->device_mallocs = p->stats.num_device_alloc - mallocs0;
        r->device_frees = p->stats.num_device_free - frees0;
        r->peak_reserved_bytes = p->stats.s[AP_STAT_RESERVED_BYTES][AP_STAT_ALL].peak;
        r->final_allocated_bytes = ap_stat_all_current(&p->stats, AP_STAT_ALLOCATED_BYTES);
    } else {
        r->final_allocated_bytes = reserved_direct;
    }
    /* what the trace leaves allocated (a snapshot's live tensors) is freed, its figure taken: no one
       else has these pointers, and a pool closed with them would warn the user to free blocks that
       were the replay's own */
    cleanup(p, b, device, mode, ptrs, n_slots);
    return AP_OK;
}

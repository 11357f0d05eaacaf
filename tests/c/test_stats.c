/* The counters (cython/core/stats.{c,h}): current, peak and freed arithmetic (allocated is
 * current + freed), "all" as the sum of the pools, peak resets, and the active stats derived from
 * allocated + pending as readers see them (ap_stats_export).
 * core: stats.c */
#include <string.h>

#include "check.h"
#include "stats.h"

enum { SMALL = 0, LARGE = 1 }; /* AP_POOL_SMALL / AP_POOL_LARGE (block.h) */

/* As readers see it: "all" derived from the pools (stats.h) */
static ap_stat stat(const ap_stats *st, int which, int type) { return ap_stat_read(st, which, type); }

#define CHECK_STAT(st_, which, type, cur, pk, fr)            \
    do {                                                      \
        const ap_stat s_ = stat((st_), (which), (type));      \
        CHECK_EQ(s_.current, (cur));                          \
        CHECK_EQ(s_.peak, (pk));                              \
        CHECK_EQ(s_.freed, (fr));                             \
    } while (0)

static void arithmetic(void) {
    ap_stats st;
    memset(&st, 0, sizeof st);
    ap_stat_inc(&st, AP_STAT_ALLOCATED_BYTES, SMALL, 512);
    ap_stat_inc(&st, AP_STAT_ALLOCATED_BYTES, LARGE, 1 << 21);
    ap_stat_inc(&st, AP_STAT_ALLOCATED_BYTES, SMALL, 1024);
    CHECK_STAT(&st, AP_STAT_ALLOCATED_BYTES, AP_STAT_SMALL, 1536, 1536, 0);
    CHECK_STAT(&st, AP_STAT_ALLOCATED_BYTES, AP_STAT_LARGE, 1 << 21, 1 << 21, 0);
    CHECK_STAT(&st, AP_STAT_ALLOCATED_BYTES, AP_STAT_ALL, 1536 + (1 << 21), 1536 + (1 << 21), 0);
    ap_stat_dec(&st, AP_STAT_ALLOCATED_BYTES, SMALL, 512);
    ap_stat_dec(&st, AP_STAT_ALLOCATED_BYTES, LARGE, 1 << 21);
    /* peaks stay, freed grows; allocated (current + freed) is every byte ever counted in */
    CHECK_STAT(&st, AP_STAT_ALLOCATED_BYTES, AP_STAT_SMALL, 1024, 1536, 512);
    CHECK_STAT(&st, AP_STAT_ALLOCATED_BYTES, AP_STAT_LARGE, 0, 1 << 21, 1 << 21);
    CHECK_STAT(&st, AP_STAT_ALLOCATED_BYTES, AP_STAT_ALL, 1024, 1536 + (1 << 21), 512 + (1 << 21));
    const ap_stat all = stat(&st, AP_STAT_ALLOCATED_BYTES, AP_STAT_ALL);
    CHECK_EQ(all.current + all.freed, 1536 + (1 << 21));
    /* A new peak is a new high, not a sum of increases. */
    ap_stat_inc(&st, AP_STAT_ALLOCATED_BYTES, SMALL, 256);
    CHECK_STAT(&st, AP_STAT_ALLOCATED_BYTES, AP_STAT_SMALL, 1280, 1536, 512);
    ap_stat_inc(&st, AP_STAT_ALLOCATED_BYTES, SMALL, 1024);
    CHECK_STAT(&st, AP_STAT_ALLOCATED_BYTES, AP_STAT_SMALL, 2304, 2304, 512);
    /* Other stats are untouched. */
    CHECK_STAT(&st, AP_STAT_ALLOCATION, AP_STAT_ALL, 0, 0, 0);
    CHECK_STAT(&st, AP_STAT_REQUESTED_BYTES, AP_STAT_SMALL, 0, 0, 0);
    /* A reset brings peaks down to current and keeps the totals. */
    ap_stats_reset_peaks(&st);
    CHECK_STAT(&st, AP_STAT_ALLOCATED_BYTES, AP_STAT_SMALL, 2304, 2304, 512);
    CHECK_STAT(&st, AP_STAT_ALLOCATED_BYTES, AP_STAT_LARGE, 0, 0, 1 << 21);
    CHECK_STAT(&st, AP_STAT_ALLOCATED_BYTES, AP_STAT_ALL, 2304, 2304, 512 + (1 << 21));
}

/* Active = allocated + pending (blocks freed but waiting for other streams' events). */
static void active_derived(void) {
    ap_stats st, out;
    memset(&st, 0, sizeof st);
    ap_stat_inc(&st, AP_STAT_ALLOCATION, LARGE, 1);
    ap_stat_inc(&st, AP_STAT_ALLOCATED_BYTES, LARGE, 4 << 20);
    ap_stat_inc(&st, AP_STAT_ALLOCATION, LARGE, 1);
    ap_stat_inc(&st, AP_STAT_ALLOCATED_BYTES, LARGE, 2 << 20);
    /* Nothing waits: active is allocated. */
    ap_stats_export(&st, &out);
    CHECK_STAT(&out, AP_STAT_ACTIVE, AP_STAT_ALL, 2, 2, 0);
    CHECK_STAT(&out, AP_STAT_ACTIVE_BYTES, AP_STAT_LARGE, 6 << 20, 6 << 20, 0);
    CHECK_EQ(out.pending_free_blocks, 0);
    /* The 4 MiB block is freed but waits: no longer allocated, still active. */
    ap_stat_dec(&st, AP_STAT_ALLOCATION, LARGE, 1);
    ap_stat_dec(&st, AP_STAT_ALLOCATED_BYTES, LARGE, 4 << 20);
    ap_stats_pending(&st, LARGE, 4 << 20, +1);
    ap_stats_export(&st, &out);
    CHECK_STAT(&out, AP_STAT_ALLOCATED_BYTES, AP_STAT_LARGE, 2 << 20, 6 << 20, 4 << 20);
    CHECK_STAT(&out, AP_STAT_ACTIVE_BYTES, AP_STAT_LARGE, 6 << 20, 6 << 20, 0);
    CHECK_STAT(&out, AP_STAT_ACTIVE, AP_STAT_ALL, 2, 2, 0);
    CHECK_EQ(out.pending_free_blocks, 1);
    CHECK_EQ(out.pending_free_bytes, 4 << 20);
    CHECK_STAT(&out, AP_STAT_ACTIVE_BYTES, AP_STAT_SMALL, 0, 0, 0);
    /* A new allocation while it waits: active reaches 9 MiB, a peak only note_active records. */
    ap_stat_inc(&st, AP_STAT_ALLOCATION, LARGE, 1);
    ap_stat_inc(&st, AP_STAT_ALLOCATED_BYTES, LARGE, 3 << 20);
    ap_stats_note_active(&st, LARGE);
    ap_stats_export(&st, &out);
    CHECK_STAT(&out, AP_STAT_ACTIVE_BYTES, AP_STAT_ALL, 9 << 20, 9 << 20, 0);
    CHECK_STAT(&out, AP_STAT_ACTIVE, AP_STAT_LARGE, 3, 3, 0);
    CHECK_STAT(&out, AP_STAT_ALLOCATED_BYTES, AP_STAT_ALL, 5 << 20, 6 << 20, 4 << 20);
    /* Its events complete: it stops being active, and is freed in the active stats. */
    ap_stats_pending(&st, LARGE, 4 << 20, -1);
    ap_stats_export(&st, &out);
    CHECK_STAT(&out, AP_STAT_ACTIVE_BYTES, AP_STAT_LARGE, 5 << 20, 9 << 20, 4 << 20);
    CHECK_STAT(&out, AP_STAT_ACTIVE, AP_STAT_ALL, 2, 3, 1);
    CHECK_EQ(out.pending_free_bytes, 0);
    /* Reset: the active peak falls to what is active now. */
    ap_stats_reset_peaks(&st);
    ap_stats_export(&st, &out);
    CHECK_STAT(&out, AP_STAT_ACTIVE_BYTES, AP_STAT_LARGE, 5 << 20, 5 << 20, 4 << 20);
    CHECK_STAT(&out, AP_STAT_ALLOCATED_BYTES, AP_STAT_LARGE, 5 << 20, 5 << 20, 4 << 20);
    /* export leaves the source alone */
    CHECK_STAT(&st, AP_STAT_ACTIVE_BYTES, AP_STAT_LARGE, 0, 0, 0);
}

int main(void) {
    arithmetic();
    active_derived();
    puts("test_stats: ok");
    return 0;
}

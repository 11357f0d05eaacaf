/* Counters in PyTorch's memory_stats() schema: each stat has current/peak/allocated/freed for
 * all, small_pool and large_pool. Updated under the pool lock; read by copying the struct.
 *
 * "all" is the sum of the pools: inside the pool its current and freed are not stored (left 0),
 * only its peak; ap_stat_read and ap_stat_all_current derive them, and ap_stats_export fills them
 * in for readers. So an update writes one pool's counters alone (the cached path's stores: the
 * atomic unlock that follows waits for every one). */
#ifndef AP_STATS_H
#define AP_STATS_H

#include <stdint.h>

#include "invariant.h"

/* allocated (the running total of increases) is not stored: it is always current + freed. */
typedef struct ap_stat {
    int64_t current, peak, freed;
} ap_stat;

enum {
    AP_STAT_ALLOCATION = 0,
    AP_STAT_SEGMENT,
    AP_STAT_ACTIVE,
    AP_STAT_INACTIVE_SPLIT,
    AP_STAT_ALLOCATED_BYTES,
    AP_STAT_RESERVED_BYTES,
    AP_STAT_ACTIVE_BYTES,
    AP_STAT_INACTIVE_SPLIT_BYTES,
    AP_STAT_REQUESTED_BYTES,
    AP_N_STATS
};

enum { AP_STAT_ALL = 0, AP_STAT_SMALL = 1, AP_STAT_LARGE = 2, AP_N_STAT_TYPES };

typedef struct ap_stats {
    ap_stat s[AP_N_STATS][AP_N_STAT_TYPES];
    /* Inside the pool, active = allocated + pending (freed blocks that wait for other streams'
       events, record_stream), so allocations and frees update no active counters:
       pending[0] counts blocks and pending[1] bytes, their `current` what waits now and their
       `peak` the active peak reached while something waited. ap_stats_export fills s[ACTIVE*]. */
    ap_stat pending[2][AP_N_STAT_TYPES];
    /* PyTorch's oversize_allocations [0] and oversize_segments [1]: large-pool blocks and segments
       of max_split_size or more (never split; none while max_split_size is off). No pool split. */
    ap_stat oversize[2];
    int64_t num_alloc_retries;
    int64_t num_ooms;
    int64_t num_sync_all_streams;
    int64_t num_device_alloc;
    int64_t num_device_free;
    int64_t num_device_map;      /* expandable segments: chunks mapped / unmapped */
    int64_t num_device_unmap;
    int64_t num_quota_exceeded;
    int64_t num_oom_rejections;  /* refused by the pool's cap (memory fraction, set_limit) before any
                                    device call: torch's num_oom_rejections (also in num_ooms) */
    int64_t events_created;      /* events ever created by the pool's event cache */
    int64_t stream_migrations;   /* times a stream was ordered after another to reuse its blocks */
    int64_t pending_free_bytes;  /* bytes of blocks waiting for events before reuse (filled in by */
    int64_t pending_free_blocks; /* ap_stats_export from pending[][AP_STAT_ALL]) */
    /* Filled in when a snapshot of the stats is taken (not maintained incrementally). */
    int64_t largest_free_block;
    int64_t cached_free_bytes;
    int64_t device_free_bytes;
    int64_t device_total_bytes;
} ap_stats;

/* current of "all" for a stat: the sum of the pools' (its own is not stored). */
static inline int64_t ap_stat_all_current(const ap_stats *st, int stat) {
    return st->s[stat][AP_STAT_SMALL].current + st->s[stat][AP_STAT_LARGE].current;
}

/* A stat as readers see it (type AP_STAT_ALL: current and freed the pools' sums). */
static inline ap_stat ap_stat_read(const ap_stats *st, int stat, int type) {
    ap_stat r = st->s[stat][type];
    if (type == AP_STAT_ALL) {
        r.current = ap_stat_all_current(st, stat);
        r.freed = st->s[stat][AP_STAT_SMALL].freed + st->s[stat][AP_STAT_LARGE].freed;
    }
    return r;
}

/* Adds n (>= 0) to a stat for pool (AP_POOL_SMALL or AP_POOL_LARGE), and so to "all"; the cached
   path's updates. Inline with constant indices. A peak is written only when passed, so the usual
   update is one store (the atomic unlock that follows waits for every store). */
static inline void ap_stat_inc(ap_stats *st, int stat, int pool, int64_t n) {
    ap_stat *a = &st->s[stat][AP_STAT_ALL], *b = &st->s[stat][1 + pool];
    AP_ASSERT(n >= 0 && (pool == 0 || pool == 1));
    b->current += n;
    if (__builtin_expect(b->current > b->peak, 0)) b->peak = b->current;
    int64_t all = ap_stat_all_current(st, stat);
    if (__builtin_expect(all > a->peak, 0)) a->peak = all;
}

/* One counter without pool split (the oversize stats): +1 or -1. */
static inline void ap_stat_step(ap_stat *a, int sign) {
    if (sign > 0) {
        if (++a->current > a->peak) a->peak = a->current;
    } else {
        a->current--;
        a->freed++;
        AP_ASSERT(a->current >= 0);
    }
}

/* Takes n (>= 0) off: current falls, freed (the running total of decreases) grows. Nothing can
   be freed that was not counted in, so no current ever goes below 0. */
static inline void ap_stat_dec(ap_stats *st, int stat, int pool, int64_t n) {
    ap_stat *b = &st->s[stat][1 + pool];
    AP_ASSERT(n >= 0);
    b->current -= n;
    b->freed += n;
    AP_ASSERT(b->current >= 0 && ap_stat_all_current(st, stat) >= b->current);
}
/* A block of pool kind `pool` and `bytes` starts (+1) or stops (-1) waiting for events. */
static inline void ap_stats_pending(ap_stats *st, int pool, int64_t bytes, int sign) {
    int types[2] = {AP_STAT_ALL, 1 + pool};
    for (int t = 0; t < 2; t++) {
        st->pending[0][types[t]].current += sign;
        st->pending[1][types[t]].current += sign * bytes;
        AP_ASSERT(st->pending[0][types[t]].current >= 0 && st->pending[1][types[t]].current >= 0);
    }
}

/* Records the active peak after an allocation of kind `pool` made while blocks are pending. */
void ap_stats_note_active(ap_stats *st, int pool);
/* Resets every peak to its current value. */
void ap_stats_reset_peaks(ap_stats *st);
/* Copies st into out with the active stats derived (the form readers see). */
void ap_stats_export(const ap_stats *st, ap_stats *out);

#endif

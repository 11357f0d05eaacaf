/* Counters in PyTorch's memory_stats() schema: each stat has current/peak/allocated/freed for
 * all, small_pool and large_pool. Updated under the pool lock; read by copying the struct. */
#ifndef AP_STATS_H
#define AP_STATS_H

#include <stdint.h>

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
    int64_t num_alloc_retries;
    int64_t num_ooms;
    int64_t num_sync_all_streams;
    int64_t num_device_alloc;
    int64_t num_device_free;
    int64_t num_device_map;      /* expandable segments: chunks mapped / unmapped */
    int64_t num_device_unmap;
    int64_t num_quota_exceeded;
    int64_t events_created;      /* events ever created by the pool's event cache */
    int64_t stream_migrations;   /* times a stream was ordered after another to reuse its blocks */
    int64_t pending_free_bytes;  /* bytes of blocks waiting for events before reuse */
    int64_t pending_free_blocks;
    /* Filled in when a snapshot of the stats is taken (not maintained incrementally). */
    int64_t largest_free_block;
    int64_t cached_free_bytes;
    int64_t device_free_bytes;
    int64_t device_total_bytes;
} ap_stats;

static inline void ap_stat_add_one(ap_stat *s, int64_t delta) {
    s->current += delta;
    if (delta > 0) {
        if (s->current > s->peak) s->peak = s->current;
    } else {
        s->freed -= delta;
    }
}

/* pool: AP_POOL_SMALL or AP_POOL_LARGE; adds delta to the stat for "all" and for the pool.
   Inline: the hot path makes several of these per call, with constant indices. */
static inline void ap_stat_add(ap_stats *st, int stat, int pool, int64_t delta) {
    ap_stat_add_one(&st->s[stat][AP_STAT_ALL], delta);
    ap_stat_add_one(&st->s[stat][1 + pool], delta);
}

/* The same for a known sign (no branch on it): the cached path's updates. */
static inline void ap_stat_inc(ap_stats *st, int stat, int pool, int64_t n) {
    ap_stat *a = &st->s[stat][AP_STAT_ALL], *b = &st->s[stat][1 + pool];
    a->current += n;
    a->peak = a->current > a->peak ? a->current : a->peak;
    b->current += n;
    b->peak = b->current > b->peak ? b->current : b->peak;
}

static inline void ap_stat_dec(ap_stats *st, int stat, int pool, int64_t n) {
    ap_stat *a = &st->s[stat][AP_STAT_ALL], *b = &st->s[stat][1 + pool];
    a->current -= n;
    a->freed += n;
    b->current -= n;
    b->freed += n;
}
/* Resets every peak to its current value. */
void ap_stats_reset_peaks(ap_stats *st);

#endif

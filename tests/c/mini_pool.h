/* A minimal pool for the tests of the free-block layer (free_blocks.c, free_cache.c): an ap_pool
 * with its config, three stream slots and segments made by hand, no backend, no device. The
 * allocation and free helpers do what pool.c's cached path does around those files (mark
 * allocated with stats / take the stats off, then cache or coalesce), so the tests see the same
 * state the pool would. recount() walks everything and checks the invariants check.c checks. */
#ifndef AP_TEST_MINI_POOL_H
#define AP_TEST_MINI_POOL_H

#include <string.h>

#include "check.h"
#include "pool_internal.h"

#define MP_SLOTS 3 /* slot 0: any stream; 1 and 2: two live streams */

static inline ap_pool *mp_create(void) {
    ap_pool *p = calloc(1, sizeof *p);
    CHECK(p != NULL);
    p->cfg.min_block = 512;
    p->cfg.small_size = 1 << 20;
    p->cfg.small_segment = 2 << 20;
    p->cfg.page_size = 2 << 20;
    p->cfg.large_split_min = 1 << 20;
    p->cfg.max_split_size = AP_NO_LIMIT;
    p->slots = calloc(MP_SLOTS, sizeof *p->slots);
    CHECK(p->slots != NULL);
    p->n_slots = p->slots_cap = MP_SLOTS;
    for (int s = 0; s < MP_SLOTS; s++) {
        p->slots[s].live = 1;
        p->slots[s].stream = (void *)(uintptr_t)s;
    }
    return p;
}

static inline void mp_destroy(ap_pool *p) {
    ap_arena_destroy(p);
    free(p->slots);
    free(p);
}

/* A new segment of size bytes at base, one free block. */
static inline ap_segment *mp_segment(ap_pool *p, uintptr_t base, size_t size, int pool) {
    ap_segment *s = ap_segment_new(p);
    ap_block *b = ap_block_new(p);
    CHECK(s && b);
    s->base = base;
    s->size = size;
    s->pool = pool;
    s->first = b;
    ap_segment_link(p, s);
    ap_stat_inc(&p->stats, AP_STAT_RESERVED_BYTES, pool, (int64_t)size);
    b->seg = s;
    b->addr = base;
    b->size = size;
    ap_free_insert(p, b, 0);
    return s;
}

/* pool.c's allocation path: a recent-free cache hit, else best fit (after a flush when the cache
   could change it), and split. */
static inline ap_block *mp_alloc(ap_pool *p, int slot, size_t size, int pool) {
    size_t rsize = (size + 511) & ~(size_t)511;
    int keyed = 0;
    ap_block *b = pool == AP_POOL_SMALL && p->n_cached ? ap_cache_hit(p, slot, rsize, &keyed) : NULL;
    if (b) {
        ap_mark_allocated_in(p, b, size, slot, AP_POOL_SMALL);
        return b;
    }
    b = ap_find_fit(p, slot, pool, rsize);
    if (ap_cache_must_flush(p, pool, slot, rsize, b, keyed)) {
        ap_cache_flush(p);
        b = ap_find_fit(p, slot, pool, rsize);
    }
    if (!b) return NULL;
    ap_take_block(p, b, rsize, size, slot);
    CHECK(b->state == AP_BLOCK_ALLOCATED && b->size >= rsize);
    return b;
}

/* pool.c's release_block without record_stream uses: the block's stats off, then cached (small,
   isolated, when use_cache) or coalesced into the trees. Returns the block that now holds its
   bytes. */
static inline ap_block *mp_free(ap_pool *p, ap_block *b, int tag, int use_cache) {
    int pool = b->seg->pool;
    CHECK(b->state == AP_BLOCK_ALLOCATED);
    ap_stat_dec(&p->stats, AP_STAT_ALLOCATION, pool, 1);
    ap_stat_dec(&p->stats, AP_STAT_ALLOCATED_BYTES, pool, (int64_t)b->size);
    ap_stat_dec(&p->stats, AP_STAT_REQUESTED_BYTES, pool, (int64_t)b->requested);
    if (use_cache && pool == AP_POOL_SMALL && ap_cache_isolated(b, tag)) {
        ap_cache_push_small(p, b, tag);
        return b;
    }
    return ap_free_insert(p, b, tag);
}

typedef struct {
    const ap_block *want;
    int found;
} mp_find;

static inline int mp_find_visit(ap_block *b, void *arg) {
    mp_find *f = arg;
    if (b == f->want) f->found = 1;
    return f->found || b->size > f->want->size; /* past its size: it is not there */
}

/* 1 when b is in tree t. */
static inline int mp_in_tree(const ap_free_tree *t, const ap_block *b) {
    mp_find f = {b, 0};
    ap_tree_walk_from(t, b->size, mp_find_visit, &f);
    return f.found;
}

static inline int mp_compatible(int a, int b) { return a == b || !a || !b; }

/* Every invariant of the block layer, against a recount: tiling and links, no two free neighbours
   that should have merged, each free block in the tree of its tag and pool, tree order and
   counts, the split and allocation stats. */
static inline void mp_recount(ap_pool *p) {
    int64_t alloc_n[2] = {0}, alloc_b[2] = {0}, split_n[2] = {0}, split_b[2] = {0};
    size_t in_trees = 0, free_blocks = 0, whole_free = 0;
    for (int s = 0; s < p->n_slots; s++)
        for (int k = 0; k < 2; k++) {
            CHECK(ap_tree_check(&p->slots[s].trees[k]));
            in_trees += p->slots[s].trees[k].count;
        }
    for (ap_segment *s = p->segments; s; s = s->next) {
        uintptr_t at = s->base;
        CHECK(s->first && s->first->prev == NULL);
        for (ap_block *b = s->first; b; b = b->next) {
            CHECK(b->seg == s && b->addr == at && b->size > 0 && b->size % 512 == 0);
            CHECK(ap_block_links_ok(b));
            at += b->size;
            if (b->state == AP_BLOCK_ALLOCATED) {
                alloc_n[s->pool]++;
                alloc_b[s->pool] += (int64_t)b->size;
            } else if (b->state == AP_BLOCK_FREE) {
                free_blocks++;
                whole_free += !b->prev && !b->next;
                CHECK(b->counted_split == (b->prev || b->next));
                split_n[s->pool] += b->counted_split;
                split_b[s->pool] += b->counted_split ? (int64_t)b->size : 0;
                CHECK(b->tag < p->n_slots && mp_in_tree(&p->slots[b->tag].trees[s->pool], b));
                CHECK(!b->next || b->next->state != AP_BLOCK_FREE || !mp_compatible(b->tag, b->next->tag));
            } else {
                CHECK(b->state == AP_BLOCK_CACHED && !b->counted_split && ap_cache_isolated(b, b->tag));
            }
        }
        CHECK(at == s->base + s->size);
    }
    CHECK_EQ(in_trees, free_blocks);
    uint32_t exact[AP_EXACT_BUCKETS] = {0};
    for (ap_segment *s = p->segments; s; s = s->next)
        for (ap_block *b = s->first; b; b = b->next)
            if (b->state == AP_BLOCK_FREE && s->pool == AP_POOL_SMALL) exact[ap_exact_bucket(b->size, b->tag)]++;
    for (int i = 0; i < AP_EXACT_BUCKETS; i++) CHECK_EQ(exact[i], p->small_exact[i]);
    CHECK_EQ(whole_free, p->n_free_segments);
    for (int k = 0; k < 2; k++) {
        CHECK_EQ(p->stats.s[AP_STAT_ALLOCATION][1 + k].current, alloc_n[k]);
        CHECK_EQ(p->stats.s[AP_STAT_ALLOCATED_BYTES][1 + k].current, alloc_b[k]);
        CHECK_EQ(p->stats.s[AP_STAT_INACTIVE_SPLIT][1 + k].current, split_n[k]);
        CHECK_EQ(p->stats.s[AP_STAT_INACTIVE_SPLIT_BYTES][1 + k].current, split_b[k]);
    }
    CHECK_EQ(ap_stat_read(&p->stats, AP_STAT_INACTIVE_SPLIT_BYTES, AP_STAT_ALL).current, split_b[0] + split_b[1]);
}

#endif

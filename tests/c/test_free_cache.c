/* The recent-free cache (cython/core/free_cache.{c,h}) on a minimal pool. It must be invisible:
 * only an isolated block is parked; a hit needs the exact size and stream, takes the first such
 * block in tree order (expandable: the lowest address, and only if it pins no new page), and is
 * refused while the stream's tree holds a block of exactly that size;
 * freeing a cached block's neighbour merges them at once; any other small request flushes first.
 * A random differential run checks that a pool with the cache places every block exactly where
 * the same pool without it does, and the merged view of the stats equals what a flush shows.
 * core: free_cache.c free_blocks.c free_tree.c block_arena.c stats.c */
#include "mini_pool.h"

#define BASE 0x20000000u
#define SEG (2u << 20)
#define K 1024

static void only_isolated_blocks_wait(void) {
    ap_pool *p = mp_create();
    mp_segment(p, BASE, SEG, AP_POOL_SMALL);
    ap_block *a = mp_alloc(p, 1, 4 * K, AP_POOL_SMALL);
    ap_block *b = mp_alloc(p, 1, 4 * K, AP_POOL_SMALL);
    ap_block *c = mp_alloc(p, 1, 4 * K, AP_POOL_SMALL);
    mp_free(p, b, 1, 1); /* a and c allocated around it: it waits */
    CHECK(b->state == AP_BLOCK_CACHED && p->n_cached == 1);
    CHECK_EQ(ap_cache_bytes(p), 4 * K);
    mp_recount(p);
    /* c borders the cached b and the free rest of the segment: b leaves the cache and all three
       merge at once, as merge-at-free merges them */
    ap_block *m = mp_free(p, c, 1, 1);
    CHECK(m == b && b->state == AP_BLOCK_FREE && b->size == SEG - 4 * K && p->n_cached == 0);
    mp_recount(p);
    /* a borders that free block: the segment is whole again */
    m = mp_free(p, a, 1, 1);
    CHECK(m == a && a->size == SEG && a->next == NULL && p->n_cached == 0);
    CHECK_EQ(p->n_free_segments, 1);
    mp_recount(p);
    mp_destroy(p);
}

static void hits_and_misses(void) {
    ap_pool *p = mp_create();
    mp_segment(p, BASE, SEG, AP_POOL_SMALL);
    ap_block *x[6];
    for (int i = 0; i < 6; i++) x[i] = mp_alloc(p, 1, 4 * K, AP_POOL_SMALL);
    mp_free(p, x[3], 1, 1);
    mp_free(p, x[1], 1, 1);
    CHECK(x[1]->state == AP_BLOCK_CACHED && x[3]->state == AP_BLOCK_CACHED);
    int keyed = 0;
    CHECK(ap_cache_hit(p, 2, 4 * K, &keyed) == NULL && !keyed); /* another stream: miss */
    CHECK(ap_cache_hit(p, 0, 4 * K, &keyed) == NULL && !keyed);
    CHECK(ap_cache_hit(p, 1, 8 * K, &keyed) == NULL && !keyed); /* another size: miss */
    /* two of the key: the first in tree order (the lower address), not the newest */
    ap_block *h = ap_cache_hit(p, 1, 4 * K, &keyed);
    CHECK(h == x[1] && keyed && h->state == AP_BLOCK_FREE && p->n_cached == 1);
    ap_mark_allocated_in(p, h, 4 * K, 1, AP_POOL_SMALL);
    CHECK(mp_alloc(p, 1, 4000, AP_POOL_SMALL) == x[3]); /* rounds to the cached size: a hit */
    CHECK_EQ(p->n_cached, 0);
    mp_recount(p);
    /* an exact block in the stream's tree comes first in tree order: no hit, the flush decides */
    mp_free(p, x[1], 1, 0); /* to the tree (not cached) */
    mp_free(p, x[4], 1, 1); /* cached, later in tree order */
    keyed = 0;
    CHECK(ap_cache_hit(p, 1, 4 * K, &keyed) == NULL && keyed && p->n_cached == 1);
    CHECK(mp_alloc(p, 1, 4 * K, AP_POOL_SMALL) == x[1]);
    CHECK(p->n_cached == 0 && x[4]->state == AP_BLOCK_FREE); /* flushed into its tree */
    mp_recount(p);
    mp_destroy(p);
}

/* A request that would split takes the hole its cached neighbours leave (issue 18, point 2). */
static void split_sees_the_merged_picture(void) {
    ap_pool *p = mp_create();
    mp_segment(p, BASE, SEG, AP_POOL_SMALL);
    ap_block *a = mp_alloc(p, 0, 512, AP_POOL_SMALL);
    ap_block *b = mp_alloc(p, 0, 512, AP_POOL_SMALL);
    ap_block *c = mp_alloc(p, 0, 512, AP_POOL_SMALL);
    mp_alloc(p, 0, 512, AP_POOL_SMALL); /* keeps the hole closed */
    mp_free(p, a, 0, 1);
    mp_free(p, b, 0, 1); /* merges with the cached a at once */
    mp_free(p, c, 0, 1); /* and c with them: one 1.5 KiB hole */
    CHECK(a->state == AP_BLOCK_FREE && a->size == 1536 && p->n_cached == 0);
    CHECK(mp_alloc(p, 0, 1024, AP_POOL_SMALL) == a); /* best fit: the hole, not the segment's rest */
    mp_recount(p);
    mp_destroy(p);
}

/* A full bin evicts its oldest block into its tree (alone: it is isolated). */
static void eviction(void) {
    ap_pool *p = mp_create();
    mp_segment(p, BASE, SEG, AP_POOL_SMALL);
    ap_block *blk[AP_CACHE_DEPTH + 1];
    for (int i = 0; i <= AP_CACHE_DEPTH; i++) {
        blk[i] = mp_alloc(p, 0, 8 * K, AP_POOL_SMALL);
        mp_alloc(p, 0, 512, AP_POOL_SMALL); /* keeps them apart */
    }
    for (int i = 0; i < AP_CACHE_DEPTH; i++) mp_free(p, blk[i], 0, 1);
    CHECK_EQ(p->n_cached, AP_CACHE_DEPTH);
    CHECK_EQ(p->cache_n[ap_cache_bin(8 * K)], AP_CACHE_DEPTH);
    mp_free(p, blk[AP_CACHE_DEPTH], 0, 1); /* the bin is full: blk[0], the oldest, goes to the tree */
    CHECK_EQ(p->n_cached, AP_CACHE_DEPTH);
    CHECK(blk[0]->state == AP_BLOCK_FREE && blk[0]->size == 8 * K);
    CHECK(blk[AP_CACHE_DEPTH]->state == AP_BLOCK_CACHED);
    /* blk[0] is now an exact tree block first in tree order: the next 8 KiB request takes it */
    CHECK(mp_alloc(p, 0, 8 * K, AP_POOL_SMALL) == blk[0]);
    mp_recount(p);
    mp_destroy(p);
}

static void merged_view_is_the_flushed_stats(void) {
    ap_pool *p = mp_create();
    ap_segment *s = mp_segment(p, BASE, SEG, AP_POOL_SMALL);
    ap_block *a = mp_alloc(p, 0, 16 * K, AP_POOL_SMALL);
    ap_block *b = mp_alloc(p, 0, 4 * K, AP_POOL_SMALL);
    ap_block *c = mp_alloc(p, 0, 32 * K, AP_POOL_SMALL);
    mp_alloc(p, 0, 4 * K, AP_POOL_SMALL);
    mp_free(p, a, 0, 1);
    mp_free(p, c, 0, 1);
    CHECK_EQ(p->n_cached, 2);
    CHECK_EQ(ap_cache_bytes(p), 48 * K);
    CHECK_EQ(ap_cache_largest(p), 32 * K);
    ap_stats view;
    ap_stats_export(&p->stats, &view);
    size_t largest = 4 * K; /* the caller's figure from the trees: raised to the largest cached block */
    ap_cache_merged_view(p, &view, &largest);
    CHECK_EQ(largest, 32 * K);
    ap_cache_flush(p);
    CHECK(s->first == a && a->state == AP_BLOCK_FREE && a->size == 16 * K && a->next == b);
    mp_recount(p);
    ap_stats after;
    ap_stats_export(&p->stats, &after);
    for (int t = 0; t < AP_N_STAT_TYPES; t++) {
        CHECK_EQ(view.s[AP_STAT_INACTIVE_SPLIT][t].current, after.s[AP_STAT_INACTIVE_SPLIT][t].current);
        CHECK_EQ(view.s[AP_STAT_INACTIVE_SPLIT_BYTES][t].current, after.s[AP_STAT_INACTIVE_SPLIT_BYTES][t].current);
    }
    CHECK_EQ(after.s[AP_STAT_INACTIVE_SPLIT][AP_STAT_SMALL].current, 3); /* a, c and the segment's rest */
    mp_destroy(p);
}

/* Layouts of two pools made alike: same blocks (address, size, free or not; when free, tag and the
   time it became free). */
static void same_layout(ap_pool *p, ap_pool *q) {
    ap_segment *s = p->segments, *t = q->segments;
    for (; s && t; s = s->next, t = t->next) {
        CHECK(s->base == t->base && s->size == t->size);
        ap_block *b = s->first, *c = t->first;
        for (; b && c; b = b->next, c = c->next) {
            int bf = b->state != AP_BLOCK_ALLOCATED, cf = c->state != AP_BLOCK_ALLOCATED;
            CHECK(b->addr == c->addr && b->size == c->size && bf == cf && (!bf || b->tag == c->tag));
            CHECK(!bf || b->free_tick == c->free_tick); /* idle since the same time (expandable trades) */
        }
        CHECK(!b && !c);
    }
    CHECK(!s && !t);
}

/* The cache is invisible: random small requests and frees on three slots, with retags, give the
   same addresses and layouts with the cache as without it; with classic best fit, and with the
   expandable small pool's page fit (64 KiB pages here, so that blocks share them). */
static void differential(unsigned seed, int expandable) {
    ap_pool *p = mp_create(), *q = mp_create();
    p->cfg.expandable = q->cfg.expandable = expandable;
    p->vmm_granularity = q->vmm_granularity = 64 * K;
    enum { N = 96 };
    ap_block *lp[N] = {0}, *lq[N] = {0};
    static const size_t sizes[] = {4 * K, 4 * K, 4 * K, 4 * K, 4 * K, 4 * K, 512, 1536, 8 * K, 64 * K, 1 << 20};
    uintptr_t base = BASE;
    uint64_t r = seed * 0x9E3779B97F4A7C15ull + 1;
    int hits = 0;
    for (int step = 0; step < 20000; step++) {
        r ^= r << 13, r ^= r >> 7, r ^= r << 17;
        int i = (int)(r % N), slot = (int)((r >> 8) % MP_SLOTS);
        if ((r >> 16) % 97 == 0) { /* a stream's work is done: its free blocks become anyone's */
            int from = 1 + (int)((r >> 24) % (MP_SLOTS - 1));
            ap_free_retag_slot(p, from, 0);
            ap_free_retag_slot(q, from, 0);
        } else if (!lp[i]) {
            size_t size = sizes[(r >> 20) % (sizeof sizes / sizeof *sizes)] - ((r >> 32) % 2) * 100;
            int cached = p->n_cached;
            lp[i] = mp_alloc(p, slot, size, AP_POOL_SMALL);
            lq[i] = mp_alloc(q, slot, size, AP_POOL_SMALL);
            CHECK(!lp[i] == !lq[i]);
            if (!lp[i]) { /* both grow the same way */
                mp_segment(p, base, SEG, AP_POOL_SMALL);
                mp_segment(q, base, SEG, AP_POOL_SMALL);
                base += SEG + (1u << 20);
                lp[i] = mp_alloc(p, slot, size, AP_POOL_SMALL);
                lq[i] = mp_alloc(q, slot, size, AP_POOL_SMALL);
            }
            CHECK(lp[i] && lq[i] && lp[i]->addr == lq[i]->addr && lp[i]->size == lq[i]->size);
            hits += cached >= 2 && p->n_cached == cached - 1; /* taken straight from the cache (a flush empties it) */
        } else {
            int tag = (r >> 40) % 2 ? lp[i]->tag : slot; /* freed on its stream or ordered on another */
            mp_free(p, lp[i], tag, 1);
            mp_free(q, lq[i], tag, 0);
            lp[i] = lq[i] = NULL;
        }
        if (step % 512 == 0) {
            same_layout(p, q);
            mp_recount(p);
            mp_recount(q);
        }
    }
    same_layout(p, q);
    mp_recount(p);
    CHECK(hits > 100); /* the cache did serve (a few hundred of some 10,000 requests): not a vacuous comparison */
    mp_destroy(p);
    mp_destroy(q);
}

int main(void) {
    only_isolated_blocks_wait();
    hits_and_misses();
    split_sees_the_merged_picture();
    eviction();
    merged_view_is_the_flushed_stats();
    for (unsigned seed = 1; seed <= 4; seed++) {
        differential(seed, 0);
        differential(seed, 1);
    }
    puts("test_free_cache: ok");
    return 0;
}

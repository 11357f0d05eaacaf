/* The recent-free cache (cython/core/free_cache.{c,h}) on a minimal pool: a hit needs the exact
 * size and stream, the newest block of a key comes back first, a full bin evicts its oldest
 * block into the trees (merged), a flush merges everything, cached bytes and the largest cached
 * block are reported, and the merged view of the stats equals what a flush then shows.
 * core: free_cache.c free_blocks.c free_tree.c block_arena.c stats.c */
#include "mini_pool.h"

#define BASE 0x20000000u
#define SEG (2u << 20)
#define K 1024

static void hit_and_miss(void) {
    ap_pool *p = mp_create();
    mp_segment(p, BASE, SEG, AP_POOL_SMALL);
    ap_block *a = mp_alloc(p, 1, 4 * K, AP_POOL_SMALL);
    ap_block *b = mp_alloc(p, 1, 4 * K, AP_POOL_SMALL);
    ap_block *guard = mp_alloc(p, 1, 512, AP_POOL_SMALL);
    (void)guard;
    mp_free(p, a, 1, 1);
    CHECK(a->state == AP_BLOCK_CACHED && p->n_cached == 1);
    CHECK_EQ(ap_cache_bytes(p), 4 * K);
    CHECK(a->next == b && a->size == 4 * K); /* not merged while cached */
    mp_recount(p);
    CHECK(ap_cache_pop(p, 2, 4 * K) == NULL); /* another stream: miss */
    CHECK(ap_cache_pop(p, 0, 4 * K) == NULL);
    CHECK(ap_cache_pop(p, 1, 8 * K) == NULL); /* another size: miss */
    CHECK(ap_cache_pop(p, 1, 3584) == NULL);
    CHECK_EQ(p->n_cached, 1);
    mp_free(p, b, 1, 1);
    CHECK_EQ(ap_cache_bytes(p), 8 * K);
    /* hits: newest first, state free until marked allocated */
    ap_block *h = ap_cache_pop(p, 1, 4 * K);
    CHECK(h == b && b->state == AP_BLOCK_FREE && p->n_cached == 1);
    ap_mark_allocated_in(p, h, 4 * K, 1, AP_POOL_SMALL);
    CHECK(mp_alloc(p, 1, 4000, AP_POOL_SMALL) == a); /* rounds to the cached size: a hit */
    CHECK_EQ(p->n_cached, 0);
    CHECK_EQ(ap_cache_bytes(p), 0);
    mp_recount(p);
    mp_destroy(p);
}

/* A full bin evicts its oldest block into the trees, where it merges with free neighbours. */
static void eviction(void) {
    ap_pool *p = mp_create();
    mp_segment(p, BASE, SEG, AP_POOL_SMALL);
    ap_block *blk[AP_CACHE_DEPTH + 1];
    for (int i = 0; i <= AP_CACHE_DEPTH; i++) {
        blk[i] = mp_alloc(p, 0, 8 * K, AP_POOL_SMALL);
        mp_alloc(p, 0, 512, AP_POOL_SMALL); /* keeps them apart */
    }
    ap_block *last = blk[AP_CACHE_DEPTH]->next; /* the 512-byte block after the last one */
    for (int i = 0; i < AP_CACHE_DEPTH; i++) mp_free(p, blk[i], 0, 1);
    CHECK_EQ(p->n_cached, AP_CACHE_DEPTH);
    CHECK_EQ(p->cache_n[ap_cache_bin(8 * K)], AP_CACHE_DEPTH);
    mp_free(p, last, 0, 0); /* its right neighbour is the free rest: they merge */
    mp_free(p, blk[AP_CACHE_DEPTH], 0, 1); /* the bin is full: blk[0], the oldest, goes to the tree */
    CHECK_EQ(p->n_cached, AP_CACHE_DEPTH);
    CHECK(blk[0]->state == AP_BLOCK_FREE && blk[0]->size == 8 * K); /* its neighbours are allocated */
    CHECK(blk[AP_CACHE_DEPTH]->state == AP_BLOCK_CACHED);
    CHECK(ap_cache_pop(p, 0, 8 * K) == blk[AP_CACHE_DEPTH]);
    ap_mark_allocated_in(p, blk[AP_CACHE_DEPTH], 8 * K, 0, AP_POOL_SMALL);
    mp_recount(p);
    mp_destroy(p);
}

static void flush_and_merged_view(void) {
    ap_pool *p = mp_create();
    ap_segment *s = mp_segment(p, BASE, SEG, AP_POOL_SMALL);
    CHECK(s->first->state == AP_BLOCK_FREE && s->first->size == SEG); /* one free block: the segment */
    ap_block *a = mp_alloc(p, 0, 16 * K, AP_POOL_SMALL);
    ap_block *b = mp_alloc(p, 0, 4 * K, AP_POOL_SMALL);
    ap_block *c = mp_alloc(p, 0, 32 * K, AP_POOL_SMALL);
    ap_block *d = mp_alloc(p, 0, 4 * K, AP_POOL_SMALL);
    mp_free(p, a, 0, 1);
    mp_free(p, b, 0, 0); /* b merges with nothing: a is cached, c allocated */
    mp_free(p, c, 0, 1);
    CHECK_EQ(p->n_cached, 2);
    CHECK_EQ(ap_cache_bytes(p), 48 * K);
    CHECK_EQ(ap_cache_largest(p), 32 * K);
    mp_recount(p);
    /* The merged view: a, b and c would be one free split block of 52 KiB (d stays allocated). */
    ap_stats view;
    ap_stats_export(&p->stats, &view);
    size_t largest = 4 * K; /* the caller's figure from the trees: raised to the merged run */
    ap_cache_merged_view(p, &view, &largest);
    CHECK_EQ(largest, 52 * K);
    ap_cache_flush(p);
    CHECK_EQ(p->n_cached, 0);
    CHECK(s->first == a && a->state == AP_BLOCK_FREE && a->size == 52 * K && a->next == d);
    mp_recount(p);
    ap_stats after;
    ap_stats_export(&p->stats, &after);
    for (int t = 0; t < AP_N_STAT_TYPES; t++) {
        CHECK_EQ(view.s[AP_STAT_INACTIVE_SPLIT][t].current, after.s[AP_STAT_INACTIVE_SPLIT][t].current);
        CHECK_EQ(view.s[AP_STAT_INACTIVE_SPLIT_BYTES][t].current, after.s[AP_STAT_INACTIVE_SPLIT_BYTES][t].current);
    }
    CHECK_EQ(after.s[AP_STAT_INACTIVE_SPLIT][AP_STAT_SMALL].current, 2); /* a+b+c, and the rest after d */
    /* A merged run larger than anything in the trees raises the largest free block. */
    mp_free(p, d, 0, 1);
    ap_stats_export(&p->stats, &view);
    largest = 0;
    ap_cache_merged_view(p, &view, &largest);
    CHECK_EQ(largest, SEG);
    CHECK_EQ(view.s[AP_STAT_INACTIVE_SPLIT][AP_STAT_ALL].current, 0); /* one whole free segment */
    ap_cache_flush(p);
    CHECK(s->first->size == SEG && p->n_free_segments == 1);
    mp_recount(p);
    mp_destroy(p);
}

int main(void) {
    hit_and_miss();
    eviction();
    flush_and_merged_view();
    puts("test_free_cache: ok");
    return 0;
}

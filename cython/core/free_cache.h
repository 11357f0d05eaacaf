/* A small cache of recently freed small-pool blocks, by exact size and stream, so that the common
 * free-then-malloc of the same size (a training step, a decode loop) skips the best-fit tree: one
 * hash, one compare, a few counter updates.
 *
 * It is invisible: every request gets the very block that a pool merging every free at once
 * (PyTorch, RMM, torch_npu) would give it, so placement, and with it every statistic, snapshot and
 * replay figure, is that of merge-at-free (issue 18; tests/c/test_free_cache.c runs a pool with and
 * without it side by side, tests/test_free_cache_merge.py against the independent torch_npu_policy
 * model). Three rules make it so:
 *  - only an isolated block is parked: one with no free or cached neighbour it would merge with,
 *    which merge-at-free leaves alone too. A block freed beside free space merges at once, and one
 *    freed beside a cached block takes that block out of the cache and merges with it
 *    (ap_free_insert), so a cached block never has a neighbour it should have merged with;
 *  - a hit takes a cached block of exactly the size and stream asked (the first in tree order if
 *    several), and only when that stream's tree holds no block of exactly that size
 *    (p->small_exact counts them by hashed size and stream: a zero is certain, a collision only
 *    costs the slow path). It is then the best fit of the merged picture: nothing smaller fits,
 *    and among equal sizes the tree order decides;
 *  - any other small request first flushes the cache into the trees (unless the trees' best fit
 *    is already an exact block of its own stream, which no cached block can beat), then fits
 *    there. Each cached block is flushed at most once per free: amortised, the cost of merging at
 *    free.
 * Expandable segments fit small blocks by page (free_blocks.c), ranking blocks by the pages they
 * would pin: there a hit also needs the cached block to pin no new page (ap_cache_hit), and every
 * miss flushes. A cached block keeps the time it was freed (free_tick), which their trades read.
 *
 * Keys (size, stream) sit beside the pointers so a lookup reads no block struct; the hits are
 * inline here, on the cached path of ap_pool_malloc/ap_pool_free. The cache holds small-pool
 * blocks only, so their statistics use constant indices.
 */
#ifndef AP_FREE_CACHE_H
#define AP_FREE_CACHE_H

#include "invariant.h"
#include "pool.h"

/* free_cache.c: the cold paths. */
void ap_cache_evict_oldest(ap_pool *p, unsigned bin);
/* Coalesces every cached block into the trees; call before anything that needs the full picture. */
void ap_cache_flush(ap_pool *p);
/* Takes the cached block c out of the cache (state FREE, in no tree). */
void ap_cache_take(ap_pool *p, ap_block *c);
/* For stats without flushing: bytes held by cached blocks, and the largest cached block. */
size_t ap_cache_bytes(const ap_pool *p);
size_t ap_cache_largest(const ap_pool *p);
/* Corrects exported stats (inactive_split counts and bytes, raised largest free block) to what
   merge-at-free would show, without flushing: each cached block is an inactive split block. */
void ap_cache_merged_view(const ap_pool *p, ap_stats *out, size_t *largest);
/* 1 when n (a free or cached neighbour of a block or run whose tag so far is *tag) would merge
   with it; *tag becomes the merged tag. The one merge rule (free_blocks.c's joins uses it). */
static inline int ap_cache_joins(const ap_block *n, int *tag) {
    if (!n || (n->state != AP_BLOCK_FREE && n->state != AP_BLOCK_CACHED)) return 0;
    if (n->tag != *tag && n->tag && *tag) return 0;
    if (n->tag) *tag = n->tag;
    return 1;
}

static inline unsigned ap_cache_bin(size_t rsize) {
    return (unsigned)(((uint64_t)(rsize >> 9) * 0x9E3779B97F4A7C15ull) >> 58) & (AP_CACHE_BINS - 1);
}

static inline uint64_t ap_cache_key(size_t rsize, int slot) { return (uint64_t)rsize << 16 | (uint16_t)slot; }

/* Takes entry i out of bin (the bin keeps its order, oldest first); returns its block, state FREE
   and in no tree. */
static inline ap_block *ap_cache_remove_at(ap_pool *p, unsigned bin, int i) {
    ap_block *b = p->cache[bin][i];
    int n = p->cache_n[bin];
    for (int j = i; j < n - 1; j++) {
        p->cache[bin][j] = p->cache[bin][j + 1];
        p->cache_key[bin][j] = p->cache_key[bin][j + 1];
    }
    p->cache_n[bin] = (uint8_t)(n - 1);
    p->n_cached--;
    AP_ASSERT(b->state == AP_BLOCK_CACHED && p->n_cached >= 0);
    b->state = AP_BLOCK_FREE;
    return b;
}

static inline unsigned ap_exact_bucket(size_t size, int tag) {
    return (unsigned)((((uint64_t)(size >> 9) ^ ((uint64_t)tag << 40)) * 0x9E3779B97F4A7C15ull) >> 56) & (AP_EXACT_BUCKETS - 1);
}

/* The block merge-at-free would hand a small request of exactly rsize on slot, if it is cached
   (taken out of the cache, state FREE), else NULL; *keyed = 1 when some cached block has the key
   (then the trees alone cannot decide: the caller flushes before fitting). Classic: the first
   cached block of the key in tree order, while the stream's tree holds no block of that size.
   Expandable (page fit: free_blocks.c): the key's lowest-addressed cached block, if it pins no
   new page (the page fit's best score, which nothing larger beats) and no block of that size is
   free for any stream (which would win a tie by address). */
static inline ap_block *ap_cache_hit(ap_pool *p, int slot, size_t rsize, int *keyed) {
    unsigned bin = ap_cache_bin(rsize);
    uint64_t key = ap_cache_key(rsize, slot), any_key = ap_cache_key(rsize, 0);
    int best = -1, vmm = p->cfg.expandable, any_cached = 0;
    for (int i = 0; i < p->cache_n[bin]; i++) {
        uint64_t k = p->cache_key[bin][i];
        any_cached |= k == any_key;
        if (k != key) continue;
        if (best >= 0 && (vmm ? p->cache[bin][i]->addr > p->cache[bin][best]->addr
                              : ap_block_before(p->cache[bin][best], p->cache[bin][i])))
            continue;
        best = i;
    }
    if (best < 0) return NULL;
    *keyed = 1;
    if (p->small_exact[ap_exact_bucket(rsize, slot)]) return NULL; /* an exact tree block may come first */
    if (vmm && ((slot && (any_cached || p->small_exact[ap_exact_bucket(rsize, 0)])) ||
                !ap_page_fit_pins_nothing(p, p->cache[bin][best], rsize)))
        return NULL;
    return ap_cache_remove_at(p, bin, best);
}

/* 1 when a request (rsize, slot) in pool, whose best fit in the trees is fit (or NULL), must see
   the cached blocks merged first: merge-at-free might hand it a cached block (or a hole beside
   one) instead. Not when the fit is an exact block of the request's own stream with no cached block
   of that key (classic): nothing cached comes before it. Large requests never take cached (small) blocks;
   their growth path flushes on its own (segments.c). */
static inline int ap_cache_must_flush(const ap_pool *p, int pool, int slot, size_t rsize, const ap_block *fit,
                                      int keyed) {
    if (!p->n_cached || pool != AP_POOL_SMALL) return 0;
    /* expandable: a larger cached block that pins no new page beats an exact fit that does */
    return keyed || !fit || fit->size != rsize || fit->tag != slot || p->cfg.expandable;
}

/* 1 when a freed small block (stream slot tag) has no neighbour it would merge with: merge-at-free
   leaves it alone, so it may wait in the cache. A whole segment is no split block: it goes to the
   tree, where the release policies see it. */
static inline int ap_cache_isolated(const ap_block *b, int tag) {
    int t1 = tag, t2 = tag;
    return (b->prev || b->next) && !ap_cache_joins(b->prev, &t1) && !ap_cache_joins(b->next, &t2);
}

/* Parks a freed, isolated small-pool block (no record_stream uses) for reuse on stream slot tag. */
static inline void ap_cache_push_small(ap_pool *p, ap_block *b, int tag) {
    unsigned bin = ap_cache_bin(b->size);
    if (p->cache_n[bin] == AP_CACHE_DEPTH) ap_cache_evict_oldest(p, bin); /* to its tree, alone: it is isolated */
    AP_ASSERT(p->cache_n[bin] < AP_CACHE_DEPTH && b->state == AP_BLOCK_ALLOCATED && b->seg->pool == AP_POOL_SMALL &&
              ap_cache_isolated(b, tag));
    b->state = AP_BLOCK_CACHED;
    b->free_tick = p->tick; /* idle since now, as merge-at-free would record it (expandable trades) */
    b->tag = (uint16_t)tag;
    b->requested = 0;
    int n = p->cache_n[bin]++;
    p->cache[bin][n] = b;
    p->cache_key[bin][n] = ap_cache_key(b->size, tag);
    p->n_cached++;
}

#endif

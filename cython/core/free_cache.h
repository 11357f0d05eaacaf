/* A small cache of recently freed small-pool blocks, by exact size and stream, so that the common
 * free-then-malloc of the same size (a training step, a decode loop) skips coalescing and the
 * best-fit tree entirely: one hash, one compare, a few counter updates.
 *
 * Only small-pool blocks (<= 1 MiB) are cached: large blocks left unmerged keep their neighbours'
 * free space fragmented, so later requests split other blocks instead and fewer segments become
 * wholly free for release (measured on the shared traces: mean waste reduction vs torch_npu fell
 * from 65 % to 25 % with every block cached, and rose to 68 % with small blocks only).
 *
 * Cached blocks are free (inactive) in every statistic and snapshot, just not merged with their
 * neighbours yet. A request that finds no fit, a release, empty_cache and stream settling flush
 * the cache first (each cached block is flushed at most once per free: amortised, the cost of
 * merging at free). A small request that would split a block (cut fresh space; with expandable
 * segments, the block the page fit picked) first merges a run of cached and free neighbours whose
 * hole is exactly its size, so that two freed neighbours serve it as one hole (PyTorch, RMM).
 * Only exactly: a larger hole would be split again, trading cached blocks that their own size's
 * next requests reuse whole for a remainder; classic segments under release_policy:budgeted flush
 * the whole cache instead. Both choices were measured, not derived: a different small-pool layout
 * changes which segments are wholly free, so the peaks move in the large pool through the trades
 * (figures and the rules tried: docs/placement-policy.md, "Placement"). Stats and snapshots, which
 * must not change what the pool does next, show the merged picture without flushing
 * (ap_cache_merged_view, snapshot.c): a cached block is never counted in inactive_split itself,
 * the view counts its merged run.
 *
 * The hits are inline here, on the cached path of ap_pool_malloc/ap_pool_free; the cache holds
 * small-pool blocks only, so their statistics use constant indices. Keys (size, stream) sit
 * beside the pointers so a lookup reads no block struct.
 */
#ifndef AP_FREE_CACHE_H
#define AP_FREE_CACHE_H

#include "invariant.h"
#include "pool.h"

/* free_cache.c: the cold paths. */
void ap_cache_evict_oldest(ap_pool *p, unsigned bin);
/* Coalesces every cached block into the trees; call before anything that needs the full picture. */
void ap_cache_flush(ap_pool *p);
/* 1 when a small request of rsize whose best fit is b would cut fresh space while blocks are
   cached: ap_cache_merge_for_split must run first (ap_pool_malloc; the lock-free try path leaves
   such requests to it). Classic and expandable segments alike. */
static inline int ap_cache_merges_before_split(const ap_pool *p, const ap_block *b, size_t rsize, int pool) {
    return b->size != rsize && pool == AP_POOL_SMALL && p->n_cached;
}
/* Before such a request cuts fresh space: with classic segments under release_policy:budgeted
   every cached block merges; else a run of cached and free neighbours (two blocks or more) whose
   hole is exactly rsize and usable by slot, as if merged at free. 1 if anything was merged (fit
   again). */
int ap_cache_merge_for_split(ap_pool *p, int slot, size_t rsize);
/* For stats without flushing: bytes held by cached blocks, and the largest cached block. */
size_t ap_cache_bytes(const ap_pool *p);
size_t ap_cache_largest(const ap_pool *p);
/* Corrects exported stats (inactive_split counts and bytes, raised largest free block) to what
   they would be with every cached block merged into its free neighbours, without merging. */
void ap_cache_merged_view(const ap_pool *p, ap_stats *out, size_t *largest);
/* 1 when a and b (free or cached neighbours, tag of a run so far `tag`) would merge; *tag is the
   merged tag. Same rule as free_blocks.c's mergeable(). */
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

/* A cached block of exactly rsize freed on slot, taken out of the cache (state FREE), or NULL. */
static inline ap_block *ap_cache_pop(ap_pool *p, int slot, size_t rsize) {
    unsigned bin = ap_cache_bin(rsize);
    uint64_t key = ap_cache_key(rsize, slot);
    for (int i = p->cache_n[bin] - 1; i >= 0; i--)
        if (p->cache_key[bin][i] == key) return ap_cache_remove_at(p, bin, i);
    return NULL;
}

/* Parks a freed small-pool block (no record_stream uses) for reuse on stream slot tag. */
static inline void ap_cache_push_small(ap_pool *p, ap_block *b, int tag) {
    unsigned bin = ap_cache_bin(b->size);
    if (p->cache_n[bin] == AP_CACHE_DEPTH) ap_cache_evict_oldest(p, bin); /* it goes to the tree, merged */
    AP_ASSERT(p->cache_n[bin] < AP_CACHE_DEPTH && b->state == AP_BLOCK_ALLOCATED && b->seg->pool == AP_POOL_SMALL);
    b->state = AP_BLOCK_CACHED;
    b->tag = (uint16_t)tag;
    b->requested = 0;
    int n = p->cache_n[bin]++;
    p->cache[bin][n] = b;
    p->cache_key[bin][n] = ap_cache_key(b->size, tag);
    p->n_cached++;
}

#endif

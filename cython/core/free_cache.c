/* The recent-free cache's cold paths: eviction, flush and sizes (the hits are in free_cache.h). */
#include "pool_internal.h"

/* A cached block enters its tree: MOVING, so that it keeps the time it was freed (free_blocks.c). */
static void to_tree(ap_pool *p, ap_block *b) {
    b->state = AP_BLOCK_MOVING;
    ap_free_insert(p, b, b->tag);
}

void ap_cache_evict_oldest(ap_pool *p, unsigned bin) {
    to_tree(p, ap_cache_remove_at(p, bin, 0));
}

void ap_cache_flush(ap_pool *p) {
    if (!p->n_cached) return;
    for (int bin = 0; bin < AP_CACHE_BINS; bin++) {
        while (p->cache_n[bin]) to_tree(p, p->cache[bin][--p->cache_n[bin]]);
    }
    p->n_cached = 0;
}

void ap_cache_take(ap_pool *p, ap_block *c) {
    unsigned bin = ap_cache_bin(c->size);
    int i = 0;
    while (i < p->cache_n[bin] && p->cache[bin][i] != c) i++;
    AP_ASSERT(i < p->cache_n[bin]);
    ap_cache_remove_at(p, bin, i);
}

size_t ap_cache_bytes(const ap_pool *p) {
    size_t bytes = 0;
    for (int bin = 0; bin < AP_CACHE_BINS; bin++)
        for (int i = 0; i < p->cache_n[bin]; i++) bytes += p->cache[bin][i]->size;
    return bytes;
}

size_t ap_cache_largest(const ap_pool *p) {
    size_t largest = 0;
    for (int bin = 0; bin < AP_CACHE_BINS; bin++)
        for (int i = 0; i < p->cache_n[bin]; i++)
            if (p->cache[bin][i]->size > largest) largest = p->cache[bin][i]->size;
    return largest;
}

void ap_cache_merged_view(const ap_pool *p, ap_stats *out, size_t *largest) {
    /* A cached block is isolated (free_cache.h): merged at free it would be a free block of its own,
       inside a segment it shares with other blocks, so it counts as one inactive split block. */
    int64_t d_n = p->n_cached, d_b = (int64_t)ap_cache_bytes(p);
    size_t cached_largest = ap_cache_largest(p);
    if (cached_largest > *largest) *largest = cached_largest;
    int types[2] = {AP_STAT_ALL, AP_STAT_SMALL};
    for (int t = 0; t < 2; t++) {
        ap_stat *n = &out->s[AP_STAT_INACTIVE_SPLIT][types[t]], *b = &out->s[AP_STAT_INACTIVE_SPLIT_BYTES][types[t]];
        n->current += d_n;
        b->current += d_b;
        if (n->current > n->peak) n->peak = n->current;
        if (b->current > b->peak) b->peak = b->current;
    }
}

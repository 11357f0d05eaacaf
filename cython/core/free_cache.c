/* The recent-free cache's cold paths: eviction, flush and sizes (the hits are in free_cache.h). */
#include "pool_internal.h"

void ap_cache_evict_oldest(ap_pool *p, unsigned bin) {
    ap_block *old = p->cache[bin][0];
    for (int j = 0; j < AP_CACHE_DEPTH - 1; j++) {
        p->cache[bin][j] = p->cache[bin][j + 1];
        p->cache_key[bin][j] = p->cache_key[bin][j + 1];
    }
    p->cache_n[bin]--;
    p->n_cached--;
    ap_cache_uncount(p, old);
    old->state = AP_BLOCK_FREE;
    ap_free_insert(p, old, old->tag);
}

void ap_cache_flush(ap_pool *p) {
    if (!p->n_cached) return;
    for (int bin = 0; bin < AP_CACHE_BINS; bin++) {
        while (p->cache_n[bin]) {
            ap_block *b = p->cache[bin][--p->cache_n[bin]];
            ap_cache_uncount(p, b);
            b->state = AP_BLOCK_FREE;
            ap_free_insert(p, b, b->tag);
        }
    }
    p->n_cached = 0;
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

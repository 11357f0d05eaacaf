/* The recent-free cache's cold paths: eviction, flush and sizes (the hits are in free_cache.h). */
#include "pool_internal.h"

void ap_cache_evict_oldest(ap_pool *p, unsigned bin) {
    ap_block *old = ap_cache_remove_at(p, bin, 0);
    ap_free_insert(p, old, old->tag);
}

void ap_cache_flush(ap_pool *p) {
    if (!p->n_cached) return;
    for (int bin = 0; bin < AP_CACHE_BINS; bin++) {
        while (p->cache_n[bin]) {
            ap_block *b = p->cache[bin][--p->cache_n[bin]];
            b->state = AP_BLOCK_FREE;
            ap_free_insert(p, b, b->tag);
        }
    }
    p->n_cached = 0;
}

/* Takes the cached block c out of its bin (state FREE, in no tree). */
static void cache_take(ap_pool *p, ap_block *c) {
    unsigned bin = ap_cache_bin(c->size);
    int i = 0;
    while (i < p->cache_n[bin] && p->cache[bin][i] != c) i++;
    AP_ASSERT(i < p->cache_n[bin]);
    ap_cache_remove_at(p, bin, i);
}

/* The size and merged tag of the run of free and cached neighbours that c would merge into;
   returns its leftmost block. */
static ap_block *run_of(ap_block *c, size_t *total, int *tag) {
    ap_block *start = c;
    int t = c->tag;
    while (ap_cache_joins(start->prev, &t)) start = start->prev;
    t = start->tag;
    *total = 0;
    ap_block *x = start;
    do {
        *total += x->size;
        x = x->next;
    } while (ap_cache_joins(x, &t));
    *tag = t;
    return start;
}

/* The exact rule (free_cache.h says why only exactly). */
static int merge_exact(ap_pool *p, int slot, size_t rsize) {
    for (int bin = 0; bin < AP_CACHE_BINS; bin++)
        for (int i = 0; i < p->cache_n[bin]; i++) {
            ap_block *c = p->cache[bin][i];
            if (c->size >= rsize) continue; /* alone it is no merge; with neighbours, too large */
            int tag = c->tag, t2 = c->tag;
            if (!ap_cache_joins(c->prev, &tag) && !ap_cache_joins(c->next, &t2)) continue; /* alone */
            size_t total;
            ap_block *x = run_of(c, &total, &tag);
            if (total != rsize || (tag && tag != slot)) continue;
            /* Each cached block of the run enters the tree, merging with what is free around it;
               the walk goes on from the merged block (an insert recycles the structs it merges). */
            tag = x->tag;
            while (ap_cache_joins(x, &tag)) {
                if (x->state == AP_BLOCK_CACHED) {
                    cache_take(p, x);
                    x = ap_free_insert(p, x, x->tag);
                    tag = x->tag;
                }
                x = x->next;
            }
            return 1;
        }
    return 0;
}

int ap_cache_merge_for_split(ap_pool *p, int slot, size_t rsize) {
    if (p->cfg.release_policy == AP_RELEASE_BUDGETED && !p->cfg.expandable) {
        ap_cache_flush(p);
        return 1;
    }
    return merge_exact(p, slot, rsize);
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
    int64_t d_n = 0, d_b = 0;
    for (int bin = 0; bin < AP_CACHE_BINS; bin++)
        for (int i = 0; i < p->cache_n[bin]; i++) {
            const ap_block *c = p->cache[bin][i], *start = c;
            int tag = c->tag, first = 1;
            while (ap_cache_joins(start->prev, &tag)) { /* each run once: from its leftmost cached block */
                start = start->prev;
                if (start->state == AP_BLOCK_CACHED) first = 0;
            }
            if (!first) continue;
            tag = start->tag;
            size_t total = 0;
            const ap_block *x = start, *end = start;
            do {
                end = x;
                total += x->size;
                if (x->state == AP_BLOCK_FREE && x->counted_split) {
                    d_n--;
                    d_b -= (int64_t)x->size;
                }
                x = x->next;
            } while (ap_cache_joins(x, &tag));
            if (start->prev || end->next) {
                d_n++;
                d_b += (int64_t)total;
            }
            if (total > *largest) *largest = total;
        }
    int types[2] = {AP_STAT_ALL, AP_STAT_SMALL};
    for (int t = 0; t < 2; t++) {
        ap_stat *n = &out->s[AP_STAT_INACTIVE_SPLIT][types[t]], *b = &out->s[AP_STAT_INACTIVE_SPLIT_BYTES][types[t]];
        n->current += d_n;
        b->current += d_b;
        if (n->current > n->peak) n->peak = n->current;
        if (b->current > b->peak) b->peak = b->current;
    }
}

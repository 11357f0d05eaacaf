/* Free blocks: insertion with address-ordered coalescing, removal, best fit and splitting.
 *
 * A free block carries a tag: the stream slot whose queued work may still touch it (0 = none).
 * Two neighbours merge only when their tags are compatible (equal, or one of them is 0); the
 * merged block keeps the stricter tag, so memory is never handed to a stream before it is safe.
 */
#include "pool_internal.h"

static inline int is_whole_segment(const ap_block *b) { return !b->prev && !b->next; }

static inline ap_free_tree *tree_of(ap_pool *p, const ap_block *b) {
    return &p->slots[b->tag].trees[b->seg->pool];
}

/* The pool's counts of a free block leaving its tree (ap_free_remove, ap_free_retag_slot). */
static void uncount_free(ap_pool *p, ap_block *b) {
    if (b->seg->pool == AP_POOL_SMALL) {
        AP_ASSERT(p->small_exact[ap_exact_bucket(b->size, b->tag)] > 0);
        p->small_exact[ap_exact_bucket(b->size, b->tag)]--;
    }
    if (b->counted_split) {
        ap_stat_dec(&p->stats, AP_STAT_INACTIVE_SPLIT, b->seg->pool, 1);
        ap_stat_dec(&p->stats, AP_STAT_INACTIVE_SPLIT_BYTES, b->seg->pool, (int64_t)b->size);
        b->counted_split = 0;
    } else {
        p->n_free_segments--;
    }
}

void ap_free_remove(ap_pool *p, ap_block *b) {
    ap_tree_remove(tree_of(p, b), b);
    uncount_free(p, b);
}

/* A free neighbour (in a tree) or a cached one (free_cache.h: merge-at-free would have merged
   it) that a block freed with this tag merges with. */
static inline int joins(const ap_block *n, int tag) { return ap_cache_joins(n, &tag); }

/* Takes a neighbour that joins out of its tree, or out of the cache. */
static inline void detach(ap_pool *p, ap_block *n) {
    if (n->state == AP_BLOCK_CACHED) ap_cache_take(p, n);
    else ap_free_remove(p, n);
}

ap_block *ap_free_insert(ap_pool *p, ap_block *b, int tag) {
    /* A merged block is as idle as its longest-idle part; a retagged block keeps its age. */
    int moving = b->state == AP_BLOCK_MOVING;
    int was_whole = is_whole_segment(b); /* a retagged whole segment keeps its free_since */
    uint64_t idle_since = moving ? b->free_tick : p->tick;
    b->state = AP_BLOCK_FREE;
    b->requested = 0;
    if (b->xs) {
        ap_uses_recycle(p, b->xs);
        b->xs = NULL;
    }
    ap_block *prev = b->prev, *next = b->next;
    if (joins(prev, tag)) {
        detach(p, prev);
        if (prev->free_tick < idle_since) idle_since = prev->free_tick;
        if (prev->tag) tag = prev->tag;
        prev->size += b->size;
        prev->next = next;
        if (next) next->prev = prev;
        ap_block_recycle(p, b);
        b = prev;
    }
    next = b->next;
    if (joins(next, tag)) {
        detach(p, next);
        if (next->free_tick < idle_since) idle_since = next->free_tick;
        if (next->tag) tag = next->tag;
        b->size += next->size;
        b->next = next->next;
        if (b->next) b->next->prev = b;
        ap_block_recycle(p, next);
    }
    AP_ASSERT(tag >= 0 && tag < p->n_slots && (tag == 0 || p->slots[tag].live));
    AP_ASSERT(ap_block_links_ok(b) && !joins(b->prev, tag) && !joins(b->next, tag)); /* fully coalesced */
    b->tag = (uint16_t)tag;
    if (tag) p->slots[tag].epoch++; /* a wait begun before this free does not cover it (waits.c) */
    b->free_tick = idle_since;
    ap_tree_insert(tree_of(p, b), b);
    if (b->seg->pool == AP_POOL_SMALL) p->small_exact[ap_exact_bucket(b->size, tag)]++;
    if (is_whole_segment(b)) {
        p->n_free_segments++;
        /* wholly free from now: by this free, or by a retag merging parts freed on two streams */
        if (!moving || !was_whole) b->seg->free_since = p->tick;
    } else {
        b->counted_split = 1;
        ap_stat_inc(&p->stats, AP_STAT_INACTIVE_SPLIT, b->seg->pool, 1);
        ap_stat_inc(&p->stats, AP_STAT_INACTIVE_SPLIT_BYTES, b->seg->pool, (int64_t)b->size);
    }
    return b;
}

void ap_free_recount_segment(ap_pool *p, ap_segment *s) {
    for (ap_block *b = s->first; b; b = b->next) {
        if (b->state != AP_BLOCK_FREE || b->counted_split == !is_whole_segment(b)) continue;
        int sign = b->counted_split ? -1 : 1; /* -1: now alone in its segment */
        if (sign > 0) {
            p->n_free_segments--;
            ap_stat_inc(&p->stats, AP_STAT_INACTIVE_SPLIT, s->pool, 1);
            ap_stat_inc(&p->stats, AP_STAT_INACTIVE_SPLIT_BYTES, s->pool, (int64_t)b->size);
        } else {
            p->n_free_segments++;
            ap_stat_dec(&p->stats, AP_STAT_INACTIVE_SPLIT, s->pool, 1);
            ap_stat_dec(&p->stats, AP_STAT_INACTIVE_SPLIT_BYTES, s->pool, (int64_t)b->size);
        }
        b->counted_split = sign > 0;
    }
}

void ap_free_retag_slot(ap_pool *p, int from, int to) {
    ap_cache_flush(p); /* cached blocks of `from` must move too */
    for (int pool = 0; pool < 2; pool++) {
        /* Detach all first (they must not merge with each other under the old tag), in one walk:
           a stream's blocks are as many as its frees (empty_cache after a million small frees). */
        ap_block *moving = ap_tree_take_all(&p->slots[from].trees[pool]);
        for (ap_block *b = moving; b; b = b->pending_next) {
            uncount_free(p, b);
            b->state = AP_BLOCK_MOVING;
        }
        while (moving) {
            ap_block *b = moving;
            moving = b->pending_next;
            b->pending_next = NULL;
            ap_free_insert(p, b, to);
        }
    }
}

/* PyTorch's oversize rules: never split a block of max_split_size or more for a smaller request,
   and do not hand a big request a cached block that is much bigger than it. A no_split pool's
   blocks are never split, every one as torch's oversize blocks: the second rule holds for all
   of them (a 2 MiB request took a free 100 MiB block whole, 98 MiB of it serving no one). */
static inline int fit_allowed(const ap_pool *p, const ap_block *b, size_t rsize) {
    size_t max_split = p->cfg.max_split_size;
    if (p->no_split && b->size >= rsize + AP_LARGE_BUFFER) return 0;
    if (max_split == AP_NO_LIMIT) return 1;
    if (rsize < max_split) return b->size < max_split;
    return b->size < rsize + AP_LARGE_BUFFER;
}

/* Expandable mode, small pool: fit by page. A page (the unit the device maps) goes back to the
   device only when no live block is left in it, and small blocks are many and short-lived, so
   plain best fit scatters them: it picks the smallest hole wherever it is, often in a page whose
   live blocks are all gone, which then stays pinned by one block (llama trace: 8 of the small
   pool's 18 MiB free at the peak, spread over all 9 pages). Here a block goes where every page
   it touches already holds live data; best fit among those, and only when none fits, best fit
   into a page with none. Pages without live blocks are thus left to empty out (cached blocks in
   them merge at the next flush) and be unmapped or reused whole. Among equal sizes the lowest
   address wins, packing blocks downwards so that the top pages empty (tree order is by segment
   age, which the splits and joins of expandable segments make differ from address order).
   Shared traces: llama's waste falls from 22.2 to 14.2 MiB, no other trace's rises. */
#define AP_PAGE_FIT_SCAN 16 /* candidates looked at, smallest first (a miss path: bounded cost) */

/* 1 if a block other than b, allocated or waiting for events, lies in the page at lo. */
static int page_live(const ap_block *b, uintptr_t lo, size_t g) {
    uintptr_t hi = lo + g;
    for (const ap_block *x = b->prev; x && x->addr + x->size > lo; x = x->prev)
        if (x->state == AP_BLOCK_ALLOCATED || x->state == AP_BLOCK_PENDING) return 1;
    for (const ap_block *x = b->next; x && x->addr < hi; x = x->next)
        if (x->state == AP_BLOCK_ALLOCATED || x->state == AP_BLOCK_PENDING) return 1;
    return 0;
}

/* Pages the first rsize bytes at b would touch that hold live data (a one-page block's page counts
   twice): 2 = nothing new pinned. */
static int page_score(const ap_block *b, size_t rsize, size_t g) {
    uintptr_t first = b->addr / g * g, last = (b->addr + rsize - 1) / g * g;
    int score = page_live(b, first, g);
    return first == last ? 2 * score : score + page_live(b, last, g);
}

int ap_page_fit_pins_nothing(const ap_pool *p, const ap_block *b, size_t rsize) {
    return page_score(b, rsize, p->vmm_granularity) == 2;
}

typedef struct page_fit {
    const ap_pool *p;
    size_t rsize;
    ap_block *best;
    int best_score, seen;
} page_fit;

/* Candidates come smallest first (page_score: 2 = nothing new pinned): the walk stops past the
   size of a best fit that pins nothing new. */
static int page_fit_visit(ap_block *b, void *arg) {
    page_fit *f = arg;
    if (f->best_score == 2 && b->size > f->best->size) return 1;
    if (!fit_allowed(f->p, b, f->rsize)) return 1; /* larger ones are refused too */
    int score = page_score(b, f->rsize, f->p->vmm_granularity);
    if (!f->best || score > f->best_score ||
        (score == f->best_score && b->size == f->best->size && b->addr < f->best->addr)) {
        f->best = b;
        f->best_score = score;
    }
    return ++f->seen >= AP_PAGE_FIT_SCAN;
}

static ap_block *page_fit_small(ap_pool *p, int slot, size_t rsize) {
    page_fit own = {p, rsize, NULL, -1, 0}, any = {p, rsize, NULL, -1, 0};
    if (slot) ap_tree_walk_from(&p->slots[slot].trees[AP_POOL_SMALL], rsize, page_fit_visit, &own);
    ap_tree_walk_from(&p->slots[0].trees[AP_POOL_SMALL], rsize, page_fit_visit, &any);
    if (!any.best) return own.best;
    if (own.best && (own.best_score != any.best_score ? own.best_score > any.best_score
                     : own.best->size != any.best->size ? own.best->size < any.best->size
                     : own.best->addr < any.best->addr))
        return own.best;
    return any.best;
}

ap_block *ap_find_fit(ap_pool *p, int slot, int pool, size_t rsize) {
    if (pool == AP_POOL_SMALL && p->cfg.expandable) return page_fit_small(p, slot, rsize);
    ap_block *own = slot ? ap_tree_best_fit(&p->slots[slot].trees[pool], rsize) : NULL;
    ap_block *any = ap_tree_best_fit(&p->slots[0].trees[pool], rsize);
    ap_block *best = own;
    if (any && (!best || any->size < best->size)) best = any;
    /* Every other candidate is at least as large, so if the best fit is refused, all are. */
    return best && fit_allowed(p, best, rsize) ? best : NULL;
}

static inline int should_split(const ap_pool *p, const ap_block *b, size_t rsize) {
    size_t rest = b->size - rsize;
    /* PyTorch's rule: an oversize request (max_split_size or more) takes its block whole. A
       smaller one splits even a block that large: only a fresh segment can be one (fit_allowed
       refuses cached ones), the 20 MiB one medium requests share when large_segment_size_mb
       equals max_split_size_mb, or one rounded up to pages past it; kept whole, the request got
       all of it (40 MiB for 8.5 MiB) and its room served no one. An expandable segment's block
       splits whatever its size, as torch's (shouldSplit): the free tail such a request is served
       from is the whole segment's spare room (104 MiB went to a 40 MiB request). */
    if (p->no_split) return 0; /* torch's MemPool(no_split=True) */
    if (rsize >= p->cfg.max_split_size && !p->cfg.expandable) return 0;
    if (b->seg->pool == AP_POOL_SMALL) return rest >= p->cfg.min_block;
    return rest >= p->cfg.large_split_min;
}

void ap_take_block(ap_pool *p, ap_block *b, size_t rsize, size_t requested, int slot) {
    AP_ASSERT(b->state == AP_BLOCK_FREE && b->size >= rsize && (b->tag == 0 || b->tag == slot));
    ap_free_remove(p, b);
    b->state = AP_BLOCK_ALLOCATED; /* before the split: the rest must not merge back into it */
    if (should_split(p, b, rsize)) {
        ap_block *rest = ap_block_new(p);
        if (rest) { /* without a struct the block is simply not split */
            rest->addr = b->addr + rsize;
            rest->size = b->size - rsize;
            rest->seg = b->seg;
            rest->prev = b;
            rest->next = b->next;
            if (b->next) b->next->prev = rest;
            b->next = rest;
            b->size = rsize;
            if (!b->prev) b->seg->ctx = 0; /* torch's segment frames live on its head block and stay
                                              with the rest when that is split off: they are gone */
            ap_free_insert(p, rest, b->tag);
            AP_ASSERT(ap_block_links_ok(b));
        }
    }
    ap_mark_allocated(p, b, requested, slot);
}

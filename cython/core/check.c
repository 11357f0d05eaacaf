/* The pool's invariants, checked on demand (pool._check_invariants(), the property and stress
 * tests): block tiling and links, free trees, the recent-free cache, pending list, live map,
 * slots and events, and every maintained statistic against a recount. Walks everything: O(blocks),
 * never on a hot path. Call with the pool quiet or under its lock (ap_pool_check takes it). */
#include <stdarg.h>
#include <string.h>

#include "pool_internal.h"

typedef struct {
    char *msg;
    size_t len;
    int bad;
} check_ctx;

static int fail(check_ctx *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(check_ctx *c, const char *fmt, ...) {
    if (!c->bad) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->msg, c->len, fmt, ap);
        va_end(ap);
    }
    c->bad = 1;
    return -1;
}

#define CHECK(cond, ...) \
    do { if (!(cond)) return fail(c, __VA_ARGS__); } while (0)

typedef struct {
    int slot, kind;
    size_t count, bytes, last_size;
    int bad;
    const ap_block *culprit;
} tree_walk;

static void count_exact(ap_block *b, void *arg) { ((uint32_t *)arg)[ap_exact_bucket(b->size, b->tag)]++; }

static void visit(ap_block *b, void *arg) {
    tree_walk *w = arg;
    if (w->bad) return;
    if (b->state != AP_BLOCK_FREE || b->tag != w->slot || b->seg->pool != w->kind || b->size < w->last_size) {
        w->bad = 1;
        w->culprit = b;
    }
    w->last_size = b->size;
    w->count++;
    w->bytes += b->size;
}

static int check_trees(ap_pool *p, check_ctx *c, size_t *free_blocks) {
    for (int s = 0; s < p->n_slots; s++)
        for (int k = 0; k < 2; k++) {
            ap_free_tree *t = &p->slots[s].trees[k];
            tree_walk w = {s, k, 0, 0, 0, 0, NULL};
            CHECK(ap_tree_check(t), "free tree of slot %d (%s pool) breaks search or heap order, or its counts",
                  s, k ? "large" : "small");
            ap_tree_visit(t, visit, &w);
            CHECK(!w.bad, "free tree of slot %d (%s pool) holds block 0x%lx (%zu bytes, state %d, tag %d) out of "
                  "order or not a free block of it", s, k ? "large" : "small", (unsigned long)w.culprit->addr,
                  w.culprit->size, w.culprit->state, w.culprit->tag);
            CHECK(w.count == t->count && w.bytes == t->bytes, "free tree of slot %d (%s pool) counts %zu blocks / "
                  "%zu bytes but holds %zu / %zu", s, k ? "large" : "small", t->count, t->bytes, w.count, w.bytes);
            CHECK(s == 0 || p->slots[s].live || !t->count, "retired slot %d still holds %zu free blocks", s, t->count);
            *free_blocks += w.count;
        }
    uint32_t exact[AP_EXACT_BUCKETS];
    memset(exact, 0, sizeof exact);
    for (int s = 0; s < p->n_slots; s++) ap_tree_visit(&p->slots[s].trees[AP_POOL_SMALL], count_exact, exact);
    for (int i = 0; i < AP_EXACT_BUCKETS; i++)
        CHECK(exact[i] == p->small_exact[i], "small_exact bucket %d counts %u tree blocks but the trees hold %u", i,
              p->small_exact[i], exact[i]);
    return 0;
}

static int check_cache(ap_pool *p, check_ctx *c, size_t *cached) {
    int n = 0;
    for (int bin = 0; bin < AP_CACHE_BINS; bin++) {
        CHECK(p->cache_n[bin] <= AP_CACHE_DEPTH, "cache bin %d holds %d blocks (depth %d)", bin, p->cache_n[bin],
              AP_CACHE_DEPTH);
        for (int i = 0; i < p->cache_n[bin]; i++) {
            ap_block *b = p->cache[bin][i];
            CHECK(b->state == AP_BLOCK_CACHED && b->seg->pool == AP_POOL_SMALL, "cached block 0x%lx has state %d, "
                  "pool %d", (unsigned long)b->addr, b->state, b->seg->pool);
            CHECK(p->cache_key[bin][i] == ap_cache_key(b->size, b->tag) && ap_cache_bin(b->size) == (unsigned)bin,
                  "cached block 0x%lx (%zu bytes, slot %d) is under a wrong key or bin", (unsigned long)b->addr,
                  b->size, b->tag);
            CHECK(b->tag < p->n_slots, "cached block 0x%lx names slot %d of %d", (unsigned long)b->addr, b->tag,
                  p->n_slots);
            /* merge-at-free would have merged it with such a neighbour (free_cache.h) */
            CHECK(ap_cache_isolated(b, b->tag), "cached block 0x%lx (%zu bytes, slot %d) has a "
                  "free or cached neighbour it merges with", (unsigned long)b->addr, b->size, b->tag);
            n++;
        }
    }
    CHECK(n == p->n_cached, "cache counts %d blocks but holds %d", p->n_cached, n);
    *cached = (size_t)n;
    return 0;
}

static int check_pending(ap_pool *p, check_ctx *c, int64_t *blocks, int64_t *bytes, int64_t *by_kind) {
    ap_block *last = NULL;
    int checked = 0;
    for (ap_block *b = p->pending_head; b; b = b->pending_next) {
        checked |= b == p->pending_checked;
        CHECK(b->state == AP_BLOCK_PENDING, "block 0x%lx on the pending list has state %d", (unsigned long)b->addr,
              b->state);
        CHECK(b->xs && ap_uses_ok(b->xs) && b->xs->n_events + b->xs->n_owed <= b->xs->cap + b->xs->fcap + 1 &&
                  b->xs->n_fevents + b->xs->n_foreign <= b->xs->fcap,
              "pending block 0x%lx has no valid event list",
              (unsigned long)b->addr);
        (*blocks)++;
        *bytes += (int64_t)b->size;
        by_kind[b->seg->pool] += (int64_t)b->size;
        last = b;
    }
    CHECK(p->pending_tail == last, "pending tail is not the last pending block");
    CHECK(!p->pending_gated || checked, "the pending frees are gated up to a block not on the pending list");
    return 0;
}

int ap_pool_check(ap_pool *p, char *msg, size_t len) {
    check_ctx cc = {msg, len, 0}, *c = &cc;
    if (len) msg[0] = 0;
    pthread_mutex_lock(&p->lock);
    int rc = -1;
    size_t free_blocks = 0, cached = 0, n_segments = 0, n_free_segments = 0;
    int64_t alloc_n[2] = {0}, alloc_b[2] = {0}, req_b[2] = {0}, reserved[2] = {0}, segs[2] = {0}, shared_n = 0;
    int64_t over_alloc = 0, over_segs = 0; /* oversize_allocations / _segments, recounted */
    int64_t split_n[2] = {0}, split_b[2] = {0}, pend_n = 0, pend_b = 0, pend_kind[2] = {0};
    size_t seen_free = 0, seen_cached = 0, seen_pending = 0;
    if (check_trees(p, c, &free_blocks) || check_cache(p, c, &cached) ||
        check_pending(p, c, &pend_n, &pend_b, pend_kind))
        goto out;
    /* classic_policy.c: the trade credit pays for every refill of the room trades left */
    if (p->trade_credit < ap_classic_refills_owed(p) * 1000 || p->protect_credit < 0) {
        fail(c, "trade credit %lld/1000 calls does not cover the %lld refills owed for %zu bytes of trade room "
             "(floor credit %lld/1000)", (long long)p->trade_credit, (long long)ap_classic_refills_owed(p),
             p->trade_room, (long long)p->protect_credit);
        goto out;
    }
    for (ap_segment *s = p->segments; s; s = s->next) {
        n_segments++;
        if (s->next && s->next->prev != s) { fail(c, "segment list links broken at 0x%lx", (unsigned long)s->base); goto out; }
        if (!s->first || s->first->prev || s->first->addr != s->base) {
            fail(c, "segment 0x%lx does not start with its first block", (unsigned long)s->base);
            goto out;
        }
        segs[s->pool]++;
        reserved[s->pool] += (int64_t)s->size;
        int over = ap_oversize(p, s->pool, s->size);
        if (over != s->oversize) {
            fail(c, "segment 0x%lx (%zu bytes) has oversize flag %d", (unsigned long)s->base, s->size, s->oversize);
            goto out;
        }
        over_segs += over;
        uintptr_t at = s->base;
        for (ap_block *b = s->first; b; b = b->next) {
            if (b->seg != s || b->addr != at || !b->size || b->size % p->cfg.min_block ||
                (b->next && b->next->prev != b)) {
                fail(c, "block 0x%lx (%zu bytes) of segment 0x%lx does not tile it (expected at 0x%lx)",
                     (unsigned long)b->addr, b->size, (unsigned long)s->base, (unsigned long)at);
                goto out;
            }
            at += b->size;
            int whole = !b->prev && !b->next;
            switch (b->state) {
            case AP_BLOCK_ALLOCATED:
                alloc_n[s->pool]++;
                alloc_b[s->pool] += (int64_t)b->size;
                over_alloc += ap_oversize(p, s->pool, b->size);
                req_b[s->pool] += (int64_t)b->requested;
                if (b->xs && !ap_uses_ok(b->xs)) {
                    fail(c, "allocated block 0x%lx has %d uses and %d of other devices in arrays of %d and %d that "
                         "are not its own", (unsigned long)b->addr, b->xs->n_uses, b->xs->n_foreign, b->xs->cap,
                         b->xs->fcap);
                    goto out;
                }
                if (s->shared) { /* a shared block: alone in its segment, and never in the live map */
                    shared_n++;
                    if (!whole || ap_map_get(&p->live, b->addr)) {
                        fail(c, "shared block 0x%lx is %s", (unsigned long)b->addr,
                             whole ? "in the live map (pool.free could free it)" : "not alone in its segment");
                        goto out;
                    }
                } else if (ap_map_get(&p->live, b->addr) != b) {
                    fail(c, "allocated block 0x%lx is not in the live map", (unsigned long)b->addr);
                    goto out;
                }
                break;
            case AP_BLOCK_FREE:
                seen_free++;
                if (whole) n_free_segments++;
                if (b->counted_split != !whole) {
                    fail(c, "free block 0x%lx: split count flag %d for a %s block", (unsigned long)b->addr,
                         b->counted_split, whole ? "whole-segment" : "split");
                    goto out;
                }
                if (b->next && b->next->state == AP_BLOCK_FREE &&
                    (b->tag == b->next->tag || !b->tag || !b->next->tag)) {
                    fail(c, "free blocks 0x%lx (slot %d) and 0x%lx (slot %d) are neighbours that should have "
                         "merged", (unsigned long)b->addr, b->tag, (unsigned long)b->next->addr, b->next->tag);
                    goto out;
                }
                break;
            case AP_BLOCK_CACHED:
                seen_cached++;
                if (b->counted_split) { /* stats count a cached block's merged run (free_cache.h) */
                    fail(c, "cached block 0x%lx is counted in inactive_split", (unsigned long)b->addr);
                    goto out;
                }
                break;
            case AP_BLOCK_PENDING: /* requested until it completes (pool.c unmark_allocated) */
                seen_pending++;
                req_b[s->pool] += (int64_t)b->requested;
                break;
            default:
                fail(c, "block 0x%lx is in transient state %d outside any operation", (unsigned long)b->addr, b->state);
                goto out;
            }
            if (b->state == AP_BLOCK_FREE || b->state == AP_BLOCK_CACHED) {
                split_n[s->pool] += b->counted_split;
                split_b[s->pool] += b->counted_split ? (int64_t)b->size : 0;
            }
        }
        if (at != s->base + s->size) {
            fail(c, "the blocks of segment 0x%lx cover %lu of its %zu bytes", (unsigned long)s->base,
                 (unsigned long)(at - s->base), s->size);
            goto out;
        }
    }
    if (n_segments != p->n_segments) { fail(c, "segment list holds %zu, count says %zu", n_segments, p->n_segments); goto out; }
    /* Expandable segments grow and split under their free blocks: expandable.c recounts them. */
    if (n_free_segments != p->n_free_segments) {
        fail(c, "%zu segments are one free block, count says %zu", n_free_segments, p->n_free_segments);
        goto out;
    }
    if (seen_free != free_blocks || seen_cached != cached || (int64_t)seen_pending != pend_n) {
        fail(c, "blocks by state (free %zu, cached %zu, pending %zu) differ from the trees (%zu), cache (%zu) and "
             "pending list (%lld)", seen_free, seen_cached, seen_pending, free_blocks, cached, (long long)pend_n);
        goto out;
    }
    if ((int64_t)p->live.count != alloc_n[0] + alloc_n[1] - shared_n) {
        fail(c, "live map holds %zu blocks, %lld are allocated (%lld of them shared)", p->live.count,
             (long long)(alloc_n[0] + alloc_n[1]), (long long)shared_n);
        goto out;
    }
    struct { int stat; int64_t *v; const char *name; } recount[] = {
        {AP_STAT_ALLOCATION, alloc_n, "allocation"}, {AP_STAT_ALLOCATED_BYTES, alloc_b, "allocated_bytes"},
        {AP_STAT_REQUESTED_BYTES, req_b, "requested_bytes"}, {AP_STAT_RESERVED_BYTES, reserved, "reserved_bytes"},
        {AP_STAT_SEGMENT, segs, "segment"}, {AP_STAT_INACTIVE_SPLIT, split_n, "inactive_split"},
        {AP_STAT_INACTIVE_SPLIT_BYTES, split_b, "inactive_split_bytes"},
    };
    size_t n_recount = sizeof recount / sizeof recount[0] - (p->cfg.expandable ? 2 : 0);
    for (size_t i = 0; i < n_recount; i++)
        for (int k = 0; k < 2; k++) {
            int64_t have = p->stats.s[recount[i].stat][1 + k].current;
            if (have != recount[i].v[k]) {
                fail(c, "stat %s.%s is %lld, a recount gives %lld", recount[i].name, k ? "large_pool" : "small_pool",
                     (long long)have, (long long)recount[i].v[k]);
                goto out;
            }
            /* all's current is the pools' sum (stats.h), never above its peak; its own is not kept */
            if (k == 1 && (p->stats.s[recount[i].stat][0].current != 0 || p->stats.s[recount[i].stat][0].freed != 0 ||
                           ap_stat_all_current(&p->stats, recount[i].stat) > p->stats.s[recount[i].stat][0].peak)) {
                fail(c, "stat %s.all is not the sum of its pools", recount[i].name);
                goto out;
            }
        }
    if (p->stats.oversize[0].current != over_alloc || p->stats.oversize[1].current != over_segs) {
        fail(c, "oversize stats (%lld allocations, %lld segments) differ from a recount (%lld, %lld)",
             (long long)p->stats.oversize[0].current, (long long)p->stats.oversize[1].current,
             (long long)over_alloc, (long long)over_segs);
        goto out;
    }
    if (p->stats.pending[0][AP_STAT_ALL].current != pend_n || p->stats.pending[1][AP_STAT_ALL].current != pend_b ||
        p->stats.pending[1][1].current != pend_kind[0] || p->stats.pending[1][2].current != pend_kind[1]) {
        fail(c, "pending stats (%lld blocks, %lld bytes) differ from the pending list (%lld, %lld)",
             (long long)p->stats.pending[0][AP_STAT_ALL].current, (long long)p->stats.pending[1][AP_STAT_ALL].current,
             (long long)pend_n, (long long)pend_b);
        goto out;
    }
    if (p->event_pins < 0 || p->n_cached_events < 0 || (!p->event_pins && p->n_cached_events > p->event_cache_max) ||
        p->n_parked < 0 || p->n_parked > p->parked_cap ||
        p->live_events < p->n_cached_events + p->n_parked) {
        fail(c, "event cache: %d idle and %d parked of %lld live (bound %d, pins %d)", p->n_cached_events,
             p->n_parked, (long long)p->live_events, p->event_cache_max, p->event_pins);
        goto out;
    }
    if (p->records_out != ap_records_counted(p)) {
        fail(c, "new-mode records in flight: %d counted, %d held", p->records_out, ap_records_counted(p));
        goto out;
    }
    if (p->last_slot < 0 || p->last_slot >= p->n_slots || p->n_slots > AP_MAX_STREAMS) {
        fail(c, "slot table: last %d of %d", p->last_slot, p->n_slots);
        goto out;
    }
    rc = 0;
out:
    pthread_mutex_unlock(&p->lock);
    return rc;
}

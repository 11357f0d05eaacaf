/* Segments: device allocations, the release policy and the out-of-memory path.
 *
 * Segment sizes: small-pool segments are 2 MiB (many small blocks share one huge page); a large
 * request gets a segment of its own size rounded up to whole 2 MiB pages, so that when it is
 * freed the whole segment is free and can serve any later request or go back to the device
 * (a request below 10 MiB shares a 20 MiB segment, as torch_npu's: segment_size_for). Under a
 * byte limit whose room is below that segment, the request's exact rounded size; a small request
 * the cap leaves no room for is cut from the preallocated reserve (reserve_fit).
 *
 * Release policy: when a miss needs a new segment and reserved memory would rise above its
 * earlier peak, fully free segments are traded for the growth so that the pool takes the new shape
 * instead of growing. AP_RELEASE_BUDGETED (the default) pays each trade from a budget of device
 * calls (classic_policy.c, docs/placement-policy.md); AP_RELEASE_UNDER_PEAK trades every time
 * (largest first), so nothing bounds its calls when a workload keeps changing shape; expandable
 * segments trade single chunks under their own budget (vmm_policy.c).
 */
#include <stdlib.h>

#include "pool_internal.h"

size_t ap_reserved(const ap_pool *p) {
    return (size_t)ap_stat_all_current(&p->stats, AP_STAT_RESERVED_BYTES);
}

static int device_error(ap_pool *p, ap_error *err, int rc, const char *what, size_t size) {
    char msg[AP_RUNTIME_MSG];
    p->backend->error_message(p->backend, rc, msg, sizeof msg);
    return ap_set_error(err, AP_E_DEVICE, rc, "%s of %zu bytes on device %d failed (%d): %s", what, size,
                        p->device, rc, msg);
}

int ap_segment_alloc(ap_pool *p, int pool, size_t size, int slot, int pinned, ap_block **out, ap_error *err) {
    if (p->cfg.limit_bytes != AP_NO_LIMIT && ap_reserved(p) + size > p->cfg.limit_bytes) {
        p->cap_refused = 0;
        return ap_set_error(err, AP_E_LIMIT, 0, "limit of %zu bytes reached", p->cfg.limit_bytes);
    }
    ap_segment *seg = ap_segment_new(p);
    ap_block *b = seg ? ap_block_new(p) : NULL;
    if (!b) {
        if (seg) ap_segment_recycle(p, seg);
        return ap_set_error(err, AP_E_HOST_NOMEM, 0, "host memory for pool bookkeeping exhausted");
    }
    if (ap_device_cap_book(p, size, err) != AP_OK) {
        ap_block_recycle(p, b);
        ap_segment_recycle(p, seg);
        return AP_E_LIMIT;
    }
    if (p->quota.reserve) {
        char why[200] = "";
        if (p->quota.reserve(p->quota.ctx, p->device, size, why, sizeof why) != 0) {
            ap_device_cap_unbook(p, size);
            ap_block_recycle(p, b);
            ap_segment_recycle(p, seg);
            return ap_set_error(err, AP_E_QUOTA, 0, "%s", why);
        }
    }
    void *ptr = NULL;
    int rc = p->backend->malloc(p->backend, p->device, &ptr, size);
    if (rc != 0) {
        ap_device_cap_unbook(p, size);
        if (p->quota.release) p->quota.release(p->quota.ctx, p->device, size);
        ap_block_recycle(p, b);
        ap_segment_recycle(p, seg);
        return device_error(p, err, rc, "device malloc", size);
    }
    seg->base = (uintptr_t)ptr;
    seg->life = ap_backend_life(p->backend, p->device, 0); /* read after the call: a renewal inside it is this one's */
    seg->size = size;
    seg->pool = pool;
    seg->pinned = pinned;
    seg->alloc_slot = (uint16_t)slot;
    seg->ctx = p->history.capacity ? ap_history_tls_ctx : 0;
    seg->first = b;
    ap_segment_link(p, seg);
    b->addr = seg->base;
    b->size = size;
    b->seg = seg;
    p->stats.num_device_alloc++;
    ap_stat_inc(&p->stats, AP_STAT_RESERVED_BYTES, pool, (int64_t)size);
    if (ap_reserved(p) > p->reserved_watermark) {
        if (p->cfg.release_policy == AP_RELEASE_BUDGETED && !p->cfg.expandable) ap_classic_peak_rose(p, ap_reserved(p));
        p->reserved_watermark = ap_reserved(p);
    }
    ap_history_add(&p->history, AP_ACT_SEGMENT_ALLOC, seg->base, size, slot ? p->slots[slot].stream : NULL);
    /* A fresh segment serves any stream, except in the tied baseline where it is its stream's. */
    *out = ap_free_insert(p, b, p->cfg.stream_reuse == AP_REUSE_TIED ? slot : 0);
    return AP_OK;
}

/* Returns a fully free segment (its one block is in the any-stream tree) to the device. */
int ap_segment_release(ap_pool *p, ap_segment *seg, ap_error *err) {
    ap_block *b = seg->first;
    ap_free_remove(p, b);
    int rc = p->backend->free(p->backend, p->device, (void *)seg->base);
    if (rc != 0) { /* keep it cached: the pool stays consistent */
        ap_free_insert(p, b, b->tag);
        return device_error(p, err, rc, "device free", seg->size);
    }
    ap_segment_unlink(p, seg);
    if (p->quota.release) p->quota.release(p->quota.ctx, p->device, seg->size);
    ap_device_cap_unbook(p, seg->size);
    p->stats.num_device_free++;
    ap_stat_dec(&p->stats, AP_STAT_RESERVED_BYTES, seg->pool, (int64_t)seg->size);
    ap_history_add(&p->history, AP_ACT_SEGMENT_FREE, seg->base, seg->size, NULL);
    ap_block_recycle(p, b);
    ap_segment_recycle(p, seg);
    return AP_OK;
}

static ap_segment *pick_free_segment(ap_pool *p, int include_pinned, int oldest_first, int skip_tagged) {
    ap_segment *pick = NULL;
    for (ap_segment *s = p->segments; s; s = s->next) {
        if (!ap_segment_is_free(s) || (s->pinned && !include_pinned) || (skip_tagged && s->first->tag)) continue;
        if (!pick || (oldest_first ? s->last_use < pick->last_use : s->size > pick->size)) pick = s;
    }
    return pick;
}

typedef struct {
    ap_segment *seg;
    size_t at; /* its place in the segment list: pick_free_segment keeps the first of equal sizes */
} release_item;

static int largest_first(const void *a, const void *b) {
    const release_item *x = a, *y = b;
    if (x->seg->size != y->seg->size) return x->seg->size > y->seg->size ? -1 : 1;
    return x->at < y->at ? -1 : 1;
}

/* Every free segment going (empty_cache, an orphan's free): pick_free_segment walks every segment
   for each one released, and 16,000 free 2 MiB segments took 0.7 s. The same order (largest
   first, then list order) from one sort, where none of them waits for a stream (a settle below
   may merge blocks into new ones: the loop keeps those). -1 when not taken (the loop does it all). */
static long release_all_sorted(ap_pool *p, int include_pinned, ap_error *err, size_t *released) {
    if (p->n_free_segments < 8) return -1;
    release_item *items = malloc(p->n_free_segments * sizeof *items);
    if (!items) return -1;
    size_t n = 0, at = 0;
    for (ap_segment *s = p->segments; s; s = s->next, at++) {
        if (!ap_segment_is_free(s) || (s->pinned && !include_pinned)) continue;
        if (s->first->tag || n == p->n_free_segments) { /* waits for a stream: the loop's order */
            free(items);
            return -1;
        }
        items[n++] = (release_item){s, at};
    }
    qsort(items, n, sizeof *items, largest_first);
    long rc = 0;
    for (size_t i = 0; i < n && rc == 0; i++) {
        size_t size = items[i].seg->size;
        if (ap_segment_release(p, items[i].seg, err) != AP_OK) rc = 1;
        else *released += size;
    }
    free(items);
    return rc;
}

size_t ap_release_free_segments(ap_pool *p, size_t target, int include_pinned, int oldest_first, ap_error *err) {
    if (p->cfg.expandable) return ap_vmm_release(p, target, err);
    size_t released = 0;
    ap_cache_flush(p);
    if (target == (size_t)-1 && !oldest_first && release_all_sorted(p, include_pinned, err, &released) == 1)
        return released; /* a release failed: the loop would have stopped there too */
    /* Explicit trims (empty_cache, a lowered quota or limit, the out-of-memory path) may wait for
       streams: a free segment split into blocks of different streams becomes whole once they are
       settled. The release policies on the allocation path never wait. */
    int may_settle = include_pinned || target == (size_t)-1;
    int skip_tagged = 0; /* set once a stream-tagged segment's stream was found busy */
    ap_cache_flush(p);
    while (released < target) {
        ap_segment *s = p->n_free_segments ? pick_free_segment(p, include_pinned, oldest_first, skip_tagged) : NULL;
        if (!s && may_settle) {
            may_settle = 0;
            if (ap_settle_free_slots(p, err) > 0) continue; /* idle streams only: no wait */
        }
        if (!s) break;
        if (s->first->tag) { /* its stream may still use it: released only once that stream is idle */
            if (ap_settle_slot(p, s->first->tag, err) != AP_OK) skip_tagged = 1; /* busy: never wait here */
            continue; /* settling may have merged blocks: pick again */
        }
        size_t size = s->size;
        if (ap_segment_release(p, s, err) != AP_OK) break;
        released += size;
    }
    return released;
}

/* The wholly free classic segments that `slot`'s allocations created and that no stream's queued
   work still holds (CuPy's per-stream arena: free_all_blocks(stream)), not the preallocated
   reserve. The caller has waited for the stream, so its own frees are untagged by now. Returns
   bytes released. */
size_t ap_release_stream_segments(ap_pool *p, int slot, ap_error *err) {
    size_t released = 0;
    ap_cache_flush(p);
    for (ap_segment *s = p->segments, *next; s; s = next) {
        next = s->next; /* s may be unlinked below */
        if (s->expandable || s->pinned || !ap_segment_is_free(s) || s->first->tag || s->alloc_slot != slot)
            continue; /* the preallocated reserve is no stream's: it goes with empty_cache */
        size_t size = s->size;
        if (ap_segment_release(p, s, err) != AP_OK) break;
        released += size;
    }
    return released;
}

/* Bytes a growth may take under the byte limit now (SIZE_MAX: none), and under the device's memory
   fraction, which the device's other plain pools share (a MemPool's requests that fit under it were
   refused for a 2 MiB segment the pool's own limit would have made exact). */
size_t ap_limit_room(const ap_pool *p) {
    size_t reserved = ap_reserved(p), cap = ap_device_cap_room(p);
    if (p->cfg.limit_bytes == AP_NO_LIMIT) return cap;
    size_t own = p->cfg.limit_bytes > reserved ? p->cfg.limit_bytes - reserved : 0;
    return own < cap ? own : cap;
}

/* A classic segment for rsize. A medium request shares a 20 MiB segment with others, as in
   torch_npu: the pool grows in fewer device calls and keeps torch_npu's layout for these sizes,
   which it is measured against (docs/placement-policy.md, "Growth size"); with 1 GiB pages a
   segment is one page whatever the request. Under a byte limit, the shared segment only while
   the limit has room for it: a 1 MiB request alone in its 2 MiB page left half of a limit unused
   (RMM's, CuPy's and torch's limit tests fill theirs); past that, the request's own size, which a
   shared segment the limit refused would cost a retry. Under a tenant quota, always the
   request's own size: the room is node-wide, other processes of the tenant take it meanwhile,
   and a refused shared growth would count a quota refusal. With `shared` 0: the request's own
   size (the fallback when a shared growth is refused).
   Under a byte limit whose room is below the segment chosen so (a 2 MiB small segment, the
   2 MiB floor, whole pages), the segment is exactly rsize: the runtime takes any size
   (aclrtMallocAlign32 rounds to 32 bytes, which rsize, a multiple of 512, already is), so a
   request that fits under the limit is served, as CuPy's and RMM's limits count exact sizes
   (before, every request was refused once less than 2 MiB was left, and a limit below 2 MiB
   refused all). Never without a limit: an unlimited pool's placement is unchanged. A tenant
   quota keeps whole segments: its room is node-wide and unknown here (as above). */
static size_t segment_size_for(const ap_pool *p, int pool, size_t rsize, int shared) {
    size_t room = ap_limit_room(p), size;
    if (pool == AP_POOL_SMALL) {
        size = p->cfg.small_segment;
    } else {
        shared = shared && rsize < AP_MIN_LARGE_ALLOC && !p->quota.reserve;
        if (shared && room != SIZE_MAX) {
            size_t buffer = ap_round_up(p->cfg.large_segment, p->cfg.page_size);
            shared = room >= (buffer < p->cfg.min_large_segment ? p->cfg.min_large_segment : buffer);
        }
        size = shared ? p->cfg.large_segment : rsize;
        size = ap_round_up(size, p->cfg.page_size); /* alone: once freed, its segment is wholly free */
        if (size < p->cfg.min_large_segment) size = p->cfg.min_large_segment;
    }
    return room != SIZE_MAX && room < size ? rsize : size;
}

/* garbage_collection_threshold, as PyTorch collects: the wholly free segments idle for at least
   the average idle time (allocations since they became free) go, all of them in a pass, not just
   enough for `target`; passes repeat, each against the average of those left, until `target`
   bytes are released or a pass releases nothing. A pass that stopped at the target would leave
   the old cache in place for the next growth to collect again. Segments that a busy stream's
   queued work may still use, and the preallocated reserve, stay (no wait on the allocation path).
   Returns bytes released. */
static size_t gc_collect(ap_pool *p, size_t target) {
    ap_cache_flush(p);
    (void)ap_settle_free_slots(p, NULL); /* free blocks of idle streams become the pool's: asks, never waits */
    uint64_t total_age = 0;
    size_t count = 0, released = 0;
    for (ap_segment *s = p->segments; s; s = s->next)
        if (!s->pinned && ap_segment_is_free(s) && !s->first->tag) total_age += p->tick - s->free_since, count++;
    int freed = 1;
    while (released < target && freed && count > 0) {
        double age_threshold = (double)total_age / (double)count;
        freed = 0;
        for (ap_segment *s = p->segments, *next; s; s = next) {
            next = s->next; /* s may be unlinked below */
            if (s->pinned || !ap_segment_is_free(s) || s->first->tag) continue;
            uint64_t age = p->tick - s->free_since;
            if ((double)age < age_threshold) continue;
            size_t size = s->size;
            if (ap_segment_release(p, s, NULL) != AP_OK) return released;
            released += size;
            total_age -= age;
            count--;
            freed = 1;
        }
    }
    return released;
}

/* Makes room under the policies before growing by `size` bytes (expandable: at most `size`; the
   policy asks how much a growth for rsize would really map). Returns the bytes to grow by
   (classic: a trade's growth may absorb what its releases freed beyond the need). */
static size_t trim_before_growth(ap_pool *p, int slot, int pool, size_t rsize, size_t size) {
    size_t reserved = ap_reserved(p);
    int idle = p->cfg.expandable || p->n_free_segments; /* anything that could be released? */
    if (p->cfg.gc_threshold > 0 && idle) {
        size_t cap = p->cfg.limit_bytes != AP_NO_LIMIT ? p->cfg.limit_bytes : (size_t)p->stats.device_total_bytes;
        size_t threshold = (size_t)(p->cfg.gc_threshold * (double)cap);
        /* The memory fraction's owner (the default pool) counts what the device's allocator holds,
           its MemPools' segments too, as torch's total_allocated_memory: its own reserved bytes
           left its idle cache in place beside MemPools holding most of the fraction. */
        size_t used = reserved;
        if (p->device_cap && __atomic_load_n(&p->device_cap->owner, __ATOMIC_SEQ_CST) == p) {
            size_t held = atomic_load(&p->device_cap->held);
            if (held > used) used = held;
        }
        if (used + size > threshold) {
            size_t target = used + size - threshold;
            reserved -= p->cfg.expandable ? ap_release_free_segments(p, target, 0, 1, NULL) : gc_collect(p, target);
        }
    }
    if (p->cfg.release_policy == AP_RELEASE_NEVER || !idle) return size;
    if (p->cfg.expandable) { /* vmm_policy.c budgets its trades under either policy */
        const ap_block *keep; /* planned again: the trim above may have changed the picture */
        size_t need = ap_vmm_plan(p, slot, pool, rsize, &keep);
        ap_vmm_make_room(p, rsize, need, keep);
        return size;
    }
    if (p->cfg.release_policy == AP_RELEASE_BUDGETED) return ap_classic_make_room(p, pool, rsize, size);
    /* under_peak: every growth past the peak trades idle segments for it, whatever it costs in calls */
    if (reserved + size > p->reserved_watermark)
        ap_release_free_segments(p, reserved + size - p->reserved_watermark, 0, 0, NULL);
    return size;
}

/* 1 when returning the idle reserve could let a growth of `size` bytes through: under the byte
   limit, and within the device's free memory once the reserve is back there. A request that
   fails whatever is released must not cost the reserve (it would be gone for nothing). A tenant
   quota is not checked here: its refusal after the release is the rare case left. */
static int reserve_would_make_room(ap_pool *p, size_t size) {
    size_t idle = 0;
    for (ap_segment *s = p->segments; s; s = s->next)
        if (s->pinned && ap_segment_is_free(s) && !s->first->tag) idle += s->size;
    if (!idle) return 0;
    if (p->cfg.limit_bytes != AP_NO_LIMIT && ap_reserved(p) - idle + size > p->cfg.limit_bytes) return 0;
    size_t free_b = 0, total_b = 0;
    if (p->backend->mem_info(p->backend, p->device, &free_b, &total_b) == 0 && free_b + idle < size) return 0;
    return 1;
}

/* A small request's best fit in the free blocks of the preallocated reserve (a large-pool
   segment, which the small pool never uses otherwise), or NULL. Used where the small pool cannot
   grow: the cap leaves no room for its segment, or the device or quota refused it. Carving the
   request out of the reserve keeps the reserve whole on the device, as RMM's pool whose initial
   size is its maximum serves every later request from it; before, the out-of-memory path gave
   the whole idle reserve back for a 1000-byte request and regrew it piece by piece. The block
   stays a large-pool block (counted there) and merges back into the reserve when freed.
   PyTorch's max_split_size still applies: a reserve at least that large is never split. */
static int reserve_block_visit(ap_block *b, void *arg) {
    if (!b->seg->pinned) return 0; /* another large segment's: the small pool does not split those */
    *(ap_block **)arg = b;
    return 1; /* tree order is by size: the first one is the best fit */
}

static ap_block *reserve_fit(ap_pool *p, int slot, size_t rsize) {
    if (p->cfg.expandable || !p->cfg.reserve_bytes) return NULL;
    ap_block *own = NULL, *any = NULL;
    if (slot) ap_tree_walk_from(&p->slots[slot].trees[AP_POOL_LARGE], rsize, reserve_block_visit, &own);
    ap_tree_walk_from(&p->slots[0].trees[AP_POOL_LARGE], rsize, reserve_block_visit, &any);
    ap_block *best = own && (!any || own->size < any->size) ? own : any;
    if (best && p->cfg.max_split_size != AP_NO_LIMIT && best->size >= p->cfg.max_split_size) return NULL;
    return best;
}

/* One attempt to get new device memory holding rsize: a segment of `size` bytes, or (expandable)
   a mapping that extends a segment in place. */
static int grow(ap_pool *p, int slot, int pool, size_t rsize, size_t size, ap_block **out, ap_error *err) {
    if (!p->cfg.expandable) return ap_segment_alloc(p, pool, size, slot, 0, out, err);
    err->status = AP_OK;
    *out = ap_vmm_grow(p, slot, pool, rsize, err);
    return *out ? AP_OK : err->status;
}

ap_block *ap_obtain_block(ap_pool *p, int slot, int pool, size_t rsize, size_t requested, ap_error *err) {
    (void)requested;
    ap_block *b;
    ap_cache_flush(p);
    if (p->pending_head) {
        ap_process_pending(p, 0, NULL);
        if ((b = ap_find_fit(p, slot, pool, rsize))) return b;
    }
    if (p->cfg.stream_reuse == AP_REUSE_BORROW && ap_borrow_from_streams(p, slot, pool, rsize, err) &&
        (b = ap_find_fit(p, slot, pool, rsize)))
        return b;

    /* A cap with no room for a small segment: the idle part of the reserve serves the request
       (no device call, the reserve kept), before an exact-size growth. */
    if (pool == AP_POOL_SMALL && ap_limit_room(p) < p->cfg.small_segment && (b = reserve_fit(p, slot, rsize)))
        return b;
    size_t size = p->cfg.expandable ? ap_round_up(rsize, p->vmm_granularity) : segment_size_for(p, pool, rsize, 1);
    size_t own = p->cfg.expandable ? size : segment_size_for(p, pool, rsize, 0);
    size = trim_before_growth(p, slot, pool, rsize, size);
    int rc = grow(p, slot, pool, rsize, size, &b, err);
    if (rc == AP_OK) return b;
    if (rc == AP_E_HOST_NOMEM) return NULL;
    p->stats.num_alloc_retries++; /* one per allocation the device (or a limit) refused once */
    if (own < size) { /* a shared or absorbing growth that does not fit: the request's own size may */
        size = own;
        if ((rc = grow(p, slot, pool, rsize, size, &b, err)) == AP_OK) return b;
        if (rc == AP_E_HOST_NOMEM) return NULL;
    }

    /* A small request the device or quota refused: the reserve's idle part serves it, rather
       than idle segments or the reserve itself going back to the device (reserve_fit). */
    if (pool == AP_POOL_SMALL && (b = reserve_fit(p, slot, rsize))) return b;

    /* Out of device memory (or over the limit): return every idle segment and retry ... */
    ap_release_free_segments(p, (size_t)-1, 0, 0, NULL);
    if ((b = ap_find_fit(p, slot, pool, rsize))) return b;
    /* the limit's room may have grown: its segment again (without a limit: `own`, unchanged) */
    if (!p->cfg.expandable) size = segment_size_for(p, pool, rsize, 0);
    rc = grow(p, slot, pool, rsize, size, &b, err);
    if (rc == AP_OK) return b;
    /* ... then the preallocated reserve, if idle: a request it cannot serve itself (a small one:
       the reserve is a large-pool segment; one larger than it) would otherwise fail beside it,
       every such request for as long as the reserve fills the cap (RMM's pool whose initial size
       is its maximum serves a 1000-byte request; ours refused every small request). */
    if (!p->cfg.expandable && rc != AP_E_HOST_NOMEM && reserve_would_make_room(p, size) &&
        ap_release_free_segments(p, (size_t)-1, 1, 0, NULL) > 0) {
        if ((b = ap_find_fit(p, slot, pool, rsize))) return b;
        rc = grow(p, slot, pool, rsize, size, &b, err);
        if (rc == AP_OK) return b;
    }

    /* ... the caller (ap_pool_malloc) then waits for every stream with the lock dropped and
       retries once more. */
    return NULL;
}

/* Expandable segments: the pool's memory is physical chunks mapped into reserved address space.
 *
 * Why: in the classic pool, free space split across separate device allocations can never merge.
 * Here a miss first tries to map just enough new memory right after a segment whose last block is
 * free, so the new pages extend that block in place; mapping into a hole between two segments
 * joins them. Blocks never straddle unmapped memory because a segment is, by definition, a run of
 * contiguous mapped chunks.
 *
 * Chunks: one physical allocation per chunk of at most AP_VMM_CHUNK_MAX (32 MiB), 1/16 of a growth
 * above 512 MiB, or 1/32 of a pool above 1 GiB, mapped and unmapped whole, as the runtime requires.
 * A growth costs two calls (allocate + map) per chunk and a release two (unmap + free), so a
 * workload that grows to R bytes makes at least 2 R / chunk calls: 2 MiB pages cost sixteen times
 * more calls for the same bytes, while a chunk as large as its whole growth is pinned by any block
 * later carved from it (gpt2 trace: 444 MiB of waste, against 86 with 20 MiB chunks); 1/16 of a
 * large growth keeps a 1 GB tensor at 34 calls, and 1/32 of the pool keeps a large pool's growths
 * few chunks. 32 MiB rather than PyTorch's 20 MiB granule: on the perturbed workloads it lowers the
 * whole-trace calls of growing workloads at no cost in waste, where 48 MiB and more make a loop of
 * 20-200 MiB blocks trade later in its life (docs/placement-policy-expandable.md, "Chunk size").
 * A chunk is unmapped only when it lies wholly inside one free block; unmapping it splits its
 * segment. How much a growth maps beyond its need: vmm_policy.c.
 *
 * Trades: the release policy (vmm_policy.c, which decides when) unmaps idle chunks but keeps their
 * physical memory in p->vmm_spares; the growth that follows maps it again where it is needed. A
 * traded chunk thus costs an unmap and a map, not also a free and an allocation.
 */
#include <stdlib.h>

#include "pool_internal.h"

/* Largest chunk of a growth of `need` bytes: AP_VMM_CHUNK_MAX, or for a growth above 16 times that
   its 1/16, so that no growth costs more than 2 * (AP_VMM_GROWTH_CHUNKS + 1) calls; or 1/32 of
   reserved memory, so that the calls per byte grown fall as the pool grows (a growth of x times
   reserved costs at most 2 * (1 + 32 x) calls: growing to R bytes costs O(log R) extra chunks), while
   a chunk pinned by one live block holds at most 1/32 of the pool. */
size_t ap_vmm_chunk_cap(const ap_pool *p, size_t need) {
    size_t g = p->vmm_granularity;
    size_t cap = AP_VMM_CHUNK_MAX < g ? g : AP_VMM_CHUNK_MAX / g * g;
    size_t share = ap_round_up((need + AP_VMM_GROWTH_CHUNKS - 1) / AP_VMM_GROWTH_CHUNKS, g);
    size_t scale = ap_reserved(p) / AP_VMM_CHUNK_SHARE / g * g;
    if (share < scale) share = scale;
    return share > cap ? share : cap;
}

static int vmm_error(ap_pool *p, ap_error *err, int rc, const char *what, size_t size) {
    char msg[AP_RUNTIME_MSG];
    p->backend->error_message(p->backend, rc, msg, sizeof msg);
    return ap_set_error(err, AP_E_DEVICE, rc, "%s of %zu bytes on device %d failed (%d): %s", what, size, p->device,
                        rc, msg);
}

int ap_vmm_init(ap_pool *p, ap_error *err) {
    if (!p->backend->has_vmm)
        return ap_set_error(err, AP_E_DEVICE, 0,
                            "expandable_segments needs the runtime's virtual-memory calls, which the %s backend "
                            "(%s) does not provide",
                            p->backend->name, p->backend->path);
    size_t g = 0;
    int rc = p->backend->vmm_granularity(p->backend, p->device, &g);
    if (rc != 0) return vmm_error(p, err, rc, "allocation granularity query", 0);
    if (g == 0 || g > p->cfg.page_size || p->cfg.page_size % g)
        return ap_set_error(err, AP_E_DEVICE, 0, "device granularity %zu does not divide page_size %zu", g,
                            p->cfg.page_size);
    p->vmm_granularity = p->cfg.page_size;
    ap_vmm_policy_init(p);
    return AP_OK;
}

static ap_block *last_block(ap_segment *s) {
    ap_block *b = s->first;
    while (b->next) b = b->next;
    return b;
}

/* End of the unmapped room after address `end` in its space (next chunk, or the space's end). */
static uintptr_t room_until(const ap_vmm_space *sp, uintptr_t end) {
    for (const ap_vmm_chunk *c = sp->chunks; c; c = c->next)
        if (c->va >= end) return c->va;
    return sp->base + sp->size;
}

static ap_vmm_space *space_of(ap_pool *p, uintptr_t va) {
    for (ap_vmm_space *sp = p->spaces; sp; sp = sp->next)
        if (va >= sp->base && va < sp->base + sp->size) return sp;
    return NULL;
}

/* Smallest hole (or space tail) of at least size bytes in spaces of this pool kind; 0 if none. */
static uintptr_t find_hole(ap_pool *p, int pool, size_t size, ap_vmm_space **where) {
    uintptr_t best = 0;
    size_t best_len = (size_t)-1;
    for (ap_vmm_space *sp = p->spaces; sp; sp = sp->next) {
        if (sp->pool != pool) continue;
        uintptr_t cursor = sp->base;
        for (ap_vmm_chunk *c = sp->chunks;; c = c->next) {
            uintptr_t end = c ? c->va : sp->base + sp->size;
            size_t len = end - cursor;
            if (len >= size && len < best_len) {
                best = cursor;
                best_len = len;
                *where = sp;
            }
            if (!c) break;
            cursor = c->va + c->size;
        }
    }
    return best;
}

static ap_vmm_space *reserve_space(ap_pool *p, int pool, size_t size, ap_error *err) {
    size_t total = (size_t)p->stats.device_total_bytes;
    size_t want = ap_round_up(size > total ? size : total, p->vmm_granularity);
    if (want < AP_VMM_SPACE_MIN) want = AP_VMM_SPACE_MIN;
    ap_vmm_space *sp = calloc(1, sizeof *sp);
    if (!sp) {
        ap_set_error(err, AP_E_HOST_NOMEM, 0, "host memory for pool bookkeeping exhausted");
        return NULL;
    }
    void *va = NULL;
    int rc = p->backend->vmm_reserve(p->backend, p->device, want, &va);
    if (rc != 0) {
        free(sp);
        vmm_error(p, err, rc, "address reservation", want);
        return NULL;
    }
    if ((uintptr_t)va % p->vmm_granularity) { /* pages must start on page boundaries */
        p->backend->vmm_release(p->backend, p->device, va, want);
        free(sp);
        ap_set_error(err, AP_E_DEVICE, 0, "address reservation at %p is not aligned to %zu bytes", va,
                     p->vmm_granularity);
        return NULL;
    }
    sp->base = (uintptr_t)va;
    sp->size = want;
    sp->pool = pool;
    sp->next = p->spaces;
    p->spaces = sp;
    return sp;
}

/* Moves every block and chunk of `right` (which starts where `left` ends) into `left`. */
static void join_segments(ap_pool *p, ap_segment *left, ap_segment *right, ap_vmm_space *sp) {
    ap_block *tail = last_block(left);
    tail->next = right->first;
    right->first->prev = tail;
    for (ap_block *b = right->first; b; b = b->next) b->seg = left;
    for (ap_vmm_chunk *c = sp->chunks; c; c = c->next)
        if (c->seg == right) c->seg = left;
    left->size += right->size;
    if (right->last_use > left->last_use) left->last_use = right->last_use;
    ap_segment_unlink(p, right);
    ap_segment_sized(p, left);
    ap_segment_recycle(p, right);
}

/* 1 when b is a neighbour a fresh block would merge with (free_cache.h's rule) that another
   stream than slot's may still be using. */
static inline int other_streams_free(const ap_block *b, int slot) {
    int tag = 0;
    return ap_cache_joins(b, &tag) && tag && tag != slot;
}

static ap_segment *segment_ending_at(ap_vmm_space *sp, ap_vmm_chunk *c, uintptr_t va) {
    (void)sp;
    return c && c->va + c->size == va ? c->seg : NULL;
}

/* Where a growth for rsize goes: the segment whose free tail needs the fewest new pages (ties to
   the tightest room, so that holes between segments are filled, joining them, before a segment
   grows into open address space), or NULL for a hole of its own. *need: bytes to map. */
static ap_segment *plan_growth(ap_pool *p, int slot, int pool, size_t rsize, size_t *need) {
    size_t g = p->vmm_granularity;
    ap_segment *target = NULL;
    size_t best = (size_t)-1, target_room = (size_t)-1;
    for (ap_segment *s = p->segments; s; s = s->next) {
        if (s->pool != pool || !s->expandable) continue;
        ap_block *last = last_block(s);
        size_t have = last->state == AP_BLOCK_FREE && (last->tag == 0 || last->tag == slot) ? last->size : 0;
        if (have >= rsize) continue; /* refused by the fit rules: do not grow it further */
        size_t n = ap_round_up(rsize - have, g);
        uintptr_t end = s->base + s->size;
        size_t room = room_until(space_of(p, s->base), end) - end;
        if (room >= n && (n < best || (n == best && room < target_room))) {
            best = n;
            target = s;
            target_room = room;
        }
    }
    *need = target ? best : ap_round_up(rsize, g);
    return target;
}

size_t ap_vmm_plan(ap_pool *p, int slot, int pool, size_t rsize, const ap_block **keep) {
    size_t need;
    ap_segment *target = plan_growth(p, slot, pool, rsize, &need);
    *keep = target ? last_block(target) : NULL;
    return need;
}

/* Gives a list of unmapped chunks' physical memory back to the device (release_quota: and to the
   quota; else the caller releases their bytes with others). */
static void free_unmapped(ap_pool *p, ap_vmm_chunk *c, int release_quota) {
    while (c) {
        ap_vmm_chunk *next = c->next;
        p->backend->vmm_free(p->backend, p->device, c->handle);
        p->stats.num_device_free++;
        if (release_quota && p->quota.release) p->quota.release(p->quota.ctx, p->device, c->size);
        free(c);
        c = next;
    }
}

static ap_block *grow(ap_pool *p, int slot, int pool, size_t rsize, int exact, size_t *extended, ap_error *err) {
    size_t need;
    ap_segment *target = plan_growth(p, slot, pool, rsize, &need);
    /* Past its call budget, a growth to a new peak maps more than it needs, and a growth under the
       peak as much again as such growths mapped since the last new peak (vmm_policy.c): at
       most what the address space after the target segment holds. Never under a quota (its room is
       node-wide, unknown here), nor past the room the pool's own limit and the device's memory
       fraction leave (ap_limit_room), where the extra bytes could make a request that fits fail.
       Far from them the overshoot stays: without it each growth was exact, a device call per
       growing request (600 of 600 under set_limit(fraction=1.0), 229 without a limit). */
    size_t cap = ap_vmm_chunk_cap(p, need);
    size_t extra = ap_vmm_growth_extra(p, need, (need + cap - 1) / cap);
    if (exact || p->quota.reserve || !ap_limit_fits(p, need, extra)) extra = 0;
    *extended = extra;
    if (extra && target) {
        uintptr_t end = target->base + target->size;
        size_t room = room_until(space_of(p, target->base), end) - end;
        if (extra > room - need) extra = room - need;
    }
    need += extra;
    /* A trade at a new high of live bytes has all its chunks mapped here again, past the need if
       they hold more (it unmapped at least reserved + need - peak, so reserved stays under the
       peak): live bytes are rising, so the bytes will be used, and a spare freed instead leaves room
       under the peak that later growths map anew on no credit (docs/placement-policy-expandable.md,
       "A gap in the accounting"). Elsewhere, and where the address space after the target cannot
       hold them, the spares that do not fit are freed: that room serves a growth anywhere, where
       the spare's excess is pinned by the block carved from its chunk. */
    size_t spare = 0;
    for (const ap_vmm_chunk *c = p->vmm_spares; c; c = c->next) spare += c->size;
    if (spare > need && p->vmm_trade_high && ap_limit_fits(p, need, spare - need)) {
        size_t room = (size_t)-1;
        if (target) {
            uintptr_t end = target->base + target->size;
            room = room_until(space_of(p, target->base), end) - end;
        }
        if (spare <= room) need = spare;
    }
    cap = ap_vmm_chunk_cap(p, need);
    /* Chunks the release policy unmapped for this growth are mapped here again (one call each,
       instead of free + allocate + map); those that do not fit in it go back to the device first,
       so that physical memory never exceeds what the growth leaves. */
    ap_vmm_chunk *reuse = NULL, **reuse_end = &reuse, *unfit = NULL;
    size_t reused = 0;
    for (ap_vmm_chunk *c = p->vmm_spares, *next; c; c = next) {
        next = c->next;
        c->next = NULL;
        if (reused + c->size <= need) {
            reused += c->size;
            *reuse_end = c;
            reuse_end = &c->next;
        } else {
            c->next = unfit;
            unfit = c;
        }
    }
    p->vmm_spares = NULL;
    free_unmapped(p, unfit, 1);
    uintptr_t va;
    ap_vmm_space *sp = NULL;
    if (target) {
        va = target->base + target->size;
        sp = space_of(p, target->base);
    } else { /* a hole (or new address space) of its own */
        va = find_hole(p, pool, need, &sp);
        if (!va) {
            sp = reserve_space(p, pool, need, err);
            if (!sp) {
                free_unmapped(p, reuse, 1);
                return NULL;
            }
            va = sp->base;
        }
    }
    if (p->cfg.limit_bytes != AP_NO_LIMIT && ap_reserved(p) + need > p->cfg.limit_bytes) {
        free_unmapped(p, reuse, 1);
        p->cap_refused = 0; /* its own limit (ap_pool.cap_refused) */
        ap_set_error(err, AP_E_LIMIT, 0, "limit of %zu bytes reached", p->cfg.limit_bytes);
        return NULL;
    }
    if (ap_device_cap_book(p, need, err) != AP_OK) { /* counted as reserved bytes are: mapped ones */
        free_unmapped(p, reuse, 1);
        return NULL;
    }
    if (p->quota.reserve && need > reused) { /* reused chunks are booked already */
        char why[200] = "";
        if (p->quota.reserve(p->quota.ctx, p->device, need - reused, why, sizeof why) != 0) {
            ap_device_cap_unbook(p, need);
            free_unmapped(p, reuse, 1);
            ap_set_error(err, AP_E_QUOTA, 0, "%s", why);
            return NULL;
        }
    }
    /* Reused chunks first, then new ones of at most cap bytes (ap_vmm_chunk_cap). */
    ap_block *nb = ap_block_new(p);
    ap_vmm_chunk *first = NULL, *last = NULL;
    size_t done = 0;
    int rc = 0;
    if (!nb) {
        ap_set_error(err, AP_E_HOST_NOMEM, 0, "host memory for pool bookkeeping exhausted");
        goto rollback;
    }
    while (done < need) {
        ap_vmm_chunk *c = reuse;
        if (c) {
            reuse = c->next;
            c->next = NULL;
        } else {
            c = calloc(1, sizeof *c);
            if (!c) {
                ap_set_error(err, AP_E_HOST_NOMEM, 0, "host memory for pool bookkeeping exhausted");
                goto rollback;
            }
            c->size = need - done < cap ? need - done : cap;
            rc = p->backend->vmm_create(p->backend, p->device, c->size, &c->handle);
            if (rc != 0) {
                free(c);
                vmm_error(p, err, rc, "mapping device memory", need);
                goto rollback;
            }
            p->stats.num_device_alloc++;
        }
        c->va = va + done;
        rc = p->backend->vmm_map(p->backend, p->device, (void *)c->va, c->size, c->handle);
        if (rc != 0) {
            free_unmapped(p, c, 0);
            vmm_error(p, err, rc, "mapping device memory", need);
            goto rollback;
        }
        p->stats.num_device_map++;
        c->prev = last;
        if (last) last->next = c;
        else first = c;
        last = c;
        done += c->size;
    }
    /* Splice the new run of chunks into the space's address-ordered list. */
    ap_vmm_chunk *before = NULL;
    for (ap_vmm_chunk *c = sp->chunks; c && c->va < va; c = c->next) before = c;
    first->prev = before;
    last->next = before ? before->next : sp->chunks;
    if (last->next) last->next->prev = last;
    if (before) before->next = first;
    else sp->chunks = first;
    ap_stat_inc(&p->stats, AP_STAT_RESERVED_BYTES, pool, (int64_t)need);
    if (ap_reserved(p) > p->reserved_watermark) p->reserved_watermark = ap_reserved(p);
    ap_history_add(&p->history, AP_ACT_SEGMENT_MAP, va, need, p->slots[slot].stream);

    /* Attach the new memory to the segment on its left, else start a segment; join on the right. */
    nb->addr = va;
    nb->size = need;
    ap_segment *left = segment_ending_at(sp, first->prev, va);
    if (left) {
        ap_block *tail = last_block(left);
        tail->next = nb;
        nb->prev = tail;
        left->size += need;
        ap_segment_sized(p, left);
    } else {
        left = ap_segment_new(p);
        if (!left) { /* cannot track it: give the pages back */
            ap_set_error(err, AP_E_HOST_NOMEM, 0, "host memory for pool bookkeeping exhausted");
            for (ap_vmm_chunk *c = first, *stop = last->next; c != stop;) {
                ap_vmm_chunk *next = c->next;
                p->backend->vmm_unmap(p->backend, p->device, (void *)c->va, c->size);
                p->backend->vmm_free(p->backend, p->device, c->handle);
                free(c);
                c = next;
            }
            if (first->prev) first->prev->next = last->next;
            else sp->chunks = last->next;
            if (last->next) last->next->prev = first->prev;
            ap_stat_dec(&p->stats, AP_STAT_RESERVED_BYTES, pool, (int64_t)need);
            first = last = NULL;
            done = 0;
            goto rollback;
        }
        left->base = va;
        left->size = need;
        left->pool = pool;
        left->expandable = 1;
        left->alloc_slot = (uint16_t)slot;
        left->ctx = p->history.capacity ? ap_history_tls_ctx : 0;
        left->first = nb;
        ap_segment_link(p, left);
    }
    nb->seg = left;
    for (ap_vmm_chunk *c = first; c != last->next; c = c->next) c->seg = left;
    if (last->next && last->next->va == va + need) join_segments(p, left, last->next->seg, sp);
    /* Fresh memory is safe for every stream (tag 0), except where it would merge into another
       stream's free block on either side (the tail on the left, or the first block of the
       segment joined on the right): then it is the requester's, so that it merges only with
       what the requester may use and the block returned still fits it. */
    int tag = other_streams_free(nb->prev, slot) || other_streams_free(nb->next, slot) ? slot : 0;
    ap_block *grown = ap_free_insert(p, nb, tag);
    ap_free_recount_segment(p, grown->seg); /* a free neighbour that was a segment alone is one no more */
    return grown;

rollback: /* chunks mapped so far (a partial growth) go back; the pool is as before, less the
             reused chunks, which are freed too */
    for (ap_vmm_chunk *c = first; c; c = c->next) {
        p->backend->vmm_unmap(p->backend, p->device, (void *)c->va, c->size);
        p->stats.num_device_unmap++;
    }
    free_unmapped(p, first, 0);
    free_unmapped(p, reuse, 0);
    if (p->quota.release) p->quota.release(p->quota.ctx, p->device, need);
    ap_device_cap_unbook(p, need);
    if (nb) ap_block_recycle(p, nb);
    return NULL;
}

ap_block *ap_vmm_grow(ap_pool *p, int slot, int pool, size_t rsize, ap_error *err) {
    size_t extended;
    ap_block *b = grow(p, slot, pool, rsize, 0, &extended, err);
    /* the device may hold what the growth needs but not its extra bytes: try again without */
    if (!b && extended && err->status == AP_E_DEVICE) {
        p->stats.num_alloc_retries++;
        b = grow(p, slot, pool, rsize, 1, &extended, err);
    }
    return b;
}

/* Unmaps the chunks [lo, hi) inside the free block b (tag 0, in its tree) and splits its segment
   around the hole. Their physical memory goes back to the device, or with `spare` stays allocated
   in p->vmm_spares for the growth that follows (vmm_policy.c). Returns the bytes unmapped (a
   prefix of the range if the runtime refused a chunk midway: the rest stays mapped and the pool
   consistent). */
static size_t release_range(ap_pool *p, ap_vmm_space *sp, ap_block *b, uintptr_t lo, uintptr_t hi, int spare,
                            ap_error *err) {
    AP_ASSERT(b->state == AP_BLOCK_FREE && b->tag == 0); /* no stream's work may still touch it */
    ap_segment *seg = b->seg;
    ap_block *left = b->addr < lo ? ap_block_new(p) : NULL;
    ap_block *right = b->addr + b->size > hi ? ap_block_new(p) : NULL;
    ap_segment *rseg = ap_segment_new(p);
    if ((b->addr < lo && !left) || (b->addr + b->size > hi && !right) || !rseg) {
        if (left) ap_block_recycle(p, left);
        if (right) ap_block_recycle(p, right);
        if (rseg) ap_segment_recycle(p, rseg);
        ap_set_error(err, AP_E_HOST_NOMEM, 0, "host memory for pool bookkeeping exhausted");
        return 0;
    }
    ap_vmm_chunk *c = sp->chunks;
    while (c && c->va < lo) c = c->next;
    ap_vmm_chunk *before = c ? c->prev : NULL;
    uintptr_t end = lo;
    while (c && c->va < hi) {
        int rc = p->backend->vmm_unmap(p->backend, p->device, (void *)c->va, c->size);
        if (rc != 0) {
            vmm_error(p, err, rc, "unmapping device memory", c->size);
            break;
        }
        p->stats.num_device_unmap++;
        end = c->va + c->size;
        ap_vmm_chunk *next = c->next;
        c->next = NULL;
        if (spare) {
            c->next = p->vmm_spares;
            p->vmm_spares = c;
        } else {
            free_unmapped(p, c, 1); /* a failed free leaks the handle, not the pool's consistency */
        }
        c = next;
    }
    if (before) before->next = c;
    else sp->chunks = c;
    if (c) c->prev = before;
    hi = end;
    if (hi == lo) {
        if (left) ap_block_recycle(p, left);
        if (right) ap_block_recycle(p, right);
        ap_segment_recycle(p, rseg);
        return 0;
    }
    if (right && b->addr + b->size <= hi) { /* a partial release leaves more of b on the right */
        ap_block_recycle(p, right);
        right = NULL;
    } else if (!right && b->addr + b->size > hi) {
        right = ap_block_new(p); /* cannot fail in practice: a struct was just recycled above */
    }
    uintptr_t bend = b->addr + b->size, send = seg->base + seg->size;
    ap_free_remove(p, b);
    ap_block *prev = b->prev, *after = b->next;
    if (left) {
        left->addr = b->addr;
        left->size = lo - b->addr;
        left->seg = seg;
        left->prev = prev;
        left->next = NULL;
        if (prev) prev->next = left;
        else seg->first = left;
    } else if (prev) {
        prev->next = NULL;
    }
    if (hi < send) { /* what lies above the hole becomes a segment of its own */
        rseg->base = hi;
        rseg->size = send - hi;
        rseg->pool = seg->pool;
        rseg->expandable = 1;
        rseg->alloc_slot = seg->alloc_slot;
        rseg->ctx = seg->ctx;
        rseg->last_use = seg->last_use;
        ap_block *firstb = after;
        if (right) {
            right->addr = hi;
            right->size = bend - hi;
            right->next = after;
            if (after) after->prev = right;
            firstb = right;
        }
        firstb->prev = NULL;
        rseg->first = firstb;
        for (ap_block *x = firstb; x; x = x->next) x->seg = rseg;
        for (ap_vmm_chunk *x = c; x && x->seg == seg; x = x->next) x->seg = rseg;
        ap_segment_link(p, rseg);
    } else {
        ap_segment_recycle(p, rseg);
    }
    int pool = seg->pool, seg_left = lo != seg->base;
    if (!seg_left) { /* nothing of the segment is left below the hole */
        ap_segment_unlink(p, seg);
        ap_segment_recycle(p, seg);
    } else {
        seg->size = lo - seg->base;
        ap_segment_sized(p, seg);
    }
    if (left) ap_free_insert(p, left, 0);
    if (right) ap_free_insert(p, right, 0);
    if (seg_left) ap_free_recount_segment(p, seg); /* each side may be one free block now */
    if (hi < send) ap_free_recount_segment(p, rseg);
    ap_block_recycle(p, b);
    ap_stat_dec(&p->stats, AP_STAT_RESERVED_BYTES, pool, (int64_t)(hi - lo));
    ap_device_cap_unbook(p, hi - lo);
    ap_history_add(&p->history, AP_ACT_SEGMENT_UNMAP, lo, hi - lo, NULL);
    return hi - lo;
}

/* First chunk of sp at or above va. */
static ap_vmm_chunk *chunk_at(ap_vmm_space *sp, uintptr_t va) {
    ap_vmm_chunk *c = sp->chunks;
    while (c && c->va < va) c = c->next;
    return c;
}

/* Bytes of the whole chunks inside free block b; *c walks up the chunk list with the blocks of
   one segment (both in address order), so a scan costs one pass over each. */
static size_t chunks_inside(ap_vmm_chunk **c, const ap_block *b) {
    while (*c && (*c)->va < b->addr) *c = (*c)->next;
    size_t bytes = 0;
    for (ap_vmm_chunk *x = *c; x && x->va + x->size <= b->addr + b->size; x = x->next) bytes += x->size;
    return bytes;
}

/* Unmaps whole free chunks until target bytes are returned or none is left. Memory whose stream
   may still use it is unmapped only after a wait for that stream (as cudaFree or PyTorch's unmap
   do). Explicit trims take the largest free run first, also wait for every stream whose free
   blocks split a chunk, and free the physical memory; for the release policy (`policy`) the
   longest-idle block goes first, `keep` (the free block the growth will extend) stays, only the
   picked block's stream is waited for, and the physical memory is kept for the growth. Only free
   blocks of min_block bytes or more are looked at (0: all). */
static size_t release(ap_pool *p, size_t target, const ap_block *keep, int policy, int64_t max_unmaps, size_t min_block,
                      ap_error *err) {
    size_t released = 0;
    int64_t unmaps0 = p->stats.num_device_unmap;
    int settled = policy;
    int skip_tagged = 0; /* set once a stream-tagged block's stream was found busy: never wait here */
    ap_cache_flush(p);
    while (released < target && p->stats.num_device_unmap - unmaps0 < max_unmaps) {
        ap_block *best = NULL;
        size_t best_len = 0;
        for (ap_segment *s = p->segments; s; s = s->next) {
            if (!s->expandable) continue;
            ap_vmm_chunk *c = chunk_at(space_of(p, s->base), s->base);
            for (ap_block *b = s->first; b; b = b->next) {
                if (b == keep || b->state != AP_BLOCK_FREE || b->size < min_block || (skip_tagged && b->tag)) continue;
                size_t len = chunks_inside(&c, b);
                if (len && (policy ? !best || b->free_tick < best->free_tick : len > best_len)) {
                    best = b;
                    best_len = len;
                }
            }
        }
        if (!best && !settled) {
            /* Free chunks may be split across blocks of different streams: once those streams are
               waited for, the blocks merge into whole free chunks. */
            settled = 1;
            int any = ap_settle_free_slots(p, err);
            if (any < 0) return released;
            if (any) continue;
        }
        if (!best) break;
        if (best->tag) { /* its stream may still use it: released once that stream is idle */
            if (ap_settle_slot(p, best->tag, err) != AP_OK) skip_tagged = 1; /* busy: the others still go */
            continue;
        }
        /* Whole chunks from the top of the block down, until the target is met. */
        ap_vmm_space *sp = space_of(p, best->addr);
        uintptr_t bend = best->addr + best->size;
        ap_vmm_chunk *top = chunk_at(sp, best->addr);
        while (top->next && top->next->va + top->next->size <= bend) top = top->next;
        uintptr_t hi = top->va + top->size, lo = top->va;
        size_t want = target - released;
        int64_t left = max_unmaps - (p->stats.num_device_unmap - unmaps0) - 1;
        for (ap_vmm_chunk *x = top; hi - lo < want && left > 0 && x->prev && x->prev->va >= best->addr; x = x->prev, left--)
            lo = x->prev->va;
        size_t got = release_range(p, sp, best, lo, hi, policy, err);
        if (!got) break;
        released += got;
    }
    return released;
}

size_t ap_vmm_release(ap_pool *p, size_t target, ap_error *err) {
    /* Room the user released (empty_cache, garbage_collection_threshold) was not needed: refills
       of it start exact again (vmm_policy.c ap_vmm_growth_extra), where doubling them mapped whole
       chunks that the next release could not unmap (torch's fuzz pattern with empty_cache: peak
       162 -> 198 MiB). */
    p->vmm_refill_step = 0;
    return release(p, target, NULL, 0, INT64_MAX, 0, err);
}

size_t ap_vmm_release_for_growth(ap_pool *p, size_t target, const ap_block *keep, int64_t max_unmaps,
                                 size_t min_block) {
    return release(p, target, keep, 1, max_unmaps, min_block, NULL);
}

/* Drops all of the pool's virtual memory: its spare handles, and each reservation with its mapped
   chunks, their quota given back. through_runtime: unmapped, freed and released through the
   runtime (the pool's destroy); else forgotten with no runtime call (ap_vmm_forget). */
static void drop_all(ap_pool *p, int through_runtime) {
    if (through_runtime) {
        free_unmapped(p, p->vmm_spares, 1);
    } else {
        for (ap_vmm_chunk *c = p->vmm_spares, *next; c; c = next) {
            next = c->next;
            if (p->quota.release) p->quota.release(p->quota.ctx, p->device, c->size);
            free(c);
        }
    }
    p->vmm_spares = NULL;
    while (p->spaces) {
        ap_vmm_space *sp = p->spaces;
        p->spaces = sp->next;
        while (sp->chunks) {
            ap_vmm_chunk *c = sp->chunks;
            sp->chunks = c->next;
            if (through_runtime) {
                p->backend->vmm_unmap(p->backend, p->device, (void *)c->va, c->size);
                p->backend->vmm_free(p->backend, p->device, c->handle);
            }
            if (p->quota.release) p->quota.release(p->quota.ctx, p->device, c->size);
            free(c);
        }
        if (through_runtime) p->backend->vmm_release(p->backend, p->device, (void *)sp->base, sp->size);
        free(sp);
    }
}

/* The runtime released the pool's virtual memory (ap_pool_runtime_check): its reservations,
   mappings and physical handles are forgotten with no runtime call (none of them is to be freed
   again: the runtime may hand their addresses and handles out anew), their quota given back.
   The segments in them are the caller's to forget. */
void ap_vmm_forget(ap_pool *p) { drop_all(p, 0); }

void ap_vmm_destroy(ap_pool *p) { drop_all(p, 1); }

/* Expandable segments: the pool's memory is physical chunks mapped into reserved address space.
 *
 * Why: in the classic pool, free space split across separate device allocations can never merge.
 * Here a miss first tries to map just enough new memory right after a segment whose last block is
 * free, so the new pages extend that block in place; mapping into a hole between two segments
 * joins them. Idle memory goes back to the device a chunk at a time: unmapping a chunk inside a
 * segment splits it. Blocks never straddle unmapped memory because a segment is, by definition,
 * a run of contiguous mapped chunks.
 *
 * Device calls: one physical allocation + one map per growth, one unmap + one free per release;
 * steady-state loops never grow, so they make none.
 */
#include <stdlib.h>

#include "pool_internal.h"

static int vmm_error(ap_pool *p, ap_error *err, int rc, const char *what, size_t size) {
    char msg[200];
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
    if (right->prev) right->prev->next = right->next;
    else p->segments = right->next;
    if (right->next) right->next->prev = right->prev;
    p->n_segments--;
    ap_stat_dec(&p->stats, AP_STAT_SEGMENT, left->pool, 1);
    ap_segment_recycle(p, right);
}

static ap_segment *segment_ending_at(ap_vmm_space *sp, ap_vmm_chunk *c, uintptr_t va) {
    (void)sp;
    return c && c->va + c->size == va ? c->seg : NULL;
}

ap_block *ap_vmm_grow(ap_pool *p, int slot, int pool, size_t rsize, ap_error *err) {
    size_t g = p->vmm_granularity;
    /* 1. Extend the segment whose tail needs the fewest new pages to hold the request. */
    ap_segment *target = NULL;
    size_t need = (size_t)-1;
    for (ap_segment *s = p->segments; s; s = s->next) {
        if (s->pool != pool || !s->expandable) continue;
        ap_block *last = last_block(s);
        size_t have = last->state == AP_BLOCK_FREE && (last->tag == 0 || last->tag == slot) ? last->size : 0;
        if (have >= rsize) continue; /* refused by the fit rules: do not grow it further */
        size_t n = ap_round_up(rsize - have, g);
        uintptr_t end = s->base + s->size;
        ap_vmm_space *sp = space_of(p, s->base);
        if (n < need && room_until(sp, end) - end >= n) {
            need = n;
            target = s;
        }
    }
    uintptr_t va;
    ap_vmm_space *sp = NULL;
    if (target) {
        va = target->base + target->size;
        sp = space_of(p, target->base);
    } else { /* 2. A hole (or new address space) of its own. */
        need = ap_round_up(rsize, g);
        va = find_hole(p, pool, need, &sp);
        if (!va) {
            sp = reserve_space(p, pool, need, err);
            if (!sp) return NULL;
            va = sp->base;
        }
    }
    if (p->cfg.limit_bytes != AP_NO_LIMIT && ap_reserved(p) + need > p->cfg.limit_bytes) {
        ap_set_error(err, AP_E_LIMIT, 0, "limit of %zu bytes reached", p->cfg.limit_bytes);
        return NULL;
    }
    if (p->quota.reserve) {
        char why[200] = "";
        if (p->quota.reserve(p->quota.ctx, p->device, need, why, sizeof why) != 0) {
            ap_set_error(err, AP_E_QUOTA, 0, "%s", why);
            return NULL;
        }
    }
    ap_vmm_chunk *chunk = calloc(1, sizeof *chunk);
    ap_block *nb = chunk ? ap_block_new(p) : NULL;
    ap_segment *fresh = NULL;
    void *handle = NULL;
    int rc = 0;
    if (!nb) {
        ap_set_error(err, AP_E_HOST_NOMEM, 0, "host memory for pool bookkeeping exhausted");
        goto rollback;
    }
    rc = p->backend->vmm_create(p->backend, p->device, need, &handle);
    if (rc != 0) {
        vmm_error(p, err, rc, "physical allocation", need);
        goto rollback;
    }
    rc = p->backend->vmm_map(p->backend, p->device, (void *)va, need, handle);
    if (rc != 0) {
        p->backend->vmm_free(p->backend, p->device, handle);
        vmm_error(p, err, rc, "mapping", need);
        goto rollback;
    }
    /* Record the chunk in address order. */
    chunk->va = va;
    chunk->size = need;
    chunk->handle = handle;
    ap_vmm_chunk *before = NULL;
    for (ap_vmm_chunk *c = sp->chunks; c && c->va < va; c = c->next) before = c;
    chunk->prev = before;
    chunk->next = before ? before->next : sp->chunks;
    if (chunk->next) chunk->next->prev = chunk;
    if (before) before->next = chunk;
    else sp->chunks = chunk;
    p->stats.num_device_alloc++;
    p->stats.num_device_map++;
    ap_stat_inc(&p->stats, AP_STAT_RESERVED_BYTES, pool, (int64_t)need);
    if (ap_reserved(p) > p->reserved_watermark) p->reserved_watermark = ap_reserved(p);
    ap_history_add(&p->history, AP_ACT_SEGMENT_MAP, va, need, p->slots[slot].stream);

    /* Attach the new memory to the segment on its left, else start a segment; join on the right. */
    nb->addr = va;
    nb->size = need;
    ap_segment *left = segment_ending_at(sp, chunk->prev, va);
    if (left) {
        ap_block *tail = last_block(left);
        tail->next = nb;
        nb->prev = tail;
        left->size += need;
    } else {
        fresh = ap_segment_new(p);
        if (!fresh) { /* cannot track it: give it back */
            ap_set_error(err, AP_E_HOST_NOMEM, 0, "host memory for pool bookkeeping exhausted");
            p->backend->vmm_unmap(p->backend, p->device, (void *)va, need);
            p->backend->vmm_free(p->backend, p->device, handle);
            if (chunk->prev) chunk->prev->next = chunk->next;
            else sp->chunks = chunk->next;
            if (chunk->next) chunk->next->prev = chunk->prev;
            ap_stat_dec(&p->stats, AP_STAT_RESERVED_BYTES, pool, (int64_t)need);
            goto rollback;
        }
        fresh->base = va;
        fresh->size = need;
        fresh->pool = pool;
        fresh->expandable = 1;
        fresh->alloc_slot = (uint16_t)slot;
        fresh->first = nb;
        fresh->next = p->segments;
        if (p->segments) p->segments->prev = fresh;
        p->segments = fresh;
        p->n_segments++;
        ap_stat_inc(&p->stats, AP_STAT_SEGMENT, pool, 1);
        left = fresh;
    }
    nb->seg = left;
    chunk->seg = left;
    if (chunk->next && chunk->next->va == va + need) join_segments(p, left, chunk->next->seg, sp);
    /* Tagged with the requesting stream so that it never merges into another stream's block. */
    return ap_free_insert(p, nb, slot);

rollback:
    if (p->quota.release) p->quota.release(p->quota.ctx, p->device, need);
    if (nb) ap_block_recycle(p, nb);
    free(chunk);
    return NULL;
}

/* The free block that covers chunk c entirely, or NULL. */
static ap_block *covering_free_block(ap_vmm_chunk *c) {
    for (ap_block *b = c->seg->first; b; b = b->next) {
        if (b->addr + b->size <= c->va) continue;
        if (b->addr <= c->va && b->addr + b->size >= c->va + c->size && b->state == AP_BLOCK_FREE) return b;
        return NULL;
    }
    return NULL;
}

static ap_block *new_free_piece(ap_pool *p, uintptr_t addr, size_t size, ap_segment *seg) {
    ap_block *b = ap_block_new(p);
    if (!b) return NULL;
    b->addr = addr;
    b->size = size;
    b->seg = seg;
    return b;
}

/* Unmaps chunk c, which the free block b (tag 0, out of its tree) covers; splits its segment. */
static int release_chunk(ap_pool *p, ap_vmm_space *sp, ap_vmm_chunk *c, ap_block *b, ap_error *err) {
    ap_segment *seg = c->seg;
    uintptr_t cend = c->va + c->size, bend = b->addr + b->size, send = seg->base + seg->size;
    ap_block *left = b->addr < c->va ? new_free_piece(p, b->addr, c->va - b->addr, seg) : NULL;
    ap_block *right = bend > cend ? ap_block_new(p) : NULL;
    ap_segment *rseg = cend < send ? ap_segment_new(p) : NULL;
    if ((b->addr < c->va && !left) || (bend > cend && !right) || (cend < send && !rseg)) {
        if (left) ap_block_recycle(p, left);
        if (right) ap_block_recycle(p, right);
        if (rseg) ap_segment_recycle(p, rseg);
        return ap_set_error(err, AP_E_HOST_NOMEM, 0, "host memory for pool bookkeeping exhausted");
    }
    int rc = p->backend->vmm_unmap(p->backend, p->device, (void *)c->va, c->size);
    if (rc == 0) rc = p->backend->vmm_free(p->backend, p->device, c->handle);
    if (rc != 0) {
        if (left) ap_block_recycle(p, left);
        if (right) ap_block_recycle(p, right);
        if (rseg) ap_segment_recycle(p, rseg);
        return vmm_error(p, err, rc, "unmapping", c->size);
    }
    ap_free_remove(p, b);
    ap_block *before = b->prev, *after = b->next;
    /* Left part: the segment keeps [base, c->va). */
    if (left) {
        left->prev = before;
        if (before) before->next = left;
        else seg->first = left;
    } else if (before) {
        before->next = NULL;
    }
    /* Right part: a new segment [cend, send). */
    if (rseg) {
        rseg->base = cend;
        rseg->size = send - cend;
        rseg->pool = seg->pool;
        rseg->expandable = 1;
        rseg->alloc_slot = seg->alloc_slot;
        rseg->last_use = seg->last_use;
        ap_block *first = right ? right : after;
        if (right) {
            right->addr = cend;
            right->size = bend - cend;
            right->seg = rseg;
            right->next = after;
            if (after) after->prev = right;
        }
        first->prev = NULL;
        rseg->first = first;
        for (ap_block *x = first; x; x = x->next) x->seg = rseg;
        for (ap_vmm_chunk *x = c->next; x && x->seg == seg; x = x->next) x->seg = rseg;
        rseg->next = p->segments;
        if (p->segments) p->segments->prev = rseg;
        p->segments = rseg;
        p->n_segments++;
        ap_stat_inc(&p->stats, AP_STAT_SEGMENT, seg->pool, 1);
    }
    int pool = seg->pool;
    if (c->va == seg->base) { /* nothing left of the segment on the left */
        if (seg->prev) seg->prev->next = seg->next;
        else p->segments = seg->next;
        if (seg->next) seg->next->prev = seg->prev;
        p->n_segments--;
        ap_stat_dec(&p->stats, AP_STAT_SEGMENT, pool, 1);
        ap_segment_recycle(p, seg);
    } else {
        seg->size = c->va - seg->base;
    }
    if (left) ap_free_insert(p, left, 0);
    if (right) ap_free_insert(p, right, 0);
    ap_block_recycle(p, b);
    if (c->prev) c->prev->next = c->next;
    else sp->chunks = c->next;
    if (c->next) c->next->prev = c->prev;
    p->stats.num_device_free++;
    p->stats.num_device_unmap++;
    ap_stat_dec(&p->stats, AP_STAT_RESERVED_BYTES, pool, (int64_t)c->size);
    if (p->quota.release) p->quota.release(p->quota.ctx, p->device, c->size);
    ap_history_add(&p->history, AP_ACT_SEGMENT_UNMAP, c->va, c->size, NULL);
    free(c);
    return AP_OK;
}

size_t ap_vmm_release(ap_pool *p, size_t target, ap_error *err) {
    size_t released = 0;
    ap_cache_flush(p);
    while (released < target) {
        ap_vmm_chunk *pick = NULL;
        ap_vmm_space *pick_sp = NULL;
        ap_block *pick_b = NULL;
        for (ap_vmm_space *sp = p->spaces; sp; sp = sp->next)
            for (ap_vmm_chunk *c = sp->chunks; c; c = c->next) {
                if (pick && c->size <= pick->size) continue;
                ap_block *b = covering_free_block(c);
                if (b) {
                    pick = c;
                    pick_sp = sp;
                    pick_b = b;
                }
            }
        if (!pick) break;
        if (pick_b->tag) { /* its stream may still use it: wait for that stream, then pick again */
            if (ap_settle_slot(p, pick_b->tag, err) != AP_OK) break;
            continue;
        }
        size_t size = pick->size;
        if (release_chunk(p, pick_sp, pick, pick_b, err) != AP_OK) break;
        released += size;
    }
    return released;
}

void ap_vmm_destroy(ap_pool *p) {
    while (p->spaces) {
        ap_vmm_space *sp = p->spaces;
        p->spaces = sp->next;
        while (sp->chunks) {
            ap_vmm_chunk *c = sp->chunks;
            sp->chunks = c->next;
            p->backend->vmm_unmap(p->backend, p->device, (void *)c->va, c->size);
            p->backend->vmm_free(p->backend, p->device, c->handle);
            if (p->quota.release) p->quota.release(p->quota.ctx, p->device, c->size);
            free(c);
        }
        p->backend->vmm_release(p->backend, p->device, (void *)sp->base, sp->size);
        free(sp);
    }
}

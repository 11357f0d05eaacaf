/* The pool's public operations: create/destroy, malloc/free (cached and slow paths), record_stream,
 * empty_cache and stream lifetime. Policies live in segments.c, stream order in stream_order.c. */
#include <sched.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <time.h>

#include "current.h"
#include "pool_internal.h"
#include "share.h" /* a shared segment of a released runtime: ap_share_write_off */

int ap_set_error(ap_error *err, int status, int device_code, const char *fmt, ...) {
    if (err) {
        err->status = status;
        err->device_code = device_code;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->message, sizeof err->message, fmt, ap);
        va_end(ap);
    }
    return status;
}

void ap_config_default(ap_config *c) {
    memset(c, 0, sizeof *c);
    c->pad_bytes = 32;
    c->min_block = 512;
    c->small_size = 1u << 20;
    c->small_segment = 2u << 20;
    c->page_size = 2u << 20;
    c->min_large_segment = 2u << 20;
    c->large_segment = AP_LARGE_BUFFER;
    c->large_split_min = 512;
    c->max_split_size = AP_NO_LIMIT;
    c->gc_threshold = 0.0;
    c->limit_bytes = AP_NO_LIMIT;
    c->reserve_bytes = 0;
    c->history_capacity = 0;
    c->release_policy = AP_RELEASE_BUDGETED;
    c->sync_timeout_ms = 60000;
}

/* PyTorch's roundup_power2_divisions rounding (CUDACachingAllocator round_size): above
   min_block * divisions, up to the next of `divisions` equal steps between two powers of two. */
size_t ap_round_power2_divisions(const ap_pool *p, size_t padded) {
    size_t mb = p->cfg.min_block, r = (padded + mb - 1) & ~(mb - 1);
    if (padded <= mb || padded >= ((size_t)1 << 62)) return r < mb ? mb : r;
    int log = 63 - __builtin_clzll((unsigned long long)padded);
    int idx = log - 20; /* interval 0 starts at 1 MiB; smaller sizes share it */
    if (idx < 0) idx = 0;
    if (idx >= AP_ROUNDUP_INTERVALS) idx = AP_ROUNDUP_INTERVALS - 1;
    size_t div = __atomic_load_n(&p->cfg.roundup_divisions[idx], __ATOMIC_RELAXED); /* ap_round_request */
    if (div <= 1 || padded <= mb * div || !(padded & (padded - 1))) return r;
    size_t step = ((size_t)1 << log) / div;
    size_t up = (padded + step - 1) & ~(step - 1);
    return (up + mb - 1) & ~(mb - 1);
}

size_t ap_pool_round_size(const ap_pool *p, size_t size) {
    size_t r = ap_round_request(p, size);
    return r < p->cfg.min_block ? p->cfg.min_block : r;
}

static inline int pool_of(const ap_pool *p, size_t rsize) {
    return rsize <= p->cfg.small_size ? AP_POOL_SMALL : AP_POOL_LARGE;
}

/* Destroyed pool structs, for reuse: never freed, so that a C ABI call that read a pool's pointer
   just before its close may still touch capi_calls (see ap_pool_hold). */
static ap_pool *spare_pools;
static pthread_mutex_t spare_lock = PTHREAD_MUTEX_INITIALIZER;

static ap_pool *pool_struct_new(void) {
    pthread_mutex_lock(&spare_lock);
    ap_pool *p = spare_pools;
    if (p) spare_pools = p->spare_next;
    pthread_mutex_unlock(&spare_lock);
    if (!p) return calloc(1, sizeof *p);
    memset(p, 0, offsetof(ap_pool, capi_calls)); /* capi_calls: a stale caller may still hold it */
    return p;
}

static void pool_struct_retire(ap_pool *p) {
    pthread_mutex_lock(&spare_lock);
    p->spare_next = spare_pools;
    spare_pools = p;
    pthread_mutex_unlock(&spare_lock);
}

void ap_pool_wait_holders(ap_pool *p) {
    atomic_thread_fence(memory_order_seq_cst); /* the pool is unpublished before this (current.h) */
    for (int i = 0; atomic_load(&p->capi_calls) != 0; i++) {
        if (i < 64) sched_yield();
        else nanosleep(&(struct timespec){0, 50000}, NULL);
    }
}

ap_pool *ap_pool_create(ap_backend *backend, int device, const ap_config *cfg, ap_error *err) {
    if (!cfg->min_block || (cfg->min_block & (cfg->min_block - 1))) {
        ap_set_error(err, AP_E_INVALID_SIZE, 0, "min_block must be a power of two, got %zu", cfg->min_block);
        return NULL;
    }
    ap_pool *p = pool_struct_new();
    if (!p) {
        ap_set_error(err, AP_E_HOST_NOMEM, 0, "host memory for the pool exhausted");
        return NULL;
    }
    p->backend = backend;
    p->device = device;
    p->cfg = *cfg;
    p->event_cache_max = AP_EVENT_CACHE_MAX;
    p->slots_cap = 8;
    p->slots = calloc((size_t)p->slots_cap, sizeof *p->slots);
    p->n_slots = 1; /* slot 0: blocks no queued work can touch */
    if (!p->slots || ap_map_init(&p->live, 1024) != 0 || ap_history_init(&p->history, cfg->history_capacity) != 0) {
        free(p->slots);
        ap_map_destroy(&p->live);
        pool_struct_retire(p);
        ap_set_error(err, AP_E_HOST_NOMEM, 0, "host memory for the pool exhausted");
        return NULL;
    }
    /* Adaptive: spin briefly before sleeping, since the critical sections are tens of ns. */
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ADAPTIVE_NP);
    pthread_mutex_init(&p->lock, &attr);
    pthread_mutexattr_destroy(&attr);
    /* One device reference for the pool's life (CANN counts aclrtSetDevice per process). */
    int rc = backend->device_retain(backend, device);
    p->holds_device = rc == 0;
    size_t free_b = 0, total_b = 0;
    if (rc == 0) rc = backend->mem_info(backend, device, &free_b, &total_b);
    p->life = ap_backend_life(backend, device, 0); /* after the calls: a renewal in them is this life */
    if (rc != 0) {
        char msg[AP_RUNTIME_MSG];
        backend->error_message(backend, rc, msg, sizeof msg);
        ap_set_error(err, AP_E_DEVICE, rc, "device %d is not usable (%d): %s", device, rc, msg);
        ap_pool_destroy(p);
        return NULL;
    }
    p->stats.device_total_bytes = (int64_t)total_b;
    ap_classic_policy_init(p);
    if (cfg->expandable && ap_vmm_init(p, err) != AP_OK) {
        ap_pool_destroy(p);
        return NULL;
    }
    if (cfg->reserve_bytes) {
        ap_block *b;
        size_t size = ap_round_up(cfg->reserve_bytes, cfg->page_size);
        int rc = AP_OK;
        if (cfg->expandable) {
            int slot = ap_slot_of(p, NULL, 1);
            err->status = AP_OK;
            if (slot < 0 || !ap_vmm_grow(p, slot, AP_POOL_LARGE, size, err)) rc = err->status ? err->status : AP_E_HOST_NOMEM;
        } else {
            rc = ap_segment_alloc(p, AP_POOL_LARGE, size, 0, 1, &b, err);
        }
        if (rc != AP_OK) {
            /* the device is full (another process took memory since the free-bytes check, or a
               fault): an out-of-memory as any allocation's, not the runtime's bare code */
            if (rc == AP_E_DEVICE && ap_backend_oom_code(p->backend, err->device_code)) {
                char why[sizeof err->message];
                snprintf(why, sizeof why, "%s", err->message);
                ap_set_error(err, AP_E_OOM, err->device_code, "out of memory: the reserve of %zu bytes on device %d: %s",
                             size, p->device, why);
            }
            ap_pool_destroy(p);
            return NULL;
        }
    }
    return p;
}

void ap_pool_destroy(ap_pool *p) { ap_pool_destroy_ex(p, 1); }

void ap_pool_destroy_ex(ap_pool *p, int wait_streams) {
    if (!p) return;
    ap_current_forget(p);
    ap_pool_wait_holders(p); /* C ABI calls that found it before it was hidden */
    ap_device_cap_leave(p);  /* all it holds at once: the segments below go back without a release each */
    ap_error ignore;
    int exiting = !wait_streams;
    int64_t start = ap_now_ms(); /* one sync_timeout_ms for the pending frees and the streams */
    ap_process_pending(p, !exiting, &ignore);
    /* Blocks freed stream-ordered may still be written by their stream's queued work: the memory
       goes back to the device (and to the next pool or process) only after it (before, a close
       right after such a free handed that memory out under the running kernel). Not at exit:
       no next pool, and the runtime tears the context down with its streams. */
    int busy = exiting || ap_wait_tagged_streams(p, start) > 0; /* at exit nothing was waited for */
    while (p->pending_head) { /* events that never completed: give their blocks up anyway */
        ap_block *b = p->pending_head;
        p->pending_head = b->pending_next;
        for (int i = 0; b->xs && i < b->xs->n_events; i++) p->backend->event_destroy(p->backend, b->xs->events[i]);
        for (int i = 0; b->xs && i < b->xs->n_fevents; i++) p->backend->event_destroy(p->backend, b->xs->fevents[i]);
        if (b->xs) ap_foreign_events_gone(b->xs);
    }
    /* Memory the runtime released behind the pool (aclFinalize: the waits above found it gone) is
       forgotten, not freed: its addresses may be another allocation's by now. */
    ap_pool_runtime_check(p, 1);
    for (ap_segment *s = p->segments; s; s = s->next) {
        for (ap_block *b = s->first; b; b = b->next) /* marked past AP_MAX_USES: heap arrays */
            if (b->xs) ap_uses_shrink(b->xs);
        if (!s->expandable) p->backend->free(p->backend, p->device, (void *)s->base);
    }
    ap_vmm_destroy(p);
    ap_map_destroy(&p->lost_live);
    ap_events_destroy(p);
    ap_map_destroy(&p->live);
    ap_history_destroy(&p->history);
    ap_arena_destroy(p);
    free(p->slots);
    pthread_mutex_destroy(&p->lock);
    /* After its last device call. The last aclrtResetDevice waits for the work queued in the
       device's default context (CANN): with a stream still busy past sync_timeout_ms (a hung
       collective), or at exit, the reference is left to the process's end instead of a wait
       without bound here. */
    if (p->holds_device && !busy) p->backend->device_release(p->backend, p->device);
    pool_struct_retire(p);
}

/* A size as PyTorch's c10::format_size writes it ("512 bytes", "20.00 MiB", "800000000.00 GiB"):
   users and PyTorch's own tests match "Tried to allocate 20.00 MiB"; the exact byte count follows
   in parentheses where the rounded one is not already exact. */
static const char *format_size(char *buf, size_t len, size_t size) {
    static const char *const units[] = {"KiB", "MiB", "GiB"};
    if (size <= 1024) {
        snprintf(buf, len, "%zu bytes", size);
        return buf;
    }
    int u = size <= ((size_t)1 << 20) ? 0 : size <= ((size_t)1 << 30) ? 1 : 2;
    snprintf(buf, len, "%.2f %s (%zu bytes)", (double)size / (double)((size_t)1 << (10 * (u + 1))), units[u], size);
    return buf;
}

static int check_size(ap_pool *p, size_t size, ap_error *err) {
    char sz[64], cap[64];
    if (size == 0) return ap_set_error(err, AP_E_INVALID_SIZE, 0, "size must be positive, got 0 bytes");
    if ((int64_t)size < 0 || size > (size_t)p->stats.device_total_bytes) {
        size_t total = (size_t)p->stats.device_total_bytes;
        /* torch's words: "Tried to allocate more than 1EB memory" from 2**60 bytes on (its check
           before any device call), else the size; and the device's "total capacity" */
        if (size >= ((size_t)1 << 60)) snprintf(sz, sizeof sz, "more than 1EB memory (%zu bytes)", size);
        else format_size(sz, sizeof sz, size);
        return ap_set_error(err, AP_E_OOM, 0,
                            "out of memory: Tried to allocate %s on device %d, which has a total capacity of "
                            "%s: larger than the device",
                            sz, p->device, format_size(cap, sizeof cap, total));
    }
    return AP_OK;
}

/* The error for a slot lookup that failed: -1 table full, -2 a stream the runtime refuses. */
static int slot_error(ap_pool *p, int slot, void *stream, ap_error *err) {
    if (slot == -2)
        return ap_set_error(err, AP_E_INVALID_STREAM, 0,
                            "stream %p is not a stream the runtime knows on device %d (destroyed, or not a "
                            "stream handle)", stream, p->device);
    if (slot == -3)
        return ap_set_error(err, AP_E_INVALID_STREAM, 0, "stream %p belongs to another device, not to device %d",
                            stream, p->device);
    if (slot == -4)
        return ap_set_error(err, AP_E_INVALID_STREAM, 107003,
                            "stream %p of device %d is not in this thread's context (ACL 107003): use it from "
                            "a thread in the context it was created in", stream, p->device);
    return ap_set_error(err, AP_E_INVALID_STREAM, 0, "too many streams (limit %d) on device %d", AP_MAX_SIDE_STREAMS,
                        p->device);
}

static void oom_message(ap_pool *p, size_t size, int slot, ap_error *err) {
    size_t free_b = 0, total_b = 0;
    p->backend->mem_info(p->backend, p->device, &free_b, &total_b);
    ap_cache_flush(p);
    size_t reserved = ap_reserved(p);
    size_t allocated = (size_t)ap_stat_all_current(&p->stats, AP_STAT_ALLOCATED_BYTES);
    size_t active = allocated + (size_t)p->stats.pending[1][AP_STAT_ALL].current;
    size_t largest = 0;
    for (int s = 0; s < p->n_slots; s++)
        for (int k = 0; k < 2; k++) {
            ap_block *b = ap_tree_largest(&p->slots[s].trees[k]);
            if (b && b->size > largest) largest = b->size;
        }
    size_t cached = reserved - active;
    double frag = cached ? 1.0 - (double)largest / (double)cached : 0.0;
    /* PyTorch's words ("out of memory", "Tried to allocate"), which users and their tests match */
    const char *why = err->status == AP_E_LIMIT ? "out of the pool's limit"
                      : err->status == AP_E_QUOTA ? "over quota" : "out of device memory";
    char cause[sizeof err->message], sz[64];
    snprintf(cause, sizeof cause, "%s", err->message);
    ap_set_error(err, err->status == AP_E_LIMIT || err->status == AP_E_QUOTA ? err->status : AP_E_OOM, err->device_code,
                 "out of memory: Tried to allocate %s on device %d (stream %p), %s. Pool: %zu bytes reserved, "
                 "%zu allocated, %zu cached free (largest free block %zu, external fragmentation %.2f); "
                 "device: %zu free of %zu. Cause: %s",
                 format_size(sz, sizeof sz, size), p->device, slot ? p->slots[slot].stream : NULL, why, reserved,
                 allocated, cached, largest,
                 frag, free_b, total_b, cause);
}

void ap_pool_oom_figures(ap_pool *p, size_t *allowed, size_t *free_b) {
    size_t total = 0, limit, quota = SIZE_MAX, held = 0;
    *free_b = 0;
    p->backend->mem_info(p->backend, p->device, free_b, &total); /* a runtime call: not under the lock */
    pthread_mutex_lock(&p->lock);
    limit = p->cfg.limit_bytes;
    if (p->device_cap && atomic_load(&p->device_cap->limit) < limit) /* the device's fraction caps a MemPool too */
        limit = atomic_load(&p->device_cap->limit);
    if (p->quota.terms) p->quota.terms(p->quota.ctx, p->device, &quota, &held); /* lock-free reads */
    pthread_mutex_unlock(&p->lock);
    *allowed = limit != AP_NO_LIMIT && limit < total ? limit : total;
    /* A tenant's quota as HAMi's limited device: its total, and what is left of it free (as the
       context's mem_get_info answers) */
    size_t left = held >= quota ? 0 : quota - held;
    if (quota < *allowed) *allowed = quota;
    if (quota != SIZE_MAX && left < *free_b) *free_b = left;
}

/* The trace's oom entry: torch's carries the device's free bytes where others carry an address. */
static void note_oom(ap_pool *p, size_t size, void *stream) {
    if (!p->history.capacity) return;
    size_t free_b = 0, total_b = 0;
    p->backend->mem_info(p->backend, p->device, &free_b, &total_b);
    ap_history_add(&p->history, AP_ACT_OOM, free_b, size, stream);
}

/* 1 when frees wait on queued work: pending frees, or free blocks tagged with a stream. */
static int queued_frees(const ap_pool *p) {
    if (p->pending_head) return 1;
    for (int s = 1; s < p->n_slots; s++)
        if (p->slots[s].trees[0].count || p->slots[s].trees[1].count) return 1;
    return 0;
}

/* Takes an allocated block's allocation stats off (a free, or an allocation undone). A block
   that waits for other streams keeps its requested bytes until it completes, with its active
   bytes, as PyTorch's free_block (ap_process_pending takes them off). */
static void unmark_allocated(ap_pool *p, const ap_block *b, int completes_later) {
    int pool = b->seg->pool;
    ap_stat_dec(&p->stats, AP_STAT_ALLOCATION, pool, 1);
    ap_stat_dec(&p->stats, AP_STAT_ALLOCATED_BYTES, pool, (int64_t)b->size);
    if (!completes_later) ap_stat_dec(&p->stats, AP_STAT_REQUESTED_BYTES, pool, (int64_t)b->requested);
    if (ap_oversize(p, pool, b->size)) ap_stat_step(&p->stats.oversize[0], -1);
}

/* ---- the runtime released the pool's memory --------------------------------------------------- */

/* A segment of an earlier runtime life than the pool's (p->life): classic segments carry the life
   they were allocated in; an expandable pool's memory is one address space, reserved in the life
   of its first growth: all of it. Shared segments (share.c) end with their block, as before. */
static int segment_old(const ap_pool *p, const ap_segment *s) {
    return !s->shared && (s->expandable || s->life != p->life);
}

/* Writes off an allocated block of released memory: out of the live map (and the stats), into
   lost_live, whose frees are accepted with nothing reused or freed. */
static void write_off(ap_pool *p, ap_block *b) {
    size_t at = ap_map_find(&p->live, b->addr);
    if (at != AP_MAP_NONE) ap_map_take_at(&p->live, at);
    unmark_allocated(p, b, 0);
    p->lost_blocks++;
    if (!p->lost_live.keys && ap_map_init(&p->lost_live, 64) != 0) return; /* host memory: its free is refused */
    if (!ap_map_get(&p->lost_live, b->addr)) (void)ap_map_put(&p->lost_live, b->addr, (void *)(uintptr_t)1);
}

/* Forgets a segment of released memory with its blocks, with no runtime call. */
static void forget_segment(ap_pool *p, ap_segment *s) {
    for (ap_block *b = s->first, *next; b; b = next) {
        next = b->next;
        if (b->state == AP_BLOCK_ALLOCATED) write_off(p, b);
        else if (b->state == AP_BLOCK_FREE) ap_free_remove(p, b);
        /* AP_BLOCK_PENDING: out of the pending list already (ap_pending_forget) */
        if (b->xs) {
            ap_uses_recycle(p, b->xs);
            b->xs = NULL;
        }
        ap_block_recycle(p, b);
    }
    ap_segment_unlink(p, s);
    /* an expandable pool's quota goes back by chunk (ap_vmm_forget) */
    if (!s->expandable && p->quota.release) p->quota.release(p->quota.ctx, p->device, s->size);
    ap_device_cap_unbook(p, s->size);
    ap_stat_dec(&p->stats, AP_STAT_RESERVED_BYTES, s->pool, (int64_t)s->size);
    ap_history_add(&p->history, AP_ACT_SEGMENT_FREE, s->base, s->size, NULL);
    ap_segment_recycle(p, s);
}

/* Said once per device and runtime life, for all the process's pools. */
static _Atomic uint64_t lost_said;

int ap_pool_runtime_check(ap_pool *p, int probe) {
    uint64_t now = ap_backend_life(p->backend, p->device, probe);
    if (now == p->life) return 0;
    p->life = now;
    if (p->n_cached) ap_cache_flush(p); /* every free block in a tree, to be taken out */
    ap_pending_forget(p, segment_old);
    if (!p->event_pins) ap_events_forget(p);
    size_t segs = 0, bytes = 0;
    uint64_t blocks = p->lost_blocks;
    for (ap_segment *s = p->segments, *next; s; s = next) {
        next = s->next;
        if (s->shared && s->life != p->life) { /* a shared block's: written off, its share told later */
            segs++;
            bytes += s->size;
            p->lost_blocks++;
            ap_share_write_off(p, s);
        }
        if (!segment_old(p, s)) continue;
        segs++;
        bytes += s->size;
        forget_segment(p, s);
    }
    if (p->cfg.expandable) ap_vmm_forget(p);
    p->lost_segments += segs;
    p->lost_bytes += bytes;
    blocks = p->lost_blocks - blocks;
    uint64_t key = now << 8 | (uint64_t)(p->device & 0xff), said = atomic_load(&lost_said);
    if ((segs || blocks) && said != key && atomic_compare_exchange_strong(&lost_said, &said, key))
        fprintf(stderr,
                "ascend_pool: warning: the runtime released device %d's memory behind its pools (aclFinalize, or "
                "aclrtResetDevice/aclrtResetDeviceForce calls that took the pools' device references): a pool "
                "forgot %zu segment(s), %zu bytes, without freeing them (their addresses are the runtime's again), "
                "and wrote off %llu block(s) still allocated (their frees are accepted, nothing of them is reused). "
                "Empty the caches (empty_cache) and close the pools before finalizing the runtime.\n",
                p->device, segs, bytes, (unsigned long long)blocks);
    return segs || blocks;
}

/* ap_obtain_block, counting one retry per allocation however many times it is tried (after the
   waits, after the peers' release), as torch's num_alloc_retries: its malloc counts the one
   retry that follows freeing the cache. */
static ap_block *obtain_counted(ap_pool *p, int slot, int pool, size_t rsize, size_t size, ap_error *e, int *retried) {
    int64_t before = p->stats.num_alloc_retries;
    ap_block *b = ap_obtain_block(p, slot, pool, rsize, size, e);
    if (p->stats.num_alloc_retries != before) {
        p->stats.num_alloc_retries = before + !*retried;
        *retried = 1;
    }
    return b;
}

/* Once more, after the lock was dropped and taken again (other pools released, or lent nothing):
   the slot table may have changed meanwhile. Called with the lock held; a stream destroyed
   meanwhile unlocks it and returns the stream's error. */
static int obtain_relocked(ap_pool *p, void *stream, int *slot, int pool, size_t rsize, size_t size, ap_error *e,
                           int *retried, ap_error *err, ap_block **b) {
    *slot = ap_slot_of_fast(p, stream, 1);
    if (*slot < 0) {
        pthread_mutex_unlock(&p->lock);
        return slot_error(p, *slot, stream, err);
    }
    e->status = AP_OK;
    *b = obtain_counted(p, *slot, pool, rsize, size, e, retried);
    return AP_OK;
}

static size_t (*_Atomic peer_release_hook)(ap_pool *self, int mode);

void ap_set_peer_release_hook(size_t (*hook)(ap_pool *self, int mode)) { atomic_store(&peer_release_hook, hook); }

static void *(*_Atomic peer_lend_hook)(ap_pool *self, size_t size, void *stream);

void ap_set_peer_lend_hook(void *(*hook)(ap_pool *self, size_t size, void *stream)) {
    atomic_store(&peer_lend_hook, hook);
}

void ap_pool_set_mempool(ap_pool *p, int keeps_idle, int lends, int no_split, uint64_t family) {
    AP_ASSERT(!(keeps_idle && lends)); /* a use_on_oom MemPool gives its idle cache too */
    pthread_mutex_lock(&p->lock);
    atomic_store(&p->keeps_idle, keeps_idle);
    atomic_store(&p->lends, lends); /* a MemPool made with use_on_oom; never a tenant context */
    p->no_split = no_split;
    atomic_store(&p->family, family);
    pthread_mutex_unlock(&p->lock);
}

int ap_pool_lend(ap_pool *q, size_t size, void *stream, void **out) {
    if (!size || size - 1 >= (size_t)q->stats.device_total_bytes) return AP_E_INVALID_SIZE;
    size_t rsize = ap_round_request(q, size);
    int pool = pool_of(q, rsize);
    pthread_mutex_lock(&q->lock);
    /* read under the lock: once ap_pool_stop_lending cleared it, no block leaves here. Nor while
       its memory may be of a runtime that released it (the borrower's miss probed the life just
       before): the release that follows forgets it (ap_pool_release_idle) */
    int slot = atomic_load(&q->lends) && ap_backend_life(q->backend, q->device, 0) == q->life
                   ? ap_slot_of_fast(q, stream, 1)
                   : -1;
    ap_block *b = NULL;
    if (slot >= 0) {
        if (q->pending_head) ap_process_pending(q, 0, NULL);
        ap_cache_flush(q);
        b = ap_find_fit(q, slot, pool, rsize); /* torch's get_free_block: no growth, no device call */
    }
    if (!b) {
        pthread_mutex_unlock(&q->lock);
        return AP_E_OOM;
    }
    ap_take_block(q, b, rsize, size, slot);
    if (ap_map_put(&q->live, b->addr, b) != 0) {
        unmark_allocated(q, b, 0);
        ap_free_insert(q, b, slot);
        pthread_mutex_unlock(&q->lock);
        return AP_E_HOST_NOMEM;
    }
    ap_history_note_alloc(q, b, size, stream);
    b->ctx |= AP_CTX_LENT; /* the next allocation of the block clears it (ap_mark_allocated_in) */
    *out = (void *)b->addr;
    pthread_mutex_unlock(&q->lock);
    return AP_OK;
}

int64_t ap_pool_stop_lending(ap_pool *q, int64_t *bytes) {
    int64_t lent = 0;
    *bytes = 0;
    pthread_mutex_lock(&q->lock);
    atomic_store(&q->lends, 0);
    for (ap_segment *s = q->segments; s; s = s->next)
        for (ap_block *b = s->first; b; b = b->next)
            if (b->state == AP_BLOCK_ALLOCATED && (b->ctx & AP_CTX_LENT)) {
                lent++;
                *bytes += (int64_t)b->size;
            }
    pthread_mutex_unlock(&q->lock);
    return lent;
}

int64_t ap_pool_free_unlent(ap_pool *q, int64_t *bytes) {
    /* the addresses first (a free merges blocks under the walk), then each freed as the C ABI
       frees: on its allocation stream. Nothing allocates from q meanwhile (closed to its user,
       lending stopped), so no address is taken again before its free. */
    size_t n = 0, i = 0;
    uintptr_t *addrs = NULL;
    size_t *sizes = NULL;
    *bytes = 0;
    pthread_mutex_lock(&q->lock);
    for (ap_segment *s = q->segments; s; s = s->next)
        for (ap_block *b = s->first; b; b = b->next)
            n += b->state == AP_BLOCK_ALLOCATED && !(b->ctx & AP_CTX_LENT);
    if (n && (addrs = malloc(n * sizeof *addrs)) && (sizes = malloc(n * sizeof *sizes)))
        for (ap_segment *s = q->segments; s; s = s->next)
            for (ap_block *b = s->first; b; b = b->next)
                if (b->state == AP_BLOCK_ALLOCATED && !(b->ctx & AP_CTX_LENT) &&
                    ap_map_find(&q->live, b->addr) != AP_MAP_NONE) { /* a shared block is sharing's */
                    sizes[i] = b->size;
                    addrs[i++] = b->addr;
                }
    pthread_mutex_unlock(&q->lock);
    if (n && !sizes) {
        free(addrs);
        return -1;
    }
    int64_t freed = 0;
    for (size_t k = 0; k < i; k++)
        if (ap_pool_free(q, (void *)addrs[k], NULL, AP_FREE_ON_ALLOC_STREAM, NULL) == AP_OK) {
            freed++; /* (one its user freed meanwhile is not counted: nothing of it was lost) */
            *bytes += (int64_t)sizes[k];
        }
    free(addrs);
    free(sizes);
    return freed;
}

void ap_pool_set_orphan(ap_pool *p) { atomic_store(&p->orphan, 1); }

/* A size that ap_pool_malloc's first compare refuses (0, or beyond the device): the error, counted
   as below. AP_OK when check_size passes after all (it cannot: that compare is check_size's test). */
static __attribute__((noinline, cold)) int malloc_refused(ap_pool *p, size_t size, void *stream, ap_error *err) {
    if (check_size(p, size, err) != AP_OK) {
        if (size) { /* larger than the device: an OOM like any other, in num_ooms and the trace, and
                       a retry as torch counts one (its device call fails, it frees the cache and
                       tries once more; freeing the cache here could not make room, so it is kept) */
            pthread_mutex_lock(&p->lock);
            p->stats.num_ooms++;
            p->stats.num_alloc_retries++;
            note_oom(p, size, stream);
            pthread_mutex_unlock(&p->lock);
        }
        return err ? err->status : (size ? AP_E_OOM : AP_E_INVALID_SIZE);
    }
    return AP_OK;
}

/* ap_pool_malloc from the lock on (held; size checked and rounded): every case but the cached hit
   that ap_pool_malloc completes inline. Out of line, so that the hit's own frame stays small. */
static __attribute__((noinline)) int malloc_locked(ap_pool *p, size_t size, size_t rsize, int pool, void *stream,
                                                   void **out, ap_error *err) {
    int slot = ap_slot_of_fast(p, stream, 1);
    if (slot < 0) {
        pthread_mutex_unlock(&p->lock);
        return slot_error(p, slot, stream, err);
    }
    if (p->pending_head) ap_process_pending(p, 0, NULL);
    int keyed = 0;
    ap_block *b = p->n_cached && pool == AP_POOL_SMALL ? ap_cache_hit(p, slot, rsize, &keyed) : NULL;
    if (b) {
        ap_mark_allocated_in(p, b, size, slot, AP_POOL_SMALL); /* the cache holds small blocks only */
        goto allocated;
    }
    b = ap_find_fit(p, slot, pool, rsize);
    if (ap_cache_must_flush(p, pool, slot, rsize, b, keyed)) {
        ap_cache_flush(p); /* the merged picture first (free_cache.h), then the fit there */
        b = ap_find_fit(p, slot, pool, rsize);
    }
    int gone = b ? 0 : ap_stream_gone(p, slot);
    if (gone) {
        /* Destroyed behind the pool's back: growing or borrowing for it would order memory on
           a stream that is no more (or on another device's, its handle reused). One question per
           miss, cheap next to a device allocation; the cached path above asks none (as
           PyTorch's and CuPy's pools). */
        pthread_mutex_unlock(&p->lock);
        return slot_error(p, gone, stream, err);
    }
    if (!b) {
        ap_error local = {0};
        ap_error *e = err ? err : &local;
        e->status = AP_OK;
        int retried = 0;
        ap_pool_runtime_check(p, 1); /* a device call follows: what the runtime released goes first */
        b = obtain_counted(p, slot, pool, rsize, size, e, &retried);
        if (!b && e->status == AP_E_DEVICE && ap_pool_runtime_check(p, 0)) {
            /* the call found the runtime finalised or renewed (an expandable pool's growth into a
               reservation of the runtime before): once more, in the runtime there is now */
            e->status = AP_OK;
            b = obtain_counted(p, slot, pool, rsize, size, e, &retried);
        }
        if (!b && e->status != AP_E_HOST_NOMEM && (p->stats.num_sync_all_streams++, queued_frees(p))) {
            /* Last resort: wait (lock dropped) for every stream and pending free, then retry. */
            ap_error wait_err = {0};
            int wrc = ap_wait_unlocked(p, -1, 1, &wait_err);
            slot = ap_slot_of_fast(p, stream, 1); /* the slot table may have changed meanwhile */
            if (slot < 0) { /* the stream was destroyed during the wait: nothing to order on it */
                pthread_mutex_unlock(&p->lock);
                return slot_error(p, slot, stream, err);
            }
            e->status = AP_OK;
            ap_release_free_segments(p, (size_t)-1, 1, 0, NULL);
            b = obtain_counted(p, slot, pool, rsize, size, e, &retried);
            if (!b && wrc == AP_E_TIMEOUT) *e = wait_err;
        }
        if (!b && e->status == AP_E_QUOTA && p->quota.settle) {
            /* The reserve under the lock gave back no dead process's share if it had to wait for
               the ledger's lock (a process stopped inside an update held it: this pool's lock,
               and every thread's cached malloc and free with it, was held 10 s per try): the
               wait is here, the lock dropped, and the request is tried again if some came back. */
            ap_quota_hook q = p->quota;
            pthread_mutex_unlock(&p->lock);
            int settled = q.settle(q.ctx, p->device);
            pthread_mutex_lock(&p->lock);
            int rc = settled ? obtain_relocked(p, stream, &slot, pool, rsize, size, e, &retried, err, &b) : AP_OK;
            if (rc != AP_OK) return rc;
        }
        size_t (*peers)(ap_pool *, int) = atomic_load(&peer_release_hook);
        int device_oom = e->status == AP_E_OOM || e->status == AP_OK ||
                         (e->status == AP_E_DEVICE && ap_backend_oom_code(p->backend, e->device_code));
        int quota_refused = e->status == AP_E_QUOTA;
        /* the device's memory fraction, not this pool's own limit, refused it: its other members'
           idle cache may make room (torch's OOM path frees the default pool's cache and lends
           use_on_oom MemPools' free blocks) */
        int cap_refused = e->status == AP_E_LIMIT && p->device_cap && p->cap_refused; /* not its own limit's:
            the growth it needed (a segment, a page), not the request, passed that (ap_segment_alloc) */
        int mode = quota_refused ? AP_PEERS_ORPHANS : cap_refused ? AP_PEERS_CAP : AP_PEERS_ALL;
        /* the default pool: torch's use_on_oom MemPools lend it a free block in place, after the
           others' idle cache went back (their cache goes only if no block of theirs fits) */
        int borrows = (device_oom || e->status == AP_E_LIMIT) && ap_pool_borrows(p);
        if (!b && peers && (device_oom || quota_refused || cap_refused)) {
            /* The device itself is full: the process's other pools of the device (the default
               pool, other tenants' contexts) give back what they cache idle, then once more. Over
               the quota: only the orphans' (pools dropped while blocks of them were allocated:
               their cache is the tenant's booking, and nothing allocates from it). Their locks
               are taken one at a time, this one's dropped (no two pool locks at once). */
            pthread_mutex_unlock(&p->lock);
            size_t freed = peers(p, mode | (borrows ? AP_PEERS_NO_LENDERS : 0));
            pthread_mutex_lock(&p->lock);
            int rc = freed ? obtain_relocked(p, stream, &slot, pool, rsize, size, e, &retried, err, &b) : AP_OK;
            if (rc != AP_OK) return rc;
        }
        void *(*lend)(ap_pool *, size_t, void *) = atomic_load(&peer_lend_hook);
        if (!b && borrows && lend) {
            pthread_mutex_unlock(&p->lock); /* no two pool locks at once */
            void *lent = lend(p, size, stream);
            if (lent) {
                *out = lent;
                return AP_OK;
            }
            /* none fits: their idle cache goes back where the device or the fraction refused
               (not this pool's own limit, which a release elsewhere cannot move) */
            size_t freed = peers && (device_oom || cap_refused) ? peers(p, mode | AP_PEERS_ONLY_LENDERS) : 0;
            pthread_mutex_lock(&p->lock);
            int rc = freed ? obtain_relocked(p, stream, &slot, pool, rsize, size, e, &retried, err, &b) : AP_OK;
            if (rc != AP_OK) return rc;
        }
        if (!b) {
            int fault = e->status == AP_E_DEVICE && e->device_code && !ap_backend_oom_code(p->backend, e->device_code);
            if (e->status == AP_E_QUOTA) p->stats.num_quota_exceeded++;
            else if (!fault) p->stats.num_ooms++;
            if (e->status == AP_E_LIMIT) p->stats.num_oom_rejections++;
            if (e->status == AP_OK || (e->status == AP_E_DEVICE && !fault)) e->status = AP_E_OOM;
            if (e->status == AP_E_OOM || e->status == AP_E_LIMIT || e->status == AP_E_QUOTA) oom_message(p, size, slot, e);
            note_oom(p, size, stream);
            pthread_mutex_unlock(&p->lock);
            return e->status;
        }
    }
    ap_take_block(p, b, rsize, size, slot);
allocated:
    AP_ASSERT(b->state == AP_BLOCK_ALLOCATED && b->size >= rsize && b->tag == slot && ap_block_links_ok(b));
    if (ap_map_put(&p->live, b->addr, b) != 0) {
        /* Cannot track it: undo, stats included, so nothing is lost or miscounted. */
        unmark_allocated(p, b, 0);
        ap_free_insert(p, b, slot);
        pthread_mutex_unlock(&p->lock);
        return ap_set_error(err, AP_E_HOST_NOMEM, 0, "host memory for pool bookkeeping exhausted");
    }
    ap_history_note_alloc(p, b, size, stream);
    void *addr = (void *)b->addr; /* read under the lock: once it is dropped, a free of this address
                                     (a dangling pointer of the caller's) may recycle the struct */
    pthread_mutex_unlock(&p->lock);
    *out = addr;
    return AP_OK;
}

int ap_pool_malloc(ap_pool *p, size_t size, void *stream, void **out, ap_error *err) {
    /* check_size's test in one compare, as ap_pool_try_malloc's: size 0 wraps to SIZE_MAX */
    if (__builtin_expect(size - 1 >= (size_t)p->stats.device_total_bytes, 0)) {
        int rc = malloc_refused(p, size, stream, err);
        if (rc != AP_OK) return rc;
    }
    size_t rsize = ap_round_request(p, size);
    int pool = pool_of(p, rsize);
    pthread_mutex_lock(&p->lock);
    /* The cached hit, inline: malloc_locked's first steps where each goes its usual way (the last
       stream's slot, nothing pending, a small request, and room in the live map, so that the put
       neither grows it nor fails). Any other case, or no hit, is malloc_locked's from its start: a
       miss leaves the cache as it was, so there the lookup finds the same. */
    int slot = p->last_slot;
    if (__builtin_expect(slot > 0 && p->slots[slot].stream == stream && p->slots[slot].live && !p->pending_head &&
                             p->n_cached && pool == AP_POOL_SMALL && (p->live.count + 1) * 2 <= p->live.mask + 1,
                         1)) {
        int keyed = 0;
        ap_block *b = ap_cache_hit(p, slot, rsize, &keyed);
        if (b) {
            ap_mark_allocated_in(p, b, size, slot, AP_POOL_SMALL); /* the cache holds small blocks only */
            AP_ASSERT(b->state == AP_BLOCK_ALLOCATED && b->size >= rsize && b->tag == slot && ap_block_links_ok(b));
            int put = ap_map_put(&p->live, b->addr, b); /* cannot fail: room was checked above */
            AP_ASSERT(put == 0);
            (void)put;
            ap_history_note_alloc(p, b, size, stream);
            void *addr = (void *)b->addr; /* under the lock, as malloc_locked reads it */
            pthread_mutex_unlock(&p->lock);
            *out = addr;
            return AP_OK;
        }
    }
    return malloc_locked(p, size, rsize, pool, stream, out, err);
}

int ap_pool_try_malloc(ap_pool *p, size_t size, void *stream, void **out) {
    /* Sizes first: beyond the device, the rounding and the cache key (rsize << 16) would wrap
       onto a small cached block. size 0 wraps to SIZE_MAX here, so one compare refuses both. */
    if (size - 1 >= (size_t)p->stats.device_total_bytes) return AP_E_BUSY;
    size_t rsize = ap_round_request(p, size);
    if (pthread_mutex_trylock(&p->lock) != 0) return AP_E_BUSY;
    int slot = p->pending_head || p->history.capacity || p->live.count * 2 + 2 > p->live.mask + 1
                   ? -1 : ap_slot_of_fast(p, stream, 0);
    int keyed = 0, pool = pool_of(p, rsize);
    ap_block *b = slot > 0 && p->n_cached && pool == AP_POOL_SMALL ? ap_cache_hit(p, slot, rsize, &keyed) : NULL;
    if (b) {
        ap_mark_allocated_in(p, b, size, slot, AP_POOL_SMALL);
    } else {
        b = slot > 0 ? ap_find_fit(p, slot, pool, rsize) : NULL;
        if (!b || ap_cache_must_flush(p, pool, slot, rsize, b, keyed)) {
            /* a growth, or a fit the cached blocks may change (the slow path) */
            pthread_mutex_unlock(&p->lock);
            return AP_E_BUSY;
        }
        ap_take_block(p, b, rsize, size, slot);
    }
    int put = ap_map_put(&p->live, b->addr, b); /* cannot fail: room was checked above */
    AP_ASSERT(put == 0);
    (void)put;
    void *addr = (void *)b->addr; /* under the lock, as ap_pool_malloc reads it */
    pthread_mutex_unlock(&p->lock);
    *out = addr;
    return AP_OK;
}

/* Describes a pointer that is not a live allocation, for the error message. */
static int bad_pointer(ap_pool *p, void *ptr, ap_error *err) {
    uintptr_t a = (uintptr_t)ptr;
    for (ap_segment *s = p->segments; s; s = s->next) {
        if (a < s->base || a >= s->base + s->size) continue;
        for (ap_block *b = s->first; b; b = b->next)
            if (a >= b->addr && a < b->addr + b->size) {
                if (a != b->addr)
                    return ap_set_error(err, AP_E_INVALID_PTR, 0,
                                        "pointer 0x%lx is inside the block at 0x%lx (%zu bytes) on device %d, "
                                        "not its start",
                                        (unsigned long)a, (unsigned long)b->addr, b->size, p->device);
                if (s->shared && b->state == AP_BLOCK_ALLOCATED) /* allocated, but not in the live map */
                    return ap_set_error(err, AP_E_INVALID_PTR, 0,
                                        "pointer 0x%lx on device %d is a shared block (share_malloc): give it "
                                        "back with share_free(ptr)", (unsigned long)a, p->device);
                return ap_set_error(err, AP_E_INVALID_PTR, 0,
                                    "pointer 0x%lx on device %d is not allocated (double free?)", (unsigned long)a,
                                    p->device);
            }
    }
    return ap_set_error(err, AP_E_INVALID_PTR, 0, "pointer 0x%lx was not allocated by this pool (device %d)",
                        (unsigned long)a, p->device);
}

/* Inline in both frees: ap_pool_free's warm path (a cached block parked) is the pair's other half. */
static inline __attribute__((always_inline)) void release_block(ap_pool *p, ap_block *b, int tag) {
    int pool = b->seg->pool;
    AP_ASSERT(b->state == AP_BLOCK_ALLOCATED && tag >= 0 && tag < p->n_slots);
    if (__builtin_expect(!p->slots[tag].live, 0)) tag = 0; /* retired stream: its work is over */
    int waits = b->xs && (b->xs->n_uses || b->xs->n_foreign);
    unmark_allocated(p, b, waits);
    if (waits) { /* other streams used it: reusable only after their events complete */
        ap_free_pending(p, b, tag);
        return;
    }
    ap_history_add_free(&p->history, AP_ACT_FREE_REQUESTED, b->addr, b->requested, p->slots[tag].stream, b->ctx);
    ap_history_add_free(&p->history, AP_ACT_FREE_COMPLETED, b->addr, b->requested, p->slots[tag].stream, b->ctx);
    if (pool == AP_POOL_SMALL && ap_cache_isolated(b, tag)) ap_cache_push_small(p, b, tag);
    else ap_free_insert(p, b, tag); /* merges with its free (and cached) neighbours at once */
}

static int note_foreign_use(ap_pool *p, ap_block *b, void *stream, int device, ap_error *err);
/* A block written off when the runtime released its memory (write_off): its free is accepted and
   forgets it. Off the hot path: only a pointer the live map lacks gets here. */
static int lost_free(ap_pool *p, void *ptr) {
    if (!p->lost_live.keys) return 0;
    size_t at = ap_map_find(&p->lost_live, (uintptr_t)ptr);
    if (at == AP_MAP_NONE) return 0;
    ap_map_take_at(&p->lost_live, at);
    return 1;
}

int ap_pool_free(ap_pool *p, void *ptr, void *stream, int how, ap_error *err) {
    pthread_mutex_lock(&p->lock);
    int tag = how == AP_FREE_ON_ALLOC_STREAM ? 0 : ap_slot_of_fast(p, stream, 1);
    size_t at = ap_map_find(&p->live, (uintptr_t)ptr); /* only allocated blocks are in the map */
    ap_block *b = at != AP_MAP_NONE ? p->live.vals[at] : NULL;
    int rc = b ? AP_OK : lost_free(p, ptr) ? AP_OK : bad_pointer(p, ptr, err);
    /* The C ABI's free on a live stream of a context this thread cannot reach (-4, 107003): no
       event can be recorded on it from here, but the block can wait in its slot, busy to every
       other stream until a call from its context or a wait finds it idle. Freed on its allocation
       stream with error 5, it went to the next request while that stream's kernel still wrote it. */
    if (b && tag < 0 && !(tag == -4 && how == AP_FREE_ON_STREAM_ELSE_ALLOC && (tag = ap_slot_of(p, stream, 2)) >= 0)) {
        /* A stream the pool cannot order on (destroyed, or not a stream). A caller that can retry
           gets the error and the block stays allocated: had it been freed, a retry would free
           whatever block was allocated at that address meanwhile. Else it is freed on the stream
           it was allocated on, with the error set. */
        /* A live stream the pool keeps no slot for: the table is full (-1), or another device's
           stream (-3: a peer's kernel used the block last, as ascend_pool.h tells the caller to
           name). Freed on its allocation stream and made to wait for `stream`'s work by an event
           recorded on it (as record_stream with such a stream); freed there alone, it went to
           the next request while that work still ran. */
        int dev = p->device;
        if (how == AP_FREE_ON_STREAM_ELSE_ALLOC &&
            (tag == -1 || (tag == -3 && p->backend->stream_device &&
                           p->backend->stream_device(p->backend, stream, &dev) == 0 && dev != p->device)) &&
            note_foreign_use(p, b, stream, dev, NULL) == AP_OK)
            rc = AP_OK;
        else
            rc = slot_error(p, tag, stream, err);
        if (rc != AP_OK && how == AP_FREE_ON_STREAM) {
            if (err) {
                size_t n = strlen(err->message);
                snprintf(err->message + n, sizeof err->message - n,
                         "; block 0x%lx stays allocated (free it on a live stream, or on its allocation stream)",
                         (unsigned long)b->addr);
            }
            b = NULL;
        }
    }
    if (b) {
        ap_map_take_at(&p->live, at); /* the map is unchanged since the lookup */
        release_block(p, b, how == AP_FREE_ON_ALLOC_STREAM || tag < 0 ? b->tag : tag);
        if (atomic_load_explicit(&p->orphan, memory_order_relaxed)) /* nothing allocates from it again */
            ap_release_free_segments(p, (size_t)-1, 0, 0, NULL);
    }
    pthread_mutex_unlock(&p->lock);
    return rc;
}

int ap_pool_try_free(ap_pool *p, void *ptr) {
    if (pthread_mutex_trylock(&p->lock) != 0) return AP_E_BUSY;
    size_t at = ap_map_find(&p->live, (uintptr_t)ptr);
    ap_block *b = at != AP_MAP_NONE ? p->live.vals[at] : NULL;
    if (!b || b->xs || p->history.capacity) {
        pthread_mutex_unlock(&p->lock);
        return AP_E_BUSY;
    }
    ap_map_take_at(&p->live, at);
    release_block(p, b, b->tag);
    pthread_mutex_unlock(&p->lock);
    return AP_OK;
}

/* record_stream with a stream of another device: kept on the block (no slot here), an event of
   that device recorded on it at the free (ap_free_pending). Before, refused: the C ABI's void hook
   dropped the use, and the block went to the next request while the peer still read it. */
static int note_foreign_use(ap_pool *p, ap_block *b, void *stream, int device, ap_error *err) {
    if (!b->xs) b->xs = ap_uses_new(p);
    ap_block_uses *u = b->xs;
    if (!u) return ap_set_error(err, AP_E_HOST_NOMEM, 0, "host memory for pool bookkeeping exhausted");
    for (int i = 0; i < u->n_foreign; i++)
        if (u->foreign[i] == stream) return AP_OK;
    /* Past the inline ones they grow, as torch's set has no limit: a use refused here was dropped
       by the C ABI's void hook, and the block reused under that peer's work */
    if (u->n_foreign == u->fcap && u->fcap == AP_FOREIGN_LIMIT)
        return ap_set_error(err, AP_E_INVALID_STREAM, 0,
                            "block 0x%lx is already marked with %d streams of other devices (the most one block "
                            "can be)", (unsigned long)b->addr, AP_FOREIGN_LIMIT);
    if (u->n_foreign == u->fcap && ap_uses_grow(u, 1) != 0)
        return ap_set_error(err, AP_E_HOST_NOMEM, 0, "host memory for pool bookkeeping exhausted");
    u->foreign_device[u->n_foreign] = (int16_t)device;
    u->foreign[u->n_foreign++] = stream;
    return AP_OK;
}

/* The allocated block at ptr that record_stream / erase_stream mark, under p->lock; NULL with
   *rc AP_OK for a block written off with the runtime that released it (no stream's work can
   reach it: nothing to mark), AP_E_NOT_HERE (if_own) for no block of this pool, else the
   bad-pointer error. */
static ap_block *marked_block(ap_pool *p, void *ptr, int if_own, int *rc, ap_error *err) {
    ap_block *b = ap_map_get(&p->live, (uintptr_t)ptr);
    *rc = AP_OK;
    if (!b && p->lost_live.keys && ap_map_get(&p->lost_live, (uintptr_t)ptr)) return NULL;
    if (!b && if_own) *rc = AP_E_NOT_HERE;
    else if (!b || b->state != AP_BLOCK_ALLOCATED) *rc = bad_pointer(p, ptr, err);
    return *rc == AP_OK ? b : NULL;
}

static int record_stream(ap_pool *p, void *ptr, void *stream, int if_own, ap_error *err) {
    int rc;
    pthread_mutex_lock(&p->lock);
    ap_block *b = marked_block(p, ptr, if_own, &rc, err);
    if (b) {
        int slot = ap_slot_of(p, stream, 1), device = -1;
        if (slot == -3 && p->backend->stream_device(p->backend, stream, &device) == 0) {
            rc = note_foreign_use(p, b, stream, device, err);
        } else if (slot == -1) {
            /* The table of streams is full (every stream in it alive): no slot, but an event of
               its own recorded on the stream at the free orders the block after its work, as for
               another device's stream. Refused, the C ABI's void hook dropped the use, and the
               block went to the next request while that stream's kernel still wrote it. */
            rc = note_foreign_use(p, b, stream, p->device, err);
        } else if (slot < 0) {
            rc = slot_error(p, slot, stream, err);
        } else if (slot != b->tag) {
            if (!b->xs) b->xs = ap_uses_new(p);
            ap_block_uses *u = b->xs;
            int seen = 0;
            for (int i = 0; u && i < u->n_uses; i++) seen |= u->uses[i] == slot;
            /* Past the inline uses they grow, as torch's set has no limit: a use refused here was
               dropped by the C ABI's void hook, and the block reused under that stream's work */
            if (!u || (!seen && u->n_uses == u->cap && ap_uses_grow(u, 0) != 0))
                rc = ap_set_error(err, AP_E_HOST_NOMEM, 0, "host memory for pool bookkeeping exhausted");
            else if (!seen)
                u->uses[u->n_uses++] = (uint16_t)slot;
        }
    }
    pthread_mutex_unlock(&p->lock);
    return rc;
}

int ap_pool_record_stream(ap_pool *p, void *ptr, void *stream, ap_error *err) {
    return record_stream(p, ptr, stream, 0, err);
}

int ap_pool_record_stream_if_own(ap_pool *p, void *ptr, void *stream, ap_error *err) {
    return record_stream(p, ptr, stream, 1, err);
}

/* torch_npu's eraseStream: the live block no longer waits for stream's work at its free (the
   caller ordered that work otherwise, or knows it is done). A stream it was not marked with (its
   allocation stream included) changes nothing. */
static int erase_stream(ap_pool *p, void *ptr, void *stream, int if_own, ap_error *err) {
    int rc;
    pthread_mutex_lock(&p->lock);
    ap_block *b = marked_block(p, ptr, if_own, &rc, err);
    if (b && b->xs) {
        ap_block_uses *u = b->xs;
        int slot = ap_slot_of(p, stream, 0);
        for (int i = 0; slot > 0 && i < u->n_uses; i++)
            if (u->uses[i] == slot) {
                u->uses[i] = u->uses[--u->n_uses];
                break;
            }
        /* another device's stream, or one kept as such (the stream table was full) */
        for (int i = 0; i < u->n_foreign; i++)
            if (u->foreign[i] == stream) {
                u->n_foreign--;
                u->foreign[i] = u->foreign[u->n_foreign];
                u->foreign_device[i] = u->foreign_device[u->n_foreign];
                break;
            }
        /* an allocated block's list holds only marks: emptied, it goes, so that the block's
           free takes the quick path again (ap_pool_try_free passes over a block with one) */
        if (!u->n_uses && !u->n_foreign) {
            AP_ASSERT(!u->n_events && !u->n_owed && !u->n_fevents);
            ap_uses_recycle(p, u);
            b->xs = NULL;
        }
    }
    pthread_mutex_unlock(&p->lock);
    return rc;
}

int ap_pool_erase_stream(ap_pool *p, void *ptr, void *stream, ap_error *err) {
    return erase_stream(p, ptr, stream, 0, err);
}

int ap_pool_erase_stream_if_own(ap_pool *p, void *ptr, void *stream, ap_error *err) {
    return erase_stream(p, ptr, stream, 1, err);
}

int ap_pool_empty_cache(ap_pool *p, ap_error *err) {
    pthread_mutex_lock(&p->lock);
    p->stats.num_sync_all_streams++; /* PyTorch counts every empty_cache as a sync of all streams */
    ap_pool_runtime_check(p, 1);
    /* Waits with the lock dropped, a few rounds: other threads may free more meanwhile. */
    int rc = AP_OK;
    for (int round = 0; round < 4; round++) {
        ap_error e = {0};
        int r = ap_wait_unlocked(p, -1, 1, &e);
        /* A stream destroyed behind the pool's back has been settled (its blocks are anyone's):
           nothing failed here, the cache still empties (PyTorch's empty_cache never raises). */
        if (r == AP_E_INVALID_STREAM) r = AP_OK;
        if (r != AP_OK && rc == AP_OK) {
            rc = r;
            if (err) *err = e;
        }
        if (r == AP_E_TIMEOUT || r == AP_E_DEVICE) break;
        int busy = p->pending_head != NULL;
        for (int s = 1; s < p->n_slots && !busy; s++)
            busy = p->slots[s].trees[0].count || p->slots[s].trees[1].count;
        if (!busy) break;
    }
    if (rc != AP_OK && ap_pool_runtime_check(p, 0)) {
        /* the waits found the runtime finalised: its streams' work is over and what it released is
           forgotten (said once on stderr); nothing is left to wait for or to free of it */
        rc = AP_OK;
        if (err) err->status = AP_OK;
    }
    ap_release_free_segments(p, (size_t)-1, 1, 0, rc == AP_OK ? err : NULL);
    if (!p->event_pins) ap_events_trim(p, 0); /* idle events go back too, as PyTorch's empty_cache */
    pthread_mutex_unlock(&p->lock);
    return rc;
}

/* CuPy's free_all_blocks(stream): a free block is in the arena of the stream it was freed on.
   A classic segment one stream's allocation created and another stream borrowed (stream_reuse
   borrow) and freed belonged to neither: its free block was tagged with the borrower's slot, its
   alloc_slot the creator's, and only a full empty_cache returned it. Marks (before the wait) the
   wholly free segments whose block `slot` freed: they go once its work is done. */
static void mark_freed_on(ap_pool *p, int slot) {
    ap_cache_flush(p);
    for (ap_segment *s = p->segments; s; s = s->next)
        if (!s->expandable && !s->pinned && ap_segment_is_free(s) && s->first->tag == slot)
            s->freed_slot = (uint16_t)slot;
}

/* After the wait: the creator's segments whose block another stream freed, where that stream's
   work is already done (asked, never waited for: ap_settle_slot), then the marked ones. */
static void release_freed_on(ap_pool *p, int slot, ap_error *err) {
    for (ap_segment *s = p->segments; s; s = s->next)
        if (!s->expandable && !s->pinned && s->alloc_slot == slot && ap_segment_is_free(s) && s->first->tag &&
            s->first->tag != slot)
            (void)ap_settle_slot(p, s->first->tag, err); /* busy: it stays, as its stream may use it */
    ap_release_stream_segments(p, slot, err);
    for (ap_segment *s = p->segments, *next; s; s = next) {
        next = s->next; /* s may be unlinked below */
        if (s->freed_slot != slot)
            continue;
        s->freed_slot = 0;
        if (s->expandable || s->pinned || !ap_segment_is_free(s) || s->first->tag)
            continue; /* taken again meanwhile, or another stream's work may use it now */
        if (ap_segment_release(p, s, err) != AP_OK) break;
    }
}

int ap_pool_empty_stream(ap_pool *p, void *stream, ap_error *err) {
    pthread_mutex_lock(&p->lock);
    int rc = AP_OK, slot = ap_slot_of(p, stream, 0);
    if (slot > 0) {
        if (!p->cfg.expandable)
            mark_freed_on(p, slot);
        /* This stream's work only (no other stream's pending frees): its frees become untagged,
           as empty_cache's. What a failed wait leaves tagged stays; the rest goes all the same. */
        rc = ap_wait_unlocked(p, slot, 0, err);
        if (rc == AP_E_INVALID_STREAM) rc = AP_OK; /* destroyed behind the pool's back: settled */
        if (p->cfg.expandable) { /* one address space: every stream's unused pages, the reserve kept */
            size_t reserved = ap_reserved(p), keep = p->cfg.reserve_bytes;
            if (reserved > keep) ap_vmm_release(p, reserved - keep, rc == AP_OK ? err : NULL);
        } else {
            release_freed_on(p, slot, rc == AP_OK ? err : NULL);
        }
    }
    pthread_mutex_unlock(&p->lock);
    return rc;
}

int ap_pool_synchronize(ap_pool *p, void *stream, ap_error *err) {
    pthread_mutex_lock(&p->lock);
    int slot = ap_slot_of(p, stream, 1);
    int rc = slot < 0 ? slot_error(p, slot, stream, err) : ap_wait_unlocked(p, slot, 0, err);
    pthread_mutex_unlock(&p->lock);
    return rc;
}

int ap_pool_synchronize_device(ap_pool *p, int device_wait, ap_error *err) {
    pthread_mutex_lock(&p->lock);
    int timeout = p->cfg.sync_timeout_ms;
    (void)ap_slot_of(p, NULL, 1); /* the default stream is waited for too, without a device wait */
    pthread_mutex_unlock(&p->lock);
    int rc = AP_ERR_MISSING_SYMBOL;
    if (device_wait && p->backend->device_sync) { /* no pool lock held across the device wait */
        rc = p->backend->device_sync(p->backend, p->device, timeout);
        if (rc != 0 && rc != AP_ERR_MISSING_SYMBOL) {
            char msg[AP_RUNTIME_MSG];
            p->backend->error_message(p->backend, rc, msg, sizeof msg);
            return ap_set_error(err, rc == 507046 || rc == 507047 ? AP_E_TIMEOUT : AP_E_DEVICE, rc,
                                "waiting for all work of device %d failed (limit %d ms): %s", p->device,
                                timeout, msg);
        }
    }
    pthread_mutex_lock(&p->lock);
    /* After a device wait these streams and events are done (no wait); without one, the streams
       the pool knows and the events of its pending frees are what it can wait for. Either way the
       frees the wait completed are settled: their blocks serve the next request. */
    /* In rounds of a batch of streams each (the pending frees of the ones waited for leave the
       list, so each round's events are the next streams'): one round waited for the first 64
       only, and the frees behind the others stayed pending. One limit for all rounds. */
    int64_t start = ap_now_ms();
    int from = 1;
    do {
        rc = ap_wait_unlocked_from(p, AP_WAIT_EVERY_STREAM, &from, start, 1, err);
        if (rc == AP_E_INVALID_STREAM) rc = AP_OK; /* a stream destroyed behind the pool's back: retired */
    } while (rc == AP_OK && from < p->n_slots);
    pthread_mutex_unlock(&p->lock);
    return rc;
}

int ap_pool_release_stream(ap_pool *p, void *stream, ap_error *err) {
    pthread_mutex_lock(&p->lock);
    /* A stream the pool never ordered anything on gets a slot here too, so that its queued work
       is waited for within sync_timeout_ms like any other's: the runtime's destroy that follows
       would wait for it with no limit. (A handle the runtime does not know gets none.) */
    int slot = ap_slot_of(p, stream, 1);
    int rc = AP_OK;
    if (slot > 0) {
        /* What is pending on it is settled first: its frees' events are waited for too. */
        rc = ap_wait_unlocked(p, slot, 1, err);
        slot = ap_slot_of(p, stream, 0); /* retired meanwhile (unusable) or by another caller */
        if (slot > 0 && rc == AP_OK) ap_slot_retire(p, slot);
    } else if (slot == -1) {
        /* The table is full (every stream in it alive): no slot, but its work is waited for within
           sync_timeout_ms all the same. Before, nothing was: the runtime's destroy then waited
           for it with no limit. */
        rc = ap_wait_stream_unslotted(p, stream, err);
    }
    pthread_mutex_unlock(&p->lock);
    return rc;
}

void ap_pool_set_quota_hook(ap_pool *p, const ap_quota_hook *hook) {
    pthread_mutex_lock(&p->lock);
    if (hook) p->quota = *hook;
    else p->quota = (ap_quota_hook){0};
    pthread_mutex_unlock(&p->lock);
}

size_t ap_pool_release_idle(ap_pool *p) {
    pthread_mutex_lock(&p->lock);
    /* memory of a runtime that released it is forgotten, never freed (its address may be another
       allocation's now); forgotten bytes count as released: the device or fraction has them back */
    size_t before = ap_reserved(p);
    ap_pool_runtime_check(p, 1);
    size_t released = before - ap_reserved(p);
    ap_process_pending(p, 0, NULL);
    released += ap_release_free_segments(p, (size_t)-1, 0, 0, NULL);
    pthread_mutex_unlock(&p->lock);
    return released;
}

int ap_pool_knows_stream(ap_pool *p, void *stream) {
    pthread_mutex_lock(&p->lock);
    int slot = ap_slot_of(p, stream, 0); /* no slot made, nothing asked */
    pthread_mutex_unlock(&p->lock);
    return slot > 0;
}

int64_t ap_pool_active_blocks(ap_pool *p) {
    pthread_mutex_lock(&p->lock);
    int64_t n = ap_stat_all_current(&p->stats, AP_STAT_ALLOCATION) + p->stats.pending[0][AP_STAT_ALL].current;
    pthread_mutex_unlock(&p->lock);
    return n;
}

int ap_pool_work_queued(ap_pool *p) {
    pthread_mutex_lock(&p->lock);
    ap_process_pending(p, 0, NULL);
    ap_settle_free_slots(p, NULL); /* asks each stream holding free blocks, never waits */
    int queued = queued_frees(p);
    pthread_mutex_unlock(&p->lock);
    return queued;
}

size_t ap_pool_trim_to(ap_pool *p, size_t target) {
    pthread_mutex_lock(&p->lock);
    size_t reserved = ap_reserved(p), released = 0;
    if (reserved > target) {
        ap_process_pending(p, 0, NULL);
        released = ap_release_free_segments(p, reserved - target, 1, 0, NULL);
        if (ap_reserved(p) > target && ap_wait_unlocked(p, -1, 0, NULL) == AP_OK && ap_reserved(p) > target)
            released += ap_release_free_segments(p, ap_reserved(p) - target, 1, 0, NULL);
    }
    pthread_mutex_unlock(&p->lock);
    return released;
}

void ap_pool_set_limit(ap_pool *p, size_t limit_bytes) {
    pthread_mutex_lock(&p->lock);
    p->cfg.limit_bytes = limit_bytes;
    ap_device_cap_set_limit(p, limit_bytes); /* the device's fraction when p is its owner */
    size_t reserved = ap_reserved(p);
    if (limit_bytes != AP_NO_LIMIT && reserved > limit_bytes)
        ap_release_free_segments(p, reserved - limit_bytes, 1, 0, NULL);
    pthread_mutex_unlock(&p->lock);
}

void ap_pool_set_tunables(ap_pool *p, size_t max_split_size, double gc_threshold, const unsigned *divisions) {
    pthread_mutex_lock(&p->lock);
    p->cfg.gc_threshold = gc_threshold;
    int power2 = 0;
    for (int i = 0; i < AP_ROUNDUP_INTERVALS; i++) {
        __atomic_store_n(&p->cfg.roundup_divisions[i], divisions[i], __ATOMIC_RELAXED);
        power2 |= divisions[i] > 1;
    }
    __atomic_store_n(&p->cfg.roundup_power2, power2, __ATOMIC_RELAXED);
    size_t old = p->cfg.max_split_size;
    if (max_split_size != old) {
        /* The oversize counts follow the new bound: a free takes off what ap_oversize says then,
           so each allocated block and each segment is counted in or out now (a step, as an
           allocation's or a free's, so the exported totals never go down). */
        for (ap_segment *s = p->segments; s; s = s->next) {
            if (s->pool != AP_POOL_LARGE) continue;
            for (ap_block *b = s->first; b; b = b->next) {
                if (b->state != AP_BLOCK_ALLOCATED) continue;
                int was = b->size >= old, is = b->size >= max_split_size;
                if (was != is) ap_stat_step(&p->stats.oversize[0], is ? 1 : -1);
            }
        }
        p->cfg.max_split_size = max_split_size;
        for (ap_segment *s = p->segments; s; s = s->next) ap_segment_sized(p, s);
    }
    pthread_mutex_unlock(&p->lock);
}

size_t ap_pool_get_limit(ap_pool *p) {
    pthread_mutex_lock(&p->lock);
    size_t limit = p->cfg.limit_bytes;
    pthread_mutex_unlock(&p->lock);
    return limit;
}

/* The stats, read with the lock held (ap_pool_get_stats, ap_pool_get_stats_within); drops it. */
static void get_stats_locked(ap_pool *p, ap_stats *out) {
    /* Reading must never change what the pool does next: no flushing here, only copies. */
    ap_stats_export(&p->stats, out);
    size_t largest = 0, cached = 0; /* the cached blocks' part: ap_cache_merged_view, below */
    for (int s = 0; s < p->n_slots; s++)
        for (int k = 0; k < 2; k++) {
            ap_block *b = ap_tree_largest(&p->slots[s].trees[k]);
            if (b && b->size > largest) largest = b->size;
            cached += p->slots[s].trees[k].bytes;
        }
    cached += ap_cache_bytes(p);
    ap_cache_merged_view(p, out, &largest);
    pthread_mutex_unlock(&p->lock);
    out->largest_free_block = (int64_t)largest;
    out->cached_free_bytes = (int64_t)cached;
    size_t free_b = 0, total_b = 0;
    if (p->backend->mem_info(p->backend, p->device, &free_b, &total_b) == 0) {
        out->device_free_bytes = (int64_t)free_b;
        out->device_total_bytes = (int64_t)total_b;
    }
}

void ap_pool_get_stats(ap_pool *p, ap_stats *out) {
    pthread_mutex_lock(&p->lock);
    get_stats_locked(p, out);
}

/* The monotonic clock where the C library can wait on it: a wall-clock step (NTP, a container's
   clock set) would otherwise stretch or cut the wait. Not under ThreadSanitizer: gcc 12's libtsan
   does not intercept pthread_mutex_clocklock, so it would report each unlock of a lock taken so as
   "unlock of an unlocked mutex" and lose the lock's ordering. */
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 30)) && \
    !defined(__SANITIZE_THREAD__)
#define AP_LOCK_CLOCK CLOCK_MONOTONIC
#define ap_mutex_lock_until(m, t) pthread_mutex_clocklock((m), CLOCK_MONOTONIC, (t))
#else
#define AP_LOCK_CLOCK CLOCK_REALTIME
#define ap_mutex_lock_until(m, t) pthread_mutex_timedlock((m), (t))
#endif

int ap_pool_get_stats_within(ap_pool *p, ap_stats *out, int wait_ms) {
    struct timespec t;
    clock_gettime(AP_LOCK_CLOCK, &t);
    t.tv_sec += wait_ms / 1000;
    t.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
    if (t.tv_nsec >= 1000000000L) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000L;
    }
    if (ap_mutex_lock_until(&p->lock, &t) != 0) return -1;
    get_stats_locked(p, out);
    return 0;
}

void ap_pool_reset_peaks(ap_pool *p) {
    pthread_mutex_lock(&p->lock);
    ap_stats_reset_peaks(&p->stats);
    pthread_mutex_unlock(&p->lock);
}

int ap_pool_segment_expandable(ap_pool *p, void *ptr) {
    uintptr_t a = (uintptr_t)ptr;
    int rc = -1;
    pthread_mutex_lock(&p->lock);
    for (ap_segment *s = p->segments; s && rc < 0; s = s->next)
        if (a >= s->base && a < s->base + s->size) rc = s->expandable ? 1 : 0;
    pthread_mutex_unlock(&p->lock);
    return rc;
}

/* The allocated block containing a (exact: starting at a), or NULL. Under the pool lock. */
static ap_block *allocated_at(ap_pool *p, uintptr_t a, int exact) {
    for (ap_segment *s = p->segments; s; s = s->next) {
        if (a < s->base || a >= s->base + s->size) continue;
        for (ap_block *b = s->first; b; b = b->next)
            if (a >= b->addr && a < b->addr + b->size && b->state == AP_BLOCK_ALLOCATED)
                return exact && b->addr != a ? NULL : b;
    }
    return NULL;
}

int ap_pool_block_info(ap_pool *p, void *ptr, uintptr_t *base, size_t *size, size_t *requested) {
    pthread_mutex_lock(&p->lock);
    ap_block *b = allocated_at(p, (uintptr_t)ptr, 0);
    if (b) {
        *base = b->addr;
        *size = b->size;
        *requested = b->requested;
    }
    pthread_mutex_unlock(&p->lock);
    return b ? 0 : -1;
}

int ap_pool_wrote_off(ap_pool *p, void *ptr) {
    pthread_mutex_lock(&p->lock);
    int lost = p->lost_live.keys && ap_map_get(&p->lost_live, (uintptr_t)ptr) != NULL;
    pthread_mutex_unlock(&p->lock);
    return lost;
}

/* The frames context id (history.h) of the allocated block starting at ptr: 0 and *ctx, or -1
   when none starts there. Asks nothing else: a snapshot for it recorded a snapshot entry in the
   history at each call (torch's _allocation_traceback records none). */
int ap_pool_block_ctx(ap_pool *p, void *ptr, uint64_t *ctx) {
    pthread_mutex_lock(&p->lock);
    ap_block *b = allocated_at(p, (uintptr_t)ptr, 1);
    if (b) *ctx = ap_block_frames(b);
    pthread_mutex_unlock(&p->lock);
    return b ? 0 : -1;
}

void ap_pool_hold_lock(ap_pool *p, double seconds) {
    struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    pthread_mutex_lock(&p->lock);
    nanosleep(&ts, NULL);
    pthread_mutex_unlock(&p->lock);
}

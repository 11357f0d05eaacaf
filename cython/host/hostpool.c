/* The pinned host-memory pool: size classes with free lists, slabs for the small classes, and
 * event-guarded reuse. The policy and the interface are described in hostpool.h.
 *
 * Every buffer (free, handed out or parked) has a small out-of-band record in an address map, so
 * pinned memory holds only user data and a free of any pointer is checked, never trusted.
 */
#include "hostpool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ptr_map.h" /* the core's address map, for the buffers' records */

enum { HB_FREE = 0, HB_ALLOCATED = 1, HB_PENDING = 2, HB_LOST = 3 };

#define SLAB_MAX_BLOCKS 64               /* a slab of tiny buffers stays small (512 B: 32 KiB) */
#define SLAB_MAX_BYTES ((size_t)2 << 20) /* ... and no slab passes 2 MiB */
#define EVENT_CACHE 64
#define STREAM_SYNC_MS 60000             /* bound on the fallback wait when no event can be made */

typedef struct host_use { /* a stream that used the buffer; events: those of the free, packed */
    void *stream, *event;
    int device, event_device;
    uint64_t event_life; /* the runtime life (ap_backend_life) of event_device the event was made in */
} host_use;

typedef struct host_uses { /* only for buffers marked with record_stream */
    int n_uses, n_events, cap;
    host_use use[]; /* cap of them: AP_HOST_MAX_USES, doubled past it (record_stream, realloc) */
} host_uses;

struct host_slab;

typedef struct host_block {
    uintptr_t addr;
    size_t requested;
    struct host_slab *slab;         /* NULL: a runtime allocation of its own */
    struct host_block *prev, *next; /* the class free list, or the pending list */
    host_uses *uses;
    uint8_t cls, state;
    uint32_t life; /* a buffer of its own: the runtime life it was pinned in (low bits; slabs: the slab's) */
} host_block;

typedef struct host_slab {
    uintptr_t base;
    size_t size;
    size_t n_blocks, n_busy; /* busy: handed out, parked or lost */
    uint64_t life;           /* the runtime life (ap_backend_life of the pool's device) it was pinned in */
    host_block *blocks;
    struct host_slab *prev, *next;
} host_slab;

struct ap_host_pool {
    pthread_mutex_t lock;
    ap_backend *backend;
    int device;
    host_block *free_lists[AP_HOST_N_CLASSES];
    host_block *pending_head, *pending_tail;
    host_slab *slabs;
    ap_ptr_map map;       /* buffer start -> record */
    void *events[EVENT_CACHE]; /* idle events for reuse, with the device and life each was made in */
    int event_devices[EVENT_CACHE];
    uint64_t event_lives[EVENT_CACHE];
    int n_events;
    /* The runtime life of the pool's device (ap_backend_life) as the pool last checked it, off
       the cached path (host_runtime_check: a miss, a marked free, empty_cache, close). Buffers
       handed out when the runtime released their memory (aclFinalize, a forced reset) are
       written off into `lost` (by address; made lazily): their frees are accepted, nothing of
       them is reused or freed. */
    uint64_t life;
    ap_ptr_map lost;
    /* Devices this pool holds a runtime reference on (bit d: device d), given back at destroy.
       CANN releases a device's default context, streams and events at its last aclrtResetDevice;
       without a reference of its own, each runtime call of a host pool outside any device pool's
       life would set the device up and tear it down again, under its pinned memory and events. */
    uint64_t held_devices;
    ap_host_stats stats;
};

/* ---- sizes ------------------------------------------------------------------------------------ */

static inline size_t class_bytes(int cls) { return (size_t)1 << (cls + AP_HOST_MIN_SHIFT); }

static inline int class_of(size_t size) {
    int log2 = size <= 1 ? 0 : 64 - __builtin_clzll((unsigned long long)(size - 1));
    return log2 <= AP_HOST_MIN_SHIFT ? 0 : log2 - AP_HOST_MIN_SHIFT;
}

size_t ap_host_class_size(size_t size) {
    if (size == 0 || size > ((size_t)1 << AP_HOST_MAX_SHIFT)) return 0;
    return class_bytes(class_of(size));
}

static inline int in_slabs(int cls) { return cls + AP_HOST_MIN_SHIFT <= AP_HOST_SLAB_SHIFT; }

static size_t slab_blocks(int cls) {
    size_t n = SLAB_MAX_BYTES / class_bytes(cls);
    return n > SLAB_MAX_BLOCKS ? SLAB_MAX_BLOCKS : n;
}

static inline void peak(int64_t *current, int64_t *peak_value, int64_t delta) {
    *current += delta;
    if (*current > *peak_value) *peak_value = *current;
}

/* ---- lists --------------------------------------------------------------------------------------- */

static void push_free(ap_host_pool *hp, host_block *b) {
    host_block **head = &hp->free_lists[b->cls];
    b->state = HB_FREE;
    b->prev = NULL;
    b->next = *head;
    if (*head) (*head)->prev = b;
    *head = b;
    hp->stats.cached_free_bytes += (int64_t)class_bytes(b->cls);
    hp->stats.cached_free_blocks++;
}

static void unlink_free(ap_host_pool *hp, host_block *b) {
    if (b->prev) b->prev->next = b->next;
    else hp->free_lists[b->cls] = b->next;
    if (b->next) b->next->prev = b->prev;
    b->prev = b->next = NULL;
    hp->stats.cached_free_bytes -= (int64_t)class_bytes(b->cls);
    hp->stats.cached_free_blocks--;
}

/* A buffer becomes reusable (freed with no stream marks, or its events completed). */
static void release_active(ap_host_pool *hp, host_block *b) {
    hp->stats.active_requests--;
    hp->stats.active_bytes -= (int64_t)class_bytes(b->cls);
    hp->stats.acc_released++;
    hp->stats.acc_released_bytes += (int64_t)class_bytes(b->cls);
}

/* ---- runtime calls ------------------------------------------------------------------------------- */

static void release_cached(ap_host_pool *hp);

static int64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* Adds one runtime call's duration to total/max/min (min of the first call: itself). */
static void time_call(int64_t us, int64_t n_before, int64_t *total, int64_t *max, int64_t *min) {
    *total += us;
    if (us > *max) *max = us;
    if (n_before == 0 || us < *min) *min = us;
}

static int host_malloc_timed(ap_host_pool *hp, size_t size, void **out) {
    ap_backend *be = hp->backend;
    int64_t t0 = now_us();
    int rc = be->host_malloc(be, hp->device, out, size);
    if (rc == 0)
        time_call(now_us() - t0, hp->stats.acc_host_alloc, &hp->stats.host_alloc_us, &hp->stats.host_alloc_us_max,
                  &hp->stats.host_alloc_us_min);
    return rc;
}

static int runtime_alloc(ap_host_pool *hp, size_t size, void **out, ap_error *err) {
    ap_backend *be = hp->backend;
    int rc = host_malloc_timed(hp, size, out);
    if (rc != 0 && rc != AP_ERR_MISSING_SYMBOL) { /* pinned memory is scarce: give back the cache, retry */
        release_cached(hp);
        rc = host_malloc_timed(hp, size, out);
    }
    if (rc != 0) {
        char msg[AP_RUNTIME_MSG]; /* the runtime's cause whole, as the device pools quote it */
        be->error_message(be, rc, msg, sizeof msg);
        /* Out of pinned memory only when the runtime says so: a finalized runtime (100001) is a
           DeviceError, as the device pools' request then (it was OutOfMemoryError). */
        return ap_set_error(err, ap_backend_oom_code(be, rc) ? AP_E_OOM : AP_E_DEVICE, rc,
                            "pinning %zu bytes of host memory failed on the %s backend: %s (the host pool "
                            "holds %lld bytes, %lld handed out)",
                            size, be->name, msg, (long long)hp->stats.reserved_bytes,
                            (long long)hp->stats.allocated_bytes);
    }
    hp->stats.num_host_alloc++;
    hp->stats.acc_host_alloc++;
    hp->stats.acc_pinned_bytes += (int64_t)size;
    peak(&hp->stats.segments, &hp->stats.segments_peak, 1);
    peak(&hp->stats.reserved_bytes, &hp->stats.reserved_bytes_peak, (int64_t)size);
    return AP_OK;
}

static void runtime_free(ap_host_pool *hp, uintptr_t addr, size_t size) {
    /* A failing free cannot be retried usefully: the bytes are forgotten either way. */
    int64_t t0 = now_us();
    hp->backend->host_free(hp->backend, hp->device, (void *)addr);
    time_call(now_us() - t0, hp->stats.acc_host_free, &hp->stats.host_free_us, &hp->stats.host_free_us_max,
              &hp->stats.host_free_us_min);
    hp->stats.num_host_free++;
    hp->stats.acc_host_free++;
    hp->stats.acc_unpinned_bytes += (int64_t)size;
    hp->stats.segments--;
    hp->stats.reserved_bytes -= (int64_t)size;
}

/* ---- growing and shrinking ----------------------------------------------------------------------- */

static int grow_slab(ap_host_pool *hp, int cls, ap_error *err) {
    size_t n = slab_blocks(cls), size = n * class_bytes(cls);
    host_slab *s = calloc(1, sizeof *s);
    host_block *blocks = calloc(n, sizeof *blocks);
    void *base = NULL;
    int rc;
    if (!s || !blocks) {
        free(s);
        free(blocks);
        return ap_set_error(err, AP_E_HOST_NOMEM, 0, "host memory for the host pool's bookkeeping exhausted");
    }
    rc = runtime_alloc(hp, size, &base, err);
    if (rc != AP_OK) {
        free(s);
        free(blocks);
        return rc;
    }
    s->base = (uintptr_t)base;
    s->size = size;
    s->life = ap_backend_life(hp->backend, hp->device, 0); /* after the call: a renewal in it is this life */
    s->n_blocks = n;
    s->blocks = blocks;
    for (size_t i = 0; i < n; i++) {
        blocks[i].addr = s->base + i * class_bytes(cls);
        blocks[i].cls = (uint8_t)cls;
        blocks[i].slab = s;
        if (ap_map_put(&hp->map, blocks[i].addr, &blocks[i]) != 0) {
            while (i-- > 0) ap_map_take(&hp->map, blocks[i].addr);
            runtime_free(hp, s->base, size);
            free(s);
            free(blocks);
            return ap_set_error(err, AP_E_HOST_NOMEM, 0, "host memory for the host pool's bookkeeping exhausted");
        }
    }
    for (size_t i = n; i-- > 0;) push_free(hp, &blocks[i]); /* lowest address handed out first */
    s->next = hp->slabs;
    if (hp->slabs) hp->slabs->prev = s;
    hp->slabs = s;
    return AP_OK;
}

static int grow_single(ap_host_pool *hp, int cls, ap_error *err) {
    host_block *b = calloc(1, sizeof *b);
    void *base = NULL;
    int rc;
    if (!b) return ap_set_error(err, AP_E_HOST_NOMEM, 0, "host memory for the host pool's bookkeeping exhausted");
    rc = runtime_alloc(hp, class_bytes(cls), &base, err);
    if (rc != AP_OK) {
        free(b);
        return rc;
    }
    b->addr = (uintptr_t)base;
    b->cls = (uint8_t)cls;
    b->life = (uint32_t)ap_backend_life(hp->backend, hp->device, 0);
    if (ap_map_put(&hp->map, b->addr, b) != 0) {
        runtime_free(hp, b->addr, class_bytes(cls));
        free(b);
        return ap_set_error(err, AP_E_HOST_NOMEM, 0, "host memory for the host pool's bookkeeping exhausted");
    }
    push_free(hp, b);
    return AP_OK;
}

static void release_slab(ap_host_pool *hp, host_slab *s) {
    for (size_t i = 0; i < s->n_blocks; i++) {
        host_block *b = &s->blocks[i];
        if (b->state == HB_FREE) unlink_free(hp, b);
        ap_map_take(&hp->map, b->addr);
        free(b->uses);
    }
    if (s->prev) s->prev->next = s->next;
    else hp->slabs = s->next;
    if (s->next) s->next->prev = s->prev;
    runtime_free(hp, s->base, s->size);
    free(s->blocks);
    free(s);
}

/* Gives every idle slab and every free big buffer back to the runtime. */
static void release_cached(ap_host_pool *hp) {
    for (int c = 0; c < AP_HOST_N_CLASSES; c++) {
        if (in_slabs(c)) continue;
        while (hp->free_lists[c]) {
            host_block *b = hp->free_lists[c];
            unlink_free(hp, b);
            ap_map_take(&hp->map, b->addr);
            runtime_free(hp, b->addr, class_bytes(c));
            free(b->uses);
            free(b);
        }
    }
    for (host_slab *s = hp->slabs, *next; s; s = next) {
        next = s->next;
        if (s->n_busy == 0) release_slab(hp, s);
    }
}

/* ---- events ----------------------------------------------------------------------------------------- */

/* One reference per device for the pool's life (device_retain: aclrtSetDevice on acl), taken
   before the first runtime object of that device is made. A failure is left to the call that
   follows, which then fails with the runtime's own code. */
static void hold_device(ap_host_pool *hp, int device) {
    if (device < 0 || device >= 64 || (hp->held_devices >> device & 1)) return;
    if (hp->backend->device_retain(hp->backend, device) == 0) hp->held_devices |= (uint64_t)1 << device;
}

static int take_event(ap_host_pool *hp, int device, void **event, uint64_t *life) {
    for (int i = hp->n_events; i-- > 0;)
        if (hp->event_devices[i] == device) {
            *event = hp->events[i];
            *life = hp->event_lives[i];
            hp->n_events--;
            hp->events[i] = hp->events[hp->n_events];
            hp->event_devices[i] = hp->event_devices[hp->n_events];
            hp->event_lives[i] = hp->event_lives[hp->n_events];
            return 0;
        }
    hold_device(hp, device);
    int rc = hp->backend->event_create(hp->backend, device, event);
    if (rc == 0) hp->stats.events_created++;
    *life = ap_backend_life(hp->backend, device, 0);
    return rc;
}

static void give_event(ap_host_pool *hp, void *event, int device, uint64_t life) {
    if (hp->n_events < EVENT_CACHE) {
        hp->events[hp->n_events] = event;
        hp->event_lives[hp->n_events] = life;
        hp->event_devices[hp->n_events++] = device;
    } else {
        hp->backend->event_destroy(hp->backend, event);
    }
}

static void unlink_pending(ap_host_pool *hp, host_block *b) {
    if (b->prev) b->prev->next = b->next;
    else hp->pending_head = b->next;
    if (b->next) b->next->prev = b->prev;
    else hp->pending_tail = b->prev;
    b->prev = b->next = NULL;
    hp->stats.pending_free_bytes -= (int64_t)class_bytes(b->cls);
    hp->stats.pending_free_blocks--;
}

/* Moves parked buffers whose events have all completed to their free lists. wait: block on each
   event (bounded) instead of only asking. Never calls the runtime when nothing is parked. Returns
   how many events the runtime refused to answer for (a released runtime, host_runtime_check). */
static int settle_pending(ap_host_pool *hp, int wait) {
    ap_backend *be = hp->backend;
    int refused = 0;
    for (host_block *b = hp->pending_head, *next; b; b = next) {
        host_uses *u = b->uses;
        int done = 1;
        next = b->next;
        for (int i = 0; i < u->n_events && done; i++) {
            int complete = 0, rc;
            if (wait) rc = be->event_sync(be, u->use[i].event, STREAM_SYNC_MS), complete = rc == 0;
            else if ((rc = be->event_query(be, u->use[i].event, &complete)) != 0) complete = 0;
            refused += rc != 0;
            done = complete;
        }
        if (!done) continue;
        for (int i = 0; i < u->n_events; i++)
            give_event(hp, u->use[i].event, u->use[i].event_device, u->use[i].event_life);
        u->n_events = u->n_uses = 0;
        unlink_pending(hp, b);
        push_free(hp, b);
        release_active(hp, b);
        if (b->slab) b->slab->n_busy--;
    }
    return refused;
}

static host_uses *uses_new(void) {
    host_uses *u = calloc(1, sizeof *u + AP_HOST_MAX_USES * sizeof(host_use));
    if (u) u->cap = AP_HOST_MAX_USES;
    return u;
}

/* b's uses with room for twice as many streams (NULL, b's unchanged, when the host has no memory). */
static host_uses *uses_grow(host_block *b) {
    int cap = b->uses->cap * 2;
    host_uses *u = realloc(b->uses, sizeof *u + (size_t)cap * sizeof(host_use));
    if (!u) return NULL;
    u->cap = cap;
    return b->uses = u;
}

/* Records an event on every stream that used b, and parks it until they complete. Returns 1 when
   parked, 0 when b may be reused at once (the streams were waited for because no event could be
   made, or the runtime knows none of them any more), or a negative status when even that failed:
   b is then kept out of use for good. A stream the runtime no longer knows (a framework's stream
   destroyed after its copy) has no work left: skipped, as the device pools do (stream_order.c).
   Before, its buffer was kept out of use for the process's life and its free raised: a pinned
   slab lost per such stream. */
static int park(ap_host_pool *hp, host_block *b, ap_error *err) {
    ap_backend *be = hp->backend;
    host_uses *u = b->uses;
    int rc = 0;
    u->n_events = 0;
    for (int i = 0; i < u->n_uses && rc == 0; i++) {
        void *ev = NULL;
        uint64_t life = 0;
        rc = take_event(hp, u->use[i].device, &ev, &life);
        if (rc != 0) break;
        /* The stream's device names the context of the record: NULL is that device's default
           stream, not that of whichever device this thread used last. */
        be->set_device(be, u->use[i].device);
        rc = be->event_record(be, ev, u->use[i].stream);
        if (rc != 0) {
            give_event(hp, ev, u->use[i].device, life);
            if (ap_backend_stream_gone_code(be, rc)) rc = 0; /* gone: nothing of it to wait for */
            else break;
            continue;
        }
        u->use[u->n_events].event = ev;
        u->use[u->n_events].event_life = life;
        u->use[u->n_events++].event_device = u->use[i].device;
    }
    if (rc == 0 && u->n_events == 0) { /* every stream gone: reusable at once */
        u->n_uses = 0;
        return 0;
    }
    if (rc == 0) {
        b->state = HB_PENDING;
        b->prev = hp->pending_tail;
        b->next = NULL;
        if (hp->pending_tail) hp->pending_tail->next = b;
        else hp->pending_head = b;
        hp->pending_tail = b;
        hp->stats.pending_free_bytes += (int64_t)class_bytes(b->cls);
        hp->stats.pending_free_blocks++;
        return 1;
    }
    /* No event: wait for the streams themselves, so that the buffer is still never reused early. */
    for (int i = 0; i < u->n_events; i++)
        give_event(hp, u->use[i].event, u->use[i].event_device, u->use[i].event_life);
    u->n_events = 0;
    for (int i = 0; i < u->n_uses; i++) {
        be->set_device(be, u->use[i].device);
        int src = be->stream_sync(be, u->use[i].stream, STREAM_SYNC_MS);
        if (src != 0 && !ap_backend_stream_gone_code(be, src)) {
            b->state = HB_LOST;
            return -ap_set_error(err, AP_E_DEVICE, src,
                                 "host buffer %p: no event could be recorded (code %d) and stream %p could not "
                                 "be waited for (code %d); the buffer is kept out of use",
                                 (void *)b->addr, rc, u->use[i].stream, src);
        }
    }
    u->n_uses = 0;
    return 0;
}

/* ---- the runtime released the pool's memory ----------------------------------------------------- */

/* Said once per runtime life of the device, for all the process's host pools. */
static _Atomic uint64_t host_lost_said;

/* Takes a buffer of released memory out of the pool with no runtime call: its free-list entry
   or its place in the counters goes, and a buffer still handed out is written off into `lost`
   (its free accepted). Its parked events were dealt with before (host_runtime_check). */
static void forget_block(ap_host_pool *hp, host_block *b, uint64_t *written_off) {
    size_t cs = class_bytes(b->cls);
    if (b->state == HB_FREE) {
        unlink_free(hp, b);
    } else {
        if (b->state == HB_ALLOCATED) {
            hp->stats.allocated_bytes -= (int64_t)cs;
            hp->stats.requested_bytes -= (int64_t)b->requested;
            hp->stats.allocations--;
            (*written_off)++;
            if (hp->lost.keys || ap_map_init(&hp->lost, 64) == 0) /* no host memory: its free is refused */
                if (!ap_map_get(&hp->lost, b->addr)) (void)ap_map_put(&hp->lost, b->addr, (void *)(uintptr_t)1);
        }
        hp->stats.active_requests--; /* handed out, parked or lost: active until now */
        hp->stats.active_bytes -= (int64_t)cs;
    }
    ap_map_take(&hp->map, b->addr);
    free(b->uses);
    b->uses = NULL;
}

/* The runtime life of the pool's device moved on (aclFinalize, then perhaps aclInit; a forced
   reset): the pinned memory of the earlier life was released by the runtime (the simulator, as
   CANN, unmaps it: a write to a cached buffer served after it ended the process with SIGSEGV) and
   its events went with it. Forgets them without a runtime call: cached buffers and slabs dropped,
   parked buffers' dead events dropped, buffers handed out written off. Called with the lock held
   before the pool's runtime calls, never on the cached path; probe: the backend first enters the
   device's context, which finds a finalised runtime or a released context. 1 when something was
   forgotten (said once on stderr per device and life). */
static int host_runtime_check(ap_host_pool *hp, int probe) {
    ap_backend *be = hp->backend;
    uint64_t now = ap_backend_life(be, hp->device, probe);
    if (now == hp->life) return 0;
    hp->life = now;
    uint64_t written_off = 0;
    size_t segs = 0, bytes = 0;
    /* Events of a device whose life moved on are the released runtime's: forgotten, not destroyed. */
    for (int i = hp->n_events; i-- > 0;)
        if (hp->event_lives[i] != ap_backend_life(be, hp->event_devices[i], 0)) {
            hp->n_events--;
            hp->events[i] = hp->events[hp->n_events];
            hp->event_devices[i] = hp->event_devices[hp->n_events];
            hp->event_lives[i] = hp->event_lives[hp->n_events];
        }
    for (host_block *b = hp->pending_head, *next; b; b = next) {
        host_uses *u = b->uses;
        int old = (b->slab ? b->slab->life : b->life) != (b->slab ? now : (uint32_t)now), kept = 0;
        next = b->next;
        for (int i = 0; i < u->n_events; i++) {
            host_use e = u->use[i];
            if (e.event_life != ap_backend_life(be, e.event_device, 0)) continue; /* gone with its work */
            if (old) give_event(hp, e.event, e.event_device, e.event_life);
            else u->use[kept++] = e;
        }
        u->n_events = kept;
        if (kept) continue; /* memory of this life, waiting for live work */
        u->n_uses = 0;
        unlink_pending(hp, b);
        if (old) {
            b->state = HB_LOST; /* forgotten with its memory below */
        } else {
            push_free(hp, b);
            release_active(hp, b);
            if (b->slab) b->slab->n_busy--;
        }
    }
    for (host_slab *s = hp->slabs, *next; s; s = next) {
        next = s->next;
        if (s->life == now) continue;
        for (size_t i = 0; i < s->n_blocks; i++) forget_block(hp, &s->blocks[i], &written_off);
        if (s->prev) s->prev->next = s->next;
        else hp->slabs = s->next;
        if (s->next) s->next->prev = s->prev;
        segs++;
        bytes += s->size;
        free(s->blocks);
        free(s);
    }
    for (size_t i = 0; i <= hp->map.mask;) { /* buffers of their own (a take may shift the next into i) */
        host_block *b = hp->map.vals[i];
        if (!b || b->slab || b->life == (uint32_t)now) {
            i++;
            continue;
        }
        forget_block(hp, b, &written_off);
        segs++;
        bytes += class_bytes(b->cls);
        free(b);
    }
    hp->stats.segments -= (int64_t)segs;
    hp->stats.reserved_bytes -= (int64_t)bytes;
    uint64_t key = now << 8 | (uint64_t)(hp->device & 0xff), said = atomic_load(&host_lost_said);
    if ((segs || written_off) && said != key && atomic_compare_exchange_strong(&host_lost_said, &said, key))
        fprintf(stderr,
                "ascend_pool: warning: the runtime released the pinned host memory of device %d's host pool "
                "(aclFinalize, or a reset of the device): the pool forgot %zu pinned allocation(s), %zu bytes, "
                "without freeing them, and wrote off %llu buffer(s) still handed out (their frees are accepted, "
                "nothing of them is reused). Empty the cache (empty_cache) and close the pool before "
                "finalizing the runtime.\n",
                hp->device, segs, bytes, (unsigned long long)written_off);
    return segs || written_off;
}

/* A buffer written off by host_runtime_check: its free is accepted once, and forgets it. */
static int lost_take(ap_host_pool *hp, void *ptr) {
    return hp->lost.keys && ap_map_take(&hp->lost, (uintptr_t)ptr) != NULL;
}

/* ---- the interface ---------------------------------------------------------------------------------- */

ap_host_pool *ap_host_pool_create(ap_backend *backend, int device, ap_error *err) {
    ap_host_pool *hp = calloc(1, sizeof *hp);
    if (!hp || ap_map_init(&hp->map, 256) != 0) {
        free(hp);
        ap_set_error(err, AP_E_HOST_NOMEM, 0, "host memory for the host pool exhausted");
        return NULL;
    }
    pthread_mutex_init(&hp->lock, NULL);
    hp->backend = backend;
    hp->device = device;
    hold_device(hp, device);
    hp->life = ap_backend_life(backend, device, 0); /* after the reference: a renewal in it is this life */
    return hp;
}

void ap_host_pool_destroy(ap_host_pool *hp) {
    if (!hp) return;
    /* What the runtime released behind the pool is forgotten, not freed: its addresses may be
       another allocation's by now. */
    host_runtime_check(hp, 1);
    for (host_block *b = hp->pending_head; b; b = b->next)
        for (int i = 0; i < b->uses->n_events; i++) hp->backend->event_destroy(hp->backend, b->uses->use[i].event);
    for (size_t i = 0; i <= hp->map.mask; i++) { /* buffers of their own */
        host_block *b = hp->map.vals[i];
        if (!b || b->slab) continue;
        hp->backend->host_free(hp->backend, hp->device, (void *)b->addr);
        free(b->uses);
        free(b);
    }
    for (host_slab *s = hp->slabs, *next; s; s = next) {
        next = s->next;
        hp->backend->host_free(hp->backend, hp->device, (void *)s->base);
        for (size_t i = 0; i < s->n_blocks; i++) free(s->blocks[i].uses);
        free(s->blocks);
        free(s);
    }
    for (int i = 0; i < hp->n_events; i++) hp->backend->event_destroy(hp->backend, hp->events[i]);
    /* Last, as CANN orders it: events and memory first, then the device references. */
    for (int d = 0; d < 64; d++)
        if (hp->held_devices >> d & 1) hp->backend->device_release(hp->backend, d);
    ap_map_destroy(&hp->map);
    if (hp->lost.keys) ap_map_destroy(&hp->lost);
    pthread_mutex_destroy(&hp->lock);
    free(hp);
}

int ap_host_malloc(ap_host_pool *hp, size_t size, void **out, ap_error *err) {
    size_t cs = ap_host_class_size(size);
    if (cs == 0)
        return ap_set_error(err, AP_E_INVALID_SIZE, 0,
                            size == 0 ? "size must be positive, got 0 bytes"
                                      : "cannot pin %zu bytes: more than the largest class (1 TiB)",
                            size);
    int cls = class_of(cs), rc = AP_OK;
    pthread_mutex_lock(&hp->lock);
    /* a query refused: the runtime may be gone (then those events are, and the buffers they guard) */
    if (hp->pending_head && settle_pending(hp, 0)) host_runtime_check(hp, 0);
    if (!hp->free_lists[cls]) {
        host_runtime_check(hp, 1); /* a runtime call follows: what the runtime released goes first */
        if (!hp->free_lists[cls]) rc = in_slabs(cls) ? grow_slab(hp, cls, err) : grow_single(hp, cls, err);
        if (rc != AP_OK && rc != AP_E_HOST_NOMEM && host_runtime_check(hp, 0)) {
            /* the call found the runtime finalised or renewed: once more, in the runtime there is now */
            rc = AP_OK;
            if (!hp->free_lists[cls]) rc = in_slabs(cls) ? grow_slab(hp, cls, err) : grow_single(hp, cls, err);
        }
    }
    if (rc != AP_OK) {
        pthread_mutex_unlock(&hp->lock);
        return rc;
    }
    host_block *b = hp->free_lists[cls];
    unlink_free(hp, b);
    b->state = HB_ALLOCATED;
    b->requested = size;
    if (b->slab) b->slab->n_busy++;
    peak(&hp->stats.allocated_bytes, &hp->stats.allocated_bytes_peak, (int64_t)cs);
    peak(&hp->stats.requested_bytes, &hp->stats.requested_bytes_peak, (int64_t)size);
    peak(&hp->stats.allocations, &hp->stats.allocations_peak, 1);
    peak(&hp->stats.active_requests, &hp->stats.active_requests_peak, 1);
    peak(&hp->stats.active_bytes, &hp->stats.active_bytes_peak, (int64_t)cs);
    hp->stats.acc_requests++;
    hp->stats.acc_request_bytes += (int64_t)cs;
    hp->stats.num_allocs++;
    void *addr = (void *)b->addr; /* under the lock: once it is dropped, a free of this address (a
                                     caller's dangling pointer) may recycle the block */
    pthread_mutex_unlock(&hp->lock);
    *out = addr;
    return AP_OK;
}

int ap_host_free(ap_host_pool *hp, void *ptr, ap_error *err) {
    pthread_mutex_lock(&hp->lock);
    host_block *b = ap_map_get(&hp->map, (uintptr_t)ptr);
    /* Events follow: what the backend saw the runtime release goes first (no probe: a marked free
       is frequent, and its records' own failures are checked after park). */
    if (b && b->state == HB_ALLOCATED && b->uses && b->uses->n_uses && host_runtime_check(hp, 0))
        b = ap_map_get(&hp->map, (uintptr_t)ptr);
    if ((!b || b->state != HB_ALLOCATED) && lost_take(hp, ptr)) {
        hp->stats.num_frees++; /* written off with the runtime that released it */
        pthread_mutex_unlock(&hp->lock);
        return AP_OK;
    }
    if (!b || b->state != HB_ALLOCATED) {
        hp->stats.num_invalid_frees++;
        pthread_mutex_unlock(&hp->lock);
        return ap_set_error(err, AP_E_INVALID_PTR, 0,
                            "%p is not a pinned host buffer handed out by this pool (never allocated, or freed twice)",
                            ptr);
    }
    hp->stats.allocated_bytes -= (int64_t)class_bytes(b->cls);
    hp->stats.requested_bytes -= (int64_t)b->requested;
    hp->stats.allocations--;
    hp->stats.num_frees++;
    b->requested = 0;
    /* 1: parked (its slab stays busy until the events complete); < 0: lost for good. */
    int rc = b->uses && b->uses->n_uses ? park(hp, b, err) : 0;
    if (rc < 0 && host_runtime_check(hp, 0)) {
        /* the records and waits found the runtime released: the buffer went with its memory, or
           (memory of this life) the streams' work it guarded did */
        if (err) err->status = AP_OK;
        rc = ap_map_get(&hp->map, (uintptr_t)ptr) == b ? 0 : 2;
        if (rc == 0) b->uses->n_uses = 0;
    }
    if (rc == 0) {
        push_free(hp, b);
        release_active(hp, b);
        if (b->slab) b->slab->n_busy--;
    }
    pthread_mutex_unlock(&hp->lock);
    return rc < 0 ? -rc : AP_OK;
}

int ap_host_realloc(ap_host_pool *hp, void *ptr, size_t new_size, void **out, ap_error *err) {
    if (!ptr) return ap_host_malloc(hp, new_size, out, err);
    size_t cs = ap_host_class_size(new_size);
    if (cs == 0) return ap_set_error(err, AP_E_INVALID_SIZE, 0, "cannot resize a host buffer to %zu bytes", new_size);
    pthread_mutex_lock(&hp->lock);
    host_block *b = ap_map_get(&hp->map, (uintptr_t)ptr);
    if ((!b || b->state != HB_ALLOCATED) && hp->lost.keys && ap_map_get(&hp->lost, (uintptr_t)ptr)) {
        /* Nothing to copy: its pages went with the runtime (it said only "not a pinned host
           buffer handed out by this pool"). Still written off: its free is accepted. */
        pthread_mutex_unlock(&hp->lock);
        return ap_set_error(err, AP_E_INVALID_PTR, 0,
                            "%p is a pinned host buffer the runtime released (aclFinalize, or a reset of the device): "
                            "its contents are gone, it cannot be resized; free it and allocate anew", ptr);
    }
    if (!b || b->state != HB_ALLOCATED) {
        pthread_mutex_unlock(&hp->lock);
        return ap_set_error(err, AP_E_INVALID_PTR, 0, "%p is not a pinned host buffer handed out by this pool", ptr);
    }
    if (b->cls == class_of(cs)) { /* same class: the buffer already has room */
        peak(&hp->stats.requested_bytes, &hp->stats.requested_bytes_peak, (int64_t)new_size - (int64_t)b->requested);
        b->requested = new_size;
        pthread_mutex_unlock(&hp->lock);
        *out = ptr;
        return AP_OK;
    }
    size_t keep = b->requested < new_size ? b->requested : new_size;
    pthread_mutex_unlock(&hp->lock);
    void *moved = NULL;
    int rc = ap_host_malloc(hp, new_size, &moved, err);
    if (rc != AP_OK) return rc; /* realloc semantics: the old buffer stays valid */
    memcpy(moved, ptr, keep);
    ap_host_free(hp, ptr, NULL);
    *out = moved;
    return AP_OK;
}

int ap_host_record_stream(ap_host_pool *hp, void *ptr, void *stream, int device, ap_error *err) {
    int rc = AP_OK;
    pthread_mutex_lock(&hp->lock);
    host_block *b = ap_map_get(&hp->map, (uintptr_t)ptr);
    if (!b && hp->lost.keys && ap_map_get(&hp->lost, (uintptr_t)ptr)) {
        /* written off with the runtime that released it: no stream's work can reach it */
    } else if (!b || b->state != HB_ALLOCATED) {
        rc = ap_set_error(err, AP_E_INVALID_PTR, 0, "%p is not a pinned host buffer handed out by this pool", ptr);
    } else if (!b->uses && !(b->uses = uses_new())) {
        rc = ap_set_error(err, AP_E_HOST_NOMEM, 0, "host memory for the host pool's bookkeeping exhausted");
    } else {
        host_uses *u = b->uses;
        int seen = 0;
        for (int i = 0; i < u->n_uses; i++) seen |= u->use[i].stream == stream && u->use[i].device == device;
        /* Past AP_HOST_MAX_USES they grow, as torch's host allocator keeps a set with no limit:
           the 9th was refused, and a caller that went on freed the buffer under that copy. An
           allocated buffer's uses are reached from nowhere else: realloc may move them. */
        if (!seen && u->n_uses == u->cap && !(u = uses_grow(b)))
            rc = ap_set_error(err, AP_E_HOST_NOMEM, 0, "host memory for the host pool's bookkeeping exhausted");
        else if (!seen) {
            u->use[u->n_uses].stream = stream;
            u->use[u->n_uses++].device = device;
        }
    }
    pthread_mutex_unlock(&hp->lock);
    return rc;
}

int ap_host_block_info(ap_host_pool *hp, void *ptr, uintptr_t *base, size_t *capacity, size_t *requested) {
    int rc = -1;
    pthread_mutex_lock(&hp->lock);
    host_block *b = ap_map_get(&hp->map, (uintptr_t)ptr);
    if (b && b->state == HB_ALLOCATED) {
        *base = b->addr;
        *capacity = class_bytes(b->cls);
        *requested = b->requested;
        rc = 0;
    }
    pthread_mutex_unlock(&hp->lock);
    return rc;
}

void ap_host_empty_cache(ap_host_pool *hp) {
    pthread_mutex_lock(&hp->lock);
    host_runtime_check(hp, 1); /* memory the runtime released is forgotten, not waited for or freed */
    if (hp->pending_head && settle_pending(hp, 1)) host_runtime_check(hp, 0);
    release_cached(hp);
    pthread_mutex_unlock(&hp->lock);
}

void ap_host_get_stats(ap_host_pool *hp, ap_host_stats *out) {
    pthread_mutex_lock(&hp->lock);
    *out = hp->stats;
    pthread_mutex_unlock(&hp->lock);
}

void ap_host_reset_peaks(ap_host_pool *hp) {
    pthread_mutex_lock(&hp->lock);
    hp->stats.allocated_bytes_peak = hp->stats.allocated_bytes;
    hp->stats.requested_bytes_peak = hp->stats.requested_bytes;
    hp->stats.allocations_peak = hp->stats.allocations;
    hp->stats.reserved_bytes_peak = hp->stats.reserved_bytes;
    hp->stats.segments_peak = hp->stats.segments;
    hp->stats.active_requests_peak = hp->stats.active_requests;
    hp->stats.active_bytes_peak = hp->stats.active_bytes;
    pthread_mutex_unlock(&hp->lock);
}

void ap_host_reset_accumulated(ap_host_pool *hp) {
    pthread_mutex_lock(&hp->lock);
    ap_host_stats *st = &hp->stats;
    st->acc_host_alloc = st->acc_host_free = st->acc_pinned_bytes = st->acc_unpinned_bytes = 0;
    st->acc_requests = st->acc_request_bytes = st->acc_released = st->acc_released_bytes = 0;
    st->host_alloc_us = st->host_alloc_us_max = st->host_alloc_us_min = 0;
    st->host_free_us = st->host_free_us_max = st->host_free_us_min = 0;
    pthread_mutex_unlock(&hp->lock);
}

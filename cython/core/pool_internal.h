/* Helpers shared by the pool's implementation files; not part of the public interface. */
#ifndef AP_POOL_INTERNAL_H
#define AP_POOL_INTERNAL_H

#include <stdio.h>

#include "invariant.h"
#include "pool.h"

#define AP_LARGE_BUFFER (20u << 20) /* torch's kLargeBuffer: an oversize cached block may exceed the request
                                       by this much, and a medium request's segment is this big (segments.c) */
#define AP_MIN_LARGE_ALLOC (10u << 20) /* torch's kMinLargeAlloc: a large request below this is medium */

static inline size_t ap_round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

/* Device-call credits of the release policies (classic_policy.c, vmm_policy.c), in thousandths of
   a call, earned per allocation (p->tick). ap_ticks_since: the allocations since *tick, which it
   moves to now (capped at 2^40, so that ticks * rate cannot overflow). ap_credit_add: the credit
   plus per_1000 for each of them, at most cap. */
static inline uint64_t ap_ticks_since(uint64_t now, uint64_t *tick) {
    uint64_t ticks = now - *tick;
    *tick = now;
    return ticks < ((uint64_t)1 << 40) ? ticks : ((uint64_t)1 << 40);
}
static inline void ap_credit_add(int64_t *credit, uint64_t ticks, int64_t per_1000, int64_t cap) {
    int64_t c = *credit + (int64_t)ticks * per_1000;
    *credit = c > cap ? cap : c;
}

/* Bytes a request of size (1 .. device size) occupies: padded, then rounded to min_block, a power
   of two (checked at creation), so the hot path rounds with a mask instead of a division. */
size_t ap_round_power2_divisions(const ap_pool *p, size_t padded);
static inline size_t ap_round_request(const ap_pool *p, size_t size) {
    /* roundup_power2 and roundup_divisions change at runtime (ap_pool_set_tunables, under the
       pool lock) while this reads them without it: relaxed atomics, plain loads on the hot path;
       a request rounded by the old settings or the new is rounded right either way. */
    if (__builtin_expect(__atomic_load_n(&p->cfg.roundup_power2, __ATOMIC_RELAXED), 0))
        return ap_round_power2_divisions(p, size + p->cfg.pad_bytes);
    return (size + p->cfg.pad_bytes + p->cfg.min_block - 1) & ~(p->cfg.min_block - 1);
}

/* Names the pool's device for the stream and event calls that follow on this thread (NULL means
   that device's default stream). The acl backend runs each such call in the device's context and
   puts the caller's context back after: a thread-local store here, no runtime call. */
static inline void ap_on_device(ap_pool *p) { p->backend->set_device(p->backend, p->device); }

/* block_arena.c: block and segment structs, recycled, never freed before the pool. */
ap_block *ap_block_new(ap_pool *p);
void ap_block_recycle(ap_pool *p, ap_block *b);
ap_segment *ap_segment_new(ap_pool *p);
void ap_segment_recycle(ap_pool *p, ap_segment *s);
void ap_arena_destroy(ap_pool *p);
ap_block_uses *ap_uses_new(ap_pool *p);
int ap_uses_grow(ap_block_uses *u, int foreign);
/* u's arrays are its inline ones, or one grown allocation laid out as ap_uses_grow lays it. */
static inline int ap_uses_ok(const ap_block_uses *u) {
    size_t waits = (size_t)u->cap + u->fcap + 1;
    int in = u->cap == AP_MAX_USES && u->fcap == AP_MAX_FOREIGN && u->uses == u->uses_in &&
             u->events == u->events_in && u->event_keys == u->event_keys_in && u->owed == u->owed_in && u->foreign == u->foreign_in &&
             u->foreign_device == u->foreign_device_in && u->fevents == u->fevents_in;
    int grown = (u->cap > AP_MAX_USES || u->fcap > AP_MAX_FOREIGN) && u->cap >= AP_MAX_USES &&
                u->cap <= AP_MAX_STREAMS && u->fcap >= AP_MAX_FOREIGN && u->fcap <= AP_FOREIGN_LIMIT &&
                u->events != u->events_in && u->owed == u->events + waits && u->foreign == u->owed + waits &&
                u->fevents == u->foreign + u->fcap && u->event_keys == (const uint32_t *)(u->fevents + u->fcap) &&
                u->uses == (const uint16_t *)(u->event_keys + waits) &&
                u->foreign_device == (const int16_t *)(u->uses + u->cap);
    return (in || grown) && u->n_uses <= u->cap && u->n_foreign <= u->fcap && u->n_fevents <= u->fcap;
}
void ap_uses_shrink(ap_block_uses *u);
void ap_uses_recycle(ap_pool *p, ap_block_uses *u);
/* PyTorch's "oversize": a large-pool block or segment of max_split_size or more (never split). */
static inline int ap_oversize(const ap_pool *p, int pool, size_t size) {
    return pool == AP_POOL_LARGE && size >= p->cfg.max_split_size;
}
/* Counts seg in oversize_segments while it is oversize. An expandable segment's size changes as
   chunks map, unmap and join, so this runs after each change. */
static inline void ap_segment_sized(ap_pool *p, ap_segment *seg) {
    int over = ap_oversize(p, seg->pool, seg->size);
    if (over != seg->oversize) ap_stat_step(&p->stats.oversize[1], over ? 1 : -1);
    seg->oversize = over;
}

/* Puts a new segment (its fields set) at the head of the pool's list and counts it (segment.*):
   the one place a segment joins the list (segments.c, expandable.c, and the C unit tests' pools). */
static inline void ap_segment_link(ap_pool *p, ap_segment *seg) {
    seg->oversize = 0;
    ap_segment_sized(p, seg);
    seg->prev = NULL;
    seg->next = p->segments;
    if (p->segments) p->segments->prev = seg;
    p->segments = seg;
    p->n_segments++;
    ap_stat_inc(&p->stats, AP_STAT_SEGMENT, seg->pool, 1);
}
/* Takes seg out of the pool's list and its counts (segment.*, oversize_segments): the one place a
   segment leaves it (a release, a shared block's end, expandable joins and unmaps). */
static inline void ap_segment_unlink(ap_pool *p, ap_segment *seg) {
    if (seg->prev) seg->prev->next = seg->next;
    else p->segments = seg->next;
    if (seg->next) seg->next->prev = seg->prev;
    p->n_segments--;
    if (seg->oversize) ap_stat_step(&p->stats.oversize[1], -1);
    seg->oversize = 0;
    ap_stat_dec(&p->stats, AP_STAT_SEGMENT, seg->pool, 1);
}

/* free_blocks.c: moving blocks in and out of the free trees with coalescing and stats. */
/* Inserts a free block tagged with stream slot `tag`, merging it with free address neighbours
   whose tag is compatible (equal, or 0 = no stream); returns the merged block. */
ap_block *ap_free_insert(ap_pool *p, ap_block *b, int tag);
void ap_free_remove(ap_pool *p, ap_block *b);
/* Moves every free block of slot `from` to tag `to` (0 = any stream), merging as it goes. */
/* A segment of expandable memory grew, joined another or was cut under its free blocks: each
   free block's inactive_split count (split or whole segment) follows its segment's new shape. */
void ap_free_recount_segment(ap_pool *p, ap_segment *s);
void ap_free_retag_slot(ap_pool *p, int from, int to);
/* Best cached block for a request on slot (own stream or any-stream blocks), or NULL. */
ap_block *ap_find_fit(ap_pool *p, int slot, int pool, size_t rsize);
/* Expandable small pool: 1 when the first rsize bytes at b touch only pages that hold live data
   (the page fit's best score: nothing new pinned). */
int ap_page_fit_pins_nothing(const ap_pool *p, const ap_block *b, size_t rsize);
/* Takes a free block (already chosen by ap_find_fit) for an allocation, splitting off the rest. */
void ap_take_block(ap_pool *p, ap_block *b, size_t rsize, size_t requested, int slot);

/* Marks a block (already out of every free structure) of pool kind `pool` allocated, with the
   allocation stats. Inline: the cached path passes a constant kind. */
static inline void ap_mark_allocated_in(ap_pool *p, ap_block *b, size_t requested, int slot, int pool) {
    b->state = AP_BLOCK_ALLOCATED;
    b->requested = requested;
    b->ctx = 0; /* no frames, unless ap_history_note_alloc files the allocation's */
    b->tag = (uint16_t)slot;
    b->seg->last_use = ++p->tick;
    ap_stat_inc(&p->stats, AP_STAT_ALLOCATION, pool, 1);
    ap_stat_inc(&p->stats, AP_STAT_ALLOCATED_BYTES, pool, (int64_t)b->size);
    ap_stat_inc(&p->stats, AP_STAT_REQUESTED_BYTES, pool, (int64_t)requested);
    if (ap_oversize(p, pool, b->size)) ap_stat_step(&p->stats.oversize[0], 1);
    /* active = allocated + pending (stats.h): its peak needs a look only while blocks wait */
    if (__builtin_expect(p->stats.pending[0][AP_STAT_ALL].current != 0, 0)) ap_stats_note_active(&p->stats, pool);
}

static inline void ap_mark_allocated(ap_pool *p, ap_block *b, size_t requested, int slot) {
    ap_mark_allocated_in(p, b, requested, slot, b->seg->pool);
}

/* Records an allocation made with history on (requested bytes, as PyTorch's trace): the event,
   and the thread's frames context on the block itself, which keeps it for as long as it lives
   (as torch keeps a block's allocation context), however far the ring has moved on. */
static inline void ap_history_note_alloc(ap_pool *p, ap_block *b, size_t requested, void *stream) {
    if (!p->history.capacity) return;
    b->ctx = ap_history_tls_ctx;
    ap_history_record(&p->history, AP_ACT_ALLOC, b->addr, requested, stream);
}

/* segments.c: device allocations, release policies and the out-of-memory path. */
/* Returns a free block of at least rsize for slot, from a new segment if needed (the slow path). */
ap_block *ap_obtain_block(ap_pool *p, int slot, int pool, size_t rsize, size_t requested, ap_error *err);
/* Releases fully free segments (settling streams as needed) until `target` bytes are returned
   or none remain; include_pinned also returns the preallocated reserve. Returns bytes released. */
size_t ap_release_free_segments(ap_pool *p, size_t target, int include_pinned, int oldest_first, ap_error *err);
/* Releases the wholly free classic segments created for slot's allocations (none still tagged). */
size_t ap_release_stream_segments(ap_pool *p, int slot, ap_error *err);
int ap_segment_alloc(ap_pool *p, int pool, size_t size, int slot, int pinned, ap_block **out, ap_error *err);
/* Returns a wholly free segment (its one block in a free tree) to the device. */
int ap_segment_release(ap_pool *p, ap_segment *seg, ap_error *err);
size_t ap_reserved(const ap_pool *p);
/* Bytes a growth may take now under p's own byte limit and its device's memory fraction, the
   smaller of both (SIZE_MAX: neither): the placement's limit rules (exact sizes near it, no
   overshoot or absorbed room past it) go by this one room. */
size_t ap_limit_room(const ap_pool *p);
/* 1 when need + extra bytes fit in that room (always without a limit or fraction). */
static inline int ap_limit_fits(const ap_pool *p, size_t need, size_t extra) {
    size_t room = ap_limit_room(p);
    return room >= need && room - need >= extra;
}

/* classic_policy.c: before a classic growth of `size` bytes that would lift reserved memory above
   its peak, trades wholly free segments for it within the device-call budget; returns the bytes
   to grow by (at least size). */
size_t ap_classic_make_room(ap_pool *p, int pool, size_t rsize, size_t size);
/* classic_policy.c: a growth has lifted reserved memory to new_peak bytes, above the watermark
   (called before the watermark moves): the growth's share of the trade credit. */
void ap_classic_peak_rose(ap_pool *p, size_t new_peak);
/* classic_policy.c: refills of the room trades left that the trade credit must still pay (each
   takes at least one growth unit of it); the credit never holds less than this many calls. */
int64_t ap_classic_refills_owed(const ap_pool *p);
void ap_classic_policy_init(ap_pool *p);

/* expandable.c: segments that grow and shrink in reserved address space. */
int ap_vmm_init(ap_pool *p, ap_error *err);
/* Maps memory so that a free block of at least rsize exists for slot; returns it (in its tree). */
ap_block *ap_vmm_grow(ap_pool *p, int slot, int pool, size_t rsize, ap_error *err);
/* Bytes a growth for rsize would map now, and the free block it would extend (*keep, or NULL). */
size_t ap_vmm_plan(ap_pool *p, int slot, int pool, size_t rsize, const ap_block **keep);

/* vmm_policy.c: before a growth of `need` bytes for a request of rsize, trades idle chunks so that
   reserved memory stays under its earlier peak, within the device-call budget. */
void ap_vmm_make_room(ap_pool *p, size_t rsize, size_t need, const ap_block *keep);
void ap_vmm_policy_init(ap_pool *p);
/* Bytes a growth of `need` bytes in `chunks` new chunks maps beyond need: 0 within the growth
   budget, else 1/64 of reserved memory (charges the budget). */
size_t ap_vmm_growth_extra(ap_pool *p, size_t need, size_t chunks);
/* Largest physical chunk of a growth of `need` bytes (expandable.c). */
size_t ap_vmm_chunk_cap(const ap_pool *p, size_t need);
/* Unmaps whole free chunks (largest free run first, settling streams as needed) until target bytes
   are returned; returns the bytes released. */
size_t ap_vmm_release(ap_pool *p, size_t target, ap_error *err);
/* The release policy's variant, for the growth that follows: takes the longest-idle free block
   first, leaves `keep` alone, never waits for all streams, and keeps the physical memory of what
   it unmaps for that growth (p->vmm_spares); only free blocks of min_block bytes or more (0: all). */
size_t ap_vmm_release_for_growth(ap_pool *p, size_t target, const ap_block *keep, int64_t max_unmaps,
                                 size_t min_block);
void ap_vmm_destroy(ap_pool *p);
/* expandable.c: the runtime released the pool's virtual memory; forgotten without a runtime call. */
void ap_vmm_forget(ap_pool *p);
/* stream_order.c: the pending frees of segments `old` says are of an earlier runtime life, taken
   out of the list without a runtime call (ap_pool_runtime_check). */
void ap_pending_forget(ap_pool *p, int (*old)(const ap_pool *, const ap_segment *));
/* stream_order.c: the idle and parked events of an earlier runtime life, forgotten likewise. */
void ap_events_forget(ap_pool *p);

/* stream_order.c: stream slots, events, pending frees, cross-stream reuse. */
/* Slot of a stream (created when create != 0); -1 when none / table full, -2 when the runtime
   refuses the stream (unusable: checked once, when its slot is created), -3 when the stream is
   another device's, -4 when it is in a context this thread cannot reach (create == 2: given a
   slot all the same, its blocks busy to other streams until it is found idle). */
int ap_slot_of(ap_pool *p, void *stream, int create);
/* The same, answered inline when the stream is the last one looked up (the usual case). */
static inline int ap_slot_of_fast(ap_pool *p, void *stream, int create) {
    int last = p->last_slot;
    if (last > 0 && p->slots[last].stream == stream && p->slots[last].live) return last;
    return ap_slot_of(p, stream, create);
}
/* An event to record on `stream`: a cached one (every record of it complete), else a parked one
   whose records all run before the work queued on `stream` (stream_order.c), else a new one;
   NULL if none. */
void *ap_event_get(ap_pool *p, void *stream);
/* Returns an event to the cache (destroyed when the cache is full). */
void ap_event_put(ap_pool *p, void *event);
/* The same for an event recorded on recorded_on that waiting_stream waited on: reset first (CANN's
   rule); new-mode events are kept until that record has run (records in flight, stream_order.c). */
void ap_event_put_waited(ap_pool *p, void *event, void *recorded_on, void *waiting_stream);
void ap_events_destroy(ap_pool *p);
/* A pending block's events of other devices destroyed with their pool: their ids no longer counted. */
void ap_foreign_events_gone(ap_block_uses *u);
/* New-mode records in flight that the pool's parked events, pending frees and slots hold: what
   ap_pool.records_out must be (check.c). */
int ap_records_counted(const ap_pool *p);
/* Destroys idle events until `keep` are left (the cache bound, after waits held pins; 0 on
   empty_cache). */
void ap_events_trim(ap_pool *p, int keep);
/* 1 when code (from a stream call) says the runtime does not know the stream: destroyed behind
   the pool's back, or garbage. */
int ap_stream_unusable(const ap_pool *p, int code);
/* 1 when code says the stream is alive but not in the calling thread's context (ACL 107003): its
   work may still run, so the pool neither retires it nor hands its blocks to others. */
int ap_stream_elsewhere(const ap_pool *p, int code);
#define AP_STREAM_ELSEWHERE (-4) /* stream_idle's answer for such a stream */
/* Retires a slot whose stream is gone or unusable: its free blocks serve every stream, and blocks
   later freed with its tag go to slot 0 (its work is over). */
void ap_slot_retire(ap_pool *p, int slot);
/* 0 while slot's stream is alive and this device's; -2 when the runtime no longer knows it (one
   event record, no wait), -3 when its handle now names another device's stream (the runtime gave
   a destroyed stream's handle away): then with its slot retired (-3: once the work queued on
   that other device's stream is done, no wait: its blocks may be its own). Lock held. For the paths that
   are about to spend far more (a device allocation). */
int ap_stream_gone(ap_pool *p, int slot);
/* Waits (blocking, all of them within what is left of one sync_timeout_ms from start, ap_now_ms)
   for every stream that free blocks are still tagged with: their queued work may write those
   blocks. For the pool's destroy, before its memory goes back to the device (waits.c). Returns
   how many are still busy (timed out, or not waited for once the limit was spent). */
int ap_wait_tagged_streams(ap_pool *p, int64_t start);
/* CLOCK_MONOTONIC in ms; what is left of one sync_timeout_ms from start (-1: no limit, 0: spent). */
int64_t ap_now_ms(void);
int ap_time_left(const ap_pool *p, int64_t start);
/* Frees a block whose uses (record_stream) need events: it waits on the pending list. */
void ap_free_pending(ap_pool *p, ap_block *b, int tag);
/* waits.c: device waits with the pool mutex dropped. Called with p->lock held; returns with it
   held. Waits for the streams of `slot` (> 0), or of every slot holding free blocks (slot < 0),
   and with `pending` for the events of pending frees; then retags what the waits covered and
   completes pending frees. AP_OK, AP_E_TIMEOUT, AP_E_DEVICE, or AP_E_INVALID_STREAM (the stream
   was retired: the runtime does not know it). */
int ap_wait_unlocked(ap_pool *p, int slot, int pending, ap_error *err);
/* The same for the streams of slots from *from on, at most a batch (64) of them, within the limit
   counted from start; *from is set to where the next round starts (p->n_slots: none left). */
int ap_wait_unlocked_from(ap_pool *p, int slot, int *from, int64_t start, int pending, ap_error *err);
/* ap_wait_unlocked's slot for every live stream of the pool, free blocks or not (a device-wide
   synchronize where the runtime has no device wait). */
#define AP_WAIT_EVERY_STREAM (-2)
/* The same for a live stream the pool has no slot for (its table full): its queued work, within
   sync_timeout_ms, lock dropped; then completes pending frees. */
int ap_wait_stream_unslotted(ap_pool *p, void *stream, ap_error *err);
/* Completes pending frees whose events are done; blocking (a destroy) waits for all, within one
   sync_timeout_ms in all from the pass's start. Returns AP_OK or AP_E_TIMEOUT. */
int ap_process_pending(ap_pool *p, int blocking, ap_error *err);
/* The live slot a pending free's event was recorded on (its event_keys entry), or 0: none known. */
int ap_event_key_slot(ap_pool *p, uint32_t key);
/* Waits for the work queued on the slot's stream, then its free blocks serve every stream. */
int ap_settle_slot(ap_pool *p, int slot, ap_error *err);
/* Settles every stream that holds free blocks, so that free space split across streams merges.
   Returns 1 if any was settled, 0 if none held free blocks, -1 on a failed wait. */
int ap_settle_free_slots(ap_pool *p, ap_error *err);
/* Lets `to` reuse the free blocks of every other stream (for a request of rsize in pool): orders
   to's stream after theirs with an event, no host wait. Returns the number of blocks moved. */
size_t ap_borrow_from_streams(ap_pool *p, int to, int pool, size_t rsize, ap_error *err);

/* free_cache.h: recently freed blocks by exact size, not yet coalesced (inline hits). */
#include "free_cache.h"

#endif

/* The caching pool of one device (and one tenant context): public C interface.
 *
 * Thread-safe: one mutex per pool. The cached path (best fit + split, or free + merge) takes the
 * lock once, touches no Python object and allocates nothing. Device calls happen only on a miss.
 *
 * Locks (who protects what):
 *   ap_pool.lock     every field of ap_pool and of its blocks, segments, slots, events and stats.
 *   backend          its own locking (the runtime is thread-safe); per-thread current device. The
 *                    acl backend's streams_lock (streams it made, and the context learned for each
 *                    someone else's stream) is taken under a pool lock and holds no runtime call
 *                    that can block. Its per-device lock (acl_dev.lock: device references, held
 *                    over aclrtSetDevice/aclrtResetDevice) is taken under a pool lock only to renew
 *                    a context released behind the pool's reference (no last reset there); the
 *                    last reset, which waits for the default context's queued work, runs at
 *                    ap_pool_destroy's end, with no pool lock and without the GIL.
 *   ap_host_pool.lock (host/hostpool.c) the pinned host pool; under it acl_dev.lock may be taken
 *                    for a device's first event (device_retain: aclrtSetDevice, never a reset); its
 *                    device references go back at ap_host_pool_destroy, with no lock held.
 *   the GIL          never taken by C code; every Python method that takes ap_pool.lock releases
 *                    the GIL first (pool.pxi), so a waiter on the mutex never stops the interpreter.
 *                    (The C ABI calls into Python before taking any pool lock, and only for a thread
 *                    that already holds the GIL: stack frames, capi/exports.h apc_note_frames; and
 *                    after a failed allocation, with the pool let go and no lock held, taking the
 *                    GIL for the out-of-memory observers: apc_notify_oom.)
 *   idle_events      (stream_order.c) idle cached events per device of all the process's pools:
 *                    an atomic counter, updated under each pool's own lock, no lock of its own (a
 *                    place under the bound is taken with one compare-and-swap, idle_take).
 *   records_out      (stream_order.c) new-mode records (aclrtCreateEventExWithFlag) of all the
 *                    process's pools not known complete, per device: an atomic counter updated under
 *                    each pool's own lock, no lock of its own. Each such record holds one of the
 *                    device's event ids until it has run, and past them CANN's aclrtRecordEvent
 *                    blocks the thread: at 1/AP_RECORDS_SHARE of them no record is made under the
 *                    lock (record_room; a free owes its stream instead).
 *   events_held      (stream_order.c) live acl events of all the process's pools, per device: the
 *                    same kind of atomic. In the reset scheme (no new-mode events) each holds one of
 *                    the device's ids for its life: at 1/AP_RECORDS_SHARE of them none is created
 *                    (event_room; a free owes its stream instead).
 *   capi_calls       (ap_pool, atomic, no lock) C ABI calls holding the pool (current.h ap_pool_hold);
 *                    ap_pool_destroy waits for it to drain, holding no lock (the pool is hidden first),
 *                    and then, still without the lock, for its pending frees' events and the streams
 *                    its free blocks are tagged with (stream_order.c's blocking pass, then waits.c
 *                    ap_wait_tagged_streams: one sync_timeout_ms in all).
 *   (peer release)   a pool out of device memory (or refused by its quota: orphans only) drops its
 *                    lock, then apc_release_peers takes the C ABI's registry lock to hold its
 *                    device's other pools and releases it, then each of their locks in turn (never
 *                    two pool locks at once), no wait. The default pool's lend from a use_on_oom MemPool
 *                    (apc_lend_from_peers, ap_pool_lend) goes the same way: its lock dropped, each
 *                    lender held and locked in turn, free blocks only (no device call).
 *   orphan           (ap_pool, atomic, no lock) set once by ap_pool_set_orphan, read by the peer release;
 *                    keeps_idle and family (ap_pool_set_mempool, under the lock) too.
 *   ap_device_cap    (device_cap.c) a device's memory fraction over its plain pools: held and limit are
 *                    atomics updated under each member pool's own lock (a compare-and-swap books a
 *                    segment), no lock of their own; caps_lock guards the table of caps and each cap's
 *                    owner, a leaf taken at a pool's join (before its pool lock) and at its destroy's
 *                    leave (no lock held), never under a pool lock.
 *   cfg.roundup_*    (ap_pool.cfg) written under ap_pool.lock (ap_pool_set_tunables), read without it by
 *                    the rounding before the lock is taken: relaxed atomics (pool_internal.h ap_round_request).
 *   spare_lock       (pool.c) the list of destroyed pool structs kept for reuse; held for the list
 *                    operation only, never with a pool lock.
 *   fork_window      (backend/fork.c, rwlock) read-held from the open of a descriptor whose lock
 *                    proves the process alive to its registration for a child's drop (and from its
 *                    unregistration to its close), a system call or two, no lock taken inside; a
 *                    fork's prepare handler takes it exclusively, so no child gets such a
 *                    descriptor unregistered.
 * Never done while holding ap_pool.lock:
 *   - a device or event wait (stream_sync, event_sync, device_sync) or any runtime call that can
 *     block on queued work: waits run in waits.c with the lock dropped (take the work out, wait,
 *     retake the lock, then apply the result only if nothing changed meanwhile); the device-wide
 *     wait of ap_pool_synchronize_device takes no pool lock at all;
 *   - GIL acquisition or any call back into Python.
 * Allowed under the lock: non-blocking runtime calls (malloc/free/map of device memory, event
 * create/record/query/reset/destroy (a new-mode record only under the records bound; the acl backend's check that a stream it made is still
 * its own, when a new stream's device is asked, is one of each), aclrtStreamWaitEvent,
 * aclrtGetMemInfo on the out-of-memory path),
 * the quota hook's reserve, release and terms (no pool calls, no wait: a reserve's give-back of dead
 * processes' shares only takes the ledger's lock when it is free; the wait for it is the hook's
 * settle, which the out-of-memory path calls with the lock dropped).
 * Exception, rare: ap_free_pending waits for a stream when no event can be had at all (the device's
 * event limit reached with every cached event in use), with events of aclrtCreateEventWithFlag only;
 * with new-mode events it never waits there (the block owes the stream, settled later). The C ABI's registry lock is never held
 * over such a free, nor while a pool's lock is waited for: a lookup holds the candidate pools
 * (capi_calls) under the registry lock and asks them, and frees or records on the one found, after
 * it is dropped (capi/registry.h apc_find_hold). Nor is the metrics
 * aggregator's lock, which every pool's close takes, held over a read of a pool (metrics/sample.py).
 */
#ifndef AP_POOL_H
#define AP_POOL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "block.h"
#include "free_tree.h"
#include "history.h"
#include "ptr_map.h"
#include "stats.h"

#define AP_MAX_SIDE_STREAMS 1023 /* distinct streams other than the default one a pool tracks */
/* Slots: 0 ("no stream"), the side streams' and one the default stream (NULL) always finds free:
   with 1,023 side streams taken before its first use it was refused ("too many streams"). */
#define AP_MAX_STREAMS (AP_MAX_SIDE_STREAMS + 2)
#define AP_NO_LIMIT ((size_t)-1)
#define AP_VMM_SPACE_MIN ((size_t)64 << 30) /* smallest address-space reservation (expandable) */
#define AP_VMM_CHUNK_MAX ((size_t)32 << 20)  /* largest physical allocation of a growth up to 512 MiB (expandable.c) */
#define AP_VMM_GROWTH_CHUNKS 16              /* a larger growth maps chunks of 1/16 of it */
#define AP_VMM_CHUNK_SHARE 32                /* ... and in a pool above 1 GiB, chunks of up to 1/32 of reserved */
#define AP_CACHE_BINS 64   /* recent-free cache: bins by hashed size ... */
#define AP_CACHE_DEPTH 4   /* ... of this many blocks each */
#define AP_EXACT_BUCKETS 256 /* small-pool tree blocks counted by hashed (size, stream) (free_cache.h) */
#define AP_EVENT_CACHE_MAX 64 /* idle events kept per device by all of a process's pools (stream_order.c) */

/* The share of a device's event ids (1,023 on Atlas inference cards, else 65,535) that the pools of a
   process keep in new-mode records in flight (stream_order.c): 1/AP_RECORDS_SHARE. */
#define AP_RECORDS_SHARE 2

/* Status codes of pool calls (ap_error.status). */
enum {
    AP_OK = 0,
    AP_E_OOM,            /* device exhausted after trimming, waiting and retrying */
    AP_E_LIMIT,          /* the pool's byte limit (memory fraction or quota) would be exceeded */
    AP_E_INVALID_SIZE,   /* size 0, negative or absurd */
    AP_E_INVALID_PTR,    /* not a live allocation of this pool */
    AP_E_INVALID_STREAM, /* too many streams, or a stream that was destroyed */
    AP_E_DEVICE,         /* the runtime returned an error (device_code) */
    AP_E_TIMEOUT,        /* a device wait passed the configured limit */
    AP_E_HOST_NOMEM,     /* host malloc for bookkeeping failed */
    AP_E_BUSY,           /* fast path only: lock contended or a miss; take the slow path */
    AP_E_QUOTA,          /* the tenant's quota hook refused the growth, even after trimming */
};

typedef struct ap_error {
    int status;
    int device_code;
    char message[768]; /* an out-of-memory message quotes the runtime's cause in full */
} ap_error;

/* Room for the runtime's own message about a failed call (backend error_message), quoted whole. */
#define AP_RUNTIME_MSG 400

/* Writes status, device_code and the message into err (if not NULL); returns status, for
   `return ap_set_error(...)`. Shared with the layers above (the host pool) so that every C error
   reads the same way. */
int ap_set_error(ap_error *err, int status, int device_code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Cross-stream reuse. */
enum {
    AP_REUSE_BORROW = 0, /* a stream with nothing cached borrows other streams' free blocks by
                            waiting on their events on the device (CUDA's stream-ordered pools) */
    AP_REUSE_TIED = 1,   /* a block serves only the stream it was cached for (PyTorch's policy):
                            kept as a baseline for benchmarks */
};

/* Release policies on a miss that needs a new segment. */
enum {
    AP_RELEASE_NEVER = 0,      /* torch_npu: keep every segment until empty_cache/OOM */
    AP_RELEASE_UNDER_PEAK = 1, /* release free segments so that reserved stays under its earlier peak */
    AP_RELEASE_BUDGETED = 2,   /* the same, paid from a device-call budget (classic_policy.c) */
};

#define AP_ROUNDUP_INTERVALS 16

typedef struct ap_config {
    size_t pad_bytes;          /* added to each request before rounding (32 on acl: torch_npu's pad) */
    size_t min_block;          /* rounding granularity, 512 */
    size_t small_size;         /* requests up to this go to the small pool (1 MiB) */
    size_t small_segment;      /* small-pool segment size (2 MiB) */
    size_t page_size;          /* large segments are multiples of this (2 MiB) */
    size_t min_large_segment;  /* smallest large segment (2 MiB; torch uses 20 MiB below 10 MiB) */
    size_t large_segment;      /* the segment medium requests (1-10 MiB) share: torch's large_segment_size_mb
                                  (kLargeBuffer, 20 MiB) */
    size_t large_split_min;    /* split a large block only if the rest is at least this */
    size_t max_split_size;     /* blocks this big or bigger are never split (AP_NO_LIMIT: off) */
    double gc_threshold;       /* 0: off; else release idle segments above this fraction of the limit */
    size_t limit_bytes;        /* reserved bytes may not exceed this (AP_NO_LIMIT: device only) */
    size_t reserve_bytes;      /* preallocated at creation, kept until empty_cache */
    size_t history_capacity;   /* trace ring entries (0: off) */
    int release_policy;
    int expandable;            /* segments grow in place in reserved address space (VMM) */
    int stream_reuse;          /* AP_REUSE_BORROW or AP_REUSE_TIED */
    int sync_timeout_ms;       /* bound on every host wait for the device (-1: forever) */
    /* PyTorch's roundup_power2_divisions: divisions per power-of-two interval of the request
       size, interval i = [2^i MiB, 2^(i+1) MiB) (sizes under 1 MiB use interval 0, the last one
       everything above); 0 or 1: plain min_block rounding. roundup_power2: any entry above 1. */
    unsigned roundup_divisions[AP_ROUNDUP_INTERVALS];
    int roundup_power2;
} ap_config;

void ap_config_default(ap_config *c);

/* A tenant's quota, asked before every device allocation of a segment and told of every release.
 * reserve() returns 0 when the bytes are granted (e.g. booked in a node-wide ledger), else nonzero
 * and a reason in why. Called under the pool lock: must not call back into the pool. */
typedef struct ap_quota_hook {
    void *ctx;
    int (*reserve)(void *ctx, int device, size_t bytes, char *why, size_t why_len);
    void (*release)(void *ctx, int device, size_t bytes);
    /* The tenant's quota and what it holds node-wide now (a lock-free read; another process may
       book the difference first); quota SIZE_MAX without one. NULL: unknown (no room assumed). */
    void (*terms)(void *ctx, int device, size_t *quota, size_t *held);
    /* After a refusal, with no pool lock held: gives back what dead processes of the tenant still
       hold where reserve() could not without waiting (another process held the ledger's lock).
       Nonzero when it gave some back (the pool then asks once more). NULL: nothing to do. */
    int (*settle)(void *ctx, int device);
} ap_quota_hook;

/* Expandable segments: physical memory mapped into reserved address space. A segment is a run
 * of contiguous mapped chunks; growing maps a chunk after a segment's last block (or into a hole,
 * joining segments); shrinking unmaps a free chunk (splitting its segment). */
typedef struct ap_vmm_chunk {
    uintptr_t va;
    size_t size;
    void *handle;               /* the runtime's physical allocation, mapped at va */
    struct ap_segment *seg;
    struct ap_vmm_chunk *prev, *next; /* address order in its space */
} ap_vmm_chunk;

typedef struct ap_vmm_space {
    uintptr_t base;
    size_t size;
    int pool;                   /* AP_POOL_SMALL or AP_POOL_LARGE: one kind per space */
    ap_vmm_chunk *chunks;       /* address order */
    struct ap_vmm_space *next;
} ap_vmm_space;

typedef struct ap_stream_slot {
    void *stream;         /* runtime handle (NULL = default stream) */
    int live;             /* 0 once retired (destroyed through the pool, or unusable): no work is
                             ordered on it any more and frees tagged with it go to slot 0 */
    uint32_t epoch;       /* bumped whenever a block enters its trees: a wait outside the lock
                             retags them only if none entered meanwhile (waits.c) */
    ap_free_tree trees[2]; /* free blocks whose last use was ordered on this stream */
    int stranded;          /* new-mode records on it whose event was reused on another stream:
                              counted until a later record on it is seen complete (stream_order.c) */
    uint64_t stranded_seq; /* the latest of them (ap_pool.record_seq) */
    uint32_t gen;          /* bumped each time the slot is given a stream (ap_event_key) */
    void *gate;            /* the last pass over the pending frees (ap_process_pending): the
                              oldest of their events on this stream found not complete, or NULL */
} ap_stream_slot;

typedef struct ap_pool {
    pthread_mutex_t lock;
    ap_backend *backend;
    int holds_device;            /* took a device reference (backend->device_retain) to give back at destroy */
    int device;
    ap_config cfg;

    ap_stream_slot *slots; /* slots[0]: blocks no queued work can touch ("any stream") */
    int n_slots;
    int slots_cap;
    int last_slot;        /* lookup cache */

    ap_ptr_map live;      /* allocated and pending blocks by address */
    ap_segment *segments; /* all segments */
    size_t n_segments;
    uint64_t segment_seq;  /* creation counter for ap_segment.seq */
    size_t n_free_segments;  /* segments that are one free block (release candidates) */
    size_t reserved_watermark; /* highest reserved so far (release policy; not reset by reset_peak) */
    uint64_t tick;

    ap_vmm_space *spaces;      /* expandable mode: reserved address ranges */
    size_t vmm_granularity;
    ap_vmm_chunk *vmm_spares;  /* unmapped by the release policy for the growth that follows */
    int64_t vmm_credit;        /* release policy (vmm_policy.c): calls it may spend, in 1/1000 call */
    uint64_t vmm_credit_tick;  /* p->tick when the credit was last topped up */
    int64_t vmm_live_high;     /* highest allocated bytes the policy has seen */
    int64_t trade_credit;      /* classic release policy (classic_policy.c): calls it may spend, in 1/1000 call */
    uint64_t trade_tick;       /* p->tick when the credit was last topped up */
    int64_t vmm_growth_credit; /* growth policy (vmm_policy.c): calls exact growths may spend, in 1/1000 call */
    uint64_t vmm_growth_tick;  /* p->tick when the growth credit was last topped up */
    size_t vmm_refill_step;    /* bytes growths under the peak mapped since the last growth to a new peak */

    ap_block *pending_head, *pending_tail; /* frees waiting on events, oldest first */
    int pending_gated;     /* every pending free up to pending_checked waits for an event recorded
                              on a stream no earlier than that stream's gate (slots' gate): while
                              each gate is not complete, none of them is (stream_order.c
                              ap_process_pending); the frees after it came since */
    ap_block *pending_checked;
    uint64_t gate_drops;   /* times the gates were dropped (stream_order.c gates_drop): a pass
                              that saw one ends ungated */
    void **event_cache;   /* idle events for reuse (at most event_cache_max; more are destroyed) */
    int n_cached_events, event_cache_cap;
    int event_cache_max;  /* bound below the device's event limit (stream_order.c) */
    int event_pins;       /* waits outside the lock hold event handles: destroy none meanwhile */
    struct ap_parked_event *parked; /* waited-on events whose reset has not run yet (stream_order.c) */
    int n_parked, parked_cap;
    int records_out;      /* new-mode records this pool made, not known complete (stream_order.c) */
    int records_carry;    /* records still out of the parked event ap_event_get just gave back */
    uint64_t record_seq;  /* numbers this pool's new-mode records, the latest last */
    uint64_t reclaim_tick; /* tick + 1 of the last reclaim that left the records bound reached */
    int reclaim_out;      /* records_out then */
    int vmm_trade_high;   /* vmm_spares were unmapped at a new high of live bytes (vmm_policy.c; expandable.c
                             maps them all); here, in padding, so that no field moves */
    int64_t live_events;  /* events this pool created and has not destroyed */

    void *spare_blocks;       /* recycled structs, linked through their first word (block_arena.c) */
    void *spare_uses;
    void *spare_segments;
    void **chunks;            /* host memory for block structs, freed at destroy */
    size_t n_chunks, chunks_cap;

    uint64_t cache_key[AP_CACHE_BINS][AP_CACHE_DEPTH]; /* size and stream of each cached block, so a
                                                          lookup reads no block struct */
    ap_block *cache[AP_CACHE_BINS][AP_CACHE_DEPTH]; /* recently freed blocks (free_cache.h) */
    uint8_t cache_n[AP_CACHE_BINS];
    int n_cached;
    uint32_t small_exact[AP_EXACT_BUCKETS]; /* small-pool tree blocks by ap_exact_bucket(size, tag) */

    ap_stats stats;
    ap_history history;
    ap_quota_hook quota;  /* reserve == NULL: no quota */
    /* Classic release policy, growth path only (kept after the cached path's fields so that they
       do not move): highest allocated bytes seen per pool (torch_npu's floor) and the calls it
       may spend to stay under that floor, in 1/1000 call (classic_policy.c). */
    size_t npu_floor[2];
    int64_t protect_credit;
    size_t trade_room; /* bytes under the watermark a trade left, whose refills the trade credit pays */
    _Atomic int orphan; /* its Python object is gone, blocks of it are still allocated (ap_pool_set_orphan) */
    struct ap_device_cap *device_cap; /* the device's memory fraction this pool counts under (device_cap.c);
                                         written under the lock, read by the peer release with relaxed atomics */
    /* torch's MemPool arguments (ap_pool_set_mempool): keeps_idle, a MemPool made without
       use_on_oom: its idle cache is its own, not given back for another pool's out-of-memory (read
       by the peer release without the lock); no_split: an allocation takes its block whole. */
    _Atomic int keeps_idle;
    int no_split;
    /* a MemPool made with use_on_oom (ap_pool_set_mempool): the default pool's request that the
       device (or its memory fraction) refuses takes a free block of it in place (ap_pool_lend), as
       torch's use_on_oom_pools; read by the peer release and lend without the lock */
    _Atomic int lends;
    /* the last AP_E_LIMIT refusal of a growth came from the device's memory fraction
       (ap_device_cap_book: 1), not from the pool's own limit (0): only the fraction's lets the
       other pools' idle cache make room (malloc's peer release). Under the lock. */
    int cap_refused;
    /* the plain pool a tenant context was made from (pool.context()), or the pool itself: one
       allocator to its user, so a family member's out-of-memory takes the others' idle cache even
       when they keep it from other pools (ap_pool_set_mempool; 0: none) */
    _Atomic uint64_t family;
    /* The backend's runtime life (ap_backend_life) of this pool's memory, checked off the hot path
       (ap_pool_runtime_check). Blocks that were allocated when the runtime released the memory
       behind the pool are written off (lost_live, by address; lazily made): their frees are
       accepted, nothing of them is reused or freed. lost_*: what the pool forgot, for stats. */
    uint64_t life;
    ap_ptr_map lost_live;
    uint64_t lost_segments, lost_bytes, lost_blocks;

    /* Past this point nothing is zeroed when the struct is reused (ap_pool_create). */
    struct ap_pool *spare_next; /* in the spare list: destroyed structs are kept for reuse, never freed */
    /* C ABI calls holding this pool (ap_pool_hold): a destroy waits for them. Atomic and outside
       the zeroed part, since a thread that read the pointer just before a close may still add and
       take back one after the destroy, even once the struct serves another pool. */
    _Atomic int capi_calls;
} ap_pool;

/* Creates a pool on device. Preallocates cfg->reserve_bytes. NULL on failure (err says why). */
ap_pool *ap_pool_create(ap_backend *backend, int device, const ap_config *cfg, ap_error *err);
/* Releases every segment (even ones with live blocks: the owner is going away) and the pool. */
void ap_pool_destroy(ap_pool *p);
/* ap_pool_destroy, or (wait_streams 0) without waiting for its streams: for the pools the
   interpreter's teardown destroys (the process is going, its runtime context with it; each pool
   waiting sync_timeout_ms on a hung stream, a collective whose peer died, in turn added that much
   to the exit). A close() the program makes, at exit too, waits. */
void ap_pool_destroy_ex(ap_pool *p, int wait_streams);
/* Waits until no C ABI call holds p (ap_pool_hold, current.h); p must be hidden already. */
void ap_pool_wait_holders(ap_pool *p);

/* What an out-of-memory observer is told besides the request (torch's observers): the bytes the
   pool may reserve (its cap, else the device's total) and the device's free bytes now. */
void ap_pool_oom_figures(ap_pool *p, size_t *allowed, size_t *free_b);

/* Allocates size bytes ordered on stream. */
int ap_pool_malloc(ap_pool *p, size_t size, void *stream, void **out, ap_error *err);
/* How ap_pool_free orders a free: */
enum {
    AP_FREE_ON_STREAM = 0,       /* on `stream`; one the pool cannot order on is an error, nothing freed */
    AP_FREE_ON_ALLOC_STREAM = 1, /* on the stream the block was allocated on (`stream` unused) */
    AP_FREE_ON_STREAM_ELSE_ALLOC /* on `stream`, else on the allocation stream with the error set: for
                                    callers that cannot retry (the C ABI's void free must not leak) */
};
/* Frees ptr, ordered as `how` says (AP_FREE_*). */
int ap_pool_free(ap_pool *p, void *ptr, void *stream, int how, ap_error *err);
/* Cached path only, for callers holding the GIL: never blocks on the lock, never calls the
   device. Returns AP_E_BUSY when the slow path is needed. */
int ap_pool_try_malloc(ap_pool *p, size_t size, void *stream, void **out);
int ap_pool_try_free(ap_pool *p, void *ptr);
/* Marks ptr as used by stream: it is not reused until that stream's work queued before the free
   has completed. */
int ap_pool_record_stream(ap_pool *p, void *ptr, void *stream, ap_error *err);
/* The same, but AP_E_NOT_HERE (err untouched) when ptr is not a live or pending block of p: the C
   ABI asks pools in turn, and the message's search of p's segments is for the owner only. */
#define AP_E_NOT_HERE (-1)
int ap_pool_record_stream_if_own(ap_pool *p, void *ptr, void *stream, ap_error *err);
/* torch_npu's eraseStream: undoes record_stream(ptr, stream) on the live block ptr (no-op for a
   stream it was not marked with); the _if_own form as record_stream's. */
int ap_pool_erase_stream(ap_pool *p, void *ptr, void *stream, ap_error *err);
int ap_pool_erase_stream_if_own(ap_pool *p, void *ptr, void *stream, ap_error *err);
/* Returns every unused segment to the device (waits for pending frees first). */
int ap_pool_empty_cache(ap_pool *p, ap_error *err);
/* CuPy's free_all_blocks(stream): waits for stream's work, then returns the unused classic
   segments its allocations created (expandable segments: every stream's unused pages, one
   address space). A stream the pool never saw has none. */
int ap_pool_empty_stream(ap_pool *p, void *stream, ap_error *err);
/* Waits for the work queued on stream, then lets its cached blocks serve every stream. */
int ap_pool_synchronize(ap_pool *p, void *stream, ap_error *err);
/* torch.npu.synchronize(): waits (sync_timeout_ms) for all work of the pool's device where
   device_wait and the runtime can (every stream of the process there), then for every stream the
   pool knows and its pending frees' events, settling what completed. */
int ap_pool_synchronize_device(ap_pool *p, int device_wait, ap_error *err);
/* Forgets a stream that is about to be destroyed: waits for it and returns its blocks to all. */
int ap_pool_release_stream(ap_pool *p, void *stream, ap_error *err);
/* Forgets a stream the runtime said is gone (its handle named a stream of another device): its
   cached blocks serve every stream, as for a stream destroyed behind the pool's back. Asked again
   under the lock (no wait): the answer was had before, and the runtime may since have given the
   handle to a new stream of this device, whose slot stays. */
void ap_pool_forget_stream(ap_pool *p, void *stream);
/* 1 when stream has no work queued (an event recorded on it now is complete), 0 when it has or
   no event can be had, -1 when the runtime does not know the stream. Never waits. */
int ap_pool_stream_idle(ap_pool *p, void *stream);
/* Installs (or with NULL removes) the tenant quota hook. Segments already held stay booked by the
   caller's own accounting; the hook sees only later reserves and releases. */
void ap_pool_set_quota_hook(ap_pool *p, const ap_quota_hook *hook);
/* Releases every cached free segment no stream's queued work holds, without waiting (never live
   blocks, nor the preallocated reserve). Returns the bytes released. For a peer pool's
   out-of-memory path (ap_set_peer_release_hook). */
size_t ap_pool_release_idle(ap_pool *p);
/* Blocks allocated, or freed and waiting for a stream's work (active.all.current), read under the
   lock with no runtime call (ap_pool_get_stats asks the device's free memory): the registry asks
   it of every dropped pool at each reap. */
int64_t ap_pool_active_blocks(ap_pool *p);
/* 1 while work queued on a stream may still touch the pool's free memory (frees pending on
   events, free blocks tagged with a stream not idle yet), after settling what is done. Asks the
   runtime, never waits: a close then has nothing to wait for. */
int ap_pool_work_queued(ap_pool *p);
/* 1 when the pool has a live slot for `stream` (its Python API or the C ABI ordered work on it). */
int ap_pool_knows_stream(ap_pool *p, void *stream);
/* Marks a pool whose owner dropped it while blocks of it are still allocated (ascend_pool.registry's
   orphans): nothing allocates from it again, so a tenant refused by its quota takes back its idle
   cache (ap_set_peer_release_hook's orphans_only). */
void ap_pool_set_orphan(ap_pool *p);
/* torch's MemPool(use_on_oom=, no_split=) for a plain pool other than a default, and p's family
   (see ap_pool.family), set once as the pool is opened (takes the lock): keeps_idle (not
   use_on_oom) keeps its idle cache from the other pools' out-of-memory path, as torch's lends a
   MemPool's free blocks only when use_on_oom; lends (use_on_oom): the default pool's refused
   request takes a free block of it in place (ap_pool_lend); no_split: blocks are never split;
   family: a plain pool's own serial number, or for a tenant context made by pool.context() that
   pool's (the context: keeps_idle 0, lends 0, no_split 0: its blocks are its quota's). */
void ap_pool_set_mempool(ap_pool *p, int keeps_idle, int lends, int no_split, uint64_t family);
/* What the peer release gives back (ap_set_peer_release_hook's mode): */
enum {
    AP_PEERS_ALL = 0,     /* the device is full: every other pool's idle cache, but a MemPool's that keeps it */
    AP_PEERS_ORPHANS = 1, /* a quota refused: the orphans' only */
    AP_PEERS_CAP = 2,     /* the device's memory fraction refused: its other members' (the same exceptions) */
    AP_PEERS_NO_LENDERS = 4,   /* flag: ... but not the use_on_oom MemPools' (they lend in place first) */
    AP_PEERS_ONLY_LENDERS = 8, /* flag: ... the use_on_oom MemPools' only (lending found no block) */
};
/* torch's use_on_oom for the default pool p (not a MemPool, nor a tenant context): 1 when a request
   the device or the memory fraction refused may take a free block of a use_on_oom MemPool. */
static inline int ap_pool_borrows(const ap_pool *p) {
    return p->device_cap && !atomic_load(&p->keeps_idle) && !atomic_load(&p->lends);
}
/* Allocates size bytes on stream from q's free blocks only (no growth, no device call, q's lock
   taken): the block stays q's (its stats, its free). AP_OK with *out, else nonzero. */
int ap_pool_lend(ap_pool *q, size_t size, void *stream, void **out);
/* Stops q lending (ap_pool_lend refuses from now on, under q's lock) and returns how many blocks
   it lent are still allocated (*bytes: their sizes): its close keeps them valid until they are freed. */
int64_t ap_pool_stop_lending(ap_pool *q, int64_t *bytes);
/* Frees, each on its allocation stream, q's allocated blocks that were not lent (what its own user
   left allocated at a close that keeps the lent ones). Blocks freed (*bytes: their sizes), -1 when
   host memory ran out. */
int64_t ap_pool_free_unlent(ap_pool *q, int64_t *bytes);
/* hook(self, size, stream): the address of a block a use_on_oom MemPool of self's device and
   backend lent (ap_pool_lend), NULL when none could; called with no lock held. NULL: none. */
void ap_set_peer_lend_hook(void *(*hook)(ap_pool *self, size_t size, void *stream));
/* hook(self, mode): releases the idle cache of the process's other pools of self's device
   and backend (the C ABI's registry knows them; which ones: mode),
   returns the bytes released. A device allocation that fails calls it once, with no lock held,
   then retries: the default pool's idle cache no longer stands in the way of a tenant context on
   the same device (PyTorch: a MemPool's allocation reclaims the default pool's cached blocks). A
   quota refusal calls it for the orphans only (their cache is booked in the tenant's ledger, and
   nothing allocates from it). NULL: none. */
void ap_set_peer_release_hook(size_t (*hook)(ap_pool *self, int mode));
/* Releases cached free segments until reserved <= target bytes (never live blocks). Returns
   the bytes released. Used when a quota is lowered. */
size_t ap_pool_trim_to(ap_pool *p, size_t target);
/* torch's memory fraction caps the device's allocator as a whole, its MemPools included: the
 * default pool (the cap's owner, whose limit it is) and every other plain pool of the device
 * (ascend_pool.Pool; not tenant contexts, which have their own caps) book the bytes they hold
 * from the device here, lock-free, before the device call, and unbook them when they go back
 * (device_cap.c). held is the sum of the members' reserved bytes. */
typedef struct ap_device_cap {
    _Atomic size_t held;
    _Atomic size_t limit; /* the owner's limit_bytes; AP_NO_LIMIT: none (no owner, or no cap) */
    struct ap_pool *owner; /* whose limit it is: set and cleared under caps_lock, read atomically */
} ap_device_cap;
/* Makes p count under its device's cap (owner: p's limit is the cap). Idempotent. 0, or -1 when
   the table of caps is full (p then counts under none). Takes p's lock. */
int ap_pool_join_device_cap(ap_pool *p, int owner);
/* Books bytes under p's device cap before a device allocation: AP_OK, or AP_E_LIMIT (err says
   so) when the device's pools together would pass it. Under p's lock. */
int ap_device_cap_book(ap_pool *p, size_t bytes, ap_error *err);
/* Bytes p may still book under its device's cap (SIZE_MAX: no cap, or no fraction set): the
   placement's limit rules (exact sizes near it, no overshoot) go by it as by p's own limit. */
size_t ap_device_cap_room(const ap_pool *p);
/* p's new limit_bytes is its cap's limit too when p is the cap's owner. Under p's lock. */
void ap_device_cap_set_limit(ap_pool *p, size_t limit_bytes);
/* Gives back bytes booked with ap_device_cap_book. Under p's lock. */
void ap_device_cap_unbook(ap_pool *p, size_t bytes);
/* p leaves its cap, with all it holds (ap_pool_destroy_ex: its segments go back without a
   release each); the cap's limit goes with it only while p is still the cap's owner. */
void ap_device_cap_leave(ap_pool *p);

/* Changes the byte limit; a lower limit trims cache, never live blocks. */
/* PyTorch's tunables that _set_allocator_settings changes at runtime: max_split_size (bytes,
   AP_NO_LIMIT: off), gc_threshold (0: off) and the AP_ROUNDUP_INTERVALS roundup divisions (0 or
   1: none), for the calls that follow. */
void ap_pool_set_tunables(ap_pool *p, size_t max_split_size, double gc_threshold, const unsigned *divisions);
void ap_pool_set_limit(ap_pool *p, size_t limit_bytes);
/* The cap ap_pool_set_limit (or the memory_fraction hook) set last: bytes, AP_NO_LIMIT for none. */
size_t ap_pool_get_limit(ap_pool *p);
/* Copies the counters (with fragmentation figures and device memory) under the lock. */
void ap_pool_get_stats(ap_pool *p, ap_stats *out);
/* The same, waiting at most wait_ms for the pool's lock, which a free may hold over a stream wait
   (no event to be had): a reader that must not wait that long (the stats publisher, whose cycle a
   fork waits for) is told -1 instead; 0 when read. */
int ap_pool_get_stats_within(ap_pool *p, ap_stats *out, int wait_ms);
void ap_pool_reset_peaks(ap_pool *p);
/* Checks the pool's invariants (check.c): free-tree order and sizes, block adjacency, stats equal
   to a recount, cache and pending lists. 0 when all hold, else -1 with the violation in msg. */
int ap_pool_check(ap_pool *p, char *msg, size_t len);
/* Test hook: holds the pool mutex for `seconds` (tests prove waiters never hold the GIL). */
void ap_pool_hold_lock(ap_pool *p, double seconds);
/* Looks up a live block: its base, size and requested bytes. 0 if ptr is inside one. */
int ap_pool_block_info(ap_pool *p, void *ptr, uintptr_t *base, size_t *size, size_t *requested);
/* 1 when ptr starts a block the pool wrote off when the runtime released its memory (lost_live:
   its free and record_stream are accepted), else 0. For the C ABI's search of the pool that owns
   a pointer (capi/registry.h), which block_info alone does not find. */
int ap_pool_wrote_off(ap_pool *p, void *ptr);
int ap_pool_block_ctx(ap_pool *p, void *ptr, uint64_t *ctx);
/* 1 when ptr lies in one of the pool's expandable (virtual-memory) segments, 0 when in another of
   its segments, -1 when in none. */
int ap_pool_segment_expandable(ap_pool *p, void *ptr);
/* Bytes a request of size really occupies (rounding and padding). */
size_t ap_pool_round_size(const ap_pool *p, size_t size);

/* Snapshot: flat arrays of segments and blocks, malloc()ed; free with ap_snapshot_free. */
typedef struct ap_snap_block {
    uintptr_t addr;
    size_t size, requested;
    int state;
    uint64_t ctx; /* an allocated (or pending-free) block's frames context id (history.h), else 0 */
} ap_snap_block;

typedef struct ap_snap_segment {
    uintptr_t base;
    size_t size;
    int pool;
    int expandable;
    void *stream;
    uint64_t ctx; /* frames context id of the allocation that created it (0: none) */
    size_t first_block, n_blocks; /* range in the blocks array */
} ap_snap_segment;

typedef struct ap_snapshot {
    ap_snap_segment *segments;
    size_t n_segments;
    ap_snap_block *blocks;
    size_t n_blocks;
    ap_history_entry *history;
    size_t n_history;
} ap_snapshot;

int ap_pool_snapshot(ap_pool *p, ap_snapshot *out);
void ap_snapshot_free(ap_snapshot *s);
/* A copy of the history ring, oldest first (*out: malloc'ed, NULL when empty), adding nothing to it. */
size_t ap_pool_history_copy(ap_pool *p, ap_history_entry **out);
/* Free blocks as a snapshot shows them (a cached block counts as one), under the lock. */
size_t ap_pool_count_free_blocks(ap_pool *p);
/* Turns the event history on with room for `capacity` entries (0: off), at any time; a new
   capacity starts an empty ring; skip: actions not recorded, bit (1 << AP_ACT_...) each.
   AP_E_HOST_NOMEM if the ring cannot be allocated. */
int ap_pool_set_history(ap_pool *p, size_t capacity, uint32_t skip);

/* Clears a pool pointer that other threads read without the GIL (PoolBase.p: the C ABI's
   registry loads it with acquire, capi/registry.h): a release store, not a plain one. */
static inline void ap_pool_ptr_clear(ap_pool **slot) { __atomic_store_n(slot, (ap_pool *)0, __ATOMIC_RELEASE); }

/* The runtime released this pool's device memory behind it (the backend's life changed:
   aclFinalize, or resets that took the pools' device references): the cache and pending frees of
   that memory are forgotten with no runtime call, blocks still allocated of it written off (their
   frees accepted). Called with the lock held (or by the destroy) before device calls, never on
   the cached path; `probe`: the backend first enters the device's context, which finds a
   finalised runtime or a released context (no device work). 1 when something was forgotten,
   said once on stderr per device and life. */
int ap_pool_runtime_check(ap_pool *p, int probe);

#endif

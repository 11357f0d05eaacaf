/* Blocks and segments: the pool's view of device memory.
 *
 * A segment is one device allocation (aclrtMalloc). It is carved into blocks that tile it exactly,
 * in address order (prev/next). A block is allocated (handed to a user), pending (freed, but
 * another stream's work recorded with record_stream may still use it), or free (in a free tree).
 */
#ifndef AP_BLOCK_H
#define AP_BLOCK_H

#include <stddef.h>
#include <stdint.h>

#define AP_MAX_USES 64 /* extra streams one block's uses hold inline (record_stream); past it the uses
                          grow on the heap (ap_uses_grow), up to every stream slot of the pool: torch's
                          record_stream has no limit (PyTorch keeps a set), and the C ABI's void hook
                          could only drop a refused use (the block reused under that stream's work) */

#define AP_MAX_FOREIGN 8 /* streams of other devices one block's uses hold inline (record_stream); past
                          it they grow on the heap as the uses do (ap_uses_grow), up to
                          AP_FOREIGN_LIMIT: torch's record_stream has no limit, and the C ABI's void
                          hook could only drop a refused use (the block reused under the peer's work) */
#define AP_FOREIGN_LIMIT 32768 /* the most: every count below stays within uint16_t */

/* CACHED: free, parked in the recent-free cache (free_cache.c), not yet merged or in a tree. */
enum { AP_BLOCK_FREE = 0, AP_BLOCK_ALLOCATED = 1, AP_BLOCK_PENDING = 2, AP_BLOCK_MOVING = 3, AP_BLOCK_CACHED = 4 };
enum { AP_POOL_SMALL = 0, AP_POOL_LARGE = 1 };

struct ap_segment;

/* Streams that used a block (record_stream) and, once it is freed, the events it waits on.
 * Kept apart from the block so that the common block stays small and cheap to recycle.
 * The arrays point at the inline ones (cap == AP_MAX_USES, fcap == AP_MAX_FOREIGN), or, past that
 * many streams of its device or of others, at one heap allocation holding them all (ap_uses_grow,
 * freed by ap_uses_recycle): cap uses, fcap foreign streams (and their devices and events), and
 * cap + fcap + 1 events or owed streams (every use, the free's own stream, and each foreign
 * stream's owed wait). */
typedef struct ap_block_uses {
    uint16_t n_uses;
    uint16_t cap;       /* uses the arrays below hold: AP_MAX_USES (inline) or more (grown) */
    uint16_t n_events;
    uint16_t n_owed;
    uint16_t n_foreign;
    uint16_t fcap;      /* foreign streams they hold: AP_MAX_FOREIGN (inline) or more (grown) */
    uint16_t n_fevents;
    uint16_t *uses;     /* extra stream slots */
    void **events;      /* pending: events still to complete (an owed stream's becomes one: owed_done) */
    uint32_t *event_keys; /* pending: for each event, the stream it was recorded on at the free
                             (ap_event_key: slot and the slot's stream generation), 0 when none
                             (an owed stream's, recorded later) */
    void **owed;        /* pending: streams still to wait for (no event could be had, and the wait
                           at the free failed or timed out) */
    /* Streams of other devices that used it (record_stream, as torch allows: a peer's kernel
       reading it): no slot of this pool, so each gets, at the free, an event of its own device
       (fevents), destroyed once complete, never cached here. While the block is pending,
       foreign/foreign_device hold the streams of the fevents first (index for index), then the
       n_foreign streams still owed one (stream_order.c foreign_owed_done). */
    void **foreign;
    int16_t *foreign_device;
    void **fevents;
    uint16_t uses_in[AP_MAX_USES];
    int16_t foreign_device_in[AP_MAX_FOREIGN];
    void *events_in[AP_MAX_USES + AP_MAX_FOREIGN + 1];
    uint32_t event_keys_in[AP_MAX_USES + AP_MAX_FOREIGN + 1];
    void *owed_in[AP_MAX_USES + AP_MAX_FOREIGN + 1];
    void *foreign_in[AP_MAX_FOREIGN];
    void *fevents_in[AP_MAX_FOREIGN];
} ap_block_uses;

typedef struct ap_block {
    uintptr_t addr;
    size_t size;      /* bytes the block covers (a multiple of 512) */
    size_t requested; /* bytes the user asked for, while allocated */
    struct ap_segment *seg;
    struct ap_block *prev, *next;   /* address neighbours inside the segment */
    struct ap_block *left, *right;  /* free-tree links */
    uint32_t prio;                  /* free-tree (treap) heap priority */
    uint64_t order;                 /* tie-break among equal sizes: its segment's seq, then the address */
    uint64_t free_tick;             /* pool tick when it last became (or grew as) a free block */
    uint8_t state;
    uint8_t counted_split;          /* counted in inactive_split stats while free */
    uint16_t tag;      /* free: stream slot whose queued work may still use it (0 = none);
                          allocated: the allocation stream's slot */
    ap_block_uses *xs; /* NULL unless record_stream marked it */
    uint64_t ctx;      /* allocated: its allocation's frames context id (history.h; 0 when none
                          was recorded; pool_internal.h: ap_history_note_alloc);
                          AP_CTX_LENT set: a use_on_oom MemPool lent it to another pool's request
                          (ap_pool_lend), kept in a word every allocation writes anyway so that
                          the hot path pays nothing to clear it; ap_block_frames reads the id) */
    struct ap_block *pending_next;
} ap_block;

#define AP_CTX_LENT (1ULL << 63) /* in ap_block.ctx: frames context ids count up from 1, never this high */

/* The frames context id of an allocated (or pending) block, without the lent flag. */
static inline uint64_t ap_block_frames(const ap_block *b) { return b->ctx & ~AP_CTX_LENT; }

typedef struct ap_segment {
    uintptr_t base;
    size_t size;
    int pool;                 /* AP_POOL_SMALL or AP_POOL_LARGE */
    int pinned;               /* the preallocated reserve: never released by automatic policies */
    int shared;               /* share.c's segment of one shared block, outside the live map; 2: written off (share.h) */
    int expandable;           /* a run of mapped chunks in reserved address space */
    int oversize;             /* counted in oversize_segments (ap_segment_sized) */
    uint16_t alloc_slot;      /* stream slot of the allocation that created it (for snapshots) */
    uint16_t freed_slot;      /* ap_pool_empty_stream: the stream slot whose free_all_blocks(stream)
                                 takes it after its wait, its block freed there (0: none) */
    uint64_t ctx;             /* frames context id of that allocation (history.h; 0: none): the
                                 segment's frames in snapshots, as torch's, until an allocation
                                 splits its first block (torch's then stay on the split-off rest) */
    uint64_t last_use;        /* pool tick of the last allocation from it (garbage collection) */
    uint64_t free_since;      /* pool tick when it last became wholly free (garbage_collection_threshold's
                                 age, as PyTorch's: since the last free, not the oldest part's) */
    uint64_t seq;             /* creation order in its pool */
    uint64_t life;            /* classic: the backend's runtime life it was allocated in (ap_backend_life) */
    struct ap_block *first;
    struct ap_segment *prev, *next; /* the pool's list of segments */
} ap_segment;

/* The best-fit order among free blocks of equal size: segment age, then offset (free_tree.h);
   1 when a comes first. Compared as a pair: packed in one word (seq << 40 | offset), the segment
   counter wrapped after 2^24 segments (a long run's growths and releases, expandable splits), and
   from then on each new segment ranked older than every earlier one: best fit packed allocations
   into the newest segments and left the old ones free, and a new segment's blocks tied with an
   old one's at the same offset (whichever went into the tree first came first). */
static inline int ap_block_before(const ap_block *a, const ap_block *b) {
    return a->seg->seq != b->seg->seq ? a->seg->seq < b->seg->seq : a->addr < b->addr;
}

/* Block list adjacency: b's address neighbours link back to it and tile its segment without a gap
   or an overlap. Holds between operations (asserted after splits and merges). */
static inline int ap_block_links_ok(const ap_block *b) {
    return (!b->prev || (b->prev->next == b && b->prev->seg == b->seg && b->prev->addr + b->prev->size == b->addr)) &&
           (!b->next || (b->next->prev == b && b->next->seg == b->seg && b->addr + b->size == b->next->addr));
}

static inline int ap_segment_is_free(const ap_segment *s) {
    return s->first->next == NULL && s->first->state == AP_BLOCK_FREE;
}

#endif

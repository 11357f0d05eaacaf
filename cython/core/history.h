/* A bounded ring of allocator events for snapshots (PyTorch's device_traces). Off unless the
 * record_history knob or record_memory_history() gives it a capacity; when off the hot path pays
 * one predictable branch.
 *
 * Python stacks: the caller captures its frames before taking the pool lock (no GIL work under
 * it), files them under a context id and sets that id for its thread (ap_history_set_ctx); each
 * entry recorded on the thread carries the id, which the snapshot maps back to the frames.
 *
 * User metadata (torch's _set_memory_metadata): Python files each string under an id and sets it
 * process-wide (ap_history_set_meta); every entry recorded afterwards carries it. */
#ifndef AP_HISTORY_H
#define AP_HISTORY_H

#include <stddef.h>
#include <stdint.h>

enum {
    AP_ACT_ALLOC = 0,
    AP_ACT_FREE_REQUESTED,
    AP_ACT_FREE_COMPLETED,
    AP_ACT_SEGMENT_ALLOC,
    AP_ACT_SEGMENT_FREE,
    AP_ACT_OOM,
    AP_ACT_SNAPSHOT,
    AP_ACT_SEGMENT_MAP,
    AP_ACT_SEGMENT_UNMAP,
};

typedef struct ap_history_entry {
    uint8_t action;
    uint32_t meta; /* the user-metadata id current when recorded (0: none), see above */
    uintptr_t addr;
    size_t size;
    void *stream;
    int64_t time_us;
    uint64_t ctx;  /* the recording thread's context id (0: none), see above */
} ap_history_entry;

typedef struct ap_history {
    ap_history_entry *ring;
    size_t capacity;
    size_t next;  /* total entries ever written; ring index = next % capacity */
    uint32_t skip; /* bit (1 << action) set: that action is not recorded (torch's skip_actions) */
} ap_history;

extern __thread uint64_t ap_history_tls_ctx;
/* Sets the user-metadata id that every pool's entries carry from now on (0: none). */
void ap_history_set_meta(uint32_t meta);
/* Sets the calling thread's context id for the entries it records next (0: none). */
void ap_history_set_ctx(uint64_t ctx);

int ap_history_init(ap_history *h, size_t capacity);
void ap_history_destroy(ap_history *h);
/* Copies src's most recent entries, as many as dst holds, into the empty ring dst, oldest first. */
void ap_history_keep_recent(ap_history *dst, const ap_history *src);
void ap_history_record(ap_history *h, int action, uintptr_t addr, size_t size, void *stream);
void ap_history_record_ctx(ap_history *h, int action, uintptr_t addr, size_t size, void *stream, uint64_t ctx);
/* Inline so that the hot path pays one branch when history is off. */
static inline void ap_history_add(ap_history *h, int action, uintptr_t addr, size_t size, void *stream) {
    if (h->capacity) ap_history_record(h, action, addr, size, stream);
}
/* A free's entry: the freeing call's frames when its thread filed them (torch's context "all"),
   else the block's allocation frames (torch's free entries carry context_when_allocated then). */
static inline void ap_history_add_free(ap_history *h, int action, uintptr_t addr, size_t size, void *stream,
                                       uint64_t block_ctx) {
    if (h->capacity) ap_history_record_ctx(h, action, addr, size, stream, ap_history_tls_ctx ? ap_history_tls_ctx : block_ctx);
}
/* Copies the entries oldest first into a malloc()ed array. */
size_t ap_history_copy(const ap_history *h, ap_history_entry **out);

#endif

/* A bounded ring of allocator events for snapshots (PyTorch's device_traces). Off unless the
 * record_history knob gives it a capacity; when off the hot path pays one predictable branch. */
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
    uintptr_t addr;
    size_t size;
    void *stream;
    int64_t time_us;
} ap_history_entry;

typedef struct ap_history {
    ap_history_entry *ring;
    size_t capacity;
    size_t next;  /* total entries ever written; ring index = next % capacity */
} ap_history;

int ap_history_init(ap_history *h, size_t capacity);
void ap_history_destroy(ap_history *h);
void ap_history_record(ap_history *h, int action, uintptr_t addr, size_t size, void *stream);
/* Inline so that the hot path pays one branch when history is off. */
static inline void ap_history_add(ap_history *h, int action, uintptr_t addr, size_t size, void *stream) {
    if (h->capacity) ap_history_record(h, action, addr, size, stream);
}
/* Copies the entries oldest first into a malloc()ed array. */
size_t ap_history_copy(const ap_history *h, ap_history_entry **out);

#endif

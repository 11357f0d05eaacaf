#include "history.h"

#include "block.h" /* AP_CTX_LENT */

#include "invariant.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

__thread uint64_t ap_history_tls_ctx;

void ap_history_set_ctx(uint64_t ctx) { ap_history_tls_ctx = ctx; }

static uint32_t history_meta; /* process-wide, as torch's; read under each pool's own lock */

void ap_history_set_meta(uint32_t meta) { __atomic_store_n(&history_meta, meta, __ATOMIC_RELAXED); }

int ap_history_init(ap_history *h, size_t capacity) {
    h->capacity = capacity;
    h->next = 0;
    h->skip = 0;
    h->ring = NULL;
    if (capacity == 0) return 0;
    h->ring = calloc(capacity, sizeof *h->ring);
    return h->ring ? 0 : -1;
}

void ap_history_keep_recent(ap_history *dst, const ap_history *src) {
    size_t n = src->next < src->capacity ? src->next : src->capacity;
    if (n > dst->capacity) n = dst->capacity;
    for (size_t i = 0; i < n; i++) dst->ring[i] = src->ring[(src->next - n + i) % src->capacity];
    dst->next = n;
}

void ap_history_destroy(ap_history *h) {
    free(h->ring);
    h->ring = NULL;
    h->capacity = 0;
}

void ap_history_record(ap_history *h, int action, uintptr_t addr, size_t size, void *stream) {
    ap_history_record_ctx(h, action, addr, size, stream, ap_history_tls_ctx);
}

void ap_history_record_ctx(ap_history *h, int action, uintptr_t addr, size_t size, void *stream, uint64_t ctx) {
    struct timespec ts;
    AP_ASSERT(h->capacity > 0 && h->ring != NULL); /* ap_history_add skips a ring that is off */
    if (h->skip >> action & 1) return;
    clock_gettime(CLOCK_REALTIME, &ts);
    ap_history_entry *e = &h->ring[h->next % h->capacity];
    e->action = (uint8_t)action;
    e->meta = __atomic_load_n(&history_meta, __ATOMIC_RELAXED);
    e->addr = addr;
    e->size = size;
    e->stream = stream;
    e->time_us = (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
    e->ctx = ctx & ~AP_CTX_LENT; /* a block's ctx may carry its lent flag */
    h->next++;
}

size_t ap_history_copy(const ap_history *h, ap_history_entry **out) {
    *out = NULL;
    if (!h->capacity || !h->next) return 0;
    size_t n = h->next < h->capacity ? h->next : h->capacity;
    ap_history_entry *copy = malloc(n * sizeof *copy);
    if (!copy) return 0;
    size_t start = h->next - n;
    for (size_t i = 0; i < n; i++) copy[i] = h->ring[(start + i) % h->capacity];
    *out = copy;
    return n;
}

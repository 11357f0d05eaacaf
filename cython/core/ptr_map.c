#include "ptr_map.h"

#include <stdlib.h>

static inline size_t slot_of(const ap_ptr_map *m, uintptr_t key) {
    /* Addresses are multiples of 512: drop those bits, then mix. */
    return (size_t)(((uint64_t)(key >> 9) * 0x9E3779B97F4A7C15ull) >> 20) & m->mask;
}

int ap_map_init(ap_ptr_map *m, size_t capacity) {
    size_t cap = 64;
    while (cap < capacity) cap <<= 1;
    m->keys = calloc(cap, sizeof *m->keys);
    m->vals = calloc(cap, sizeof *m->vals);
    if (!m->keys || !m->vals) {
        free(m->keys);
        free(m->vals);
        m->keys = NULL;
        m->vals = NULL;
        return -1;
    }
    m->mask = cap - 1;
    m->count = 0;
    return 0;
}

void ap_map_destroy(ap_ptr_map *m) {
    free(m->keys);
    free(m->vals);
    m->keys = NULL;
    m->vals = NULL;
    m->count = 0;
}

static void place(ap_ptr_map *m, uintptr_t key, ap_block *val) {
    size_t i = slot_of(m, key);
    while (m->keys[i]) i = (i + 1) & m->mask;
    m->keys[i] = key;
    m->vals[i] = val;
}

static int grow(ap_ptr_map *m) {
    ap_ptr_map bigger;
    if (ap_map_init(&bigger, (m->mask + 1) * 2) != 0) return -1;
    for (size_t i = 0; i <= m->mask; i++)
        if (m->keys[i]) place(&bigger, m->keys[i], m->vals[i]);
    bigger.count = m->count;
    ap_map_destroy(m);
    *m = bigger;
    return 0;
}

int ap_map_put(ap_ptr_map *m, uintptr_t key, ap_block *val) {
    if ((m->count + 1) * 2 > m->mask + 1 && grow(m) != 0) return -1;
    place(m, key, val);
    m->count++;
    return 0;
}

ap_block *ap_map_get(const ap_ptr_map *m, uintptr_t key) {
    size_t i = slot_of(m, key);
    while (m->keys[i]) {
        if (m->keys[i] == key) return m->vals[i];
        i = (i + 1) & m->mask;
    }
    return NULL;
}

ap_block *ap_map_take(ap_ptr_map *m, uintptr_t key) {
    size_t i = slot_of(m, key);
    while (m->keys[i] && m->keys[i] != key) i = (i + 1) & m->mask;
    if (!m->keys[i]) return NULL;
    ap_block *val = m->vals[i];
    /* Backward-shift: pull later entries of the probe run into the hole so no tombstones are needed. */
    size_t hole = i, j = i;
    for (;;) {
        j = (j + 1) & m->mask;
        if (!m->keys[j]) break;
        size_t home = slot_of(m, m->keys[j]);
        /* Entry j may move to the hole if its home is not cyclically in (hole, j]. */
        int home_in_range = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
        if (!home_in_range) {
            m->keys[hole] = m->keys[j];
            m->vals[hole] = m->vals[j];
            hole = j;
        }
    }
    m->keys[hole] = 0;
    m->vals[hole] = NULL;
    m->count--;
    return val;
}

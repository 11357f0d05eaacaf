/* Records by address (the pool's live blocks, the host pool's buffers): open addressing with
 * linear probing and backward-shift deletion. One probe on average at load <= 1/2; grows by
 * doubling, so steady state never allocates. Keys are multiples of 512. The lookups are inline:
 * every malloc puts and every free takes. */
#ifndef AP_PTR_MAP_H
#define AP_PTR_MAP_H

#include <stddef.h>
#include <stdint.h>

#include "invariant.h"

typedef struct ap_ptr_map {
    uintptr_t *keys; /* 0 = empty slot (no block lives at address 0) */
    void **vals;
    size_t mask;     /* capacity - 1, capacity a power of two */
    size_t count;
} ap_ptr_map;

int ap_map_init(ap_ptr_map *m, size_t capacity);
void ap_map_destroy(ap_ptr_map *m);
/* Doubles the table; 0, or -1 when host memory ran out (the table is unchanged). */
int ap_map_grow(ap_ptr_map *m);

static inline size_t ap_map_home(const ap_ptr_map *m, uintptr_t key) {
    /* Addresses are multiples of 512: drop those bits, then mix. */
    return (size_t)(((uint64_t)(key >> 9) * 0x9E3779B97F4A7C15ull) >> 20) & m->mask;
}

static inline void ap_map_place(ap_ptr_map *m, uintptr_t key, void *val) {
    size_t i = ap_map_home(m, key);
    while (m->keys[i]) i = (i + 1) & m->mask;
    m->keys[i] = key;
    m->vals[i] = val;
}

static inline void *ap_map_get(const ap_ptr_map *m, uintptr_t key) {
    size_t i = ap_map_home(m, key);
    while (m->keys[i]) {
        if (m->keys[i] == key) return m->vals[i];
        i = (i + 1) & m->mask;
    }
    return NULL;
}

/* 0 on success, -1 when growing the table failed (host out of memory). */
static inline int ap_map_put(ap_ptr_map *m, uintptr_t key, void *val) {
    AP_ASSERT(key != 0 && ap_map_get(m, key) == NULL); /* 0 marks empty slots; a key is put once */
    if (__builtin_expect((m->count + 1) * 2 > m->mask + 1, 0) && ap_map_grow(m) != 0) return -1;
    ap_map_place(m, key, val);
    m->count++;
    AP_ASSERT(m->count * 2 <= m->mask + 1); /* load <= 1/2: probe runs stay short and always end */
    return 0;
}

/* The slot holding key, or AP_MAP_NONE: a lookup whose slot ap_map_take_at may then empty
   without probing again (a free looks its block up, checks it, then removes it). */
#define AP_MAP_NONE ((size_t)-1)
static inline size_t ap_map_find(const ap_ptr_map *m, uintptr_t key) {
    size_t i = ap_map_home(m, key);
    while (m->keys[i]) {
        if (m->keys[i] == key) return i;
        i = (i + 1) & m->mask;
    }
    return AP_MAP_NONE;
}

/* Removes and returns the record in slot i (from ap_map_find, the map unchanged since). */
static inline void *ap_map_take_at(ap_ptr_map *m, size_t i) {
    AP_ASSERT(i <= m->mask && m->keys[i] != 0);
    void *val = m->vals[i];
    /* Backward-shift: pull later entries of the probe run into the hole so no tombstones are needed. */
    size_t hole = i, j = i;
    for (;;) {
        j = (j + 1) & m->mask;
        if (!m->keys[j]) break;
        size_t home = ap_map_home(m, m->keys[j]);
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
    AP_ASSERT(m->count > 0);
    m->count--;
    return val;
}

/* Removes and returns the record at key, or NULL. */
static inline void *ap_map_take(ap_ptr_map *m, uintptr_t key) {
    size_t i = ap_map_find(m, key);
    return i == AP_MAP_NONE ? NULL : ap_map_take_at(m, i);
}

#endif

#include "ptr_map.h"

#include <stdlib.h>

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

int ap_map_grow(ap_ptr_map *m) {
    ap_ptr_map bigger;
    if (ap_map_init(&bigger, (m->mask + 1) * 2) != 0) return -1;
    for (size_t i = 0; i <= m->mask; i++)
        if (m->keys[i]) ap_map_place(&bigger, m->keys[i], m->vals[i]);
    bigger.count = m->count;
    ap_map_destroy(m);
    *m = bigger;
    return 0;
}

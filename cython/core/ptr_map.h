/* Live allocations by address: open addressing with linear probing and backward-shift deletion.
 * One probe on average at load <= 1/2; grows by doubling, so steady state never allocates. */
#ifndef AP_PTR_MAP_H
#define AP_PTR_MAP_H

#include "block.h"

typedef struct ap_ptr_map {
    uintptr_t *keys; /* 0 = empty slot (no block lives at address 0) */
    ap_block **vals;
    size_t mask;     /* capacity - 1, capacity a power of two */
    size_t count;
} ap_ptr_map;

int ap_map_init(ap_ptr_map *m, size_t capacity);
void ap_map_destroy(ap_ptr_map *m);
/* 0 on success, -1 when growing the table failed (host out of memory). */
int ap_map_put(ap_ptr_map *m, uintptr_t key, ap_block *val);
ap_block *ap_map_get(const ap_ptr_map *m, uintptr_t key);
/* Removes and returns the block at key, or NULL. */
ap_block *ap_map_take(ap_ptr_map *m, uintptr_t key);

#endif

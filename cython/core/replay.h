/* Replays an allocation trace with the per-operation loop in C (no Python per event). */
#ifndef AP_REPLAY_H
#define AP_REPLAY_H

#include <stddef.h>
#include <stdint.h>

#include "pool.h"

enum { AP_REPLAY_POOL = 0, AP_REPLAY_DIRECT = 1 };

typedef struct ap_replay_result {
    int64_t allocs, frees;
    double seconds;
    int64_t peak_live_bytes;      /* peak of the sum of requested sizes */
    int64_t peak_reserved_bytes;  /* pool: segments; direct: what the device reserved */
    int64_t device_mallocs, device_frees;
    int64_t device_calls_steady;  /* device mallocs + frees during the second half of the events */
    int64_t final_allocated_bytes;
    double fragmentation_at_peak; /* pool: 1 - largest free / cached free right after the malloc that
                                     first reached peak reserved (0 if nothing cached); direct: 0 */
    int64_t failed_index;         /* event that failed, or -1 */
    ap_error error;
} ap_replay_result;

/* op[i]: 1 allocate, 0 free; slot[i]: dense allocation index (< n_slots); size[i]: bytes;
   stream[i]: index into streams[]. ptrs: n_slots entries of scratch. mode: pool or direct (one
   device call per allocation and free, through the same backend). On failure, stops and frees
   what it allocated; direct mode frees what the trace leaves allocated at its end too (pool
   mode leaves it to the pool's close). Returns AP_OK or the failing status. */
int ap_replay(ap_pool *p, ap_backend *b, int device, int mode, const int8_t *op, const int32_t *slot,
              const int64_t *size, const int32_t *stream, size_t n, void **streams, void **ptrs, size_t n_slots,
              ap_replay_result *r);

#endif

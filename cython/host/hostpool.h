/* The pinned host-memory pool: page-locked host buffers for staging copies and for numpy arrays
 * (the NEP 49 handler in numpy_handler.h), cached so that steady state never calls the runtime.
 *
 * Pinning is slow (the runtime locks and maps pages) and scarce, so buffers are cached in
 * power-of-two size classes, as PyTorch's CachingHostAllocator does: a request of n bytes gets the
 * class 2^ceil(log2(max(n, 512))). Classes up to 1 MiB are carved from slabs of up to 64 buffers
 * (one runtime call per slab); bigger classes are one runtime allocation each.
 *
 * Event-guarded reuse: a buffer that the device reads or writes asynchronously (a copy queued on a
 * stream) must not be handed out again before that work is done. record_stream(ptr, stream) marks
 * the buffer; its free then records an event on each marked stream and parks the buffer until
 * every event has completed (polled, never waited for, on later calls). Unmarked buffers are
 * reusable at once.
 *
 * The runtime's life (ap_backend_life): buffers and events of a runtime that released them
 * (aclFinalize, then perhaps aclInit; a forced reset) are forgotten at the pool's next runtime
 * call (a miss, a marked free, empty_cache, destroy), never on the cached path: cached ones
 * dropped, handed-out ones written off (their free accepted), said once on stderr.
 *
 * Thread-safe (one mutex); no Python objects; sizes in bytes.
 */
#ifndef AP_HOSTPOOL_H
#define AP_HOSTPOOL_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "pool.h" /* ap_error, ap_set_error and the AP_E_* statuses */

#define AP_HOST_MIN_SHIFT 9   /* smallest class: 512 bytes */
#define AP_HOST_SLAB_SHIFT 20 /* classes up to 1 MiB live in slabs */
#define AP_HOST_MAX_SHIFT 40  /* largest class: 1 TiB */
#define AP_HOST_N_CLASSES (AP_HOST_MAX_SHIFT - AP_HOST_MIN_SHIFT + 1)
#define AP_HOST_MAX_USES 8    /* streams one buffer's uses hold at first; more double them (no limit, as torch's) */

typedef struct ap_host_pool ap_host_pool;

/* Counters, in bytes or counts; peaks since creation or the last reset. */
typedef struct ap_host_stats {
    int64_t allocated_bytes, allocated_bytes_peak; /* class sizes of buffers handed out */
    int64_t requested_bytes, requested_bytes_peak; /* bytes asked for by those buffers */
    int64_t allocations, allocations_peak;         /* buffers handed out */
    int64_t reserved_bytes, reserved_bytes_peak;   /* pinned bytes held from the runtime */
    int64_t segments;                              /* runtime allocations held (slabs + big buffers) */
    int64_t cached_free_bytes;                     /* reserved bytes ready for reuse */
    int64_t cached_free_blocks;                    /* buffers ready for reuse (CuPy's n_free_blocks) */
    int64_t pending_free_bytes, pending_free_blocks; /* freed, waiting for their events */
    int64_t num_allocs, num_frees;                 /* calls served */
    int64_t num_host_alloc, num_host_free;         /* runtime calls (aclrtMallocHost, ...) */
    int64_t events_created;
    int64_t num_invalid_frees;                     /* frees of unknown pointers (ignored) */
    /* torch's host_memory_stats: */
    int64_t segments_peak;
    int64_t active_requests, active_requests_peak; /* handed out or parked: not yet reusable */
    int64_t active_bytes, active_bytes_peak;       /* their class sizes */
    /* accumulated since creation or ap_host_reset_accumulated (torch's .allocated / .freed): */
    int64_t acc_host_alloc, acc_host_free;         /* runtime allocations made / given back */
    int64_t acc_pinned_bytes, acc_unpinned_bytes;  /* their bytes */
    int64_t acc_requests, acc_request_bytes;       /* buffers handed out, class bytes */
    int64_t acc_released, acc_released_bytes;      /* buffers reusable again (after their events) */
    int64_t host_alloc_us, host_alloc_us_max, host_alloc_us_min; /* time in the runtime's pinning */
    int64_t host_free_us, host_free_us_max, host_free_us_min;    /* calls (count: acc_host_alloc/free) */
} ap_host_stats;

/* A pool pinning through backend's host_malloc in device's runtime context. NULL (err set) when
   host memory for the bookkeeping is missing. */
ap_host_pool *ap_host_pool_create(ap_backend *backend, int device, ap_error *err);
/* Returns every buffer to the runtime, those still handed out included (the owner is going),
   but those of a runtime that released them (forgotten: their addresses may be another's). */
void ap_host_pool_destroy(ap_host_pool *hp);

/* Bytes a request of size occupies (its class), or 0 when size is 0 or too big. */
size_t ap_host_class_size(size_t size);
int ap_host_malloc(ap_host_pool *hp, size_t size, void **out, ap_error *err);
/* Frees ptr: reusable at once unless record_stream marked it (then after its events). */
int ap_host_free(ap_host_pool *hp, void *ptr, ap_error *err);
/* Resizes ptr, keeping min(old requested, new_size) bytes: in place when new_size stays in the
   same class, else into a new buffer (the old one is freed). ptr == NULL: malloc. */
int ap_host_realloc(ap_host_pool *hp, void *ptr, size_t new_size, void **out, ap_error *err);
/* Marks ptr as used by work queued on stream (of device, whose context the event is made in). */
int ap_host_record_stream(ap_host_pool *hp, void *ptr, void *stream, int device, ap_error *err);
/* 0 and the buffer's start, class size and requested bytes when ptr starts a handed-out buffer. */
int ap_host_block_info(ap_host_pool *hp, void *ptr, uintptr_t *base, size_t *capacity, size_t *requested);
/* Returns every cached buffer whose events completed (and every idle slab) to the runtime. */
void ap_host_empty_cache(ap_host_pool *hp);
void ap_host_get_stats(ap_host_pool *hp, ap_host_stats *out);
void ap_host_reset_peaks(ap_host_pool *hp);
/* Zeroes the acc_* counters and the call times (torch's reset_accumulated_host_memory_stats). */
void ap_host_reset_accumulated(ap_host_pool *hp);

#endif

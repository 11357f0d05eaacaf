/* A numpy memory handler (NEP 49): array data in ascend_pool's pinned host pool.
 *
 * numpy (>= 1.22) allocates every array's data through the handler current in the calling
 * context (a context variable); each array keeps the handler that allocated it and frees through
 * it, whatever the context at free time. So one handler struct lives for the whole process and its
 * ctx (the host pool) is fixed at the first installation: a freed array must always reach the pool
 * that gave its memory.
 *
 * The structs mirror numpy's PyDataMem_Handler version 1 (numpy/ndarraytypes.h), which numpy
 * keeps binary compatible: name[127], version, then the five-pointer allocator. Declared here
 * rather than included because the extension is built without numpy's headers.
 *
 * Called with the GIL held (numpy's own rule); the host pool needs no GIL anyway.
 *
 * In a forked child the parent's pool is not this process's (its runtime, its lock, perhaps held
 * by a thread that did not survive the fork): nothing here touches it there. The integration puts
 * numpy's default handler back in the forking thread's context (integrations/numpy.py), so the
 * child's new arrays come from numpy's allocator; a context copied before the fork still reaching
 * this handler gets NULL (numpy's MemoryError), and the parent's arrays freed in the child are
 * left to the process's exit.
 */
#ifndef APC_NUMPY_HANDLER_H
#define APC_NUMPY_HANDLER_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "backend/backend.h"
#include "host/hostpool.h"

#define APNP_HANDLER_NAME "ascend_pool_pinned_host"

typedef struct apnp_allocator {
    void *ctx;
    void *(*malloc)(void *ctx, size_t size);
    void *(*calloc)(void *ctx, size_t nelem, size_t elsize);
    void *(*realloc)(void *ctx, void *ptr, size_t new_size);
    void (*free)(void *ctx, void *ptr, size_t size);
} apnp_allocator;

typedef struct apnp_handler {
    char name[127];
    uint8_t version;
    apnp_allocator allocator;
} apnp_handler;

_Static_assert(offsetof(apnp_handler, allocator) == 128, "numpy's PyDataMem_Handler layout");

/* numpy asks for 0 bytes for empty arrays; the pool's smallest class serves them. */
static inline int apnp_forked(void) { return atomic_load_explicit(&ap_forked_from, memory_order_relaxed) != 0; }

static void *apnp_malloc(void *ctx, size_t size) {
    void *out = NULL;
    if (apnp_forked()) return NULL;
    return ap_host_malloc((ap_host_pool *)ctx, size ? size : 1, &out, NULL) == AP_OK ? out : NULL;
}

static void *apnp_calloc(void *ctx, size_t nelem, size_t elsize) {
    size_t total;
    if (__builtin_mul_overflow(nelem, elsize, &total)) return NULL;
    void *out = apnp_malloc(ctx, total);
    if (out) memset(out, 0, total ? total : 1); /* cached buffers are not clean */
    return out;
}

/* numpy does not say the old size: the pool knows it. */
static void *apnp_realloc(void *ctx, void *ptr, size_t new_size) {
    void *out = NULL;
    if (apnp_forked()) return NULL;
    return ap_host_realloc((ap_host_pool *)ctx, ptr, new_size ? new_size : 1, &out, NULL) == AP_OK ? out : NULL;
}

/* A free has no way to report an error: an unknown pointer is counted (num_invalid_frees). */
static void apnp_free(void *ctx, void *ptr, size_t size) {
    (void)size;
    if (ptr && !apnp_forked()) ap_host_free((ap_host_pool *)ctx, ptr, NULL);
}

static apnp_handler apnp_the_handler = {
    APNP_HANDLER_NAME, 1, {NULL, apnp_malloc, apnp_calloc, apnp_realloc, apnp_free}};

/* The process's handler, bound to hp on first use. NULL when it is already bound to another pool. */
static apnp_handler *apnp_handler_for(ap_host_pool *hp) {
    if (!apnp_the_handler.allocator.ctx) apnp_the_handler.allocator.ctx = hp;
    return apnp_the_handler.allocator.ctx == hp ? &apnp_the_handler : NULL;
}

#endif

/* The live pools of this process (default pools and tenant contexts), as the C ABI sees them.
 *
 * A framework frees a pointer on whatever thread drops the tensor, whose current context may not
 * be the one that allocated it; record_stream and base_alloc are not even told the device. So the
 * C ABI looks pointers up here when the calling thread's current pool does not own them.
 *
 * An entry is the address of a PoolBase's `p` field, not the pool pointer itself: the one close
 * path of every pool (PoolBase._shut, for close() and __dealloc__ alike) sets that field to NULL,
 * then unregisters it, and only then destroys the pool, so a lookup never reaches a closed pool.
 * Lookups hold the candidate pools (capi_calls) under the registry lock and ask them after it is
 * let go (apc_find_hold): asking takes a pool's own lock, which a free may hold over a stream wait.
 * No wait happens under the registry lock: ascend_pool_empty_cache holds the pools and lets the
 * lock go before their stream waits too (opening and closing a pool take it under the GIL). Lock
 * order where both are taken (the rare fallback of apc_find_locked, the fork test's hold):
 * registry, then a pool's own lock (nothing takes them the other way round). As everywhere in the pool, closing a pool while other threads
 * still use its memory is the caller's error. In a child forked after the runtime was opened the
 * registry is dead: the C ABI refuses before any lookup, and closing pools there skips it (its
 * lock may have been held at the fork).
 * Not on the hot path: a malloc or free served by the current pool never touches it.
 */
#ifndef APC_REGISTRY_H
#define APC_REGISTRY_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "current.h"
#include "pool.h"

typedef struct apc_entry {
    ap_pool **slot; /* &PoolBase.p: NULL once the pool is closed */
    int device;
} apc_entry;

/* The pool of an entry, or NULL once closed. The field is written by Python code under the GIL,
   read here without it: an atomic pointer load. */
static inline ap_pool *apc_entry_pool(const apc_entry *e) { return __atomic_load_n(e->slot, __ATOMIC_ACQUIRE); }

static pthread_mutex_t apc_reg_lock = PTHREAD_MUTEX_INITIALIZER;
static apc_entry *apc_reg;
static size_t apc_reg_n, apc_reg_cap;
/* Devices of the backend that created pools (0: not known yet), for rejecting bad device
   numbers without a trip to Python. */
static atomic_int apc_device_count;

static void apc_learn_device_count(int device_count) {
    if (device_count > atomic_load(&apc_device_count)) atomic_store(&apc_device_count, device_count);
}

/* 0, or -1 when host memory for the table ran out. */
static int apc_register(ap_pool **slot, int device, int device_count) {
    int rc = 0;
    pthread_mutex_lock(&apc_reg_lock);
    if (apc_reg_n == apc_reg_cap) {
        size_t cap = apc_reg_cap ? apc_reg_cap * 2 : 16;
        apc_entry *grown = realloc(apc_reg, cap * sizeof *grown);
        if (grown) {
            apc_reg = grown;
            apc_reg_cap = cap;
        }
    }
    if (apc_reg_n < apc_reg_cap) apc_reg[apc_reg_n++] = (apc_entry){slot, device};
    else rc = -1;
    pthread_mutex_unlock(&apc_reg_lock);
    apc_learn_device_count(device_count);
    return rc;
}

static void apc_unregister(ap_pool **slot) {
    pthread_mutex_lock(&apc_reg_lock);
    for (size_t i = 0; i < apc_reg_n; i++)
        if (apc_reg[i].slot == slot) {
            apc_reg[i] = apc_reg[--apc_reg_n];
            break;
        }
    pthread_mutex_unlock(&apc_reg_lock);
}

/* Whether q owns ptr: a live block starting at ptr (inside: any address in the block), or, not
   inside, a block q wrote off when the runtime released its memory (ap_pool_wrote_off): its
   free and record_stream are accepted by q, but were refused from any other pool as "no live
   pool of device N allocated it". */
static int apc_owns(ap_pool *q, void *ptr, int inside) {
    uintptr_t base = 0;
    size_t size = 0, requested = 0;
    if (ap_pool_block_info(q, ptr, &base, &size, &requested) == 0 && (inside || base == (uintptr_t)ptr)) return 1;
    return !inside && ap_pool_wrote_off(q, ptr);
}

/* With apc_reg_lock held: the live pool of device (-1: any device) owning ptr (apc_owns),
   skipping `skip`; NULL if none. */
static ap_pool *apc_find_locked(int device, void *ptr, int inside, ap_pool *skip) {
    for (size_t i = 0; i < apc_reg_n; i++) {
        ap_pool *q = apc_entry_pool(&apc_reg[i]);
        if (!q || q == skip || (device >= 0 && apc_reg[i].device != device)) continue;
        if (apc_owns(q, ptr, inside)) return q;
    }
    return NULL;
}

/* As apc_find_locked, but the pool found is held (capi_calls: its close waits for it; give it back
   with ap_pool_unhold), and the registry lock is held only to hold the candidates, not while each
   is asked: asking takes a pool's lock, which a free may hold over a stream wait (no event to be
   had), and opening or closing any pool takes the registry lock with the GIL held. */
static ap_pool *apc_find_hold(int device, void *ptr, int inside, ap_pool *skip) {
    ap_pool *few[16], **held = few, *owner = NULL;
    size_t n = 0;
    pthread_mutex_lock(&apc_reg_lock);
    if (apc_reg_n > sizeof few / sizeof *few && !(held = malloc(apc_reg_n * sizeof *held))) {
        owner = apc_find_locked(device, ptr, inside, skip); /* no host memory for the list: asked here */
        if (owner) atomic_fetch_add_explicit(&owner->capi_calls, 1, memory_order_seq_cst);
        pthread_mutex_unlock(&apc_reg_lock);
        return owner;
    }
    for (size_t i = 0; i < apc_reg_n; i++) {
        ap_pool *q = apc_entry_pool(&apc_reg[i]);
        if (!q || q == skip || (device >= 0 && apc_reg[i].device != device)) continue;
        atomic_fetch_add_explicit(&q->capi_calls, 1, memory_order_seq_cst);
        held[n++] = q;
    }
    pthread_mutex_unlock(&apc_reg_lock);
    for (size_t i = 0; i < n; i++) {
        if (!owner && apc_owns(held[i], ptr, inside))
            owner = held[i];
        else
            ap_pool_unhold(held[i]);
    }
    if (held != few) free(held);
    return owner;
}

/* Test-only: holds the registry lock and the mutexes of pools[0..n) for ms milliseconds, as
   framework threads inside C-ABI calls hold them, so that a test can fork at that moment
   (tests/test_fork_safety.py). apc_test_locks_held is 1 while they are held. Lock order as
   everywhere: registry, then pools. */
static atomic_int apc_test_locks_held;

static void apc_test_hold_locks(ap_pool **pools, int n, unsigned ms) {
    pthread_mutex_lock(&apc_reg_lock);
    for (int i = 0; i < n; i++) pthread_mutex_lock(&pools[i]->lock);
    atomic_store(&apc_test_locks_held, 1);
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&t, &t) != 0) {
    }
    atomic_store(&apc_test_locks_held, 0);
    for (int i = n - 1; i >= 0; i--) pthread_mutex_unlock(&pools[i]->lock);
    pthread_mutex_unlock(&apc_reg_lock);
}

#endif

/* Which pool serves module-level calls and the C ABI: per thread, a tenant context made current
 * with `with ctx:`; otherwise the process's default pool of the device. Lock-free to read.
 *
 * A pool can close while other threads still have it current (an outer context closed inside a
 * nested `with`, another thread's context closed under it). Their entries must then never lead to
 * the freed pool, nor to a new pool that happens to sit at the same address. So each open pool
 * holds a ticket: a slot in a process-wide table and the slot's generation at opening. A thread's
 * entry keeps the pool and its ticket; closing bumps the generation, so every thread's entry goes
 * stale at once, and ap_current_get (one extra load) no longer returns it. Defaults are cleared
 * at close directly (one atomic per device).
 *
 * A C ABI call already running on another thread when the pool closes holds it
 * (ap_pool_hold): it adds itself to the pool's capi_calls, then checks that the pool is still
 * current; a destroy hides the pool first, then waits for capi_calls to drain (ap_pool_wait_holders).
 * Either the close sees the call (and waits) or the call sees the close (and lets go): both sides
 * are sequentially consistent. A caller that lets go touched only capi_calls, which stays valid:
 * pool structs are reused, never freed (pool.c).
 */
#ifndef AP_CURRENT_H
#define AP_CURRENT_H

#include <stddef.h>
#include <stdint.h>

#include "pool.h"

#define AP_MAX_DEVICES 64
#define AP_TICKETS 16384          /* pools open at once in one process */
#define AP_NO_TICKET UINT64_MAX  /* no ticket: never valid (its slot is out of range) */

/* A ticket for a pool being opened, labelled (e.g. "tenant context 'x'") for the messages of calls that find it
   closed; AP_NO_TICKET when AP_TICKETS pools are open. */
uint64_t ap_ticket_open(const char *label);
/* Closes a ticket: every thread's entry holding it is stale from now on. Idempotent. */
void ap_ticket_close(uint64_t ticket);

/* The calling thread's current pool for device (its context, else the default), or NULL (also
   when its context was closed: see ap_current_closed). */
ap_pool *ap_current_get(int device);
/* 1 when the calling thread's context for device was closed (copies its label into buf), else 0. */
int ap_current_closed(int device, char *buf, size_t len);
/* A thread's entry for a device, as saved by ap_current_set and put back by ap_current_restore. */
typedef struct ap_current_token {
    ap_pool *pool;
    uint64_t ticket;
    ap_pool *owner;
    uint64_t owner_ticket;
} ap_current_token;

/* Makes p (with its ticket) current for device on the calling thread (p NULL: back to the
   default); saves the previous entry in *prev (may be NULL) so that contexts can nest. mem_pool:
   made current by use_mem_pool, whose cache the C ABI's empty_cache keeps (torch's emptyCache
   skips a MemPool): the cache owner stays the entry's beneath. */
void ap_current_set(int device, ap_pool *p, uint64_t ticket, int mem_pool, ap_current_token *prev);
/* Puts back an entry saved by ap_current_set. */
void ap_current_restore(int device, const ap_current_token *t);
/* The pool whose cache the C ABI's empty_cache empties for device on the calling thread: its
   `with ctx:` context (a use_mem_pool pool above it skipped), else the default; NULL when that
   context was closed. */
ap_pool *ap_current_cache_owner(int device);
/* The process default pool of device (set by the Python layer when it creates it). */
void ap_default_set(int device, ap_pool *p);
ap_pool *ap_default_get(int device);
/* Forgets p as a default; called when p is destroyed (threads' entries go stale by its ticket). */
void ap_current_forget(ap_pool *p);
/* 1 while p is still what ap_current_get(device) returns (cache_owner 0) or what
   ap_current_cache_owner(device) returns (cache_owner 1), read with sequentially consistent loads. */
int ap_current_still(int device, ap_pool *p, int cache_owner);

/* The calling thread's current pool for device (cache_owner 1: its cache owner,
   ap_current_cache_owner), held against a concurrent destroy until ap_pool_unhold; NULL when there
   is none (or it was closed). */
static inline ap_pool *ap_pool_hold_as(int device, int cache_owner) {
    ap_pool *p;
    while ((p = cache_owner ? ap_current_cache_owner(device) : ap_current_get(device)) != NULL) {
        atomic_fetch_add_explicit(&p->capi_calls, 1, memory_order_seq_cst);
        if (__builtin_expect(ap_current_still(device, p, cache_owner), 1)) return p;
        atomic_fetch_sub_explicit(&p->capi_calls, 1, memory_order_release); /* closed meanwhile */
    }
    return NULL;
}

static inline ap_pool *ap_pool_hold(int device) { return ap_pool_hold_as(device, 0); }

static inline void ap_pool_unhold(ap_pool *p) { atomic_fetch_sub_explicit(&p->capi_calls, 1, memory_order_release); }

#endif

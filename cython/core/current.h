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
 * A call already running on another thread when the pool closes is the caller's race, as for any
 * use of a pool being closed: the ticket protects every call that starts after the close began.
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
/* Makes p (with its ticket) current for device on the calling thread (p NULL: back to the
   default); returns the previous entry in *prev_pool / *prev_ticket so that contexts can nest. */
void ap_current_set(int device, ap_pool *p, uint64_t ticket, ap_pool **prev_pool, uint64_t *prev_ticket);
/* The process default pool of device (set by the Python layer when it creates it). */
void ap_default_set(int device, ap_pool *p);
ap_pool *ap_default_get(int device);
/* Forgets p as a default; called when p is destroyed (threads' entries go stale by its ticket). */
void ap_current_forget(ap_pool *p);

#endif

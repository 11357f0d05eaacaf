/* Which pool serves module-level calls and the C ABI: per thread, a tenant context made current
 * with `with ctx:`; otherwise the process's default pool of the device. Lock-free to read. */
#ifndef AP_CURRENT_H
#define AP_CURRENT_H

#include "pool.h"

#define AP_MAX_DEVICES 64

/* The calling thread's current pool for device (its context, else the default), or NULL. */
ap_pool *ap_current_get(int device);
/* Makes p current for device on the calling thread (NULL: back to the default); returns the
   previous thread-local choice (NULL if none) so that contexts can nest. */
ap_pool *ap_current_set(int device, ap_pool *p);
/* The process default pool of device (set by the Python layer when it creates it). */
void ap_default_set(int device, ap_pool *p);
ap_pool *ap_default_get(int device);
/* Forgets p everywhere it can be seen (defaults, the calling thread); called when p closes. */
void ap_current_forget(ap_pool *p);

#endif

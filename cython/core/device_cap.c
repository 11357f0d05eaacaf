/* The device's memory fraction over all its plain pools (see ap_device_cap in pool.h): torch's
 * set_per_process_memory_fraction caps the device's caching allocator, whose total counts every
 * MemPool's segments too, so a MemPool's bytes may not escape it. Booking is a compare-and-swap
 * on the cap's counter; it runs only where a segment is obtained from or given back to the
 * device, never on the cached path. */
#include <pthread.h>

#include "pool_internal.h"

/* One cap per (backend, device), made on first use and kept for the process's life (a handful). */
#define AP_DEVICE_CAPS 256
static struct {
    const ap_backend *backend;
    int device;
    ap_device_cap cap;
} caps[AP_DEVICE_CAPS];
static int n_caps;
static pthread_mutex_t caps_lock = PTHREAD_MUTEX_INITIALIZER; /* a leaf: nothing is taken under it */

static ap_device_cap *cap_for(const ap_backend *backend, int device) {
    ap_device_cap *found = NULL;
    pthread_mutex_lock(&caps_lock);
    for (int i = 0; i < n_caps && !found; i++)
        if (caps[i].backend == backend && caps[i].device == device) found = &caps[i].cap;
    if (!found && n_caps < AP_DEVICE_CAPS) {
        caps[n_caps].backend = backend;
        caps[n_caps].device = device;
        atomic_store(&caps[n_caps].cap.limit, AP_NO_LIMIT);
        found = &caps[n_caps++].cap;
    }
    pthread_mutex_unlock(&caps_lock);
    return found;
}

int ap_pool_join_device_cap(ap_pool *p, int owner) {
    ap_device_cap *cap = cap_for(p->backend, p->device);
    if (!cap) return -1;
    if (owner) { /* before the limit below: a previous owner's leave no longer lifts it */
        pthread_mutex_lock(&caps_lock);
        __atomic_store_n(&cap->owner, p, __ATOMIC_SEQ_CST);
        pthread_mutex_unlock(&caps_lock);
    }
    pthread_mutex_lock(&p->lock);
    if (!p->device_cap) {
        __atomic_store_n(&p->device_cap, cap, __ATOMIC_RELAXED);
        atomic_fetch_add(&cap->held, ap_reserved(p));
    }
    if (owner) {
        atomic_store(&p->keeps_idle, 0); /* the default pool: no MemPool, its cache serves the others */
        atomic_store(&p->lends, 0);      /* ... and it borrows from use_on_oom MemPools (ap_pool_borrows) */
        ap_device_cap_set_limit(p, p->cfg.limit_bytes);
    }
    pthread_mutex_unlock(&p->lock);
    return 0;
}

void ap_device_cap_set_limit(ap_pool *p, size_t limit_bytes) {
    ap_device_cap *cap = p->device_cap;
    if (cap && __atomic_load_n(&cap->owner, __ATOMIC_SEQ_CST) == p) atomic_store(&cap->limit, limit_bytes);
}

int ap_device_cap_book(ap_pool *p, size_t bytes, ap_error *err) {
    ap_device_cap *cap = p->device_cap;
    if (!cap) return AP_OK;
    size_t held = atomic_load(&cap->held);
    for (;;) {
        size_t limit = atomic_load(&cap->limit);
        /* the owner's own limit check came first: this is the other pools' share of it */
        if (limit != AP_NO_LIMIT && (held > limit || bytes > limit - held)) {
            p->cap_refused = 1;
            return ap_set_error(err, AP_E_LIMIT, 0,
                                "the device's memory fraction of %zu bytes reached (the process's pools of device %d "
                                "hold %zu bytes together, MemPools included)", limit, p->device, held);
        }
        if (atomic_compare_exchange_weak(&cap->held, &held, held + bytes)) return AP_OK;
    }
}

size_t ap_device_cap_room(const ap_pool *p) {
    const ap_device_cap *cap = p->device_cap;
    if (!cap) return SIZE_MAX;
    size_t limit = atomic_load(&cap->limit), held = atomic_load(&cap->held);
    if (limit == AP_NO_LIMIT) return SIZE_MAX;
    return held < limit ? limit - held : 0;
}

void ap_device_cap_unbook(ap_pool *p, size_t bytes) {
    if (p->device_cap) atomic_fetch_sub(&p->device_cap->held, bytes);
}

void ap_device_cap_leave(ap_pool *p) {
    ap_device_cap *cap = p->device_cap;
    if (!cap) return;
    atomic_fetch_sub(&cap->held, ap_reserved(p));
    /* The fraction was its limit, unless a default pool made since owns the cap: a default made
       while another was being made (a signal handler's, api.process_default_pool) has the first
       one closed after it joined, and that close lifted the fraction over every MemPool. */
    pthread_mutex_lock(&caps_lock);
    if (__atomic_load_n(&cap->owner, __ATOMIC_SEQ_CST) == p) {
        __atomic_store_n(&cap->owner, NULL, __ATOMIC_SEQ_CST);
        atomic_store(&cap->limit, AP_NO_LIMIT);
    }
    pthread_mutex_unlock(&caps_lock);
    __atomic_store_n(&p->device_cap, NULL, __ATOMIC_RELAXED);
}

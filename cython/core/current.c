#include "current.h"

#include <stdatomic.h>

static _Atomic(ap_pool *) defaults[AP_MAX_DEVICES];
static __thread ap_pool *thread_current[AP_MAX_DEVICES];

ap_pool *ap_current_get(int device) {
    if (device < 0 || device >= AP_MAX_DEVICES) return NULL;
    ap_pool *p = thread_current[device];
    return p ? p : atomic_load_explicit(&defaults[device], memory_order_acquire);
}

ap_pool *ap_current_set(int device, ap_pool *p) {
    if (device < 0 || device >= AP_MAX_DEVICES) return NULL;
    ap_pool *prev = thread_current[device];
    thread_current[device] = p;
    return prev;
}

void ap_default_set(int device, ap_pool *p) {
    if (device >= 0 && device < AP_MAX_DEVICES) atomic_store_explicit(&defaults[device], p, memory_order_release);
}

ap_pool *ap_default_get(int device) {
    if (device < 0 || device >= AP_MAX_DEVICES) return NULL;
    return atomic_load_explicit(&defaults[device], memory_order_acquire);
}

void ap_current_forget(ap_pool *p) {
    for (int d = 0; d < AP_MAX_DEVICES; d++) {
        ap_pool *expected = p;
        atomic_compare_exchange_strong(&defaults[d], &expected, NULL);
        if (thread_current[d] == p) thread_current[d] = NULL;
    }
}

#include "current.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

typedef struct current_entry {
    ap_pool *pool;         /* NULL: the default */
    uint64_t ticket;       /* slot << 32 | generation */
    ap_pool *owner;        /* whose cache the C ABI's empty_cache empties: pool, or for a pool made
                              current by use_mem_pool the owner beneath it (NULL: the default) */
    uint64_t owner_ticket;
} current_entry;

/* A slot's generation is odd while a pool holds it, even when free; bumped at open and close, so
   a closed pool's ticket never matches again, even after the slot is reused. */
typedef struct ticket_slot {
    _Atomic uint32_t gen;
    char label[60]; /* for messages; written at open under table_lock */
} ticket_slot;

static _Atomic(ap_pool *) defaults[AP_MAX_DEVICES];
static __thread current_entry thread_current[AP_MAX_DEVICES];
static ticket_slot tickets[AP_TICKETS]; /* .bss: pages cost nothing until pools use them */
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
static uint32_t next_slot;

static inline uint32_t slot_of(uint64_t t) { return (uint32_t)(t >> 32); }

static inline int ticket_valid(uint64_t t) {
    uint32_t s = slot_of(t);
    return s < AP_TICKETS && atomic_load_explicit(&tickets[s].gen, memory_order_acquire) == (uint32_t)t;
}

uint64_t ap_ticket_open(const char *label) {
    uint64_t t = AP_NO_TICKET;
    pthread_mutex_lock(&table_lock);
    for (uint32_t i = 0; i < AP_TICKETS; i++) {
        uint32_t s = (next_slot + i) % AP_TICKETS;
        uint32_t g = atomic_load_explicit(&tickets[s].gen, memory_order_relaxed);
        if (g & 1) continue; /* held by an open pool */
        snprintf(tickets[s].label, sizeof tickets[s].label, "%s", label ? label : "a pool");
        atomic_store_explicit(&tickets[s].gen, g + 1, memory_order_release);
        next_slot = s + 1; /* round robin: a freed slot is reused as late as possible */
        t = (uint64_t)s << 32 | (g + 1);
        break;
    }
    pthread_mutex_unlock(&table_lock);
    return t;
}

void ap_ticket_close(uint64_t t) {
    uint32_t s = slot_of(t);
    if (t == AP_NO_TICKET || s >= AP_TICKETS) return;
    pthread_mutex_lock(&table_lock);
    uint32_t g = (uint32_t)t;
    /* Only the holder's generation closes it: a second close finds it moved on. */
    atomic_compare_exchange_strong(&tickets[s].gen, &g, g + 1);
    pthread_mutex_unlock(&table_lock);
}

ap_pool *ap_current_get(int device) {
    if (device < 0 || device >= AP_MAX_DEVICES) return NULL;
    current_entry *e = &thread_current[device];
    if (e->pool) return __builtin_expect(ticket_valid(e->ticket), 1) ? e->pool : NULL;
    return atomic_load_explicit(&defaults[device], memory_order_acquire);
}

int ap_current_closed(int device, char *buf, size_t len) {
    if (device < 0 || device >= AP_MAX_DEVICES) return 0;
    current_entry *e = &thread_current[device];
    if (!e->pool || ticket_valid(e->ticket)) return 0;
    if (buf && len) {
        uint32_t s = slot_of(e->ticket);
        pthread_mutex_lock(&table_lock);
        snprintf(buf, len, "%s", s < AP_TICKETS ? tickets[s].label : "a pool");
        pthread_mutex_unlock(&table_lock);
    }
    return 1;
}

void ap_current_set(int device, ap_pool *p, uint64_t ticket, int mem_pool, ap_current_token *prev) {
    if (device < 0 || device >= AP_MAX_DEVICES) return;
    current_entry *e = &thread_current[device];
    if (prev) *prev = (ap_current_token){e->pool, e->ticket, e->owner, e->owner_ticket};
    e->pool = p;
    e->ticket = p ? ticket : AP_NO_TICKET;
    if (!mem_pool || !p) { /* a MemPool keeps its cache: the owner stays the one beneath */
        e->owner = p;
        e->owner_ticket = e->ticket;
    }
}

void ap_current_restore(int device, const ap_current_token *t) {
    if (device < 0 || device >= AP_MAX_DEVICES) return;
    current_entry *e = &thread_current[device];
    e->pool = t->pool;
    e->ticket = t->pool ? t->ticket : AP_NO_TICKET;
    e->owner = t->owner;
    e->owner_ticket = t->owner ? t->owner_ticket : AP_NO_TICKET;
}

ap_pool *ap_current_cache_owner(int device) {
    if (device < 0 || device >= AP_MAX_DEVICES) return NULL;
    current_entry *e = &thread_current[device];
    if (e->owner) return ticket_valid(e->owner_ticket) ? e->owner : NULL;
    return atomic_load_explicit(&defaults[device], memory_order_acquire);
}

void ap_default_set(int device, ap_pool *p) {
    if (device >= 0 && device < AP_MAX_DEVICES) atomic_store_explicit(&defaults[device], p, memory_order_release);
}

ap_pool *ap_default_get(int device) {
    if (device < 0 || device >= AP_MAX_DEVICES) return NULL;
    return atomic_load_explicit(&defaults[device], memory_order_acquire);
}

int ap_current_still(int device, ap_pool *p, int cache_owner) {
    const current_entry *e = &thread_current[device];
    ap_pool *entry = cache_owner ? e->owner : e->pool;
    uint64_t ticket = cache_owner ? e->owner_ticket : e->ticket;
    if (entry) {
        uint32_t s = slot_of(ticket);
        return entry == p && s < AP_TICKETS && atomic_load(&tickets[s].gen) == (uint32_t)ticket;
    }
    return atomic_load(&defaults[device]) == p;
}

void ap_current_forget(ap_pool *p) {
    for (int d = 0; d < AP_MAX_DEVICES; d++) {
        ap_pool *expected = p;
        atomic_compare_exchange_strong(&defaults[d], &expected, NULL);
    }
    /* Threads' entries are left alone: their tickets went stale when p's closed, and a thread
       inside `with ctx:` of a closed context must hear so rather than fall back to the default. */
}

/* The node-wide quota ledger: reserving and releasing device bytes, and the pool's quota hook.
 *
 * The pool calls reserve() under its own lock before every device allocation of a segment, and
 * release() after every device free of one (or after a device malloc that failed after a grant).
 *
 * Concurrency: the tenant's `held` counter is the single arbiter. reserve() loads it, checks
 * held + bytes <= quota, and publishes held + bytes with a compare-and-swap; if another process
 * moved the counter in between, the CAS fails and the check is redone on the fresh value. So the
 * sum of all grants never exceeds the quota at any instant, whatever the number of processes,
 * without any lock. Lowering the quota (a single store) stops growth at once: every later CAS
 * checks against the new value. release() is a fetch-and-subtract (clamped at 0).
 *
 * Each context also records what it holds in its own slot (written only by its process), so that
 * the share of a process that dies can be found and given back (ledger_slots.h). The slot's
 * `pending` field brackets the two steps so that a death between them is detected, not silently
 * miscounted.
 *
 * Refusal: before refusing, the slots of dead processes of the tenant are reclaimed (under the file
 * lock) and the reservation is retried once; the pool then trims its own cache and asks again.
 */
#ifndef AP_LEDGER_RESERVE_H
#define AP_LEDGER_RESERVE_H

#include "ledger_slots.h"

/* One context's membership in a tenant: the quota hook's ctx. */
typedef struct apl_handle {
    apl_ledger *L;          /* a reference: the mapping outlives every handle */
    int tenant, slot;
    int device;
    pid_t pid;              /* the process that claimed the slot (a forked child must not use it) */
    _Atomic int warn_pending; /* set when this context's growth crossed the warn level */
} apl_handle;

/* Why the calling thread's latest reserve() was refused (the pool runs reserve() on the thread
   that called malloc, so the caller reads this right after the failed malloc). Bytes. */
typedef struct apl_refusal {
    int valid;
    int forked;
    uint64_t quota, held, bytes;
} apl_refusal;

static __thread apl_refusal apl_last_refusal;

static uint64_t apl_warn_bytes(uint64_t quota, uint32_t ppm) {
    if (!ppm || quota == APL_NO_QUOTA) return APL_NO_QUOTA;
    return (uint64_t)((unsigned __int128)quota * ppm / 1000000u);
}

/* Test-only crash window: with ASCEND_POOL_TEST_PAUSE_IN_RESERVE=PATH, the first reserve that
   moves the tenant counter creates PATH and stops there, inside its pending bracket (tenant
   counter raised, slot not yet), until the process is killed: a test kills it at exactly the
   moment the bracket exists for. Read once; costs one load per reserve (a miss path) when unset. */
static void apl_test_pause_in_bracket(void) {
    static int state = -1; /* -1 unread, 0 off, 1 armed */
    static const char *path;
    if (state < 0) {
        path = getenv("ASCEND_POOL_TEST_PAUSE_IN_RESERVE");
        state = path && path[0] ? 1 : 0;
    }
    if (state != 1) return;
    int fd = open(path, O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
    if (fd >= 0) close(fd);
    for (;;) pause();
}

/* One lock-free attempt. 0 granted; 1 refused (*held_seen, *quota_seen say why). */
static int apl_try_reserve(apl_handle *h, uint64_t bytes, uint64_t *held_seen, uint64_t *quota_seen) {
    apl_file *f = h->L->f;
    apl_tenant *t = &f->tenants[h->tenant];
    apl_slot *s = &f->slots[h->slot];
    atomic_store(&s->pending, (int64_t)bytes); /* a death from here on is detectable */
    uint64_t held = atomic_load(&t->held);
    for (;;) {
        uint64_t quota = atomic_load(&t->quota);
        if (bytes > quota || held > quota - bytes) { /* held + bytes > quota, without overflow */
            atomic_store(&s->pending, 0);
            *held_seen = held;
            *quota_seen = quota;
            return 1;
        }
        if (atomic_compare_exchange_weak(&t->held, &held, held + bytes)) {
            apl_test_pause_in_bracket();
            atomic_store(&s->held, atomic_load(&s->held) + bytes); /* only this process writes it */
            atomic_store(&s->pending, 0);
            uint64_t now = held + bytes, peak = atomic_load(&t->peak);
            while (now > peak && !atomic_compare_exchange_weak(&t->peak, &peak, now)) {}
            uint64_t warn = apl_warn_bytes(quota, atomic_load(&t->warn_ppm));
            if (held < warn && now >= warn) atomic_store(&h->warn_pending, 1);
            return 0;
        }
        /* Another process moved the counter: `held` now has its value; check again. */
    }
}

/* Reserves bytes for the context; reclaims dead processes' shares once before refusing.
   0 granted; 1 refused (apl_last_refusal and why say why). */
static int apl_reserve(apl_handle *h, uint64_t bytes, char *why, size_t why_len) {
    apl_last_refusal.valid = 0;
    if (getpid() != h->pid) {
        apl_last_refusal = (apl_refusal){1, 1, 0, 0, bytes};
        snprintf(why, why_len, "this tenant context was created by process %d; a forked child (process %d) "
                 "must create its own contexts", (int)h->pid, (int)getpid());
        return 1;
    }
    uint64_t held = 0, quota = 0;
    if (apl_try_reserve(h, bytes, &held, &quota) == 0) return 0;
    uint64_t freed = 0;
    char ignore[256];
    if (apl_reclaim(h->L, h->tenant, &freed, ignore, sizeof ignore) > 0 &&
        apl_try_reserve(h, bytes, &held, &quota) == 0)
        return 0;
    atomic_fetch_add(&h->L->f->tenants[h->tenant].refusals, 1);
    apl_last_refusal = (apl_refusal){1, 0, quota, held, bytes};
    snprintf(why, why_len, "tenant '%s' holds %llu bytes node-wide on device %d, its quota is %llu bytes; a new "
             "segment of %llu bytes would exceed it", h->L->f->tenants[h->tenant].name, (unsigned long long)held,
             h->device, (unsigned long long)quota, (unsigned long long)bytes);
    return 1;
}

static void apl_release(apl_handle *h, uint64_t bytes) {
    if (getpid() != h->pid) return; /* a forked child's copy of the parent's pool: not ours to book */
    apl_file *f = h->L->f;
    apl_slot *s = &f->slots[h->slot];
    uint64_t mine = atomic_load(&s->held);
    if (bytes > mine) bytes = mine; /* never give back more than this context booked */
    /* The slot goes down before the tenant (and in apl_reserve the tenant goes up before the
       slot), so the slots of a tenant never add up to more than its counter, which never exceeds
       the quota: a reader of the ledger never sees a tenant over its quota. */
    atomic_store(&s->pending, -(int64_t)bytes);
    atomic_store(&s->held, mine - bytes);
    apl_tenant_sub(f, &f->tenants[h->tenant], bytes);
    atomic_store(&s->pending, 0);
}

/* 1 once after this context's growth crossed the tenant's warn level (then cleared). */
static int apl_take_warn(apl_handle *h) { return atomic_exchange(&h->warn_pending, 0); }

/* The ap_quota_hook functions (pool.h). */
static int apl_hook_reserve(void *ctx, int device, size_t bytes, char *why, size_t why_len) {
    (void)device;
    return apl_reserve((apl_handle *)ctx, (uint64_t)bytes, why, why_len);
}

static void apl_hook_release(void *ctx, int device, size_t bytes) {
    (void)device;
    apl_release((apl_handle *)ctx, (uint64_t)bytes);
}

/* The tenant's quota (SIZE_MAX: none) and what it holds node-wide now. Lock-free; another
   process may book the difference first (its reserve is then refused). */
static void apl_hook_terms(void *ctx, int device, size_t *quota, size_t *held) {
    (void)device;
    apl_handle *h = ctx;
    apl_tenant *t = &h->L->f->tenants[h->tenant];
    uint64_t q = atomic_load(&t->quota);
    *quota = q >= (uint64_t)SIZE_MAX ? SIZE_MAX : (size_t)q;
    *held = (size_t)atomic_load(&t->held);
}

/* A new handle: attaches to the tenant (claiming a slot). NULL and err on failure. */
static apl_handle *apl_handle_open(apl_ledger *L, const char *name, int set_quota, uint64_t quota, int src, uint32_t stamp,
                                   int set_warn, uint32_t warn_ppm, int *conflict, char *err, size_t len,
                                   int *kind) {
    apl_handle *h = calloc(1, sizeof *h);
    if (!h) {
        *kind = apl_fail(err, len, APL_E_IO, "host memory exhausted");
        return NULL;
    }
    *kind = apl_attach(L, name, set_quota, quota, src, stamp, set_warn, warn_ppm, &h->tenant, &h->slot, conflict, err,
                       len);
    if (*kind != APL_OK) {
        free(h);
        return NULL;
    }
    apl_ref(L);
    h->L = L;
    h->device = L->device;
    h->pid = getpid();
    return h;
}

/* Gives the slot back (what it still holds returns to the tenant) and frees the handle. */
static void apl_handle_close(apl_handle *h) {
    if (!h) return;
    if (getpid() == h->pid) {
        char ignore[256];
        if (apl_detach(h->L, h->tenant, h->slot, ignore, sizeof ignore) != APL_OK)
            apl_release(h, atomic_load(&h->L->f->slots[h->slot].held)); /* lock failed: at least the bytes */
    }
    apl_unref(h->L);
    free(h);
}

#endif

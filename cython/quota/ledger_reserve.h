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
 * miscounted, and its `seq` (odd inside) tells a reclaim when no update is in flight, so that it
 * can make the tenant's counter exact from the slots (ledger_format.h "Invariants"). Two stores
 * per reserve or release, on the path that allocates or frees a segment, never on a cached one.
 *
 * A guarded ledger (a group's, or another user's: ledger_file.h) may be truncated by another
 * process at any time, so there every access to the mapping runs under the SIGBUS guard
 * (ledger_guard.h); a fault marks the ledger broken (L->broken), and from then on this process
 * refuses every reservation on it (a LedgerError naming the file), books no release, and gives
 * nothing back at close: the mapping describes no ledger any more. The pool's own accounting does
 * not depend on the ledger, so a release that faults leaves it whole. A private ledger arms
 * nothing: its hot path is the same load, compare-and-swap and stores.
 *
 * Refusal: before refusing, the slots of dead processes of the tenant are reclaimed (under the file
 * lock) and the reservation is retried once; the pool then trims its own cache and asks again.
 */
#ifndef AP_LEDGER_RESERVE_H
#define AP_LEDGER_RESERVE_H

#include "invariant.h"
#include "ledger_foreign.h"
#include "ledger_slots.h"
#include "ledger_view.h"

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
    int broken;             /* the ledger's file shrank under this process (a guarded ledger) */
} apl_refusal;

static __thread apl_refusal apl_last_refusal;

/* Runs `body` on L's mapping: as it is for a private ledger; for a guarded one (L->guarded) under
   the SIGBUS guard, where a fault gives back the ledger's lock if the body held it, marks L broken
   and sets `bus` (a volatile int of the caller's, 0 before); a broken L runs nothing and sets it. */
#define APL_ON_MAPPING(L, body, bus)                                                     \
    do {                                                                               \
        if (!(L)->guarded) {                                                           \
            body;                                                                      \
            break;                                                                     \
        }                                                                              \
        if (atomic_load(&(L)->broken)) {                                               \
            bus = 1;                                                                   \
            break;                                                                     \
        }                                                                              \
        sigjmp_buf env; /* the name APL_GUARDED_AT takes */                                \
        APL_GUARDED_AT(env, (L)->f, sizeof(apl_file), body, (apl_unlock_if_held(L), bus = 1)); \
        if (bus)                                                                       \
            atomic_store(&(L)->broken, 1);                                             \
    } while (0)

static uint64_t apl_warn_bytes(uint64_t quota, uint32_t ppm) {
    if (!ppm || quota == APL_NO_QUOTA) return APL_NO_QUOTA;
    return (uint64_t)((unsigned __int128)quota * ppm / 1000000u);
}

/* Test-only crash window (apl_test_pause): inside the pending bracket of the first reserve that
   moves the tenant counter (tenant counter raised, slot not yet). */
static apl_pause_point apl_pause_in_reserve;

/* One lock-free attempt. 0 granted; 1 refused (*held_seen, *quota_seen say why). */
static int apl_try_reserve(apl_handle *h, uint64_t bytes, uint64_t *held_seen, uint64_t *quota_seen) {
    apl_file *f = h->L->f;
    apl_tenant *t = &f->tenants[h->tenant];
    apl_slot *s = &f->slots[h->slot];
    uint64_t seq = atomic_load(&s->seq); /* only this process writes it: even between updates */
    AP_ASSERT((seq & 1) == 0);
    atomic_store(&s->seq, seq + 1);            /* inside an update: no reconcile reads across it */
    atomic_store(&s->pending, (int64_t)bytes); /* a death from here on is detectable */
    uint64_t held = atomic_load(&t->held);
    for (;;) {
        uint64_t quota = atomic_load(&t->quota);
        if (bytes > quota || held > quota - bytes) { /* held + bytes > quota, without overflow */
            atomic_store(&s->pending, 0);
            atomic_store(&s->seq, seq + 2);
            *held_seen = held;
            *quota_seen = quota;
            return 1;
        }
        if (atomic_compare_exchange_weak(&t->held, &held, held + bytes)) {
            apl_test_pause(&apl_pause_in_reserve, "ASCEND_POOL_TEST_PAUSE_IN_RESERVE");
            atomic_store(&s->held, atomic_load(&s->held) + bytes); /* only this process writes it */
            atomic_store(&s->pending, 0);
            atomic_store(&s->seq, seq + 2);
            uint64_t now = held + bytes, peak = atomic_load(&t->peak);
            while (now > peak && !atomic_compare_exchange_weak(&t->peak, &peak, now)) {}
            uint64_t warn = apl_warn_bytes(quota, atomic_load(&t->warn_ppm));
            if (held < warn && now >= warn) atomic_store(&h->warn_pending, 1);
            return 0;
        }
        /* Another process moved the counter: `held` now has its value; check again. */
    }
}

/* A guarded ledger that faulted: the refusal (apl_last_refusal.broken) and its reason. */
static int apl_refuse_broken(apl_handle *h, uint64_t bytes, char *why, size_t why_len) {
    atomic_store(&h->L->broken, 1);
    apl_last_refusal = (apl_refusal){1, 0, 0, 0, bytes, 1};
    snprintf(why, why_len, "ledger %s shrank while this process used it (truncated by another process that "
             "can write it); this process no longer books in it, so its tenant contexts on device %d are "
             "refused new device memory (open a new context once the file is whole again)", h->L->path,
             h->device);
    return 1;
}

/* Set by a refusal whose give-back of dead processes' shares was skipped because the ledger's lock
   was held (apl_reserve_ms with lock_ms 0): the pool's settle (apl_hook_settle) then waits for it
   with the pool's lock dropped. */
static __thread int apl_reclaim_skipped;

/* Reserves bytes for the context; reclaims dead processes' shares once before refusing (a guarded
   ledger's under the lock given back if it faults: apl_reclaim_checked), waiting at most lock_ms
   for the ledger's lock (0: only if it is free; the pool's hook, under the pool's lock).
   0 granted; 1 refused (apl_last_refusal and why say why). */
static int apl_reserve_ms(apl_handle *h, uint64_t bytes, int lock_ms, char *why, size_t why_len) {
    apl_last_refusal.valid = 0;
    apl_reclaim_skipped = 0;
    if (getpid() != h->pid) {
        apl_last_refusal = (apl_refusal){1, 1, 0, 0, bytes, 0};
        snprintf(why, why_len, "this tenant context was created by process %d; a forked child (process %d) "
                 "must create its own contexts", (int)h->pid, (int)getpid());
        return 1;
    }
    apl_ledger *L = h->L;
    volatile int r = 1, bus = 0;
    uint64_t held = 0, quota = 0;
    APL_ON_MAPPING(L, r = apl_try_reserve(h, bytes, &held, &quota), bus);
    if (bus) return apl_refuse_broken(h, bytes, why, why_len);
    if (r == 0) return 0;
    uint64_t freed = 0;
    char ignore[256];
    int n = L->guarded ? apl_reclaim_checked(L, lock_ms, 1, &freed, ignore, sizeof ignore)
                       : apl_reclaim_ms(L, h->tenant, lock_ms, &freed, ignore, sizeof ignore);
    if (n == -2) return apl_refuse_broken(h, bytes, why, why_len);
    if (n == -1 && lock_ms == 0) apl_reclaim_skipped = 1;
    if (n > 0 || (n == 0 && freed > 0)) { /* freed alone: an open update's bytes made exact */
        APL_ON_MAPPING(L, r = apl_try_reserve(h, bytes, &held, &quota), bus);
        if (bus) return apl_refuse_broken(h, bytes, why, why_len);
        if (r == 0) return 0;
    }
    char name[APL_NAME_MAX + 1];
    memset(name, 0, sizeof name);
    APL_ON_MAPPING(L,
                   (atomic_fetch_add(&L->f->tenants[h->tenant].refusals, 1),
                    memcpy(name, (const void *)L->f->tenants[h->tenant].name, APL_NAME_MAX)),
                   bus);
    if (bus) return apl_refuse_broken(h, bytes, why, why_len);
    apl_last_refusal = (apl_refusal){1, 0, quota, held, bytes, 0};
    snprintf(why, why_len, "tenant '%s' holds %llu bytes node-wide on device %d, its quota is %llu bytes; a new "
             "segment of %llu bytes would exceed it", name, (unsigned long long)held, h->device,
             (unsigned long long)quota, (unsigned long long)bytes);
    return 1;
}

static int apl_reserve(apl_handle *h, uint64_t bytes, char *why, size_t why_len) {
    return apl_reserve_ms(h, bytes, APL_LOCK_TIMEOUT_MS, why, why_len);
}

static void apl_release_mapped(apl_handle *h, uint64_t bytes);

/* A fault (a guarded ledger) leaves the pool as it is (it freed its segment either way); the
   ledger is broken, and nothing more is booked in it. */
static void apl_release(apl_handle *h, uint64_t bytes) {
    if (getpid() != h->pid) return; /* a forked child's copy of the parent's pool: not ours to book */
    volatile int bus = 0;
    APL_ON_MAPPING(h->L, apl_release_mapped(h, bytes), bus);
    (void)bus;
}

static void apl_release_mapped(apl_handle *h, uint64_t bytes) {
    apl_file *f = h->L->f;
    apl_slot *s = &f->slots[h->slot];
    uint64_t mine = atomic_load(&s->held);
    if (bytes > mine) bytes = mine; /* never give back more than this context booked */
    /* The slot goes down before the tenant (and in apl_reserve the tenant goes up before the
       slot), so the slots of a tenant never add up to more than its counter, which never exceeds
       the quota: a reader of the ledger never sees a tenant over its quota. */
    uint64_t seq = atomic_load(&s->seq);
    AP_ASSERT((seq & 1) == 0);
    atomic_store(&s->seq, seq + 1);
    atomic_store(&s->pending, -(int64_t)bytes);
    atomic_store(&s->held, mine - bytes);
    apl_tenant *t = &f->tenants[h->tenant];
    apl_tenant_sub(f, t, bytes);
    atomic_store(&s->pending, 0);
    atomic_store(&s->seq, seq + 2);
    /* A crossing of the warn level that did not last (the device refused the segment just booked,
       or it went back before the malloc returned) is no warning: malloc reports it afterwards and
       would say the tenant is past a level it is below. */
    if (atomic_load(&t->held) < apl_warn_bytes(atomic_load(&t->quota), atomic_load(&t->warn_ppm)))
        atomic_store(&h->warn_pending, 0);
}

/* 1 when a guarded access to L's mapping faulted (the file shrank): L is not used again. */
static int apl_is_broken(apl_ledger *L) { return atomic_load(&L->broken); }

/* 1 once after this context's growth crossed the tenant's warn level (then cleared). */
static int apl_take_warn(apl_handle *h) { return atomic_exchange(&h->warn_pending, 0); }

/* The ap_quota_hook functions (pool.h). reserve runs under the pool's lock: it never waits for
   the ledger's lock (a process stopped inside an update held every thread of the pool 10 s per
   try, cached mallocs and frees included); settle does, the pool's lock dropped. */
static int apl_hook_reserve(void *ctx, int device, size_t bytes, char *why, size_t why_len) {
    (void)device;
    return apl_reserve_ms((apl_handle *)ctx, (uint64_t)bytes, 0, why, why_len);
}

/* After the calling thread's refusal that skipped the give-back (apl_reclaim_skipped): gives back
   the shares of the tenant's dead processes, waiting for the ledger's lock as a reserve did
   before. 1 when some came back. */
static int apl_hook_settle(void *ctx, int device) {
    (void)device;
    apl_handle *h = ctx;
    if (!apl_reclaim_skipped || getpid() != h->pid) return 0;
    apl_reclaim_skipped = 0;
    apl_ledger *L = h->L;
    uint64_t freed = 0;
    char ignore[256];
    int n = L->guarded ? apl_reclaim_checked(L, APL_LOCK_TIMEOUT_MS, 1, &freed, ignore, sizeof ignore)
                       : apl_reclaim(L, h->tenant, &freed, ignore, sizeof ignore);
    return n > 0 || (n == 0 && freed > 0);
}

static void apl_hook_release(void *ctx, int device, size_t bytes) {
    (void)device;
    apl_release((apl_handle *)ctx, (uint64_t)bytes);
}

/* The tenant's quota (SIZE_MAX: none) and what it holds node-wide now. Lock-free; another
   process may book the difference first (its reserve is then refused). */
static void apl_read_terms(apl_handle *h, uint64_t *quota, uint64_t *held) {
    apl_tenant *t = &h->L->f->tenants[h->tenant];
    *quota = atomic_load(&t->quota);
    *held = atomic_load(&t->held);
}

static void apl_hook_terms(void *ctx, int device, size_t *quota, size_t *held) {
    (void)device;
    apl_handle *h = ctx;
    uint64_t q = 0, hd = 0;
    volatile int bus = 0;
    APL_ON_MAPPING(h->L, apl_read_terms(h, &q, &hd), bus);
    if (bus) q = hd = 0; /* a broken ledger: no room (its reservations are refused) */
    *quota = q >= (uint64_t)SIZE_MAX ? SIZE_MAX : (size_t)q;
    *held = (size_t)hd;
}

/* A copy of the handle's tenant and slot entries (LedgerQuota.state). 0; -1 when the ledger is
   broken (a guarded ledger that shrank). */
static int apl_read_entries(apl_handle *h, apl_tenant *t, apl_slot *s) {
    volatile int bus = 0;
    APL_ON_MAPPING(h->L,
                   (memcpy(t, (const void *)&h->L->f->tenants[h->tenant], sizeof *t),
                    memcpy(s, (const void *)&h->L->f->slots[h->slot], sizeof *s)),
                   bus);
    return bus ? -1 : 0;
}

/* The header (*hdr) and apl_copy_tables of the ledger's mapping (Ledger.view()), guarded where it
   must be. 1 consistent, 0 not (ledger_view.h), -1 when the ledger is broken. */
static int apl_copy_tables_of(apl_ledger *L, apl_header *hdr, apl_tables *out, apl_tables *scratch) {
    volatile int r = 0, bus = 0;
    APL_ON_MAPPING(L, (memcpy(hdr, (const void *)&L->f->h, sizeof *hdr), r = apl_copy_tables(L->f, out, scratch)),
                   bus);
    return bus ? -1 : r;
}

/* apl_set_quota, guarded where it must be (the lock given back if the body faults). -2 with err
   when the ledger is broken. */
static int apl_set_quota_of(apl_ledger *L, int tenant, uint64_t quota, uint32_t warn_ppm, int src, uint32_t stamp,
                            char *err, size_t len) {
    volatile int r = -2, bus = 0;
    APL_ON_MAPPING(L, r = apl_set_quota(L, tenant, quota, warn_ppm, src, stamp, err, len), bus);
    if (bus) {
        apl_fail(err, len, APL_E_MALFORMED, "ledger %s shrank while this process used it (truncated by another "
                 "process that can write it); open a new context once the file is whole again", L->path);
        return -2;
    }
    return r;
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
    volatile int k = APL_E_MALFORMED, bus = 0;
    APL_ON_MAPPING(L,
                   k = apl_attach(L, name, set_quota, quota, src, stamp, set_warn, warn_ppm, &h->tenant, &h->slot,
                                  conflict, err, len),
                   bus);
    if (bus)
        k = apl_fail(err, len, APL_E_MALFORMED, "ledger %s shrank while this process used it (truncated by "
                     "another process that can write it); open it again once the file is whole", L->path);
    *kind = k;
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
    if (getpid() == h->pid) { /* a broken ledger gets nothing back (it describes nothing) */
        char ignore[256];
        volatile int bus = 0, rc = APL_OK;
        volatile uint64_t held = 0;
        APL_ON_MAPPING(h->L, rc = apl_detach(h->L, h->tenant, h->slot, ignore, sizeof ignore), bus);
        if (!bus && rc != APL_OK) { /* lock failed: at least the bytes */
            APL_ON_MAPPING(h->L, held = atomic_load(&h->L->f->slots[h->slot].held), bus);
            if (!bus) apl_release(h, held);
        }
    }
    apl_unref(h->L);
    free(h);
}

#endif

/* The node-wide quota ledger: tenants, process slots, and giving back the share of dead processes.
 *
 * Everything here runs under the file lock (ledger_file.h): these are the rare, multi-field
 * changes. The hot pair, reserve/release, is in ledger_reserve.h and takes no lock.
 *
 * Lifetime of a tenant entry: it lives as long as some process has a slot for it. The first
 * process to attach to a tenant that has no live slot starts it afresh (held 0, its own quota), so
 * a quota from a run long gone never lingers; its counters (refusals, conflicts) and peak go on,
 * as exported counters must. An entry with no slot is reused (everything zeroed) when the table
 * fills.
 *
 * Quota: one source of truth per tenant. The operator's tenants file wins when it names a quota
 * (APL_SRC_OPERATOR); otherwise processes' declarations resolve to the stricter one, so a process
 * never lifts a limit another relies on. Every declaration that disagrees with the quota in force
 * is counted in the tenant's `conflicts` (exported; the Python layer logs the first one).
 *
 * Reclaiming a dead process's slot (its lease is no longer held: proc_identity.h) subtracts
 * what the slot held from the tenant's counter. The one ambiguity: a process killed between the
 * two steps of reserve or release (the tenant's compare-and-swap and its own slot update, a few
 * instructions apart), or of a slot's clear (a reclaimer's give-back, a context's close: the slot
 * goes down first, as in a release), leaves `pending` set, and nobody can know whether the tenant
 * counter moved.
 * The reclaimer assumes the move that leaves the counter *higher* (the tenant can only be refused
 * early, never allowed past its quota) and records the difference in `uncertain`; then, in the
 * same reclaim, it makes the counter exact from the live slots (apl_tenant_reconcile: a reading
 * no update was in flight across, told by the slots' seq; ledger_format.h "Invariants"), and the
 * uncertainty disappears. Before, it stayed counted until the tenant had no live slot left: a
 * serving tenant never idles, so each process killed inside its booking shrank its usable quota
 * for good. Where a live process is inside an update at every try (stopped there: a paused
 * container), the bytes stay uncertain and the next reclaim tries again. When the tenant has no
 * live slot left, nobody can be reserving for it (slots are claimed under this lock), so its
 * counter is reset to exactly 0.
 */
#ifndef AP_LEDGER_SLOTS_H
#define AP_LEDGER_SLOTS_H

#include "ledger_file.h"
#include "proc_identity.h"

/* Test-only crash windows: with the point's variable set to PATH (ASCEND_POOL_TEST_PAUSE_IN_RESERVE,
   ..._IN_RECLAIM), the first pass through the point creates PATH and stops there until the process
   is killed: a test kills it at exactly the moment a window exists for. Read once; one load per
   pass when unset. Several threads may pass first at once (pools of different tenants grow under
   their own locks): the state is published after the path (release/acquire); a plain pair was a
   data race. */
typedef struct apl_pause_point {
    _Atomic int state;         /* 0 unread, 1 off, 2 armed */
    const char *_Atomic path;
} apl_pause_point;

static void apl_test_pause(apl_pause_point *p, const char *var) {
    int st = atomic_load_explicit(&p->state, memory_order_acquire);
    if (st == 0) {
        const char *env = getenv(var);
        atomic_store_explicit(&p->path, env, memory_order_relaxed);
        st = env && env[0] ? 2 : 1;
        atomic_store_explicit(&p->state, st, memory_order_release);
    }
    if (st != 2) return;
    int fd = open(atomic_load_explicit(&p->path, memory_order_relaxed), O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
    if (fd >= 0) close(fd);
    for (;;) pause();
}

static apl_pause_point apl_pause_in_reclaim; /* inside apl_slot_clear of a dead process's slot */

static int apl_find_tenant(const apl_file *f, const char *name) {
    for (int i = 0; i < APL_TENANTS; i++)
        if (atomic_load_explicit(&f->tenants[i].state, memory_order_acquire) == APL_USED &&
            strncmp(f->tenants[i].name, name, APL_NAME_MAX) == 0)
            return i;
    return -1;
}

static int apl_tenant_live_slots(const apl_file *f, int tenant) {
    int n = 0;
    for (int i = 0; i < APL_SLOTS; i++)
        if (atomic_load(&f->slots[i].state) == APL_USED && f->slots[i].tenant == (uint32_t)tenant) n++;
    return n;
}

/* Lowers a tenant's held counter by bytes, never below 0 (a lower counter would let it past its
   quota, so an impossible underflow is clamped and the tenant is marked uncertain instead). */
static void apl_tenant_sub(apl_file *f, apl_tenant *t, uint64_t bytes) {
    uint64_t held = atomic_load(&t->held);
    for (;;) {
        uint64_t next = held >= bytes ? held - bytes : 0;
        if (atomic_compare_exchange_weak(&t->held, &held, next)) {
            if (held < bytes) {
                atomic_fetch_add(&t->uncertain, bytes - held);
                atomic_fetch_add(&f->h.uncertain_bytes, bytes - held);
            }
            return;
        }
    }
}

/* A tenant with no slot left: nobody can be reserving, so the counter can be made exact. */
static void apl_tenant_settle_if_idle(apl_file *f, int tenant) {
    if (apl_tenant_live_slots(f, tenant) == 0) {
        atomic_store(&f->tenants[tenant].held, 0);
        atomic_store(&f->tenants[tenant].uncertain, 0);
    }
}

/* Tries at a consistent reading of a tenant's slots per reconcile: a reserve's bracket is a few
   instructions, so a second try finds one that was in flight done; no wait (a pool's lock may be
   held: the hook's reserve reclaims under it). */
#define APL_RECONCILE_TRIES 4

/* Makes tenant t's counter exact once some of it is uncertain (dead processes' shares that may or
   may not have moved it): reads every used slot's seq, the counter, every slot's held and seq
   again; if no slot was inside an update across that (each seq even and unchanged), the counter
   less the slots' sum is what the dead left counted, taken off (or, negative, put back: the safe
   side), and uncertain goes to 0. Under the lock: no slot is claimed or freed meanwhile. Returns
   the bytes given back (0: none, or a live process inside an update at every try: the next
   reclaim tries again). */
static uint64_t apl_tenant_reconcile(apl_file *f, int tenant) {
    apl_tenant *T = &f->tenants[tenant];
    if (atomic_load(&T->uncertain) == 0) return 0;
    uint64_t seqs[APL_SLOTS];
    for (int attempt = 0; attempt < APL_RECONCILE_TRIES; attempt++) {
        int busy = 0;
        for (int i = 0; i < APL_SLOTS && !busy; i++) {
            const apl_slot *s = &f->slots[i];
            if (atomic_load(&s->state) != APL_USED || s->tenant != (uint32_t)tenant) continue;
            seqs[i] = atomic_load(&s->seq);
            busy = (seqs[i] & 1) != 0;
        }
        if (busy) continue;
        uint64_t held = atomic_load(&T->held), sum = 0;
        for (int i = 0; i < APL_SLOTS && !busy; i++) {
            const apl_slot *s = &f->slots[i];
            if (atomic_load(&s->state) != APL_USED || s->tenant != (uint32_t)tenant) continue;
            uint64_t h = atomic_load(&s->held);
            int64_t pending = atomic_load(&s->pending);
            sum += h > APL_MAX_BYTES ? APL_MAX_BYTES : h; /* checked at each step: never past 2^61 */
            /* pending or a sum past any device: a file written by hand, never made exact */
            busy = atomic_load(&s->seq) != seqs[i] || pending != 0 || sum > APL_MAX_BYTES;
        }
        if (busy) continue;
        uint64_t back = 0;
        if (held > sum) {
            back = held - sum;
            apl_tenant_sub(f, T, back); /* relative: live updates since go on on top of it */
        } else if (held < sum) {
            atomic_fetch_add(&T->held, sum - held);
        }
        atomic_store(&T->uncertain, 0);
        return back;
    }
    return 0;
}

/* Empties slot i (under the lock), returning what it held to its tenant. Does not settle. */
static uint64_t apl_slot_clear(apl_file *f, int i, int dead) {
    apl_slot *s = &f->slots[i];
    apl_tenant *t = &f->tenants[s->tenant];
    uint64_t held = atomic_load(&s->held);
    int64_t pending = atomic_load(&s->pending);
    uint64_t u = pending > 0 ? (uint64_t)pending : (uint64_t)-pending;
    /* Inside a release (pending < 0) the slot was already lowered; whether the tenant was too is
       unknown, so only what the slot still holds goes back (at worst the tenant stays counted
       too high by the pending bytes, recorded as uncertain: early refusals, never an overrun).
       The slot goes down first, its bytes marked pending, as a release does: this clearer killed
       before the tenant moved, or after (the lock is dropped with it), leaves a slot that holds
       nothing, so the next clear gives nothing back twice and counts the bytes as uncertain.
       Before, it gave them back again, lowering the tenant below what its live processes hold:
       past its quota. */
    atomic_store(&s->seq, (atomic_load(&s->seq) | 1) + 2); /* odd: inside an update (dead: any value) */
    if (held) {
        uint64_t mark = held + u > APL_MAX_BYTES ? APL_MAX_BYTES : held + u; /* the file's bound */
        atomic_store(&s->pending, -(int64_t)mark);
        atomic_store(&s->held, 0);
    }
    apl_tenant_sub(f, t, held);
    if (dead) apl_test_pause(&apl_pause_in_reclaim, "ASCEND_POOL_TEST_PAUSE_IN_RECLAIM");
    if (u) {
        atomic_fetch_add(&t->uncertain, u);
        atomic_fetch_add(&f->h.uncertain_bytes, u);
    }
    if (dead) {
        atomic_fetch_add(&f->h.reclaimed_slots, 1);
        atomic_fetch_add(&f->h.reclaimed_bytes, held);
    }
    atomic_store(&s->pending, 0);
    atomic_store(&s->seq, 0);
    s->pid = 0;
    s->instance = 0;
    s->pidns = 0;
    s->start_time = 0;
    atomic_store_explicit(&s->state, APL_FREE, memory_order_release);
    return held;
}

/* Gives back the slots of dead processes (of one tenant, or all when tenant < 0). Under the lock.
   Returns the number of slots reclaimed; *bytes (optional) gets the bytes they held. */
static int apl_reclaim_locked(apl_ledger *L, int tenant, uint64_t *bytes) {
    apl_file *f = L->f;
    int n = 0;
    uint64_t total = 0;
    uint64_t touched = 0; /* bit per tenant */
    for (int i = 0; i < APL_SLOTS; i++) {
        apl_slot *s = &f->slots[i];
        if (atomic_load(&s->state) != APL_USED) continue;
        if (s->tenant >= APL_TENANTS) continue; /* validated at open; never index with a bad value */
        if (tenant >= 0 && s->tenant != (uint32_t)tenant) continue;
        /* By lease, never by pid: a pid may belong to another namespace (proc_identity.h). */
        if (apl_owner_alive(L->dir, s->instance, s->pid, s->pidns, s->start_time, L->fd) != 0)
            continue; /* alive, or cannot tell: keep */
        touched |= 1ull << s->tenant;
        total += apl_slot_clear(f, i, 1);
        n++;
    }
    for (int t = 0; t < APL_TENANTS; t++) {
        if (tenant >= 0 && t != tenant) continue;
        if (touched & (1ull << t)) apl_tenant_settle_if_idle(f, t);
        if (atomic_load(&f->tenants[t].state) != APL_USED) continue;
        uint64_t back = apl_tenant_reconcile(f, t); /* what dead processes' open updates left counted */
        if (back) {
            atomic_fetch_add(&f->h.reclaimed_bytes, back);
            total += back;
        }
    }
    if (bytes) *bytes = total;
    return n;
}

/* Locks (waiting at most lock_ms), reclaims dead slots, unlocks. -1 when the lock could not be taken. */
static int apl_reclaim_ms(apl_ledger *L, int tenant, int lock_ms, uint64_t *bytes, char *err, size_t len) {
    if (apl_lock_ms(L, lock_ms, err, len) != APL_OK) return -1;
    int n = apl_reclaim_locked(L, tenant, bytes);
    apl_unlock(L);
    return n;
}

static int apl_reclaim(apl_ledger *L, int tenant, uint64_t *bytes, char *err, size_t len) {
    return apl_reclaim_ms(L, tenant, APL_LOCK_TIMEOUT_MS, bytes, err, len);
}

/* Applies a quota declaration to a live tenant (under the lock): the operator's (src
   APL_SRC_OPERATOR) replaces any declared one; a declared one never overrides the operator's and
   never raises the quota in force (the stricter wins). Returns 1 when it disagreed (counted). */
/* A live tenant's quota meets another process's declaration. 0: they agree; 1: the quota in
   force stays; 2: the declaration replaced it. The operator's file wins over declarations; of
   two operator files that disagree, the newer (stamp: its modification time, s): a ConfigMap
   update reaching pods at different times is applied by the first pod that has it, a pod still
   starting with the older file changes nothing (the stricter of the two stayed before: a raise
   rolled out by restarting pods never took effect); of two files of the same second, the later
   declaration's. */
static int apl_declare_quota(apl_tenant *T, uint64_t quota, int src, uint32_t stamp) {
    uint64_t old = atomic_load(&T->quota);
    int old_src = (int)atomic_load(&T->quota_src);
    uint32_t old_stamp = atomic_load(&T->quota_stamp);
    int conflict = old_src != APL_SRC_NONE && quota != old, replaced = 0;
    if (old_src == APL_SRC_OPERATOR && src == APL_SRC_OPERATOR) {
        if (stamp >= old_stamp) {
            atomic_store(&T->quota, quota);
            atomic_store(&T->quota_stamp, stamp);
            replaced = quota != old;
        }
    } else if (src == APL_SRC_OPERATOR || old_src == APL_SRC_NONE) {
        atomic_store(&T->quota, quota);
        atomic_store(&T->quota_src, quota == APL_NO_QUOTA && src != APL_SRC_OPERATOR ? APL_SRC_NONE : (uint32_t)src);
        atomic_store(&T->quota_stamp, src == APL_SRC_OPERATOR ? stamp : 0);
        replaced = 1;
    } else if (old_src == APL_SRC_DECLARED && src == APL_SRC_DECLARED && quota < old) {
        atomic_store(&T->quota, quota); /* stricter */
        replaced = 1;
    } /* else: the operator's quota, or a stricter declaration, stays */
    if (conflict) atomic_fetch_add(&T->conflicts, 1);
    return conflict ? 1 + replaced : 0;
}

/* Takes this process's life lock on the ledger (proc_identity.h apl_life_offset), once per process
   and ledger, before it claims a slot; held until the process ends (a forked child takes its own at
   its first claim). Its own descriptor, opened read-only, that a forked child drops (fork.c): holding
   the lock, the child would keep a killed parent alive. It is registered for that before the lock
   is taken, with no fork between its open and its registration (fork.c's window); where it cannot
   be registered (the table full) or had (a kernel before 3.15, the path replaced), only the lease
   tells. Under the lock (L->mu: one thread sets it). */
static void apl_life_hold(apl_ledger *L, uint64_t instance) {
    if (L->life_fd >= 0 && L->life_pid == getpid()) return;
    if (L->life_fd >= 0) { /* a forked child's copy (/dev/null after fork.c, else the parent's file) */
        apl_dropped_close(L->life_fd);
        L->life_fd = -1;
    }
    int registered;
    int fd = apl_dropped_open(L->path, O_RDONLY | O_NOFOLLOW, 0, &registered);
    if (fd >= 0 && !registered) close(fd);
    if (!registered) return;
    struct stat st;
    struct flock fl = apl_life_range(instance, F_RDLCK);
    if (fstat(fd, &st) != 0 || st.st_dev != L->st_dev || st.st_ino != L->st_ino ||
        fcntl(fd, F_OFD_SETLK, &fl) != 0) {
        apl_dropped_close(fd);
        return;
    }
    L->life_fd = fd;
    L->life_pid = getpid();
}

/* Finds or creates tenant `name` and claims a slot for this process in it.
 * quota: bytes or APL_NO_QUOTA; set_quota: 0 joins a live tenant on its terms (a context created
 * with quota=None), else the declaration is applied as apl_declare_quota says, with source src.
 * warn_ppm likewise with set_warn. *conflict_out (optional): apl_declare_quota's answer (1 the quota
 * in force stayed, 2 the declaration replaced it) when the declaration disagreed, else 0. */
static int apl_attach(apl_ledger *L, const char *name, int set_quota, uint64_t quota, int src, uint32_t stamp,
                      int set_warn,
                      uint32_t warn_ppm, int *tenant_out, int *slot_out, int *conflict_out, char *err,
                      size_t len) {
    if (conflict_out) *conflict_out = 0;
    if (atomic_load(&apl_self_instance) == 0)
        return apl_fail(err, len, APL_E_ARG, "internal: this process has no lease (identity) to claim a slot with");
    if (!apl_name_ok(name, APL_NAME_MAX))
        return apl_fail(err, len, APL_E_ARG, "tenant name '%.80s' is not 1-63 of A-Z a-z 0-9 _ . -", name);
    int rc = apl_lock(L, err, len);
    if (rc != APL_OK) return rc;
    apl_file *f = L->f;
    int t = apl_find_tenant(f, name);
    int same_name = t >= 0;
    if (t >= 0) apl_reclaim_locked(L, t, NULL); /* a crashed run's slots must not keep it alive */
    int fresh = t < 0 || apl_tenant_live_slots(f, t) == 0;
    if (t < 0) {
        for (int i = 0; i < APL_TENANTS && t < 0; i++)
            if (atomic_load(&f->tenants[i].state) == APL_FREE) t = i;
        if (t < 0) { /* full: reuse an entry nobody holds a slot in, after reclaiming the dead */
            apl_reclaim_locked(L, -1, NULL);
            for (int i = 0; i < APL_TENANTS && t < 0; i++)
                if (apl_tenant_live_slots(f, i) == 0) t = i;
        }
        if (t < 0) {
            apl_unlock(L);
            return apl_fail(err, len, APL_E_FULL, "ledger %s is full: %d tenants have live processes on device %d",
                            L->path, APL_TENANTS, L->device);
        }
        atomic_store(&f->tenants[t].state, APL_FREE);
        memset(f->tenants[t].name, 0, APL_NAME_MAX);
        snprintf(f->tenants[t].name, APL_NAME_MAX, "%s", name);
    }
    apl_tenant *T = &f->tenants[t];
    if (fresh) { /* nobody holds anything under this name: start it afresh */
        atomic_store(&T->held, 0);
        atomic_store(&T->uncertain, 0);
        if (!same_name) {
            /* The counters and the peak stay with the name while its entry does: they are
               exported under the tenant's labels, and a service that opens a context per
               request leaves its tenant without a slot between requests (zeroed, refusals read
               the same at every scrape while they went on: a rate of 0). */
            atomic_store(&T->peak, 0);
            atomic_store(&T->refusals, 0);
            atomic_store(&T->conflicts, 0);
        }
        atomic_store(&T->quota, set_quota ? quota : APL_NO_QUOTA);
        atomic_store(&T->quota_src, set_quota && (quota != APL_NO_QUOTA || src == APL_SRC_OPERATOR) ? (uint32_t)src
                                                                                                   : APL_SRC_NONE);
        atomic_store(&T->quota_stamp, set_quota && src == APL_SRC_OPERATOR ? stamp : 0);
        atomic_store(&T->warn_ppm, set_warn ? warn_ppm : 0);
    } else {
        int c = set_quota ? apl_declare_quota(T, quota, src, stamp) : 0;
        if (conflict_out) *conflict_out = c;
        if (set_warn && (src == APL_SRC_OPERATOR || atomic_load(&T->quota_src) != APL_SRC_OPERATOR))
            atomic_store(&T->warn_ppm, warn_ppm);
    }
    atomic_store_explicit(&T->state, APL_USED, memory_order_release);

    int s = -1;
    for (int pass = 0; pass < 2 && s < 0; pass++) {
        if (pass == 1) apl_reclaim_locked(L, -1, NULL);
        for (int i = 0; i < APL_SLOTS && s < 0; i++)
            if (atomic_load(&f->slots[i].state) == APL_FREE) s = i;
    }
    if (s < 0) {
        if (fresh) apl_tenant_settle_if_idle(f, t);
        apl_unlock(L);
        return apl_fail(err, len, APL_E_FULL, "ledger %s is full: %d contexts are live on device %d", L->path,
                        APL_SLOTS, L->device);
    }
    apl_life_hold(L, atomic_load(&apl_self_instance)); /* before the slot is published */
    apl_slot *S = &f->slots[s];
    S->pid = getpid();
    S->instance = atomic_load(&apl_self_instance);
    S->pidns = atomic_load(&apl_self_pidns);
    S->start_time = apl_proc_start_time(S->pid);
    S->tenant = (uint32_t)t;
    atomic_store(&S->held, 0);
    atomic_store(&S->pending, 0);
    atomic_store(&S->seq, 0);
    atomic_store_explicit(&S->state, APL_USED, memory_order_release); /* published last */
    apl_unlock(L);
    *tenant_out = t;
    *slot_out = s;
    return APL_OK;
}

/* Gives up this process's slot (its context closed): whatever it still held goes back to the tenant. */
static int apl_detach(apl_ledger *L, int tenant, int slot, char *err, size_t len) {
    int rc = apl_lock(L, err, len);
    if (rc != APL_OK) return rc;
    apl_slot *S = &L->f->slots[slot];
    if (atomic_load(&S->state) == APL_USED && S->pid == getpid() && S->tenant == (uint32_t)tenant &&
        S->instance == atomic_load(&apl_self_instance)) {
        apl_slot_clear(L->f, slot, 0);
        apl_tenant_settle_if_idle(L->f, tenant);
    }
    apl_unlock(L);
    return APL_OK;
}

/* Changes a live tenant's quota (bytes or APL_NO_QUOTA) and warn level. The operator's file
   (src APL_SRC_OPERATOR, e.g. a reload) always applies. A process's own change applies when it
   lowers the quota, or when no other live process of the tenant relies on the quota in force and
   the operator did not set it; otherwise the stricter quota stays, the conflict is counted and 1 is
   returned. -1 when the lock cannot be taken (err says why). A reserve racing with the store sees
   either value, and both are valid quotas. */
static int apl_set_quota(apl_ledger *L, int tenant, uint64_t quota, uint32_t warn_ppm, int src, uint32_t stamp,
                         char *err, size_t len) {
    if (apl_lock(L, err, len) != APL_OK) return -1;
    apl_tenant *T = &L->f->tenants[tenant];
    int conflict = 0;
    uint64_t old = atomic_load(&T->quota);
    int old_src = (int)atomic_load(&T->quota_src);
    uint64_t me = atomic_load(&apl_self_instance);
    int others = 0;
    for (int i = 0; i < APL_SLOTS; i++)
        if (atomic_load(&L->f->slots[i].state) == APL_USED && L->f->slots[i].tenant == (uint32_t)tenant &&
            L->f->slots[i].instance != me &&
            apl_owner_alive(L->dir, L->f->slots[i].instance, L->f->slots[i].pid, L->f->slots[i].pidns,
                            L->f->slots[i].start_time, L->fd) != 0)
            others++;
    /* An operator's reload applies unless another process has the quota from a newer file. */
    int operator_ok = src == APL_SRC_OPERATOR && !(old_src == APL_SRC_OPERATOR && stamp < atomic_load(&T->quota_stamp));
    if (operator_ok || (src != APL_SRC_OPERATOR && (quota <= old || (!others && old_src != APL_SRC_OPERATOR)))) {
        atomic_store(&T->quota, quota);
        atomic_store(&T->quota_src, src == APL_SRC_OPERATOR ? APL_SRC_OPERATOR
                                    : quota == APL_NO_QUOTA ? APL_SRC_NONE : APL_SRC_DECLARED);
        atomic_store(&T->quota_stamp, src == APL_SRC_OPERATOR ? stamp : 0);
        atomic_store(&T->warn_ppm, warn_ppm);
    } else if (quota != old) {
        conflict = 1;
        atomic_fetch_add(&T->conflicts, 1);
    }
    apl_unlock(L);
    return conflict;
}

#endif

/* A guard against SIGBUS while this process touches a ledger that another user may truncate.
 *
 * A ledger is mapped MAP_SHARED; if its file shrinks, the next access to the vanished pages raises
 * SIGBUS, which kills the process. A user's own processes only risk their own life that way, but
 * a node service (root, or a member of a sharing group) maps the ledgers of other users to sweep
 * them, and the members of a group share one 0660 ledger that any of them can truncate: neither
 * must be killed by it. Every access to the mapping of such a file (a "guarded" ledger: a
 * group's, or another user's) runs under this guard, which turns a SIGBUS of this thread at an
 * address of the armed mapping into an error return (sigsetjmp/siglongjmp; the faulting access is
 * only ever to the mapping, never inside a libc call that holds a resource, and a body that holds
 * the ledger's lock gives it back on the error path).
 *
 * The handler is installed once per process, when a guard is first armed, and chains to the
 * handler found then (stored once, read through an atomic pointer). It is never installed again:
 * reinstalling over a handler that was installed after ours and chains back to ours
 * (faulthandler.enable()) would make each the other's "previous", a cycle that an unrelated SIGBUS
 * runs around until the stack overflows. A handler installed over ours later sees every SIGBUS
 * first (faulthandler reports it and passes it on by raise(), which is no longer the kernel's
 * fault: a guarded access then ends the process as it would without the guard). If the handler is
 * entered again on a thread while it is passing a signal on (a cycle built by someone else), it
 * restores the default action and raises the signal again: the process ends, once.
 *
 * The handler reads no thread-local: armed threads are recorded by thread id in a fixed table
 * (a thread-local of a dlopened module may be allocated on its first use, which a signal handler
 * must not do; initial-exec TLS does not fit the static block beside torch's and numpy's). Only
 * the kernel's fault (BUS_ADRERR) at an address inside the mapping the thread armed for is
 * caught; any other SIGBUS goes to the handler that was installed before ours (faulthandler's),
 * else the default action, exactly as without the guard. Private ledgers arm nothing and install
 * no handler.
 */
#ifndef AP_LEDGER_GUARD_H
#define AP_LEDGER_GUARD_H

#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* One armed thread: its id (0: a free entry), where to jump, and the mapping it armed for. */
#define APL_BUS_SLOTS 256
typedef struct apl_bus_slot {
    _Atomic long tid;
    sigjmp_buf *_Atomic env;
    _Atomic uintptr_t lo, hi; /* [lo, hi): the armed mapping */
} apl_bus_slot;

static apl_bus_slot apl_bus_slots[APL_BUS_SLOTS];
static _Atomic int apl_bus_armed;      /* entries in use: the handler scans only when some are */
static struct sigaction apl_bus_prev_store; /* written once, before apl_bus_prev points at it */
static struct sigaction *_Atomic apl_bus_prev; /* NULL until ours is installed */
static _Atomic int apl_bus_installed;
static _Atomic long apl_bus_passing;   /* the thread passing a signal on to the previous handler */
static pthread_mutex_t apl_bus_mu = PTHREAD_MUTEX_INITIALIZER;

static long apl_bus_tid(void) { return (long)syscall(SYS_gettid); } /* async-signal-safe */

static void apl_bus_handler(int sig, siginfo_t *si, void *uc) {
    long tid = apl_bus_tid();
    /* only the kernel's fault on a vanished page (BUS_ADRERR) of the mapping this thread armed
       for: a SIGBUS sent with kill(), or a fault elsewhere, means what it means without the guard */
    if (atomic_load(&apl_bus_armed) > 0 && si && si->si_code == BUS_ADRERR) {
        uintptr_t a = (uintptr_t)si->si_addr;
        for (int i = 0; i < APL_BUS_SLOTS; i++) {
            apl_bus_slot *s = &apl_bus_slots[i];
            if (atomic_load_explicit(&s->tid, memory_order_relaxed) != tid) continue;
            sigjmp_buf *env = atomic_load(&s->env);
            if (env && a >= atomic_load(&s->lo) && a < atomic_load(&s->hi)) {
                atomic_store(&s->env, NULL);
                siglongjmp(*env, 1);
            }
            break;
        }
    }
    if (atomic_load(&apl_bus_passing) == tid) {
        /* entered again while passing this signal on: a cycle of handlers. End it here. */
        struct sigaction dfl;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        sigaction(sig, &dfl, NULL);
        raise(sig);
        return;
    }
    struct sigaction *prev = atomic_load(&apl_bus_prev);
    long none = 0;
    int mine = atomic_compare_exchange_strong(&apl_bus_passing, &none, tid);
    if (prev && (prev->sa_flags & SA_SIGINFO)) {
        if (prev->sa_sigaction) {
            prev->sa_sigaction(sig, si, uc);
            if (mine) atomic_store(&apl_bus_passing, 0);
            return;
        }
    } else if (prev && prev->sa_handler != SIG_DFL && prev->sa_handler != SIG_IGN) {
        prev->sa_handler(sig);
        if (mine) atomic_store(&apl_bus_passing, 0);
        return;
    }
    if (mine) atomic_store(&apl_bus_passing, 0);
    /* The action before ours (the default: the process ends), as without the guard, for a
       fault and for a signal sent alike. */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigaction(sig, prev ? prev : &dfl, NULL);
    raise(sig);
}

/* A forked child has only the thread that forked, which was not inside a guarded body: the
   entries of the parent's armed threads are stale there (their ids may come again). */
static void apl_bus_after_fork_child(void) {
    for (int i = 0; i < APL_BUS_SLOTS; i++) {
        atomic_store(&apl_bus_slots[i].env, NULL);
        atomic_store(&apl_bus_slots[i].tid, 0);
    }
    atomic_store(&apl_bus_armed, 0);
    atomic_store(&apl_bus_passing, 0);
    pthread_mutex_init(&apl_bus_mu, NULL);
}

/* Installs ours as the SIGBUS handler, once per process; the handler found then is the one
   chained to. */
static void apl_bus_install(void) {
    if (atomic_load_explicit(&apl_bus_installed, memory_order_acquire)) return;
    pthread_mutex_lock(&apl_bus_mu);
    if (!atomic_load(&apl_bus_installed)) {
        struct sigaction cur;
        if (sigaction(SIGBUS, NULL, &cur) == 0 &&
            !((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == apl_bus_handler)) {
            apl_bus_prev_store = cur;
            atomic_store(&apl_bus_prev, &apl_bus_prev_store); /* before ours can run */
            struct sigaction sa;
            memset(&sa, 0, sizeof sa);
            sa.sa_sigaction = apl_bus_handler;
            sa.sa_flags = SA_SIGINFO | SA_NODEFER | (cur.sa_flags & SA_ONSTACK);
            sigemptyset(&sa.sa_mask);
            sigaction(SIGBUS, &sa, NULL);
        }
        pthread_atfork(NULL, NULL, apl_bus_after_fork_child);
        atomic_store_explicit(&apl_bus_installed, 1, memory_order_release);
    }
    pthread_mutex_unlock(&apl_bus_mu);
}

/* Claims an entry of the table for this thread (waits for one when all are in use). */
static apl_bus_slot *apl_bus_arm(const void *base, size_t len) {
    apl_bus_install();
    long tid = apl_bus_tid();
    for (unsigned spin = 0;; spin++) {
        for (int i = 0; i < APL_BUS_SLOTS; i++) {
            apl_bus_slot *s = &apl_bus_slots[i];
            long none = 0;
            if (atomic_load_explicit(&s->tid, memory_order_relaxed) == 0 &&
                atomic_compare_exchange_strong(&s->tid, &none, tid)) {
                atomic_store(&s->env, NULL);
                atomic_store(&s->lo, (uintptr_t)base);
                atomic_store(&s->hi, (uintptr_t)base + len);
                atomic_fetch_add(&apl_bus_armed, 1);
                return s;
            }
        }
        struct timespec ts = {0, 100 * 1000};
        nanosleep(&ts, NULL);
    }
}

static void apl_bus_disarm(apl_bus_slot *s) {
    atomic_store(&s->env, NULL);
    atomic_fetch_sub(&apl_bus_armed, 1);
    atomic_store(&s->tid, 0);
}

/* APL_GUARDED_AT(env, base, len, body, on_bus): runs body with the guard armed for the mapping
   [base, base + len); on SIGBUS there, runs on_bus instead of returning into body. Locals that
   body changes and on_bus (or the code after) reads must be volatile. The signal mask is not
   saved (sigsetjmp(env, 0): no system call; the handler blocks nothing, SA_NODEFER). */
#define APL_GUARDED_AT(env, base, len, body, on_bus)        \
    do {                                                    \
        apl_bus_slot *apl_gslot_ = apl_bus_arm((base), (len)); \
        if (sigsetjmp(env, 0) == 0) {                       \
            atomic_store(&apl_gslot_->env, &(env));          \
            atomic_signal_fence(memory_order_seq_cst);      \
            body;                                           \
            atomic_signal_fence(memory_order_seq_cst);      \
            apl_bus_disarm(apl_gslot_);                      \
        } else {                                            \
            apl_bus_disarm(apl_gslot_);                      \
            on_bus;                                         \
        }                                                   \
    } while (0)

#endif

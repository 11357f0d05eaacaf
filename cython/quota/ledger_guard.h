/* A guard against SIGBUS while this process touches a ledger that another user may truncate.
 *
 * A ledger is mapped MAP_SHARED; if its file shrinks, the next access to the vanished pages raises
 * SIGBUS, which kills the process. A user's own processes only risk their own life that way, but
 * a node service (root, or a member of a sharing group) maps the ledgers of other users to sweep
 * them, and one of those users truncating its own file must not kill the service. The sweep
 * checks the file's size first (fstat under the lock), which leaves a window of microseconds: the
 * accesses that follow run under this guard, which turns a SIGBUS of this thread into an error
 * return (sigsetjmp/siglongjmp; the faulting access is only ever to the mapping, never inside a
 * libc call that holds a resource).
 *
 * The handler is installed when a guard is armed and it is not the process's SIGBUS handler
 * (first use, or replaced since: faulthandler.enable()/disable()); only paths that read a file
 * another user can write arm it (a node service's sweep, a group ledger's checks at open). A
 * SIGBUS that is not the kernel's fault on a vanished page of an armed thread goes to the
 * handler that was installed before (faulthandler's), else the default action, exactly as
 * without the guard.
 */
#ifndef AP_LEDGER_GUARD_H
#define AP_LEDGER_GUARD_H

#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>

/* volatile, and fenced around the body: the stores arming and disarming the guard must neither
   be dropped nor let the body's accesses move out of the armed region. */
static __thread sigjmp_buf *volatile apl_bus_env;
/* Threads armed now: the handler reads its thread's apl_bus_env only when some thread is (a
   thread-local of a dlopened module may be allocated on its first use, which a signal handler
   must not do; initial-exec TLS does not fit the static block beside torch's and numpy's). */
static _Atomic int apl_bus_armed;
static struct sigaction apl_bus_prev;
static pthread_mutex_t apl_bus_mu = PTHREAD_MUTEX_INITIALIZER;

static void apl_bus_handler(int sig, siginfo_t *si, void *uc) {
    /* only the kernel's fault on a vanished page (BUS_ADRERR): a SIGBUS sent with kill() means
       what it means without the guard */
    sigjmp_buf *env = atomic_load(&apl_bus_armed) && si && si->si_code == BUS_ADRERR ? apl_bus_env : NULL;
    if (env) {
        apl_bus_env = NULL;
        siglongjmp(*env, 1);
    }
    if (apl_bus_prev.sa_flags & SA_SIGINFO) {
        if (apl_bus_prev.sa_sigaction) {
            apl_bus_prev.sa_sigaction(sig, si, uc);
            return;
        }
    } else if (apl_bus_prev.sa_handler != SIG_DFL && apl_bus_prev.sa_handler != SIG_IGN) {
        apl_bus_prev.sa_handler(sig);
        return;
    }
    /* The action before ours (the default: the process ends), as without the guard, for a
       fault and for a signal sent alike. */
    sigaction(sig, &apl_bus_prev, NULL);
    raise(sig);
}

/* Ours is the SIGBUS handler (again: faulthandler.enable() or disable() may have replaced it
   since; the one found is chained to). */
static void apl_bus_install(void) {
    struct sigaction cur;
    pthread_mutex_lock(&apl_bus_mu);
    if (sigaction(SIGBUS, NULL, &cur) == 0 && !((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == apl_bus_handler)) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = apl_bus_handler;
        sa.sa_flags = SA_SIGINFO | SA_NODEFER;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGBUS, &sa, &apl_bus_prev);
    }
    pthread_mutex_unlock(&apl_bus_mu);
}

/* APL_GUARDED(env, body, on_bus): runs body with the guard armed; on SIGBUS, runs on_bus instead
   of returning into body. Locals that body changes and on_bus reads must be volatile. */
#define APL_GUARDED(env, body, on_bus)                      \
    do {                                                    \
        apl_bus_install();                                  \
        apl_bus_env = NULL; /* this thread's slot exists */ \
        atomic_fetch_add(&apl_bus_armed, 1);                \
        if (sigsetjmp(env, 1) == 0) {                       \
            apl_bus_env = &(env);                           \
            atomic_signal_fence(memory_order_seq_cst);      \
            body;                                           \
            atomic_signal_fence(memory_order_seq_cst);      \
            apl_bus_env = NULL;                             \
        } else {                                            \
            apl_bus_env = NULL;                             \
            on_bus;                                         \
        }                                                   \
        atomic_fetch_sub(&apl_bus_armed, 1);                \
    } while (0)

#endif

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
 * The handler is installed once, the first time a guard is armed (only paths that read a file
 * another user can write arm it); a SIGBUS that arrives while no guard of its thread is armed
 * goes to the handler that was installed before (faulthandler's, Python's default), else the
 * default action, exactly as without the guard.
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
static struct sigaction apl_bus_prev;
static pthread_once_t apl_bus_once = PTHREAD_ONCE_INIT;

static void apl_bus_handler(int sig, siginfo_t *si, void *uc) {
    sigjmp_buf *env = apl_bus_env;
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
    /* The default action: reinstalled, the faulting access runs again and ends the process. */
    signal(sig, SIG_DFL);
}

static void apl_bus_install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = apl_bus_handler;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &apl_bus_prev);
}

/* APL_GUARDED(env, body, on_bus): runs body with the guard armed; on SIGBUS, runs on_bus instead
   of returning into body. Locals that body changes and on_bus reads must be volatile. */
#define APL_GUARDED(env, body, on_bus)                      \
    do {                                                    \
        pthread_once(&apl_bus_once, apl_bus_install);       \
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
    } while (0)

#endif

/* A child forked after its parent opened a device runtime cannot use that runtime.
 *
 * Why: CANN and CUDA keep device contexts, driver handles and worker threads that a fork does not
 * copy into the child (PyTorch: "Cannot re-initialize CUDA in forked subprocess"); the simulator
 * mirrors this by resetting its runtime in the child (every call: ACL_ERROR_UNINITIALIZE). The
 * child would otherwise reuse the parent's opened backend and pools and get baffling codes, or a
 * cached block whose address means nothing in its own runtime. So the fork is noted here, once,
 * and every entry point (ap_backend_open_default, the Python pool and sharing calls, the C ABI) refuses
 * with AP_ERR_FORKED and a message that says to start workers with 'spawn'.
 *
 * A fork before any backend was opened is fine: the child opens its own runtime as any process.
 * A fork while another thread is opening one is not: the runtime may be half set up (dlopen'ed,
 * aclInit called) and the opening thread's locks are copied held into the child.
 */
#include "backend_impl.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

static atomic_int open_backends;
static atomic_int opening_backends; /* ap_backend_open calls in progress */
atomic_int ap_forked_from; /* backend.h */

/* One bit per descriptor number below AP_FORK_DROP_FDS (8 KiB): a share record's life lock takes one
   per exported or imported block (sharing.py), so a table of 64 entries, shared with the leases
   and the stats file, was full after some 60 exports and the rest went without (their records
   then taken for a dead exporter's once a cleanup removed its lease file). O(1) to mark. */
#define AP_FORK_DROP_FDS 65536
static _Atomic uint64_t drop_fds[AP_FORK_DROP_FDS / 64];

/* A fork waits (its prepare handler takes this exclusively) while a thread is between making
   such a descriptor and registering it, or between unregistering and closing it: a fork there
   copied it, unregistered, into the child, which then kept the lock the parent held (the lock
   belongs to the open file description, which the copy shares). Held for a system call or two. */
static pthread_rwlock_t fork_window = PTHREAD_RWLOCK_INITIALIZER;

void ap_fork_window_enter(void)
{
    pthread_rwlock_rdlock(&fork_window);
}

void ap_fork_window_leave(void)
{
    pthread_rwlock_unlock(&fork_window);
}

static void before_fork(void)
{
    pthread_rwlock_wrlock(&fork_window);
}

static void after_fork_in_parent(void)
{
    pthread_rwlock_unlock(&fork_window);
}

int ap_fork_drop_fd(int fd, int on)
{
    if (fd < 0 || fd >= AP_FORK_DROP_FDS)
        return on ? -1 : 0;
    uint64_t bit = (uint64_t)1 << (fd % 64);
    if (on)
        atomic_fetch_or(&drop_fds[fd / 64], bit);
    else
        atomic_fetch_and(&drop_fds[fd / 64], ~bit);
    return 0;
}

static void after_fork_in_child(void)
{
    pthread_rwlock_t fresh = PTHREAD_RWLOCK_INITIALIZER; /* the forking thread's hold is the parent's */
    memcpy(&fork_window, &fresh, sizeof fresh);
    /* Only async-signal-safe work here: atomic accesses, memcpy, getppid(), open, dup2 and close. A
       grandchild keeps the first pid: its runtime is as unusable as its parent's. */
    if ((atomic_load(&open_backends) > 0 || atomic_load(&opening_backends) > 0) && atomic_load(&ap_forked_from) == 0)
        atomic_store(&ap_forked_from, (int)getppid());
    /* The parent's lease descriptors: the child must not keep its locks (the fd numbers stay
       valid, now /dev/null, for Python's own fork handlers to close). */
    int null_fd = -1;
    for (int w = 0; w < AP_FORK_DROP_FDS / 64; w++) {
        uint64_t bits = atomic_exchange(&drop_fds[w], 0);
        for (int b = 0; bits; b++, bits >>= 1) {
            if (!(bits & 1))
                continue;
            if (null_fd < 0 && (null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC)) < 0)
                return;
            (void)dup3(null_fd, w * 64 + b, O_CLOEXEC);
        }
    }
    if (null_fd >= 0)
        close(null_fd);
}

__attribute__((constructor)) static void fork_boot(void)
{
    pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);
}

void ap_backend_count_open(int delta)
{
    atomic_fetch_add(&open_backends, delta);
}

void ap_backend_count_opening(int delta)
{
    atomic_fetch_add(&opening_backends, delta);
}

void ap_backend_forked_message(char *buf, size_t len)
{
    ap_errf(buf, len,
            "this process (pid %d) was forked from pid %d after that process had opened the device runtime; "
            "a runtime (CANN, CUDA, the simulated NPU) cannot be used in a forked child. Start worker processes "
            "with the 'spawn' start method (multiprocessing.get_context('spawn'), or 'forkserver'), or fork before "
            "opening any pool", (int)getpid(), (int)atomic_load(&ap_forked_from));
}

/* LD_PRELOAD shim for tests/test_fork_life_locks.py: widens the windows in which a process makes a
   descriptor whose lock proves it alive, so that a fork lands there. A read-only open of a ledger
   file (ascend_pool-ledger-*: the life lock's descriptor, cython/quota/ledger_slots.h) returns after
   SLOW_LEDGER_OPEN_MS milliseconds, one of /proc/self/fd/N (identity.life_open: a share record's
   life lock) after SLOW_PROC_FD_OPEN_MS; flock(LOCK_EX) on a lease file (ascend_pool-lease-*) after
   SLOW_LEASE_MS, on a stats file (ascend_pool-stats-*) after SLOW_STATS_MS, on the simulator's
   lease (ascendsim-lease-*, cython/sim/proc.c) after SLOW_SIM_LEASE_MS, on a ledger (its update lock,
   ledger_file.h apl_lock) after SLOW_LEDGER_LOCK_MS, on a share record (ascend_pool-share-*, sharing.py)
   after SLOW_SHARE_LOCK_MS, on one being made (its temporary name) after SLOW_SHARE_TMP_MS. A ledger being
   made (ledger_file.h apl_create) pauses SLOW_LEDGER_TMP_MS once its temporary file's contents are
   in: after an mmap of that file (the creation before 2026-12-05) or its fdatasync. A read-write open, not creating, of a simulator's node record
   (ascendsim-*-dev*: node.c's life descriptor) returns after SLOW_SIM_NODE_OPEN_MS, of an IPC record
   (ascendsim-*-ipc-*: ipc.c's) after SLOW_SIM_IPC_OPEN_MS. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static void pause_ms(const char *env) {
    const char *ms = getenv(env);
    long v = ms ? atol(ms) : 0;
    struct timespec ts = {v / 1000, (v % 1000) * 1000000L};
    if (v > 0) nanosleep(&ts, NULL);
}

#define SHIM_OPEN(name)                                                                   \
    int name(const char *path, int flags, ...) {                                          \
        static int (*real)(const char *, int, ...);                                       \
        if (!real) real = (int (*)(const char *, int, ...))dlsym(RTLD_NEXT, #name);       \
        va_list ap;                                                                       \
        va_start(ap, flags);                                                              \
        int mode = (flags & (O_CREAT | O_TMPFILE)) ? va_arg(ap, int) : 0;                 \
        va_end(ap);                                                                       \
        int fd = real(path, flags, mode);                                                 \
        if (fd >= 0 && (flags & O_ACCMODE) == O_RDONLY && strstr(path, "ascend_pool-ledger-")) \
            pause_ms("SLOW_LEDGER_OPEN_MS");                                              \
        if (fd >= 0 && (flags & O_ACCMODE) == O_RDONLY && strncmp(path, "/proc/self/fd/", 14) == 0) \
            pause_ms("SLOW_PROC_FD_OPEN_MS");                                             \
        if (fd >= 0 && (flags & O_ACCMODE) == O_RDWR && !(flags & (O_CREAT | O_NONBLOCK)) &&     \
            strstr(path, "/ascendsim-") && strstr(path, "-dev") && !strstr(path, "-ipc-"))                     \
            pause_ms("SLOW_SIM_NODE_OPEN_MS");                                            \
        if (fd >= 0 && (flags & O_ACCMODE) == O_RDWR && !(flags & O_CREAT) && strstr(path, "-ipc-simipc-")) \
            pause_ms("SLOW_SIM_IPC_OPEN_MS");                                             \
        return fd;                                                                        \
    }
SHIM_OPEN(open)
SHIM_OPEN(open64)

int flock(int fd, int op) {
    static int (*real)(int, int);
    if (!real) real = (int (*)(int, int))dlsym(RTLD_NEXT, "flock");
    int rc = real(fd, op);
    if (rc == 0 && (op & LOCK_EX) &&
        (getenv("SLOW_LEASE_MS") || getenv("SLOW_STATS_MS") || getenv("SLOW_SIM_LEASE_MS") ||
         getenv("SLOW_LEDGER_LOCK_MS") || getenv("SLOW_SHARE_LOCK_MS") || getenv("SLOW_SHARE_TMP_MS"))) {
        char link[64], path[512];
        snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        ssize_t n = readlink(link, path, sizeof path - 1);
        if (n > 0) {
            path[n] = 0;
            if (strstr(path, "ascend_pool-lease-")) pause_ms("SLOW_LEASE_MS");
            if (strstr(path, "ascend_pool-stats-")) pause_ms("SLOW_STATS_MS");
            if (strstr(path, "ascendsim-lease-")) pause_ms("SLOW_SIM_LEASE_MS");
            if (strstr(path, "ascend_pool-ledger-") && !strstr(path, ".tmp")) pause_ms("SLOW_LEDGER_LOCK_MS");
            if (strstr(path, "ascend_pool-share-")) pause_ms(strstr(path, ".tmp") ? "SLOW_SHARE_TMP_MS" : "SLOW_SHARE_LOCK_MS");
        }
    }
    return rc;
}

/* Whether fd is a ledger's temporary file (ascend_pool-ledger-*.tmp.*). */
static int ledger_tmp(int fd) {
    char link[64], path[512];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0) return 0;
    path[n] = 0;
    return strstr(path, "ascend_pool-ledger-") && strstr(path, ".tmp.");
}

#define SHIM_MMAP(name, off_t_)                                                                        \
    void *name(void *addr, size_t len, int prot, int flags, int fd, off_t_ off) {                      \
        static void *(*real)(void *, size_t, int, int, int, off_t_);                                   \
        if (!real) real = (void *(*)(void *, size_t, int, int, int, off_t_))dlsym(RTLD_NEXT, #name);   \
        void *p = real(addr, len, prot, flags, fd, off);                                               \
        if (p != MAP_FAILED && fd >= 0 && getenv("SLOW_LEDGER_TMP_MS") && ledger_tmp(fd))              \
            pause_ms("SLOW_LEDGER_TMP_MS");                                                            \
        return p;                                                                                      \
    }
SHIM_MMAP(mmap, off_t)
SHIM_MMAP(mmap64, off64_t)

int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    int rc = real(fd);
    if (getenv("SLOW_LEDGER_TMP_MS") && ledger_tmp(fd)) pause_ms("SLOW_LEDGER_TMP_MS");
    return rc;
}

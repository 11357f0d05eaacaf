/* Who owns a ledger slot: a process *instance*, not a pid.
 *
 * Pids are per pid namespace: two containers' workers are both pid 1, and a pid read from another
 * namespace names nobody (or somebody else) here. So a process is named by a random 64-bit
 * instance id, and it proves it is alive by a lease: it holds flock(LOCK_EX) on its own file
 *     <dir>/ascend_pool-lease-<instance as 16 hex digits>
 * in the directory of the records it writes (ascend_pool/identity.py creates it, fully locked
 * before it appears under that name). The kernel drops the lock when the process dies, whatever
 * namespace the process or the checker is in; anyone who can open the file can test the lock.
 * A process holding a ledger slot also holds a read lock (an open-file-description lock, F_OFD_SETLK)
 * on one byte of the ledger file named by its instance (apl_life_offset): that proves it alive
 * when its lease file was removed under it (a /dev/shm cleanup job, an init container), which
 * gave its quota share away before 2026-12-05; the lease is made again by its next ledger operation
 * or stats interval (identity.ensure_lease). A
 * slot keeps the pid and its pid namespace (the inode of /proc/self/ns/pid) only as labels for
 * people: no liveness or ownership decision rests on them.
 */
#ifndef AP_PROC_IDENTITY_H
#define AP_PROC_IDENTITY_H

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include "../common/proc_exit.h"

#define APL_LEASE_PREFIX "ascend_pool-lease-"

static int apl_read_stat(int pid, char *state, uint64_t *start) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT || errno == ESRCH ? -1 : -2;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    int saved = errno;
    close(fd);
    if (n <= 0) return n == 0 || saved == ESRCH ? -1 : -2;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ') return -2;
    p += 2; /* field 3 starts here */
    *state = *p;
    for (int field = 3; field < 22; field++) { /* skip to field 22 */
        p = strchr(p, ' ');
        if (!p) return -2;
        p++;
    }
    char *end;
    unsigned long long v = strtoull(p, &end, 10);
    if (end == p) return -2;
    *start = (uint64_t)v;
    return 0;
}

/* The start time of pid (0 when unknown). */
static uint64_t apl_proc_start_time(int pid) {
    char state;
    uint64_t start = 0;
    return apl_read_stat(pid, &state, &start) == 0 ? start : 0;
}

/* 0 when pid is surely gone: no such process, or one that has exited and awaits its reaping
   (../common/proc_exit.h: a zombie leader whose other threads run on, after pthread_exit(), is
   alive); else -1, cannot tell (the lease decides). A start time that differs from the one the
   process wrote proves nothing while its lease is held: the kernel shifts it by the reader's
   time namespace (a CRIU-restored container's workers read other values than their peers), and
   a pid cannot be reused while its lease is held. A /proc entry the reader cannot see (hidepid=2,
   another user's process) while kill() finds the process is not a death either. */
static int apl_proc_gone_here(int pid) {
    if (pid <= 0) return 0;
    if (kill(pid, 0) != 0 && errno == ESRCH) return 0;
    return ap_proc_exited(pid) ? 0 : -1;
}


/* 1 when /proc shows this process's own pid namespace (so a pid recorded with our pidns can be
   looked up there), 0 otherwise (e.g. `unshare --pid` without a /proc of its own). */
static int apl_proc_is_ours(void) {
    char buf[32];
    ssize_t n = readlink("/proc/self", buf, sizeof buf - 1);
    if (n <= 0) return 0;
    buf[n] = 0;
    return atoi(buf) == (int)getpid();
}

/* This process's identity, set by Python (identity.py) before it claims a slot; a forked child
   gets a new one before it attaches. 0: not set (then nothing is claimed). */
static _Atomic uint64_t apl_self_instance;
static _Atomic uint64_t apl_self_pidns;
static _Atomic int apl_self_pid; /* the process they are of: a forked child keeps the parent's */

static void apl_set_identity(uint64_t instance, uint64_t pidns) {
    atomic_store(&apl_self_instance, instance);
    atomic_store(&apl_self_pidns, pidns);
    atomic_store(&apl_self_pid, (int)getpid());
}

/* 1 alive (its lease is held), 0 dead (no lease file, or nobody holds its lock), -1 cannot tell
   (then the slot is kept: never give away bytes a live process may still hold). */
static int apl_lease_alive(const char *dir, uint64_t instance);

#ifndef F_OFD_GETLK /* Linux 3.15; older C libraries do not name them */
#define F_OFD_GETLK 36
#define F_OFD_SETLK 37
#endif

/* The byte of the ledger file a process of this instance read-locks while it holds slots there
   (ledger_slots.h apl_life_hold): 1 .. 2^62, nearly always past the end of the file (a lock is
   allowed there, and touches no data anywhere); two live instances share it with a chance of 2^-62. */
static off_t apl_life_offset(uint64_t instance) { return (off_t)(instance >> 2) + 1; }

/* The lock description of that byte: type F_RDLCK to take it, F_WRLCK to ask who holds it. */
static struct flock apl_life_range(uint64_t instance, short type) {
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = apl_life_offset(instance);
    fl.l_len = 1;
    return fl;
}

/* 1 when some process holds the life lock of instance on the ledger open as fd (any descriptor of
   the file: another open file description's lock is reported), 0 when nobody does, -1 cannot tell. */
static int apl_life_held(int fd, uint64_t instance) {
    if (fd < 0 || instance == 0) return -1;
    struct flock fl = apl_life_range(instance, F_WRLCK);
    if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return -1;
    return fl.l_type != F_UNLCK;
}

/* The liveness of a slot's owner: its lease decides. One refinement, for a process of *our* pid
   namespace only (recorded pidns equal to ours and /proc showing that namespace): a pid that is
   gone or a zombie is dead even while its lease is still held for a moment (a killed
   multi-threaded process is a zombie before its last thread closes its files). start_time is
   kept for people (a label), never as proof of death (apl_proc_gone_here). ledger_fd: a
   descriptor of the ledger whose slot this is (-1: none), where a live owner whose lease file was
   removed still holds its life lock (apl_life_held): alive. */
static int apl_owner_alive(const char *dir, uint64_t instance, int pid, uint64_t pidns, uint64_t start_time,
                           int ledger_fd) {
    (void)start_time;
    int lease = apl_lease_alive(dir, instance);
    if (lease != 1 && apl_life_held(ledger_fd, instance) == 1) lease = 1;
    if (lease == 1 && pidns != 0 && pidns == atomic_load(&apl_self_pidns) && pid > 0 &&
        apl_proc_is_ours() && apl_proc_gone_here(pid) == 0)
        return 0;
    return lease;
}

static int apl_lease_alive(const char *dir, uint64_t instance) {
    if (instance == 0) return 0;
    /* ours only in the process that set it: a forked child's view and sweep ask the parent's lease */
    if (instance == atomic_load(&apl_self_instance) && atomic_load(&apl_self_pid) == (int)getpid()) return 1;
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%s/" APL_LEASE_PREFIX "%016llx", dir, (unsigned long long)instance) >=
        (int)sizeof path)
        return -1;
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return errno == ENOENT ? 0 : -1;
    int rc;
    if (flock(fd, LOCK_SH | LOCK_NB) == 0) {
        rc = 0; /* nobody holds it: its owner is gone */
        flock(fd, LOCK_UN);
    } else {
        rc = errno == EWOULDBLOCK ? 1 : -1;
    }
    close(fd);
    return rc;
}

#endif

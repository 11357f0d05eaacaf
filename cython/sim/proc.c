/* Process identity for the node records: not a pid. Pids are per pid namespace (two containers'
 * workers are both pid 1) and reused, so a record names its owner by a random 64-bit *lease id*,
 * and the owner proves it is alive by holding flock(LOCK_EX) on its lease file
 *     $ASCEND_SIM_SHM_DIR/ascendsim-lease-<uid>-<id as 16 hex digits>
 * which the kernel drops when the process dies, in whatever namespace (as ascend_pool/identity.py
 * does for the allocator's records). The pid stays in the records as a label.
 *
 * Other users of the node count this process's device memory too (foreign.c), so it also holds a
 * *public* lease, mode 0644, that they can test:
 *     $ASCEND_SIM_SHM_DIR/ascendsim-alive-<uid>-<id as 16 hex digits>
 * Two files, because a file another user can open is a file it can flock: after our death it could
 * take the lock and make us look alive forever. Our own user's checks use only the 0600 lease, so
 * another user can at worst keep our bytes counted in *its* view of the device (what it could do
 * by allocating them); the public lease is trusted only when owned by the uid its name states.
 *
 * The node-level process id (aclrtDeviceGetBareTgid): on a real node, the host's tgid of the
 * process, which inside a container differs from getpid(). The simulator gives each process one
 * derived from its lease id, always above the kernel's largest pid (2^22), so it never equals a
 * getpid() value: code that passes getpid() where the runtime wants this id fails here as it
 * would in a container. aclrtIpcMemSetImportPid and the import check use it (ipc.c).
 */
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../common/host_ids.h"
#include "../common/proc_exit.h"
#include "sim_internal.h"

/* Reads state (field 3) and start time (field 22). 0 ok, -1 no such process, -2 unreadable. */
static int read_stat(int pid, char *state, uint64_t *start)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT || errno == ESRCH ? -1 : -2;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return -1; /* the process went away between open and read */
    buf[n] = '\0';
    /* comm (field 2) may hold spaces and parentheses: fields resume after the last ')'. */
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ')
        return -2;
    p += 2;
    *state = *p;
    for (int field = 3; field < 22; field++) {
        p = strchr(p, ' ');
        if (!p)
            return -2;
        p++;
    }
    *start = strtoull(p, NULL, 10);
    return 0;
}

uint64_t sim_proc_start_time(int pid)
{
    char state;
    uint64_t start = 0;
    return read_stat(pid, &state, &start) == 0 ? start : 0;
}

/* ---- leases ---- */

#define LEASE_DIRS 8 /* directories a process held a lease in (each aclInit's $ASCEND_SIM_SHM_DIR) */

static pthread_mutex_t lease_mu = PTHREAD_MUTEX_INITIALIZER;
static _Atomic uint64_t lease_id;
static char lease_dir[PATH_MAX];                /* where records are now: checks look here */
static char held_dir[LEASE_DIRS][PATH_MAX];
static int held_fd[LEASE_DIRS] = {-1, -1, -1, -1, -1, -1, -1, -1};
static int held_pub_fd[LEASE_DIRS] = {-1, -1, -1, -1, -1, -1, -1, -1};
static int lease_atfork;

/* A fork waits while another thread makes a lease (lease_hold_locked runs under lease_mu: a few
   system calls): between the lease's lock and its entry in held_fd[] a fork, from Python or from
   C, gave the child the locked descriptor unknown to the handler below, which kept a killed
   parent alive (its device memory counted) for as long as the child lived. */
static void lease_before_fork(void)
{
    pthread_mutex_lock(&lease_mu);
}

static void lease_after_fork_in_parent(void)
{
    pthread_mutex_unlock(&lease_mu);
}

static void lease_after_fork_in_child(void)
{
    /* Another process: a new id and leases when it needs them. Closing our copies of the
       descriptors leaves the parent's locks in place (they belong to the parent's open files). */
    pthread_mutex_init(&lease_mu, NULL);
    for (int i = 0; i < LEASE_DIRS; i++) {
        if (held_fd[i] >= 0)
            close(held_fd[i]);
        if (held_pub_fd[i] >= 0)
            close(held_pub_fd[i]);
        held_fd[i] = -1;
        held_pub_fd[i] = -1;
        held_dir[i][0] = 0;
    }
    atomic_store(&lease_id, 0);
}

static void lease_path(char *out, size_t len, const char *dir, uint64_t id)
{
    snprintf(out, len, "%s/ascendsim-lease-%u-%016llx", dir, sim_host_uid(), (unsigned long long)id);
}

static void public_lease_path(char *out, size_t len, const char *dir, unsigned uid, uint64_t id)
{
    snprintf(out, len, "%s/ascendsim-alive-%u-%016llx", dir, uid, (unsigned long long)id);
}

/* Creates `path` locked (LOCK_EX) with `mode`, under a temporary name first so that it never
   appears unlocked. The descriptor, or -1 with errno set. */
static int create_locked(const char *path, mode_t mode)
{
    char tmp[PATH_MAX + 96];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    int fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
    if (fd < 0)
        return -1;
    int err = 0;
    /* Locked first: a maker killed before its link() leaves the temporary file, which
       sim_proc_sweep_abandoned removes once unlocked (and a minute old: the lock comes a moment
       after the creation). */
    if (flock(fd, LOCK_EX | LOCK_NB) != 0 || fchmod(fd, mode) != 0 || link(tmp, path) != 0) {
        err = errno;
        close(fd);
        fd = -1;
    }
    unlink(tmp);
    errno = err; /* the failure's, for the caller's message */
    return fd;
}

/* Why the last attempt to hold a lease failed (lease_mu held): the file and errno. */
static char lease_fail_path[PATH_MAX + 64];
static int lease_fail_errno;

/* Holds our leases, private and public, in lease_dir (lease_mu held). 0 when held (or no directory
   is known yet), else an errno, with the file in lease_fail_path. A process without its private
   lease is dead to its own user (sim_proc_alive: no file, no life), and one without its public
   lease is dead to the others (their sums skip its bytes): its records would be reclaimed and
   its device memory handed out again, so the callers that name us in a record (node.c: attach,
   ipc.c) refuse to go on without both (sim_proc_lease_ready). */
static int lease_hold_locked(uint64_t id)
{
    int free_i = -1;
    for (int i = 0; i < LEASE_DIRS; i++) {
        if (held_fd[i] >= 0 && strcmp(held_dir[i], lease_dir) == 0)
            return 0;
        if (held_fd[i] < 0 && free_i < 0)
            free_i = i;
    }
    if (!lease_dir[0])
        return 0;
    char path[PATH_MAX + 64];
    lease_path(path, sizeof path, lease_dir, id);
    if (free_i < 0) {
        snprintf(lease_fail_path, sizeof lease_fail_path, "%s", path);
        return lease_fail_errno = EMFILE; /* leases in LEASE_DIRS directories already */
    }
    int fd = create_locked(path, 0600);
    if (fd < 0) {
        lease_fail_errno = errno ? errno : EIO;
        snprintf(lease_fail_path, sizeof lease_fail_path, "%s", path);
        return lease_fail_errno;
    }
    char pub[PATH_MAX + 64];
    public_lease_path(pub, sizeof pub, lease_dir, sim_host_uid(), id);
    int pub_fd = create_locked(pub, 0644);
    if (pub_fd < 0) {
        lease_fail_errno = errno ? errno : EIO;
        snprintf(lease_fail_path, sizeof lease_fail_path, "%s", pub);
        unlink(path); /* nobody knows the id yet: the private lease goes with it, to be made again */
        close(fd);
        return lease_fail_errno;
    }
    held_fd[free_i] = fd;
    held_pub_fd[free_i] = pub_fd;
    snprintf(held_dir[free_i], PATH_MAX, "%s", lease_dir);
    return 0;
}

int sim_proc_lease_ready(const char *call)
{
    uint64_t id = sim_proc_self_id();
    char path[sizeof lease_fail_path];
    pthread_mutex_lock(&lease_mu);
    int err = lease_hold_locked(id); /* again: a directory out of room may have room now */
    if (err)
        snprintf(path, sizeof path, "%s", lease_fail_path);
    pthread_mutex_unlock(&lease_mu);
    if (!err)
        return 0;
    if (err == EMFILE)
        return sim_fail(ACL_ERROR_RT_RESOURCE_ALLOC_FAIL, call,
                        "cannot hold this process's lease %s: it holds leases in %d directories "
                        "(ASCEND_SIM_SHM_DIR) already, the most one process can", path, LEASE_DIRS);
    return sim_fail(ACL_ERROR_RT_RESOURCE_ALLOC_FAIL, call,
                    "cannot create this process's lease %s: %s; without it the node's other processes "
                    "would take this one for dead and hand its device memory out again (ASCEND_SIM_SHM_DIR "
                    "must have room and inodes for two small files per process)", path, strerror(err));
}

void sim_proc_use_dir(const char *dir)
{
    pthread_mutex_lock(&lease_mu);
    snprintf(lease_dir, sizeof lease_dir, "%s", dir);
    uint64_t id = atomic_load(&lease_id);
    if (id)
        (void)lease_hold_locked(id); /* a failure is reported by sim_proc_lease_ready */
    pthread_mutex_unlock(&lease_mu);
}

uint64_t sim_proc_self_id(void)
{
    uint64_t id = atomic_load(&lease_id);
    if (id)
        return id;
    pthread_mutex_lock(&lease_mu);
    if (!lease_atfork) {
        pthread_atfork(lease_before_fork, lease_after_fork_in_parent, lease_after_fork_in_child);
        lease_atfork = 1;
    }
    while (!(id = atomic_load(&lease_id))) {
        uint64_t r = 0;
        if (getrandom(&r, sizeof r, 0) != (ssize_t)sizeof r)
            r = sim_now_ns() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)&r;
        if (r) {
            (void)lease_hold_locked(r); /* likewise */
            atomic_store(&lease_id, r);
        }
    }
    pthread_mutex_unlock(&lease_mu);
    return id;
}

int sim_proc_alive(int pid, uint64_t id)
{
    (void)pid; /* a label: it may belong to another pid namespace */
    if (!id)
        return 0;
    if (id == atomic_load(&lease_id))
        return 1;
    char path[PATH_MAX + 64];
    pthread_mutex_lock(&lease_mu);
    lease_path(path, sizeof path, lease_dir, id);
    pthread_mutex_unlock(&lease_mu);
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return errno == ENOENT || errno == ELOOP ? 0 : -1;
    int rc;
    struct stat st;
    /* Only our own private lease proves anything: the directory is shared (1777), and another
       user who re-creates a dead lease's name and locks it would keep that process "alive", its
       device bytes and record slots pinned, for as long as it likes. */
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid())
        rc = 0;
    else if (flock(fd, LOCK_SH | LOCK_NB) == 0)
        rc = 0;
    else
        rc = errno == EWOULDBLOCK ? 1 : -1;
    close(fd); /* also drops a lock we took */
    if (rc == 0) {
        unlink(path); /* ids are never reused: a dead lease is garbage */
        pthread_mutex_lock(&lease_mu);
        public_lease_path(path, sizeof path, lease_dir, sim_host_uid(), id);
        pthread_mutex_unlock(&lease_mu);
        unlink(path); /* its public twin too (only if ours: the directory is sticky) */
    }
    return rc;
}

#define ABANDONED_STALE_S 60 /* as ascend_pool/identity.py's TMP_STALE_S */

/* 1 when path (a regular file of ours, older than ABANDONED_STALE_S) can be locked: its maker,
   which holds it locked from creation to publication, is gone. */
static int unlocked_and_stale(const char *path)
{
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return 0;
    struct stat st;
    int rc = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == geteuid() &&
             time(NULL) - st.st_mtime > ABANDONED_STALE_S && flock(fd, LOCK_SH | LOCK_NB) == 0;
    close(fd);
    return rc;
}

/* The lease id in a record's temporary name, "<name>.tmp.<16 hex digits>" (ipc.c) or
   "<name>.tmp.<16 hex digits>.<n>" (node.c); 0 when it is not one (a node name may hold ".tmp."). */
static uint64_t temporary_of(const char *n)
{
    const char *t = NULL;
    for (const char *p = strstr(n, ".tmp."); p; p = strstr(p + 1, ".tmp."))
        t = p;
    if (!t)
        return 0;
    t += 5;
    for (int i = 0; i < 16; i++)
        if (!isxdigit((unsigned char)t[i]))
            return 0;
    if (t[16] == '.') {
        if (!t[17])
            return 0;
        for (const char *p = t + 17; *p; p++)
            if (!isdigit((unsigned char)*p))
                return 0;
    } else if (t[16]) {
        return 0;
    }
    return strtoull(t, NULL, 16);
}

void sim_proc_sweep_abandoned(const char *dir)
{
    char lease[64], alive[64], rec[64];
    int llen = snprintf(lease, sizeof lease, "ascendsim-lease-%u-", sim_host_uid());
    int alen = snprintf(alive, sizeof alive, "ascendsim-alive-%u-", sim_host_uid());
    int rlen = snprintf(rec, sizeof rec, "ascendsim-%u-", sim_host_uid());
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *e;
    char path[PATH_MAX + 512];
    for (long seen = 0; seen < 65536 && (e = readdir(d)); seen++) {
        const char *n = e->d_name, *tmp = strstr(n, ".tmp");
        snprintf(path, sizeof path, "%s/%s", dir, n);
        if (strncmp(n, lease, (size_t)llen) == 0 || strncmp(n, alive, (size_t)alen) == 0) {
            if (tmp) { /* a lease being made (create_locked): its maker holds it locked */
                if (strcmp(tmp, ".tmp") == 0 && unlocked_and_stale(path))
                    unlink(path);
            } else if (strncmp(n, lease, (size_t)llen) == 0) { /* sim_proc_alive removes a dead one, twin too */
                uint64_t id = strtoull(n + llen, NULL, 16);
                if (id)
                    (void)sim_proc_alive(0, id);
            }
        } else if (strncmp(n, rec, (size_t)rlen) == 0) {
            /* a node or IPC record being made, named by its maker's lease id, which it holds */
            uint64_t id = temporary_of(n);
            if (id && sim_proc_alive(0, id) == 0)
                unlink(path);
        }
    }
    closedir(d);
}

int sim_proc_lock(_Atomic uint64_t *word, int timeout_s, int *took_over, int life_fd)
{
    uint64_t me = sim_proc_self_id();
    uint64_t now = sim_now_ns(), deadline = now + (uint64_t)timeout_s * 1000000000ull, next_check = now;
    uint64_t pause_ns = 1000;
    if (took_over)
        *took_over = 0;
    for (;;) {
        uint64_t holder = 0;
        if (atomic_compare_exchange_strong(word, &holder, me))
            return 0;
        now = sim_now_ns();
        /* holder == me: another thread of this process, alive by definition */
        if (holder != me && now >= next_check) {
            /* life_fd: a descriptor of the record holding the word, where a holder whose lease
               file was removed still holds its life lock (node.c; -1 for records without one) */
            if (sim_proc_alive(0, holder) == 0 && sim_proc_life_held(life_fd, holder) != 1 &&
                atomic_compare_exchange_strong(word, &holder, me)) {
                if (took_over)
                    *took_over = 1; /* its holder died inside: the record's updates are single stores */
                return 0;
            }
            next_check = now + 50000000ull;
        }
        if (now >= deadline)
            return ETIMEDOUT;
        sim_sleep_ns(pause_ns);
        if (pause_ns < 1000000)
            pause_ns *= 2;
    }
}

void sim_proc_unlock(_Atomic uint64_t *word)
{
    atomic_store(word, 0);
}

#ifndef F_OFD_GETLK /* Linux 3.15; older C libraries do not name them */
#define F_OFD_GETLK 36
#define F_OFD_SETLK 37
#endif

/* A fork waits while another thread is between the open of a life lock's descriptor and its entry
   where the child's fork handler closes it (node.c's life_fd1, ipc.c's lists), or between its
   removal from there and its close: a fork in between gave the child a copy of the open file
   whose lock the parent took, and the child kept a killed parent alive (its device memory
   counted, its exported blocks live). Read-held for a few system calls; no lock is taken inside. */
static pthread_rwlock_t life_window = PTHREAD_RWLOCK_INITIALIZER;

void sim_proc_fork_window_enter(void)
{
    pthread_rwlock_rdlock(&life_window);
}

void sim_proc_fork_window_leave(void)
{
    pthread_rwlock_unlock(&life_window);
}

static void life_window_before_fork(void)
{
    pthread_rwlock_wrlock(&life_window);
}

static void life_window_after_fork_in_parent(void)
{
    pthread_rwlock_unlock(&life_window);
}

static void life_window_after_fork_in_child(void)
{
    pthread_rwlock_t fresh = PTHREAD_RWLOCK_INITIALIZER; /* the forking thread's hold is the parent's */
    memcpy(&life_window, &fresh, sizeof fresh);
}

__attribute__((constructor)) static void life_window_boot(void)
{
    pthread_atfork(life_window_before_fork, life_window_after_fork_in_parent, life_window_after_fork_in_child);
}

/* The life lock's byte of lease id (as cython/quota/proc_identity.h's): 1 .. 2^62, past the
   record's data (a lock is allowed there and touches nothing). */
static struct flock life_range(uint64_t id, short type)
{
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)(id >> 2) + 1;
    fl.l_len = 1;
    return fl;
}

int sim_proc_life_hold(int fd)
{
    struct flock fl = life_range(sim_proc_self_id(), F_WRLCK);
    return fd >= 0 && fcntl(fd, F_OFD_SETLK, &fl) == 0 ? 0 : -1;
}

int sim_proc_life_held(int fd, uint64_t id)
{
    if (fd < 0 || !id)
        return -1;
    /* Asked as a read lock: only a write lock conflicts, which only the record's owner user can
       hold; another user's read lock on the byte proves nothing. */
    struct flock fl = life_range(id, F_RDLCK);
    if (fcntl(fd, F_OFD_GETLK, &fl) != 0)
        return -1;
    return fl.l_type != F_UNLCK;
}

int sim_proc_foreign_alive(unsigned uid, uint64_t id, int life_fd)
{
    if (!id)
        return 0;
    if (sim_proc_life_held(life_fd, id) == 1)
        return 1; /* its public lease may have been removed under it; its record's lock says */
    char path[PATH_MAX + 64];
    pthread_mutex_lock(&lease_mu);
    public_lease_path(path, sizeof path, lease_dir, uid, id);
    pthread_mutex_unlock(&lease_mu);
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return errno == ENOENT || errno == ELOOP ? 0 : -1;
    struct stat st;
    int rc;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || !sim_owned_by(st.st_uid, uid))
        rc = 0; /* not that user's lease: a name someone else put there proves nothing */
    else if (flock(fd, LOCK_SH | LOCK_NB) == 0)
        rc = 0;
    else
        rc = errno == EWOULDBLOCK ? 1 : -1;
    close(fd);
    return rc;
}

int sim_proc_user_namespace(char *map, size_t len, long *outside)
{
    const struct ap_idmap *m = ap_ids_map(0);
    uint32_t host;
    *outside = ap_idmap_outward(m, (uint32_t)geteuid(), &host) ? (long)host : -1;
    if (len)
        map[0] = '\0';
    if (!m->kind)
        return 0; /* the initial namespace, or /proc cannot tell */
    size_t o = 0;
    for (int i = 0; i < m->n && len && o < len; i++) {
        int k = snprintf(map + o, len - o, "%s%u %u %u", i ? "; " : "", (unsigned)m->in[i], (unsigned)m->out[i],
                         (unsigned)m->count[i]);
        if (k < 0)
            break;
        o += (size_t)k;
    }
    return 1;
}

int sim_proc_runs_as_overflow_uid(void)
{
    const struct ap_idmap *m = ap_ids_map(0);
    return m->kind && (uint32_t)geteuid() == m->overflow;
}

unsigned sim_host_uid(void)
{
    return ap_host_uid();
}

int sim_owned_by(unsigned st_uid, unsigned host)
{
    return ap_owned_by((uid_t)st_uid, host);
}

uint64_t sim_proc_pidns(void)
{
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

/* 1 when /proc shows this process's own pid namespace (so a pid recorded with our pidns can be
   looked up there), 0 otherwise (e.g. `unshare --pid` without a /proc of its own). */
static int proc_is_ours(void)
{
    char buf[32];
    ssize_t n = readlink("/proc/self", buf, sizeof buf - 1);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    return atoi(buf) == (int)getpid();
}

int sim_proc_owner_alive(int pid, uint64_t id, uint64_t pidns, uint64_t start_time, int life_fd)
{
    int lease = sim_proc_alive(pid, id);
    if (lease != 1 && sim_proc_life_held(life_fd, id) == 1)
        lease = 1; /* its lease files were removed under it: its life lock on the record says */
    (void)start_time; /* a label: the kernel shifts it by the reader's time namespace, and a pid
                         cannot be reused while its lease is held */
    if (lease == 1 && pid > 0 && pidns && pidns == sim_proc_pidns() && proc_is_ours()) {
        if (kill(pid, 0) != 0 && errno == ESRCH)
            return 0; /* gone */
        if (ap_proc_exited(pid))
            return 0; /* exited, not reaped: its lease drops a moment later (not a leader that
                         called pthread_exit(): a zombie too, while its other threads run on) */
    }
    return lease;
}

int32_t sim_proc_bare_tgid(void)
{
    uint64_t id = sim_proc_self_id();
    return (int32_t)((1u << 22) + (uint32_t)(id % (uint64_t)(INT32_MAX - (1u << 22))));
}

SIM_EXPORT aclError aclrtDeviceGetBareTgid(int32_t *pid)
{
    if (!pid)
        return sim_fail(ACL_ERROR_INVALID_PARAM, "aclrtDeviceGetBareTgid", "pid is NULL");
    if (!sim_ready())
        return sim_fail(ACL_ERROR_UNINITIALIZE, "aclrtDeviceGetBareTgid", "aclInit has not been called");
    *pid = sim_proc_bare_tgid();
    return ACL_SUCCESS;
}

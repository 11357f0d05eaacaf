/* The node-wide quota ledger: opening, creating, validating and locking one ledger file.
 *
 * Trust: a ledger decides how much device memory processes may take, so a file that another user
 * could have written, or that does not look exactly like one this build creates, is refused with a
 * message naming the file and the reason; it is never repaired or reinterpreted. Checks: regular
 * file (symbolic links refused), owner = this user (or, when a group is configured, the file's
 * group = that group; both as this namespace shows them, ../common/host_ids.h), mode exactly 0600 (0660 with a group), exact size, and under the lock the
 * header (magic, version, layout sizes, owner, group, device, backend, node) and every entry
 * (states, name characters, byte counts no device could hold, slots pointing at unused tenants).
 *
 * Creation: the file is fully initialised under a temporary name and link()ed into place; link()
 * does not overwrite, so of two processes racing to create the ledger exactly one wins and the
 * other opens the winner's file. Nobody ever maps a half-written ledger.
 *
 * Locking: state changes that touch several fields (claiming a slot, registering a tenant,
 * reclaiming a dead process's slot) take flock() on the file. The kernel drops that lock when its
 * holder dies, and it lives outside the shared memory, so a corrupted or malicious file cannot
 * wedge it. flock() excludes other processes only (threads share the open file), so a process
 * mutex is taken first. Reserve and release (ledger_reserve.h) take no lock at all.
 */
#ifndef AP_LEDGER_FILE_H
#define AP_LEDGER_FILE_H

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <time.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../common/host_ids.h"
#include "ledger_format.h"
#include "ledger_guard.h"

#define APL_LOCK_TIMEOUT_MS 10000 /* a lock held this long means a stopped or wedged peer */

/* Error kinds (the Python layer raises LedgerError with the message either way). */
enum { APL_OK = 0, APL_E_IO = 1, APL_E_PERM = 2, APL_E_MALFORMED = 3, APL_E_FULL = 4, APL_E_LOCK = 5,
       APL_E_ARG = 6 };

/* One process's mapping of one ledger file. Shared by every context of the process on the
   device (reference counted); never unmapped while a context can still reach it. */
typedef struct apl_ledger {
    apl_file *f;
    int fd;                 /* for flock(); reopened in a forked child (flock belongs to the open file),
                               which drops the parent's (apl_dropped_open) */
    pid_t fd_pid;
    dev_t st_dev;
    ino_t st_ino;
    pthread_mutex_t mu;     /* threads of this process, before flock() */
    _Atomic int refs;
    int device;
    uint32_t group;
    int guarded;            /* a file another user can write (a group's, another user's): every access to
                               the mapping runs under the SIGBUS guard (ledger_guard.h) */
    _Atomic int broken;     /* a guarded access faulted (the file shrank): the mapping is not used again */
    _Atomic long lock_tid;  /* the thread holding the lock (apl_lock), 0 none: a guarded body that faults
                               while holding it gives it back (apl_unlock_if_held) */
    int life_fd;            /* read-only, holding this process's life lock (ledger_slots.h apl_life_hold); -1 none */
    pid_t life_pid;
    char path[PATH_MAX];
    char dir[PATH_MAX];     /* the ledger's directory: where its processes' leases are */
} apl_ledger;

static int apl_fail(char *err, size_t len, int kind, const char *fmt, ...) {
    if (err && len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, len, fmt, ap);
        va_end(ap);
    }
    return kind;
}

/* Tenant names are also file-system and metric-label friendly: 1-63 of [A-Za-z0-9_.-]. */
static int apl_name_ok(const char *s, size_t cap) {
    size_t n = strnlen(s, cap);
    if (n == 0 || n >= cap) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
              c == '-' || c == '.'))
            return 0;
    }
    return 1;
}

static void apl_init_file(apl_file *f, int device, const char *backend, const char *node, uint32_t group) {
    memset(f, 0, sizeof *f);
    f->h.magic = APL_MAGIC;
    f->h.version = APL_VERSION;
    f->h.header_size = sizeof(apl_header);
    f->h.tenant_size = sizeof(apl_tenant);
    f->h.slot_size = sizeof(apl_slot);
    f->h.n_tenants = APL_TENANTS;
    f->h.n_slots = APL_SLOTS;
    f->h.file_size = sizeof(apl_file);
    f->h.owner_uid = ap_host_uid(); /* the host's ids: one ledger inside and outside a user namespace */
    f->h.group = group == APL_NO_GROUP ? group : ap_host_gid(group);
    f->h.device = device;
    snprintf(f->h.backend, sizeof f->h.backend, "%s", backend);
    snprintf(f->h.node, sizeof f->h.node, "%s", node);
}

/* Checks the file behind fd before mapping it: type, owner, group, mode, size. owner: the host
   uid the ledger belongs to (its name's); group: the gid as this namespace sees it. */
static int apl_check_st(const struct stat *st, const char *path, uint32_t group, uint32_t owner, char *err,
                        size_t len) {
    if (!S_ISREG(st->st_mode))
        return apl_fail(err, len, APL_E_PERM, "ledger %s is not a regular file; refusing it", path);
    unsigned mode = (unsigned)(st->st_mode & 07777);
    if (group == APL_NO_GROUP) {
        if (!ap_owned_by(st->st_uid, owner))
            return apl_fail(err, len, APL_E_PERM,
                            "ledger %s is owned by uid %u, not by %s (host uid %u); refusing a ledger another "
                            "user could write", path, (unsigned)st->st_uid, owner == ap_host_uid() ? "this user"
                            : "the user it belongs to", (unsigned)owner);
        if (mode != 0600)
            return apl_fail(err, len, APL_E_PERM,
                            "ledger %s has permissions %04o; a private ledger must be 0600 (owner only), "
                            "refusing it", path, mode);
    } else {
        if ((uint32_t)st->st_gid != group)
            return apl_fail(err, len, APL_E_PERM,
                            "ledger %s belongs to group %u, not to the configured group %u; refusing it", path,
                            (unsigned)st->st_gid, (unsigned)group);
        if (mode != 0660)
            return apl_fail(err, len, APL_E_PERM,
                            "ledger %s has permissions %04o; a group ledger must be 0660 (owner and group), "
                            "refusing it", path, mode);
    }
    if (st->st_size != (off_t)sizeof(apl_file))
        return apl_fail(err, len, APL_E_MALFORMED,
                        "ledger %s is %lld bytes, expected %zu: malformed or from another version; refusing "
                        "it (remove it when no process uses device quotas)", path, (long long)st->st_size,
                        sizeof(apl_file));
    return APL_OK;
}

static int apl_check_stat(int fd, const char *path, uint32_t group, uint32_t owner, struct stat *st, char *err,
                          size_t len) {
    if (fstat(fd, st) != 0) return apl_fail(err, len, APL_E_IO, "cannot stat ledger %s: %s", path, strerror(errno));
    return apl_check_st(st, path, group, owner, err, len);
}

/* Why this process may not open the ledger at path (its open failed with EACCES): what the checks
   after an open would say of the file's owner, group or mode (another member's or root's ledger
   whose group or mode was changed), else the file's figures beside this process's ids. Before,
   "cannot open ledger PATH: Permission denied" said neither. */
static int apl_open_refused(const char *path, uint32_t group, uint32_t owner, char *err, size_t len) {
    struct stat st;
    if (lstat(path, &st) != 0)
        return apl_fail(err, len, APL_E_PERM, "cannot open ledger %s: %s", path, strerror(EACCES));
    if (apl_check_st(&st, path, group, owner, err, len) == APL_E_PERM) return APL_E_PERM;
    return apl_fail(err, len, APL_E_PERM,
                    "cannot open ledger %s: %s (owner uid %u, group %u, mode %04o; this process runs as uid %u, "
                    "gid %u%s)", path, strerror(EACCES), (unsigned)st.st_uid, (unsigned)st.st_gid,
                    (unsigned)(st.st_mode & 07777), (unsigned)geteuid(), (unsigned)getegid(),
                    group == APL_NO_GROUP ? "" : " and its supplementary groups");
}

/* Checks the mapped contents (under the lock: entries are not changing shape meanwhile). */
static const char *apl_check_contents(const apl_file *f, const struct stat *st, int device, const char *backend,
                                      const char *node, uint32_t group) {
    const apl_header *h = &f->h;
    if (h->magic != APL_MAGIC) return "bad magic number: not a ledger";
    if (h->version != APL_VERSION) return "unsupported version";
    if (h->header_size != sizeof(apl_header) || h->tenant_size != sizeof(apl_tenant) ||
        h->slot_size != sizeof(apl_slot) || h->n_tenants != APL_TENANTS || h->n_slots != APL_SLOTS ||
        h->file_size != sizeof(apl_file))
        return "unexpected layout (another version of ascend_pool?)";
    /* A group's ledger may be another member's file, whose owner a user namespace's map can leave
       out (it shows as the overflow uid): the group and mode (apl_check_stat) are what is trusted
       there, so only an owner that can be told must match; a private ledger's always must. */
    uint32_t owner_host;
    if (ap_owner_host_uid(st->st_uid, &owner_host) ? h->owner_uid != owner_host : group == APL_NO_GROUP)
        return "the recorded owner is not the file's owner";
    if (h->group != (group == APL_NO_GROUP ? group : ap_host_gid(group)))
        return "it was created for another sharing group";
    if (h->device != device) return "it describes another device";
    if (strncmp(h->backend, backend, sizeof h->backend) != 0 || strncmp(h->node, node, sizeof h->node) != 0)
        return "it describes another backend or simulated node";
    for (int i = 0; i < APL_TENANTS; i++) {
        const apl_tenant *t = &f->tenants[i];
        uint32_t state = atomic_load(&t->state);
        if (state > APL_USED) return "a tenant entry has an impossible state";
        if (state == APL_FREE) continue;
        if (!apl_name_ok(t->name, sizeof t->name)) return "a tenant name is not a valid name";
        uint64_t q = atomic_load(&t->quota);
        if ((q > APL_MAX_BYTES && q != APL_NO_QUOTA) || atomic_load(&t->held) > APL_MAX_BYTES ||
            atomic_load(&t->peak) > APL_MAX_BYTES || atomic_load(&t->uncertain) > APL_MAX_BYTES)
            return "a tenant holds an impossible byte count";
        if (atomic_load(&t->warn_ppm) > 1000000) return "a tenant's warn level is above 100%";
        if (atomic_load(&t->quota_src) > APL_SRC_OPERATOR) return "a tenant's quota has an unknown source";
        for (int j = 0; j < i; j++)
            if (atomic_load(&f->tenants[j].state) == APL_USED &&
                strncmp(f->tenants[j].name, t->name, APL_NAME_MAX) == 0)
                return "a tenant appears twice";
    }
    for (int i = 0; i < APL_SLOTS; i++) {
        const apl_slot *s = &f->slots[i];
        uint32_t state = atomic_load(&s->state);
        if (state > APL_USED) return "a process slot has an impossible state";
        if (state == APL_FREE) continue;
        int64_t pending = atomic_load(&s->pending);
        if (s->instance == 0 || s->tenant >= APL_TENANTS || atomic_load(&f->tenants[s->tenant].state) != APL_USED)
            return "a process slot names no process or an unused tenant";
        if (atomic_load(&s->held) > APL_MAX_BYTES || pending > (int64_t)APL_MAX_BYTES ||
            pending < -(int64_t)APL_MAX_BYTES)
            return "a process slot holds an impossible byte count";
    }
    return NULL;
}

static int apl_lock(apl_ledger *L, char *err, size_t len);
static int apl_lock_ms(apl_ledger *L, int timeout_ms, char *err, size_t len);
static void apl_unlock(apl_ledger *L);

int ap_fork_drop_fd(int fd, int on); /* ../backend/fork.c (backend.h) */
void ap_fork_window_enter(void);
void ap_fork_window_leave(void);

/* Opens a descriptor whose lock a forked child must not keep, marked for its drop (fork.c) with no
   fork in between: the life lock's, and the update lock's (L->fd), a flock of its open file, which
   a child's copy shares: a parent killed inside an update left the ledger locked while its child
   lived (every other process's lock failed after APL_LOCK_TIMEOUT_MS). *marked: 0 where the table
   could not take it (fork.c). -1 with errno. */
static int apl_dropped_open(const char *path, int flags, mode_t mode, int *marked) {
    ap_fork_window_enter();
    int fd = open(path, flags | O_CLOEXEC, mode);
    int e = errno;
    *marked = fd >= 0 && ap_fork_drop_fd(fd, 1) == 0;
    ap_fork_window_leave();
    errno = e;
    return fd;
}

/* Closes such a descriptor: unregistered and closed with no fork between (fork.c). */
static void apl_dropped_close(int fd) {
    ap_fork_window_enter();
    ap_fork_drop_fd(fd, 0);
    close(fd);
    ap_fork_window_leave();
}

/* Creates the ledger under a temporary name and link()s it into place. APL_OK, EEXIST when another
   process won the race (the caller then opens theirs), or an APL_E_* kind. */
static int apl_create(const char *path, int device, const char *backend, const char *node, uint32_t group,
                      char *err, size_t len) {
    static _Atomic unsigned seq;
    char tmp[PATH_MAX + 64];
    /* Not named by pid alone: two processes of two pid namespaces may share a pid. */
    uint64_t rnd = 0;
    if (getrandom(&rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd) rnd = (uint64_t)(uintptr_t)&rnd ^ (uint64_t)time(NULL);
    snprintf(tmp, sizeof tmp, "%s.tmp.%d.%016llx.%u", path, (int)getpid(), (unsigned long long)rnd,
             atomic_fetch_add(&seq, 1));
    mode_t mode = group == APL_NO_GROUP ? 0600 : 0660;
    int marked;
    int fd = apl_dropped_open(tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW, 0600, &marked); /* locked below */
    if (fd < 0) return apl_fail(err, len, APL_E_IO, "cannot create ledger %s: %s", tmp, strerror(errno));
    /* Locked while it has its temporary name: a creator killed here leaves ~74 KB that a scan
       (identity.remove_dead_leases) removes once nobody holds this lock and it is over 60 s old.
       It is also the ledger's lock once published: held a few system calls more (unlink, close),
       as an update holds it. Not waited for: a new file's lock is free (a scan looks at old files
       only), and one left unlocked is at worst removed after a minute and made again (below). */
    (void)flock(fd, LOCK_EX | LOCK_NB);
    int rc = 0;
    const char *what = "initialise";
    if (group != APL_NO_GROUP && fchown(fd, (uid_t)-1, (gid_t)group) != 0) {
        rc = errno;
        what = "give the configured group";
    }
    if (!rc && (fchmod(fd, mode) != 0 || ftruncate(fd, sizeof(apl_file)) != 0)) rc = errno;
    /* every page now: a mapped write to a page a full file system cannot give is SIGBUS */
    if (!rc) rc = posix_fallocate(fd, 0, sizeof(apl_file));
    /* Written, not mapped: a mapping of fd keeps its open file, and the flock above, in a child
       forked meanwhile (from Python or C) for the child's life, and the published ledger stayed
       locked (every open failed after APL_LOCK_TIMEOUT_MS, the creator's own included). */
    if (!rc) {
        apl_file *f = malloc(sizeof(apl_file));
        if (!f) rc = ENOMEM;
        else {
            apl_init_file(f, device, backend, node, group);
            size_t done = 0;
            while (!rc && done < sizeof(apl_file)) {
                ssize_t w = pwrite(fd, (char *)f + done, sizeof(apl_file) - done, (off_t)done);
                if (w > 0) done += (size_t)w;
                else if (w < 0 && errno != EINTR) rc = errno;
                else if (w == 0) rc = EIO;
            }
            free(f);
            if (!rc) (void)fdatasync(fd); /* harmless in tmpfs; a disk directory gets a whole file */
        }
    }
    if (!rc && link(tmp, path) != 0) {
        rc = errno;
        what = "publish";
    }
    unlink(tmp);
    apl_dropped_close(fd);
    /* ENOENT: a scan removed the temporary file (this process was stopped for a minute before it
       locked it): the caller tries again, as after losing the race. */
    if (rc == EEXIST || (rc == ENOENT && !strcmp(what, "publish"))) return EEXIST;
    if (rc) return apl_fail(err, len, rc == EPERM || rc == EACCES ? APL_E_PERM : APL_E_IO,
                            "cannot %s ledger %s: %s", what, path, strerror(rc));
    return APL_OK;
}

/* Opens (creating if absent) and validates the ledger at path. *out gets a new reference. */
/* owner: the host uid the private ledger must belong to (ap_host_uid: its name's); APL_NO_OWNER for this user's own, which is
   created when missing. A node service sweeping a trusted user's ledger names that user: such a
   ledger is opened only if it exists, never created. */
/* lock_ms: how long the validation waits for the lock (a node service sweeping other users'
   ledgers waits less than APL_LOCK_TIMEOUT_MS: one stopped process must not stall it). A file
   another user can write (foreign, or a group's) is validated under the SIGBUS guard
   (ledger_guard.h): it may be truncated while it is being read. */
#define APL_NO_OWNER UINT32_MAX
static int apl_open_as_ms(const char *path, int device, const char *backend, const char *node, uint32_t group,
                          uint32_t owner, int lock_ms, apl_ledger **out, char *err, size_t len) {
    int foreign = owner != APL_NO_OWNER && owner != ap_host_uid();
    if (owner == APL_NO_OWNER) owner = ap_host_uid();
    if (strlen(path) >= PATH_MAX - 64) return apl_fail(err, len, APL_E_ARG, "ledger path too long: %s", path);
    if (strlen(backend) >= sizeof(((apl_header *)0)->backend) || strlen(node) >= sizeof(((apl_header *)0)->node))
        return apl_fail(err, len, APL_E_ARG, "backend or node name too long for the ledger");
    int fd = -1;
    for (int attempt = 0; attempt < 5 && fd < 0; attempt++) {
        fd = open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
        if (fd >= 0) break;
        if (errno == ELOOP)
            return apl_fail(err, len, APL_E_PERM, "ledger %s is a symbolic link; refusing it", path);
        if (errno == EACCES) return apl_open_refused(path, group, owner, err, len);
        if (errno != ENOENT || foreign)
            return apl_fail(err, len, APL_E_IO, "cannot open ledger %s: %s", path, strerror(errno));
        int rc = apl_create(path, device, backend, node, group, err, len);
        if (rc != APL_OK && rc != EEXIST) return rc;
    }
    if (fd < 0) return apl_fail(err, len, APL_E_IO, "ledger %s keeps appearing and vanishing", path);
    struct stat st;
    int rc = apl_check_stat(fd, path, group, owner, &st, err, len);
    if (rc != APL_OK) {
        close(fd);
        return rc;
    }
    apl_file *f = mmap(NULL, sizeof(apl_file), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (f == MAP_FAILED) {
        close(fd);
        return apl_fail(err, len, APL_E_IO, "cannot map ledger %s: %s", path, strerror(errno));
    }
    /* The lock's descriptor is not the mapping's: a forked child inherits the mapping, which keeps
       its open file (and a flock on it) for as long as the child lives. Its own open file, which a
       child drops (apl_dropped_open). */
    int marked;
    int lock_fd = apl_dropped_open(path, O_RDWR | O_NOFOLLOW, 0, &marked);
    struct stat lst;
    if (lock_fd < 0 || fstat(lock_fd, &lst) != 0 || lst.st_dev != st.st_dev || lst.st_ino != st.st_ino) {
        int e = lock_fd < 0 ? errno : 0;
        if (lock_fd >= 0) apl_dropped_close(lock_fd);
        munmap(f, sizeof(apl_file));
        close(fd);
        return apl_fail(err, len, APL_E_IO, "ledger %s was replaced while it was being opened%s%s", path,
                        e ? ": " : "", e ? strerror(e) : "");
    }
    close(fd); /* the mapping keeps the file */
    fd = lock_fd;
    apl_ledger *L = calloc(1, sizeof *L);
    if (!L) {
        munmap(f, sizeof(apl_file));
        apl_dropped_close(fd);
        return apl_fail(err, len, APL_E_IO, "host memory exhausted opening ledger %s", path);
    }
    L->f = f;
    L->fd = fd;
    L->fd_pid = getpid();
    L->life_fd = -1;
    L->st_dev = st.st_dev;
    L->st_ino = st.st_ino;
    L->device = device;
    L->group = group;
    L->guarded = foreign || group != APL_NO_GROUP;
    atomic_init(&L->broken, 0);
    atomic_init(&L->refs, 1);
    pthread_mutex_init(&L->mu, NULL);
    snprintf(L->path, sizeof L->path, "%s", path);
    snprintf(L->dir, sizeof L->dir, "%s", path);
    char *slash = strrchr(L->dir, '/');
    if (slash == L->dir) slash[1] = 0;
    else if (slash) *slash = 0;
    else snprintf(L->dir, sizeof L->dir, ".");
    /* The header is immutable after creation, but entries are checked under the lock so that no
       entry is seen half-claimed. */
    if ((rc = apl_lock_ms(L, lock_ms, err, len)) == APL_OK) {
        const char *volatile bad = NULL;
        volatile int bus = 0;
        if (L->guarded) {
            sigjmp_buf env;
            APL_GUARDED_AT(env, f, sizeof(apl_file), bad = apl_check_contents(f, &st, device, backend, node, group), bus = 1);
        } else {
            bad = apl_check_contents(f, &st, device, backend, node, group);
        }
        apl_unlock(L);
        if (bus)
            rc = apl_fail(err, len, APL_E_MALFORMED,
                          "ledger %s was truncated while it was being opened; refusing it", path);
        else if (bad)
            rc = apl_fail(err, len, APL_E_MALFORMED,
                          "ledger %s is malformed (%s); refusing it (remove it when no process uses device "
                          "quotas)", path, bad);
    }
    if (rc != APL_OK) {
        munmap(f, sizeof(apl_file));
        apl_dropped_close(fd);
        pthread_mutex_destroy(&L->mu);
        free(L);
        return rc;
    }
    *out = L;
    return APL_OK;
}

static int apl_open_as(const char *path, int device, const char *backend, const char *node, uint32_t group,
                       uint32_t owner, apl_ledger **out, char *err, size_t len) {
    return apl_open_as_ms(path, device, backend, node, group, owner, APL_LOCK_TIMEOUT_MS, out, err, len);
}

static void apl_ref(apl_ledger *L) { atomic_fetch_add(&L->refs, 1); }

static void apl_unref(apl_ledger *L) {
    if (L && atomic_fetch_sub(&L->refs, 1) == 1) {
        munmap(L->f, sizeof(apl_file));
        apl_dropped_close(L->fd);
        if (L->life_fd >= 0) /* this process's lock, or a forked child's copy */
            apl_dropped_close(L->life_fd);
        pthread_mutex_destroy(&L->mu);
        free(L);
    }
}

/* A forked child inherits the parent's open file, and with it the parent's flock(): it must open
   its own before locking, or parent and child would not exclude each other. */
static int apl_reopen_after_fork(apl_ledger *L, char *err, size_t len) {
    int marked;
    int fd = apl_dropped_open(L->path, O_RDWR | O_NOFOLLOW, 0, &marked);
    if (fd < 0) return apl_fail(err, len, APL_E_IO, "cannot reopen ledger %s: %s", L->path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_dev != L->st_dev || st.st_ino != L->st_ino) {
        apl_dropped_close(fd);
        return apl_fail(err, len, APL_E_PERM, "ledger %s was replaced by another file; refusing it", L->path);
    }
    apl_dropped_close(L->fd); /* the parent's copy (/dev/null after fork.c) */
    L->fd = fd;
    L->fd_pid = getpid();
    return APL_OK;
}

static int apl_lock(apl_ledger *L, char *err, size_t len) {
    return apl_lock_ms(L, APL_LOCK_TIMEOUT_MS, err, len);
}

/* apl_lock with a deadline of timeout_ms (both the process mutex and flock()). */
static int apl_lock_ms(apl_ledger *L, int timeout_ms, char *err, size_t len) {
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start); /* a deadline, not a count of sleeps: each oversleeps */
    /* The process mutex within the same deadline: another thread of this process may hold it
       while it waits out its own (longer) flock deadline. */
    while (pthread_mutex_trylock(&L->mu) != 0) {
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000 >= timeout_ms)
            return apl_fail(err, len, APL_E_LOCK, "cannot lock ledger %s: another thread of this process held it "
                            "for %d ms", L->path, timeout_ms);
        struct timespec ts = {0, 200 * 1000};
        nanosleep(&ts, NULL);
    }
    if (L->fd_pid != getpid()) {
        int rc = apl_reopen_after_fork(L, err, len);
        if (rc != APL_OK) {
            pthread_mutex_unlock(&L->mu);
            return rc;
        }
    }
    /* Non-blocking attempts with a bounded wait: a peer stopped (SIGSTOP) inside its critical
       section must produce an error, not a hang under the pool lock. */
    for (;;) {
        if (flock(L->fd, LOCK_EX | LOCK_NB) == 0) {
            atomic_store(&L->lock_tid, apl_bus_tid());
            return APL_OK;
        }
        if (errno != EWOULDBLOCK && errno != EINTR) break;
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000 >= timeout_ms) {
            errno = ETIMEDOUT;
            break;
        }
        struct timespec ts = {0, 200 * 1000};
        nanosleep(&ts, NULL);
    }
    int e = errno;
    pthread_mutex_unlock(&L->mu);
    if (e == ETIMEDOUT)
        return apl_fail(err, len, APL_E_LOCK, "cannot lock ledger %s: held for %d ms by another process (stopped "
                        "or wedged?)", L->path, timeout_ms);
    return apl_fail(err, len, APL_E_LOCK, "cannot lock ledger %s: %s", L->path, strerror(e));
}

static void apl_unlock(apl_ledger *L) {
    atomic_store(&L->lock_tid, 0);
    flock(L->fd, LOCK_UN);
    pthread_mutex_unlock(&L->mu);
}

/* After a guarded body faulted: gives the lock back if this thread holds it (the body jumped out
   between its apl_lock and apl_unlock). */
static void apl_unlock_if_held(apl_ledger *L) {
    if (atomic_load(&L->lock_tid) == apl_bus_tid()) apl_unlock(L);
}

#endif

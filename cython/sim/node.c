/* Device capacity shared by the processes of a simulated node, as a real device's HBM is: by every
 * process of every user.
 *
 * Each user keeps one small record per simulated device in shared memory: a file
 *     $ASCEND_SIM_SHM_DIR/ascendsim-<uid>-<node>-dev<N>      (default directory /dev/shm)
 * with one slot per attached process of that user (lease id, pid as a label, bytes held). Device
 * usage is the sum of the slots of every user's record of the node, so two processes on device 0
 * together cannot exceed its HBM, whoever runs them, and each one's aclrtGetMemInfo sees the
 * others' allocations.
 *
 * Squatting: the directory is writable by every local user, who may create any name in it first.
 * A name that is not a regular file of this user (another user's file, a symbolic link, a
 * directory...) is skipped for the next one, `...-dev<N>.1`, `.2`, ... (as ascend_pool's private
 * directories are): a process uses the first name that holds a record of its user, looking up to
 * NODE_LOOKAHEAD names past the first free one (so a squatted name removed later does not split
 * the user's processes over two records), and creates the record at that first free name when
 * it finds none. Squatting names can therefore never stop a user from using a device.
 *
 * Other users' records (foreign.c): read, never mapped (a mapping
 * of a file its owner may truncate raises SIGBUS) and never locked (another user may hold a lock
 * forever): each reserve preads them (file descriptors kept open, refreshed when the directory
 * changes). A foreign record counts only when it is a regular file owned by the uid its name
 * states, writable by that user alone, of the exact size, and describes this node, device and HBM
 * total; a slot counts at most the device's total, a record at most the total. Its slots' owners
 * are checked by their public leases (proc.c: sim_proc_foreign_alive) before a reserve is refused
 * and by aclrtGetMemInfo. What a hostile user can do with its own record is claim bytes, which is
 * what it could do by allocating them: a real device's memory is shared by all its users.
 *
 * Cross-user reserves are ordered without a shared lock: a process adds its bytes to its own slot
 * first, then reads the others' records, and takes the bytes back if the sum is over the total.
 * Of two processes reserving at once, at least one sees the other's bytes, so the device is never
 * over-committed; both may refuse when only one of them fits (a caller's retry then succeeds).
 *
 * Crashes: a process killed with memory held leaves its slot behind. Whoever looks next (aclInit,
 * aclrtGetMemInfo, or a malloc that would otherwise fail) checks each slot's owner by its lease
 * (proc.c: a lock the kernel drops at death, in whatever pid namespace; never by pid, which may
 * name another process in another namespace); a slot whose lease is not held is reclaimed by a
 * process of its user, and skipped by other users' sums, unless its owner holds its life lock on the
 * record (proc.c: sim_proc_life_hold; its lease files were removed under it by a cleanup). The lock is a word holding its holder's
 * lease id (proc.c: sim_proc_lock): if its holder dies, the next locker finds the lease dropped and
 * takes over, which is safe because every update of the record is a single atomic store (the sum
 * is recomputed, never cached). Not a robust pthread mutex: those name holders by thread id, which
 * pid namespaces repeat. So a process never takes a slot without holding its leases: when they
 * cannot be made (a directory out of room or inodes), attaching fails (aclInit:
 * ACL_ERROR_RT_RESOURCE_ALLOC_FAIL naming the file and errno), where before the slot was taken
 * anyway, reclaimed by the next process as a dead one's, and its bytes handed out twice.
 *
 * Trust: the file is created mode 0644 (its owner writes, every user of the node reads), fully
 * initialised under a temporary name and then link()ed into place, so nobody ever sees a
 * half-written record (and two creators racing cannot both win). Before use it is checked:
 * regular file, owned by this user, writable by nobody else, exact size, magic, version, layout,
 * device index, node name and the same HBM total. A record of this user failing any check is
 * refused with a message naming the file; it is never repaired or trusted. One exception: a record
 * of an earlier simulator version (left in /dev/shm across an upgrade) whose slots name no live
 * process is replaced by a fresh one (stale_older_record); while one of them lives it is refused.
 *
 * Locks, in the order they nest: a record's lock (this user's processes only; guards its
 * slots' claims and reclaims) -> foreign_mu (foreign.c, process-local: the cache of other users'
 * records) -> lease_mu (proc.c: the lease directory). None is ever taken inside a later one.
 * Invariants: a slot's bytes never exceed the total; after a successful reserve, this user's sum
 * plus every live foreign slot never exceeds the total.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <time.h>

#include "sim_internal.h"
#include "node_record.h"

struct node_local {
    struct node_record *_Atomic rec;     /* NULL when detached; mappings are never unmapped */
    int slot;
    /* fd + 1 (0: none) of the record, open for writing, on which this process holds its life lock
       (proc.c: sim_proc_life_hold) and reads the others' (their lease files removed under them) */
    _Atomic int life_fd1;
    char path[PATH_MAX + SIM_NODE_NAME_MAX + 64];
};

static struct node_local local[SIM_MAX_DEVICES];

static int life_fd(const struct node_local *l)
{
    return atomic_load(&l->life_fd1) - 1;
}

static int lock_record(struct node_record *r, int life)
{
    int took_over = 0;
    int rc = sim_proc_lock(&r->lock_owner, NODE_LOCK_TIMEOUT_S, &took_over, life);
    if (took_over) /* the holder died inside its critical section; its stores were single atomic ones */
        atomic_fetch_add(&r->recoveries, 1);
    return rc;
}

static void unlock_record(struct node_record *r)
{
    sim_proc_unlock(&r->lock_owner);
}

static uint64_t sum_slots(struct node_record *r)
{
    uint64_t used = 0;
    for (int i = 0; i < NODE_SLOTS; i++)
        if (atomic_load(&r->slots[i].pid) != 0)
            used += atomic_load(&r->slots[i].bytes);
    return used;
}

/* Frees the slots of processes that are gone. Called with the record locked; life: a descriptor of
   it (life_fd), where the live owners hold their life locks. */
static void reclaim_dead(struct node_record *r, int self, int life)
{
    for (int i = 0; i < NODE_SLOTS; i++) {
        struct node_slot *s = &r->slots[i];
        int32_t pid = atomic_load(&s->pid);
        if (i == self || pid == 0)
            continue;
        if (sim_proc_owner_alive(pid, atomic_load(&s->start_time), atomic_load(&s->pidns),
                                 atomic_load(&s->proc_start), life) == 0) {
            atomic_store(&s->bytes, 0);
            atomic_store(&s->pid, 0);
        }
    }
}

static int init_record(struct node_record *r, int dev, const struct sim_config *cfg)
{
    memset(r, 0, sizeof *r);
    r->magic = NODE_MAGIC;
    r->version = NODE_VERSION;
    r->record_size = sizeof *r;
    r->owner_uid = sim_host_uid(); /* the host's uid: one record inside and outside a user namespace */
    r->nslots = NODE_SLOTS;
    r->device = (uint32_t)dev;
    r->total_bytes = cfg->hbm;
    snprintf(r->node, sizeof r->node, "%s", cfg->node);
    atomic_store(&r->lock_owner, 0);
    return 0;
}

/* Checks an opened record; maps it into *out. Returns 0 or an aclError (message recorded). */
static int validate(int fd, const char *path, int dev, const struct sim_config *cfg,
                    struct node_record **out, const char *call)
{
    struct stat st;
    if (fstat(fd, &st) != 0)
        return sim_fail(ACL_ERROR_INVALID_FILE, call, "cannot stat node record %s: %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode))
        return sim_fail(ACL_ERROR_INVALID_FILE, call, "node record %s is not a regular file; refusing it", path);
    if (st.st_uid != geteuid())
        return sim_fail(ACL_ERROR_RT_NO_PERMISSION, call,
                        "node record %s is owned by uid %u, not by this user (uid %u); refusing a "
                        "record another user could write", path, (unsigned)st.st_uid, (unsigned)geteuid());
    if (st.st_mode & 022)
        return sim_fail(ACL_ERROR_RT_NO_PERMISSION, call,
                        "node record %s has permissions %03o; only its owner may write it (0644), "
                        "refusing it", path, (unsigned)(st.st_mode & 0777));
    if ((st.st_mode & 0777) != 0644)
        (void)fchmod(fd, 0644); /* a 0600 record of an earlier version: let other users count it */
    if (st.st_size != (off_t)sizeof(struct node_record))
        return sim_fail(ACL_ERROR_INVALID_FILE, call,
                        "node record %s is %lld bytes, expected %zu: malformed or from another "
                        "simulator version; refusing it (remove it if no process uses the node)",
                        path, (long long)st.st_size, sizeof(struct node_record));
    struct node_record *r = mmap(NULL, sizeof *r, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (r == MAP_FAILED)
        return sim_fail(ACL_ERROR_INVALID_FILE, call, "cannot map node record %s: %s", path, strerror(errno));
    const char *bad = NULL;
    if (r->magic != NODE_MAGIC)
        bad = "bad magic number";
    else if (r->version != NODE_VERSION)
        bad = "unsupported version";
    else if (r->record_size != sizeof *r || r->nslots != NODE_SLOTS)
        bad = "unexpected layout";
    else if (r->owner_uid != sim_host_uid())
        bad = "recorded owner is another user";
    else if (r->device != (uint32_t)dev || strncmp(r->node, cfg->node, sizeof r->node) != 0)
        bad = "it describes another device or node";
    else {
        for (int i = 0; i < NODE_SLOTS && !bad; i++)
            if (atomic_load(&r->slots[i].bytes) > r->total_bytes || atomic_load(&r->slots[i].pid) < 0)
                bad = "a process slot holds an impossible value";
    }
    if (bad) {
        munmap(r, sizeof *r);
        return sim_fail(ACL_ERROR_INVALID_FILE, call,
                        "node record %s is malformed (%s); refusing it (remove it if no process "
                        "uses the node)", path, bad);
    }
    if (r->total_bytes != cfg->hbm) {
        unsigned long long had = (unsigned long long)r->total_bytes;
        munmap(r, sizeof *r);
        return sim_fail(ACL_ERROR_INVALID_FILE, call,
                        "node record %s says device %d has %llu bytes of HBM but this process is "
                        "configured for %llu (ASCEND_SIM_HBM); every process of node '%s' must "
                        "agree: use another ASCEND_SIM_NODE or remove the file",
                        path, dev, had, (unsigned long long)cfg->hbm, cfg->node);
    }
    *out = r;
    return 0;
}

/* The record versions whose slots this build can read: the slots end the file with this build's
   layout (only the header before them changed). */
#define NODE_OLDEST_READABLE 2u

/* 1 when fd is this user's record of an earlier simulator version (kept in /dev/shm across an
   upgrade) that no live process uses: every claimed slot's lease is dropped. Such a record is
   replaced, not refused: it describes nothing any more, and the user could do nothing but remove
   it by hand. */
static int stale_older_record(int fd, const struct stat *st)
{
    size_t slots_len = NODE_SLOTS * sizeof(struct node_slot);
    struct { uint64_t magic; uint32_t version; } head;
    if (!S_ISREG(st->st_mode) || st->st_uid != geteuid() || st->st_size < (off_t)(sizeof head + slots_len) ||
        st->st_size > (off_t)(1 << 20) || pread(fd, &head, sizeof head, 0) != (ssize_t)sizeof head ||
        head.magic != NODE_MAGIC || head.version >= NODE_VERSION || head.version < NODE_OLDEST_READABLE)
        return 0;
    struct node_slot *slots = malloc(slots_len);
    if (!slots || pread(fd, slots, slots_len, st->st_size - (off_t)slots_len) != (ssize_t)slots_len) {
        free(slots);
        return 0;
    }
    int live = 0;
    for (int i = 0; i < NODE_SLOTS && !live; i++)
        live = atomic_load(&slots[i].pid) != 0 && sim_proc_alive(0, atomic_load(&slots[i].start_time)) != 0;
    free(slots);
    return !live;
}

/* Creates the record under a temporary name and link()s it into place (with `over`, the fd of a
   stale record at path: rename()s it over that one, if path still names it). 0 ok, EEXIST when
   another process won the race (then open theirs), or an aclError. */
static int create_record_over(const char *path, int dev, const struct sim_config *cfg, int over,
                              struct node_record **out, int *fd_out, const char *call);

static int create_record(const char *path, int dev, const struct sim_config *cfg,
                         struct node_record **out, int *fd_out, const char *call)
{
    return create_record_over(path, dev, cfg, -1, out, fd_out, call);
}

/* *fd_out: the new record's descriptor (open for writing), on success. */
static int create_record_over(const char *path, int dev, const struct sim_config *cfg, int over,
                              struct node_record **out, int *fd_out, const char *call)
{
    static _Atomic unsigned seq;
    char tmp[PATH_MAX + SIM_NODE_NAME_MAX + 128];
    /* Named by our lease id, not our pid: two processes of two pid namespaces may share a pid. */
    snprintf(tmp, sizeof tmp, "%s.tmp.%016llx.%u", path, (unsigned long long)sim_proc_self_id(),
             atomic_fetch_add(&seq, 1));
    int fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0)
        return sim_fail(ACL_ERROR_INVALID_FILE, call, "cannot create node record %s: %s", tmp, strerror(errno));
    int rc = 0;
    struct node_record *r = MAP_FAILED;
    if (fchmod(fd, 0644) != 0 || ftruncate(fd, sizeof *r) != 0)
        rc = errno;
    if (!rc) /* every page now: a mapped write to a page a full file system cannot give is SIGBUS */
        rc = posix_fallocate(fd, 0, sizeof *r);
    if (!rc) {
        r = mmap(NULL, sizeof *r, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (r == MAP_FAILED)
            rc = errno;
    }
    if (!rc)
        rc = init_record(r, dev, cfg);
    if (!rc && over < 0 && link(tmp, path) != 0)
        rc = errno;
    if (!rc && over >= 0) {
        /* Replacers of one stale record take turns on its flock (current records are never
           flock()ed), and replace it only while path still names it. */
        struct stat now, old;
        if (flock(over, LOCK_EX | LOCK_NB) != 0)
            rc = EEXIST;
        else if (stat(path, &now) != 0 || fstat(over, &old) != 0 || now.st_ino != old.st_ino || now.st_dev != old.st_dev)
            rc = EEXIST;
        else if (rename(tmp, path) != 0)
            rc = errno;
        (void)flock(over, LOCK_UN);
    }
    unlink(tmp);
    if (rc) {
        close(fd);
        if (r != MAP_FAILED)
            munmap(r, sizeof *r);
        if (rc == EEXIST)
            return EEXIST;
        return sim_fail(ACL_ERROR_INVALID_FILE, call, "cannot create node record %s: %s", path, strerror(rc));
    }
    *out = r;
    *fd_out = fd;
    return 0;
}

int sim_node_record_name(char *out, size_t len, unsigned uid, const char *node, int dev, int index)
{
    if (index == 0)
        return snprintf(out, len, "ascendsim-%u-%s-dev%d", uid, node, dev);
    return snprintf(out, len, "ascendsim-%u-%s-dev%d.%d", uid, node, dev, index);
}

static void record_path(char *out, size_t len, const struct sim_config *cfg, int dev, int index)
{
    char name[SIM_NODE_NAME_MAX + 64];
    sim_node_record_name(name, sizeof name, sim_host_uid(), cfg->node, dev, index);
    snprintf(out, len, "%s/%s", cfg->shm_dir, name);
}

/* Finds this user's record of the device (see "Squatting" above), or creates it; its path goes to
   `path` (len PATH_MAX + SIM_NODE_NAME_MAX + 64), its descriptor (open for writing) to *fd_out. */
static int open_record(char *path, size_t len, int dev, const struct sim_config *cfg,
                       struct node_record **out, int *fd_out, const char *call)
{
    for (int attempt = 0; attempt < 5; attempt++) {
        int first_free = -1, taken = 0, replaced = 0;
        for (int i = 0; i < NODE_PROBES && !replaced && (first_free < 0 || i <= first_free + NODE_LOOKAHEAD); i++) {
            record_path(path, len, cfg, dev, i);
            int fd = open(path, O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
            if (fd < 0) {
                if (errno == ENOENT) {
                    if (first_free < 0)
                        first_free = i;
                    continue;
                }
                if (errno == ELOOP || errno == EACCES || errno == EPERM || errno == EISDIR ||
                    errno == ENXIO || errno == ETXTBSY || errno == EOPNOTSUPP) {
                    taken++; /* a symbolic link, someone else's file, a directory...: not ours */
                    continue;
                }
                return sim_fail(ACL_ERROR_INVALID_FILE, call, "cannot open node record %s: %s", path,
                                strerror(errno));
            }
            struct stat st;
            if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid()) {
                close(fd); /* a name another user (or something else) holds: skip it */
                taken++;
                continue;
            }
            int rc;
            if (stale_older_record(fd, &st)) { /* an upgrade's leftover: replace it, then look again */
                rc = create_record_over(path, dev, cfg, fd, out, fd_out, call);
                close(fd);
                if (rc == 0)
                    return 0;
                if (rc != EEXIST)
                    return rc;
                replaced = 1; /* another process replaced it first: look again from the start */
                continue;
            }
            rc = validate(fd, path, dev, cfg, out, call); /* ours: use it, or refuse it */
            if (rc == 0)
                *fd_out = fd;
            else
                close(fd);
            return rc;
        }
        if (replaced)
            continue;
        if (first_free < 0)
            return sim_fail(ACL_ERROR_RT_NO_PERMISSION, call,
                            "no name for device %d's node record is free in %s: %d names "
                            "ascendsim-%u-%s-dev%d[.N] are taken by others", dev, cfg->shm_dir, taken,
                            sim_host_uid(), cfg->node, dev);
        record_path(path, len, cfg, dev, first_free);
        int rc = create_record(path, dev, cfg, out, fd_out, call);
        if (rc != EEXIST)
            return rc;
        /* Another process (or a squatter) took the name first: look again. */
    }
    return sim_fail(ACL_ERROR_INVALID_FILE, call, "node record %s keeps appearing and vanishing", path);
}

/* A random nonzero id for this loaded copy of the simulator. */
static uint32_t instance_id(void)
{
    static _Atomic uint32_t id;
    uint32_t v = atomic_load(&id);
    while (!v) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t x = ((uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20) ^ (uint64_t)(uintptr_t)&id) *
                     0x9E3779B97F4A7C15ull;
        uint32_t want = (uint32_t)(x >> 32) | 1u;
        uint32_t expected = 0;
        atomic_compare_exchange_strong(&id, &expected, want);
        v = atomic_load(&id);
    }
    return v;
}

int sim_node_attach(int dev, const struct sim_config *cfg, const char *call)
{
    struct node_local *l = &local[dev];
    sim_proc_use_dir(cfg->shm_dir); /* our lease, beside the records that name us by it */
    /* Never a slot without a lease: others would take us for dead at once, reclaim the slot and
       hand its bytes out again (before: a directory out of inodes over-committed the device). */
    int rc = sim_proc_lease_ready(call);
    if (rc)
        return rc;
    sim_proc_sweep_abandoned(cfg->shm_dir); /* killed processes' half-made files */
    struct node_record *r;
    /* The node's device behind this process's `dev` (ASCEND_RT_VISIBLE_DEVICES renumbers): its
       capacity is shared with every process that sees it, whatever number each gives it. */
    int fd = -1;
    rc = open_record(l->path, sizeof l->path, cfg->phys[dev], cfg, &r, &fd, call);
    if (rc)
        return rc;
    /* Held before our slot is claimed, for as long as the process lives (the descriptor is kept;
       one of an earlier aclInit is replaced, a fork child's copy closed: sim_node_reset). On a
       descriptor of its own, not the mapping's: a forked child inherits the mapping, which keeps
       its open file (and a lock on it) for as long as the child lives. */
    /* From its open to its entry in life_fd1 (where sim_node_reset closes it), no fork (proc.c's
       window): a fork between gave the child a copy of the open file the lock is then taken on. */
    sim_proc_fork_window_enter();
    int life = open(l->path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    struct stat mapped, now;
    if (life >= 0 && (fstat(fd, &mapped) != 0 || fstat(life, &now) != 0 || mapped.st_ino != now.st_ino ||
                      mapped.st_dev != now.st_dev)) {
        close(life); /* replaced meanwhile: the lease alone tells */
        life = -1;
    }
    /* An earlier aclInit's descriptor goes first: it holds this lease's byte on the same file
       (re-init after aclFinalize), and a lock by another open file conflicts even within the
       process, so taken before, the new one failed and closing the old left no lock at all. */
    int old = atomic_exchange(&l->life_fd1, life + 1) - 1;
    if (old >= 0)
        close(old);
    sim_proc_fork_window_leave();
    close(fd);
    if (life >= 0)
        (void)sim_proc_life_hold(life);
    fd = life;
    int32_t me = (int32_t)getpid();
    uint32_t inst = instance_id();
    uint64_t start = sim_proc_self_id();
    if ((rc = lock_record(r, fd)) != 0)
        return sim_fail(ACL_ERROR_RT_INTERNAL_ERROR, call, "cannot lock node record %s: %s", l->path, strerror(rc));
    reclaim_dead(r, -1, fd);
    int slot = -1;
    for (int i = 0; i < NODE_SLOTS; i++) {
        /* A process may load two copies of the simulator (e.g. the legacy build beside the
           normal one): each has its own slot, told apart by the instance id. */
        if (atomic_load(&r->slots[i].pid) == me && atomic_load(&r->slots[i].instance) == inst &&
            atomic_load(&r->slots[i].start_time) == start) {
            /* Ours from an earlier aclInit (same lease: a process of another pid namespace with
               our pid has another). Either way we hold nothing yet. */
            atomic_store(&r->slots[i].bytes, 0);
            slot = i;
            break;
        }
    }
    for (int i = 0; i < NODE_SLOTS && slot < 0; i++)
        if (atomic_load(&r->slots[i].pid) == 0)
            slot = i;
    if (slot >= 0) {
        atomic_store(&r->slots[slot].bytes, 0);
        atomic_store(&r->slots[slot].start_time, start);
        atomic_store(&r->slots[slot].pidns, sim_proc_pidns());
        atomic_store(&r->slots[slot].proc_start, sim_proc_start_time(me));
        atomic_store(&r->slots[slot].instance, inst);
        atomic_store(&r->slots[slot].pid, me);
    }
    unlock_record(r);
    if (slot < 0)
        return sim_fail(ACL_ERROR_RT_RESOURCE_ALLOC_FAIL, call,
                        "node record %s is full: %d live processes already use device %d", l->path,
                        NODE_SLOTS, dev);
    l->slot = slot;
    atomic_store(&l->rec, r);
    return 0;
}

void sim_node_detach(int dev)
{
    struct node_local *l = &local[dev];
    struct node_record *r = atomic_exchange(&l->rec, NULL);
    if (!r)
        return;
    if (lock_record(r, life_fd(l)) == 0) {
        atomic_store(&r->slots[l->slot].bytes, 0);
        atomic_store(&r->slots[l->slot].pid, 0);
        unlock_record(r);
    } else {
        atomic_store(&r->slots[l->slot].bytes, 0);
        atomic_store(&r->slots[l->slot].pid, 0);
    }
    /* Not unmapped: a call racing aclFinalize may still read it. 6 KiB per device per aclInit. */
}

int sim_node_reserve(int dev, uint64_t bytes)
{
    struct node_local *l = &local[dev];
    struct node_record *r = atomic_load(&l->rec);
    if (!r || lock_record(r, life_fd(l)) != 0)
        return -1;
    uint64_t total = r->total_bytes;
    if (bytes > total) {
        unlock_record(r);
        return 1;
    }
    uint64_t used = sum_slots(r);
    if (used + bytes > total) {
        /* Before refusing, take back what dead processes left behind. */
        reclaim_dead(r, l->slot, life_fd(l));
        used = sum_slots(r);
    }
    if (used + bytes > total) {
        unlock_record(r);
        return 1;
    }
    /* Claimed first (never past the total: a concurrent aclInit's validate() reads the slots),
       then checked against the other users' (see "Cross-user reserves" above). */
    _Atomic uint64_t *mine = &r->slots[l->slot].bytes;
    atomic_fetch_add(mine, bytes);
    used += bytes;
    uint64_t foreign = sim_foreign_used(g_sim.cfg.phys[dev], &g_sim.cfg, 0, 0);
    if (foreign > total - used) {
        /* Before refusing, take back (or skip) what dead processes left behind. */
        reclaim_dead(r, l->slot, life_fd(l));
        used = sum_slots(r);
        foreign = sim_foreign_used(g_sim.cfg.phys[dev], &g_sim.cfg, 1, 1);
    }
    int rc = 0;
    if (used > total || foreign > total - used) {
        atomic_fetch_sub(mine, bytes);
        rc = 1;
    }
    unlock_record(r);
    return rc;
}

void sim_node_release(int dev, uint64_t bytes)
{
    /* Only this process writes its slot, and releases only lower the sum: no lock needed. */
    struct node_local *l = &local[dev];
    struct node_record *r = atomic_load(&l->rec);
    if (!r)
        return;
    /* Never below zero: a wrapped counter would make the device look full to everyone. */
    _Atomic uint64_t *held = &r->slots[l->slot].bytes;
    uint64_t cur = atomic_load(held);
    while (!atomic_compare_exchange_weak(held, &cur, cur >= bytes ? cur - bytes : 0)) {
    }
}

uint64_t sim_node_used(int dev)
{
    struct node_local *l = &local[dev];
    struct node_record *r = atomic_load(&l->rec);
    if (!r)
        return 0;
    uint64_t used;
    if (lock_record(r, life_fd(l)) != 0) {
        used = sum_slots(r);
    } else {
        reclaim_dead(r, l->slot, life_fd(l));
        used = sum_slots(r);
        unlock_record(r);
    }
    uint64_t total = r->total_bytes, foreign = sim_foreign_used(g_sim.cfg.phys[dev], &g_sim.cfg, 1, 0);
    if (used > total)
        used = total;
    return foreign > total - used ? total : used + foreign;
}

void sim_node_reset(void)
{
    for (int i = 0; i < SIM_MAX_DEVICES; i++) {
        atomic_store(&local[i].rec, NULL); /* the parent's slots are not the child's */
        /* Nor its life locks: our copy closed, the lock stays the parent's (its descriptor still
           refers to the open file); kept, it would keep a killed parent's slot alive. */
        int fd = atomic_exchange(&local[i].life_fd1, 0) - 1;
        if (fd >= 0)
            close(fd);
    }
    sim_foreign_reset();
}

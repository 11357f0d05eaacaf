/* Device capacity shared by the processes of a simulated node, as a real device's HBM is.
 *
 * Each simulated device has a small record in shared memory: a file
 *     $ASCEND_SIM_SHM_DIR/ascendsim-<uid>-<node>-dev<N>      (default directory /dev/shm)
 * with one slot per attached process (lease id, pid as a label, bytes held). Device usage is the
 * sum of the slots, so two processes on device 0 together cannot exceed its HBM and each one's
 * aclrtGetMemInfo sees the others' allocations.
 *
 * Crashes: a process killed with memory held leaves its slot behind. Whoever looks next (aclInit,
 * aclrtGetMemInfo, or a malloc that would otherwise fail) checks each slot's owner by its lease
 * (proc.c: a lock the kernel drops at death, in whatever pid namespace; never by pid, which may
 * name another process in another namespace); a slot whose lease is not held is reclaimed. The lock is a process-shared robust mutex: if its holder dies, the
 * next locker gets EOWNERDEAD and carries on, which is safe because every update of the record is
 * a single atomic store (the sum is recomputed, never cached).
 *
 * Trust: the file is created with owner-only permissions, fully initialised under a temporary
 * name and then link()ed into place, so nobody ever sees a half-written record (and two creators
 * racing cannot both win). Before use it is checked: regular file, owned by this user, mode 0600,
 * exact size, magic, version, layout, device index, node name and the same HBM total. A record
 * failing any check is refused with a message naming the file; it is never repaired or trusted.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <time.h>

#include "sim_internal.h"

#define NODE_MAGIC 0x314d495344435341ull /* "ASCDSIM1" */
#define NODE_VERSION 2u /* 2: slots named by lease id */
#define NODE_SLOTS 256
#define NODE_LOCK_TIMEOUT_S 10           /* a lock held this long means a wedged peer */

struct node_slot {
    _Atomic int32_t pid;                 /* 0: free */
    _Atomic uint32_t instance;           /* which loaded copy of the simulator in that process */
    _Atomic uint64_t start_time;         /* the owner's lease id (proc.c), despite the name */
    _Atomic uint64_t pidns;              /* the owner's pid namespace (inode): what pid is relative to */
    _Atomic uint64_t proc_start;         /* /proc/PID/stat field 22 in that namespace */
    _Atomic uint64_t bytes;
};

struct node_record {
    uint64_t magic;
    uint32_t version;
    uint32_t record_size;
    uint32_t owner_uid;
    uint32_t nslots;
    uint32_t device;
    uint32_t reserved;
    uint64_t total_bytes;
    char node[SIM_NODE_NAME_MAX + 8];
    pthread_mutex_t lock;                /* process-shared, robust */
    _Atomic uint64_t recoveries;         /* times a dead holder's lock was recovered */
    struct node_slot slots[NODE_SLOTS];
};

struct node_local {
    struct node_record *_Atomic rec;     /* NULL when detached; mappings are never unmapped */
    int slot;
    char path[PATH_MAX + SIM_NODE_NAME_MAX + 64];
};

static struct node_local local[SIM_MAX_DEVICES];

static int lock_record(struct node_record *r)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += NODE_LOCK_TIMEOUT_S;
    int rc = pthread_mutex_timedlock(&r->lock, &ts);
    if (rc == EOWNERDEAD) {
        /* The holder died inside its critical section; its stores were single atomic ones. */
        pthread_mutex_consistent(&r->lock);
        atomic_fetch_add(&r->recoveries, 1);
        rc = 0;
    }
    return rc;
}

static uint64_t sum_slots(struct node_record *r)
{
    uint64_t used = 0;
    for (int i = 0; i < NODE_SLOTS; i++)
        if (atomic_load(&r->slots[i].pid) != 0)
            used += atomic_load(&r->slots[i].bytes);
    return used;
}

/* Frees the slots of processes that are gone. Called with the record locked. */
static void reclaim_dead(struct node_record *r, int self)
{
    for (int i = 0; i < NODE_SLOTS; i++) {
        struct node_slot *s = &r->slots[i];
        int32_t pid = atomic_load(&s->pid);
        if (i == self || pid == 0)
            continue;
        if (sim_proc_owner_alive(pid, atomic_load(&s->start_time), atomic_load(&s->pidns),
                                 atomic_load(&s->proc_start)) == 0) {
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
    r->owner_uid = (uint32_t)geteuid();
    r->nslots = NODE_SLOTS;
    r->device = (uint32_t)dev;
    r->total_bytes = cfg->hbm;
    snprintf(r->node, sizeof r->node, "%s", cfg->node);
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    int rc = pthread_mutex_init(&r->lock, &a);
    pthread_mutexattr_destroy(&a);
    return rc;
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
    if (st.st_mode & 077)
        return sim_fail(ACL_ERROR_RT_NO_PERMISSION, call,
                        "node record %s has permissions %03o; only its owner may have access (0600), "
                        "refusing it", path, (unsigned)(st.st_mode & 0777));
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
    else if (r->owner_uid != (uint32_t)geteuid())
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

/* Creates the record under a temporary name and link()s it into place. 0 ok, EEXIST when another
   process won the race (then open theirs), or an aclError. */
static int create_record(const char *path, int dev, const struct sim_config *cfg,
                         struct node_record **out, const char *call)
{
    static _Atomic unsigned seq;
    char tmp[PATH_MAX + SIM_NODE_NAME_MAX + 128];
    /* Named by our lease id, not our pid: two processes of two pid namespaces may share a pid. */
    snprintf(tmp, sizeof tmp, "%s.tmp.%016llx.%u", path, (unsigned long long)sim_proc_self_id(),
             atomic_fetch_add(&seq, 1));
    int fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0)
        return sim_fail(ACL_ERROR_INVALID_FILE, call, "cannot create node record %s: %s", tmp, strerror(errno));
    int rc = 0;
    struct node_record *r = MAP_FAILED;
    if (fchmod(fd, 0600) != 0 || ftruncate(fd, sizeof *r) != 0)
        rc = errno;
    if (!rc) {
        r = mmap(NULL, sizeof *r, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (r == MAP_FAILED)
            rc = errno;
    }
    if (!rc)
        rc = init_record(r, dev, cfg);
    if (!rc && link(tmp, path) != 0)
        rc = errno;
    unlink(tmp);
    close(fd);
    if (rc) {
        if (r != MAP_FAILED)
            munmap(r, sizeof *r);
        if (rc == EEXIST)
            return EEXIST;
        return sim_fail(ACL_ERROR_INVALID_FILE, call, "cannot create node record %s: %s", path, strerror(rc));
    }
    *out = r;
    return 0;
}

static int open_record(const char *path, int dev, const struct sim_config *cfg,
                       struct node_record **out, const char *call)
{
    for (int attempt = 0; attempt < 5; attempt++) {
        int fd = open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
        if (fd >= 0) {
            int rc = validate(fd, path, dev, cfg, out, call);
            close(fd);
            return rc;
        }
        if (errno != ENOENT)
            return sim_fail(errno == ELOOP ? ACL_ERROR_RT_NO_PERMISSION : ACL_ERROR_INVALID_FILE, call,
                            "cannot open node record %s: %s%s", path, strerror(errno),
                            errno == ELOOP ? " (a symbolic link; refusing it)" : "");
        int rc = create_record(path, dev, cfg, out, call);
        if (rc != EEXIST)
            return rc;
        /* Another process created it first: open and validate theirs. */
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
    snprintf(l->path, sizeof l->path, "%s/ascendsim-%u-%s-dev%d", cfg->shm_dir, (unsigned)geteuid(),
             cfg->node, dev);
    struct node_record *r;
    int rc = open_record(l->path, dev, cfg, &r, call);
    if (rc)
        return rc;
    int32_t me = (int32_t)getpid();
    uint32_t inst = instance_id();
    uint64_t start = sim_proc_self_id();
    if ((rc = lock_record(r)) != 0)
        return sim_fail(ACL_ERROR_RT_INTERNAL_ERROR, call, "cannot lock node record %s: %s", l->path, strerror(rc));
    reclaim_dead(r, -1);
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
    pthread_mutex_unlock(&r->lock);
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
    if (lock_record(r) == 0) {
        atomic_store(&r->slots[l->slot].bytes, 0);
        atomic_store(&r->slots[l->slot].pid, 0);
        pthread_mutex_unlock(&r->lock);
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
    if (!r || lock_record(r) != 0)
        return -1;
    uint64_t used = sum_slots(r);
    if (used + bytes > r->total_bytes) {
        /* Before refusing, take back what dead processes left behind. */
        reclaim_dead(r, l->slot);
        used = sum_slots(r);
    }
    int rc = 1;
    if (used + bytes <= r->total_bytes) {
        atomic_fetch_add(&r->slots[l->slot].bytes, bytes);
        rc = 0;
    }
    pthread_mutex_unlock(&r->lock);
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
    if (lock_record(r) != 0)
        return sum_slots(r);
    reclaim_dead(r, l->slot);
    uint64_t used = sum_slots(r);
    pthread_mutex_unlock(&r->lock);
    return used;
}

void sim_node_reset(void)
{
    for (int i = 0; i < SIM_MAX_DEVICES; i++)
        atomic_store(&local[i].rec, NULL); /* the parent's slots are not the child's */
}

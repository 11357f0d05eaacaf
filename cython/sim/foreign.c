/* Other users' node records: how much of a device the processes of other users of the node hold.
 *
 * A real device's memory is shared by every process on the node, whoever runs it, so each user's
 * record (node.c) is readable by all and every process adds the other users' records to its own
 * when it reserves and when it answers aclrtGetMemInfo. Another user may be hostile, so its files
 * are only ever read:
 *   - never mapped: its owner may truncate it, and a mapping would then raise SIGBUS; each use
 *     preads the whole record into a buffer of ours (a short read counts 0);
 *   - never locked: its owner may hold the lock forever; a slot's fields are read as they are
 *     (every writer stores them atomically), and any value is only that user's claim;
 *   - trusted only when it is a regular file owned by the uid its name states, writable by that
 *     user alone, of the exact size, with the magic, version, layout, owner, device, node and HBM
 *     total of this node (else it counts 0); a slot counts at most the total, so does a record,
 *     and so does the sum;
 *   - bounded: at most NODE_FOREIGN_MAX records per device, 4 per user, and FOREIGN_SCAN_MAX
 *     directory entries per scan.
 * A user can therefore make a device look as full as it could make it by allocating, nothing more:
 * no crash, no hang, no refusal of this user's record. A slot's owner is checked by its public
 * lease (proc.c) when check_alive is asked for, so the bytes of a dead process of a user that never
 * runs again do not count forever.
 *
 * The directory is listed again when its mtime moved since the last listing, or when the last
 * listing was less than FOREIGN_TICK_NS after that mtime (a name added in the same clock tick would
 * not move it); otherwise the open descriptors of the last listing are read.
 *
 * Locks: foreign_mu guards the cache (descriptors, buffer); callers may hold a node record's mutex
 * (node.c takes foreign_mu inside it, never the other way round).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sim_internal.h"
#include "node_record.h"

#define FOREIGN_SCAN_MAX 65536                    /* directory entries looked at per listing */
#define FOREIGN_PER_USER 4                        /* records counted per other user */
#define FOREIGN_TICK_NS (20ull * 1000 * 1000)     /* larger than the file system's mtime tick */

struct foreign_rec {
    int fd;
    unsigned uid;
};

struct foreign_cache {
    int valid;
    char dir[PATH_MAX];
    char node[SIM_NODE_NAME_MAX + 1];
    uint64_t hbm;
    struct timespec mtime;       /* the directory's, at the last listing */
    uint64_t listed_ns;          /* CLOCK_REALTIME when the last listing began */
    int n;
    struct foreign_rec recs[NODE_FOREIGN_MAX];
};

static pthread_mutex_t foreign_mu = PTHREAD_MUTEX_INITIALIZER;
static struct foreign_cache cache[SIM_MAX_DEVICES];
static struct node_record buf; /* one record read at a time, under foreign_mu */

static uint64_t ts_ns(const struct timespec *t) { return (uint64_t)t->tv_sec * 1000000000ull + (uint64_t)t->tv_nsec; }

static void drop(struct foreign_cache *c)
{
    for (int i = 0; i < c->n; i++)
        close(c->recs[i].fd);
    c->n = 0;
    c->valid = 0;
}

void sim_foreign_reset(void)
{
    pthread_mutex_init(&foreign_mu, NULL); /* fork child: the parent's holder is not here */
    for (int d = 0; d < SIM_MAX_DEVICES; d++)
        drop(&cache[d]);
}

/* The uid of a name "ascendsim-<uid>-<node>-dev<dev>[.<k>]" of this node and device, or -1. */
static long parse_name(const char *name, const char *node, int dev)
{
    static const char prefix[] = "ascendsim-";
    if (strncmp(name, prefix, sizeof prefix - 1) != 0)
        return -1;
    const char *p = name + sizeof prefix - 1;
    if (*p < '0' || *p > '9')
        return -1;
    char *end;
    errno = 0;
    unsigned long uid = strtoul(p, &end, 10);
    if (errno || *end != '-' || uid > 0xffffffffUL)
        return -1;
    p = end + 1;
    size_t nl = strlen(node);
    if (strncmp(p, node, nl) != 0)
        return -1;
    p += nl;
    char tail[32];
    int tl = snprintf(tail, sizeof tail, "-dev%d", dev);
    if (strncmp(p, tail, (size_t)tl) != 0)
        return -1;
    p += tl;
    if (*p == '\0')
        return (long)uid;
    if (*p != '.' || p[1] < '1' || p[1] > '9')
        return -1;
    for (p++; *p; p++)
        if (*p < '0' || *p > '9')
            return -1;
    return (long)uid;
}

static void list_dir(struct foreign_cache *c, int dev, const struct sim_config *cfg)
{
    drop(c);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    c->listed_ns = ts_ns(&now);
    snprintf(c->dir, sizeof c->dir, "%s", cfg->shm_dir);
    snprintf(c->node, sizeof c->node, "%s", cfg->node);
    c->hbm = cfg->hbm;
    c->valid = 1;
    DIR *d = opendir(cfg->shm_dir);
    if (!d)
        return;
    struct stat dst;
    if (fstat(dirfd(d), &dst) == 0)
        c->mtime = dst.st_mtim;
    unsigned me = sim_host_uid(); /* names hold host uids */
    struct dirent *e;
    for (long seen = 0; c->n < NODE_FOREIGN_MAX && seen < FOREIGN_SCAN_MAX && (e = readdir(d)); seen++) {
        long uid = parse_name(e->d_name, cfg->node, dev);
        if (uid < 0 || (unsigned)uid == me)
            continue;
        int same_user = 0;
        for (int i = 0; i < c->n; i++)
            same_user += c->recs[i].uid == (unsigned)uid;
        if (same_user >= FOREIGN_PER_USER)
            continue;
        int fd = openat(dirfd(d), e->d_name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
        if (fd < 0)
            continue;
        struct stat st;
        int dup = 0;
        if (fstat(fd, &st) == 0)
            for (int i = 0; i < c->n && !dup; i++) {
                struct stat other;
                dup = fstat(c->recs[i].fd, &other) == 0 && other.st_ino == st.st_ino && other.st_dev == st.st_dev;
            }
        else
            dup = 1;
        if (dup || !S_ISREG(st.st_mode) || !sim_owned_by(st.st_uid, (unsigned)uid) || (st.st_mode & 022) ||
            st.st_size != (off_t)sizeof(struct node_record)) {
            close(fd);
            continue;
        }
        c->recs[c->n].fd = fd;
        c->recs[c->n].uid = (unsigned)uid;
        c->n++;
    }
    closedir(d);
}

/* Bytes the live slots of one foreign record claim, at most the total; 0 if it is not trusted. */
static uint64_t record_used(const struct foreign_rec *f, int dev, const struct sim_config *cfg, int check_alive)
{
    if (pread(f->fd, &buf, sizeof buf, 0) != (ssize_t)sizeof buf)
        return 0;
    if (buf.magic != NODE_MAGIC || buf.version != NODE_VERSION || buf.record_size != sizeof buf ||
        buf.nslots != NODE_SLOTS || buf.owner_uid != f->uid || buf.device != (uint32_t)dev ||
        buf.total_bytes != cfg->hbm || memchr(buf.node, '\0', sizeof buf.node) == NULL ||
        strcmp(buf.node, cfg->node) != 0)
        return 0;
    uint64_t used = 0;
    for (int i = 0; i < NODE_SLOTS && used < cfg->hbm; i++) {
        struct node_slot *s = &buf.slots[i];
        int32_t pid = atomic_load(&s->pid);
        uint64_t bytes = atomic_load(&s->bytes);
        if (pid == 0 || bytes == 0)
            continue;
        if (check_alive && sim_proc_foreign_alive(f->uid, atomic_load(&s->start_time), f->fd) == 0)
            continue;
        used += bytes > cfg->hbm - used ? cfg->hbm - used : bytes;
    }
    return used;
}

uint64_t sim_foreign_used(int dev, const struct sim_config *cfg, int check_alive, int rescan)
{
    if (dev < 0 || dev >= SIM_MAX_DEVICES)
        return 0;
    pthread_mutex_lock(&foreign_mu);
    struct foreign_cache *c = &cache[dev];
    struct stat dst;
    int have = stat(cfg->shm_dir, &dst) == 0;
    if (rescan || !c->valid || !have || strcmp(c->dir, cfg->shm_dir) != 0 || strcmp(c->node, cfg->node) != 0 ||
        c->hbm != cfg->hbm || ts_ns(&dst.st_mtim) != ts_ns(&c->mtime) ||
        c->listed_ns < ts_ns(&c->mtime) + FOREIGN_TICK_NS)
        list_dir(c, dev, cfg);
    uint64_t used = 0;
    for (int i = 0; i < c->n && used < cfg->hbm; i++) {
        uint64_t u = record_used(&c->recs[i], dev, cfg, check_alive);
        used += u > cfg->hbm - used ? cfg->hbm - used : u;
    }
    pthread_mutex_unlock(&foreign_mu);
    return used;
}

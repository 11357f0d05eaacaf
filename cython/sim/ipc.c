/* Sharing device memory between processes: aclrtIpcMemGetExportKey, aclrtIpcMemSetImportPid,
 * aclrtIpcMemImportByKey, aclrtIpcMemClose - for real, between the processes of a simulated node.
 *
 * Backing. aclrtMalloc memory is an anonymous private mapping (dmem.c), which no other process can
 * map. Exporting turns the exported range into shared memory in place: a file is created in the
 * node's directory (ASCEND_SIM_SHM_DIR, default /dev/shm), mode 0600, named by the key
 *     ascendsim-<uid>-<node>-ipc-<key>
 * every page of it is allocated first (posix_fallocate: a directory without room for the whole
 * range refuses the export with ACL_ERROR_RT_MEMORY_ALLOCATION naming it, where a sparse file
 * mapped over the range was a SIGBUS at the first write), the range's present pages are copied
 * into it, and the file is mapped MAP_SHARED | MAP_FIXED
 * over the range, in one system call, so the exporter's address never changes. Importers open
 * the file by the key's name and map it at an address of their own (2 MiB aligned); everybody
 * then reads and writes the same pages. Exported ranges are MADV_DONTFORK: a forked child has
 * no runtime and must import like any other process. Work that writes the range while it is
 * being exported may be lost (synchronize first), as the export copies the pages.
 *
 * Rules (what CANN documents, made checkable; codes in acl_api.h):
 *  - exported memory must be page aligned: address and size multiples of the 2 MiB huge page,
 *    inside one live aclrtMalloc allocation (VMM memory is exported with CANN's separate
 *    aclrtMemExportToShareableHandle, not simulated), not overlapping a range already exported;
 *  - keys are at most 64 characters ([A-Za-z0-9_-]) plus NUL, in a buffer of len >= 65; random,
 *    so knowing a key is the capability (the file is 0600: other users cannot import at all, and
 *    an import of another user's key is refused with ACL_ERROR_RT_NO_PERMISSION naming its uid);
 *  - unless exported with ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION, only the pids the
 *    exporter listed with aclrtIpcMemSetImportPid (and the exporter itself) may import: others get
 *    ACL_ERROR_RT_NO_PERMISSION. A pid is remembered with its start time when it is alive at
 *    listing, so a recycled pid is not let in;
 *  - close order: importers close first. The exporter's aclrtIpcMemClose, and its aclrtFree of the
 *    allocation, are refused (ACL_ERROR_RT_IPC_ERROR) while a live process still imports the key.
 *    aclrtFree with no live importer closes the allocation's keys itself;
 *  - capacity is counted once: the exporter's aclrtMalloc holds it; importers add nothing to the
 *    node's usage (their stats count "ipc_imported_bytes" instead);
 *  - a killed importer leaks nothing: the record names each importer by pid and start time, and
 *    dead ones are dropped whenever the exporter asks (close, free);
 *  - a killed exporter: its node slot (and so its bytes) is reclaimed as for any dead process;
 *    the importers' mappings stay valid until they close, but every use (ascendsim_read,
 *    ascendsim_launch_fill, a second import) answers ACL_ERROR_RT_IPC_ERROR naming the dead
 *    exporter, never a crash. The same holds after the exporter closed the key in aclFinalize. The
 *    last importer to close a dead exporter's key removes its file; files nobody can close any
 *    more (exporter and importers all dead) are swept at the next export on the node;
 *  - importing a key this process already imported maps it once more, at another address (CANN's
 *    driver: svm_ipc_open_handle maps each open anew), and aclrtIpcMemClose(key) closes the
 *    oldest import of the key in this process, whichever the caller meant (CANN's
 *    IpcCloseMemoryByName closes its vaList's front); the record counts the process's imports;
 *  - an import on another device than the exporter's needs ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS
 *    (CANN's aclrtIpcMemImportByKey page: with the default flag, data exchange between the two
 *    devices stays off unless aclrtDeviceEnablePeerAccess was called, which is not simulated; the
 *    driver refuses the handle, ACL_ERROR_RT_DRV_INTERNAL_ERROR);
 *  - read-only sharing (simulator extension, ASCENDSIM_IPC_EXPORT_FLAG_READ_ONLY in ascendsim.h):
 *    importers map the file PROT_READ and ascendsim_launch_fill refuses to write there
 *    (ACL_ERROR_RT_NO_PERMISSION); the exporter's range stays read-write, and its writes are seen
 *    by the importers as any other.
 *
 * The record at the head of each file (the data starts at 2 MiB) holds the exporter's identity,
 * the allowed pids and the importers, under a lease-id lock (proc.c: sim_proc_lock), as node.c's records are;
 * it is created under a temporary name and link()ed into place, and checked (regular file, owner,
 * mode 0600, magic, sizes, node, key) before use.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ascendsim.h"
#include "sim_internal.h"

#define IPC_MAGIC 0x3143504944534341ull /* "ASCDIPC1" */
#define IPC_VERSION 3u /* 2: processes named by lease id, importers by node-level id; 3: lease-id lock */
#define IPC_KEY_LEN 65                  /* 64 characters and NUL: CANN's key buffer */
#define IPC_MAX_PIDS 256
#define IPC_MAX_IMPORTERS 256
#define IPC_DATA_OFF SIM_HUGE_PAGE      /* data offset in the file: huge-page aligned */
#define IPC_LOCK_TIMEOUT_S 10
#define IPC_PATH_MAX (PATH_MAX + SIM_NODE_NAME_MAX + IPC_KEY_LEN + 64)

enum { IPC_CREATING = 0, IPC_LIVE = 1, IPC_CLOSED = 2 };

struct ipc_pid {
    int32_t pid;         /* a node-level id (aclrtDeviceGetBareTgid), as CANN checks them */
    uint32_t reserved;
    uint64_t start_time; /* unused (0): node-level ids are unique on the node */
};

struct ipc_importer {
    int32_t pid;         /* 0: free slot; else the importer's pid, a label */
    uint32_t count;      /* imports of the key in that process */
    uint64_t start_time; /* the importer's lease id (proc.c): who it is, in any pid namespace */
};

struct ipc_record {
    uint64_t magic;
    uint32_t version;
    uint32_t record_size;
    uint32_t owner_uid;
    int32_t device;
    uint64_t size;       /* bytes exported */
    uint64_t data_off;
    uint64_t flags;      /* export flags */
    char node[SIM_NODE_NAME_MAX + 8];
    char key[IPC_KEY_LEN + 7];
    int32_t exporter_pid;
    uint32_t reserved;
    uint64_t exporter_start; /* the exporter's lease id (proc.c) */
    _Atomic uint32_t state;  /* IPC_CREATING, IPC_LIVE, IPC_CLOSED */
    uint32_t n_pids;
    _Atomic uint64_t lock_owner; /* holder's lease id, 0 free (proc.c: sim_proc_lock): guards n_pids,
                                    allowed, importers */
    struct ipc_pid allowed[IPC_MAX_PIDS];
    struct ipc_importer importers[IPC_MAX_IMPORTERS];
};

/* This process's exports. */
struct ipc_export {
    struct ipc_export *next;
    char key[IPC_KEY_LEN];
    char path[IPC_PATH_MAX];
    uintptr_t alloc_base;    /* the aclrtMalloc allocation the range lies in */
    uintptr_t base;
    size_t size;
    int device;
    struct ipc_record *rec;
    int life_fd;             /* the record, open for this process's life lock (proc.c), or -1 */
};

/* This process's imports. */
struct ipc_import {
    struct sim_alloc a;      /* first: the SIM_TREE_IPC entry */
    struct ipc_import *next;
    char key[IPC_KEY_LEN];
    char path[IPC_PATH_MAX];
    struct ipc_record *rec;
    int life_fd;             /* the record, open for this process's life lock (proc.c), or -1 */
    uint32_t count;          /* 1: each import is a mapping of its own */
};

struct counters {
    _Atomic uint64_t exports, exported_bytes, imports, imported_bytes;
};

static pthread_mutex_t ipc_mu = PTHREAD_MUTEX_INITIALIZER; /* the lists; serialises every call */
/* The life descriptor of the export or import being made (ipc_mu held) from its open until its
   entry is listed, where the child's handler finds it; -1 none. Set, listed and closed inside
   proc.c's fork window: a fork between its open and its listing gave the child a copy of the open
   file the parent then locked, and the child kept a killed parent alive to its peers. */
static int making_life = -1;
static struct ipc_export *exports;
static struct ipc_import *imports;
static struct counters counters[SIM_MAX_DEVICES];
static _Atomic unsigned key_seq;

static size_t rec_len(void)
{
    size_t ps = (size_t)sysconf(_SC_PAGESIZE);
    return (sizeof(struct ipc_record) + ps - 1) / ps * ps;
}

static void after_fork_in_child(void)
{
    /* The child has no runtime: the parent's exports and imports are not its own (their structs
       leak in the child; imported mappings stay, unregistered, as the parent's memory does). */
    pthread_mutex_init(&ipc_mu, NULL);
    /* Nor their life locks: our copies closed (the locks stay the parent's, whose descriptors still
       refer to the open files); kept, they would keep a killed parent alive to its peers. */
    for (struct ipc_export *e = exports; e; e = e->next)
        if (e->life_fd >= 0)
            close(e->life_fd);
    for (struct ipc_import *m = imports; m; m = m->next)
        if (m->life_fd >= 0)
            close(m->life_fd);
    if (making_life >= 0)
        close(making_life);
    making_life = -1;
    exports = NULL;
    imports = NULL;
    for (int d = 0; d < SIM_MAX_DEVICES; d++)
        memset(&counters[d], 0, sizeof counters[d]);
}

__attribute__((constructor)) static void ipc_boot(void)
{
    pthread_atfork(NULL, NULL, after_fork_in_child);
}

void sim_ipc_lock(void) { pthread_mutex_lock(&ipc_mu); }
void sim_ipc_unlock(void) { pthread_mutex_unlock(&ipc_mu); }

/* ---- records ------------------------------------------------------------------------------- */

/* Its holder dying inside is taken over (proc.c): every update keeps the record consistent. life:
   a descriptor of the record (-1 none), where a live holder whose lease files were removed holds
   its life lock (so do the liveness checks below). */
static int lock_record(struct ipc_record *r, int life)
{
    return sim_proc_lock(&r->lock_owner, IPC_LOCK_TIMEOUT_S, NULL, life);
}

/* Closes a life descriptor with no fork between that and its leaving making_life. */
static void life_close(int life)
{
    sim_proc_fork_window_enter();
    if (making_life == life)
        making_life = -1;
    close(life);
    sim_proc_fork_window_leave();
}

/* A second descriptor of the record open as fd (its own open file, not the one its mappings keep:
   a forked child inherits those), holding this process's life lock; -1 where it cannot be had. */
static int life_open(const char *path, int fd)
{
    sim_proc_fork_window_enter();
    int life = open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    making_life = life; /* until listed (life_listed) */
    sim_proc_fork_window_leave();
    struct stat a, b;
    if (life >= 0 && (fstat(fd, &a) != 0 || fstat(life, &b) != 0 || a.st_ino != b.st_ino || a.st_dev != b.st_dev ||
                      sim_proc_life_hold(life) != 0)) {
        life_close(life);
        life = -1;
    }
    return life;
}

/* Lists an export (e) or an import (m) with no fork between that and its life descriptor's leaving
   making_life. ipc_mu held. */
static void life_listed(struct ipc_export *e, struct ipc_import *m)
{
    sim_proc_fork_window_enter();
    if (e) {
        e->next = exports;
        exports = e;
    } else {
        m->next = imports;
        imports = m;
    }
    making_life = -1;
    sim_proc_fork_window_leave();
}

static void unlock_record(struct ipc_record *r)
{
    sim_proc_unlock(&r->lock_owner);
}

static int key_ok(const char *key)
{
    size_t n = strnlen(key, IPC_KEY_LEN);
    if (n == 0 || n >= IPC_KEY_LEN)
        return 0;
    for (size_t i = 0; i < n; i++) {
        char c = key[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-'))
            return 0;
    }
    return 1;
}

static void record_path(char *out, size_t len, const char *key)
{
    snprintf(out, len, "%s/ascendsim-%u-%s-ipc-%s", g_sim.cfg.shm_dir, sim_host_uid(), g_sim.cfg.node, key);
}

/* The uid of another user whose record of `key` on this node exists (owned by the uid its name
   states), or -1. Only to explain a refusal: never opened, at most 65536 entries looked at. */
static long other_users_export(const char *key)
{
    DIR *d = opendir(g_sim.cfg.shm_dir);
    if (!d)
        return -1;
    char tail[SIM_NODE_NAME_MAX + 96];
    snprintf(tail, sizeof tail, "-%s-ipc-%s", g_sim.cfg.node, key);
    long found = -1;
    struct dirent *e;
    for (int seen = 0; found < 0 && seen < 65536 && (e = readdir(d)); seen++) {
        const char *p = e->d_name;
        if (strncmp(p, "ascendsim-", 10) != 0 || p[10] < '0' || p[10] > '9')
            continue;
        char *end;
        unsigned long uid = strtoul(p + 10, &end, 10);
        struct stat st;
        if (strcmp(end, tail) != 0 || uid == (unsigned long)sim_host_uid() || uid > 0xffffffffUL ||
            fstatat(dirfd(d), p, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) ||
            !sim_owned_by(st.st_uid, (unsigned)uid))
            continue;
        found = (long)uid;
    }
    closedir(d);
    return found;
}

/* 1 when the exporter no longer shares the memory: it closed the key, or it is gone. */
static int exporter_gone(const struct ipc_record *r, int life)
{
    if (atomic_load(&r->state) != IPC_LIVE)
        return 1;
    return sim_proc_alive(r->exporter_pid, r->exporter_start) == 0 && sim_proc_life_held(life, r->exporter_start) != 1;
}

/* Drops importers that died without closing; returns the live ones. Record locked. */
static int live_importers(struct ipc_record *r, char *pids, size_t len, int life)
{
    int live = 0;
    if (pids && len)
        pids[0] = '\0';
    for (int i = 0; i < IPC_MAX_IMPORTERS; i++) {
        struct ipc_importer *m = &r->importers[i];
        if (!m->pid)
            continue;
        if (sim_proc_alive(m->pid, m->start_time) == 0 && sim_proc_life_held(life, m->start_time) != 1) {
            m->count = 0;
            m->pid = 0;
            continue;
        }
        if (pids && len && live < 8) {
            size_t used = strlen(pids);
            snprintf(pids + used, len - used, "%s%d", live ? ", " : "", (int)m->pid);
        }
        live++;
    }
    return live;
}

/* Checks an open record file and maps its header: 0, or an aclError (message recorded). */
static int open_record(int fd, const char *path, const char *key, struct ipc_record **out, const char *call)
{
    struct stat st;
    if (fstat(fd, &st) != 0)
        return sim_fail(ACL_ERROR_RT_IPC_ERROR, call, "cannot stat %s: %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode))
        return sim_fail(ACL_ERROR_RT_NO_PERMISSION, call, "%s is not a regular file; refusing it", path);
    if (st.st_uid != geteuid() || (st.st_mode & 077))
        return sim_fail(ACL_ERROR_RT_NO_PERMISSION, call,
                        "%s is owned by uid %u with mode %03o: only a 0600 file of this user (uid %u) is "
                        "trusted", path, (unsigned)st.st_uid, (unsigned)(st.st_mode & 0777), (unsigned)geteuid());
    if (st.st_size < (off_t)IPC_DATA_OFF)
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call, "%s is not an IPC record (too short)", path);
    struct ipc_record *r = mmap(NULL, rec_len(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (r == MAP_FAILED)
        return sim_fail(ACL_ERROR_RT_IPC_ERROR, call, "cannot map %s: %s", path, strerror(errno));
    const char *bad = NULL;
    if (r->magic != IPC_MAGIC || r->version != IPC_VERSION || r->record_size != sizeof *r)
        bad = "bad magic, version or layout";
    else if (r->owner_uid != sim_host_uid())
        bad = "recorded owner is another user";
    else if (strncmp(r->node, g_sim.cfg.node, sizeof r->node) != 0 || (key && strcmp(r->key, key) != 0))
        bad = "it names another node or key";
    else if (r->data_off != IPC_DATA_OFF || r->size == 0 || (uint64_t)st.st_size != r->data_off + r->size)
        bad = "its sizes disagree with the file";
    else if (r->n_pids > IPC_MAX_PIDS)
        bad = "impossible allowed-pid count";
    if (bad) {
        munmap(r, rec_len());
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call, "%s is a malformed IPC record (%s); refusing it", path, bad);
    }
    *out = r;
    return 0;
}

/* Removes records nobody can close any more: the exporter and every importer dead (or closed),
   and the temporary files and not yet live records of exporters that died while creating one.
   Best effort, at export time. */
static void sweep_stale(void)
{
    char prefix[SIM_NODE_NAME_MAX + 64];
    snprintf(prefix, sizeof prefix, "ascendsim-%u-%s-ipc-", sim_host_uid(), g_sim.cfg.node);
    size_t plen = strlen(prefix);
    DIR *d = opendir(g_sim.cfg.shm_dir);
    if (!d)
        return;
    struct dirent *e;
    char path[PATH_MAX + 512];
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, prefix, plen) != 0)
            continue;
        snprintf(path, sizeof path, "%s/%s", g_sim.cfg.shm_dir, e->d_name);
        const char *tmp = strstr(e->d_name + plen, ".tmp.");
        if (tmp) {
            uint64_t id = strtoull(tmp + 5, NULL, 16); /* its creator's lease id */
            if (id && sim_proc_alive(0, id) == 0)
                unlink(path);
            continue;
        }
        int fd = open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0)
            continue;
        struct ipc_record *r;
        if (open_record(fd, path, NULL, &r, "sweep") != 0) {
            (void)aclGetRecentErrMsg(); /* not this call's failure: do not leave it behind */
            close(fd);
            continue;
        }
        if (atomic_load(&r->state) == IPC_CREATING) {
            /* Published, not yet live (its memory being copied in): nobody imports it, and its
               exporter holds the lease it names meanwhile; dead, it never will be live. */
            if (sim_proc_alive(r->exporter_pid, r->exporter_start) == 0 &&
                sim_proc_life_held(fd, r->exporter_start) != 1)
                unlink(path);
        } else if (lock_record(r, fd) == 0) {
            if (exporter_gone(r, fd) && live_importers(r, NULL, 0, fd) == 0) {
                atomic_store(&r->state, IPC_CLOSED);
                unlink(path);
            }
            unlock_record(r);
        }
        munmap(r, rec_len());
        close(fd);
    }
    closedir(d);
}

/* Writes the run [*start, *start + *len) of src to fd at off + *start; empties the run.
   0 or an errno. */
static int write_run(const char *src, int fd, off_t off, size_t *start, size_t *len)
{
    while (*len) {
        ssize_t w = pwrite(fd, src + *start, *len, off + (off_t)*start);
        if (w <= 0)
            return w < 0 ? errno : EIO;
        *start += (size_t)w;
        *len -= (size_t)w;
    }
    return 0;
}

/* Copies the pages of [src, src+len) that exist (present or swapped, per /proc/self/pagemap) to fd
   at off; untouched pages stay holes of the file, which read as zeros as they did. Without a
   readable pagemap, copies everything. 0 or an errno. */
static int copy_pages(const char *src, size_t len, int fd, off_t off)
{
    size_t ps = (size_t)sysconf(_SC_PAGESIZE);
    int pm = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    uint64_t ent[512];
    size_t run_start = 0, run_len = 0;
    for (size_t i = 0; i < len;) {
        size_t n = (len - i) / ps;
        if (n > 512)
            n = 512;
        int have = 0;
        if (pm >= 0) {
            off_t at = (off_t)(((uintptr_t)src + i) / ps * sizeof(uint64_t));
            have = pread(pm, ent, n * sizeof(uint64_t), at) == (ssize_t)(n * sizeof(uint64_t));
        }
        for (size_t k = 0; k < n; k++, i += ps) {
            int exists = !have || (ent[k] >> 62) != 0; /* bit 63 present, bit 62 swapped */
            if (exists) {
                if (!run_len)
                    run_start = i;
                run_len += ps;
                continue;
            }
            int err = write_run(src, fd, off, &run_start, &run_len);
            if (err) {
                if (pm >= 0)
                    close(pm);
                return err;
            }
        }
    }
    int err = write_run(src, fd, off, &run_start, &run_len);
    if (pm >= 0)
        close(pm);
    return err;
}

static void new_key(char *key)
{
    uint64_t rnd = 0;
    if (getrandom(&rnd, sizeof rnd, GRND_NONBLOCK) != (ssize_t)sizeof rnd)
        rnd = sim_now_ns() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)&rnd;
    snprintf(key, IPC_KEY_LEN, "simipc-%x-%x-%016llx", (unsigned)getpid(), atomic_fetch_add(&key_seq, 1) + 1,
             (unsigned long long)rnd);
}

/* ---- export -------------------------------------------------------------------------------- */

static void export_free(struct ipc_export *e)
{
    if (e->rec)
        munmap(e->rec, rec_len());
    if (e->life_fd >= 0)
        life_close(e->life_fd);
    free(e);
}

/* Unlinks the list entry `e` (ipc_mu held), closes its record and counters. */
static void export_drop(struct ipc_export *e)
{
    for (struct ipc_export **pp = &exports; *pp; pp = &(*pp)->next)
        if (*pp == e) {
            *pp = e->next;
            break;
        }
    atomic_store(&e->rec->state, IPC_CLOSED);
    unlink(e->path);
    atomic_fetch_sub(&counters[e->device].exports, 1);
    atomic_fetch_sub(&counters[e->device].exported_bytes, e->size);
    export_free(e);
}

static struct ipc_export *find_export(const char *key)
{
    for (struct ipc_export *e = exports; e; e = e->next)
        if (strcmp(e->key, key) == 0)
            return e;
    return NULL;
}

/* Creates the record file under a fresh key (temporary name, link()ed into place). ipc_mu held.
   Returns the open fd (>= 0) with *out mapped, or -aclError. */
static int create_record(struct ipc_export *e, int dev, size_t size, uint64_t flags, struct ipc_record **out,
                         const char *call)
{
    char tmp[IPC_PATH_MAX + 64];
    for (int attempt = 0; attempt < 8; attempt++) {
        new_key(e->key);
        record_path(e->path, sizeof e->path, e->key);
        snprintf(tmp, sizeof tmp, "%s.tmp.%016llx", e->path, (unsigned long long)sim_proc_self_id());
        int fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd < 0)
            return -sim_fail(ACL_ERROR_RT_RESOURCE_ALLOC_FAIL, call, "cannot create %s: %s", tmp, strerror(errno));
        int err = 0;
        struct ipc_record *r = MAP_FAILED;
        if (fchmod(fd, 0600) != 0 || ftruncate(fd, (off_t)(IPC_DATA_OFF + size)) != 0)
            err = errno;
        /* Every page now, the data's too: the file is mapped over the device range, and a page the
           file system cannot give later would be a SIGBUS at the first write of the memory. */
        int room = 0;
        if (!err && (room = posix_fallocate(fd, 0, (off_t)(IPC_DATA_OFF + size))) != 0)
            err = room;
        if (!err && (r = mmap(NULL, rec_len(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED)
            err = errno;
        if (!err) {
            memset(r, 0, sizeof *r);
            r->magic = IPC_MAGIC;
            r->version = IPC_VERSION;
            r->record_size = sizeof *r;
            r->owner_uid = sim_host_uid();
            r->device = g_sim.cfg.phys[dev]; /* the node's device: importers may number it otherwise */
            r->size = size;
            r->data_off = IPC_DATA_OFF;
            r->flags = flags;
            snprintf(r->node, sizeof r->node, "%s", g_sim.cfg.node);
            snprintf(r->key, sizeof r->key, "%s", e->key);
            r->exporter_pid = (int32_t)getpid();
            r->exporter_start = sim_proc_self_id();
            atomic_store(&r->state, IPC_CREATING);
            atomic_store(&r->lock_owner, 0);
        }
        /* Held before the record is published, for as long as the export lives (export_free) */
        if (!err)
            e->life_fd = life_open(tmp, fd);
        if (!err && link(tmp, e->path) != 0)
            err = errno;
        unlink(tmp);
        if (!err) {
            *out = r;
            return fd;
        }
        if (e->life_fd >= 0)
            life_close(e->life_fd);
        e->life_fd = -1;
        if (r != MAP_FAILED)
            munmap(r, rec_len());
        close(fd);
        if (room) /* nothing is left behind: the temporary file is gone, the range untouched */
            return -sim_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call,
                             "cannot share %zu bytes: the shared-memory directory %s (ASCEND_SIM_SHM_DIR) %s (%s)",
                             size, g_sim.cfg.shm_dir,
                             room == ENOSPC ? "has no room for them: free space there or give the node a larger one"
                                            : "cannot reserve them", strerror(room));
        if (err != EEXIST) /* else: that key exists on the node (vanishingly rare): draw another */
            return -sim_fail(err == ENOSPC || err == ENOMEM ? ACL_ERROR_RT_MEMORY_ALLOCATION
                                                            : ACL_ERROR_RT_RESOURCE_ALLOC_FAIL,
                             call, "cannot create the shared record %s: %s", e->path, strerror(err));
    }
    return -sim_fail(ACL_ERROR_RT_INTERNAL_ERROR, call, "no free key after 8 attempts");
}

SIM_EXPORT aclError aclrtIpcMemGetExportKey(void *devPtr, size_t size, char *key, size_t len, uint64_t flags)
{
    static const char call[] = "aclrtIpcMemGetExportKey";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!devPtr || !key)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "devPtr or key is NULL");
    if (size == 0)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "size is 0");
    if (len < IPC_KEY_LEN)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "len %zu: the key buffer must hold %d bytes", len, IPC_KEY_LEN);
    if ((flags & ~ASCENDSIM_IPC_EXPORT_FLAG_READ_ONLY) > ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION)
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                        "flags %llu is not ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT (0) or "
                        "ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION (1), optionally with the simulator's "
                        "ASCENDSIM_IPC_EXPORT_FLAG_READ_ONLY", (unsigned long long)flags);
    if ((flags & ~ASCENDSIM_IPC_EXPORT_FLAG_READ_ONLY) && g_sim.cfg.profile.ipc_flags_reserved)
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                        "flags %llu: under the simulator's '%s' profile (CANN 8.2.RC1) the flags are reserved, "
                        "0 only: list the importers with aclrtIpcMemSetImportPid", (unsigned long long)flags,
                        g_sim.cfg.profile.name);
    int dev;
    if ((rc = sim_current_device(call, &dev)) != 0)
        return rc;
    if ((rc = sim_proc_lease_ready(call)) != 0) /* the record names us by lease: none, no export */
        return rc;
    uintptr_t p = (uintptr_t)devPtr;
    if (p % SIM_HUGE_PAGE || size % SIM_HUGE_PAGE)
        return sim_fail(ACL_ERROR_RT_ADDR_UNALIGNED, call,
                        "[%p, +%zu bytes): exported memory must be page aligned (address and size multiples of "
                        "the 2 MiB page)", devPtr, size);
    pthread_mutex_lock(&ipc_mu);
    struct sim_alloc *a = sim_alloc_pin(SIM_TREE_DEVICE, devPtr, size);
    if (!a || a->tree != SIM_TREE_DEVICE) {
        if (a)
            sim_alloc_unpin(SIM_TREE_DEVICE, a);
        pthread_mutex_unlock(&ipc_mu);
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                        "[%p, +%zu bytes) is not inside one live aclrtMalloc allocation (virtual memory is "
                        "shared with aclrtMemExportToShareableHandle, not simulated)", devPtr, size);
    }
    for (struct ipc_export *e = exports; e; e = e->next) {
        if (p < e->base + e->size && e->base < p + size) {
            rc = sim_fail(ACL_ERROR_RT_PARAM_INVALID, call, "[%p, +%zu bytes) overlaps [%p, +%zu bytes), exported "
                          "already with key '%s'", devPtr, size, (void *)e->base, e->size, e->key);
            sim_alloc_unpin(SIM_TREE_DEVICE, a);
            pthread_mutex_unlock(&ipc_mu);
            return rc;
        }
    }
    sweep_stale();
    struct ipc_export *e = calloc(1, sizeof *e);
    if (e)
        e->life_fd = -1;
    struct ipc_record *r = NULL;
    int fd = e ? create_record(e, dev, size, flags, &r, call)
               : -sim_fail(ACL_ERROR_RT_RESOURCE_ALLOC_FAIL, call, "out of host memory");
    if (fd < 0) {
        free(e);
        sim_alloc_unpin(SIM_TREE_DEVICE, a);
        pthread_mutex_unlock(&ipc_mu);
        return -fd;
    }
    e->rec = r;
    int err = copy_pages(devPtr, size, fd, (off_t)IPC_DATA_OFF);
    if (!err && mmap(devPtr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, (off_t)IPC_DATA_OFF) == MAP_FAILED)
        err = errno; /* the range keeps its old pages unless the kernel dropped them (not expected) */
    close(fd);
    if (err) {
        unlink(e->path);
        export_free(e);
        sim_alloc_unpin(SIM_TREE_DEVICE, a);
        pthread_mutex_unlock(&ipc_mu);
        return sim_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call, "the host could not share %zu bytes at %p (%s)",
                        size, devPtr, strerror(err));
    }
    (void)madvise(devPtr, size, MADV_DONTFORK);
    e->alloc_base = a->base;
    e->base = p;
    e->size = size;
    e->device = dev;
    atomic_store(&r->state, IPC_LIVE);
    life_listed(e, NULL);
    atomic_fetch_add(&counters[dev].exports, 1);
    atomic_fetch_add(&counters[dev].exported_bytes, size);
    sim_alloc_unpin(SIM_TREE_DEVICE, a);
    snprintf(key, len, "%s", e->key);
    pthread_mutex_unlock(&ipc_mu);
    return ACL_SUCCESS;
}

SIM_EXPORT aclError aclrtIpcMemSetImportPid(const char *key, int32_t *pid, size_t num)
{
    static const char call[] = "aclrtIpcMemSetImportPid";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!key || !pid)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "key or pid is NULL");
    if (num == 0)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "num is 0");
    for (size_t i = 0; i < num; i++)
        if (pid[i] <= 0)
            return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call, "pid[%zu] = %d is not a process id", i, (int)pid[i]);
    int dev;
    if ((rc = sim_current_device(call, &dev)) != 0) /* CANN's SetIpcMemPid runs in a context */
        return rc;
    pthread_mutex_lock(&ipc_mu);
    struct ipc_export *e = key_ok(key) ? find_export(key) : NULL;
    if (!e) {
        rc = sim_fail(ACL_ERROR_RT_PARAM_INVALID, call, "key '%.64s' was not exported by this process (pid %d)",
                      key, (int)getpid());
        pthread_mutex_unlock(&ipc_mu);
        return rc;
    }
    struct ipc_record *r = e->rec;
    if (lock_record(r, e->life_fd) != 0) {
        pthread_mutex_unlock(&ipc_mu);
        return sim_fail(ACL_ERROR_RT_IPC_ERROR, call, "cannot lock the record of key '%s'", key);
    }
    for (size_t i = 0; i < num && rc == 0; i++) {
        uint32_t j; /* pid[i] is a node-level id (aclrtDeviceGetBareTgid), never a getpid() value */
        for (j = 0; j < r->n_pids; j++)
            if (r->allowed[j].pid == pid[i])
                break;
        if (j == r->n_pids) {
            if (r->n_pids == IPC_MAX_PIDS) {
                rc = sim_fail(ACL_ERROR_RT_OVER_LIMIT, call, "key '%s' already allows %d pids, the most one key "
                              "can", key, IPC_MAX_PIDS);
                break;
            }
            r->n_pids++;
        }
        r->allowed[j].pid = pid[i];
        r->allowed[j].start_time = 0;
    }
    unlock_record(r);
    pthread_mutex_unlock(&ipc_mu);
    return rc;
}

/* ---- import -------------------------------------------------------------------------------- */

/* This process's imports of key: the newest (the list is newest first), or the oldest, the one
   CANN's aclrtIpcMemClose(key) closes (IpcCloseMemoryByName: its vaList's front). */
static struct ipc_import *find_import(const char *key, int oldest)
{
    struct ipc_import *found = NULL;
    for (struct ipc_import *m = imports; m; m = m->next)
        if (strcmp(m->key, key) == 0) {
            found = m;
            if (!oldest)
                break;
        }
    return found;
}

/* A second import's life descriptor: the same open file description as the earlier import's, whose
   OFD lock (this process's life lock on the record) it then shares, so that the lock lasts as long
   as either import; -1 when the earlier one has none. ipc_mu held. */
static int life_dup(int life)
{
    if (life < 0)
        return -1;
    sim_proc_fork_window_enter();
    int fd = fcntl(life, F_DUPFD_CLOEXEC, 0);
    making_life = fd; /* until listed (life_listed) */
    sim_proc_fork_window_leave();
    return fd;
}

static int exporter_gone_fail(const struct ipc_record *r, const char *key, const char *call)
{
    if (atomic_load(&r->state) != IPC_LIVE)
        return sim_fail(ACL_ERROR_RT_IPC_ERROR, call, "the exporter (pid %d) closed key '%s': its memory is no "
                        "longer shared", (int)r->exporter_pid, key);
    return sim_fail(ACL_ERROR_RT_IPC_ERROR, call, "the process that exported key '%s' (pid %d) has exited: its "
                    "memory is no longer shared", key, (int)r->exporter_pid);
}

/* As CANN: the importer's node-level id (aclrtDeviceGetBareTgid) must be listed, unless the
   export disabled the check; the exporter itself (its lease id) may always import. */
static int allowed(const struct ipc_record *r, int32_t node_pid, uint64_t my_id)
{
    if ((r->flags & ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION) || my_id == r->exporter_start)
        return 1;
    for (uint32_t i = 0; i < r->n_pids; i++)
        if (r->allowed[i].pid == node_pid)
            return 1;
    return 0;
}

SIM_EXPORT aclError aclrtIpcMemImportByKey(void **devPtr, const char *key, uint64_t flags)
{
    static const char call[] = "aclrtIpcMemImportByKey";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!devPtr || !key)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "devPtr or key is NULL");
    if (flags > ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS)
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                        "flags %llu is not ACL_RT_IPC_MEM_IMPORT_FLAG_DEFAULT (0) or "
                        "ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS (1)", (unsigned long long)flags);
    if (flags && g_sim.cfg.profile.ipc_flags_reserved)
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                        "flags %llu: under the simulator's '%s' profile (CANN 8.2.RC1) the flags are reserved, "
                        "0 only", (unsigned long long)flags, g_sim.cfg.profile.name);
    int dev;
    if ((rc = sim_current_device(call, &dev)) != 0)
        return rc;
    if (!key_ok(key))
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                        "'%.64s' is not a key (1-64 characters of A-Z a-z 0-9 _ -)", key);
    if ((rc = sim_proc_lease_ready(call)) != 0) /* the record names importers by lease */
        return rc;
    int32_t me = (int32_t)getpid();       /* a label */
    uint64_t my_id = sim_proc_self_id();  /* who we are (proc.c) */
    int32_t node_pid = sim_proc_bare_tgid();
    pthread_mutex_lock(&ipc_mu);
    /* Imported already: as CANN's driver (svm_ipc_open_handle maps each open at a new address of
       its own), one more mapping at another address, each closed by one aclrtIpcMemClose, the
       oldest first. Until 2026-12-06 the same address came back, counted. */
    struct ipc_import *prev = find_import(key, 0);
    struct ipc_import *m;
    m = calloc(1, sizeof *m);
    if (!m) {
        pthread_mutex_unlock(&ipc_mu);
        return sim_fail(ACL_ERROR_RT_RESOURCE_ALLOC_FAIL, call, "out of host memory");
    }
    m->life_fd = -1;
    snprintf(m->key, sizeof m->key, "%s", key);
    record_path(m->path, sizeof m->path, key);
    int fd = open(m->path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        int err = errno;
        pthread_mutex_unlock(&ipc_mu);
        long owner = err == ENOENT ? other_users_export(key) : -1;
        if (owner >= 0)
            rc = sim_fail(ACL_ERROR_RT_NO_PERMISSION, call,
                          "key '%s' was exported by another user (uid %ld) of node '%s'; this process runs "
                          "as uid %u, and the simulator's IPC keys are per user (the exporter's record "
                          "is 0600): import it from a process of uid %ld", key, owner, g_sim.cfg.node,
                          sim_host_uid(), owner);
        else if (err == ENOENT)
            rc = sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                          "no memory is exported with key '%s' on node '%s' (never exported, closed by its "
                          "exporter, or exported on another node)", key, g_sim.cfg.node);
        else /* (m->path is read here: m is freed after) */
            rc = sim_fail(err == ELOOP || err == EACCES ? ACL_ERROR_RT_NO_PERMISSION : ACL_ERROR_RT_IPC_ERROR, call,
                          "cannot open the record of key '%s' (%s): %s", key, m->path, strerror(err));
        free(m);
        return rc;
    }
    struct ipc_record *r = NULL;
    if ((rc = open_record(fd, m->path, key, &r, call)) != 0) {
        close(fd);
        free(m);
        pthread_mutex_unlock(&ipc_mu);
        return rc;
    }
    m->rec = r;
    /* before our slot is published, until import_close; a second import shares the first's */
    m->life_fd = prev ? life_dup(prev->life_fd) : life_open(m->path, fd);
    int slot = -1;
    if (atomic_load(&r->state) == IPC_CREATING) {
        rc = sim_fail(ACL_ERROR_RT_PARAM_INVALID, call, "key '%s' is still being exported", key);
    } else if (exporter_gone(r, fd)) {
        rc = exporter_gone_fail(r, key, call);
    } else if (!(flags & ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS) && (int)r->device != g_sim.cfg.phys[dev]) {
        rc = sim_fail(ACL_ERROR_RT_DRV_INTERNAL_ERROR, call,
                      "key '%s' is memory of the node's device %d, imported on device %d (the node's %d) with "
                      "ACL_RT_IPC_MEM_IMPORT_FLAG_DEFAULT, which leaves data exchange between two devices off: "
                      "pass ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS (aclrtDeviceEnablePeerAccess is not "
                      "simulated)", key, (int)r->device, dev, g_sim.cfg.phys[dev]);
    } else if (lock_record(r, fd) != 0) {
        rc = sim_fail(ACL_ERROR_RT_IPC_ERROR, call, "cannot lock the record of key '%s'", key);
    } else {
        if (atomic_load(&r->state) != IPC_LIVE) { /* closed meanwhile */
            rc = exporter_gone_fail(r, key, call);
        } else if (!allowed(r, node_pid, my_id)) {
            rc = sim_fail(ACL_ERROR_RT_NO_PERMISSION, call,
                          "pid %d (node-level id %d, from aclrtDeviceGetBareTgid) may not import key '%s': its "
                          "exporter (pid %d) allows only the node-level ids it set with aclrtIpcMemSetImportPid "
                          "(%u listed), unless it exports with ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION",
                          (int)me, (int)node_pid, key, (int)r->exporter_pid, r->n_pids);
        } else {
            (void)live_importers(r, NULL, 0, fd); /* frees the slots of dead importers */
            for (int i = 0; i < IPC_MAX_IMPORTERS && slot < 0; i++) /* ours, importing it already */
                if (r->importers[i].pid != 0 && r->importers[i].start_time == my_id)
                    slot = i;
            if (slot >= 0) {
                r->importers[slot].count++;
            } else {
                for (int i = 0; i < IPC_MAX_IMPORTERS && slot < 0; i++)
                    if (r->importers[i].pid == 0)
                        slot = i;
                if (slot < 0) {
                    rc = sim_fail(ACL_ERROR_RT_OVER_LIMIT, call, "key '%s' is imported by %d live processes already, "
                                  "the most one key can serve", key, IPC_MAX_IMPORTERS);
                } else {
                    r->importers[slot].pid = me;
                    r->importers[slot].start_time = my_id;
                    r->importers[slot].count = 1;
                }
            }
        }
        unlock_record(r);
    }
    size_t size = (size_t)r->size;
    int read_only = (r->flags & ASCENDSIM_IPC_EXPORT_FLAG_READ_ONLY) != 0;
    char *start = NULL;
    if (rc == 0) {
        /* 2 MiB-aligned address: over-reserve, trim, then map the file over the aligned part. */
        char *raw = mmap(NULL, size + SIM_HUGE_PAGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        int err = raw == MAP_FAILED ? errno : 0;
        if (!err) {
            start = (char *)(((uintptr_t)raw + SIM_HUGE_PAGE - 1) & ~(uintptr_t)(SIM_HUGE_PAGE - 1));
            if (start > raw)
                munmap(raw, (size_t)(start - raw));
            size_t tail = (size_t)(raw + size + SIM_HUGE_PAGE - (start + size));
            if (tail)
                munmap(start + size, tail);
            int prot = read_only ? PROT_READ : PROT_READ | PROT_WRITE; /* the exporter's choice */
            if (mmap(start, size, prot, MAP_SHARED | MAP_FIXED, fd, (off_t)IPC_DATA_OFF) == MAP_FAILED) {
                err = errno;
                munmap(start, size);
            }
        }
        if (err) {
            rc = sim_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call, "the host could not map %zu bytes of key '%s' (%s)",
                          size, key, strerror(err));
            if (lock_record(r, fd) == 0) {
                if (r->importers[slot].count <= 1) {
                    r->importers[slot].count = 0;
                    r->importers[slot].pid = 0;
                } else {
                    r->importers[slot].count--;
                }
                unlock_record(r);
            }
        }
    }
    close(fd);
    if (rc != 0) {
        munmap(r, rec_len());
        if (m->life_fd >= 0)
            life_close(m->life_fd);
        free(m);
        pthread_mutex_unlock(&ipc_mu);
        return rc;
    }
    (void)madvise(start, size, MADV_HUGEPAGE); /* only advice: THP for shared memory is often off */
    m->a.base = (uintptr_t)start;
    m->a.size = size;
    m->a.map = start;
    m->a.map_len = size;
    /* The record names the node's device; this process may number it otherwise, or not see it
       (then the import is counted on the device it imports from). */
    int here = sim_logical_device((int)r->device);
    m->a.device = here >= 0 ? here : dev;
    m->a.read_only = read_only;
    m->count = 1;
    sim_alloc_insert(SIM_TREE_IPC, &m->a);
    life_listed(NULL, m);
    atomic_fetch_add(&counters[m->a.device].imports, 1);
    atomic_fetch_add(&counters[m->a.device].imported_bytes, size);
    *devPtr = start;
    pthread_mutex_unlock(&ipc_mu);
    return ACL_SUCCESS;
}

/* Unmaps an import (after reads and fills in flight), gives up its slot, and removes the file when
   this was the last holder of a key whose exporter is gone. ipc_mu held; m already unlisted. */
static void import_close(struct ipc_import *m)
{
    sim_alloc_remove(SIM_TREE_IPC, (void *)m->a.base);
    sim_alloc_wait_unpinned(&m->a);
    munmap(m->a.map, m->a.map_len);
    struct ipc_record *r = m->rec;
    uint64_t my_id = sim_proc_self_id();
    if (lock_record(r, m->life_fd) == 0) {
        for (int i = 0; i < IPC_MAX_IMPORTERS; i++) /* this import's share of our slot */
            if (r->importers[i].pid != 0 && r->importers[i].start_time == my_id) {
                if (r->importers[i].count > 1) {
                    r->importers[i].count--;
                } else {
                    r->importers[i].count = 0;
                    r->importers[i].pid = 0;
                }
            }
        if (exporter_gone(r, m->life_fd) && live_importers(r, NULL, 0, m->life_fd) == 0) {
            atomic_store(&r->state, IPC_CLOSED);
            unlink(m->path); /* nobody else can close it any more */
        }
        unlock_record(r);
    }
    atomic_fetch_sub(&counters[m->a.device].imports, 1);
    atomic_fetch_sub(&counters[m->a.device].imported_bytes, m->a.size);
    munmap(r, rec_len());
    if (m->life_fd >= 0)
        life_close(m->life_fd); /* after its slot was given up */
    free(m);
}

/* ---- close --------------------------------------------------------------------------------- */

SIM_EXPORT aclError aclrtIpcMemClose(const char *key)
{
    static const char call[] = "aclrtIpcMemClose";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!key)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "key is NULL");
    if (!key_ok(key))
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call, "'%.64s' is not a key", key);
    pthread_mutex_lock(&ipc_mu);
    /* Imported here: closes the oldest import of the key (CANN's IpcCloseMemoryByName: vaList's
       front), whichever address the caller meant. */
    struct ipc_import *m = find_import(key, 1);
    if (m) {
        for (struct ipc_import **pp = &imports; *pp; pp = &(*pp)->next)
            if (*pp == m) {
                *pp = m->next;
                break;
            }
        import_close(m);
        pthread_mutex_unlock(&ipc_mu);
        return ACL_SUCCESS;
    }
    struct ipc_export *e = find_export(key);
    if (!e) {
        pthread_mutex_unlock(&ipc_mu);
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call, "key '%s' is neither exported nor imported by this "
                        "process (pid %d)", key, (int)getpid());
    }
    if (lock_record(e->rec, e->life_fd) != 0) {
        pthread_mutex_unlock(&ipc_mu);
        return sim_fail(ACL_ERROR_RT_IPC_ERROR, call, "cannot lock the record of key '%s'", key);
    }
    char pids[128];
    int live = live_importers(e->rec, pids, sizeof pids, e->life_fd);
    if (live) {
        unlock_record(e->rec);
        pthread_mutex_unlock(&ipc_mu);
        return sim_fail(ACL_ERROR_RT_IPC_ERROR, call, "key '%s' is still imported by %d live process(es) (pid %s): "
                        "importers must aclrtIpcMemClose it before its exporter does", key, live, pids);
    }
    atomic_store(&e->rec->state, IPC_CLOSED);
    unlock_record(e->rec);
    export_drop(e);
    pthread_mutex_unlock(&ipc_mu);
    return ACL_SUCCESS;
}

/* ---- runtime hooks ------------------------------------------------------------------------- */

int sim_ipc_free_check(const void *devPtr, const char *call)
{
    uintptr_t p = (uintptr_t)devPtr;
    int found = 0;
    for (struct ipc_export *e = exports; e; e = e->next) {
        if (e->alloc_base != p)
            continue;
        found = 1;
        if (lock_record(e->rec, e->life_fd) != 0)
            return sim_fail(ACL_ERROR_RT_IPC_ERROR, call, "cannot lock the record of key '%s'", e->key);
        char pids[128];
        int live = live_importers(e->rec, pids, sizeof pids, e->life_fd);
        if (live) {
            unlock_record(e->rec);
            return sim_fail(ACL_ERROR_RT_IPC_ERROR, call,
                            "%p is exported with key '%s' and still imported by %d live process(es) (pid %s): "
                            "importers must aclrtIpcMemClose it before its exporter frees it", devPtr, e->key, live,
                            pids);
        }
        unlock_record(e->rec);
    }
    if (!found)
        return 0;
    /* Nobody imports any of them: close them all (no new import can start: ipc_mu is held). */
    for (struct ipc_export *e = exports, *next; e; e = next) {
        next = e->next;
        if (e->alloc_base == p)
            export_drop(e);
    }
    return 0;
}

int sim_ipc_usable(const struct sim_alloc *a)
{
    const struct ipc_import *m = (const struct ipc_import *)a;
    return !exporter_gone(m->rec, m->life_fd);
}

int sim_ipc_explain(const void *ptr, size_t n, const char *call)
{
    pthread_mutex_lock(&ipc_mu);
    const struct sim_alloc *a = sim_alloc_lookup(SIM_TREE_IPC, ptr, n);
    int rc = 0;
    if (a && (uintptr_t)ptr + n <= a->base + a->size) {
        const struct ipc_import *m = (const struct ipc_import *)a;
        const struct ipc_record *r = m->rec;
        if (atomic_load(&r->state) != IPC_LIVE)
            rc = sim_fail(ACL_ERROR_RT_IPC_ERROR, call,
                          "[%p, +%zu bytes) is memory imported with key '%s', which its exporter (pid %d) has "
                          "closed: it can no longer be used; aclrtIpcMemClose it", ptr, n, m->key,
                          (int)r->exporter_pid);
        else if (exporter_gone(r, m->life_fd))
            rc = sim_fail(ACL_ERROR_RT_IPC_ERROR, call,
                          "[%p, +%zu bytes) is memory imported with key '%s', whose exporter (pid %d) has exited: "
                          "it can no longer be used; aclrtIpcMemClose it", ptr, n, m->key, (int)r->exporter_pid);
    }
    pthread_mutex_unlock(&ipc_mu);
    return rc;
}

SIM_EXPORT uint64_t ascendsim_ipc_export_flag_read_only(void)
{
    return ASCENDSIM_IPC_EXPORT_FLAG_READ_ONLY;
}

int sim_ipc_refuse_write(const struct sim_alloc *a, const void *ptr, size_t n, const char *call)
{
    const struct ipc_import *m = (const struct ipc_import *)a; /* a read-only entry is an import */
    return sim_fail(ACL_ERROR_RT_NO_PERMISSION, call,
                    "[%p, +%zu bytes) is memory imported with key '%s', which its exporter (pid %d) shared "
                    "read-only: this process may read it but not write it", ptr, n, m->key,
                    (int)m->rec->exporter_pid);
}

void sim_ipc_finalize(void)
{
    pthread_mutex_lock(&ipc_mu);
    while (imports) {
        struct ipc_import *m = imports;
        imports = m->next;
        import_close(m);
    }
    while (exports) {
        struct ipc_export *e = exports;
        /* Leaving the runtime closes its keys even if importers remain: their next use fails. */
        if (lock_record(e->rec, e->life_fd) == 0) {
            atomic_store(&e->rec->state, IPC_CLOSED);
            int live = live_importers(e->rec, NULL, 0, e->life_fd);
            unlock_record(e->rec);
            if (live) { /* the last importer to close removes the file */
                exports = e->next;
                atomic_fetch_sub(&counters[e->device].exports, 1);
                atomic_fetch_sub(&counters[e->device].exported_bytes, e->size);
                export_free(e);
                continue;
            }
        }
        export_drop(e);
    }
    pthread_mutex_unlock(&ipc_mu);
}

SIM_EXPORT aclError ascendsim_get_ipc_stats(int32_t device, uint64_t *out, uint32_t n)
{
    static const char call[] = "ascendsim_get_ipc_stats";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!sim_valid_device(device))
        return sim_fail(ACL_ERROR_INVALID_DEVICE, call, "device id %d is out of range (0..%d)", (int)device,
                        g_sim.cfg.devices - 1);
    if (!out && n)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "out is NULL");
    struct counters *c = &counters[device];
    uint64_t v[] = {atomic_load(&c->exports), atomic_load(&c->exported_bytes), atomic_load(&c->imports),
                    atomic_load(&c->imported_bytes)};
    for (uint32_t i = 0; i < n && i < sizeof v / sizeof v[0]; i++)
        out[i] = v[i];
    return ACL_SUCCESS;
}

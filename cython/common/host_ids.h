/* This process's uid and gids as the host sees them: what shared files are NAMED by and STORE.
 *
 * A process in a user namespace (a rootless container, a pod with hostUsers: false, `unshare
 * --user --map-user=N`) has an euid inside it (geteuid()) that the kernel maps to another uid
 * outside. The files one host user's processes share on a node (the simulator's node records,
 * leases and IPC files; the quota ledgers) are named by, and record, the uid OUTSIDE: the second
 * column of /proc/self/uid_map for the line whose range holds geteuid() (gid_map for a group).
 * That column is the parent namespace's view: for a namespace made from the host, the host's uid;
 * a nested namespace resolves to its parent's view, not the host's. So the processes of one host
 * user, inside and outside a user namespace, are one user: one node record, one ledger.
 *
 * Ownership CHECKS of a file (fstat's st_uid) are not translated: the kernel already shows a file
 * of this host user as geteuid() and one of an owner the map leaves out as the overflow uid
 * (65534), so `st_uid == geteuid()` stays right. A named or recorded uid is compared with st_uid
 * only through ap_owner_host_uid(), which translates st_uid outward and refuses the overflow uid
 * (every unmapped owner shows as it, even where the map holds that uid).
 *
 * Where the map leaves geteuid() out (a namespace whose map is not written yet) or /proc cannot
 * be read, the host uid is geteuid() itself: today's names, shared with nobody outside (the
 * simulator says so once, device.c).
 *
 * The maps are read once per loaded object and cached (pthread_once): they never change once
 * written, and a process changes user namespace only by unshare()/setns() while single-threaded,
 * which this package does not do; a forked child, which may, reads them again (pthread_atfork,
 * as identity.py does). Each object that uses it (the simulator: cython/sim/proc.c; the
 * pool: cython/quota) includes this header once and has its own copy of the cache. Hot paths pay
 * one geteuid() at most, never a /proc read.
 */
#ifndef AP_HOST_IDS_H
#define AP_HOST_IDS_H

#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#define AP_IDMAP_ROWS 340 /* the kernel's limit on a map's lines (since 4.15) */

struct ap_idmap {
    int kind;      /* 0: identity (the initial namespace, or /proc cannot tell); 1: the rows below */
    int n;         /* rows; 0 with kind 1: a map with no lines (nothing written yet) */
    uint32_t overflow;
    uint32_t in[AP_IDMAP_ROWS], out[AP_IDMAP_ROWS], count[AP_IDMAP_ROWS];
};

static struct ap_idmap ap_ids_uid, ap_ids_gid;
static pthread_once_t ap_ids_once = PTHREAD_ONCE_INIT;

static void ap_idmap_read(struct ap_idmap *m, const char *path, const char *overflow_path) {
    m->kind = 0;
    m->n = 0;
    m->overflow = 65534;
    char small[32];
    int fd = open(overflow_path, O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        ssize_t k = read(fd, small, sizeof small - 1);
        if (k > 0) {
            small[k] = 0;
            m->overflow = (uint32_t)strtoul(small, NULL, 10);
        }
        close(fd);
    }
    size_t cap = 16384, len = 0; /* 340 lines of three 10-digit numbers fit */
    char *buf = malloc(cap);
    if (!buf) return;
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        free(buf);
        return; /* no /proc: cannot tell; the identity */
    }
    for (;;) {
        ssize_t k = read(fd, buf + len, cap - 1 - len);
        if (k <= 0) break;
        len += (size_t)k;
        if (len >= cap - 1) break;
    }
    close(fd);
    buf[len] = 0;
    int n = 0;
    char *p = buf;
    while (*p && n < AP_IDMAP_ROWS) {
        char *end;
        unsigned long long a = strtoull(p, &end, 10);
        if (end == p) break;
        p = end;
        unsigned long long b = strtoull(p, &end, 10);
        if (end == p) break;
        p = end;
        unsigned long long c = strtoull(p, &end, 10);
        if (end == p) break;
        p = end;
        if (a > UINT32_MAX || b > UINT32_MAX || c > 4294967296ull) break;
        m->in[n] = (uint32_t)a;
        m->out[n] = (uint32_t)b;
        m->count[n] = c > UINT32_MAX ? UINT32_MAX : (uint32_t)c;
        n++;
        while (*p && *p != '\n') p++;
        while (*p == '\n' || *p == ' ' || *p == '\t') p++;
    }
    free(buf);
    if (n == 1 && m->in[0] == 0 && m->out[0] == 0 && m->count[0] == UINT32_MAX) return; /* the initial one */
    m->n = n;
    m->kind = 1;
}

/* A forked child reads the maps again when it first asks: it may unshare(CLONE_NEWUSER) (and have
   its map written) before it does, as identity.py's cache allows for; the parent's would then name
   and record the wrong host uid (the uid inside taken for the host's). */
static void ap_ids_after_fork_in_child(void) {
    static const pthread_once_t fresh = PTHREAD_ONCE_INIT;
    ap_ids_once = fresh;
}

static void ap_ids_load(void) {
    static int atfork; /* registered once per object; the handler runs in every later child */
    if (!atfork) {
        atfork = 1;
        pthread_atfork(NULL, NULL, ap_ids_after_fork_in_child);
    }
    ap_idmap_read(&ap_ids_uid, "/proc/self/uid_map", "/proc/sys/kernel/overflowuid");
    ap_idmap_read(&ap_ids_gid, "/proc/self/gid_map", "/proc/sys/kernel/overflowgid");
}

static const struct ap_idmap *ap_ids_map(int gid) {
    pthread_once(&ap_ids_once, ap_ids_load);
    return gid ? &ap_ids_gid : &ap_ids_uid;
}

/* 1 with *out the id outside of `id` inside; 0 when the map leaves it out. */
static int ap_idmap_outward(const struct ap_idmap *m, uint32_t id, uint32_t *out) {
    if (!m->kind) {
        *out = id;
        return 1;
    }
    for (int i = 0; i < m->n; i++)
        if (id >= m->in[i] && id - m->in[i] < m->count[i]) {
            *out = m->out[i] + (id - m->in[i]);
            return 1;
        }
    return 0;
}

/* 1 when this process runs in a user namespace other than the initial one (its uid map is not
   the identity "0 0 4294967295"). */
static int ap_in_user_namespace(void) {
    return ap_ids_map(0)->kind != 0;
}

/* 1 when the uid map holds geteuid() (or there is no namespace): ap_host_uid() is the host's. */
static int ap_host_uid_known(void) {
    uint32_t out;
    return ap_idmap_outward(ap_ids_map(0), (uint32_t)geteuid(), &out);
}

/* This process's host uid: geteuid() translated by the uid map; geteuid() where it cannot be. */
static uint32_t ap_host_uid(void) {
    uint32_t me = (uint32_t)geteuid(), out;
    return ap_idmap_outward(ap_ids_map(0), me, &out) ? out : me;
}

/* The host's gid of `gid` (as this namespace sees it); gid itself where the map leaves it out. */
static uint32_t ap_host_gid(uint32_t gid) {
    uint32_t out;
    return ap_idmap_outward(ap_ids_map(1), gid, &out) ? out : gid;
}

/* 1 with *host the host uid of a file owned by st_uid (fstat's, this namespace's view); 0 when it
   cannot be told: the map leaves st_uid out, or it is the overflow uid unmapped owners show as. */
static int ap_owner_host_uid(uid_t st_uid, uint32_t *host) {
    if (st_uid == geteuid()) {
        *host = ap_host_uid();
        return 1;
    }
    const struct ap_idmap *m = ap_ids_map(0);
    if (m->kind && (uint32_t)st_uid == m->overflow) return 0;
    return ap_idmap_outward(m, (uint32_t)st_uid, host);
}

/* 1 when a file owned by st_uid (this namespace's view) belongs to the host's uid `host`: this
   user's own by st_uid == geteuid(), untranslated; another user's through ap_owner_host_uid. */
static int ap_owned_by(uid_t st_uid, uint32_t host) {
    if (host == ap_host_uid()) return st_uid == geteuid();
    uint32_t h;
    return ap_owner_host_uid(st_uid, &h) && h == host;
}

/* As ap_owner_host_uid, for a file's group (st_gid). */
static int ap_owner_host_gid(gid_t st_gid, uint32_t *host) {
    const struct ap_idmap *m = ap_ids_map(1);
    if (m->kind && (uint32_t)st_gid == m->overflow) return 0;
    return ap_idmap_outward(m, (uint32_t)st_gid, host);
}

#endif

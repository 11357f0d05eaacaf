/* Reading and sweeping ledgers of other users (a node service's --allow-uid / --allow-group).
 *
 * Such a file belongs to its user, who may truncate, replace or lock it at any time. So:
 *   - a view is a private copy read with pread(), never a mapping (as the stats files of other
 *     users are read): a truncated file is refused, never a SIGBUS; no lock is taken, so a process
 *     stopped inside an update holding the lock cannot stall a scrape (the copy is taken twice
 *     until both agree, "double collect", and checked as the open checks a mapping);
 *   - a sweep (which writes: it gives a dead process's share back) uses a mapping, but checks the
 *     size of the file under the lock first (fstat) and runs under the SIGBUS guard
 *     (ledger_guard.h), and waits for the lock no longer than its caller says.
 */
#ifndef AP_LEDGER_FOREIGN_H
#define AP_LEDGER_FOREIGN_H

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ledger_guard.h"
#include "ledger_slots.h"

static int apl_pread_all(int fd, void *buf, size_t n) {
    size_t done = 0;
    while (done < n) {
        ssize_t r = pread(fd, (char *)buf + done, n - done, (off_t)done);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return r < 0 ? -1 : 0; /* 0: shorter than a ledger (truncated meanwhile) */
        done += (size_t)r;
    }
    return 1;
}

/* Fills *out (and *scratch, same size) with a checked copy of the ledger at path; never maps it,
   never locks it. owner: APL_NO_OWNER for this user's own. APL_OK or an APL_E_* kind. */
static int apl_read_copy(const char *path, int device, const char *backend, const char *node, uint32_t group,
                         uint32_t owner, apl_file *out, apl_file *scratch, char *err, size_t len) {
    if (owner == APL_NO_OWNER) owner = ap_host_uid();
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0 && errno == EACCES) return apl_open_refused(path, group, owner, err, len); /* its group or mode */
    if (fd < 0)
        return apl_fail(err, len, errno == ELOOP ? APL_E_PERM : APL_E_IO,
                        "cannot open ledger %s: %s", path, errno == ELOOP ? "a symbolic link; refusing it"
                        : strerror(errno));
    struct stat st;
    int rc = apl_check_stat(fd, path, group, owner, &st, err, len);
    const char *bad = NULL;
    for (int attempt = 0; rc == APL_OK && attempt < 4; attempt++) {
        int same = 0;
        for (int i = 0; i < 100 && !same; i++) { /* double collect: two reads in a row that agree */
            int r = apl_pread_all(fd, i ? scratch : out, sizeof *out);
            if (r > 0 && i) {
                same = memcmp(out, scratch, sizeof *out) == 0;
                if (!same) memcpy(out, scratch, sizeof *out);
            }
            if (r < 0) {
                rc = apl_fail(err, len, APL_E_IO, "cannot read ledger %s: %s", path, strerror(errno));
                break;
            }
            if (r == 0) {
                rc = apl_fail(err, len, APL_E_MALFORMED, "ledger %s was truncated while being read; refusing it",
                              path);
                break;
            }
        }
        if (rc != APL_OK) break;
        /* A writer stopped inside an update (lock held) may leave an entry half-claimed: read
           again a few times before calling the file malformed. A copy that never read the same
           twice is no picture at all. */
        bad = same ? apl_check_contents(out, &st, device, backend, node, group)
                   : "it kept changing while it was read";
        if (!bad) break;
        struct timespec ts = {0, 2 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    close(fd);
    if (rc == APL_OK && bad)
        rc = apl_fail(err, len, APL_E_MALFORMED, "ledger %s is malformed (%s); refusing it (remove it when no "
                      "process uses device quotas)", path, bad);
    return rc;
}

/* Sweep of a mapped ledger another user may truncate: the lock within lock_ms, then the file's
   size (the mapping is only touched while the file still covers it), then the reclaim under the
   SIGBUS guard (guard: a file another user can write; a user's own processes install no
   signal handler). Returns the slots reclaimed; -1 with err when the lock could not be taken;
   -2 with err when the file shrank: this mapping must not be used again (drop it). */
static int apl_reclaim_checked(apl_ledger *L, int lock_ms, int guard, uint64_t *bytes, char *err, size_t len) {
    if (bytes) *bytes = 0;
    if (apl_lock_ms(L, lock_ms, err, len) != APL_OK) return -1;
    struct stat st;
    if (fstat(L->fd, &st) != 0 || st.st_size < (off_t)sizeof(apl_file)) {
        apl_unlock(L);
        atomic_store(&L->broken, 1);
        apl_fail(err, len, APL_E_MALFORMED, "ledger %s shrank (truncated by its owner?); dropping it", L->path);
        return -2;
    }
    volatile int n = 0, bus = 0;
    uint64_t got = 0;
    if (guard) {
        sigjmp_buf env;
        APL_GUARDED_AT(env, L->f, sizeof(apl_file), n = apl_reclaim_locked(L, -1, &got), bus = 1);
    } else {
        n = apl_reclaim_locked(L, -1, &got);
    }
    apl_unlock(L);
    if (bus) {
        atomic_store(&L->broken, 1);
        apl_fail(err, len, APL_E_MALFORMED, "ledger %s was truncated during a sweep; dropping it", L->path);
        return -2;
    }
    if (bytes) *bytes = got;
    return n;
}

#endif

/* Who owns a ledger slot: a process is named by its pid *and* its start time, because pids are
 * reused. A slot whose pid is gone, a zombie, or now belongs to a process that started at
 * another time is dead and its bytes may be given back.
 *
 * The start time is field 22 of /proc/PID/stat ("starttime", clock ticks since boot). Field 2 is
 * the command name in parentheses and may itself contain spaces and ')' — so parsing starts after
 * the *last* ')'.
 *
 * Assumes the processes sharing a ledger share a pid namespace (true for the processes of one
 * container, which is also the scope of its /dev/shm).
 */
#ifndef AP_PROC_IDENTITY_H
#define AP_PROC_IDENTITY_H

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Reads state (field 3) and start time (field 22) of pid. 0 ok, -1 no such process, -2 cannot
   tell (e.g. /proc hidden or unreadable). */
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

/* 1 alive (same pid, same start time), 0 dead, -1 cannot tell (then the slot is kept: never give
   away bytes a live process may still hold). */
static int apl_proc_alive(int pid, uint64_t start_time) {
    if (pid <= 0) return 0;
    if (kill(pid, 0) != 0 && errno == ESRCH) return 0;
    char state;
    uint64_t start;
    int rc = apl_read_stat(pid, &state, &start);
    if (rc == -1) return 0;
    if (rc == -2) return -1;
    if (state == 'Z' || state == 'X') return 0; /* exited; its device memory is already gone */
    return start == start_time ? 1 : 0;
}

#endif

/* Whether a process of this pid namespace has surely exited, from /proc/PID/stat.
 *
 * A zombie ('Z', or 'X') state is not enough: it is the state of the thread group's LEADER, which
 * is a zombie from the moment the main thread ends, also when it ended by pthread_exit() while the
 * process's other threads run on holding its device memory (kill(pid, 0) still finds it). Taking
 * that for a death gave a live process's quota share away (and its simulated device memory). So
 * a zombie leader is a death only when
 *   - no thread but it is left (num_threads, field 20, is 1: the process waits to be reaped), or
 *   - it was ended by a signal (exit_code, field 52, low 7 bits): a fatal signal ends every
 *     thread of the process, and its lease drops a moment later (the other threads are still
 *     closing their files: what this early answer is for).
 * exit_code reads 0 where the kernel does not show it (before 3.5, or a process the reader may not
 * ptrace): then only the lease tells, a moment later.
 *
 * Header-only: the pool's ledger (../quota/proc_identity.h) and the simulator (../sim/proc.c) each
 * include it once. */
#ifndef AP_PROC_EXIT_H
#define AP_PROC_EXIT_H

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* 1 when pid has surely exited (see above), 0 when it is alive or it cannot be told. */
static int ap_proc_exited(int pid) {
    char path[64], buf[2048];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* comm (field 2) may hold spaces and ')' */
    if (!p || p[1] != ' ') return 0;
    p += 2;
    if (*p != 'Z' && *p != 'X') return 0;
    long long threads = -1, exit_code = 0;
    for (int field = 3; *p && field <= 52; field++) {
        if (field == 20) threads = strtoll(p, NULL, 10);
        if (field == 52) exit_code = strtoll(p, NULL, 10);
        p = strchr(p, ' ');
        if (!p) break;
        p++;
    }
    return threads == 1 || (exit_code & 0x7f) != 0;
}

#endif

/* Process identity for the node records: a pid alone is not an identity (pids are reused), so a
 * slot names its owner by pid and start time (/proc/PID/stat field 22, clock ticks since boot).
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

int sim_proc_alive(int pid, uint64_t start_time)
{
    if (pid <= 0)
        return 0;
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return 0;
    char state;
    uint64_t start;
    int rc = read_stat(pid, &state, &start);
    if (rc == -1)
        return 0;
    if (rc == -2)
        return -1; /* e.g. /proc mounted with hidepid: cannot tell, so keep the slot */
    if (state == 'Z' || state == 'X')
        return 0;  /* exited (a zombie holds no memory) */
    return start == start_time ? 1 : 0;
}

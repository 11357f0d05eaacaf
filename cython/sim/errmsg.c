/* The per-thread "recent error" that aclGetRecentErrMsg() returns.
 *
 * Every failing call records one line naming the call, the problem and the code, so the pool's
 * backend can turn a bare aclError into a message a user can act on. Like the real runtime's,
 * the message is per thread and reading it clears it (the next read returns NULL until another
 * failure); the returned pointer stays valid until this thread's next failing call.
 */
#include <stdarg.h>
#include <stdio.h>

#include "sim_internal.h"

#define SIM_ERRMSG_LEN 1024

static __thread char t_msg[SIM_ERRMSG_LEN];
static __thread int t_has_msg;

int sim_fail(int code, const char *call, const char *fmt, ...)
{
    int n = snprintf(t_msg, sizeof t_msg, "%s: ", call);
    if (n < 0 || (size_t)n >= sizeof t_msg)
        n = 0;
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(t_msg + n, sizeof t_msg - (size_t)n, fmt, ap);
    va_end(ap);
    if (m > 0 && (size_t)(n + m) < sizeof t_msg)
        snprintf(t_msg + n + m, sizeof t_msg - (size_t)(n + m), " (aclError %d)", code);
    t_has_msg = 1;
    return code;
}

SIM_EXPORT const char *aclGetRecentErrMsg(void)
{
    if (!t_has_msg)
        return NULL;
    t_has_msg = 0;
    return t_msg;
}

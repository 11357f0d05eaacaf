/* The C ABI's last error: one per thread, set by every failing call, read with
 * ascend_pool_last_error_code() / ascend_pool_last_error().
 *
 * errno's rules: a successful call leaves it alone (clearing it would cost every hot-path call a
 * thread-local write), so a caller clears it before the call it wants to check.
 *
 * Compiled into the extension through capi.pxi (a header, because setup.py compiles only
 * cython/core and cython/backend sources); it is included once, into _core.c.
 */
#ifndef APC_LAST_ERROR_H
#define APC_LAST_ERROR_H

#include <stdarg.h>
#include <stdio.h>

#include "ascend_pool.h"
#include "pool.h"

#define APC_EXPORT __attribute__((visibility("default")))

/* The public codes are the pool's statuses: a pool failure is reported with its own status. */
_Static_assert(ASCEND_POOL_OK == AP_OK, "status codes drifted");
_Static_assert(ASCEND_POOL_E_OOM == AP_E_OOM, "status codes drifted");
_Static_assert(ASCEND_POOL_E_LIMIT == AP_E_LIMIT, "status codes drifted");
_Static_assert(ASCEND_POOL_E_INVALID_SIZE == AP_E_INVALID_SIZE, "status codes drifted");
_Static_assert(ASCEND_POOL_E_INVALID_PTR == AP_E_INVALID_PTR, "status codes drifted");
_Static_assert(ASCEND_POOL_E_INVALID_STREAM == AP_E_INVALID_STREAM, "status codes drifted");
_Static_assert(ASCEND_POOL_E_DEVICE == AP_E_DEVICE, "status codes drifted");
_Static_assert(ASCEND_POOL_E_TIMEOUT == AP_E_TIMEOUT, "status codes drifted");
_Static_assert(ASCEND_POOL_E_HOST_NOMEM == AP_E_HOST_NOMEM, "status codes drifted");
_Static_assert(ASCEND_POOL_E_QUOTA == AP_E_QUOTA, "status codes drifted");

typedef struct apc_error {
    int code;
    char message[1024]; /* a prefix naming the call, then the pool's message (pool.h) */
} apc_error;

static __thread apc_error apc_last;

static void apc_fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void apc_fail(int code, const char *fmt, ...) {
    va_list ap;
    apc_last.code = code;
    va_start(ap, fmt);
    vsnprintf(apc_last.message, sizeof apc_last.message, fmt, ap);
    va_end(ap);
}

APC_EXPORT int ascend_pool_last_error_code(void) { return apc_last.code; }

APC_EXPORT const char *ascend_pool_last_error(void) { return apc_last.message; }

APC_EXPORT void ascend_pool_clear_last_error(void) {
    apc_last.code = ASCEND_POOL_OK;
    apc_last.message[0] = 0;
}

#endif

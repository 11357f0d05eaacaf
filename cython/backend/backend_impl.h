/* Private helpers shared by the backend implementations (acl.c, cuda.c) and backend.c.
 * Not part of the pool's interface: only backend.h is. */
#ifndef ASCEND_POOL_BACKEND_IMPL_H
#define ASCEND_POOL_BACKEND_IMPL_H

#include "backend.h"

#include <stdarg.h>
#include <stdint.h>

#define AP_MAX_SYMBOLS 48

/* The first member of every implementation's private state (b->impl), so that backend.c can list
   resolved symbols and close any backend without knowing its kind. */
typedef struct ap_impl_base {
    uint64_t id;                          /* unique per open: keys the per-thread device cache */
    int n_symbols;
    const char *symbols[AP_MAX_SYMBOLS];  /* names resolved by dlsym(), in order (string literals) */
} ap_impl_base;

/* prefer_loaded: a runtime already loaded in the process wins over `path` (a default, not a
   choice); want_sim: only a simulator copy counts as that runtime (kind "sim"), else only a real one. */
int ap_acl_open(ap_backend *b, const char *path, int prefer_loaded, int want_sim, char *err,
                size_t errlen);
int ap_cuda_open(ap_backend *b, const char *path, char *err, size_t errlen);

/* fork.c: +1 when a backend opens, -1 when it closes (a fork with any open is refused). */
void ap_backend_count_open(int delta);
/* +1 when ap_backend_open starts, -1 when it returns: a fork meanwhile counts as after an open. */
void ap_backend_count_opening(int delta);

/* A library already loaded in this process whose file name is `stem` or `stem.<version>`, opened
   again (RTLD_NOLOAD: never a second copy) and written to found; NULL when none. With marker
   set, only a library exporting that symbol counts when want_marker, only one lacking it when
   not (e.g. the simulator's libascendcl.so versus a real one). */
void *ap_find_loaded(const char *stem, const char *marker, int want_marker, char *found, size_t foundlen);

/* A fresh id for ap_impl_base.id (never 0, so a zeroed thread-local cache never matches). */
uint64_t ap_next_backend_id(void);

/* dlsym() that records the name in base->symbols when found. Returns NULL when absent. */
void *ap_resolve(void *lib, ap_impl_base *base, const char *name);

/* snprintf into err that never overflows and tolerates err == NULL / errlen == 0. */
void ap_errf(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Appends to a NUL-terminated buffer, truncating silently. */
void ap_appendf(char *buf, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Appends "\n  <why dlopen(path) failed>" to err (dlerror() text, which usually names the file). */
void ap_append_dlerror(char *err, size_t errlen, const char *path);

/* Text for our own AP_ERR_* codes, or NULL for any other code. */
const char *ap_own_error_text(int code);

/* Monotonic clock in nanoseconds, and the polling sleep used where a runtime has no timed wait:
   starts short (latency matters when the work is nearly done) and backs off to 1 ms. */
uint64_t ap_now_ns(void);
void ap_poll_sleep(unsigned *step_us);

#endif

/* ap_backend_open_default/close: picks the implementation by kind; helpers shared by acl.c and cuda.c. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* dl_iterate_phdr */
#endif
#include "backend_impl.h"

#include <dlfcn.h>
#include <link.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Loads and opens the runtime of `kind` into b (zeroed); counted as open on success. */
static int open_kind(ap_backend *b, const char *kind, const char *path, int prefer_loaded, char *err, size_t errlen)
{
    int rc;

    if (path && !*path)
        path = NULL; /* "" means the default search, as NULL does */
    if (!kind) {
        ap_errf(err, errlen, "ap_backend_open: no backend kind given (expected acl, sim or cuda)");
        return AP_ERR_NOT_LOADED;
    }
    if (strcmp(kind, "acl") == 0) {
        rc = ap_acl_open(b, path, prefer_loaded, 0, err, errlen);
    } else if (strcmp(kind, "sim") == 0) {
        /* The simulator is the acl implementation pointed at its own libascendcl.so. It has no
           default location at this level: only the Python package knows where it is installed,
           and silently picking a real NPU runtime instead would defeat the point of asking. */
        if (!path) {
            ap_errf(err, errlen, "the sim backend needs the path of the simulator's libascendcl.so");
            return AP_ERR_NOT_LOADED;
        }
        rc = ap_acl_open(b, path, prefer_loaded, 1, err, errlen);
    } else if (strcmp(kind, "cuda") == 0) {
        rc = ap_cuda_open(b, path, err, errlen);
    } else {
        ap_errf(err, errlen, "unknown backend kind '%s' (expected acl, sim or cuda)", kind);
        return AP_ERR_NOT_LOADED;
    }
    if (rc != 0) {
        ap_backend_close(b);
        return rc;
    }
    snprintf(b->name, sizeof b->name, "%s", kind);
    ap_backend_count_open(1);
    return 0;
}

int ap_backend_open_default(ap_backend *b, const char *kind, const char *path, int prefer_loaded,
                            char *err, size_t errlen)
{
    int rc;

    if (!b) {
        ap_errf(err, errlen, "ap_backend_open: no backend struct given");
        return AP_ERR_NOT_LOADED;
    }
    memset(b, 0, sizeof *b);
    if (atomic_load_explicit(&ap_forked_from, memory_order_relaxed)) {
        ap_backend_forked_message(err, errlen);
        return AP_ERR_FORKED;
    }
    ap_backend_count_opening(1); /* a fork from now on leaves the child without a runtime (fork.c) */
    rc = open_kind(b, kind, path, prefer_loaded, err, errlen);
    ap_backend_count_opening(-1);
    return rc;
}

void ap_backend_close(ap_backend *b)
{
    if (!b)
        return;
    /* No aclFinalize()/cudaDeviceReset(): a framework in the same process may share the runtime.
       The library is opened with RTLD_NODELETE, so dlclose() only drops our reference and never
       unmaps code that runtime worker threads may still be executing. */
    if (b->name[0]) /* opened (ap_backend_open names it last) */
        ap_backend_count_open(-1);
    if (b->shutdown && b->impl)
        b->shutdown(b);
    if (b->lib)
        dlclose(b->lib);
    free(b->impl);
    memset(b, 0, sizeof *b);
}

const char *ap_backend_symbol(const ap_backend *b, int i)
{
    const ap_impl_base *base;

    if (!b || !b->impl || i < 0)
        return NULL;
    base = (const ap_impl_base *)b->impl;
    return i < base->n_symbols ? base->symbols[i] : NULL;
}

struct find_loaded {
    const char *stem, *marker;
    int want_marker;
    void *lib;
    char *found;
    size_t foundlen;
};

static int find_loaded_cb(struct dl_phdr_info *info, size_t size, void *arg)
{
    struct find_loaded *f = arg;
    const char *name = info->dlpi_name, *base;
    size_t n = strlen(f->stem);
    void *lib;

    (void)size;
    if (!name || !*name)
        return 0;
    base = strrchr(name, '/');
    base = base ? base + 1 : name;
    if (strncmp(base, f->stem, n) != 0 || (base[n] != '\0' && base[n] != '.'))
        return 0;
    lib = dlopen(name, RTLD_NOW | RTLD_NOLOAD | RTLD_LOCAL | RTLD_NODELETE);
    if (!lib)
        return 0;
    if (f->marker && (dlsym(lib, f->marker) != NULL) != (f->want_marker != 0)) {
        dlclose(lib);
        return 0;
    }
    f->lib = lib;
    snprintf(f->found, f->foundlen, "%s", name);
    return 1;
}

void *ap_find_loaded(const char *stem, const char *marker, int want_marker, char *found, size_t foundlen)
{
    struct find_loaded f = {stem, marker, want_marker, NULL, found, foundlen};

    dl_iterate_phdr(find_loaded_cb, &f);
    return f.lib;
}

uint64_t ap_next_backend_id(void)
{
    static uint64_t next_id;
    return __atomic_add_fetch(&next_id, 1, __ATOMIC_RELAXED);
}

void *ap_resolve(void *lib, ap_impl_base *base, const char *name)
{
    void *sym = dlsym(lib, name);

    if (sym && base->n_symbols < AP_MAX_SYMBOLS)
        base->symbols[base->n_symbols++] = name;
    return sym;
}

void ap_errf(char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;

    if (!err || errlen == 0)
        return;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

void ap_appendf(char *buf, size_t len, const char *fmt, ...)
{
    va_list ap;
    size_t used;

    if (!buf || len == 0)
        return;
    used = strnlen(buf, len);
    if (used + 1 >= len)
        return;
    va_start(ap, fmt);
    vsnprintf(buf + used, len - used, fmt, ap);
    va_end(ap);
}

void ap_append_dlerror(char *err, size_t errlen, const char *path)
{
    const char *why = dlerror();

    if (!why)
        ap_appendf(err, errlen, "\n  %s: dlopen failed", path);
    else if (strstr(why, path))
        ap_appendf(err, errlen, "\n  %s", why);
    else
        ap_appendf(err, errlen, "\n  %s: %s", path, why);
}

const char *ap_own_error_text(int code)
{
    switch (code) {
    case AP_ERR_NOT_LOADED:
        return "backend library could not be loaded";
    case AP_ERR_MISSING_SYMBOL:
        return "backend library lacks a required symbol";
    case AP_ERR_NO_DEVICE:
        return "backend library loaded but reports no device";
    case AP_ERR_FORKED:
        return "forked after the parent opened the device runtime: start workers with 'spawn'";
    default:
        return NULL;
    }
}

uint64_t ap_now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void ap_poll_sleep(unsigned *step_us)
{
    struct timespec ts;

    if (*step_us == 0)
        *step_us = 20;
    ts.tv_sec = 0;
    ts.tv_nsec = (long)*step_us * 1000L;
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
    if (*step_us < 1000)
        *step_us *= 2;
}

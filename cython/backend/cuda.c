/* The cuda backend: the CUDA runtime (libcudart) loaded with dlopen(), so that the same pool and
 * its peers (PyTorch, CuPy, RMM) can be compared on an NVIDIA GPU. Nothing links against CUDA at
 * build time. Codes returned are cudaError_t values (0 = cudaSuccess).
 */
#include "backend_impl.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int cudaError_t;

#define cudaErrorNotReady 600           /* queries: work still pending; also our timeout code */
#define cudaEventDisableTiming 0x02u    /* the cheapest event: no timestamps, spin-wait sync */
#define cudaHostAllocDefault 0x00u      /* pinned, portable to the allocating context only */

typedef struct cuda_impl {
    ap_impl_base base; /* must stay first */
    cudaError_t (*cudaSetDevice)(int device);
    cudaError_t (*cudaGetDeviceCount)(int *count);
    cudaError_t (*cudaMalloc)(void **ptr, size_t size);
    cudaError_t (*cudaFree)(void *ptr);
    cudaError_t (*cudaMemGetInfo)(size_t *free_bytes, size_t *total_bytes);
    cudaError_t (*cudaEventCreateWithFlags)(void **event, unsigned flags);
    cudaError_t (*cudaEventRecord)(void *event, void *stream);
    cudaError_t (*cudaEventQuery)(void *event);
    cudaError_t (*cudaEventSynchronize)(void *event);
    cudaError_t (*cudaEventDestroy)(void *event);
    cudaError_t (*cudaStreamWaitEvent)(void *stream, void *event, unsigned flags);
    cudaError_t (*cudaStreamCreate)(void **stream);
    cudaError_t (*cudaStreamQuery)(void *stream);
    cudaError_t (*cudaStreamSynchronize)(void *stream);
    cudaError_t (*cudaStreamDestroy)(void *stream);
    const char *(*cudaGetErrorString)(cudaError_t code);
    const char *(*cudaGetErrorName)(cudaError_t code);
    /* Pinned host memory, resolved on first use (see cuda_host_resolve). */
    int host_state; /* 0: not yet looked up; 1: resolved; 2: absent (atomic) */
    cudaError_t (*cudaHostAlloc)(void **ptr, size_t size, unsigned flags);
    cudaError_t (*cudaFreeHost)(void *ptr);
} cuda_impl;

#define IMPL(b) ((cuda_impl *)(b)->impl)

/* Same per-thread cache as acl.c: the CUDA current device is per thread too. */
static __thread uint64_t tls_owner;
static __thread int tls_device;

static int cuda_set_device(ap_backend *b, int device)
{
    cuda_impl *im = IMPL(b);
    cudaError_t rc;

    if (tls_owner == im->base.id && tls_device == device)
        return 0;
    rc = im->cudaSetDevice(device);
    if (rc != 0)
        return rc;
    tls_owner = im->base.id;
    tls_device = device;
    return 0;
}

/* cudaMalloc reserves whole pages internally, but it reports and accounts the size asked for. */
static size_t cuda_device_size(const ap_backend *b, size_t size)
{
    (void)b;
    return size;
}

static int cuda_malloc(ap_backend *b, int device, void **ptr, size_t size)
{
    int rc = cuda_set_device(b, device);

    return rc != 0 ? rc : IMPL(b)->cudaMalloc(ptr, size);
}

static int cuda_free(ap_backend *b, int device, void *ptr)
{
    int rc = cuda_set_device(b, device);

    return rc != 0 ? rc : IMPL(b)->cudaFree(ptr);
}

static int cuda_mem_info(ap_backend *b, int device, size_t *free_bytes, size_t *total_bytes)
{
    int rc = cuda_set_device(b, device);

    return rc != 0 ? rc : IMPL(b)->cudaMemGetInfo(free_bytes, total_bytes);
}

/* Resolved on first use, as in acl.c: only processes that pin host memory list these symbols. */
static pthread_mutex_t host_resolve_lock = PTHREAD_MUTEX_INITIALIZER;

static int cuda_host_resolve(ap_backend *b)
{
    cuda_impl *im = IMPL(b);
    int state = __atomic_load_n(&im->host_state, __ATOMIC_ACQUIRE);

    if (state == 0) {
        pthread_mutex_lock(&host_resolve_lock);
        state = im->host_state;
        if (state == 0) {
            im->cudaHostAlloc = (__typeof__(im->cudaHostAlloc))ap_resolve(b->lib, &im->base, "cudaHostAlloc");
            im->cudaFreeHost = (__typeof__(im->cudaFreeHost))ap_resolve(b->lib, &im->base, "cudaFreeHost");
            state = im->cudaHostAlloc && im->cudaFreeHost ? 1 : 2;
            __atomic_store_n(&im->host_state, state, __ATOMIC_RELEASE);
        }
        pthread_mutex_unlock(&host_resolve_lock);
    }
    return state == 1 ? 0 : AP_ERR_MISSING_SYMBOL;
}

/* cudaHostAlloc pins in the current device's context: make `device` current first. */
static int cuda_host_malloc(ap_backend *b, int device, void **ptr, size_t size)
{
    int rc = cuda_host_resolve(b);

    if (rc == 0)
        rc = cuda_set_device(b, device);
    return rc != 0 ? rc : IMPL(b)->cudaHostAlloc(ptr, size, cudaHostAllocDefault);
}

static int cuda_host_free(ap_backend *b, int device, void *ptr)
{
    int rc = cuda_host_resolve(b);

    if (rc == 0)
        rc = cuda_set_device(b, device);
    return rc != 0 ? rc : IMPL(b)->cudaFreeHost(ptr);
}

static int cuda_event_create(ap_backend *b, int device, void **event)
{
    int rc = cuda_set_device(b, device);

    return rc != 0 ? rc : IMPL(b)->cudaEventCreateWithFlags(event, cudaEventDisableTiming);
}

static int cuda_event_record(ap_backend *b, void *event, void *stream)
{
    return IMPL(b)->cudaEventRecord(event, stream);
}

static int cuda_event_query(ap_backend *b, void *event, int *complete)
{
    cudaError_t rc = IMPL(b)->cudaEventQuery(event);

    if (rc == 0 || rc == cudaErrorNotReady) {
        *complete = rc == 0;
        return 0;
    }
    return rc;
}

/* CUDA has no timed waits: poll a query (cudaEventQuery / cudaStreamQuery) until the deadline. */
static int cuda_poll(cudaError_t (*query)(void *), void *handle, int timeout_ms)
{
    uint64_t deadline = ap_now_ns() + (uint64_t)timeout_ms * 1000000u;
    unsigned step = 0;
    cudaError_t rc;

    for (;;) {
        rc = query(handle);
        if (rc != cudaErrorNotReady)
            return rc;
        if (ap_now_ns() >= deadline)
            return cudaErrorNotReady;
        ap_poll_sleep(&step);
    }
}

static int cuda_event_sync(ap_backend *b, void *event, int timeout_ms)
{
    if (timeout_ms < 0)
        return IMPL(b)->cudaEventSynchronize(event);
    return cuda_poll(IMPL(b)->cudaEventQuery, event, timeout_ms);
}

static int cuda_event_destroy(ap_backend *b, void *event)
{
    return IMPL(b)->cudaEventDestroy(event);
}

static int cuda_stream_wait_event(ap_backend *b, void *stream, void *event)
{
    return IMPL(b)->cudaStreamWaitEvent(stream, event, 0);
}

static int cuda_stream_create(ap_backend *b, int device, void **stream)
{
    int rc = cuda_set_device(b, device);

    return rc != 0 ? rc : IMPL(b)->cudaStreamCreate(stream);
}

static int cuda_stream_sync(ap_backend *b, void *stream, int timeout_ms)
{
    if (timeout_ms < 0)
        return IMPL(b)->cudaStreamSynchronize(stream);
    return cuda_poll(IMPL(b)->cudaStreamQuery, stream, timeout_ms);
}

static int cuda_stream_destroy(ap_backend *b, void *stream)
{
    return IMPL(b)->cudaStreamDestroy(stream);
}

static void cuda_error_message(ap_backend *b, int code, char *buf, size_t len)
{
    const char *own = ap_own_error_text(code);
    cuda_impl *im = b ? IMPL(b) : NULL;
    const char *name = im && im->cudaGetErrorName ? im->cudaGetErrorName(code) : NULL;
    const char *text = im && im->cudaGetErrorString ? im->cudaGetErrorString(code) : NULL;

    if (!buf || len == 0)
        return;
    if (own) {
        ap_errf(buf, len, "%s (code %d)", own, code);
        return;
    }
    ap_errf(buf, len, "cudaError %d", code);
    if (name)
        ap_appendf(buf, len, " (%s)", name);
    if (text)
        ap_appendf(buf, len, ": %s", text);
}

/* The runtime's unversioned development link first (what a CUDA toolkit install provides), then
   the sonames of the CUDA 12, 13 and 11 runtimes (what pip wheels and driver-only images have). */
static void *cuda_load(const char *path, char *found, size_t foundlen, char *err, size_t errlen)
{
    static const char *const names[] = {"libcudart.so", "libcudart.so.12", "libcudart.so.13",
                                        "libcudart.so.11.0"};
    size_t i, n = path ? 1 : sizeof names / sizeof names[0];

    ap_errf(err, errlen, "could not load the CUDA runtime (no CUDA installed?); tried:");
    for (i = 0; i < n; i++) {
        const char *name = path ? path : names[i];
        void *lib = dlopen(name, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
        if (lib) {
            snprintf(found, foundlen, "%s", name);
            return lib;
        }
        ap_append_dlerror(err, errlen, name);
    }
    return NULL;
}

static int cuda_resolve_all(cuda_impl *im, void *lib, char *err, size_t errlen)
{
    int missing = 0;

#define RESOLVE(sym) (im->sym = (__typeof__(im->sym))ap_resolve(lib, &im->base, #sym))
#define REQUIRE(sym)                                      \
    do {                                                  \
        if (!RESOLVE(sym)) {                              \
            ap_appendf(err, errlen, " %s", #sym);         \
            missing++;                                    \
        }                                                 \
    } while (0)

    ap_errf(err, errlen, "missing required CUDA runtime symbol(s):");
    REQUIRE(cudaSetDevice);
    REQUIRE(cudaGetDeviceCount);
    REQUIRE(cudaMalloc);
    REQUIRE(cudaFree);
    REQUIRE(cudaMemGetInfo);
    REQUIRE(cudaEventCreateWithFlags);
    REQUIRE(cudaEventRecord);
    REQUIRE(cudaEventQuery);
    REQUIRE(cudaEventSynchronize);
    REQUIRE(cudaEventDestroy);
    REQUIRE(cudaStreamWaitEvent);
    REQUIRE(cudaStreamCreate);
    REQUIRE(cudaStreamQuery);
    REQUIRE(cudaStreamSynchronize);
    REQUIRE(cudaStreamDestroy);
    REQUIRE(cudaGetErrorString);
    RESOLVE(cudaGetErrorName);
#undef REQUIRE
#undef RESOLVE
    return missing;
}

int ap_cuda_open(ap_backend *b, const char *path, char *err, size_t errlen)
{
    char found[sizeof b->path] = "";
    char why[512];
    cuda_impl *im;
    int count = 0;
    cudaError_t rc;
    Dl_info info;

    b->kind = AP_BACKEND_CUDA;
    b->lib = cuda_load(path, found, sizeof found, err, errlen);
    if (!b->lib)
        return AP_ERR_NOT_LOADED;
    im = calloc(1, sizeof *im);
    if (!im) {
        ap_errf(err, errlen, "out of host memory opening %s", found);
        return AP_ERR_NOT_LOADED;
    }
    b->impl = im;
    im->base.id = ap_next_backend_id();
    if (cuda_resolve_all(im, b->lib, why, sizeof why) > 0) {
        ap_errf(err, errlen, "%s is not a usable CUDA runtime: %s", found, why);
        return AP_ERR_MISSING_SYMBOL;
    }
    if (dladdr((void *)im->cudaMalloc, &info) && info.dli_fname && info.dli_fname[0] == '/')
        snprintf(b->path, sizeof b->path, "%s", info.dli_fname);
    else
        snprintf(b->path, sizeof b->path, "%s", found);

    b->device_size = cuda_device_size;
    b->set_device = cuda_set_device;
    b->malloc = cuda_malloc;
    b->free = cuda_free;
    b->mem_info = cuda_mem_info;
    b->event_create = cuda_event_create;
    b->event_record = cuda_event_record;
    b->event_query = cuda_event_query;
    b->event_sync = cuda_event_sync;
    b->event_destroy = cuda_event_destroy;
    b->stream_wait_event = cuda_stream_wait_event;
    b->stream_create = cuda_stream_create;
    b->stream_sync = cuda_stream_sync;
    b->stream_destroy = cuda_stream_destroy;
    b->error_message = cuda_error_message;
    b->host_malloc = cuda_host_malloc;
    b->host_free = cuda_host_free;

    /* Without a driver the runtime loads fine and fails here (cudaErrorInsufficientDriver 35 or
       cudaErrorNoDevice 100): report that as "no device", with the runtime's own words. */
    rc = im->cudaGetDeviceCount(&count);
    if (rc != 0 || count <= 0) {
        if (rc != 0)
            cuda_error_message(b, rc, why, sizeof why);
        else
            snprintf(why, sizeof why, "0 devices");
        ap_errf(err, errlen, "%s loaded but no CUDA device is usable (cudaGetDeviceCount: %s)",
                b->path, why);
        return AP_ERR_NO_DEVICE;
    }
    b->device_count = count;
    return 0;
}

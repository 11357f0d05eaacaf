/* The acl backend: the ACL runtime (libascendcl.so) loaded with dlopen() and resolved with dlsym().
 *
 * The simulator ships its own libascendcl.so with the same symbols and codes, and is loaded by
 * exactly this code (kind "sim" only changes where the library comes from). Nothing here links
 * against CANN at build time, so one build of ascend_pool runs on machines with and without it.
 *
 * Enum values and codes below are from CANN's public acl_rt.h / acl_base_rt.h / rt_error_codes.h.
 */
#include "backend_impl.h"
#include "stream_notes.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int aclError;

#define ACL_ERROR_UNINITIALIZE 100001 /* aclFinalize was called (or aclInit never) */
#define ACL_ERROR_REPEAT_INITIALIZE 100002
#define ACL_ERROR_RT_STREAM_SYNC_TIMEOUT 507046
#define ACL_ERROR_RT_EVENT_SYNC_TIMEOUT 507047
#define ACL_ERROR_RT_STREAM_CONTEXT 107003 /* "stream not in current context" */
#define ACL_ERROR_RT_PARAM_INVALID 107000  /* a handle the runtime does not know (destroyed, garbage) */
#define ACL_ERROR_RT_INVALID_HANDLE 107017
#define ACL_MEM_MALLOC_HUGE_FIRST 0 /* aclrtMemMallocPolicy: 2 MiB pages above 1 MiB */
#define ACL_HBM_MEM 1               /* aclrtMemAttr */
/* Cross-stream sync capability, no timestamps. CANN documents that an event created without
   ACL_EVENT_SYNC must not be passed to aclrtStreamWaitEvent, which the pool does; TIME_LINE would
   only slow every record down. */
#define ACL_EVENT_SYNC 0x1u
#define ACL_ERROR_RT_FEATURE_NOT_SUPPORT 207000
#define ACL_EVENT_RECORDED_STATUS_COMPLETE 1 /* aclrtQueryEventStatus: NOT_READY=0, COMPLETE=1 */
#define ACL_EVENT_STATUS_COMPLETE 0          /* deprecated aclrtQueryEvent: COMPLETE=0, NOT_READY=1 */
/* Virtual memory (acl_rt.h): physical memory on the device's HBM in 2 MiB huge pages. */
#define ACL_HBM_MEM_HUGE 4                   /* aclrtMemAttr */
#define ACL_RESERVE_FLAG_HUGE 1              /* aclrtReserveMemAddress flags: huge pages */
#define ACL_MEM_HANDLE_TYPE_NONE 0
#define ACL_MEM_ALLOCATION_TYPE_PINNED 0
#define ACL_MEM_LOCATION_TYPE_DEVICE 1
#define ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM 0
/* IPC (acl_rt.h): the key buffer holds 64 characters and NUL; export flags. */
#define ACL_IPC_KEY_LEN 65
#define ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT 0x0UL
#define ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION 0x1UL
#define ACL_RT_IPC_MEM_IMPORT_FLAG_DEFAULT 0x0UL
#define ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS 0x1UL /* as torch_npu imports */

typedef struct acl_mem_location {
    uint32_t id;
    int type;                                /* aclrtMemLocationType */
} acl_mem_location;

typedef struct acl_physical_mem_prop {       /* aclrtPhysicalMemProp, field for field */
    int handleType;                          /* aclrtMemHandleType */
    int allocationType;                      /* aclrtMemAllocationType */
    int memAttr;                             /* aclrtMemAttr */
    acl_mem_location location;
    uint64_t reserve;
} acl_physical_mem_prop;

struct acl_dev {
    /* Guards this entry's changes (reads of ctx are atomic); held over aclrtSetDevice and
       aclrtResetDevice, so references and ctx change together. The last aclrtResetDevice waits
       for the default context's queued work (CANN), so the lock is per device: a device being
       released stalls only its own retains, never another device's pools or calls. */
    pthread_mutex_t lock;
    void *ctx;          /* the device's default context while we hold a reference (atomic), else NULL */
    int pool_refs;      /* aclrtSetDevice calls made for pools (device_retain), not yet reset */
    int temp_refs;      /* references held for the length of one call made outside any pool */
    /* References of streams this backend made whose notes went (the stream found destroyed
       behind the backend's back, its handle perhaps given to another stream): counted here,
       atomically, wherever the note is dropped (under a pool lock too), and given back
       (acl_release_orphans: this lock, aclrtResetDevice) only where no pool lock is held and no
       device scope is entered: acl_stream_create, acl_stream_destroy, acl_device_release. */
    int orphan_refs;
    /* The runtime's life on this device (backend.h life; atomic): bumped when a call finds the
       runtime finalised, or the default context renewed behind the pools (acl_runtime_lost). */
    uint64_t life;
};

/* ACL cannot tell a stream's context, and runs a stream's calls only in it (107003 elsewhere):
   someone else's stream is remembered with the context a call on it last succeeded in, so that a
   thread of another context (the pool settling that stream's blocks for its own allocation) can
   ask it there instead of being refused. */
#define ACL_LEARNED_STREAMS 256
struct acl_stream_ctx {
    void *stream;  /* NULL: a free entry */
    void *ctx;
    int device;    /* the context's device */
    uint64_t used; /* learned_clock at the last use: the least recently used entry goes first */
};

typedef struct acl_impl {
    ap_impl_base base; /* must stay first */
    aclError (*aclInit)(const char *config_path);
    aclError (*aclrtSetDevice)(int32_t device);
    aclError (*aclrtResetDevice)(int32_t device);
    aclError (*aclrtGetCurrentContext)(void **context);
    aclError (*aclrtSetCurrentContext)(void *context);
    aclError (*aclrtGetDevice)(int32_t *device);
    aclError (*aclrtGetDeviceCount)(uint32_t *count);
    const char *(*aclrtGetSocName)(void);
    aclError (*aclrtMalloc)(void **ptr, size_t size, int policy);
    aclError (*aclrtMallocAlign32)(void **ptr, size_t size, int policy);
    aclError (*aclrtFree)(void *ptr);
    aclError (*aclrtGetMemInfo)(int attr, size_t *free_bytes, size_t *total_bytes);
    aclError (*aclrtCreateEventWithFlag)(void **event, uint32_t flag);
    aclError (*aclrtCreateEvent)(void **event);
    /* CANN 8.0.RC1 on: events whose waits wait for their latest record (a fresh hardware id at
       each record), so no aclrtResetEvent after a wait (docs/cann-rules-events.md). Used while
       event_ex is 1 (atomic); a runtime that refuses it (207000) clears it once, for good. */
    aclError (*aclrtCreateEventExWithFlag)(void **event, uint32_t flag);
    int event_ex;
    aclError (*aclrtRecordEvent)(void *event, void *stream);
    aclError (*aclrtQueryEventStatus)(void *event, int *status);
    aclError (*aclrtQueryEvent)(void *event, int *status);
    aclError (*aclrtSynchronizeEvent)(void *event);
    aclError (*aclrtSynchronizeEventWithTimeout)(void *event, int32_t timeout_ms);
    aclError (*aclrtDestroyEvent)(void *event);
    aclError (*aclrtStreamWaitEvent)(void *stream, void *event);
    aclError (*aclrtResetEvent)(void *event, void *stream);
    aclError (*aclrtCreateStream)(void **stream);
    aclError (*aclrtSynchronizeStream)(void *stream);
    aclError (*aclrtSynchronizeStreamWithTimeout)(void *stream, int32_t timeout_ms);
    aclError (*aclrtSynchronizeDevice)(void);
    aclError (*aclrtSynchronizeDeviceWithTimeout)(int32_t timeout_ms);
    aclError (*aclrtDestroyStream)(void *stream);
    const char *(*aclGetRecentErrMsg)(void);
    /* Pinned host memory, resolved on first use (see acl_host_resolve). */
    int host_state; /* 0: not yet looked up; 1: resolved; 2: absent (atomic) */
    aclError (*aclrtMallocHost)(void **ptr, size_t size);
    aclError (*aclrtFreeHost)(void *ptr);
    /* Virtual memory: looked up at open (has_vmm), recorded in base.symbols on first use. */
    int vmm_recorded; /* atomic */
    aclError (*aclrtMemGetAllocationGranularity)(acl_physical_mem_prop *prop, int option, size_t *granularity);
    aclError (*aclrtReserveMemAddress)(void **va, size_t size, size_t alignment, void *expect, uint64_t flags);
    aclError (*aclrtReleaseMemAddress)(void *va);
    aclError (*aclrtMallocPhysical)(void **handle, size_t size, const acl_physical_mem_prop *prop, uint64_t flags);
    aclError (*aclrtFreePhysical)(void *handle);
    aclError (*aclrtMapMem)(void *va, size_t size, size_t offset, void *handle, uint64_t flags);
    aclError (*aclrtUnmapMem)(void *va);
    /* Sharing between processes: looked up at open (has_ipc), recorded on first use. */
    int ipc_recorded; /* atomic */
    aclError (*aclrtIpcMemGetExportKey)(void *devPtr, size_t size, char *key, size_t len, uint64_t flags);
    aclError (*aclrtIpcMemSetImportPid)(const char *key, int32_t *pid, size_t num);
    aclError (*aclrtIpcMemImportByKey)(void **devPtr, const char *key, uint64_t flags);
    aclError (*aclrtIpcMemClose)(const char *key);
    uint64_t ipc_read_only_flag; /* the simulator's read-only export bit; 0 on CANN */
    /* Devices: the context each device's calls run in, and the references this backend holds. */
    struct acl_dev *dev;         /* device_count entries */
    int finalized;               /* a call answered ACL_ERROR_UNINITIALIZE, and none has set a device since (atomic) */
    size_t malloc_pad;           /* aclrtMalloc's padding on this SoC: 32, or 0 (Ascend 950) */
    /* Streams this backend created, with their device (the pool refuses another device's), and
       the context someone else's stream was last used in successfully (learned; see
       acl_enter_stream). Under streams_lock: no runtime call is made while it is held. */
    pthread_mutex_t streams_lock;
    acl_stream_notes streams; /* by handle (stream_notes.h) */
    uint64_t streams_serial; /* the last note's serial */
    int streams_suspect;     /* some note may be suspect (atomic hint; cleared by acl_check_suspects) */
    struct acl_stream_ctx learned[ACL_LEARNED_STREAMS];
    uint64_t learned_clock;
    aclError (*sim_stream_device)(void *stream, int32_t *device); /* simulator only: probed */
    aclError (*aclrtDeviceGetBareTgid)(int32_t *pid); /* optional: NULL on an old CANN */
    aclError (*aclFinalizeReference)(uint64_t *count); /* optional: NULL before CANN counted aclInit */
    aclError (*aclrtGetPhyDevIdByLogicDevId)(int32_t logic, int32_t *phys); /* optional likewise */
} acl_impl;

#define IMPL(b) ((acl_impl *)(b)->impl)

/* ---- device ------------------------------------------------------------------------------- */

/* ACL's current device and context are per thread, and a framework in the same process switches
   them itself (torch_npu's aclrtSetDevice on each of its threads). So the pool never leaves a
   caller's thread elsewhere and never trusts a cached "current device": each call on a device
   asks the runtime for the thread's context, switches with aclrtSetCurrentContext (which adds no
   device reference, unlike aclrtSetDevice) only when it differs, and switches back after.
   The device's default context comes from one aclrtSetDevice per pool (device_retain), paired
   with one aclrtResetDevice at the pool's close (device_release): CANN counts these references
   per process and releases the device when they reach 0. A thread that had no context at all
   is left in the device's context (there is nothing to restore; ACL has no "no context").
   Calls without a device argument (events, streams) run in the context of the device the
   calling thread last named with set_device for this backend. */
static __thread uint64_t tls_owner;
static __thread int tls_device;

/* 1 when the calling thread is in a context (*cur), else 0; a thread without one is normal here,
   so the runtime's "no context" message is cleared rather than left as this thread's error. */
static int acl_thread_context(acl_impl *im, void **cur)
{
    *cur = NULL;
    if (im->aclrtGetCurrentContext(cur) == 0 && *cur)
        return 1;
    if (im->aclGetRecentErrMsg)
        (void)im->aclGetRecentErrMsg();
    return 0;
}

/* Takes one runtime reference on `device` and records its default context. dev[device].lock held. */
static int acl_take_ref_locked(acl_impl *im, int device)
{
    void *cur = NULL, *ctx = NULL;
    int had = acl_thread_context(im, &cur);
    aclError rc;

    rc = im->aclrtSetDevice(device);
    if (rc != 0)
        return rc;
    __atomic_store_n(&im->finalized, 0, __ATOMIC_RELEASE); /* initialised (again) */
    rc = im->aclrtGetCurrentContext(&ctx);
    if (had && cur != ctx)
        (void)im->aclrtSetCurrentContext(cur);
    if (rc != 0) {
        (void)im->aclrtResetDevice(device);
        return rc;
    }
    /* A context recorded while holders remain, and now another: it was released behind them
       (aclFinalize then aclInit, a forced reset). A new pool's reference (a host pool's first,
       or a stream's) taking the new one first must not hide that from the pools of the old one:
       the runtime's life moves on, as acl_renew_context moves it. */
    void *prev = im->dev[device].ctx;
    if (prev && prev != ctx && im->dev[device].pool_refs + im->dev[device].temp_refs > 0)
        __atomic_add_fetch(&im->dev[device].life, 1, __ATOMIC_ACQ_REL);
    __atomic_store_n(&im->dev[device].ctx, ctx, __ATOMIC_RELEASE);
    return 0;
}

/* Gives one runtime reference back, leaving the calling thread in the context it was in (when
   that context still exists). dev[device].lock held. */
static int acl_drop_ref_locked(acl_impl *im, int device)
{
    void *cur = NULL, *after = NULL;
    int had = acl_thread_context(im, &cur);
    aclError rc;

    /* A thread in the device's own context loses it with the last reference, as with any
       aclrtResetDevice: nothing to restore then (and a failed restore would overwrite the
       message of the call that failed before it). */
    if (had && cur == im->dev[device].ctx)
        had = 0;
    rc = im->aclrtResetDevice(device);
    if (had && (im->aclrtGetCurrentContext(&after) != 0 || after != cur))
        (void)im->aclrtSetCurrentContext(cur);
    return rc;
}

/* 0 for a device of this runtime; else the runtime's own refusal (its code and message). */
static int acl_check_device(ap_backend *b, int device)
{
    acl_impl *im = IMPL(b);
    aclError rc;

    if (device >= 0 && device < b->device_count)
        return 0;
    rc = im->aclrtSetDevice(device);
    if (rc == 0) { /* a device the runtime did not report at open: refuse it all the same */
        (void)im->aclrtResetDevice(device);
        rc = 107001; /* ACL_ERROR_RT_INVALID_DEVICEID */
    }
    return rc;
}

/* The context of `device`. Outside any pool's life (no pool reference), the call holds a
   reference of its own for its length (*temp = 1: give it back with acl_ctx_put). */
static int acl_ctx_get(ap_backend *b, int device, void **ctx, int *temp)
{
    acl_impl *im = IMPL(b);
    int rc = acl_check_device(b, device);

    *temp = 0;
    if (rc != 0)
        return rc;
    *ctx = __atomic_load_n(&im->dev[device].ctx, __ATOMIC_ACQUIRE);
    /* A pool's reference keeps the context alive (a call racing the close of the device's last
       pool may still find it released: the runtime then refuses with its own code). */
    if (*ctx && __atomic_load_n(&im->dev[device].pool_refs, __ATOMIC_ACQUIRE) > 0)
        return 0;
    pthread_mutex_lock(&im->dev[device].lock);
    if (im->dev[device].pool_refs == 0 && (rc = acl_take_ref_locked(im, device)) == 0) {
        im->dev[device].temp_refs++;
        *temp = 1;
    }
    *ctx = im->dev[device].ctx;
    pthread_mutex_unlock(&im->dev[device].lock);
    return rc;
}

static void acl_ctx_put(ap_backend *b, int device, int temp)
{
    acl_impl *im = IMPL(b);

    if (!temp)
        return;
    pthread_mutex_lock(&im->dev[device].lock);
    im->dev[device].temp_refs--;
    (void)acl_drop_ref_locked(im, device);
    if (im->dev[device].pool_refs == 0 && im->dev[device].temp_refs == 0)
        __atomic_store_n(&im->dev[device].ctx, NULL, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&im->dev[device].lock);
}

/* The device's default context was released behind the pools' references (an aclrtResetDevice
   too many, or aclrtResetDeviceForce, elsewhere in the process: CANN counts references per
   process, so someone else's resets can take ours). Our references went with it: take them again
   on the device's new default context, so that the pools keep working and their resets at close
   still pair. Returns the context to use, or NULL when `stale` is in fact alive (the switch
   failed for another reason) or the device cannot be set. */
static void *acl_renew_context(acl_impl *im, int device, void *stale)
{
    void *fresh;
    int held;

    pthread_mutex_lock(&im->dev[device].lock);
    fresh = im->dev[device].ctx;
    held = im->dev[device].pool_refs + im->dev[device].temp_refs;
    if (fresh != stale || held <= 0) { /* renewed by another thread meanwhile, or nothing to renew */
        pthread_mutex_unlock(&im->dev[device].lock);
        return fresh != stale ? fresh : NULL;
    }
    if (acl_take_ref_locked(im, device) != 0) {
        pthread_mutex_unlock(&im->dev[device].lock);
        return NULL;
    }
    fresh = im->dev[device].ctx;
    if (fresh == stale) { /* alive after all: give the reference back */
        (void)acl_drop_ref_locked(im, device);
        pthread_mutex_unlock(&im->dev[device].lock);
        return NULL;
    }
    for (int i = 1; i < held; i++)
        (void)acl_take_ref_locked(im, device); /* same context: one reference per holder again */
    /* What the pools held in the released context (memory, events, streams) may be gone with it:
       certainly after aclFinalize, which a renewal after aclInit cannot be told from. The first
       take above moved the runtime's life on (a new context while holders remain). */
    pthread_mutex_unlock(&im->dev[device].lock);
    return fresh;
}

/* A call was answered ACL_ERROR_UNINITIALIZE: the runtime was finalised (aclFinalize), and with
   it every device's memory, events and streams of this process. Each device's life moves on. */
static void acl_runtime_lost(acl_impl *im, int device_count)
{
    /* once per finalisation: every call until the next aclInit answers the same */
    if (__atomic_exchange_n(&im->finalized, 1, __ATOMIC_ACQ_REL))
        return;
    for (int d = 0; d < device_count; d++)
        __atomic_add_fetch(&im->dev[d].life, 1, __ATOMIC_ACQ_REL);
}

/* The thread's context before acl_enter switched it (restored by acl_leave). */
typedef struct acl_scope {
    void *saved;
    int switched;
    int device;
    int temp;  /* a reference taken for this call only (acl_ctx_get) */
    int kept;  /* acl_enter_stream kept the caller's context for someone else's stream */
    int learned; /* acl_enter_stream used the context that stream was learned in */
    int created; /* acl_enter_stream took the stream for one this backend created */
    uint64_t serial; /* created: the serial of its note */
    void *ctx; /* kept: the caller's context (learned for the stream when the call succeeds) */
} acl_scope;

static int acl_enter(ap_backend *b, int device, acl_scope *sc)
{
    acl_impl *im = IMPL(b);
    void *ctx, *cur = NULL;
    int rc;

    sc->saved = NULL;
    sc->switched = 0;
    sc->kept = 0;
    sc->learned = 0;
    sc->created = 0;
    sc->serial = 0;
    sc->ctx = NULL;
    sc->device = device;
    rc = acl_ctx_get(b, device, &ctx, &sc->temp);
    if (rc != 0)
        return rc;
    (void)acl_thread_context(im, &cur);
    if (cur == ctx)
        return 0;
    rc = im->aclrtSetCurrentContext(ctx);
    if (rc != 0 && !sc->temp) { /* a pool's context, perhaps released behind its reference */
        void *fresh = acl_renew_context(im, device, ctx);
        if (fresh && (fresh == cur || im->aclrtSetCurrentContext(fresh) == 0))
            rc = 0, ctx = fresh;
    }
    if (rc != 0) {
        acl_ctx_put(b, device, sc->temp);
        return rc;
    }
    if (ctx == cur)
        return 0;
    sc->saved = cur;
    sc->switched = 1;
    return 0;
}

static void acl_leave(ap_backend *b, acl_scope *sc)
{
    if (sc->switched && sc->saved)
        (void)IMPL(b)->aclrtSetCurrentContext(sc->saved);
    acl_ctx_put(b, sc->device, sc->temp);
}

static uint64_t acl_life(ap_backend *b, int device, int probe)
{
    acl_impl *im = IMPL(b);
    acl_scope sc;
    int rc;

    if (device < 0 || device >= b->device_count || !im->dev)
        return 0;
    /* Entering finds a context released behind the pools (renewed: a new life) or a finalised
       runtime (ACL_ERROR_UNINITIALIZE). Only where a pool holds the device: no reference is
       taken for it. */
    if (probe && __atomic_load_n(&im->dev[device].pool_refs, __ATOMIC_ACQUIRE) > 0) {
        if ((rc = acl_enter(b, device, &sc)) == 0)
            acl_leave(b, &sc);
        else if (rc == ACL_ERROR_UNINITIALIZE)
            acl_runtime_lost(im, b->device_count);
        if (rc != 0 && im->aclGetRecentErrMsg)
            (void)im->aclGetRecentErrMsg(); /* asked here: not the caller's error */
    }
    return __atomic_load_n(&im->dev[device].life, __ATOMIC_ACQUIRE);
}

/* For the calls without a device argument: the device this thread named last, if any. */
static int acl_enter_selected(ap_backend *b, acl_scope *sc)
{
    sc->saved = NULL;
    sc->switched = 0;
    sc->temp = 0;
    sc->kept = 0;
    sc->learned = 0;
    sc->ctx = NULL;
    if (tls_owner != IMPL(b)->base.id)
        return 0; /* never named one: the caller's own context */
    return acl_enter(b, tls_device, sc);
}

static int acl_stream_device(ap_backend *b, void *stream, int *device);
static int acl_created_stream_device(acl_impl *im, void *stream, uint64_t *serial);

/* The context `stream` was learned in (and its device), or NULL. */
static void *acl_learned_context(acl_impl *im, void *stream, int *device)
{
    void *ctx = NULL;

    pthread_mutex_lock(&im->streams_lock);
    for (int i = 0; i < ACL_LEARNED_STREAMS && !ctx; i++)
        if (im->learned[i].stream == stream) {
            ctx = im->learned[i].ctx;
            *device = im->learned[i].device;
            im->learned[i].used = ++im->learned_clock;
        }
    pthread_mutex_unlock(&im->streams_lock);
    return ctx;
}

/* Remembers stream's context (on device), or with ctx NULL forgets it (a stream destroyed, a
   handle the runtime reused, a context gone). Full: the least recently used entry makes room. */
static void acl_learn_context(acl_impl *im, void *stream, void *ctx, int device)
{
    int at = -1, free_at = -1, oldest = 0;

    pthread_mutex_lock(&im->streams_lock);
    for (int i = 0; i < ACL_LEARNED_STREAMS; i++) {
        if (im->learned[i].stream == stream)
            at = i;
        else if (!im->learned[i].stream && free_at < 0)
            free_at = i;
        if (im->learned[i].used < im->learned[oldest].used)
            oldest = i;
    }
    if (!ctx) {
        if (at >= 0)
            im->learned[at] = (struct acl_stream_ctx){0};
    } else {
        if (at < 0)
            at = free_at >= 0 ? free_at : oldest;
        im->learned[at] = (struct acl_stream_ctx){stream, ctx, device, ++im->learned_clock};
    }
    pthread_mutex_unlock(&im->streams_lock);
}

/* 1 when the calling thread's current context is on `device` (whichever context of it). */
static int acl_thread_on_device(acl_impl *im, int device)
{
    void *cur;
    int32_t dev = -1;

    if (!acl_thread_context(im, &cur))
        return 0;
    if (im->aclrtGetDevice(&dev) != 0) {
        if (im->aclGetRecentErrMsg)
            (void)im->aclGetRecentErrMsg();
        return 0;
    }
    return dev == device;
}

/* For calls on a stream. CANN runs a stream's calls (record, wait, reset, destroy) only in the
   context the stream belongs to (107003 otherwise), and the NULL stream is the current context's
   default stream. A stream this backend created belongs to its device's default context: that
   one. Someone else's stream (a framework's, perhaps of a context it created) is used from the
   framework's threads, whose current context is the stream's: when the calling thread's context
   is on the call's device (the stream's, or the one this thread named last) it is kept; else the
   device's default context, else as acl_enter_selected. */
static int acl_enter_stream(ap_backend *b, void *stream, acl_scope *sc)
{
    acl_impl *im = IMPL(b);
    uint64_t serial = 0;
    int dev = stream ? acl_created_stream_device(im, stream, &serial) : -1, learned_dev = -1;
    void *learned = dev < 0 && stream ? acl_learned_context(im, stream, &learned_dev) : NULL;

    if (dev >= 0) {
        int rc = acl_enter(b, dev, sc);
        sc->created = 1;
        sc->serial = serial;
        return rc;
    }
    sc->learned = 0;
    sc->created = 0;
    sc->ctx = NULL;
    if (learned) { /* a stream of a context other threads are in: its calls there */
        void *cur = NULL;
        (void)acl_thread_context(im, &cur);
        sc->saved = NULL;
        sc->switched = 0;
        sc->temp = 0;
        sc->kept = 0;
        sc->device = -1;
        if (cur == learned || im->aclrtSetCurrentContext(learned) == 0) {
            sc->learned = 1;
            sc->switched = cur != learned;
            /* A thread that had no context goes back to the device's default one, as after any
               call here (acl_enter), never stays in another thread's own context. */
            sc->saved = cur == learned ? NULL
                        : cur             ? cur
                        : learned_dev >= 0 ? __atomic_load_n(&im->dev[learned_dev].ctx, __ATOMIC_ACQUIRE)
                                           : NULL;
            return 0;
        }
        if (im->aclGetRecentErrMsg)
            (void)im->aclGetRecentErrMsg(); /* that context is gone: forget it */
        acl_learn_context(im, stream, NULL, -1);
    }
    if (!(stream && acl_stream_device(b, stream, &dev) == 0))
        dev = tls_owner == im->base.id ? tls_device : -1;
    if (dev >= 0 && !acl_thread_on_device(im, dev))
        return acl_enter(b, dev, sc);
    sc->saved = NULL; /* the caller's own context */
    sc->switched = 0;
    sc->temp = 0;
    sc->kept = dev >= 0;
    sc->device = dev;
    if (sc->kept && stream)
        (void)acl_thread_context(im, &sc->ctx);
    return 0;
}

/* Runs `expr` between entering a context (`enter`, which fills sc_) and leaving it, and returns
   its code; the caller's context is restored whatever expr returned. */
#define IN_SCOPE(b, enter, expr)                                \
    do {                                                        \
        acl_scope sc_;                                          \
        int rc_ = (enter);                                      \
        if (rc_ == 0) {                                         \
            rc_ = (expr);                                       \
            acl_leave((b), &sc_);                               \
        }                                                       \
        if (rc_ == ACL_ERROR_UNINITIALIZE)                      \
            acl_runtime_lost(IMPL(b), (b)->device_count);       \
        return rc_;                                             \
    } while (0)

static void acl_streams_drop(acl_impl *im, void *stream, uint64_t serial);
static void acl_streams_suspect(acl_impl *im, void *stream, uint64_t serial);

/* For a stream call: in the context the stream was learned in, if any (when the runtime refuses
   it there, the stream is forgotten and the call made as for an unknown one); a stream this
   backend created that the runtime says is not in its device's default context is no longer
   ours (destroyed behind the backend's back, its handle given to a stream of another context:
   CANN's handles are heap pointers), so its note goes (its device reference is given back later,
   acl_release_orphans: a pool lock may be held here) and the call is made as for someone
   else's; when the caller's
   context was kept for someone else's stream and the call succeeded, that context is learned for
   it; when the runtime says the stream is not in it (a stream of the device's default context
   used from a thread in a context of its own), once more in the device's default context. */
/* ON_STREAM's second try, after it dropped what sent the first one to the wrong context (the
   first try's runtime message is read away: it is not this call's error). */
#define ON_STREAM_AGAIN(b, stream, expr)                                           \
    do {                                                                           \
        if (IMPL(b)->aclGetRecentErrMsg)                                           \
            (void)IMPL(b)->aclGetRecentErrMsg();                                   \
        rc_ = acl_enter_stream((b), (stream), &sc_);                               \
        if (rc_ == 0) {                                                            \
            rc_ = (expr);                                                          \
            acl_leave((b), &sc_);                                                  \
        }                                                                          \
    } while (0)

#define ON_STREAM(b, stream, expr)                                                 \
    do {                                                                           \
        acl_scope sc_;                                                             \
        int rc_ = acl_enter_stream((b), (stream), &sc_);                           \
        if (rc_ == 0) {                                                            \
            rc_ = (expr);                                                          \
            acl_leave((b), &sc_);                                                  \
            if (rc_ == ACL_ERROR_RT_STREAM_CONTEXT && sc_.learned) {               \
                acl_learn_context(IMPL(b), (stream), NULL, -1);                    \
                ON_STREAM_AGAIN(b, stream, expr);                                  \
            }                                                                      \
            if (rc_ == ACL_ERROR_RT_STREAM_CONTEXT && sc_.created) {               \
                acl_streams_drop(IMPL(b), (stream), sc_.serial);                   \
                ON_STREAM_AGAIN(b, stream, expr);                                  \
            }                                                                      \
            if (rc_ == 0 && sc_.kept && sc_.ctx)                                   \
                acl_learn_context(IMPL(b), (stream), sc_.ctx, sc_.device);         \
            else if (rc_ == ACL_ERROR_RT_PARAM_INVALID ||                          \
                     rc_ == ACL_ERROR_RT_INVALID_HANDLE) {                         \
                acl_learn_context(IMPL(b), (stream), NULL, -1); /* gone */        \
                if (sc_.created) /* ours, destroyed behind our back? asked later */ \
                    acl_streams_suspect(IMPL(b), (stream), sc_.serial);            \
            }                                                                      \
            if (rc_ == ACL_ERROR_RT_STREAM_CONTEXT && sc_.kept &&                  \
                acl_enter((b), sc_.device, &sc_) == 0) {                           \
                if (IMPL(b)->aclGetRecentErrMsg)                                   \
                    (void)IMPL(b)->aclGetRecentErrMsg(); /* the first try's */     \
                rc_ = (expr);                                                      \
                acl_leave((b), &sc_);                                              \
            }                                                                      \
        }                                                                          \
        if (rc_ == ACL_ERROR_UNINITIALIZE)                                         \
            acl_runtime_lost(IMPL(b), (b)->device_count);                          \
        return rc_;                                                                \
    } while (0)

/* Names the device whose context this thread's device-less calls use; no runtime state changes. */
static int acl_set_device(ap_backend *b, int device)
{
    int rc = acl_check_device(b, device);

    if (rc != 0)
        return rc;
    tls_owner = IMPL(b)->base.id;
    tls_device = device;
    return 0;
}

static int acl_device_retain(ap_backend *b, int device)
{
    acl_impl *im = IMPL(b);
    int rc = acl_check_device(b, device);

    if (rc != 0)
        return rc;
    pthread_mutex_lock(&im->dev[device].lock);
    rc = acl_take_ref_locked(im, device);
    if (rc == 0)
        __atomic_store_n(&im->dev[device].pool_refs, im->dev[device].pool_refs + 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&im->dev[device].lock);
    return rc;
}

/* Gives back one reference taken with acl_device_retain (a pool's, or a stream's). */
static int acl_device_unref(ap_backend *b, int device)
{
    acl_impl *im = IMPL(b);
    int rc = acl_check_device(b, device);

    if (rc != 0)
        return rc;
    pthread_mutex_lock(&im->dev[device].lock);
    if (im->dev[device].pool_refs > 0) {
        __atomic_store_n(&im->dev[device].pool_refs, im->dev[device].pool_refs - 1, __ATOMIC_RELEASE);
        rc = acl_drop_ref_locked(im, device);
        /* Our last reference gone: the runtime may release the context; fetch it anew next time. */
        if (im->dev[device].pool_refs == 0 && im->dev[device].temp_refs == 0)
            __atomic_store_n(&im->dev[device].ctx, NULL, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&im->dev[device].lock);
    return rc;
}

/* Wraps a call of the runtime in the device's context: `expr` is evaluated between enter and
   leave, and its code returned. */
#define ON_DEVICE(b, device, expr) IN_SCOPE((b), acl_enter((b), (device), &sc_), expr)

#define ON_SELECTED(b, expr) IN_SCOPE((b), acl_enter_selected((b), &sc_), expr)

/* ---- memory -------------------------------------------------------------------------------- */

/* An Ascend 950PR/950DT by the name aclrtGetSocName gives it: "Ascend950PR_9599" in current CANN,
   "Ascend910_95xx" in the versions that named it after the 910 (HCCL's SOC_VER_CONVERT maps
   Ascend910_9591, _9599, _9589, _958a, _958b, _957b, _957d and _950z to DEV_TYPE_950). */
static int acl_soc_is_950(const char *soc)
{
    return strncmp(soc, "Ascend950", 9) == 0 || strncmp(soc, "Ascend910_95", 12) == 0;
}

#define ACL_HUGE_PAGE ((size_t)2 << 20)

/* The size given to aclrtMalloc, the fallback without aclrtMallocAlign32, for `size` bytes: it
   pads 32 bytes after rounding (malloc_pad), and huge pages are taken whole (ACL_HBM_MEM_HUGE's
   granularity is 2 MiB), so aclrtMalloc(2 MiB) would take 4 MiB of the device. For a whole number
   of pages (the pool's segments) it is asked 32 bytes less: padded, that is `size` exactly, and
   the whole range is ours (the padding is part of the allocation, as with aclrtMallocAlign32 no
   byte past the segment is mapped either way). */
static size_t acl_fallback_ask(const ap_backend *b, size_t size)
{
    size_t pad = IMPL(b)->malloc_pad;

    return pad && size > pad && size % ACL_HUGE_PAGE == 0 ? size - pad : size;
}

/* The bytes asked of the runtime, padding included (the pool's segments, whole pages, take
   exactly that; the huge pages of other sizes above 1 MiB are not counted: the bench's direct
   figures stay what they were). */
static size_t acl_device_size(const ap_backend *b, size_t size)
{
    if (size == 0)
        return 0;
    if (size > SIZE_MAX - 64)
        return SIZE_MAX;
    /* aclrtMalloc adds 32 bytes of padding after rounding, except on Ascend 950 (malloc_pad);
       aclrtMallocAlign32 does not. */
    if (!b->has_malloc_align32)
        return ((acl_fallback_ask(b, size) + 31) & ~(size_t)31) + IMPL(b)->malloc_pad;
    return (size + 31) & ~(size_t)31;
}

static int acl_malloc(ap_backend *b, int device, void **ptr, size_t size)
{
    acl_impl *im = IMPL(b);

    if (im->aclrtMallocAlign32)
        ON_DEVICE(b, device, im->aclrtMallocAlign32(ptr, size, ACL_MEM_MALLOC_HUGE_FIRST));
    ON_DEVICE(b, device, im->aclrtMalloc(ptr, acl_fallback_ask(b, size), ACL_MEM_MALLOC_HUGE_FIRST));
}

/* The runtime frees in the current device's context. */
static int acl_free(ap_backend *b, int device, void *ptr)
{
    ON_DEVICE(b, device, IMPL(b)->aclrtFree(ptr));
}

static int acl_mem_info_here(ap_backend *b, int device, size_t *free_bytes, size_t *total_bytes)
{
    ON_DEVICE(b, device, IMPL(b)->aclrtGetMemInfo(ACL_HBM_MEM, free_bytes, total_bytes));
}

struct acl_mem_info_job {
    ap_backend *b;
    int device;
    size_t *free_bytes, *total_bytes;
    int rc;
};

static void *acl_mem_info_job_run(void *arg)
{
    struct acl_mem_info_job *j = arg;

    /* As any call here (acl_enter: the device's context, renewed if it was released behind the
       pools); this thread ends with it. */
    j->rc = acl_mem_info_here(j->b, j->device, j->free_bytes, j->total_bytes);
    if (j->rc != 0 && IMPL(j->b)->aclGetRecentErrMsg)
        (void)IMPL(j->b)->aclGetRecentErrMsg();
    return NULL;
}

/* A thread in no context (one that never chose a device: a monitoring thread reading a pool's
   stats) is asked for from a short-lived helper thread, so that it stays without a device: ACL
   cannot unbind a thread again, and torch_npu takes a thread's device from the runtime when it
   has none of its own (that thread's next tensor went to the pool's device). Only where a pool
   holds the device (no reference to take for the call); stats are not a hot path. */
static int acl_mem_info(ap_backend *b, int device, size_t *free_bytes, size_t *total_bytes)
{
    acl_impl *im = IMPL(b);
    void *cur = NULL;

    if (acl_check_device(b, device) == 0 && !acl_thread_context(im, &cur) &&
        __atomic_load_n(&im->dev[device].pool_refs, __ATOMIC_ACQUIRE) > 0) {
        struct acl_mem_info_job j = {b, device, free_bytes, total_bytes, 0};
        pthread_t t;
        if (pthread_create(&t, NULL, acl_mem_info_job_run, &j) == 0) {
            pthread_join(t, NULL);
            return j.rc;
        }
    }
    return acl_mem_info_here(b, device, free_bytes, total_bytes);
}

/* ---- pinned host memory -------------------------------------------------------------------- */

/* Resolved on first use rather than at open: most processes never pin host memory, and
   resolved_symbols should list only the entry points in use. One lock for all backends: this runs
   once per backend. */
static pthread_mutex_t host_resolve_lock = PTHREAD_MUTEX_INITIALIZER;

static int acl_host_resolve(ap_backend *b)
{
    acl_impl *im = IMPL(b);
    int state = __atomic_load_n(&im->host_state, __ATOMIC_ACQUIRE);

    if (state == 0) {
        pthread_mutex_lock(&host_resolve_lock);
        state = im->host_state;
        if (state == 0) {
            im->aclrtMallocHost = (__typeof__(im->aclrtMallocHost))ap_resolve(b->lib, &im->base, "aclrtMallocHost");
            im->aclrtFreeHost = (__typeof__(im->aclrtFreeHost))ap_resolve(b->lib, &im->base, "aclrtFreeHost");
            state = im->aclrtMallocHost && im->aclrtFreeHost ? 1 : 2;
            __atomic_store_n(&im->host_state, state, __ATOMIC_RELEASE);
        }
        pthread_mutex_unlock(&host_resolve_lock);
    }
    return state == 1 ? 0 : AP_ERR_MISSING_SYMBOL;
}

/* aclrtMallocHost needs a current context (CANN: after aclrtSetDevice or aclrtCreateContext). */
static int acl_host_malloc(ap_backend *b, int device, void **ptr, size_t size)
{
    int rc = acl_host_resolve(b);

    if (rc != 0)
        return rc;
    ON_DEVICE(b, device, IMPL(b)->aclrtMallocHost(ptr, size));
}

static int acl_host_free(ap_backend *b, int device, void *ptr)
{
    int rc = acl_host_resolve(b);

    if (rc != 0)
        return rc;
    ON_DEVICE(b, device, IMPL(b)->aclrtFreeHost(ptr));
}

/* ---- virtual memory ------------------------------------------------------------------------ */

/* The seven calls of CANN's virtual-memory API, all or none (has_vmm). Looked up at open, so that
   the pool knows before it starts whether expandable segments are possible; recorded in
   resolved_symbols when first used, like the host-memory calls, since most processes never use
   them. */
static const char *const acl_vmm_names[] = {
    "aclrtMemGetAllocationGranularity", "aclrtReserveMemAddress", "aclrtReleaseMemAddress",
    "aclrtMallocPhysical", "aclrtFreePhysical", "aclrtMapMem", "aclrtUnmapMem",
};
#define ACL_VMM_NAMES (int)(sizeof acl_vmm_names / sizeof acl_vmm_names[0])

static int acl_vmm_lookup(acl_impl *im, void *lib)
{
    void *f[ACL_VMM_NAMES];
    int i;

    for (i = 0; i < ACL_VMM_NAMES; i++)
        if (!(f[i] = dlsym(lib, acl_vmm_names[i])))
            return 0;
    im->aclrtMemGetAllocationGranularity = (__typeof__(im->aclrtMemGetAllocationGranularity))f[0];
    im->aclrtReserveMemAddress = (__typeof__(im->aclrtReserveMemAddress))f[1];
    im->aclrtReleaseMemAddress = (__typeof__(im->aclrtReleaseMemAddress))f[2];
    im->aclrtMallocPhysical = (__typeof__(im->aclrtMallocPhysical))f[3];
    im->aclrtFreePhysical = (__typeof__(im->aclrtFreePhysical))f[4];
    im->aclrtMapMem = (__typeof__(im->aclrtMapMem))f[5];
    im->aclrtUnmapMem = (__typeof__(im->aclrtUnmapMem))f[6];
    return 1;
}

static pthread_mutex_t vmm_record_lock = PTHREAD_MUTEX_INITIALIZER;

/* Records the names on first use; the calls then run in the device's context (ON_DEVICE). */
static void acl_vmm_record(ap_backend *b)
{
    acl_impl *im = IMPL(b);
    int i;

    if (!__atomic_load_n(&im->vmm_recorded, __ATOMIC_ACQUIRE)) {
        pthread_mutex_lock(&vmm_record_lock);
        if (!im->vmm_recorded) {
            for (i = 0; i < ACL_VMM_NAMES; i++)
                (void)ap_resolve(b->lib, &im->base, acl_vmm_names[i]);
            __atomic_store_n(&im->vmm_recorded, 1, __ATOMIC_RELEASE);
        }
        pthread_mutex_unlock(&vmm_record_lock);
    }
}

/* Device HBM in 2 MiB huge pages: what torch_npu's expandable segments ask for too. */
static void acl_vmm_prop(acl_physical_mem_prop *prop, int device)
{
    memset(prop, 0, sizeof *prop);
    prop->handleType = ACL_MEM_HANDLE_TYPE_NONE;
    prop->allocationType = ACL_MEM_ALLOCATION_TYPE_PINNED;
    prop->memAttr = ACL_HBM_MEM_HUGE;
    prop->location.id = (uint32_t)device;
    prop->location.type = ACL_MEM_LOCATION_TYPE_DEVICE;
}

/* MINIMUM: the granularity aclrtMapMem sizes must be multiples of. */
static int acl_vmm_granularity(ap_backend *b, int device, size_t *granularity)
{
    acl_physical_mem_prop prop;

    acl_vmm_record(b);
    acl_vmm_prop(&prop, device);
    ON_DEVICE(b, device, IMPL(b)->aclrtMemGetAllocationGranularity(
                             &prop, ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM, granularity));
}

/* alignment and expected address are reserved: 0, NULL. flags is the page type of the memory
   that will be mapped (CANN 8.0.x requires it to match: 0 normal, 1 huge pages; later versions
   accept either; torch_npu passes 1): the pool maps huge pages only (acl_vmm_prop). */
static int acl_vmm_reserve(ap_backend *b, int device, size_t size, void **va)
{
    acl_vmm_record(b);
    ON_DEVICE(b, device, IMPL(b)->aclrtReserveMemAddress(va, size, 0, NULL, ACL_RESERVE_FLAG_HUGE));
}

static int acl_vmm_release(ap_backend *b, int device, void *va, size_t size)
{
    (void)size; /* the runtime knows the reservation by its base */
    acl_vmm_record(b);
    ON_DEVICE(b, device, IMPL(b)->aclrtReleaseMemAddress(va));
}

static int acl_vmm_create(ap_backend *b, int device, size_t size, void **handle)
{
    acl_physical_mem_prop prop;

    acl_vmm_record(b);
    acl_vmm_prop(&prop, device);
    ON_DEVICE(b, device, IMPL(b)->aclrtMallocPhysical(handle, size, &prop, 0));
}

static int acl_vmm_free(ap_backend *b, int device, void *handle)
{
    acl_vmm_record(b);
    ON_DEVICE(b, device, IMPL(b)->aclrtFreePhysical(handle));
}

/* The whole handle (offset 0); mapped memory is read-write for the device at once. */
static int acl_vmm_map(ap_backend *b, int device, void *va, size_t size, void *handle)
{
    acl_vmm_record(b);
    ON_DEVICE(b, device, IMPL(b)->aclrtMapMem(va, size, 0, handle, 0));
}

static int acl_vmm_unmap(ap_backend *b, int device, void *va, size_t size)
{
    (void)size; /* the runtime knows the mapping by its start */
    acl_vmm_record(b);
    ON_DEVICE(b, device, IMPL(b)->aclrtUnmapMem(va));
}

/* has_vmm == 0: the table still holds callable entries, which refuse. */
static int acl_vmm_absent_granularity(ap_backend *b, int d, size_t *g) { (void)b; (void)d; (void)g; return AP_ERR_MISSING_SYMBOL; }
static int acl_vmm_absent_reserve(ap_backend *b, int d, size_t s, void **v) { (void)b; (void)d; (void)s; (void)v; return AP_ERR_MISSING_SYMBOL; }
static int acl_vmm_absent_range(ap_backend *b, int d, void *v, size_t s) { (void)b; (void)d; (void)v; (void)s; return AP_ERR_MISSING_SYMBOL; }
static int acl_vmm_absent_create(ap_backend *b, int d, size_t s, void **h) { (void)b; (void)d; (void)s; (void)h; return AP_ERR_MISSING_SYMBOL; }
static int acl_vmm_absent_free(ap_backend *b, int d, void *h) { (void)b; (void)d; (void)h; return AP_ERR_MISSING_SYMBOL; }
static int acl_vmm_absent_map(ap_backend *b, int d, void *v, size_t s, void *h) { (void)b; (void)d; (void)v; (void)s; (void)h; return AP_ERR_MISSING_SYMBOL; }

/* ---- sharing between processes (IPC) ------------------------------------------------------ */

/* The four calls of CANN's IPC memory API (CANN 8.x), all or none (has_ipc): looked up at open,
   recorded in resolved_symbols on first use, as the virtual-memory calls are. */
static const char *const acl_ipc_names[] = {
    "aclrtIpcMemGetExportKey", "aclrtIpcMemSetImportPid", "aclrtIpcMemImportByKey", "aclrtIpcMemClose",
};
#define ACL_IPC_NAMES (int)(sizeof acl_ipc_names / sizeof acl_ipc_names[0])

static int acl_ipc_lookup(acl_impl *im, void *lib)
{
    void *f[ACL_IPC_NAMES];
    int i;

    for (i = 0; i < ACL_IPC_NAMES; i++)
        if (!(f[i] = dlsym(lib, acl_ipc_names[i])))
            return 0;
    im->aclrtIpcMemGetExportKey = (__typeof__(im->aclrtIpcMemGetExportKey))f[0];
    im->aclrtIpcMemSetImportPid = (__typeof__(im->aclrtIpcMemSetImportPid))f[1];
    im->aclrtIpcMemImportByKey = (__typeof__(im->aclrtIpcMemImportByKey))f[2];
    im->aclrtIpcMemClose = (__typeof__(im->aclrtIpcMemClose))f[3];
    /* The simulator's read-only extension: probed, not recorded in resolved_symbols (it is no
       ACL entry point), and never passed to a runtime that lacks it. */
    uint64_t (*ro)(void) = (uint64_t(*)(void))dlsym(lib, "ascendsim_ipc_export_flag_read_only");
    im->ipc_read_only_flag = ro ? ro() : 0;
    return 1;
}

/* Every pid given to aclrtIpcMemSetImportPid is one of these (CANN: the host tgid in a container). */
static int acl_physical_device(ap_backend *b, int device, int *physical)
{
    int32_t phys = device;
    int rc;

    if (!IMPL(b)->aclrtGetPhyDevIdByLogicDevId) {
        *physical = device;
        return 0;
    }
    rc = IMPL(b)->aclrtGetPhyDevIdByLogicDevId(device, &phys);
    if (rc == 0)
        *physical = phys;
    return rc;
}

static int acl_node_pid(ap_backend *b, int32_t *pid)
{
    if (!IMPL(b)->aclrtDeviceGetBareTgid) {
        *pid = (int32_t)getpid();
        return 0;
    }
    return IMPL(b)->aclrtDeviceGetBareTgid(pid);
}

static pthread_mutex_t ipc_record_lock = PTHREAD_MUTEX_INITIALIZER;

static void acl_ipc_record(ap_backend *b)
{
    acl_impl *im = IMPL(b);
    int i;

    if (__atomic_load_n(&im->ipc_recorded, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&ipc_record_lock);
    if (!im->ipc_recorded) {
        for (i = 0; i < ACL_IPC_NAMES; i++)
            (void)ap_resolve(b->lib, &im->base, acl_ipc_names[i]);
        __atomic_store_n(&im->ipc_recorded, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&ipc_record_lock);
}

/* The runtime exports in (and imports into) the current context: make `device` current. */
static int acl_ipc_export(ap_backend *b, int device, void *ptr, size_t size, char *key, size_t keylen,
                          unsigned flags)
{
    int rc;

    acl_ipc_record(b);
    if (!key || keylen < ACL_IPC_KEY_LEN)
        return 100000; /* ACL_ERROR_INVALID_PARAM: the runtime writes 65 bytes */
    (void)rc;
    uint64_t aflags = (flags & AP_IPC_ANY_PROCESS) ? ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION
                                                   : ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT;
    if (flags & AP_IPC_READ_ONLY)
        aflags |= IMPL(b)->ipc_read_only_flag; /* 0 on CANN: no read-only IPC there */
    ON_DEVICE(b, device, IMPL(b)->aclrtIpcMemGetExportKey(ptr, size, key, ACL_IPC_KEY_LEN, aflags));
}

/* CANN's SetIpcMemPid needs a current context (107002 without one): the key's device's. */
static int acl_ipc_set_pids(ap_backend *b, int device, const char *key, const int32_t *pids, size_t n)
{
    acl_ipc_record(b);
    ON_DEVICE(b, device, IMPL(b)->aclrtIpcMemSetImportPid(key, (int32_t *)pids, n)); /* prototype lacks const */
}

static int acl_ipc_import(ap_backend *b, int device, const char *key, int peer, void **ptr, size_t *size)
{
    int rc;

    acl_ipc_record(b);
    if (size)
        *size = 0; /* aclrtIpcMemImportByKey does not say */
    (void)rc;
    /* Peer access only for another device's memory (usable here then without
       aclrtDeviceEnablePeerAccess): CANN 8.2.RC1's pages call the flag reserved, "fixed to 0", and
       the later runtimes' flag asks the driver the key's device and opens peer access to it,
       nothing an import on the exporter's own device needs. */
    ON_DEVICE(b, device, IMPL(b)->aclrtIpcMemImportByKey(ptr, key, peer ? ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS
                                                                        : ACL_RT_IPC_MEM_IMPORT_FLAG_DEFAULT));
}

static int acl_ipc_close(ap_backend *b, int device, const char *key)
{
    int rc;

    acl_ipc_record(b);
    (void)rc;
    ON_DEVICE(b, device, IMPL(b)->aclrtIpcMemClose(key));
}

static int acl_ipc_absent_export(ap_backend *b, int d, void *p, size_t s, char *k, size_t l, unsigned f) { (void)b; (void)d; (void)p; (void)s; (void)k; (void)l; (void)f; return AP_ERR_MISSING_SYMBOL; }
static int acl_ipc_absent_set_pids(ap_backend *b, int d, const char *k, const int32_t *p, size_t n) { (void)b; (void)d; (void)k; (void)p; (void)n; return AP_ERR_MISSING_SYMBOL; }
static int acl_ipc_absent_import(ap_backend *b, int d, const char *k, int peer, void **p, size_t *s) { (void)b; (void)d; (void)k; (void)peer; (void)p; (void)s; return AP_ERR_MISSING_SYMBOL; }
static int acl_ipc_absent_close(ap_backend *b, int d, const char *k) { (void)b; (void)d; (void)k; return AP_ERR_MISSING_SYMBOL; }

/* ---- events -------------------------------------------------------------------------------- */

static int acl_event_reset(ap_backend *b, void *event, void *stream);

/* Creates an event in the current thread's context (no set_device). Where the runtime has
   aclrtCreateEventExWithFlag, with ACL_EVENT_SYNC (which aclrtStreamWaitEvent needs) through it,
   as torch_npu does: its waits wait for the latest record, so the pools reuse it at once, with
   no aclrtResetEvent after each wait and no record to park it on (event_reset is NULL, CUDA's
   path). A runtime that exports it but refuses it (ACL_ERROR_RT_FEATURE_NOT_SUPPORT, logged by
   ACL as a warning) sends the backend, once and for good, to aclrtCreateEventWithFlag and the
   reset scheme (event_reset set before any such event is made; no new-mode event exists then,
   the runtime having refused each). */
static int acl_event_create_here(ap_backend *b, void **event)
{
    acl_impl *im = IMPL(b);
    if (__atomic_load_n(&im->event_ex, __ATOMIC_ACQUIRE)) {
        int rc = im->aclrtCreateEventExWithFlag(event, ACL_EVENT_SYNC);
        if (rc != ACL_ERROR_RT_FEATURE_NOT_SUPPORT)
            return rc;
        if (im->aclGetRecentErrMsg) /* handled here: not the caller's error */
            (void)im->aclGetRecentErrMsg();
        __atomic_store_n(&b->event_reset, im->aclrtResetEvent ? acl_event_reset : NULL, __ATOMIC_RELEASE);
        __atomic_store_n(&im->event_ex, 0, __ATOMIC_RELEASE);
    }
    if (im->aclrtCreateEventWithFlag)
        return im->aclrtCreateEventWithFlag(event, ACL_EVENT_SYNC);
    return im->aclrtCreateEvent(event);
}

static int acl_event_create(ap_backend *b, int device, void **event)
{
    ON_DEVICE(b, device, acl_event_create_here(b, event));
}

/* NULL stream: the default stream of the context the call runs in (ON_SELECTED). */
static int acl_event_record(ap_backend *b, void *event, void *stream)
{
    ON_STREAM(b, stream, IMPL(b)->aclrtRecordEvent(event, stream));
}

static int acl_event_query_here(ap_backend *b, void *event, int *complete)
{
    acl_impl *im = IMPL(b);
    int status = -1;
    aclError rc;

    if (im->aclrtQueryEventStatus) {
        rc = im->aclrtQueryEventStatus(event, &status);
        if (rc == 0)
            *complete = status == ACL_EVENT_RECORDED_STATUS_COMPLETE;
    } else {
        /* Older CANN: the deprecated call, whose enum counts the other way round. */
        rc = im->aclrtQueryEvent(event, &status);
        if (rc == 0)
            *complete = status == ACL_EVENT_STATUS_COMPLETE;
    }
    return rc;
}

/* Polls until the event completes or timeout_ms (>= 0) passes; returns timeout_code then. */
static int acl_poll_event(ap_backend *b, void *event, int timeout_ms, int timeout_code)
{
    uint64_t deadline = ap_now_ns() + (uint64_t)timeout_ms * 1000000u;
    unsigned step = 0;
    int complete = 0;
    int rc;

    for (;;) {
        rc = acl_event_query_here(b, event, &complete);
        if (rc != 0 || complete)
            return rc;
        if (ap_now_ns() >= deadline) {
            /* Nothing failed inside the runtime: drop any message left from an earlier failure so
               that error_message() does not attach it to this timeout. */
            if (IMPL(b)->aclGetRecentErrMsg)
                (void)IMPL(b)->aclGetRecentErrMsg();
            return timeout_code;
        }
        ap_poll_sleep(&step);
    }
}

static int acl_event_query(ap_backend *b, void *event, int *complete)
{
    ON_SELECTED(b, acl_event_query_here(b, event, complete));
}

static int acl_event_sync_here(ap_backend *b, void *event, int timeout_ms)
{
    acl_impl *im = IMPL(b);

    if (timeout_ms < 0)
        return im->aclrtSynchronizeEvent(event);
    /* The runtime's timed wait takes -1 or a positive timeout; 0 means "just look", a query. */
    if (timeout_ms > 0 && im->aclrtSynchronizeEventWithTimeout)
        return im->aclrtSynchronizeEventWithTimeout(event, timeout_ms);
    return acl_poll_event(b, event, timeout_ms, ACL_ERROR_RT_EVENT_SYNC_TIMEOUT);
}

static int acl_event_sync(ap_backend *b, void *event, int timeout_ms)
{
    ON_SELECTED(b, acl_event_sync_here(b, event, timeout_ms));
}

static int acl_event_destroy(ap_backend *b, void *event)
{
    ON_SELECTED(b, IMPL(b)->aclrtDestroyEvent(event));
}

static int acl_stream_wait_event(ap_backend *b, void *stream, void *event)
{
    ON_STREAM(b, stream, IMPL(b)->aclrtStreamWaitEvent(stream, event));
}

/* CANN's EventReset checks the stream against the current context (107003 otherwise). */
static int acl_event_reset(ap_backend *b, void *event, void *stream)
{
    ON_STREAM(b, stream, IMPL(b)->aclrtResetEvent(event, stream));
}

/* ---- streams ------------------------------------------------------------------------------- */

/* The notes of the streams this backend created (im->streams, under streams_lock). Each such
   stream holds a device reference of its own (acl_stream_create). A note goes with its stream
   (acl_stream_destroy), or when the backend finds the stream destroyed behind its back (by the
   framework's aclrtDestroyStream: the runtime refuses the handle, or has given it to another
   stream); that stream's reference is then counted in orphan_refs and given back by
   acl_release_orphans, never where the note is dropped: a pool lock may be held there. */

static void acl_orphan_ref(acl_impl *im, int device)
{
    __atomic_fetch_add(&im->dev[device].orphan_refs, 1, __ATOMIC_ACQ_REL);
}

/* Appends a note, streams_lock held. 0, or the runtime's code for host memory exhausted. */
static int acl_streams_append_locked(acl_impl *im, struct acl_stream_dev note)
{
    return notes_append(&im->streams, note) == 0 ? 0 : 207005; /* ACL_ERROR_RT_RESOURCE_ALLOC_FAIL */
}

/* Notes `stream`, just created on `device`. A note the table already has for its handle is stale:
   the runtime gave the handle of a stream destroyed behind the backend's back (a destroy through
   the backend takes its note out first, acl_stream_destroy_here), so that stream's reference is
   an orphan now. */
static int acl_streams_note(acl_impl *im, void *stream, int device)
{
    int rc = 0;

    pthread_mutex_lock(&im->streams_lock);
    ptrdiff_t i = notes_find(&im->streams, stream);
    if (i >= 0) {
        acl_orphan_ref(im, im->streams.v[i].device);
        im->streams.v[i].device = device;
        im->streams.v[i].serial = ++im->streams_serial;
    } else {
        rc = acl_streams_append_locked(im, (struct acl_stream_dev){stream, device, ++im->streams_serial});
    }
    pthread_mutex_unlock(&im->streams_lock);
    return rc;
}

/* Takes the note of `stream` out of the table (the one with `serial` only, when serial is not 0).
   1 and *note when there was one, else 0. */
static int acl_streams_take(acl_impl *im, void *stream, uint64_t serial, struct acl_stream_dev *note)
{
    int found = 0;

    pthread_mutex_lock(&im->streams_lock);
    ptrdiff_t i = notes_find(&im->streams, stream);
    if (i >= 0 && (!serial || im->streams.v[i].serial == serial)) {
        *note = im->streams.v[i];
        notes_remove_at(&im->streams, (size_t)i);
        found = 1;
    }
    pthread_mutex_unlock(&im->streams_lock);
    return found;
}

/* Drops the note `serial` of `stream`, found stale (its stream destroyed behind the backend's
   back): its reference becomes an orphan. Nothing when the note went meanwhile (the stream
   destroyed through the backend, or its handle noted anew for a stream created since). */
static void acl_streams_drop(acl_impl *im, void *stream, uint64_t serial)
{
    struct acl_stream_dev note = {0};

    if (acl_streams_take(im, stream, serial, &note))
        acl_orphan_ref(im, note.device);
}

/* A call on the stream of note `serial` was refused as for a handle the runtime does not know:
   most likely the stream was destroyed behind the backend's back. Asked for certain (and the
   note dropped) by acl_check_suspects, not here: the question is runtime calls of its own, and
   the refused call's message must stay the thread's. */
static void acl_streams_suspect(acl_impl *im, void *stream, uint64_t serial)
{
    pthread_mutex_lock(&im->streams_lock);
    ptrdiff_t i = notes_find(&im->streams, stream);
    if (i >= 0 && im->streams.v[i].serial == serial) {
        im->streams.v[i].suspect = 1;
        __atomic_store_n(&im->streams_suspect, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&im->streams_lock);
}

static int acl_created_note_holds(ap_backend *b, void *stream, int device);

/* Asks the streams of the notes on `device` (device < 0: of the suspect notes) whether they are
   still ours (acl_created_note_holds), and drops the stale notes. No pool lock held. */
static void acl_streams_check(ap_backend *b, int device)
{
    acl_impl *im = IMPL(b);
    struct acl_stream_dev *notes = NULL;
    size_t n = 0;

    pthread_mutex_lock(&im->streams_lock);
    for (size_t i = 0; i < im->streams.n; i++)
        n += device >= 0 ? im->streams.v[i].device == device : im->streams.v[i].suspect;
    if (n && (notes = malloc(n * sizeof *notes)) != NULL) {
        n = 0;
        for (size_t i = 0; i < im->streams.n; i++)
            if (device >= 0 ? im->streams.v[i].device == device : im->streams.v[i].suspect) {
                im->streams.v[i].suspect = 0;
                notes[n++] = im->streams.v[i];
            }
    }
    if (device < 0 && (notes || !n))
        __atomic_store_n(&im->streams_suspect, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&im->streams_lock);
    if (!notes)
        return;
    for (size_t i = 0; i < n; i++)
        if (!acl_created_note_holds(b, notes[i].stream, notes[i].device))
            acl_streams_drop(im, notes[i].stream, notes[i].serial);
    free(notes);
}

/* The suspect notes (acl_streams_suspect), checked. No pool lock held, and before a call whose
   error message its caller may read (the check reads away its own refusals' messages). */
static void acl_check_suspects(ap_backend *b)
{
    if (__atomic_load_n(&IMPL(b)->streams_suspect, __ATOMIC_ACQUIRE))
        acl_streams_check(b, -1);
}

/* Gives back the references of streams whose notes were dropped. Only with no pool lock held and
   outside any device scope: the last aclrtResetDevice of a device waits for its default context's
   queued work (CANN). */
static void acl_release_orphans(ap_backend *b)
{
    acl_impl *im = IMPL(b);

    for (int d = 0; d < b->device_count; d++) {
        int n = __atomic_exchange_n(&im->dev[d].orphan_refs, 0, __ATOMIC_ACQ_REL);
        while (n-- > 0)
            (void)acl_device_unref(b, d);
    }
}

static int acl_stream_create_here(ap_backend *b, int device, void **stream)
{
    acl_impl *im = IMPL(b);
    int rc = im->aclrtCreateStream(stream);

    if (rc == 0 && (rc = acl_streams_note(im, *stream, device)) != 0) {
        (void)im->aclrtDestroyStream(*stream);
        *stream = NULL;
    }
    return rc;
}

/* A stream this backend creates holds a device reference of its own until it is destroyed, as a
   pool does: the last aclrtResetDevice destroys every stream of the default context (CANN), so a
   stream made outside any pool's life (replay's direct mode, a framework's stream from
   Pool.create_stream kept after the pool) died with the call's temporary reference. */
static int acl_stream_create_on(ap_backend *b, int device, void **stream)
{
    ON_DEVICE(b, device, acl_stream_create_here(b, device, stream));
}

static int acl_stream_create(ap_backend *b, int device, void **stream)
{
    int rc;

    acl_check_suspects(b);
    rc = acl_device_retain(b, device);

    if (rc != 0)
        return rc;
    rc = acl_stream_create_on(b, device, stream);
    if (rc != 0)
        (void)acl_device_unref(b, device);
    acl_release_orphans(b); /* a stale note the new stream's handle replaced, among others */
    return rc;
}

/* The device of `stream` if this backend created it (and the serial of its note), else -1. */
static int acl_created_stream_device(acl_impl *im, void *stream, uint64_t *serial)
{
    int dev = -1;

    pthread_mutex_lock(&im->streams_lock);
    ptrdiff_t i = notes_find(&im->streams, stream);
    if (i >= 0) {
        dev = im->streams.v[i].device;
        *serial = im->streams.v[i].serial;
    }
    pthread_mutex_unlock(&im->streams_lock);
    return dev;
}

/* Whether a stream this backend noted as created on `device` is still that stream: the
   framework may have destroyed it with the runtime, which then gives its handle to a stream of
   another device or context (CANN's handles are heap pointers). Asked with an event recorded in
   the device's default context, where our stream lives; only a refusal that names the stream
   (not in this context, unknown handle) says the note is stale. Not on a hot path: a stream's
   device is asked when it is registered, a suspect note's stream at the next create or destroy,
   and the device's notes when a pool gives its device back (acl_streams_check). */
static int acl_created_note_holds(ap_backend *b, void *stream, int device)
{
    acl_impl *im = IMPL(b);
    acl_scope sc;
    void *event = NULL;
    int rc;

    if (acl_enter(b, device, &sc) != 0)
        return 1; /* cannot ask: keep the note */
    rc = acl_event_create_here(b, &event);
    if (rc == 0) {
        /* A new-mode event (event_ex still set once it is made) is asked with a wait: never
           recorded, the runtime checks the stream's context and sends no task (Event::WaitSendCheck),
           where a record takes one of the device's event ids until the stream reaches it. Asked
           at each record_stream with another device's stream, records left on a busy stream took
           every id of its device. The reset scheme's event must not be waited on unrecorded (its
           wait blocks the stream until a record): a record, whose id the destroy gives back. */
        if (__atomic_load_n(&im->event_ex, __ATOMIC_ACQUIRE))
            rc = im->aclrtStreamWaitEvent(stream, event);
        else
            rc = im->aclrtRecordEvent(event, stream);
        (void)im->aclrtDestroyEvent(event);
    }
    acl_leave(b, &sc);
    if (rc == 0)
        return 1;
    if (im->aclGetRecentErrMsg)
        (void)im->aclGetRecentErrMsg();
    return !(rc == ACL_ERROR_RT_STREAM_CONTEXT || rc == ACL_ERROR_RT_PARAM_INVALID ||
             rc == ACL_ERROR_RT_INVALID_HANDLE);
}

static int acl_stream_device(ap_backend *b, void *stream, int *device)
{
    acl_impl *im = IMPL(b);
    uint64_t serial = 0;
    int32_t dev = -1;

    if (!stream)
        return AP_ERR_UNKNOWN_STREAM; /* the default stream: whichever device the call runs on */
    dev = acl_created_stream_device(im, stream, &serial);
    if (dev >= 0 && !acl_created_note_holds(b, stream, dev)) {
        acl_streams_drop(im, stream, serial); /* perhaps under a pool lock: the reference later */
        dev = -1;
    }
    if (dev < 0 && im->sim_stream_device && im->sim_stream_device(stream, &dev) != 0) {
        if (im->aclGetRecentErrMsg)
            (void)im->aclGetRecentErrMsg();
        dev = -1;
    }
    if (dev < 0)
        return AP_ERR_UNKNOWN_STREAM;
    *device = dev;
    return 0;
}

/* A pool's reference (device_retain) given back, with no pool lock held. First each stream noted
   as ours on the device is asked whether it still is (acl_created_note_holds), and the
   references of the stale ones are given back too: streams the framework destroyed with the
   runtime that no call here named since (one a pool's close left busy, destroyed after it; one
   destroyed while its pool was open). */
static int acl_device_release(ap_backend *b, int device)
{
    int rc = acl_check_device(b, device);

    if (rc != 0)
        return rc;
    acl_check_suspects(b);
    acl_streams_check(b, device);
    acl_release_orphans(b);
    return acl_device_unref(b, device);
}

static int acl_stream_sync_here(ap_backend *b, void *stream, int timeout_ms)
{
    acl_impl *im = IMPL(b);
    void *event = NULL;
    int rc, rc2;

    if (timeout_ms < 0)
        return im->aclrtSynchronizeStream(stream);
    if (timeout_ms > 0 && im->aclrtSynchronizeStreamWithTimeout)
        return im->aclrtSynchronizeStreamWithTimeout(stream, timeout_ms);
    /* No timed stream wait in this runtime (and no stream query in older CANN): mark the end of
       the stream's current work with a temporary event and poll that. Rare path, so the event is
       not pooled. It is created in this thread's current context, which is the stream's when the
       caller set the device it created the stream on. */
    rc = acl_event_create_here(b, &event);
    if (rc != 0)
        return rc;
    rc = im->aclrtRecordEvent(event, stream);
    if (rc == 0)
        rc = acl_poll_event(b, event, timeout_ms, ACL_ERROR_RT_STREAM_SYNC_TIMEOUT);
    rc2 = im->aclrtDestroyEvent(event);
    return rc != 0 ? rc : rc2;
}

static int acl_stream_sync(ap_backend *b, void *stream, int timeout_ms)
{
    ON_STREAM(b, stream, acl_stream_sync_here(b, stream, timeout_ms));
}

/* CANN waits for the device of the thread's current context: entered for the call only. */
static int acl_device_sync_here(ap_backend *b, int timeout_ms)
{
    acl_impl *im = IMPL(b);

    if (timeout_ms < 0 && im->aclrtSynchronizeDevice)
        return im->aclrtSynchronizeDevice();
    if (timeout_ms > 0 && im->aclrtSynchronizeDeviceWithTimeout)
        return im->aclrtSynchronizeDeviceWithTimeout(timeout_ms);
    return AP_ERR_MISSING_SYMBOL; /* no bounded device wait: the caller waits for its streams */
}

static int acl_device_sync(ap_backend *b, int device, int timeout_ms)
{
    ON_DEVICE(b, device, acl_device_sync_here(b, timeout_ms));
}

/* The note goes out of the table before the runtime's destroy: from then on the runtime may give
   the handle to a stream another thread creates, whose note must not be this one. Destroyed, or
   found gone already (unknown, or the handle now another context's stream): its reference is an
   orphan, given back by acl_stream_destroy out of the stream's scope; else the note goes back. */
static int acl_stream_destroy_here(ap_backend *b, void *stream)
{
    acl_impl *im = IMPL(b);
    struct acl_stream_dev note = {0};
    int had = acl_streams_take(im, stream, 0, &note);
    int rc = im->aclrtDestroyStream(stream);

    if (rc == 0)
        acl_learn_context(im, stream, NULL, -1);
    if (!had)
        return rc;
    if (rc == 0 || rc == ACL_ERROR_RT_STREAM_CONTEXT || rc == ACL_ERROR_RT_PARAM_INVALID ||
        rc == ACL_ERROR_RT_INVALID_HANDLE) {
        acl_orphan_ref(im, note.device);
    } else {
        pthread_mutex_lock(&im->streams_lock);
        /* The handle noted anew meanwhile: ours was gone after all. Host memory exhausted: the
           stream lives on unnoted, keeping its reference (never one given back under it). */
        if (notes_find(&im->streams, stream) >= 0)
            acl_orphan_ref(im, note.device);
        else
            (void)acl_streams_append_locked(im, note);
        pthread_mutex_unlock(&im->streams_lock);
    }
    return rc;
}

/* CANN: "the stream must be in the current context": run in its device's context when known. */
static int acl_stream_destroy_on(ap_backend *b, void *stream)
{
    ON_STREAM(b, stream, acl_stream_destroy_here(b, stream));
}

static int acl_stream_destroy(ap_backend *b, void *stream)
{
    int rc;

    acl_check_suspects(b);
    rc = acl_stream_destroy_on(b, stream);

    acl_release_orphans(b); /* the reference it held (acl_stream_create), among others */
    return rc;
}

/* ---- errors -------------------------------------------------------------------------------- */

static const char *acl_code_name(int code)
{
    switch (code) {
    case 100000: return "ACL_ERROR_INVALID_PARAM";
    case 100001: return "ACL_ERROR_UNINITIALIZE";
    case 100002: return "ACL_ERROR_REPEAT_INITIALIZE";
    case 107000: return "ACL_ERROR_RT_PARAM_INVALID";
    case 107001: return "ACL_ERROR_RT_INVALID_DEVICEID";
    case 107002: return "ACL_ERROR_RT_CONTEXT_NULL";
    case 107003: return "ACL_ERROR_RT_STREAM_CONTEXT (stream not in current context)";
    case 107008: return "ACL_ERROR_RT_ADDR_UNALIGNED";
    case 107017: return "ACL_ERROR_RT_INVALID_HANDLE";
    case 107019: return "ACL_ERROR_RT_WAIT_TIMEOUT";
    case 200000: return "ACL_ERROR_BAD_ALLOC";
    case 200002: return "ACL_ERROR_INVALID_DEVICE";
    case 207000: return "ACL_ERROR_RT_FEATURE_NOT_SUPPORT";
    case 207001: return "ACL_ERROR_RT_MEMORY_ALLOCATION (out of memory: device or pinned host)";
    case 207002: return "ACL_ERROR_RT_MEMORY_FREE";
    case 207005: return "ACL_ERROR_RT_RESOURCE_ALLOC_FAIL";
    case 207006: return "ACL_ERROR_RT_NO_PERMISSION";
    case 207007: return "ACL_ERROR_RT_NO_EVENT_RESOURCE";
    case 207008: return "ACL_ERROR_RT_NO_STREAM_RESOURCE";
    case 207012: return "ACL_ERROR_RT_OVER_LIMIT";
    case 207018: return "ACL_ERROR_RT_DEVICE_OOM";
    case 507000: return "ACL_ERROR_RT_INTERNAL_ERROR";
    case 507022: return "ACL_ERROR_RT_IPC_ERROR";
    case 507046: return "ACL_ERROR_RT_STREAM_SYNC_TIMEOUT";
    case 507047: return "ACL_ERROR_RT_EVENT_SYNC_TIMEOUT";
    case 507899: return "ACL_ERROR_RT_DRV_INTERNAL_ERROR";
    default: return NULL;
    }
}

/* Call on the thread that saw the failure, right after it: aclGetRecentErrMsg is per thread. */
static void acl_error_message(ap_backend *b, int code, char *buf, size_t len)
{
    const char *own = ap_own_error_text(code);
    const char *name = acl_code_name(code);
    const char *recent = NULL;

    if (!buf || len == 0)
        return;
    if (own) {
        ap_errf(buf, len, "%s (code %d)", own, code);
        return;
    }
    ap_errf(buf, len, "aclError %d", code);
    if (name)
        ap_appendf(buf, len, " (%s)", name);
    if (b && b->impl && IMPL(b)->aclGetRecentErrMsg)
        recent = IMPL(b)->aclGetRecentErrMsg();
    if (recent && *recent)
        ap_appendf(buf, len, ": %s", recent);
}

/* Frees the backend's own tables. Pools give their device references back at close; the
   runtime itself is never finalised (ap_backend_close). */
static void acl_shutdown(ap_backend *b)
{
    acl_impl *im = IMPL(b);

    if (!im)
        return;
    free(im->dev);
    im->dev = NULL;
    notes_free(&im->streams);
}

/* ---- loading ------------------------------------------------------------------------------- */

static void *acl_try_load(const char *path, char *err, size_t errlen)
{
    /* RTLD_LOCAL: the runtime's symbols must not leak into the global namespace (a framework may
       load another copy). RTLD_NODELETE: see ap_backend_close(). */
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);

    if (!lib)
        ap_append_dlerror(err, errlen, path);
    return lib;
}

/* One runtime per process: torch_npu (or anything else) may have loaded libascendcl.so already,
   from wherever; a second copy would have its own devices, contexts and aclInit. So unless the
   caller named a library, a loaded copy is used: for kind "acl" a real runtime, for kind "sim"
   (default path only) a simulator (it exports ascendsim_* calls). The default path itself
   first, when it is the loaded one. */
static void *acl_find_loaded(const char *path, int want_sim, char *found, size_t foundlen)
{
    void *lib = path ? dlopen(path, RTLD_NOW | RTLD_NOLOAD | RTLD_LOCAL | RTLD_NODELETE) : NULL;

    if (lib) {
        snprintf(found, foundlen, "%s", path);
        return lib;
    }
    return ap_find_loaded("libascendcl.so", "ascendsim_stats_fields", want_sim, found, foundlen);
}

/* path, else $ASCEND_POOL_ACL_LIB (explicit choices are not second-guessed: a failure there is an
   error, not a reason to load some other runtime), else CANN's environment variables and
   standard install locations, else the loader's own search path. A runtime already loaded in
   the process comes before all of these but an explicit choice (prefer_loaded; sim: the path is
   then only the bundled default). */
static void *acl_load(const char *path, int prefer_loaded, int want_sim, char *found, size_t foundlen,
                      char *err, size_t errlen)
{
    static const char *const fixed[] = {
        "/usr/local/Ascend/ascend-toolkit/latest/lib64/libascendcl.so",
        "/usr/local/Ascend/latest/lib64/libascendcl.so",
        "/usr/local/Ascend/nnae/latest/lib64/libascendcl.so",
        "libascendcl.so",
    };
    static const char *const env_homes[] = {"ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"};
    const char *env = getenv("ASCEND_POOL_ACL_LIB");
    char candidate[1024];
    void *lib;
    size_t i;

    ap_errf(err, errlen, "could not load libascendcl.so; tried:");
    if (!path && env && *env) {
        path = env;
        prefer_loaded = 0;
    }
    if (prefer_loaded && (lib = acl_find_loaded(path, want_sim, found, foundlen)) != NULL)
        return lib;
    if (path) {
        lib = acl_try_load(path, err, errlen);
        if (lib)
            snprintf(found, foundlen, "%s", path);
        return lib;
    }
    for (i = 0; i < sizeof env_homes / sizeof env_homes[0]; i++) {
        const char *home = getenv(env_homes[i]);
        if (!home || !*home)
            continue;
        snprintf(candidate, sizeof candidate, "%s/lib64/libascendcl.so", home);
        lib = acl_try_load(candidate, err, errlen);
        if (lib) {
            snprintf(found, foundlen, "%s", candidate);
            return lib;
        }
    }
    for (i = 0; i < sizeof fixed / sizeof fixed[0]; i++) {
        lib = acl_try_load(fixed[i], err, errlen);
        if (lib) {
            snprintf(found, foundlen, "%s", fixed[i]);
            return lib;
        }
    }
    return NULL;
}

/* Resolves every symbol, required or optional, recording which were found. Returns the number of
   required ones missing and lists them in err. */
static int acl_resolve_all(acl_impl *im, void *lib, char *err, size_t errlen)
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

    ap_errf(err, errlen, "missing required ACL symbol(s):");
    REQUIRE(aclInit);
    REQUIRE(aclrtSetDevice);
    REQUIRE(aclrtResetDevice);
    REQUIRE(aclrtGetCurrentContext);
    REQUIRE(aclrtSetCurrentContext);
    REQUIRE(aclrtGetDevice);
    REQUIRE(aclrtGetDeviceCount);
    /* Newer entry points first; the older ones are only resolved (and recorded) when needed. */
    if (!RESOLVE(aclrtMallocAlign32))
        REQUIRE(aclrtMalloc);
    REQUIRE(aclrtFree);
    REQUIRE(aclrtGetMemInfo);
    if (!RESOLVE(aclrtCreateEventWithFlag))
        REQUIRE(aclrtCreateEvent);
    REQUIRE(aclrtRecordEvent);
    if (!RESOLVE(aclrtQueryEventStatus))
        REQUIRE(aclrtQueryEvent);
    REQUIRE(aclrtSynchronizeEvent);
    RESOLVE(aclrtSynchronizeEventWithTimeout);
    REQUIRE(aclrtDestroyEvent);
    REQUIRE(aclrtStreamWaitEvent);
    RESOLVE(aclrtResetEvent);
    /* New-mode events need aclrtQueryEventStatus (they refuse the deprecated aclrtQueryEvent). */
    if (im->aclrtQueryEventStatus && RESOLVE(aclrtCreateEventExWithFlag))
        im->event_ex = 1;
    REQUIRE(aclrtCreateStream);
    REQUIRE(aclrtSynchronizeStream);
    RESOLVE(aclrtSynchronizeStreamWithTimeout);
    RESOLVE(aclrtSynchronizeDevice);
    RESOLVE(aclrtSynchronizeDeviceWithTimeout);
    REQUIRE(aclrtDestroyStream);
    RESOLVE(aclGetRecentErrMsg);
    RESOLVE(aclrtGetSocName);
#undef REQUIRE
#undef RESOLVE
    return missing;
}

int ap_acl_open(ap_backend *b, const char *path, int prefer_loaded, int want_sim, char *err,
                size_t errlen)
{
    char found[sizeof b->path] = "";
    char why[512];
    acl_impl *im;
    uint32_t count = 0;
    aclError rc;
    Dl_info info;

    b->kind = AP_BACKEND_ACL;
    b->lib = acl_load(path, prefer_loaded, want_sim, found, sizeof found, err, errlen);
    if (!b->lib)
        return AP_ERR_NOT_LOADED;

    im = calloc(1, sizeof *im);
    if (!im) {
        ap_errf(err, errlen, "out of host memory opening %s", found);
        return AP_ERR_NOT_LOADED;
    }
    b->impl = im;
    im->base.id = ap_next_backend_id();
    pthread_mutex_init(&im->streams_lock, NULL);
    /* The simulator's stream-device query: probed, not recorded (it is no ACL entry point). */
    im->sim_stream_device = (__typeof__(im->sim_stream_device))dlsym(b->lib, "ascendsim_stream_device");
    if (acl_resolve_all(im, b->lib, why, sizeof why) > 0) {
        ap_errf(err, errlen, "%s is not a usable ACL runtime: %s", found, why);
        return AP_ERR_MISSING_SYMBOL;
    }
    /* Record the file really loaded (the loader may have found a bare name anywhere). */
    if (dladdr((void *)im->aclInit, &info) && info.dli_fname && info.dli_fname[0] == '/')
        snprintf(b->path, sizeof b->path, "%s", info.dli_fname);
    else
        snprintf(b->path, sizeof b->path, "%s", found);

    b->has_malloc_align32 = im->aclrtMallocAlign32 != NULL;
    b->has_query_event_status = im->aclrtQueryEventStatus != NULL;
    b->has_sync_event_timeout = im->aclrtSynchronizeEventWithTimeout != NULL;
    b->has_sync_stream_timeout = im->aclrtSynchronizeStreamWithTimeout != NULL;
    b->device_size = acl_device_size;
    b->set_device = acl_set_device;
    b->device_retain = acl_device_retain;
    b->device_release = acl_device_release;
    b->life = acl_life;
    b->stream_device = acl_stream_device;
    b->shutdown = acl_shutdown;
    b->malloc = acl_malloc;
    b->free = acl_free;
    b->mem_info = acl_mem_info;
    b->event_create = acl_event_create;
    b->event_record = acl_event_record;
    b->event_query = acl_event_query;
    b->event_sync = acl_event_sync;
    b->event_destroy = acl_event_destroy;
    b->stream_wait_event = acl_stream_wait_event;
    b->event_reset = im->aclrtResetEvent && !im->event_ex ? acl_event_reset : NULL;
    b->stream_create = acl_stream_create;
    b->stream_sync = acl_stream_sync;
    b->device_sync = acl_device_sync;
    b->stream_destroy = acl_stream_destroy;
    b->error_message = acl_error_message;
    b->host_malloc = acl_host_malloc;
    b->host_free = acl_host_free;
    b->has_vmm = acl_vmm_lookup(im, b->lib);
    b->vmm_granularity = b->has_vmm ? acl_vmm_granularity : acl_vmm_absent_granularity;
    b->vmm_reserve = b->has_vmm ? acl_vmm_reserve : acl_vmm_absent_reserve;
    b->vmm_release = b->has_vmm ? acl_vmm_release : acl_vmm_absent_range;
    b->vmm_create = b->has_vmm ? acl_vmm_create : acl_vmm_absent_create;
    b->vmm_free = b->has_vmm ? acl_vmm_free : acl_vmm_absent_free;
    b->vmm_map = b->has_vmm ? acl_vmm_map : acl_vmm_absent_map;
    b->vmm_unmap = b->has_vmm ? acl_vmm_unmap : acl_vmm_absent_range;
    b->has_ipc = acl_ipc_lookup(im, b->lib);
    b->ipc_export = b->has_ipc ? acl_ipc_export : acl_ipc_absent_export;
    b->ipc_set_pids = b->has_ipc ? acl_ipc_set_pids : acl_ipc_absent_set_pids;
    b->ipc_import = b->has_ipc ? acl_ipc_import : acl_ipc_absent_import;
    b->ipc_close = b->has_ipc ? acl_ipc_close : acl_ipc_absent_close;
    b->has_ipc_read_only = b->has_ipc && im->ipc_read_only_flag != 0;
    im->aclrtDeviceGetBareTgid = (__typeof__(im->aclrtDeviceGetBareTgid))dlsym(b->lib, "aclrtDeviceGetBareTgid");
    im->aclrtGetPhyDevIdByLogicDevId =
        (__typeof__(im->aclrtGetPhyDevIdByLogicDevId))dlsym(b->lib, "aclrtGetPhyDevIdByLogicDevId");
    b->node_pid = acl_node_pid;
    b->physical_device = acl_physical_device;

    /* A framework in this process may have initialised ACL already; that is fine. Never finalise:
       see ap_backend_close(). */
    rc = im->aclInit(NULL);
    if (rc != 0 && rc != ACL_ERROR_REPEAT_INITIALIZE) {
        acl_error_message(b, rc, why, sizeof why);
        ap_errf(err, errlen, "aclInit failed in %s: %s", b->path, why);
        return rc;
    }
    /* CANN counts every aclInit, a refused one too (aclInitImpl), and aclFinalizeReference
       finalises only at the count's last: the reference the refused call took is given back at
       once, so that a framework pairing its own aclInit with aclFinalizeReference still ends its
       runtime there (kept, it was left running until exit). The runtime stays the framework's, as
       with aclFinalize (docs/cann-rules.md R6, R11). One initialised here is kept. */
    im->aclFinalizeReference = (__typeof__(im->aclFinalizeReference))dlsym(b->lib, "aclFinalizeReference");
    if (rc == ACL_ERROR_REPEAT_INITIALIZE && im->aclFinalizeReference && im->aclFinalizeReference(NULL) != 0 &&
        im->aclGetRecentErrMsg)
        (void)im->aclGetRecentErrMsg(); /* refused: a framework's aclFinalize raced ours; its calls say so */
    rc = im->aclrtGetDeviceCount(&count);
    if (rc != 0) {
        acl_error_message(b, rc, why, sizeof why);
        ap_errf(err, errlen, "%s loaded but aclrtGetDeviceCount failed: %s", b->path, why);
        return AP_ERR_NO_DEVICE;
    }
    if (count == 0) {
        ap_errf(err, errlen, "%s loaded but reports no NPU device", b->path);
        return AP_ERR_NO_DEVICE;
    }
    im->dev = calloc(count, sizeof *im->dev);
    if (!im->dev) {
        ap_errf(err, errlen, "out of host memory opening %s", b->path);
        return AP_ERR_NOT_LOADED;
    }
    for (uint32_t i = 0; i < count; i++)
        pthread_mutex_init(&im->dev[i].lock, NULL);
    b->device_count = (int)count;
    /* Padding of aclrtMalloc (used only without aclrtMallocAlign32): CANN documents 32 bytes
       after rounding on every SoC but Ascend 950 (docs/cann-rules.md). */
    const char *soc = im->aclrtGetSocName ? im->aclrtGetSocName() : NULL;
    snprintf(b->soc_name, sizeof b->soc_name, "%s", soc ? soc : "");
    im->malloc_pad = acl_soc_is_950(b->soc_name) ? 0 : 32;
    return 0;
}

/* The device backend: one small table of C functions that the pool calls.
 *
 * Three implementations fill it in:
 *   acl  - dlopen()s libascendcl.so (a real NPU) and resolves the ACL runtime symbols;
 *   sim  - exactly the acl implementation, pointed at the simulator's libascendcl.so;
 *   cuda - dlopen()s libcudart.so and maps the same operations onto the CUDA runtime.
 *
 * Every operation returns 0 on success or the runtime's own error code (an aclError for acl/sim,
 * a cudaError_t for cuda), never aborts, and is callable from any thread without the GIL.
 * Handles (streams, events) are the runtime's own opaque pointers; NULL is the default stream.
 */
#ifndef ASCEND_POOL_BACKEND_H
#define ASCEND_POOL_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#define AP_BACKEND_ACL 1   /* also used by the simulator */
#define AP_BACKEND_CUDA 2

/* Codes of our own (outside the runtimes' ranges) for failures before a runtime is reached. */
#define AP_ERR_NOT_LOADED 990001     /* library could not be dlopen()ed */
#define AP_ERR_MISSING_SYMBOL 990002 /* a required symbol is absent */
#define AP_ERR_NO_DEVICE 990003      /* library loaded but reports no device */
#define AP_ERR_FORKED 990004         /* forked after the parent opened a runtime (fork.c) */
#define AP_ERR_UNKNOWN_STREAM 990005 /* stream_device: the runtime cannot tell a stream's device */

/* Sharing device memory between processes (ipc_* below). */
#define AP_IPC_KEY_MAX 160           /* key buffers: acl keys are <= 64 chars, cuda's 128 hex digits */
#define AP_IPC_ANY_PROCESS 0x1u      /* ipc_export flag: no pid check (any process of the user) */
#define AP_IPC_READ_ONLY 0x2u        /* ipc_export flag: importers may only read (has_ipc_read_only) */

typedef struct ap_backend ap_backend;

/* fork.c: the parent's pid when this process was forked after it had opened a backend (then no
   runtime may be used here: callers refuse with AP_ERR_FORKED), else 0. Read it with a relaxed
   atomic load; it is set once, in the child, before any of the child's code runs. */
extern _Atomic int ap_forked_from;
/* The message for AP_ERR_FORKED: what happened, and to start workers with 'spawn'. */
void ap_backend_forked_message(char *buf, size_t len);
/* fork.c: fd is (on = 1) or is no longer (on = 0) a descriptor whose flock proves this process
   alive (a lease, a stats file): a child forked from C, where no Python fork handler runs, drops
   it (dup2 of /dev/null over it), or it would hold the lock after this process died. 0, or -1
   when fd is past the table (AP_FORK_DROP_FDS: 65,536 descriptors). */
int ap_fork_drop_fd(int fd, int on);
/* fork.c: around making such a descriptor up to its registration, and from its unregistration to
   its close: a fork waits meanwhile (else the child got it unregistered). No other lock is taken
   inside, nor may the caller wait for anything there. */
void ap_fork_window_enter(void);
void ap_fork_window_leave(void);

struct ap_backend {
    int kind;          /* AP_BACKEND_ACL or AP_BACKEND_CUDA */
    char name[16];     /* "acl", "sim" or "cuda" */
    char path[1024];   /* the library that was loaded */
    void *lib;         /* dlopen() handle */
    int has_malloc_align32;        /* acl: aclrtMallocAlign32 resolved (else aclrtMalloc is used) */
    int has_query_event_status;    /* acl: aclrtQueryEventStatus resolved (else aclrtQueryEvent) */
    int has_sync_event_timeout;    /* acl: aclrtSynchronizeEventWithTimeout resolved */
    int has_sync_stream_timeout;   /* acl: aclrtSynchronizeStreamWithTimeout resolved */
    int device_count;
    char soc_name[64]; /* acl: aclrtGetSocName() ("" when absent); cuda: "" */

    /* Bytes the device really reserves for a request of `size` bytes from this backend's
       malloc (acl: aclrtMallocAlign32 rounds up to 32; aclrtMalloc rounds up to 32 and adds 32,
       but a whole number of 2 MiB pages is asked 32 bytes short and takes exactly itself; huge
       pages of other sizes above 1 MiB, taken whole, are not counted). */
    size_t (*device_size)(const ap_backend *b, size_t size);

    /* Names the device whose context this thread's calls without a device argument (events,
       streams) run in. acl: it changes no runtime state; every call switches to its device's
       context and back (aclrtGetCurrentContext/aclrtSetCurrentContext), so the caller's current
       device is never left changed. cuda: makes the device current (cudaSetDevice when
       cudaGetDevice differs) and leaves it so; cuda's malloc/free/mem_info and event/stream
       creation switch back themselves. */
    int (*set_device)(ap_backend *b, int device);
    /* One device reference for a pool, from its creation to its close (acl: aclrtSetDevice /
       aclrtResetDevice, which CANN counts per process; cuda: nothing to count, 0). */
    int (*device_retain)(ap_backend *b, int device);
    int (*device_release)(ap_backend *b, int device);
    /* The device a stream belongs to: 0 and *device, or AP_ERR_UNKNOWN_STREAM when it cannot be
       told (NULL; acl: a handle this backend did not create, since CANN has no such query and
       only the simulator answers one). */
    int (*stream_device)(ap_backend *b, void *stream, int *device);
    /* The runtime's life on `device` as this backend has seen it, or NULL (cuda: one life): a
       number that changes when the backend learns that the runtime released what the process
       held there behind the pools' references: a call answered that the runtime is not
       initialised (aclFinalize), or the device's default context, on which the pools hold their
       references, was found released (aclFinalize then aclInit, a forced reset, resets past the
       pools' references) and taken anew. Device memory, events and streams of an earlier life
       are not to be used or freed again. Learned from the calls the backend makes anyway, and
       with `probe`, by entering the device's context first (acl: the context switch each device
       call makes; no device work): read it off the hot path only (ap_backend_life), with probe
       before a device call on memory of the pool's. */
    uint64_t (*life)(ap_backend *b, int device, int probe);
    /* Private: called by ap_backend_close to give back what the implementation holds. */
    void (*shutdown)(ap_backend *b);
    /* Device memory of `size` bytes on `device`, huge pages first (ACL_MEM_MALLOC_HUGE_FIRST). */
    int (*malloc)(ap_backend *b, int device, void **ptr, size_t size);
    int (*free)(ap_backend *b, int device, void *ptr);
    /* Free and total bytes of the device's HBM (aclrtGetMemInfo(ACL_HBM_MEM)). */
    int (*mem_info)(ap_backend *b, int device, size_t *free_bytes, size_t *total_bytes);

    /* Events without timestamps or blocking host sync: the cheapest kind that can still order
       streams (acl: aclrtCreateEventWithFlag(ACL_EVENT_SYNC), which CANN requires for
       aclrtStreamWaitEvent, else aclrtCreateEvent; cuda: cudaEventDisableTiming). */
    int (*event_create)(ap_backend *b, int device, void **event);
    int (*event_record)(ap_backend *b, void *event, void *stream);
    /* *complete = 1 when all work recorded before the event has finished, else 0. */
    int (*event_query)(ap_backend *b, void *event, int *complete);
    /* Blocks the host until the event completes or timeout_ms passes (timeout_ms < 0: forever);
       a timeout returns the runtime's timeout code (ACL_ERROR_RT_EVENT_SYNC_TIMEOUT 507047 /
       cudaErrorNotReady for cuda, which has no timeout variant: it polls). */
    int (*event_sync)(ap_backend *b, void *event, int timeout_ms);
    int (*event_destroy)(ap_backend *b, void *event);
    /* Work submitted to `stream` after this call waits until `event` completes. No host wait. */
    int (*stream_wait_event)(ap_backend *b, void *stream, void *event);
    /* Returns an event that a stream waited on to its initial state, ordered on that (waiting)
       stream, so that it may be recorded again. CANN requires it (aclrtResetEvent: "usually
       called after aclrtStreamWaitEvent"; docs/cann-rules-events.md); NULL where the runtime has
       no such rule (cuda) or lacks the symbol: the event is then reused as it is. */
    int (*event_reset)(ap_backend *b, void *event, void *stream);
    /* (event_reset is read with ap_backend_event_reset: the acl backend sets it, once, when the
       runtime refuses the events that need none; see acl_event_create_here.) */

    int (*stream_create)(ap_backend *b, int device, void **stream);
    /* Same timeout rule as event_sync (ACL_ERROR_RT_STREAM_SYNC_TIMEOUT 507046 on timeout). */
    int (*stream_sync)(ap_backend *b, void *stream, int timeout_ms);
    int (*stream_destroy)(ap_backend *b, void *stream);
    /* Blocks until all work the process queued on `device` is done, every stream of it, as
       cudaDeviceSynchronize (acl: aclrtSynchronizeDevice[WithTimeout] in the device's context,
       the caller's current device unchanged); same timeout rule as stream_sync. NULL, or
       AP_ERR_MISSING_SYMBOL, where the runtime has no such wait (cuda here; an acl runtime
       without the timed one asked for a limit): the caller waits for the streams it knows. */
    int (*device_sync)(ap_backend *b, int device, int timeout_ms);

    /* Writes a readable message for `code` (with aclGetRecentErrMsg / cudaGetErrorString). */
    void (*error_message)(ap_backend *b, int code, char *buf, size_t len);

    /* Pinned (page-locked) host memory for staging copies and the host pool (acl: aclrtMallocHost /
       aclrtFreeHost; cuda: cudaHostAlloc(cudaHostAllocDefault) / cudaFreeHost). Pinned memory
       belongs to the process; `device` only makes a runtime context current, which the runtimes
       require. The two symbols are resolved on first use (so resolved_symbols lists them once
       used); a runtime without them answers AP_ERR_MISSING_SYMBOL. */
    int (*host_malloc)(ap_backend *b, int device, void **ptr, size_t size);
    int (*host_free)(ap_backend *b, int device, void *ptr);

    /* Virtual memory (expandable segments): all 0 = ok or the runtime's code; usable only when
       has_vmm. acl: aclrtReserveMemAddress / aclrtMallocPhysical / aclrtMapMem ...; cuda: cuMem*. */
    int has_vmm;
    int (*vmm_granularity)(ap_backend *b, int device, size_t *granularity);        /* huge page, 2 MiB */
    int (*vmm_reserve)(ap_backend *b, int device, size_t size, void **va);          /* inaccessible VA range */
    int (*vmm_release)(ap_backend *b, int device, void *va, size_t size);
    int (*vmm_create)(ap_backend *b, int device, size_t size, void **handle);       /* physical memory */
    int (*vmm_free)(ap_backend *b, int device, void *handle);
    int (*vmm_map)(ap_backend *b, int device, void *va, size_t size, void *handle); /* map + read-write */
    int (*vmm_unmap)(ap_backend *b, int device, void *va, size_t size);

    /* Sharing device memory with other processes of the node (IPC); usable only when has_ipc,
       else every entry answers AP_ERR_MISSING_SYMBOL. Keys are NUL-terminated text in buffers of
       keylen >= AP_IPC_KEY_MAX bytes; 0 = ok or the runtime's code.
       acl: aclrtIpcMemGetExportKey / SetImportPid / ImportByKey / Close (CANN 8.x; optional
       symbols). cuda: cudaIpcGetMemHandle / cudaIpcOpenMemHandle / cudaIpcCloseMemHandle. */
    int has_ipc;
    /* 1 when the runtime maps imports of an AP_IPC_READ_ONLY export read-only: only the
       simulator (its ascendsim_ipc_export_flag_read_only extension). CANN's and CUDA's IPC calls
       have no read-only mode: there AP_IPC_READ_ONLY is accepted and has no effect. */
    int has_ipc_read_only;
    /* Exports [ptr, ptr+size) of `device` and writes its key. acl: ptr and size must be page
       aligned (2 MiB); only pids listed with ipc_set_pids may import it, unless flags has
       AP_IPC_ANY_PROCESS (ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION); AP_IPC_READ_ONLY
       as has_ipc_read_only says. cuda: the whole cudaMalloc allocation containing ptr is
       exported, and CUDA checks no pids. */
    int (*ipc_export)(ap_backend *b, int device, void *ptr, size_t size, char *key, size_t keylen,
                      unsigned flags);
    /* Exporter: lets these processes import `key` (cuda: nothing to do, 0). */
    int (*ipc_set_pids)(ap_backend *b, int device, const char *key, const int32_t *pids, size_t n);
    /* Maps the memory of `key` into this process for `device`; *size gets its bytes where the
       runtime tells them, else 0 (acl tells nothing: the exporter's handle carries the size).
       `peer`: 1 when the memory was exported on another device than `device` (acl: imports with
       ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS then, with 0 otherwise: CANN 8.2.RC1's pages
       fix the flag to 0, and the later runtimes' flag only opens peer access to the exporter's
       device; cuda: peer access is lazy either way). */
    int (*ipc_import)(ap_backend *b, int device, const char *key, int peer, void **ptr, size_t *size);
    /* Importer: unmaps its import of `key`. Exporter: withdraws the key (acl: importers must have
       closed first; the simulator refuses with ACL_ERROR_RT_IPC_ERROR 507022 otherwise; cuda: 0). */
    int (*ipc_close)(ap_backend *b, int device, const char *key);
    /* The id the runtime's IPC checks know this process by, for ipc_set_pids: acl
       aclrtDeviceGetBareTgid (the host's tgid inside a container; getpid() on a CANN without the
       call, which predates containers' pid namespaces in its IPC checks); cuda getpid() (CUDA
       IPC checks no pids). 0 = ok. */
    int (*node_pid)(ap_backend *b, int32_t *pid);
    /* The node's device behind this process's `device` (*physical): a container given some of a
       node's NPUs sees them renumbered from 0 (ASCEND_RT_VISIBLE_DEVICES), and what processes of
       different containers share on a node (the quota ledgers) must name the same NPU alike.
       acl: aclrtGetPhyDevIdByLogicDevId, the device itself on a CANN without it; cuda: the device
       itself (CUDA_VISIBLE_DEVICES renumbering is not resolved). 0 = ok. */
    int (*physical_device)(ap_backend *b, int device, int *physical);

    void *impl; /* private: resolved symbols */
};

/* 1 when a device allocation failed with `code` because the device is out of memory (the pool
   trims, retries, then raises OutOfMemoryError); any other code is a device fault, reported as
   such (a context destroyed behind the pool is not an out-of-memory condition). */
static inline int ap_backend_oom_code(const ap_backend *b, int code) {
    if (b->kind == AP_BACKEND_CUDA) return code == 2; /* cudaErrorMemoryAllocation, CUDA_ERROR_OUT_OF_MEMORY */
    return code == 207001 || code == 207018 || code == 200000; /* RT_MEMORY_ALLOCATION, RT_DEVICE_OOM, BAD_ALLOC */
}

/* 1 when a call on a stream failed with `code` because the runtime no longer knows the stream
   (destroyed behind the pool's back, or never a stream): no work of it is left to wait for. ACL
   (rt_error_codes.h): param invalid, invalid handle; not 107003, "stream not in current context":
   that stream lives in another context and its queued work may still run. CUDA: invalid handle,
   context destroyed. */
static inline int ap_backend_stream_gone_code(const ap_backend *b, int code) {
    if (b->kind == AP_BACKEND_CUDA) return code == 400 || code == 709;
    return code == 107000 || code == 107017;
}

/* The device's runtime life (backend life above); 0 where the backend has one life only. */
static inline uint64_t ap_backend_life(ap_backend *b, int device, int probe) {
    return b->life ? b->life(b, device, probe) : 0;
}

/* The backend's event_reset (NULL: events are reused as they are). Read atomically: the acl
   backend sets it once while pools run, when the runtime refuses the events that need no reset. */
static inline int (*ap_backend_event_reset(const ap_backend *b))(ap_backend *, void *, void *) {
    return __atomic_load_n(&b->event_reset, __ATOMIC_ACQUIRE);
}

/* Opens a backend. kind: "acl", "sim" or "cuda". path: library to dlopen, or NULL for the
   default search (acl: $ASCEND_POOL_ACL_LIB, standard CANN locations, then the loader path;
   sim: must be given; cuda: libcudart.so.* by the loader path). prefer_loaded != 0 says `path` is
   only a default: a copy of the runtime already loaded in the process is used instead of a second
   one (acl/sim: libascendcl.so, a simulator copy for sim; cuda: libcudart.so*). On failure
   returns a nonzero code, writes why into err, and leaves *b closed. */
int ap_backend_open_default(ap_backend *b, const char *kind, const char *path, int prefer_loaded,
                            char *err, size_t errlen);
void ap_backend_close(ap_backend *b);

/* The i-th runtime symbol (0-based) that this backend resolved with dlsym(), in resolution order,
   or NULL past the end (or on a closed backend). The strings live as long as the process. Lets
   tests and diagnostics list exactly which entry points of the loaded library are in use. */
const char *ap_backend_symbol(const ap_backend *b, int i);

#endif

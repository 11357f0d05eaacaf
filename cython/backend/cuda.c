/* The cuda backend: the CUDA runtime (libcudart) loaded with dlopen(), so that the same pool and
 * its peers (PyTorch, CuPy, RMM) can be compared on an NVIDIA GPU. Nothing links against CUDA at
 * build time. Codes returned are cudaError_t values (0 = cudaSuccess), except the virtual-memory
 * calls, which only the driver API has (libcuda.so.1, cuMem*): they return CUresult values, whose
 * numbers agree with cudaError_t for what they report (1 invalid value, 2 out of memory, 801 not
 * supported...), so error_message words them correctly.
 */
#include "backend_impl.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int cudaError_t;

#define cudaErrorNotReady 600           /* queries: work still pending; also our timeout code */
#define cudaEventDisableTiming 0x02u    /* the cheapest event: no timestamps, spin-wait sync */
#define cudaHostAllocDefault 0x00u      /* pinned, portable to the allocating context only */
#define cudaIpcMemLazyEnablePeerAccess 0x01u

/* cudaIpcMemHandle_t: 64 opaque bytes, passed by value. Keys are its 128 hex digits. */
typedef struct cuda_ipc_handle {
    char reserved[64];
} cuda_ipc_handle;

/* This process's imports, by key: cudaIpcCloseMemHandle takes the pointer, the backend the key. */
typedef struct cuda_ipc_entry {
    struct cuda_ipc_entry *next;
    char key[129];
    void *ptr;
    unsigned count;
} cuda_ipc_entry;

/* Driver API virtual memory (cuda.h, CUDA 10.2+). */
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
#define CU_MEM_ALLOCATION_TYPE_PINNED 0x1
#define CU_MEM_HANDLE_TYPE_NONE 0x0
#define CU_MEM_LOCATION_TYPE_DEVICE 0x1
#define CU_MEM_ACCESS_FLAGS_PROT_READWRITE 0x3
#define CU_MEM_ALLOC_GRANULARITY_MINIMUM 0x0

typedef struct cu_mem_location {          /* CUmemLocation */
    int type;
    int id;
} cu_mem_location;

typedef struct cu_mem_allocation_prop {   /* CUmemAllocationProp */
    int type;                             /* CUmemAllocationType */
    int requestedHandleTypes;             /* CUmemAllocationHandleType */
    cu_mem_location location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} cu_mem_allocation_prop;

typedef struct cu_mem_access_desc {       /* CUmemAccessDesc */
    cu_mem_location location;
    int flags;                            /* CUmemAccess_flags */
} cu_mem_access_desc;

typedef struct cuda_impl {
    ap_impl_base base; /* must stay first */
    cudaError_t (*cudaSetDevice)(int device);
    cudaError_t (*cudaGetDevice)(int *device);
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
    /* Virtual memory from the driver library: looked up at open (has_vmm), recorded in
       base.symbols on first use. */
    void *driver;     /* dlopen("libcuda.so.1"), never closed (RTLD_NODELETE; loaded by the runtime anyway) */
    int vmm_recorded; /* atomic */
    CUresult (*cuMemGetAllocationGranularity)(size_t *granularity, const cu_mem_allocation_prop *prop, int option);
    CUresult (*cuMemAddressReserve)(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                    unsigned long long flags);
    CUresult (*cuMemAddressFree)(CUdeviceptr ptr, size_t size);
    CUresult (*cuMemCreate)(CUmemGenericAllocationHandle *handle, size_t size, const cu_mem_allocation_prop *prop,
                            unsigned long long flags);
    CUresult (*cuMemRelease)(CUmemGenericAllocationHandle handle);
    CUresult (*cuMemMap)(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                         unsigned long long flags);
    CUresult (*cuMemSetAccess)(CUdeviceptr ptr, size_t size, const cu_mem_access_desc *desc, size_t count);
    CUresult (*cuMemUnmap)(CUdeviceptr ptr, size_t size);
    /* Sharing between processes: looked up at open (has_ipc), recorded on first use. */
    int ipc_recorded; /* atomic */
    cudaError_t (*cudaIpcGetMemHandle)(cuda_ipc_handle *handle, void *devPtr);
    cudaError_t (*cudaIpcOpenMemHandle)(void **devPtr, cuda_ipc_handle handle, unsigned flags);
    cudaError_t (*cudaIpcCloseMemHandle)(void *devPtr);
    pthread_mutex_t ipc_lock;         /* guards imports */
    cuda_ipc_entry *imports;
} cuda_impl;

#define IMPL(b) ((cuda_impl *)(b)->impl)

/* The CUDA current device is per thread, and a framework switches it itself: never trust a
   cached one. Ask the runtime (cudaGetDevice is a thread-local read) and switch only when it
   differs. Every device call switches back after (CUDA_ON_DEVICE); only set_device itself (the
   backend's explicit "make this device current", used by tests and tools) leaves it there. */
static int cuda_set_device(ap_backend *b, int device)
{
    cuda_impl *im = IMPL(b);
    int cur = -1;

    if (im->cudaGetDevice && im->cudaGetDevice(&cur) == 0 && cur == device)
        return 0;
    return im->cudaSetDevice(device);
}

/* Runs `expr` with `device` current and the caller's device restored after. */
#define CUDA_ON_DEVICE(b, device, expr)                                            \
    do {                                                                           \
        cuda_impl *im_ = IMPL(b);                                                  \
        int prev_ = -1, rc_;                                                       \
        if (!im_->cudaGetDevice || im_->cudaGetDevice(&prev_) != 0)                \
            prev_ = -1;                                                            \
        rc_ = prev_ == (device) ? 0 : im_->cudaSetDevice(device);                  \
        if (rc_ == 0)                                                              \
            rc_ = (expr);                                                          \
        if (prev_ >= 0 && prev_ != (device))                                       \
            (void)im_->cudaSetDevice(prev_);                                       \
        return rc_;                                                                \
    } while (0)

/* CUDA counts no device references (cudaSetDevice makes the primary context current only). */
static int cuda_device_retain(ap_backend *b, int device)
{
    (void)b;
    (void)device;
    return 0;
}

/* cudaStreamGetDevice exists from CUDA 12.8 only; not relied on here. */
static int cuda_stream_device(ap_backend *b, void *stream, int *device)
{
    (void)b;
    (void)stream;
    (void)device;
    return AP_ERR_UNKNOWN_STREAM;
}

/* cudaMalloc reserves whole pages internally, but it reports and accounts the size asked for. */
static size_t cuda_device_size(const ap_backend *b, size_t size)
{
    (void)b;
    return size;
}

static int cuda_malloc(ap_backend *b, int device, void **ptr, size_t size)
{
    CUDA_ON_DEVICE(b, device, IMPL(b)->cudaMalloc(ptr, size));
}

static int cuda_free(ap_backend *b, int device, void *ptr)
{
    CUDA_ON_DEVICE(b, device, IMPL(b)->cudaFree(ptr));
}

static int cuda_mem_info(ap_backend *b, int device, size_t *free_bytes, size_t *total_bytes)
{
    CUDA_ON_DEVICE(b, device, IMPL(b)->cudaMemGetInfo(free_bytes, total_bytes));
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

    if (rc != 0)
        return rc;
    CUDA_ON_DEVICE(b, device, IMPL(b)->cudaHostAlloc(ptr, size, cudaHostAllocDefault));
}

static int cuda_host_free(ap_backend *b, int device, void *ptr)
{
    int rc = cuda_host_resolve(b);

    if (rc != 0)
        return rc;
    CUDA_ON_DEVICE(b, device, IMPL(b)->cudaFreeHost(ptr));
}

/* ---- virtual memory (driver API) ---------------------------------------------------------- */

static const char *const cuda_vmm_names[] = {
    "cuMemGetAllocationGranularity", "cuMemAddressReserve", "cuMemAddressFree", "cuMemCreate",
    "cuMemRelease", "cuMemMap", "cuMemSetAccess", "cuMemUnmap",
};
#define CUDA_VMM_NAMES (int)(sizeof cuda_vmm_names / sizeof cuda_vmm_names[0])

/* All eight calls or none. No libcuda (a toolkit without a driver): has_vmm stays 0. */
static int cuda_vmm_lookup(cuda_impl *im)
{
    void *f[CUDA_VMM_NAMES];
    int i;

    im->driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
    if (!im->driver)
        return 0;
    for (i = 0; i < CUDA_VMM_NAMES; i++)
        if (!(f[i] = dlsym(im->driver, cuda_vmm_names[i])))
            return 0;
    im->cuMemGetAllocationGranularity = (__typeof__(im->cuMemGetAllocationGranularity))f[0];
    im->cuMemAddressReserve = (__typeof__(im->cuMemAddressReserve))f[1];
    im->cuMemAddressFree = (__typeof__(im->cuMemAddressFree))f[2];
    im->cuMemCreate = (__typeof__(im->cuMemCreate))f[3];
    im->cuMemRelease = (__typeof__(im->cuMemRelease))f[4];
    im->cuMemMap = (__typeof__(im->cuMemMap))f[5];
    im->cuMemSetAccess = (__typeof__(im->cuMemSetAccess))f[6];
    im->cuMemUnmap = (__typeof__(im->cuMemUnmap))f[7];
    return 1;
}

static pthread_mutex_t vmm_record_lock = PTHREAD_MUTEX_INITIALIZER;

/* Records the driver's VMM names on first use. The calls below run with `device` current (which
   also initialises the driver and its primary context) and the caller's device restored after. */
static void cuda_vmm_names_once(ap_backend *b)
{
    cuda_impl *im = IMPL(b);
    int i;

    if (!__atomic_load_n(&im->vmm_recorded, __ATOMIC_ACQUIRE)) {
        pthread_mutex_lock(&vmm_record_lock);
        if (!im->vmm_recorded) {
            for (i = 0; i < CUDA_VMM_NAMES; i++)
                (void)ap_resolve(im->driver, &im->base, cuda_vmm_names[i]);
            __atomic_store_n(&im->vmm_recorded, 1, __ATOMIC_RELEASE);
        }
        pthread_mutex_unlock(&vmm_record_lock);
    }
}

/* Pinned device memory on `device`, not exportable. */
static void cuda_vmm_prop(cu_mem_allocation_prop *prop, int device)
{
    memset(prop, 0, sizeof *prop);
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop->location.id = device;
}

static int vmm_granularity_here(ap_backend *b, int device, size_t *granularity)
{
    cu_mem_allocation_prop prop;

    cuda_vmm_prop(&prop, device);
    return IMPL(b)->cuMemGetAllocationGranularity(granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
}

static int vmm_reserve_here(ap_backend *b, size_t size, void **va)
{
    CUdeviceptr ptr = 0;
    int rc = IMPL(b)->cuMemAddressReserve(&ptr, size, 0, 0, 0);

    if (rc == 0)
        *va = (void *)(uintptr_t)ptr;
    return rc;
}

static int vmm_create_here(ap_backend *b, int device, size_t size, void **handle)
{
    cu_mem_allocation_prop prop;
    CUmemGenericAllocationHandle h = 0;
    int rc;

    cuda_vmm_prop(&prop, device);
    rc = IMPL(b)->cuMemCreate(&h, size, &prop, 0);
    if (rc == 0)
        *handle = (void *)(uintptr_t)h;
    return rc;
}

/* cuMemMap leaves the range inaccessible until cuMemSetAccess: grant the device read-write, and
   undo the map when that fails so that the caller sees one operation. */
static int vmm_map_here(ap_backend *b, int device, void *va, size_t size, void *handle)
{
    cuda_impl *im = IMPL(b);
    CUdeviceptr ptr = (CUdeviceptr)(uintptr_t)va;
    cu_mem_access_desc access;
    int rc = im->cuMemMap(ptr, size, 0, (CUmemGenericAllocationHandle)(uintptr_t)handle, 0);

    if (rc != 0)
        return rc;
    memset(&access, 0, sizeof access);
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    rc = im->cuMemSetAccess(ptr, size, &access, 1);
    if (rc != 0)
        (void)im->cuMemUnmap(ptr, size);
    return rc;
}

static int cuda_vmm_granularity(ap_backend *b, int device, size_t *granularity)
{
    cuda_vmm_names_once(b);
    CUDA_ON_DEVICE(b, device, vmm_granularity_here(b, device, granularity));
}

static int cuda_vmm_reserve(ap_backend *b, int device, size_t size, void **va)
{
    cuda_vmm_names_once(b);
    CUDA_ON_DEVICE(b, device, vmm_reserve_here(b, size, va));
}

static int cuda_vmm_release(ap_backend *b, int device, void *va, size_t size)
{
    cuda_vmm_names_once(b);
    CUDA_ON_DEVICE(b, device, IMPL(b)->cuMemAddressFree((CUdeviceptr)(uintptr_t)va, size));
}

static int cuda_vmm_create(ap_backend *b, int device, size_t size, void **handle)
{
    cuda_vmm_names_once(b);
    CUDA_ON_DEVICE(b, device, vmm_create_here(b, device, size, handle));
}

static int cuda_vmm_free(ap_backend *b, int device, void *handle)
{
    cuda_vmm_names_once(b);
    CUDA_ON_DEVICE(b, device, IMPL(b)->cuMemRelease((CUmemGenericAllocationHandle)(uintptr_t)handle));
}

static int cuda_vmm_map(ap_backend *b, int device, void *va, size_t size, void *handle)
{
    cuda_vmm_names_once(b);
    CUDA_ON_DEVICE(b, device, vmm_map_here(b, device, va, size, handle));
}

static int cuda_vmm_unmap(ap_backend *b, int device, void *va, size_t size)
{
    cuda_vmm_names_once(b);
    CUDA_ON_DEVICE(b, device, IMPL(b)->cuMemUnmap((CUdeviceptr)(uintptr_t)va, size));
}

/* has_vmm == 0: the table still holds callable entries, which refuse. */
static int cuda_vmm_absent_granularity(ap_backend *b, int d, size_t *g) { (void)b; (void)d; (void)g; return AP_ERR_MISSING_SYMBOL; }
static int cuda_vmm_absent_reserve(ap_backend *b, int d, size_t s, void **v) { (void)b; (void)d; (void)s; (void)v; return AP_ERR_MISSING_SYMBOL; }
static int cuda_vmm_absent_range(ap_backend *b, int d, void *v, size_t s) { (void)b; (void)d; (void)v; (void)s; return AP_ERR_MISSING_SYMBOL; }
static int cuda_vmm_absent_create(ap_backend *b, int d, size_t s, void **h) { (void)b; (void)d; (void)s; (void)h; return AP_ERR_MISSING_SYMBOL; }
static int cuda_vmm_absent_free(ap_backend *b, int d, void *h) { (void)b; (void)d; (void)h; return AP_ERR_MISSING_SYMBOL; }
static int cuda_vmm_absent_map(ap_backend *b, int d, void *v, size_t s, void *h) { (void)b; (void)d; (void)v; (void)s; (void)h; return AP_ERR_MISSING_SYMBOL; }

/* ---- sharing between processes (IPC) ------------------------------------------------------ */

static const char *const cuda_ipc_names[] = {"cudaIpcGetMemHandle", "cudaIpcOpenMemHandle", "cudaIpcCloseMemHandle"};
#define CUDA_IPC_NAMES (int)(sizeof cuda_ipc_names / sizeof cuda_ipc_names[0])

static int cuda_ipc_lookup(cuda_impl *im, void *lib)
{
    void *f[CUDA_IPC_NAMES];
    int i;

    for (i = 0; i < CUDA_IPC_NAMES; i++)
        if (!(f[i] = dlsym(lib, cuda_ipc_names[i])))
            return 0;
    im->cudaIpcGetMemHandle = (__typeof__(im->cudaIpcGetMemHandle))f[0];
    im->cudaIpcOpenMemHandle = (__typeof__(im->cudaIpcOpenMemHandle))f[1];
    im->cudaIpcCloseMemHandle = (__typeof__(im->cudaIpcCloseMemHandle))f[2];
    pthread_mutex_init(&im->ipc_lock, NULL);
    return 1;
}

static pthread_mutex_t ipc_record_lock = PTHREAD_MUTEX_INITIALIZER;

static void cuda_ipc_record(ap_backend *b)
{
    cuda_impl *im = IMPL(b);
    int i;

    if (__atomic_load_n(&im->ipc_recorded, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&ipc_record_lock);
    if (!im->ipc_recorded) {
        for (i = 0; i < CUDA_IPC_NAMES; i++)
            (void)ap_resolve(b->lib, &im->base, cuda_ipc_names[i]);
        __atomic_store_n(&im->ipc_recorded, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&ipc_record_lock);
}

#define cudaErrorInvalidValue 1

/* CUDA exports the whole allocation containing ptr (size is not the runtime's business); any
   process that has the handle may open it: flags and pids have nothing to act on. */
static int ipc_get_handle(ap_backend *b, int device, cuda_ipc_handle *h, void *ptr)
{
    CUDA_ON_DEVICE(b, device, IMPL(b)->cudaIpcGetMemHandle(h, ptr));
}

static int ipc_open_handle(ap_backend *b, int device, void **ptr, cuda_ipc_handle h)
{
    CUDA_ON_DEVICE(b, device, IMPL(b)->cudaIpcOpenMemHandle(ptr, h, cudaIpcMemLazyEnablePeerAccess));
}

static int ipc_close_handle(ap_backend *b, int device, void *ptr)
{
    CUDA_ON_DEVICE(b, device, IMPL(b)->cudaIpcCloseMemHandle(ptr));
}

static int cuda_ipc_export(ap_backend *b, int device, void *ptr, size_t size, char *key, size_t keylen,
                           unsigned flags)
{
    static const char hex[] = "0123456789abcdef";
    cuda_ipc_handle h;
    int rc, i;

    (void)size;
    (void)flags;
    cuda_ipc_record(b);
    if (!key || keylen < 2 * sizeof h.reserved + 1)
        return cudaErrorInvalidValue;
    memset(&h, 0, sizeof h);
    if ((rc = ipc_get_handle(b, device, &h, ptr)) != 0)
        return rc;
    for (i = 0; i < (int)sizeof h.reserved; i++) {
        key[2 * i] = hex[(unsigned char)h.reserved[i] >> 4];
        key[2 * i + 1] = hex[(unsigned char)h.reserved[i] & 15];
    }
    key[2 * sizeof h.reserved] = '\0';
    return 0;
}

static int cuda_ipc_set_pids(ap_backend *b, int device, const char *key, const int32_t *pids, size_t n)
{
    (void)b;
    (void)device;
    (void)key;
    (void)pids;
    (void)n;
    return 0;
}

static int hex_value(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* `peer` changes nothing: cudaIpcMemLazyEnablePeerAccess enables peer access only when needed. */
static int cuda_ipc_import(ap_backend *b, int device, const char *key, int peer, void **ptr, size_t *size)
{
    cuda_impl *im = IMPL(b);
    cuda_ipc_handle h;
    cuda_ipc_entry *m;
    int rc, i;

    (void)peer;
    cuda_ipc_record(b);
    if (size)
        *size = 0;
    if (!key || strlen(key) != 2 * sizeof h.reserved)
        return cudaErrorInvalidValue;
    for (i = 0; i < (int)sizeof h.reserved; i++) {
        int hi = hex_value(key[2 * i]), lo = hex_value(key[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return cudaErrorInvalidValue;
        h.reserved[i] = (char)(hi << 4 | lo);
    }
    pthread_mutex_lock(&im->ipc_lock);
    for (m = im->imports; m; m = m->next)
        if (strcmp(m->key, key) == 0)
            break;
    if (m) { /* CUDA refuses to open a handle twice in one process: share the mapping */
        m->count++;
        *ptr = m->ptr;
        pthread_mutex_unlock(&im->ipc_lock);
        return 0;
    }
    m = calloc(1, sizeof *m);
    rc = m ? ipc_open_handle(b, device, ptr, h) : 2 /* cudaErrorMemoryAllocation */;
    if (rc == 0) {
        snprintf(m->key, sizeof m->key, "%s", key);
        m->ptr = *ptr;
        m->count = 1;
        m->next = im->imports;
        im->imports = m;
    } else {
        free(m);
    }
    pthread_mutex_unlock(&im->ipc_lock);
    return rc;
}

/* Importer: the last close unmaps. Exporter: CUDA has nothing to withdraw (cudaFree of the
   allocation is the end of the export; CUDA keeps it alive for importers that still map it). */
static int cuda_ipc_close(ap_backend *b, int device, const char *key)
{
    cuda_impl *im = IMPL(b);
    cuda_ipc_entry **pp, *m = NULL;
    int rc = 0;

    cuda_ipc_record(b);
    if (!key)
        return cudaErrorInvalidValue;
    pthread_mutex_lock(&im->ipc_lock);
    for (pp = &im->imports; *pp; pp = &(*pp)->next)
        if (strcmp((*pp)->key, key) == 0) {
            m = *pp;
            break;
        }
    if (m && --m->count == 0) {
        *pp = m->next;
        rc = ipc_close_handle(b, device, m->ptr);
        free(m);
    }
    pthread_mutex_unlock(&im->ipc_lock);
    return rc;
}

static int cuda_ipc_absent_export(ap_backend *b, int d, void *p, size_t s, char *k, size_t l, unsigned f) { (void)b; (void)d; (void)p; (void)s; (void)k; (void)l; (void)f; return AP_ERR_MISSING_SYMBOL; }
static int cuda_physical_device(ap_backend *b, int device, int *physical)
{
    (void)b;
    *physical = device;
    return 0;
}

/* CUDA IPC checks no pids: the process's own pid is its id (what a CUDA pids list would hold). */
static int cuda_node_pid(ap_backend *b, int32_t *pid)
{
    (void)b;
    *pid = (int32_t)getpid();
    return 0;
}

static int cuda_ipc_absent_set_pids(ap_backend *b, int d, const char *k, const int32_t *p, size_t n) { (void)b; (void)d; (void)k; (void)p; (void)n; return AP_ERR_MISSING_SYMBOL; }
static int cuda_ipc_absent_import(ap_backend *b, int d, const char *k, int peer, void **p, size_t *s) { (void)b; (void)d; (void)k; (void)peer; (void)p; (void)s; return AP_ERR_MISSING_SYMBOL; }
static int cuda_ipc_absent_close(ap_backend *b, int d, const char *k) { (void)b; (void)d; (void)k; return AP_ERR_MISSING_SYMBOL; }

static int cuda_event_create(ap_backend *b, int device, void **event)
{
    CUDA_ON_DEVICE(b, device, IMPL(b)->cudaEventCreateWithFlags(event, cudaEventDisableTiming));
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
    CUDA_ON_DEVICE(b, device, IMPL(b)->cudaStreamCreate(stream));
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
/* Unless a path is given, a libcudart already loaded in the process comes first: torch loads the
   one of its wheel (libcudart.so.12) while the machine may have CUDA 13 on the loader path, and
   two runtimes in one process do not share contexts, streams or events. */
static void *cuda_load(const char *path, char *found, size_t foundlen, char *err, size_t errlen)
{
    static const char *const names[] = {"libcudart.so", "libcudart.so.12", "libcudart.so.13",
                                        "libcudart.so.11.0"};
    size_t i, n = path ? 1 : sizeof names / sizeof names[0];
    void *loaded = path ? NULL : ap_find_loaded("libcudart.so", NULL, 0, found, foundlen);

    if (loaded)
        return loaded;
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
    RESOLVE(cudaGetDevice);
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
    b->device_retain = cuda_device_retain;
    b->device_release = cuda_device_retain;
    b->stream_device = cuda_stream_device;
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
    b->has_vmm = 0; /* set below once a device is known to work */
    b->vmm_granularity = cuda_vmm_absent_granularity;
    b->vmm_reserve = cuda_vmm_absent_reserve;
    b->vmm_release = cuda_vmm_absent_range;
    b->vmm_create = cuda_vmm_absent_create;
    b->vmm_free = cuda_vmm_absent_free;
    b->vmm_map = cuda_vmm_absent_map;
    b->vmm_unmap = cuda_vmm_absent_range;
    b->has_ipc = cuda_ipc_lookup(im, b->lib);
    b->ipc_export = b->has_ipc ? cuda_ipc_export : cuda_ipc_absent_export;
    b->ipc_set_pids = b->has_ipc ? cuda_ipc_set_pids : cuda_ipc_absent_set_pids;
    b->ipc_import = b->has_ipc ? cuda_ipc_import : cuda_ipc_absent_import;
    b->ipc_close = b->has_ipc ? cuda_ipc_close : cuda_ipc_absent_close;
    b->node_pid = cuda_node_pid;
    b->physical_device = cuda_physical_device;

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
    if (cuda_vmm_lookup(im)) {
        b->has_vmm = 1;
        b->vmm_granularity = cuda_vmm_granularity;
        b->vmm_reserve = cuda_vmm_reserve;
        b->vmm_release = cuda_vmm_release;
        b->vmm_create = cuda_vmm_create;
        b->vmm_free = cuda_vmm_free;
        b->vmm_map = cuda_vmm_map;
        b->vmm_unmap = cuda_vmm_unmap;
    }
    return 0;
}

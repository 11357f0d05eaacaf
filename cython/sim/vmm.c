/* Virtual memory: aclrtReserveMemAddress / aclrtReleaseMemAddress, aclrtMallocPhysical /
 * aclrtFreePhysical, aclrtMapMem / aclrtUnmapMem, aclrtMemGetAllocationGranularity.
 *
 * Reservation: an inaccessible range of address space, mmap(PROT_NONE, MAP_NORESERVE), on a 2 MiB
 * boundary (1 GiB from 1 GiB up). flags is the page type (0 normal, 1 huge pages); under the
 * profiles with CANN 8.0's rule (cann8.0, strict) aclrtMapMem refuses a handle of the other type. It costs no device capacity: a 1 TiB
 * reservation on a 64 GiB device succeeds, and touching it faults (SIGSEGV) as a use of unmapped
 * device memory should.
 *
 * Physical memory: an extent of a per-device backing file (a memfd, sparse, created on first use),
 * charged to the device's node-wide capacity exactly like aclrtMalloc (same fault injection, same
 * 207001 past capacity). One file per device rather than one per handle: a full 64 GiB device in
 * 2 MiB pages would need 32768 descriptors. Extents are handed out by a bump pointer and never
 * reused; freeing punches the extent out of the file, which gives the pages back to the host.
 * Handles are registry serials (registry.c), so a garbage or freed handle is refused, never
 * dereferenced.
 *
 * Mapping: mmap(MAP_SHARED | MAP_FIXED) of the handle's extent over its place in the reservation,
 * read-write; unmapping puts mmap(PROT_NONE | MAP_FIXED) back. Both replace the range in one
 * system call, so the address space never has a hole another thread's mmap could land in. A
 * handle keeps its contents while unmapped, may be mapped at several places at once (as in
 * CUDA; they share the memory), and cannot be freed while any mapping of it remains. Mapped
 * pages are MADV_DONTFORK: a forked child, which has no runtime, cannot touch the parent's device
 * memory (as with a real NPU).
 *
 * Reads and fills (ascendsim_read / ascendsim_launch_fill) accept a range when it lies in one
 * reservation and every 2 MiB page of it is mapped (dmem.c asks sim_vmm_covered): a block may span
 * handles mapped side by side. Each reservation keeps, per 2 MiB page, the mapping there; it is
 * written under both this file's lock and the reservation tree's lock, and read by pins under the
 * tree's lock alone. aclrtUnmapMem clears the pages, waits for pins in flight, then remaps
 * PROT_NONE, so a fill never writes to memory that is being taken away; a fill queued behind the
 * unmap is dropped and counted, as for aclrtFree.
 *
 * Rules and codes follow CANN's acl layer and runtime (see the table at the top of acl_api.h):
 * argument checks of the acl layer answer 100000; what the runtime/driver refuses answers 107000.
 * Two points where the real runtime leaves room:
 *  - aclrtMallocPhysical rounds a size up to the granularity (CANN documents "not a multiple of
 *    2M: rounded up"), and capacity is charged the rounded size; aclrtMapMem needs the size given
 *    at allocation, which must be a granularity multiple, so an unaligned handle cannot be mapped.
 *  - Reservation sizes must be multiples of 2 MiB, alignment 0 and expectPtr NULL (the runtime's
 *    experimental fixed placement is not simulated). Mapping needs virPtr aligned to the handle's
 *    granularity and, as CANN documents, one reservation holds one device's memory at a time.
 * Every physical granularity is 2 MiB except the HUGE1G attributes (1 GiB); normal-page
 * attributes also get 2 MiB (ACL_HBM_MEM_NORMAL is documented to allocate huge pages anyway).
 * One mutex serialises every call here: they are rare (the pool maps on growth only).
 * Limit: vm.max_map_count (65530 by default) bounds mappings plus the gaps between them.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* memfd_create, fallocate */
#endif
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "sim_internal.h"

#define GRANULE SIM_HUGE_PAGE                  /* 2 MiB: huge pages, and the unit of resv.page */
#define GRANULE_1G ((size_t)1 << 30)
#define RESERVE_MAX ((size_t)1 << 46)          /* 64 TiB of address space per reservation */
#define BACKING_MAX ((uint64_t)1 << 50)        /* file offsets handed out per device and aclInit */
#define BACKING_STEP ((uint64_t)64 << 30)      /* the (sparse) backing file grows this much at once */

struct phys {
    struct sim_obj obj;  /* the handle */
    int device;
    size_t size;         /* as requested: what aclrtMapMem's size must equal */
    size_t bytes;        /* rounded up to the granularity: charged to capacity */
    size_t gran;
    int huge;            /* huge pages (2 MiB or 1 GiB): the reserve flag that matches it is 1 */
    uint64_t off;        /* extent [off, off + bytes) of the device's backing file */
    uint32_t maps;       /* live mappings; vmm_mu */
};

struct mapping {
    uintptr_t va;
    size_t size;
    struct phys *phys;   /* holds a reference */
};

struct resv {
    struct sim_alloc a;     /* first: the SIM_TREE_VMM entry (base, size, the mmap, pins) */
    struct mapping **page;  /* per 2 MiB page: its mapping, or NULL */
    size_t npages;
    size_t nmaps;
    int device;             /* device of the memory mapped here; -1 while nothing is */
    uint64_t flags;         /* aclrtReserveMemAddress's page flag: 0 normal, 1 huge pages */
};

struct backing {
    int has_fd;
    int fd;                 /* memfd of the device's physical memory */
    uint64_t next_off;
    uint64_t file_size;
};

struct counters {
    _Atomic uint64_t phys_mallocs, phys_frees, phys_bytes, maps, unmaps, mapped_bytes;
};

static pthread_mutex_t vmm_mu = PTHREAD_MUTEX_INITIALIZER;
static struct backing backing[SIM_MAX_DEVICES];
static struct counters counters[SIM_MAX_DEVICES];

/* ---- helpers ------------------------------------------------------------------------------- */

static void reset_counters(void)
{
    for (int d = 0; d < SIM_MAX_DEVICES; d++) {
        struct counters *c = &counters[d];
        atomic_store(&c->phys_mallocs, 0);
        atomic_store(&c->phys_frees, 0);
        atomic_store(&c->phys_bytes, 0);
        atomic_store(&c->maps, 0);
        atomic_store(&c->unmaps, 0);
        atomic_store(&c->mapped_bytes, 0);
    }
}

static void vmm_after_fork_in_child(void)
{
    pthread_mutex_init(&vmm_mu, NULL);
    for (int d = 0; d < SIM_MAX_DEVICES; d++) {
        if (backing[d].has_fd)
            close(backing[d].fd); /* the child's copy; the parent's pages stay the parent's */
        memset(&backing[d], 0, sizeof backing[d]);
    }
    reset_counters(); /* dmem.c and registry.c forget the reservations and handles */
}

__attribute__((constructor)) static void vmm_boot(void)
{
    pthread_atfork(NULL, NULL, vmm_after_fork_in_child);
}

/* Replaces [va, va+size) with inaccessible reserved address space, in one call. */
static int make_inaccessible(void *va, size_t size)
{
    void *got = mmap(va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    return got == MAP_FAILED ? -1 : 0;
}

/* Normal-page attributes: the ones aclrtReserveMemAddress flags 0 goes with (CANN 8.0.x). */
static int page_attr_normal(int attr)
{
    return attr == ACL_HBM_MEM_NORMAL || attr == ACL_MEM_NORMAL || attr == ACL_MEM_P2P_NORMAL ||
           attr == ACL_DDR_MEM_NORMAL || attr == ACL_DDR_MEM_P2P_NORMAL || attr == ACL_HBM_MEM_P2P_NORMAL;
}

/* Checks prop like the acl layer (100000), then the device id like the runtime (107001).
   Host physical memory exists in CANN but not in the simulated device (207000). */
static int check_prop(const aclrtPhysicalMemProp *prop, const char *call, int *dev, size_t *gran)
{
    if (prop->handleType != ACL_MEM_HANDLE_TYPE_NONE)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call,
                        "prop->handleType %d is not ACL_MEM_HANDLE_TYPE_NONE (0)", prop->handleType);
    if (prop->allocationType != ACL_MEM_ALLOCATION_TYPE_PINNED)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call,
                        "prop->allocationType %d is not ACL_MEM_ALLOCATION_TYPE_PINNED (0)",
                        prop->allocationType);
    int type = prop->location.type;
    if (type != ACL_MEM_LOCATION_TYPE_DEVICE && type != ACL_MEM_LOCATION_TYPE_HOST &&
        type != ACL_MEM_LOCATION_TYPE_HOST_NUMA)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call,
                        "prop->location.type %d is not ACL_MEM_LOCATION_TYPE_DEVICE (1)", type);
    switch (prop->memAttr) {
    case ACL_HBM_MEM_HUGE:
    case ACL_HBM_MEM_NORMAL:
    case ACL_MEM_NORMAL:
    case ACL_MEM_HUGE:
    case ACL_MEM_P2P_NORMAL:
    case ACL_MEM_P2P_HUGE:
        *gran = GRANULE;
        break;
    case ACL_HBM_MEM_HUGE1G:
    case ACL_MEM_HUGE1G:
    case ACL_MEM_P2P_HUGE1G:
        *gran = GRANULE_1G;
        break;
    case ACL_DDR_MEM_HUGE:
    case ACL_DDR_MEM_NORMAL:
    case ACL_DDR_MEM_P2P_HUGE:
    case ACL_DDR_MEM_P2P_NORMAL:
        if (type == ACL_MEM_LOCATION_TYPE_DEVICE)
            return sim_fail(ACL_ERROR_INVALID_PARAM, call,
                            "prop->memAttr %d is host (DDR) memory, not for a device location",
                            prop->memAttr);
        *gran = GRANULE;
        break;
    default:
        return sim_fail(ACL_ERROR_INVALID_PARAM, call,
                        "prop->memAttr %d is not a physical-memory attribute (ACL_HBM_MEM_HUGE 4, "
                        "ACL_HBM_MEM_NORMAL 5, ACL_HBM_MEM_HUGE1G 10, ACL_MEM_NORMAL..ACL_MEM_P2P_HUGE1G "
                        "12..17)", prop->memAttr);
    }
    if (type != ACL_MEM_LOCATION_TYPE_DEVICE)
        return sim_fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, call,
                        "host physical memory (prop->location.type %d) is not simulated: the "
                        "simulated device has HBM only", type);
    if (prop->location.id >= (uint32_t)g_sim.cfg.devices)
        return sim_fail(ACL_ERROR_RT_INVALID_DEVICEID, call,
                        "prop->location.id %u is out of range: this node has %d devices (0..%d)",
                        prop->location.id, g_sim.cfg.devices, g_sim.cfg.devices - 1);
    *dev = (int)prop->location.id;
    return 0;
}

/* Takes [*off, *off + bytes) of the device's backing file, creating or growing it. vmm_mu held.
   Returns 0 or an errno. */
static int backing_take(int dev, size_t bytes, uint64_t *off)
{
    struct backing *bk = &backing[dev];
    if (!bk->has_fd) {
        int fd = memfd_create("ascendsim-hbm", MFD_CLOEXEC);
        if (fd < 0)
            return errno;
        bk->fd = fd;
        bk->has_fd = 1;
        bk->next_off = bk->file_size = 0;
    }
    if (bytes > BACKING_MAX - bk->next_off)
        return ENOSPC;
    uint64_t end = bk->next_off + bytes;
    if (end > bk->file_size) {
        uint64_t grown = (end + BACKING_STEP - 1) / BACKING_STEP * BACKING_STEP;
        if (ftruncate(bk->fd, (off_t)grown) != 0)
            return errno;
        bk->file_size = grown;
    }
    *off = bk->next_off;
    bk->next_off = end;
    return 0;
}

/* Gives an extent's bytes back to the host (punched out of the file), the node and the process. */
static void give_back(int dev, uint64_t off, size_t bytes)
{
    struct backing *bk = &backing[dev];
    if (bk->has_fd)
        (void)fallocate(bk->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)off, (off_t)bytes);
    sim_uncharge(dev, bytes);
}

/* The last reference to a handle went: aclrtFreePhysical, or aclFinalize. */
static void phys_destroy(struct sim_obj *o)
{
    struct phys *p = (struct phys *)o;
    give_back(p->device, p->off, p->bytes);
    atomic_fetch_sub(&g_sim.dev[p->device].held, p->bytes);
    atomic_fetch_sub(&counters[p->device].phys_bytes, p->bytes);
    atomic_fetch_add(&counters[p->device].phys_frees, 1);
    free(p);
}

/* The reservation containing [va, va+n) (n 0: the byte at va), or NULL. vmm_mu held. */
static struct resv *find_resv(const void *va, size_t n)
{
    return (struct resv *)sim_alloc_lookup(SIM_TREE_VMM, va, n);
}

/* ---- granularity --------------------------------------------------------------------------- */

SIM_EXPORT aclError aclrtMemGetAllocationGranularity(aclrtPhysicalMemProp *prop, int option,
                                                     size_t *granularity)
{
    static const char call[] = "aclrtMemGetAllocationGranularity";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!prop || !granularity)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "prop or granularity is NULL");
    if (option != ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM && option != ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call,
                        "option %d is not ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM (0) or _RECOMMENDED (1)",
                        option);
    int dev;
    size_t gran;
    if ((rc = check_prop(prop, call, &dev, &gran)) != 0)
        return rc;
    *granularity = gran;
    return ACL_SUCCESS;
}

/* ---- address space ------------------------------------------------------------------------- */

SIM_EXPORT aclError aclrtReserveMemAddress(void **virPtr, size_t size, size_t alignment,
                                           void *expectPtr, uint64_t flags)
{
    static const char call[] = "aclrtReserveMemAddress";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!virPtr)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "virPtr is NULL");
    if (size == 0)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "size is 0");
    if (flags > 1)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "flags %llu is not 0 (or 1, the page flag)",
                        (unsigned long long)flags);
    if (alignment != 0)
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call, "alignment %zu is reserved and must be 0",
                        alignment);
    if (expectPtr)
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                        "expectPtr %p: placing a reservation at a chosen address is not simulated "
                        "(experimental in CANN); pass NULL", expectPtr);
    if (size % GRANULE)
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                        "size %zu is not a multiple of the 2 MiB granularity", size);
    if (size > RESERVE_MAX)
        return sim_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call,
                        "size %zu is more than the %zu bytes one reservation may span", size,
                        (size_t)RESERVE_MAX);
    size_t align = size >= GRANULE_1G ? GRANULE_1G : GRANULE;
    struct resv *r = calloc(1, sizeof *r);
    struct mapping **page = calloc(size / GRANULE, sizeof *page); /* large: mmap'ed, zero lazily */
    if (!r || !page) {
        free(r);
        free(page);
        return sim_fail(ACL_ERROR_RT_RESOURCE_ALLOC_FAIL, call, "out of host memory");
    }
    char *raw = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) {
        int err = errno;
        free(r);
        free(page);
        return sim_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call,
                        "the host could not reserve %zu bytes of address space (%s)", size, strerror(err));
    }
    /* Over-reserve, then trim both ends so the range starts on the boundary. */
    char *start = (char *)(((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1));
    if (start > raw)
        munmap(raw, (size_t)(start - raw));
    size_t tail = (size_t)(raw + size + align - (start + size));
    if (tail)
        munmap(start + size, tail);
    r->a.base = (uintptr_t)start;
    r->a.size = size;
    r->a.map = start;
    r->a.map_len = size;
    r->a.device = -1;
    r->page = page;
    r->npages = size / GRANULE;
    r->device = -1;
    r->flags = flags;
    pthread_mutex_lock(&vmm_mu);
    sim_alloc_insert(SIM_TREE_VMM, &r->a);
    pthread_mutex_unlock(&vmm_mu);
    *virPtr = start;
    return ACL_SUCCESS;
}

SIM_EXPORT aclError aclrtReleaseMemAddress(void *virPtr)
{
    static const char call[] = "aclrtReleaseMemAddress";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!virPtr)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "virPtr is NULL");
    pthread_mutex_lock(&vmm_mu);
    struct resv *r = find_resv(virPtr, 0);
    if (!r || r->a.base != (uintptr_t)virPtr) {
        rc = r ? sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                          "%p is inside the reservation at %p: pass its base", virPtr, (void *)r->a.base)
               : sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                          "%p is not a reservation from aclrtReserveMemAddress (never reserved, or "
                          "released already)", virPtr);
        pthread_mutex_unlock(&vmm_mu);
        return rc;
    }
    if (r->nmaps) {
        rc = sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                      "the reservation at %p still has %zu mapping(s) in it: aclrtUnmapMem them first",
                      virPtr, r->nmaps);
        pthread_mutex_unlock(&vmm_mu);
        return rc;
    }
    sim_alloc_remove(SIM_TREE_VMM, virPtr);
    pthread_mutex_unlock(&vmm_mu);
    sim_alloc_wait_unpinned(&r->a); /* nothing mapped: only a pin that is already failing */
    munmap(r->a.map, r->a.map_len);
    free(r->page);
    free(r);
    return ACL_SUCCESS;
}

/* ---- physical memory ----------------------------------------------------------------------- */

/* Failure order as in memory.c: latency, "fail the Nth malloc", "fail after bytes", capacity. */
SIM_EXPORT aclError aclrtMallocPhysical(aclrtDrvMemHandle *handle, size_t size,
                                        const aclrtPhysicalMemProp *prop, uint64_t flags)
{
    static const char call[] = "aclrtMallocPhysical";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!handle || !prop)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "handle or prop is NULL");
    if (size == 0)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "size is 0");
    if (flags != 0)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "flags %llu is reserved and must be 0",
                        (unsigned long long)flags);
    int dev;
    size_t gran;
    if ((rc = check_prop(prop, call, &dev, &gran)) != 0)
        return rc;
    uint64_t total = g_sim.cfg.hbm;
    if (size > total)
        return sim_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call,
                        "%zu bytes requested, more than device %d's %llu bytes of HBM", size, dev,
                        (unsigned long long)total);
    size_t bytes = (size + gran - 1) / gran * gran;

    if ((rc = sim_charge(dev, bytes, call)) != 0)
        return rc;
    struct phys *p = calloc(1, sizeof *p);
    int err = p ? 0 : ENOMEM;
    if (p) {
        pthread_mutex_lock(&vmm_mu);
        err = backing_take(dev, bytes, &p->off);
        pthread_mutex_unlock(&vmm_mu);
    }
    if (err) {
        free(p);
        sim_uncharge(dev, bytes); /* nothing of the file was taken */
        return sim_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call,
                        "the host could not back %zu bytes of physical memory (%s)", bytes, strerror(err));
    }
    sim_obj_init(&p->obj, SIM_H_PHYS, phys_destroy);
    p->device = dev;
    p->size = size;
    p->bytes = bytes;
    p->gran = gran;
    p->huge = !page_attr_normal(prop->memAttr);
    if (sim_reg_add(&p->obj) != 0) {
        give_back(dev, p->off, bytes);
        free(p);
        return sim_fail(ACL_ERROR_RT_RESOURCE_ALLOC_FAIL, call, "out of host memory");
    }
    atomic_fetch_add(&g_sim.dev[dev].held, bytes);
    atomic_fetch_add(&counters[dev].phys_bytes, bytes);
    atomic_fetch_add(&counters[dev].phys_mallocs, 1);
    *handle = SIM_HANDLE(&p->obj);
    return ACL_SUCCESS;
}

SIM_EXPORT aclError aclrtFreePhysical(aclrtDrvMemHandle handle)
{
    static const char call[] = "aclrtFreePhysical";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!handle)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "handle is NULL");
    sim_fault_free_latency();
    pthread_mutex_lock(&vmm_mu);
    struct sim_obj *o = sim_reg_get(handle, SIM_H_PHYS);
    if (!o) {
        pthread_mutex_unlock(&vmm_mu);
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                        "%p is not a live physical memory handle (never allocated, or freed already)",
                        handle);
    }
    struct phys *p = (struct phys *)o;
    if (p->maps) {
        rc = sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                      "handle %p is still mapped (%u mapping(s)): aclrtUnmapMem first", handle, p->maps);
        pthread_mutex_unlock(&vmm_mu);
        sim_obj_unref(o);
        return rc;
    }
    sim_reg_take(handle, SIM_H_PHYS); /* the registry's reference is ours now */
    pthread_mutex_unlock(&vmm_mu);
    sim_obj_unref(o);
    sim_obj_unref(o); /* -> phys_destroy */
    return ACL_SUCCESS;
}

/* ---- mapping ------------------------------------------------------------------------------- */

SIM_EXPORT aclError aclrtMapMem(void *virPtr, size_t size, size_t offset, aclrtDrvMemHandle handle,
                                uint64_t flags)
{
    static const char call[] = "aclrtMapMem";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!virPtr || !handle)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "virPtr or handle is NULL");
    if (size == 0)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "size is 0");
    if (flags != 0)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "flags %llu is reserved and must be 0",
                        (unsigned long long)flags);
    if (offset != 0)
        return sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                        "offset %zu: only 0 is supported (a handle is mapped whole)", offset);
    uintptr_t va = (uintptr_t)virPtr;
    pthread_mutex_lock(&vmm_mu);
    struct sim_obj *o = sim_reg_get(handle, SIM_H_PHYS);
    struct phys *p = (struct phys *)o;
    struct resv *r = NULL;
    if (!o) {
        rc = sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                      "%p is not a live physical memory handle (never allocated, or freed already)", handle);
    } else if (size != p->size) {
        rc = sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                      "size %zu is not the size of the physical allocation (%zu bytes)", size, p->size);
    } else if (size % p->gran) {
        rc = sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                      "size %zu is not a multiple of the handle's %zu-byte granularity (an allocation "
                      "of such a size cannot be mapped)", size, p->gran);
    } else if (va % p->gran) {
        rc = sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                      "%p is not aligned to the handle's %zu-byte granularity", virPtr, p->gran);
    } else if (!(r = find_resv(virPtr, size))) {
        rc = sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                      "[%p, +%zu bytes) is not inside one reservation from aclrtReserveMemAddress",
                      virPtr, size);
    } else if (g_sim.cfg.profile.reserve_flags_match && r->flags != (uint64_t)p->huge) {
        /* CANN 8.0.x: "the flag must be the same as the memory type of aclrtMallocPhysical"
           (docs/cann-rules.md R1). No code is documented: the runtime's parameter code. */
        rc = sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                      "the reservation at %p was made with flags %llu (%s pages) but this handle "
                      "holds %s pages: CANN 8.0 requires aclrtReserveMemAddress flags to match the "
                      "physical memory type (0 normal, 1 huge) [profile %s]",
                      (void *)r->a.base, (unsigned long long)r->flags, r->flags ? "huge" : "normal",
                      p->huge ? "huge" : "normal", g_sim.cfg.profile.name);
    } else if (r->nmaps && r->device != p->device) {
        rc = sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                      "the reservation at %p holds device %d's memory; one reservation cannot map "
                      "two devices' memory (this handle is device %d's)",
                      (void *)r->a.base, r->device, p->device);
    } else {
        size_t first = (va - r->a.base) / GRANULE, n = size / GRANULE;
        for (size_t i = 0; i < n && rc == 0; i++) {
            const struct mapping *m = r->page[first + i];
            if (m)
                rc = sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                              "[%p, +%zu bytes) overlaps the mapping at %p (+%zu bytes)", virPtr, size,
                              (void *)m->va, m->size);
        }
    }
    struct mapping *m = NULL;
    if (rc == 0 && !(m = malloc(sizeof *m)))
        rc = sim_fail(ACL_ERROR_RT_RESOURCE_ALLOC_FAIL, call, "out of host memory");
    if (rc == 0) {
        void *got = mmap(virPtr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                         backing[p->device].fd, (off_t)p->off);
        if (got == MAP_FAILED) {
            int err = errno;
            (void)make_inaccessible(virPtr, size); /* in case the kernel dropped the old range */
            rc = sim_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call,
                          "the host could not map %zu bytes at %p (%s; vm.max_map_count bounds the "
                          "number of mappings)", size, virPtr, strerror(err));
        }
    }
    if (rc != 0) {
        pthread_mutex_unlock(&vmm_mu);
        free(m);
        if (o)
            sim_obj_unref(o);
        return rc;
    }
    (void)madvise(virPtr, size, MADV_HUGEPAGE); /* only advice: THP for shmem is often off */
    (void)madvise(virPtr, size, MADV_DONTFORK);
    m->va = va;
    m->size = size;
    m->phys = p; /* keeps the reference taken by sim_reg_get */
    size_t first = (va - r->a.base) / GRANULE, n = size / GRANULE;
    sim_alloc_lock(SIM_TREE_VMM); /* from here, reads and fills of these pages pass */
    for (size_t i = 0; i < n; i++)
        r->page[first + i] = m;
    r->nmaps++;
    r->device = r->a.device = p->device;
    sim_alloc_unlock(SIM_TREE_VMM);
    p->maps++;
    atomic_fetch_add(&counters[p->device].maps, 1);
    atomic_fetch_add(&counters[p->device].mapped_bytes, size);
    pthread_mutex_unlock(&vmm_mu);
    return ACL_SUCCESS;
}

/* Like aclrtFree, does not wait for queued work: fills that reach these pages later are dropped. */
SIM_EXPORT aclError aclrtUnmapMem(void *virPtr)
{
    static const char call[] = "aclrtUnmapMem";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!virPtr)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "virPtr is NULL");
    uintptr_t va = (uintptr_t)virPtr;
    pthread_mutex_lock(&vmm_mu);
    struct resv *r = find_resv(virPtr, 0);
    struct mapping *m = r ? r->page[(va - r->a.base) / GRANULE] : NULL;
    if (!r || !m || m->va != va) {
        if (!r)
            rc = sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                          "%p is not in any reservation from aclrtReserveMemAddress", virPtr);
        else if (!m)
            rc = sim_fail(ACL_ERROR_RT_PARAM_INVALID, call, "nothing is mapped at %p", virPtr);
        else
            rc = sim_fail(ACL_ERROR_RT_PARAM_INVALID, call,
                          "%p is inside the mapping at %p (+%zu bytes): pass its start", virPtr,
                          (void *)m->va, m->size);
        pthread_mutex_unlock(&vmm_mu);
        return rc;
    }
    size_t first = (va - r->a.base) / GRANULE, n = m->size / GRANULE;
    sim_alloc_lock(SIM_TREE_VMM); /* from here, new reads and fills of these pages fail */
    for (size_t i = 0; i < n; i++)
        r->page[first + i] = NULL;
    if (--r->nmaps == 0)
        r->device = r->a.device = -1;
    sim_alloc_unlock(SIM_TREE_VMM);
    sim_alloc_wait_unpinned(&r->a); /* those in flight finish first */
    if (make_inaccessible(virPtr, m->size) != 0)
        rc = sim_fail(ACL_ERROR_RT_INTERNAL_ERROR, call,
                      "the host could not make [%p, +%zu bytes) inaccessible again (%s)", virPtr,
                      m->size, strerror(errno));
    struct phys *p = m->phys;
    p->maps--;
    atomic_fetch_add(&counters[p->device].unmaps, 1);
    atomic_fetch_sub(&counters[p->device].mapped_bytes, m->size);
    pthread_mutex_unlock(&vmm_mu);
    sim_obj_unref(&p->obj);
    free(m);
    return rc;
}

/* ---- runtime hooks ------------------------------------------------------------------------- */

int sim_vmm_covered(const struct sim_alloc *a, uintptr_t p, size_t n)
{
    const struct resv *r = (const struct resv *)a;
    size_t first = (p - a->base) / GRANULE;
    size_t last = (p + (n ? n : 1) - 1 - a->base) / GRANULE;
    for (size_t g = first; g <= last; g++)
        if (!r->page[g])
            return 0;
    return 1;
}

void sim_vmm_finalize(void)
{
    pthread_mutex_lock(&vmm_mu);
    struct sim_alloc **all;
    size_t n = sim_alloc_take_all(SIM_TREE_VMM, &all);
    for (size_t i = 0; i < n; i++) {
        struct resv *r = (struct resv *)all[i];
        sim_alloc_wait_unpinned(&r->a);
        for (size_t g = 0; g < r->npages;) {
            struct mapping *m = r->page[g];
            if (!m) {
                g++;
                continue;
            }
            g += m->size / GRANULE;
            m->phys->maps--;
            sim_obj_unref(&m->phys->obj); /* the last reference once the registry let go */
            free(m);
        }
        munmap(r->a.map, r->a.map_len);
        free(r->page);
        free(r);
    }
    free(all);
    for (int d = 0; d < SIM_MAX_DEVICES; d++) {
        if (backing[d].has_fd)
            close(backing[d].fd);
        memset(&backing[d], 0, sizeof backing[d]);
    }
    reset_counters();
    pthread_mutex_unlock(&vmm_mu);
}

void sim_vmm_stats(int dev, uint64_t out[SIM_VMM_NSTATS])
{
    struct counters *c = &counters[dev];
    out[0] = atomic_load(&c->phys_mallocs);
    out[1] = atomic_load(&c->phys_frees);
    out[2] = atomic_load(&c->phys_bytes);
    out[3] = atomic_load(&c->maps);
    out[4] = atomic_load(&c->unmaps);
    out[5] = atomic_load(&c->mapped_bytes);
}

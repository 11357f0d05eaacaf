/* Device memory: aclrtMalloc, aclrtMallocAlign32, aclrtFree, aclrtGetMemInfo.
 *
 * Sizes follow the real runtime: aclrtMalloc rounds up to a multiple of 32 bytes and adds 32
 * bytes of padding (except on Ascend 950, profile 950, and for the 1 GiB-page policies),
 * aclrtMallocAlign32 only rounds. That rounded size is the extent that ascendsim_read/launch_fill
 * may touch; what an allocation takes from the device's capacity, and what aclrtGetMemInfo counts
 * as used (summed over every process of the node), is that size in whole 2 MiB pages when the
 * allocation is of huge pages (HUGE_ONLY, HUGE_FIRST above 1 MiB), else the size itself. Bases are
 * 64-byte aligned (page aligned in fact: each allocation is its own mapping, see dmem.c).
 *
 * Failure order for a valid call: injected latency, then "fail the Nth malloc", then
 * "fail after bytes" (this process's total across devices), then the node-wide capacity; every
 * one of them answers ACL_ERROR_RT_MEMORY_ALLOCATION (207001) as a full device does.
 */
#include <errno.h>
#include <string.h>

#include "sim_internal.h"

int sim_charge(int dev, size_t bytes, const char *call)
{
    sim_fault_malloc_latency();
    if (sim_fault_malloc_nth())
        return sim_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call,
                        "injected fault: this malloc was chosen to fail (fail_malloc_nth)");
    int64_t cap = sim_fault_after_bytes();
    uint64_t before = atomic_fetch_add(&g_sim.held_total, bytes);
    if (cap >= 0 && before + bytes > (uint64_t)cap) {
        atomic_fetch_sub(&g_sim.held_total, bytes);
        return sim_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call,
                        "injected fault: %zu more bytes would take this process to %llu device "
                        "bytes, above fail_after_bytes=%lld", bytes,
                        (unsigned long long)(before + bytes), (long long)cap);
    }
    int r = sim_node_reserve(dev, bytes);
    if (r != 0) {
        atomic_fetch_sub(&g_sim.held_total, bytes);
        if (r < 0)
            return sim_fail(ACL_ERROR_RT_INTERNAL_ERROR, call, "device %d's node record is unusable", dev);
        uint64_t used = sim_node_used(dev);
        return sim_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call,
                        "out of device memory: device %d has %llu of %llu bytes in use on node '%s' "
                        "(all processes of every user), %zu more requested", dev, (unsigned long long)used,
                        (unsigned long long)g_sim.cfg.hbm, g_sim.cfg.node, bytes);
    }
    return 0;
}

void sim_uncharge(int dev, size_t bytes)
{
    sim_node_release(dev, bytes);
    atomic_fetch_sub(&g_sim.held_total, bytes);
}

static aclError do_malloc(void **devPtr, size_t size, int policy, int pad, const char *call)
{
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!devPtr)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "devPtr is NULL");
    if (size == 0)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "size is 0");
    /* acl_rt.h's aclrtMemMallocPolicy: a page policy (0..7), which may carry a memory type
       (ACL_MEM_TYPE_LOW_BAND_WIDTH, ACL_MEM_TYPE_HIGH_BAND_WIDTH) and
       ACL_MEM_ACCESS_USER_SPACE_READONLY; GE and HCCL allocate with ACL_MEM_TYPE_HIGH_BAND_WIDTH
       alone (HUGE_FIRST plus the type). Before 2026-12-05 the simulator refused every such bit. */
    int page = policy & 0xff;
    if (policy < 0 || page > ACL_MEM_MALLOC_HUGE1G_ONLY_P2P || (policy & ~0xff & ~ACL_MEM_POLICY_FLAGS))
        return sim_fail(ACL_ERROR_INVALID_PARAM, call,
                        "policy 0x%x is not an aclrtMemMallocPolicy (0..7, with ACL_MEM_TYPE_LOW_BAND_WIDTH "
                        "0x100, ACL_MEM_TYPE_HIGH_BAND_WIDTH 0x1000 or ACL_MEM_ACCESS_USER_SPACE_READONLY "
                        "0x100000)", (unsigned)policy);
    policy = page;
    int dev;
    if ((rc = sim_current_device(call, &dev)) != 0)
        return rc;
    uint64_t total = g_sim.cfg.hbm;
    if (size > total)
        return sim_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call,
                        "%zu bytes requested, more than device %d's %llu bytes of HBM", size, dev,
                        (unsigned long long)total);
    /* The 32 bytes of padding: not on Ascend 950 (profile) nor for 1 GiB pages (CANN docs). */
    int huge1g = policy == ACL_MEM_MALLOC_HUGE1G_ONLY || policy == ACL_MEM_MALLOC_HUGE1G_ONLY_P2P;
    pad = pad && g_sim.cfg.profile.malloc_pad && !huge1g;
    size_t bytes = ((size + 31) & ~(size_t)31) + (pad ? 32 : 0);
    /* Huge pages are taken whole (acl_rt.h's aclrtMemAttr: ACL_HBM_MEM_HUGE "granularity 2M, a
       size short of a 2M multiple is rounded up to 2M"): HUGE_ONLY always, HUGE_FIRST above
       1 MiB. So aclrtMalloc(2 MiB), padded to 2 MiB + 32 bytes, takes 4 MiB of the device.
       (1 GiB pages are not modelled: charged as 2 MiB ones.) */
    int normal_only = policy == ACL_MEM_MALLOC_NORMAL_ONLY || policy == ACL_MEM_MALLOC_NORMAL_ONLY_P2P;
    int huge = !normal_only && (bytes > SIM_HUGE_PAGE / 2 || policy == ACL_MEM_MALLOC_HUGE_ONLY ||
                                policy == ACL_MEM_MALLOC_HUGE_ONLY_P2P);
    size_t charged = huge ? (bytes + SIM_HUGE_PAGE - 1) / SIM_HUGE_PAGE * SIM_HUGE_PAGE : bytes;
    if (charged > total)
        return sim_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call,
                        "%zu bytes requested take %zu bytes of huge pages, more than device %d's %llu bytes "
                        "of HBM", size, charged, dev, (unsigned long long)total);

    if ((rc = sim_charge(dev, charged, call)) != 0)
        return rc;
    struct sim_alloc *a = sim_alloc_map(bytes, SIM_BASE_ALIGN, !normal_only && bytes >= SIM_HUGE_PAGE);
    if (!a) {
        int err = errno;
        sim_uncharge(dev, charged);
        return sim_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call,
                        "the host could not map %zu bytes (%s; vm.max_map_count bounds the number "
                        "of live allocations)", bytes, strerror(err));
    }
    a->device = dev;
    a->charged = charged;
    sim_alloc_insert(SIM_TREE_DEVICE, a);
    struct sim_device *d = &g_sim.dev[dev];
    atomic_fetch_add(&d->held, charged);
    atomic_fetch_add(&d->mallocs, 1);
    *devPtr = (void *)a->base;
    return ACL_SUCCESS;
}

SIM_EXPORT aclError aclrtMalloc(void **devPtr, size_t size, int policy)
{
    return do_malloc(devPtr, size, policy, 1, "aclrtMalloc");
}

#if !ASCEND_SIM_LEGACY
SIM_EXPORT aclError aclrtMallocAlign32(void **devPtr, size_t size, int policy)
{
    return do_malloc(devPtr, size, policy, 0, "aclrtMallocAlign32");
}
#endif

/* Does not wait for work still using the memory (nor does the real one): fills that arrive
   later are dropped, see stream.c. Works from any thread, with or without a current device. */
SIM_EXPORT aclError aclrtFree(void *devPtr)
{
    static const char call[] = "aclrtFree";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!devPtr)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "devPtr is NULL");
    sim_fault_free_latency();
    /* Exported memory (ipc.c) is freed only once no live process imports it: checked and removed
       under the IPC lock, so that no import can start in between. */
    sim_ipc_lock();
    int busy = sim_ipc_free_check(devPtr, call);
    struct sim_alloc *a = busy ? NULL : sim_alloc_remove(SIM_TREE_DEVICE, devPtr);
    sim_ipc_unlock();
    if (busy)
        return busy;
    if (!a)
        return sim_fail(ACL_ERROR_RT_MEMORY_FREE, call,
                        "%p is not the base of a live device allocation (never allocated, already "
                        "freed, or inside another allocation)", devPtr);
    struct sim_device *d = &g_sim.dev[a->device];
    sim_uncharge(a->device, a->charged);
    atomic_fetch_sub(&d->held, a->charged);
    atomic_fetch_add(&d->frees, 1);
    a->poison = atomic_load(&g_sim.poison);
    if (a->poison)
        atomic_fetch_add(&d->poisoned_bytes, a->size);
    sim_alloc_release(SIM_TREE_DEVICE, a);
    return ACL_SUCCESS;
}

/* The current device's memory, node-wide: free = total - (rounded bytes held by every live process
   of the node). It is HBM, and the DDR attributes report 0 of 0 ("otherwise both are 0"), except
   on a DDR device (profile 310p: CANN's aclrtGetMemInfo page, Atlas inference and 200I/500 A2
   products have no HBM and convert an HBM query to the DDR one), where every attribute answers it. */
SIM_EXPORT aclError aclrtGetMemInfo(int attr, size_t *free, size_t *total)
{
    static const char call[] = "aclrtGetMemInfo";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!free || !total)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "free or total is NULL");
    if (attr < ACL_DDR_MEM || attr > ACL_MEM_P2P_HUGE1G)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "attr %d is not an aclrtMemAttr", attr);
    int dev;
    if ((rc = sim_current_device(call, &dev)) != 0)
        return rc;
    if (!g_sim.cfg.profile.ddr_device &&
        (attr == ACL_DDR_MEM || attr == ACL_DDR_MEM_HUGE || attr == ACL_DDR_MEM_NORMAL ||
         attr == ACL_DDR_MEM_P2P_HUGE || attr == ACL_DDR_MEM_P2P_NORMAL)) {
        *free = *total = 0;
        return ACL_SUCCESS;
    }
    uint64_t cap = g_sim.cfg.hbm, used = sim_node_used(dev);
    *total = (size_t)cap;
    *free = (size_t)(used >= cap ? 0 : cap - used);
    return ACL_SUCCESS;
}

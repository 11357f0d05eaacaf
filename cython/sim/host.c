/* Pinned host memory: aclrtMallocHost / aclrtFreeHost.
 *
 * Page-aligned mappings tracked like device memory (dmem.c), so a double free or an unknown
 * pointer is answered with ACL_ERROR_RT_MEMORY_FREE instead of corrupting anything. Host memory
 * does not count against device capacity. It is lock-page memory, resident by definition, so the
 * real call fails past the host's RAM: each allocation takes its size in whole pages from this
 * process's pinned budget (ASCEND_SIM_HOST_PINNED, default the host's physical memory) and
 * answers ACL_ERROR_RT_MEMORY_ALLOCATION past it (the mapping itself is NORESERVE and would
 * succeed for any size the address space holds). aclrtMallocHost needs a current context, as CANN's
 * (ApiImpl::HostMalloc); aclrtFreeHost works without one.
 */
#include <errno.h>
#include <string.h>
#include <unistd.h>

#include "sim_internal.h"

SIM_EXPORT aclError aclrtMallocHost(void **hostPtr, size_t size)
{
    static const char call[] = "aclrtMallocHost";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!hostPtr)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "hostPtr is NULL");
    if (size == 0)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "size is 0");
    /* CANN's HostMalloc needs a current context (107002 without); its HostFree does not. */
    int dev;
    if ((rc = sim_current_device(call, &dev)) != 0)
        return rc;
    size_t ps = (size_t)sysconf(_SC_PAGESIZE);
    uint64_t budget = g_sim.cfg.host_pinned;
    if (size > budget)
        return sim_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call,
                        "cannot pin %zu bytes: more than the host's %llu pinnable bytes "
                        "(ASCEND_SIM_HOST_PINNED)", size, (unsigned long long)budget);
    size_t pinned = (size + ps - 1) & ~(ps - 1);
    uint64_t before = atomic_fetch_add(&g_sim.host_held, pinned);
    if (before + pinned > budget) {
        atomic_fetch_sub(&g_sim.host_held, pinned);
        return sim_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call,
                        "cannot pin %zu more bytes: %llu of the host's %llu pinnable bytes "
                        "pinned (ASCEND_SIM_HOST_PINNED)", size,
                        (unsigned long long)before, (unsigned long long)budget);
    }
    struct sim_alloc *a = sim_alloc_map(size, ps, 0);
    if (!a) {
        int err = errno;
        atomic_fetch_sub(&g_sim.host_held, pinned);
        return sim_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call, "cannot map %zu bytes of host memory (%s)",
                        size, strerror(err));
    }
    a->device = -1;
    a->charged = pinned;
    sim_alloc_insert(SIM_TREE_HOST, a);
    *hostPtr = (void *)a->base;
    return ACL_SUCCESS;
}

SIM_EXPORT aclError aclrtFreeHost(void *hostPtr)
{
    static const char call[] = "aclrtFreeHost";
    int rc = sim_require_init(call);
    if (rc)
        return rc;
    if (!hostPtr)
        return sim_fail(ACL_ERROR_INVALID_PARAM, call, "hostPtr is NULL");
    struct sim_alloc *a = sim_alloc_remove(SIM_TREE_HOST, hostPtr);
    if (!a)
        return sim_fail(ACL_ERROR_RT_MEMORY_FREE, call,
                        "%p is not a live host allocation from aclrtMallocHost (never allocated, "
                        "or already freed)", hostPtr);
    atomic_fetch_sub(&g_sim.host_held, a->charged);
    sim_alloc_release(SIM_TREE_HOST, a);
    return ACL_SUCCESS;
}

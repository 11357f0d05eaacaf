/* Pinned host memory: aclrtMallocHost / aclrtFreeHost.
 *
 * Page-aligned mappings tracked like device memory (dmem.c), so a double free or an unknown
 * pointer is answered with ACL_ERROR_RT_MEMORY_FREE instead of corrupting anything. Host memory
 * does not count against device capacity. aclrtMallocHost needs a current context, as CANN's
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
    struct sim_alloc *a = sim_alloc_map(size, (size_t)sysconf(_SC_PAGESIZE), 0);
    if (!a)
        return sim_fail(ACL_ERROR_RT_MEMORY_ALLOCATION, call, "cannot map %zu bytes of host memory (%s)",
                        size, strerror(errno));
    a->device = -1;
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
    sim_alloc_release(SIM_TREE_HOST, a);
    return ACL_SUCCESS;
}

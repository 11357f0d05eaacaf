/* The ACL runtime C API that the simulated NPU exports: the same names, prototypes, enum values
 * and error codes as CANN's acl_base.h / acl_rt.h / rt_error_codes.h, for the subset that
 * ascend_pool's acl backend calls. Declaring them here (with default visibility) lets the
 * compiler check every definition against the real prototype.
 *
 * The legacy build (-DASCEND_SIM_LEGACY=1) stands for an old CANN: it lacks aclrtMallocAlign32,
 * aclrtQueryEventStatus, aclrtCreateEventExWithFlag, aclFinalizeReference and
 * aclrtSynchronizeDeviceWithTimeout, so that the backend's fallbacks are exercised.
 *
 * Error codes where the runtime leaves a choice (kept consistent across calls):
 *   bad argument values (NULL out-pointer, size 0, unknown policy/attr/flag, timeout < -1)
 *                                                     ACL_ERROR_INVALID_PARAM        100000
 *   any call before aclInit                           ACL_ERROR_UNINITIALIZE         100001
 *   aclInit twice; ascendsim_configure after aclInit  ACL_ERROR_REPEAT_INITIALIZE    100002
 *   aclFinalize twice; aclFinalizeReference without an aclInit reference left
 *                                                     ACL_ERROR_REPEAT_FINALIZE      100037
 *   unreadable aclInit config file; node record malformed, of another HBM size, unopenable
 *                                                     ACL_ERROR_INVALID_FILE         100003
 *   node record owned by another user, mode not 0600, or a symlink
 *                                                     ACL_ERROR_RT_NO_PERMISSION     207006
 *   device id out of range (SetDevice, ResetDevice, CreateContext)
 *                                                     ACL_ERROR_RT_INVALID_DEVICEID  107001
 *   device id out of range in ascendsim_get_stats     ACL_ERROR_INVALID_DEVICE       200002
 *   no current device on the thread (malloc, streams, events, GetDevice, GetMemInfo; record,
 *   wait and reset of an event and destroy on a created stream; IPC set-pid)
 *                                                     ACL_ERROR_RT_CONTEXT_NULL      107002
 *   record / wait / reset / destroy on a stream of a context that is not the thread's current
 *   one (CANN's "stream not in current context"; the NULL default stream: any context of its
 *   device)                                            ACL_ERROR_RT_STREAM_CONTEXT    107003
 *   unknown/destroyed stream, event, context handle; address outside live device memory
 *   (ascendsim_read/launch_fill); injected event-query fault
 *                                                     ACL_ERROR_RT_PARAM_INVALID     107000
 *   destroying a default context                      ACL_ERROR_RT_PARAM_INVALID     107000
 *   out of device memory, injected malloc faults      ACL_ERROR_RT_MEMORY_ALLOCATION 207001
 *   free of an unknown, interior or freed pointer     ACL_ERROR_RT_MEMORY_FREE       207002
 *   65,536 live events on the device; injected create fault
 *                                                     ACL_ERROR_RT_NO_EVENT_RESOURCE 207007
 *   no thread for a new stream                        ACL_ERROR_RT_NO_STREAM_RESOURCE 207008
 *   node record full (256 processes), host out of memory
 *                                                     ACL_ERROR_RT_RESOURCE_ALLOC_FAIL 207005
 *   stream / event sync timeout                       507046 / 507047
 * Virtual memory (vmm.c), following the split in CANN's acl layer and runtime:
 *   NULL out-pointer/handle/address, size 0, flags != 0 (reserve: 0 or 1), unsupported prop
 *   (handle/allocation/location type, memAttr), unknown granularity option
 *                                                     ACL_ERROR_INVALID_PARAM        100000
 *   prop->location.id not a device                    ACL_ERROR_RT_INVALID_DEVICEID  107001
 *   host physical memory (location HOST / HOST_NUMA)  ACL_ERROR_RT_FEATURE_NOT_SUPPORT 207000
 *   alignment != 0, expectPtr != NULL, reserve size not a granule multiple, offset != 0, map size
 *   != the handle's size or not a granule multiple, misaligned or out-of-reservation or overlapping
 *   map, unmap of a non-start, unknown/freed physical handle, release of a non-base; and the busy
 *   cases: aclrtFreePhysical of a mapped handle, aclrtReleaseMemAddress with mappings inside
 *                                                     ACL_ERROR_RT_PARAM_INVALID     107000
 *   physical memory past capacity, injected malloc faults, host out of address space
 *                                                     ACL_ERROR_RT_MEMORY_ALLOCATION 207001
 * Sharing between processes (ipc.c; CANN's acl layer checks arguments, the runtime the rest):
 *   NULL devPtr/key/pid, size 0, len < 65, num 0      ACL_ERROR_INVALID_PARAM        100000
 *   flags out of range, pid <= 0, address not in one live aclrtMalloc allocation, range already
 *   exported, malformed key, unknown key (never exported, closed, or another node's), key not
 *   exported (SetImportPid) / neither exported nor imported (Close) by this process
 *                                                     ACL_ERROR_RT_PARAM_INVALID     107000
 *   no current device (export, import, set-pid)       ACL_ERROR_RT_CONTEXT_NULL      107002
 *   export of an address or size that is not a multiple of the 2 MiB page
 *                                                     ACL_ERROR_RT_ADDR_UNALIGNED    107008
 *   import by a pid the exporter did not allow; record of another user or not 0600; a fill of
 *   memory imported from a read-only export (a simulator extension: ascendsim.h)
 *                                                     ACL_ERROR_RT_NO_PERMISSION     207006
 *   256 allowed pids or 256 importing processes      ACL_ERROR_RT_OVER_LIMIT        207012
 *   the order of closing: aclrtIpcMemClose or aclrtFree by the exporter while a live process
 *   still imports; import, read or fill after the exporter exited or closed the key
 *                                                     ACL_ERROR_RT_IPC_ERROR         507022
 *   import on another device than the exporter's without
 *   ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS (the driver refuses the handle)
 *                                                     ACL_ERROR_RT_DRV_INTERNAL_ERROR 507899
 */
#ifndef ASCEND_SIM_ACL_API_H
#define ASCEND_SIM_ACL_API_H

#include <stddef.h>
#include <stdint.h>

#define SIM_EXPORT __attribute__((visibility("default")))

typedef int aclError;
typedef void *aclrtStream;
typedef void *aclrtEvent;
typedef void *aclrtContext;

/* acl_base.h */
#define ACL_SUCCESS 0
#define ACL_ERROR_INVALID_PARAM 100000
#define ACL_ERROR_UNINITIALIZE 100001
#define ACL_ERROR_REPEAT_INITIALIZE 100002
#define ACL_ERROR_INVALID_FILE 100003
#define ACL_ERROR_REPEAT_FINALIZE 100037
#define ACL_ERROR_BAD_ALLOC 200000
#define ACL_ERROR_INVALID_DEVICE 200002
/* rt_error_codes.h */
#define ACL_ERROR_RT_PARAM_INVALID 107000
#define ACL_ERROR_RT_INVALID_DEVICEID 107001
#define ACL_ERROR_RT_CONTEXT_NULL 107002
#define ACL_ERROR_RT_STREAM_CONTEXT 107003
#define ACL_ERROR_RT_ADDR_UNALIGNED 107008
#define ACL_ERROR_RT_WAIT_TIMEOUT 107019
#define ACL_ERROR_RT_FEATURE_NOT_SUPPORT 207000
#define ACL_ERROR_RT_MEMORY_ALLOCATION 207001
#define ACL_ERROR_RT_MEMORY_FREE 207002
#define ACL_ERROR_RT_RESOURCE_ALLOC_FAIL 207005
#define ACL_ERROR_RT_NO_PERMISSION 207006
#define ACL_ERROR_RT_NO_EVENT_RESOURCE 207007
#define ACL_ERROR_RT_NO_STREAM_RESOURCE 207008
#define ACL_ERROR_RT_OVER_LIMIT 207012
#define ACL_ERROR_RT_DEVICE_OOM 207018
#define ACL_ERROR_RT_INTERNAL_ERROR 507000
#define ACL_ERROR_RT_IPC_ERROR 507022
#define ACL_ERROR_RT_DRV_INTERNAL_ERROR 507899
#define ACL_ERROR_RT_STREAM_SYNC_TIMEOUT 507046
#define ACL_ERROR_RT_EVENT_SYNC_TIMEOUT 507047

/* aclrtMemMallocPolicy: the valid values are 0..7. */
#define ACL_MEM_MALLOC_HUGE_FIRST 0
#define ACL_MEM_MALLOC_HUGE_ONLY 1
#define ACL_MEM_MALLOC_NORMAL_ONLY 2
#define ACL_MEM_MALLOC_HUGE_FIRST_P2P 3
#define ACL_MEM_MALLOC_HUGE_ONLY_P2P 4
#define ACL_MEM_MALLOC_NORMAL_ONLY_P2P 5
#define ACL_MEM_MALLOC_HUGE1G_ONLY 6
#define ACL_MEM_MALLOC_HUGE1G_ONLY_P2P 7
#define ACL_MEM_TYPE_LOW_BAND_WIDTH 0x0100
#define ACL_MEM_TYPE_HIGH_BAND_WIDTH 0x1000
#define ACL_MEM_ACCESS_USER_SPACE_READONLY 0x100000
#define ACL_MEM_POLICY_FLAGS (ACL_MEM_TYPE_LOW_BAND_WIDTH | ACL_MEM_TYPE_HIGH_BAND_WIDTH | ACL_MEM_ACCESS_USER_SPACE_READONLY)

/* aclrtMemAttr (0..11 in CANN 7/8; 12..17 are the newer generic ACL_MEM_* attributes). */
#define ACL_DDR_MEM 0
#define ACL_HBM_MEM 1
#define ACL_DDR_MEM_HUGE 2
#define ACL_DDR_MEM_NORMAL 3
#define ACL_HBM_MEM_HUGE 4
#define ACL_HBM_MEM_NORMAL 5
#define ACL_DDR_MEM_P2P_HUGE 6
#define ACL_DDR_MEM_P2P_NORMAL 7
#define ACL_HBM_MEM_P2P_HUGE 8
#define ACL_HBM_MEM_P2P_NORMAL 9
#define ACL_HBM_MEM_HUGE1G 10
#define ACL_HBM_MEM_P2P_HUGE1G 11
#define ACL_MEM_NORMAL 12
#define ACL_MEM_HUGE 13
#define ACL_MEM_HUGE1G 14
#define ACL_MEM_P2P_NORMAL 15
#define ACL_MEM_P2P_HUGE 16
#define ACL_MEM_P2P_HUGE1G 17

/* Virtual memory (acl_rt.h): physical memory handles and their properties. The enums are int-sized
   as in CANN (aclrtMemHandleType, aclrtMemAllocationType, aclrtMemLocationType, aclrtMemAttr). */
typedef void *aclrtDrvMemHandle;
#define ACL_MEM_HANDLE_TYPE_NONE 0
#define ACL_MEM_ALLOCATION_TYPE_PINNED 0
#define ACL_MEM_LOCATION_TYPE_HOST 0
#define ACL_MEM_LOCATION_TYPE_DEVICE 1
#define ACL_MEM_LOCATION_TYPE_UNREGISTERED 2
#define ACL_MEM_LOCATION_TYPE_HOST_NUMA 4
#define ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM 0     /* aclrtMemGranularityOptions */
#define ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED 1
typedef struct aclrtMemLocation {
    uint32_t id;   /* device id for ACL_MEM_LOCATION_TYPE_DEVICE */
    int type;      /* aclrtMemLocationType */
} aclrtMemLocation;
typedef struct aclrtPhysicalMemProp {
    int handleType;       /* aclrtMemHandleType: ACL_MEM_HANDLE_TYPE_NONE */
    int allocationType;   /* aclrtMemAllocationType: ACL_MEM_ALLOCATION_TYPE_PINNED */
    int memAttr;          /* aclrtMemAttr, e.g. ACL_HBM_MEM_HUGE (2 MiB pages) */
    aclrtMemLocation location;
    uint64_t reserve;
} aclrtPhysicalMemProp;

/* aclrtEventRecordedStatus (aclrtQueryEventStatus) and the deprecated, inverted aclrtEventStatus
   (aclrtQueryEvent). */
#define ACL_EVENT_RECORDED_STATUS_NOT_READY 0
#define ACL_EVENT_RECORDED_STATUS_COMPLETE 1
#define ACL_EVENT_STATUS_COMPLETE 0
#define ACL_EVENT_STATUS_NOT_READY 1

/* Event flags (acl_rt.h; the runtime's RT_EVENT_* of the same values). */
#define ACL_EVENT_SYNC 0x1u
#define ACL_EVENT_CAPTURE_STREAM_PROGRESS 0x2u
#define ACL_EVENT_TIME_LINE 0x8u
#define ACL_EVENT_DEVICE_USE_ONLY 0x10u /* RT_EVENT_MC2: recorded and waited on by device tasks only */
#define ACL_EVENT_EXTERNAL 0x20u        /* task update in model capture (not simulated) */
#define ACL_EVENT_IPC 0x40u             /* aclrtIpcGetEventHandle (not simulated); ExWithFlag only */
/* What each call takes (hicann/runtime ApiErrorDecorator::EventCreate: RT_EVENT_FLAG_MAX;
   ::EventCreateEx: its maxFlag), and the flags that must come alone (their solelyFlag lists). */
#define ACL_EVENT_FLAGS_COMMON (ACL_EVENT_SYNC | ACL_EVENT_CAPTURE_STREAM_PROGRESS | ACL_EVENT_TIME_LINE)
#define ACL_EVENT_FLAGS_WITH_FLAG (ACL_EVENT_FLAGS_COMMON | ACL_EVENT_DEVICE_USE_ONLY | ACL_EVENT_EXTERNAL)
#define ACL_EVENT_FLAGS_EX (ACL_EVENT_FLAGS_COMMON | ACL_EVENT_IPC)
#define ACL_EVENT_FLAGS_ALONE (ACL_EVENT_DEVICE_USE_ONLY | ACL_EVENT_EXTERNAL | ACL_EVENT_IPC)

SIM_EXPORT aclError aclInit(const char *configPath);
SIM_EXPORT aclError aclFinalize(void);
#if !ASCEND_SIM_LEGACY
SIM_EXPORT aclError aclFinalizeReference(uint64_t *refCount);
#endif

SIM_EXPORT aclError aclrtSetDevice(int32_t deviceId);
SIM_EXPORT aclError aclrtGetDevice(int32_t *deviceId);
SIM_EXPORT aclError aclrtGetDeviceCount(uint32_t *count);
SIM_EXPORT aclError aclrtResetDevice(int32_t deviceId);
SIM_EXPORT aclError aclrtResetDeviceForce(int32_t deviceId);
SIM_EXPORT aclError aclrtGetPhyDevIdByLogicDevId(int32_t logicDevId, int32_t *phyDevId);
SIM_EXPORT aclError aclrtGetLogicDevIdByPhyDevId(int32_t phyDevId, int32_t *logicDevId);
SIM_EXPORT const char *aclrtGetSocName(void);

SIM_EXPORT aclError aclrtCreateContext(aclrtContext *context, int32_t deviceId);
SIM_EXPORT aclError aclrtSetCurrentContext(aclrtContext context);
SIM_EXPORT aclError aclrtGetCurrentContext(aclrtContext *context);
SIM_EXPORT aclError aclrtDestroyContext(aclrtContext context);

SIM_EXPORT aclError aclrtMalloc(void **devPtr, size_t size, int policy);
#if !ASCEND_SIM_LEGACY
SIM_EXPORT aclError aclrtMallocAlign32(void **devPtr, size_t size, int policy);
#endif
SIM_EXPORT aclError aclrtFree(void *devPtr);
SIM_EXPORT aclError aclrtGetMemInfo(int attr, size_t *free, size_t *total);
SIM_EXPORT aclError aclrtMallocHost(void **hostPtr, size_t size);
SIM_EXPORT aclError aclrtFreeHost(void *hostPtr);

/* Virtual memory (vmm.c). In both builds: nothing shows these to be newer than the two symbols the
   legacy build lacks (torch_npu resolves all of them as optional alike). */
SIM_EXPORT aclError aclrtMemGetAllocationGranularity(aclrtPhysicalMemProp *prop, int option,
                                                     size_t *granularity);
SIM_EXPORT aclError aclrtReserveMemAddress(void **virPtr, size_t size, size_t alignment,
                                           void *expectPtr, uint64_t flags);
SIM_EXPORT aclError aclrtReleaseMemAddress(void *virPtr);
SIM_EXPORT aclError aclrtMallocPhysical(aclrtDrvMemHandle *handle, size_t size,
                                        const aclrtPhysicalMemProp *prop, uint64_t flags);
SIM_EXPORT aclError aclrtFreePhysical(aclrtDrvMemHandle handle);
SIM_EXPORT aclError aclrtMapMem(void *virPtr, size_t size, size_t offset, aclrtDrvMemHandle handle,
                                uint64_t flags);
SIM_EXPORT aclError aclrtUnmapMem(void *virPtr);

/* Sharing device memory between processes (ipc.c). In both builds, like the VMM calls. */
#define ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT 0x0UL                /* importers' pids are checked */
#define ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION 0x1UL
#define ACL_RT_IPC_MEM_IMPORT_FLAG_DEFAULT 0x0UL
#define ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS 0x1UL
SIM_EXPORT aclError aclrtIpcMemGetExportKey(void *devPtr, size_t size, char *key, size_t len, uint64_t flags);
SIM_EXPORT aclError aclrtIpcMemSetImportPid(const char *key, int32_t *pid, size_t num);
SIM_EXPORT aclError aclrtIpcMemImportByKey(void **devPtr, const char *key, uint64_t flags);
SIM_EXPORT aclError aclrtIpcMemClose(const char *key);
SIM_EXPORT aclError aclrtDeviceGetBareTgid(int32_t *pid); /* the node-level id (proc.c) */

SIM_EXPORT aclError aclrtCreateEvent(aclrtEvent *event);
SIM_EXPORT aclError aclrtCreateEventWithFlag(aclrtEvent *event, uint32_t flag);
#if !ASCEND_SIM_LEGACY
SIM_EXPORT aclError aclrtCreateEventExWithFlag(aclrtEvent *event, uint32_t flag); /* CANN 8.0.RC1 on */
#endif
SIM_EXPORT aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream);
#if !ASCEND_SIM_LEGACY
SIM_EXPORT aclError aclrtQueryEventStatus(aclrtEvent event, int *status);
#endif
SIM_EXPORT aclError aclrtQueryEvent(aclrtEvent event, int *status);
SIM_EXPORT aclError aclrtSynchronizeEvent(aclrtEvent event);
SIM_EXPORT aclError aclrtSynchronizeEventWithTimeout(aclrtEvent event, int32_t timeout);
SIM_EXPORT aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event);
SIM_EXPORT aclError aclrtDestroyEvent(aclrtEvent event);
SIM_EXPORT aclError aclrtResetEvent(aclrtEvent event, aclrtStream stream);

SIM_EXPORT aclError aclrtCreateStream(aclrtStream *stream);
SIM_EXPORT aclError aclrtSynchronizeStream(aclrtStream stream);
SIM_EXPORT aclError aclrtSynchronizeStreamWithTimeout(aclrtStream stream, int32_t timeout);
SIM_EXPORT aclError aclrtDestroyStream(aclrtStream stream);
SIM_EXPORT aclError aclrtDestroyStreamForce(aclrtStream stream);
SIM_EXPORT aclError aclrtSynchronizeDevice(void);
#if !ASCEND_SIM_LEGACY
SIM_EXPORT aclError aclrtSynchronizeDeviceWithTimeout(int32_t timeout);
#endif

SIM_EXPORT const char *aclGetRecentErrMsg(void);

#endif

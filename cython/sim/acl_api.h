/* The ACL runtime C API that the simulated NPU exports: the same names, prototypes, enum values
 * and error codes as CANN's acl_base.h / acl_rt.h / rt_error_codes.h, for the subset that
 * ascend_pool's acl backend calls. Declaring them here (with default visibility) lets the
 * compiler check every definition against the real prototype.
 *
 * The legacy build (-DASCEND_SIM_LEGACY=1) stands for an old CANN: it lacks aclrtMallocAlign32
 * and aclrtQueryEventStatus, so that the backend's fallbacks are exercised.
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
#define ACL_ERROR_RT_WAIT_TIMEOUT 107019
#define ACL_ERROR_RT_FEATURE_NOT_SUPPORT 207000
#define ACL_ERROR_RT_MEMORY_ALLOCATION 207001
#define ACL_ERROR_RT_MEMORY_FREE 207002
#define ACL_ERROR_RT_RESOURCE_ALLOC_FAIL 207005
#define ACL_ERROR_RT_NO_PERMISSION 207006
#define ACL_ERROR_RT_NO_EVENT_RESOURCE 207007
#define ACL_ERROR_RT_NO_STREAM_RESOURCE 207008
#define ACL_ERROR_RT_DEVICE_OOM 207018
#define ACL_ERROR_RT_INTERNAL_ERROR 507000
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
#define ACL_MEM_P2P_HUGE1G 17

/* aclrtEventRecordedStatus (aclrtQueryEventStatus) and the deprecated, inverted aclrtEventStatus
   (aclrtQueryEvent). */
#define ACL_EVENT_RECORDED_STATUS_NOT_READY 0
#define ACL_EVENT_RECORDED_STATUS_COMPLETE 1
#define ACL_EVENT_STATUS_COMPLETE 0
#define ACL_EVENT_STATUS_NOT_READY 1

/* Event flags (acl_rt.h). */
#define ACL_EVENT_SYNC 0x1u
#define ACL_EVENT_CAPTURE_STREAM_PROGRESS 0x2u
#define ACL_EVENT_TIME_LINE 0x8u
#define ACL_EVENT_FLAGS_KNOWN (ACL_EVENT_SYNC | ACL_EVENT_CAPTURE_STREAM_PROGRESS | ACL_EVENT_TIME_LINE)

SIM_EXPORT aclError aclInit(const char *configPath);
SIM_EXPORT aclError aclFinalize(void);

SIM_EXPORT aclError aclrtSetDevice(int32_t deviceId);
SIM_EXPORT aclError aclrtGetDevice(int32_t *deviceId);
SIM_EXPORT aclError aclrtGetDeviceCount(uint32_t *count);
SIM_EXPORT aclError aclrtResetDevice(int32_t deviceId);

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

SIM_EXPORT aclError aclrtCreateEvent(aclrtEvent *event);
SIM_EXPORT aclError aclrtCreateEventWithFlag(aclrtEvent *event, uint32_t flag);
SIM_EXPORT aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream);
#if !ASCEND_SIM_LEGACY
SIM_EXPORT aclError aclrtQueryEventStatus(aclrtEvent event, int *status);
#endif
SIM_EXPORT aclError aclrtQueryEvent(aclrtEvent event, int *status);
SIM_EXPORT aclError aclrtSynchronizeEvent(aclrtEvent event);
SIM_EXPORT aclError aclrtSynchronizeEventWithTimeout(aclrtEvent event, int32_t timeout);
SIM_EXPORT aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event);
SIM_EXPORT aclError aclrtDestroyEvent(aclrtEvent event);

SIM_EXPORT aclError aclrtCreateStream(aclrtStream *stream);
SIM_EXPORT aclError aclrtSynchronizeStream(aclrtStream stream);
SIM_EXPORT aclError aclrtSynchronizeStreamWithTimeout(aclrtStream stream, int32_t timeout);
SIM_EXPORT aclError aclrtDestroyStream(aclrtStream stream);

SIM_EXPORT const char *aclGetRecentErrMsg(void);

#endif

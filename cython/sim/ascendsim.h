/* Control API of the simulated NPU (not part of ACL): what tests and demos use to put work on
 * streams, look at device memory, inject faults and read counters. ascend_pool/sim.py calls these
 * through ctypes on the same library file the pool's backend dlopen()s, so both see one state.
 *
 * Every function returns an aclError (0 = success) and sets the per-thread message that
 * aclGetRecentErrMsg() returns. All need an initialised runtime (ACL_ERROR_UNINITIALIZE 100001)
 * except ascendsim_configure, ascendsim_parse_size and ascendsim_stats_fields.
 */
#ifndef ASCEND_SIM_CONTROL_H
#define ASCEND_SIM_CONTROL_H

#include <stddef.h>
#include <stdint.h>

#include "acl_api.h"

/* Enqueues on `stream` (NULL: the calling thread's current device's default stream) a wait of
   `delay_us` microseconds followed by memset(ptr, value & 0xff, nbytes). [ptr, ptr+nbytes) must lie
   inside one live device allocation (its reserved, rounded extent), or inside one VMM reservation
   with every page of it mapped (aclrtMapMem), or inside memory imported with
   aclrtIpcMemImportByKey, at enqueue time, else 107000 (507022 ACL_ERROR_RT_IPC_ERROR for imported
   memory whose exporter has exited or closed the key). If that memory is freed or unmapped before
   the fill runs, the fill is dropped (counted in stats "dropped_fills") instead of writing to
   unmapped memory. */
SIM_EXPORT aclError ascendsim_launch_fill(aclrtStream stream, void *ptr, size_t nbytes, int value,
                                          uint64_t delay_us);
/* Copies nbytes of device memory at ptr to host memory at dst, now, without waiting for streams.
   [ptr, ptr+nbytes) must lie inside one live device allocation, mapped VMM range or imported
   range (as for ascendsim_launch_fill), else 107000 (or 507022, as there). */
SIM_EXPORT aclError ascendsim_read(const void *ptr, void *dst, size_t nbytes);
/* Enqueues on `stream` an item that blocks its worker until ascendsim_release_stream(stream). */
SIM_EXPORT aclError ascendsim_hang_stream(aclrtStream stream);
/* Releases every hang enqueued on `stream` so far. */
SIM_EXPORT aclError ascendsim_release_stream(aclrtStream stream);

/* Fault injection. The counts are "the Nth call from now" (from aclInit for the environment
   variables), fire once, then disarm; 0 disarms. "Device malloc" is aclrtMalloc[Align32] and
   aclrtMallocPhysical alike (one count, one byte total). */
SIM_EXPORT aclError ascendsim_set_fail_malloc_nth(uint64_t n);      /* -> 207001 */
SIM_EXPORT aclError ascendsim_set_fail_event_create_nth(uint64_t n); /* -> 207007 */
SIM_EXPORT aclError ascendsim_set_fail_event_query_nth(uint64_t n);  /* -> 107000 */
/* A device malloc that would take this process's held device bytes (all devices together, the
   rounded sizes) above `bytes` fails with 207001. bytes < 0 disarms. */
SIM_EXPORT aclError ascendsim_set_fail_after_bytes(int64_t bytes);
/* Microseconds added to every aclrtMalloc[Align32] / aclrtMallocPhysical and aclrtFree /
   aclrtFreePhysical call (0: none). */
SIM_EXPORT aclError ascendsim_set_malloc_latency_us(uint64_t us);
SIM_EXPORT aclError ascendsim_set_free_latency_us(uint64_t us);
/* Disarms every fault, including those set from the environment. */
SIM_EXPORT aclError ascendsim_reset_faults(void);
/* on != 0: aclrtFree fills the freed bytes with 0xDD before unmapping them. */
SIM_EXPORT aclError ascendsim_set_poison(int on);

/* Overrides ASCEND_SIM_DEVICES / ASCEND_SIM_HBM for the next aclInit (0: use the environment or
   the default). Fails with ACL_ERROR_REPEAT_INITIALIZE (100002) once the runtime is initialised. */
SIM_EXPORT aclError ascendsim_configure(int32_t devices, uint64_t hbm_bytes);
/* Parses a byte size: plain bytes ("1024"), or a decimal number with a unit: B, KiB/MiB/GiB/TiB
   (powers of 1024; K/M/G/T alone mean the same), KB/MB/GB/TB (powers of 1000); case-insensitive,
   fractions allowed ("1.5GB"), rounded down to whole bytes. 100000 on a malformed or overflowing
   text. */
SIM_EXPORT aclError ascendsim_parse_size(const char *text, uint64_t *bytes);

/* Counters of one device, written as n uint64 values in the order named by
   ascendsim_stats_fields() (a comma-separated list; new fields are only ever appended). Bad device
   id -> ACL_ERROR_INVALID_DEVICE. */
SIM_EXPORT aclError ascendsim_get_stats(int32_t device, uint64_t *out, uint32_t n);
SIM_EXPORT const char *ascendsim_stats_fields(void);
/* The device of a live stream (NULL: the calling thread's default stream); 107000 for a handle
   that is not a live stream. */
SIM_EXPORT aclError ascendsim_stream_device(aclrtStream stream, int32_t *device);
/* ASCEND_SIM_PROFILE as read at aclInit (strict, cann8.0, cann8.2, cann8.3, 310p, 950); NULL before. */
SIM_EXPORT const char *ascendsim_profile(void);
/* This process's sharing of one device (ipc.c), as n uint64 values in this order: live exports,
   bytes exported, live imports (a key imported twice counts once), bytes imported. Imported bytes
   are not part of any node usage: the exporter's aclrtMalloc holds them. Bad device id ->
   ACL_ERROR_INVALID_DEVICE. */
SIM_EXPORT aclError ascendsim_get_ipc_stats(int32_t device, uint64_t *out, uint32_t n);

/* Read-only sharing, a simulator extension: CANN's aclrtIpcMemGetExportKey (like CUDA's
   cudaIpcGetMemHandle) has no such flag, so a real runtime maps every import read-write. Or'ed
   into aclrtIpcMemGetExportKey's flags, this bit makes every import of the key a read-only
   mapping (PROT_READ): ascendsim_read works, ascendsim_launch_fill answers
   ACL_ERROR_RT_NO_PERMISSION (207006) naming the key. The exporter's own memory stays writable.
   The acl backend looks up ascendsim_ipc_export_flag_read_only() and passes the bit only to a
   runtime that exports it, so the same backend code runs unchanged on CANN. */
#define ASCENDSIM_IPC_EXPORT_FLAG_READ_ONLY 0x100000000ULL
SIM_EXPORT uint64_t ascendsim_ipc_export_flag_read_only(void);

#endif

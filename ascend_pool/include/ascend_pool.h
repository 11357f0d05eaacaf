/* ascend_pool: the C ABI of the caching device-memory allocator.
 *
 * These symbols are exported with default visibility from the file that
 * `python -c "import ascend_pool; print(ascend_pool.library_path())"` names (the package's compiled
 * extension). Frameworks load them by name: torch_npu's NPUPluggableAllocator and PyTorch's
 * CUDAPluggableAllocator take ascend_pool_malloc / ascend_pool_free plus the optional hooks below.
 *
 * Rules that hold for every function here:
 *   - callable from any thread, with or without the Python GIL held;
 *   - never abort and never raise: a failure returns NULL (or does nothing) and sets the calling
 *     thread's last error (ascend_pool_last_error_code / ascend_pool_last_error). Like errno, a
 *     successful call does not clear it: clear it yourself before a call you want to check;
 *   - the library is a Python extension: the process must run a Python interpreter that has
 *     imported `ascend_pool` (torch requires that anyway: the user imports the module that gives
 *     the path). A plain C program links libpython, calls Py_Initialize() and imports ascend_pool
 *     first (see tests/c/capi_threads.c).
 *
 * The GIL: allocation, free, record_stream, erase_stream and the error functions never take it.
 * The first allocation on a device that has no pool yet creates the process's default pool for it, which
 * needs Python (PyGILState_Ensure, once per device): ascend_pool_init(device) does that up front,
 * so that threads that must never wait for the GIL find the pool ready.
 *
 * Units: sizes in bytes; devices are runtime ordinals (aclrtSetDevice / cudaSetDevice numbering);
 * streams are the runtime's handles (aclrtStream / cudaStream_t), NULL the default stream.
 */
#ifndef ASCEND_POOL_H
#define ASCEND_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h> /* ssize_t */

#ifdef __cplusplus
extern "C" {
#endif

/* Last-error codes (ascend_pool_last_error_code). 1..10 are the pool's own statuses. */
#define ASCEND_POOL_OK 0
#define ASCEND_POOL_E_OOM 1             /* device exhausted after trimming the cache and retrying (also a
                                           request larger than the device: PyTorch's OutOfMemoryError) */
#define ASCEND_POOL_E_LIMIT 2           /* the pool's byte limit (memory fraction) would be passed */
#define ASCEND_POOL_E_INVALID_SIZE 3    /* size 0, negative, or past what the pool can round */
#define ASCEND_POOL_E_INVALID_PTR 4     /* not a live allocation of any pool of that device */
#define ASCEND_POOL_E_INVALID_STREAM 5  /* too many streams, or a stream the pool forgot */
#define ASCEND_POOL_E_DEVICE 6          /* the runtime returned an error */
#define ASCEND_POOL_E_TIMEOUT 7         /* a host wait for the device passed its limit */
#define ASCEND_POOL_E_HOST_NOMEM 8      /* host memory for bookkeeping ran out */
#define ASCEND_POOL_E_QUOTA 10          /* the current tenant's quota would be exceeded */
#define ASCEND_POOL_E_INVALID_DEVICE 100 /* no such device */
#define ASCEND_POOL_E_NOT_READY 101     /* ascend_pool not imported, Python finalizing, the
                                           default pool could not be created, or the tenant context
                                           current on this thread was closed (message says why) */
#define ASCEND_POOL_E_INVALID_ARG 102   /* another argument out of range (fraction, NULL out-pointer) */

/* Allocates `size` bytes on `device`, ordered on `stream`, from the calling thread's current pool
 * of that device: the tenant context made current with `with ctx:` on this thread, else the
 * process's default pool (created on first use). NULL on failure (size <= 0, bad device, out of
 * memory, quota). Blocks keep the runtime's alignment (at least 64 bytes on Ascend, 256 on CUDA). */
void *ascend_pool_malloc(ssize_t size, int device, void *stream);

/* Frees `ptr` ordered on `stream`: the block is reusable at once by later work on `stream`, and by
 * other streams only once the work queued on `stream` before this call has completed. Pass the
 * stream the memory was last used on (torch passes the allocation stream). stream == NULL means
 * "the stream it was allocated on" (which is the default stream when it was allocated there).
 * `size` is informational (the pool knows each block's size) and is not checked. The pointer is
 * looked up in the calling thread's current pool of `device`, then in the other live pools of
 * `device` (a block allocated under another tenant context is returned to that context).
 * ptr == NULL does nothing. An unknown pointer or a bad device is ignored with the error set (a
 * block of another device is unknown here: it stays allocated; pass the allocation's device). A
 * stream the pool cannot order on (destroyed meanwhile) frees the block on its allocation stream,
 * with the error set: nothing leaks. (Python's pool.free refuses instead and frees nothing.) A live
 * stream of another device (a peer's kernel used the block last), or one past the pool's table of
 * 1,023 side streams (the default stream always has a slot), is waited for by an event recorded on
 * it now. A stream of a context the calling thread is not in (an application's aclrtCreateContext
 * context), on which no event can be recorded from here, keeps the block in its own cache: other
 * streams take it only once a call from that context, or a wait (empty_cache, synchronize), finds
 * the stream's work done. */
void ascend_pool_free(void *ptr, ssize_t size, int device, void *stream);

/* Prepares the C ABI. If `device` names an existing device, creates its default pool now (taking
 * the GIL once), so later calls never need Python. Any other value only checks that the library
 * is ready (it opens the backend to learn the device count).
 * Frameworks never pass a device here: torch_npu's NPUPluggableAllocator calls its init hook with
 * the device count, once the allocator is constructed (in versions that call init from inside the
 * constructor, before Python can set the hook, it is not called at all), and PyTorch's
 * CUDAPluggableAllocator passes its device count too. So under a framework the first allocation
 * on each device creates its pool; a program whose C threads must never wait for the GIL calls
 * ascend_pool_init(d) itself for each device d before starting them. */
void ascend_pool_init(int device);

/* Returns the unused cached segments of every device's default pool, of pools dropped with blocks
 * still allocated, and of the calling thread's `with ctx:` tenant context, to the device, as torch's
 * emptyCache (which calls this hook) and ap.empty_cache() do: a live MemPool (a pool made current
 * by use_mem_pool, or not current at all) and other threads' contexts keep their cache
 * (pool.empty_cache() empties one). The argument is ignored: torch_npu passes check_error,
 * PyTorch passes nothing. */
void ascend_pool_reset(bool check_error);

/* Caps the calling thread's current pool of `device` (its `with ctx:` context, else the default;
 * inside use_mem_pool, the pool beneath: torch's fraction is the device's, not the MemPool's) at
 * `fraction` (0..1) of the device's memory; a cap below what it holds trims its cache, never live
 * blocks. The default pool's cap counts the device's other plain pools (MemPools) too, as
 * torch's fraction caps its device allocator with its MemPools. */
void ascend_pool_set_memory_fraction(double fraction, int device);

/* The device allocation (segment) that contains `ptr`, a live block of any pool: returns its base
 * and writes its size in bytes to *size (torch uses this to share memory between processes).
 * NULL (and *size = 0) when ptr is not inside a live block. */
void *ascend_pool_base_alloc(void *ptr, size_t *size);

/* Marks the live block `ptr` as used by `stream`: after its free, it is not reused until the work
 * queued on `stream` before the free has completed (a stream of another device, or one past the
 * pool's table of 1,023 side streams, too). Ignored with the error set if unknown. */
void ascend_pool_record_stream(void *ptr, void *stream);

/* Undoes ascend_pool_record_stream(ptr, stream) on the live block `ptr` (torch_npu's
 * erase_stream): its free no longer waits for the work queued on `stream`. A stream it was not
 * marked with changes nothing. Ignored with the error set if ptr is not a live block. */
void ascend_pool_erase_stream(void *ptr, void *stream);

/* Same as ascend_pool_reset. */
void ascend_pool_empty_cache(void);

/* The calling thread's last error: a code above (0: none) and a readable message ("" when none).
 * The message stays valid until the next failing call on this thread. */
int ascend_pool_last_error_code(void);
const char *ascend_pool_last_error(void);
void ascend_pool_clear_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* ASCEND_POOL_H */

/* The alloc and free functions torch's pluggable allocators load (torch_npu's NPUPluggableAllocator,
 * torch's CUDAPluggableAllocator): ascend_pool_malloc and ascend_pool_free, except that a failed
 * allocation throws. Neither framework checks a NULL from its alloc function: a NULL became a
 * tensor at address 0, and the first kernel on it a device fault instead of the out-of-memory
 * error a program backs off on (a smaller batch). A C++ exception is how an allocator fails there:
 * torch turns std::runtime_error into RuntimeError, whose text ("... out of memory: Tried to
 * allocate ...") torch's own tests and users match.
 *
 * Built as its own small library (libascend_pool_torch.so, only where a C++ compiler is) so that
 * the C core needs none: the integration binds it to the core's C ABI (ascend_pool_torch_bind)
 * before handing its path to torch, which loads the same file by path. */
#include <atomic>
#include <climits>
#include <stdexcept>
#include <string>
#include <sys/types.h>

#define EXPORT extern "C" __attribute__((visibility("default")))

typedef void *(*malloc_fn)(ssize_t size, int device, void *stream);
typedef void (*free_fn)(void *ptr, ssize_t size, int device, void *stream);
typedef const char *(*error_fn)(void);

static std::atomic<malloc_fn> bound_malloc{nullptr};
static std::atomic<free_fn> bound_free{nullptr};
static std::atomic<error_fn> bound_error{nullptr};

/* Points this library at the core's ascend_pool_malloc, ascend_pool_free and ascend_pool_last_error. */
EXPORT void ascend_pool_torch_bind(void *malloc_, void *free_, void *last_error) {
    bound_error.store(reinterpret_cast<error_fn>(last_error));
    bound_free.store(reinterpret_cast<free_fn>(free_));
    bound_malloc.store(reinterpret_cast<malloc_fn>(malloc_));
}

/* ascend_pool_malloc's memory, or an exception: std::runtime_error with the pool's own message
 * (out of memory, over a tenant's quota, a bad device or stream). size is torch's size_t; one past
 * SSIZE_MAX is refused here, in the words of the Python API, naming the size asked for (cast to
 * the core's ssize_t it read "size must be positive, got -1 bytes" for SIZE_MAX). 0 bytes:
 * whatever the core returns (no exception for an empty request). */
EXPORT void *ascend_pool_torch_malloc(size_t size, int device, void *stream) {
    malloc_fn m = bound_malloc.load();
    if (!m)
        throw std::runtime_error("ascend_pool: the torch allocator library was loaded without "
                                 "ascend_pool.integrations installing it (ascend_pool_torch_bind)");
    if (size > (size_t)SSIZE_MAX)
        throw std::runtime_error("ascend_pool: ascend_pool_malloc: size " + std::to_string(size) +
                                 " bytes is larger than any device");
    void *p = m((ssize_t)size, device, stream);
    if (!p && size != 0) {
        error_fn e = bound_error.load();
        const char *why = e ? e() : nullptr;
        throw std::runtime_error(std::string("ascend_pool: ") +
                                 (why && *why ? why : "allocation failed (out of memory)"));
    }
    return p;
}

EXPORT void ascend_pool_torch_free(void *ptr, size_t size, int device, void *stream) {
    free_fn f = bound_free.load();
    if (f)
        f(ptr, (ssize_t)size, device, stream);
}

/* The alloc and free functions torch's pluggable allocators load (torch_npu's NPUPluggableAllocator,
 * torch's CUDAPluggableAllocator): ascend_pool_malloc and ascend_pool_free, except that a failed
 * allocation throws. Neither framework checks a NULL from its alloc function: a NULL became a
 * tensor at address 0, and the first kernel on it a device fault instead of the out-of-memory
 * error a program backs off on (a smaller batch). A C++ exception is how an allocator fails there:
 * torch turns std::runtime_error into RuntimeError, whose text ("... out of memory: Tried to
 * allocate ...") torch's own tests and users match, and c10::OutOfMemoryError into
 * torch.OutOfMemoryError (a RuntimeError), which torch's and torch_npu's own allocators throw when
 * memory runs out and which programs catch to back off (`except torch.OutOfMemoryError`). An out
 * of memory (the device, the memory fraction, a tenant's quota) throws that one where the
 * process's torch has it (oom_throw below); any other refusal, or a torch without it, runtime_error.
 *
 * Built as its own small library (libascend_pool_torch.so, only where a C++ compiler is) so that
 * the C core needs none: the integration binds it to the core's C ABI (ascend_pool_torch_bind)
 * before handing its path to torch, which loads the same file by path. */
#include <atomic>
#include <climits>
#include <cstdint>
#include <cxxabi.h>
#include <dlfcn.h>
#include <exception>
#include <stdexcept>
#include <string>
#include <sys/types.h>

#define EXPORT extern "C" __attribute__((visibility("default")))

typedef void *(*malloc_fn)(size_t size, int device, void *stream); /* torch's size_t: every size reaches the pool */
typedef void (*free_fn)(void *ptr, ssize_t size, int device, void *stream);
typedef const char *(*error_fn)(void);
typedef int (*code_fn)(void);

static std::atomic<malloc_fn> bound_malloc{nullptr};
static std::atomic<free_fn> bound_free{nullptr};
static std::atomic<error_fn> bound_error{nullptr};
static std::atomic<code_fn> bound_code{nullptr};

/* Points this library at the core's allocation (ascend_pool_malloc's, taking torch's size_t:
 * _core._capi_torch_malloc_address), ascend_pool_free, ascend_pool_last_error and
 * ascend_pool_last_error_code (NULL: every failure is a runtime_error). */
EXPORT void ascend_pool_torch_bind(void *malloc_, void *free_, void *last_error, void *last_error_code) {
    bound_code.store(reinterpret_cast<code_fn>(last_error_code));
    bound_error.store(reinterpret_cast<error_fn>(last_error));
    bound_free.store(reinterpret_cast<free_fn>(free_));
    bound_malloc.store(reinterpret_cast<malloc_fn>(malloc_));
}

/* c10::SourceLocation's layout ({function, file, line}, c10/util/StringUtil.h), passed by value
 * to the constructor below as the header's own type would be. */
struct c10_source_location {
    const char *function;
    const char *file;
    uint32_t line;
};
typedef void (*oom_ctor_fn)(void *self, c10_source_location where, std::string msg);

/* Room for the c10::OutOfMemoryError built in place: 128 bytes in torch 2.13; generous, as a
 * later torch's Error may grow (only the allocation is this size, the object is torch's). */
static const size_t OOM_ROOM = 1024;

static void oom_destroy(void *obj) {
    /* c10::Error derives from std::exception first: its virtual destructor (the object's vtable
     * is c10::OutOfMemoryError's) destroys the whole object */
    static_cast<std::exception *>(obj)->~exception();
}

/* Throws c10::OutOfMemoryError(msg) through the libc10 the process has loaded (torch's): its
 * constructor, exported by torch 2.x, and its typeinfo, by name, so that this library needs
 * neither torch's headers nor a link to its libraries; a torch built another way (an older one
 * without the exported constructor, the pre-C++11 string ABI) leaves it a runtime_error. torch's
 * Python bindings catch it by type and raise torch.OutOfMemoryError with msg. Returns only when
 * the process has no such libc10. */
static void oom_throw(const std::string &msg) {
    static std::atomic<int> looked{0};
    static std::atomic<oom_ctor_fn> ctor{nullptr};
    static std::atomic<std::type_info *> type{nullptr};
    if (!looked.load(std::memory_order_acquire)) {
        void *c10 = dlopen("libc10.so", RTLD_LAZY | RTLD_NOLOAD); /* only if torch loaded it */
        if (c10) {
            void *c = dlsym(c10, "_ZN3c1016OutOfMemoryErrorC1ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11"
                                 "char_traitsIcESaIcEEE");
            void *t = dlsym(c10, "_ZTIN3c1016OutOfMemoryErrorE");
            if (c && t) {
                type.store(static_cast<std::type_info *>(t));
                ctor.store(reinterpret_cast<oom_ctor_fn>(c));
            }
            /* the reference stays: torch keeps libc10 for the life of the process */
        }
        looked.store(1, std::memory_order_release);
    }
    oom_ctor_fn c = ctor.load();
    if (!c) return;
    void *obj = __cxxabiv1::__cxa_allocate_exception(OOM_ROOM);
    c(obj, c10_source_location{"ascend_pool_torch_malloc", __FILE__, __LINE__}, msg);
    __cxxabiv1::__cxa_throw(obj, type.load(), oom_destroy);
}

/* ascend_pool_malloc's memory, or an exception: std::runtime_error with the pool's own message
 * (out of memory, over a tenant's quota, a bad device or stream). size is torch's size_t, handed
 * to the pool whole: one past SSIZE_MAX is its out of memory as every size past the device,
 * counted in num_ooms and told to the OOM observers (refused here before, none of that was done).
 * 0 bytes: whatever the core returns (no exception for an empty request). */
EXPORT void *ascend_pool_torch_malloc(size_t size, int device, void *stream) {
    malloc_fn m = bound_malloc.load();
    if (!m)
        throw std::runtime_error("ascend_pool: the torch allocator library was loaded without "
                                 "ascend_pool.integrations installing it (ascend_pool_torch_bind)");
    void *p = m(size, device, stream);
    if (!p && size != 0) {
        error_fn e = bound_error.load();
        code_fn c = bound_code.load();
        const char *why = e ? e() : nullptr;
        std::string msg = std::string("ascend_pool: ") + (why && *why ? why : "allocation failed (out of memory)");
        int code = c ? c() : 0;
        /* the refusals Python raises as ap.OutOfMemoryError: the device, the fraction, a quota
         * (ASCEND_POOL_E_OOM, _LIMIT, _QUOTA of ascend_pool.h) */
        if (code == 1 || code == 2 || code == 10)
            oom_throw(msg);
        throw std::runtime_error(msg);
    }
    return p;
}

EXPORT void ascend_pool_torch_free(void *ptr, size_t size, int device, void *stream) {
    free_fn f = bound_free.load();
    if (f)
        f(ptr, (ssize_t)size, device, stream);
}

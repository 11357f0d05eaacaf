/* Framework threads allocating through the C ABI while the interpreter exits, for
 * tests/test_capi_threads_gil.py: C++ threads whose call runs in a noexcept frame, as torch's
 * allocator calls often do. Each call fails for want of memory with an out-of-memory observer
 * attached, so the C ABI takes the GIL for the observer on every call. */
#include <sys/types.h>
#include <thread>
#include <unistd.h>

typedef void *(*malloc_fn)(ssize_t size, int device, void *stream);

static void allocate_forever(malloc_fn m, int device, ssize_t size) noexcept {
    for (;;) m(size, device, nullptr);
}

/* Starts n detached threads calling m(size, device, NULL) for ever. */
extern "C" void start_threads(void *m, int device, ssize_t size, int n) {
    for (int i = 0; i < n; i++) std::thread(allocate_forever, (malloc_fn)m, device, size).detach();
}

/* Called through ctypes.PyDLL (the GIL held): keeps the GIL for ms, as a C exit handler may. */
extern "C" void hold_gil(int ms) { usleep(ms * 1000); }

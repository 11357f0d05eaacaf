/* The stats hooks of newer torch_npu's NPUPluggableAllocator (set_get_device_stats_fn,
 * set_reset_peak_status_fn; torch_npu v2.7.1 and later, Ascend/pytorch PR 22644). Without them its
 * getDeviceStats warns and returns nothing (undefined behaviour in C++) to whatever C++ code asks:
 * torch_npu's own memory_stats binding, torch.accelerator's, anything else in the process.
 *
 * The stats hook returns c10_npu::NPUCachingAllocator::DeviceStats by value. That struct holds
 * only int64_t figures (Stat: current, peak, allocated, freed; StatArray: 3 Stats, for all, small
 * and large pools) in the torch_npu versions whose header ascend_pool transcribes, so it is passed
 * as any trivially copyable struct of that size is: the caller's memory, its address a hidden
 * argument (x86-64 and AArch64 alike). Hence one function per size below, named by it; which
 * figure goes in which slot is read from the installed header by the integration
 * (ascend_pool/integrations/torch_npu_stats.py), which fills them from ascend_pool's memory_stats.
 * A DeviceStats with any other member (torch 2.13's, for one, holds a hash map of private pools)
 * cannot be built without torch's headers: the integration then registers no stats hook. */
#include <atomic>
#include <ctime>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include <pthread.h>

#define EXPORT extern "C" __attribute__((visibility("default")))

/* Fills n int64 figures of device's stats in the header's order; 0, or -1 (the reason logged). */
typedef int (*fill_fn)(int device, int64_t *figures, size_t n);
typedef int (*reset_fn)(int device);

static std::atomic<fill_fn> bound_fill{nullptr};
static std::atomic<reset_fn> bound_reset{nullptr};
static std::atomic<int> python_gone{0};

/* Points the hooks at the integration's callbacks (each takes the GIL: ctypes callbacks). */
EXPORT void ascend_pool_torch_bind_stats(void *fill, void *reset) {
    bound_fill.store(reinterpret_cast<fill_fn>(fill));
    bound_reset.store(reinterpret_cast<reset_fn>(reset));
}

/* A C++ thread must never wait for the GIL once the interpreter finalizes: Python then ends it in
 * take_gil with pthread_exit, a forced unwind that torch_npu's noexcept frames turn into
 * std::terminate (the process aborted at exit). A flag read before the call cannot see an exit that
 * starts while the thread waits for the GIL, so calls into Python count themselves and the close
 * (atexit, before finalization, without the GIL) turns new ones away and waits for those on their
 * way: a call's increment is seen by the close or the close's flag by the call (both sequentially
 * consistent), as the C ABI's apc_gil_enter and apc_python_close (capi/exports.h). */
static std::atomic<int> calls_in_python{0};
static thread_local int calls_mine = 0; /* this thread's share: a forked child keeps only its own */

namespace {
struct python_call {
    bool ok;
    python_call() {
        calls_in_python.fetch_add(1);
        ok = !python_gone.load();
        if (ok) calls_mine++;
        else calls_in_python.fetch_sub(1);
    }
    ~python_call() {
        if (!ok) return;
        calls_mine--;
        calls_in_python.fetch_sub(1);
    }
};
} // namespace

static void after_fork_in_child() { calls_in_python.store(calls_mine); }
static int fork_handler_set = pthread_atfork(nullptr, nullptr, after_fork_in_child);

/* Called at interpreter exit, through ctypes (the GIL released, so that calls waiting for it get it
 * and finish): from then on the hooks never call into Python (stats read 0, resets do nothing);
 * waits up to 10 s for the calls already on their way (a stats read takes milliseconds). */
EXPORT void ascend_pool_torch_stats_closed(void) {
    (void)fork_handler_set;
    python_gone.store(1);
    struct timespec tick = {0, 1000000L};
    for (int waited = 0; calls_in_python.load() != 0 && waited < 10000; waited++) nanosleep(&tick, nullptr);
}

template <size_t N> struct figures {
    int64_t v[N];
};

template <size_t N> static figures<N> device_stats(int device) {
    figures<N> out{};
    python_call call;
    if (!call.ok) return out;
    fill_fn f = bound_fill.load();
    if (!f)
        throw std::runtime_error("ascend_pool: the torch allocator library's stats hook was called without "
                                 "ascend_pool.integrations.torch_npu installing it");
    if (f(device, out.v, N) != 0)
        throw std::runtime_error("ascend_pool: memory_stats(" + std::to_string(device) +
                                 ") failed (the reason is in the log)");
    return out;
}

/* DeviceStats of torch_npu's own header: 9 StatArrays, num_alloc_retries, num_ooms,
 * oversize_allocations, oversize_segments, max_split_size (119 figures). */
EXPORT figures<119> ascend_pool_torch_device_stats_952(int device) { return device_stats<119>(device); }
/* torch's c10::CachingDeviceAllocator::DeviceStats before its hash map: the above plus
 * num_sync_all_streams, num_device_alloc, num_device_free (122), and num_oom_rejections (123). */
EXPORT figures<122> ascend_pool_torch_device_stats_976(int device) { return device_stats<122>(device); }
EXPORT figures<123> ascend_pool_torch_device_stats_984(int device) { return device_stats<123>(device); }

EXPORT void ascend_pool_torch_reset_peak_stats(int device) {
    python_call call;
    if (!call.ok) return;
    reset_fn r = bound_reset.load();
    if (!r)
        throw std::runtime_error("ascend_pool: the torch allocator library's reset hook was called without "
                                 "ascend_pool.integrations.torch_npu installing it");
    if (r(device) != 0)
        throw std::runtime_error("ascend_pool: reset_peak_memory_stats(" + std::to_string(device) +
                                 ") failed (the reason is in the log)");
}

/* torch_npu's side of the stats hooks, for tests/test_torch_npu_stats_hooks.py: DeviceStats declared
 * as torch_npu's own header declares it (torch_npu/csrc/core/npu/NPUCachingAllocator.h, Ascend/pytorch
 * v2.7.1: the branch set_get_device_stats_fn was added to), and the hook called as torch_npu's
 * Module.cpp binds it: the address Python handed the setter, cast to DeviceStats(int) and held in a
 * std::function, whose result the caller then reads field by field. */
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <new>
#include <thread>

struct Stat {
    int64_t current = 0;
    int64_t peak = 0;
    int64_t allocated = 0;
    int64_t freed = 0;
};

enum struct StatType : uint64_t { AGGREGATE = 0, SMALL_POOL = 1, LARGE_POOL = 2, NUM_TYPES = 3 };

typedef std::array<Stat, static_cast<size_t>(StatType::NUM_TYPES)> StatArray;

struct DeviceStats {
    StatArray allocation;
    StatArray segment;
    StatArray active;
    StatArray inactive_split;
    StatArray allocated_bytes;
    StatArray reserved_bytes;
    StatArray active_bytes;
    StatArray inactive_split_bytes;
    StatArray requested_bytes;
    int64_t num_alloc_retries = 0;
    int64_t num_ooms = 0;
    Stat oversize_allocations;
    Stat oversize_segments;
    int64_t max_split_size = 0;
};

static_assert(sizeof(DeviceStats) == 952, "DeviceStats is 119 int64 figures");

static size_t put_stat(const Stat &s, int64_t *out) {
    out[0] = s.current;
    out[1] = s.peak;
    out[2] = s.allocated;
    out[3] = s.freed;
    return 4;
}

static size_t put_array(const StatArray &a, int64_t *out) {
    size_t n = 0;
    for (const Stat &s : a) n += put_stat(s, out + n);
    return n;
}

/* Calls the hook at address fn for device; writes the 119 figures to out, read member by member in
 * the header's order (allocation.all.current first, max_split_size last). 0, or -1 with the
 * exception's text in why. Canaries around the result catch a hook that writes past it. */
extern "C" int read_device_stats(uint64_t fn, int device, int64_t *out, char *why, size_t len) {
    using FuncType = DeviceStats(int);
    std::function<FuncType> hook = reinterpret_cast<FuncType *>(fn);
    try {
        /* the hook's result built in place (C++17: placement new from the prvalue hands the hook
           this address), followed by bytes it must leave alone */
        alignas(DeviceStats) unsigned char room[sizeof(DeviceStats) + 64];
        memset(room, 0x5a, sizeof room);
        const DeviceStats &s = *new (room) DeviceStats(hook(device));
        for (size_t i = sizeof(DeviceStats); i < sizeof room; i++)
            if (room[i] != 0x5a) {
                snprintf(why, len, "the hook wrote past DeviceStats (byte %zu)", i);
                return -1;
            }
        size_t n = 0;
        for (const StatArray *a : {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes,
                                   &s.reserved_bytes, &s.active_bytes, &s.inactive_split_bytes, &s.requested_bytes})
            n += put_array(*a, out + n);
        out[n++] = s.num_alloc_retries;
        out[n++] = s.num_ooms;
        n += put_stat(s.oversize_allocations, out + n);
        n += put_stat(s.oversize_segments, out + n);
        out[n++] = s.max_split_size;
        return n == 119 ? 0 : -1;
    } catch (const std::exception &e) {
        snprintf(why, len, "%s", e.what());
        return -1;
    }
}

/* Calls the reset hook at address fn as torch_npu's resetPeakStats does. 0, or -1 with why. */
extern "C" int reset_peak(uint64_t fn, int device, char *why, size_t len) {
    using FuncType = void(int);
    std::function<FuncType> hook = reinterpret_cast<FuncType *>(fn);
    try {
        hook(device);
        return 0;
    } catch (const std::exception &e) {
        snprintf(why, len, "%s", e.what());
        return -1;
    }
}

/* Starts n detached threads reading the stats hook at fn for device for ever, in a noexcept frame
 * as torch_npu's C++ callers often are (a watchdog, a profiler), for the exit test: a thread that
 * Python ends with pthread_exit in take_gil aborts the process there (std::terminate). */
static void read_forever(uint64_t fn, int device) noexcept {
    int64_t out[119];
    char why[256];
    for (;;) read_device_stats(fn, device, out, why, sizeof why);
}

extern "C" void start_stats_readers(uint64_t fn, int device, int n) {
    for (int i = 0; i < n; i++) std::thread(read_forever, fn, device).detach();
}

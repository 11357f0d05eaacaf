"""Ports of RMM's own allocator tests (cpp/tests/mr/device: mr_ref_test, mr_ref_multithreaded,
pool_mr, arena_mr, statistics_mr, tracking_mr, limiting_mr, failure_callback_mr, aligned_mr;
python/rmm/tests/test_rmm.py) and of the CUDA stream-ordered allocator's rules
(cudaMallocAsync / cudaFreeAsync) to ascend_pool's Pool, its C ABI and its streams: what those
suites check of a caching pool holds here too. Where RMM's API differs, the port says what stands
for it: RMM's maximum_pool_size and limiting_resource_adaptor are `set_limit(limit_bytes=...)`
(a cap on the bytes the pool holds from the device, not on the bytes handed out), its
initial_pool_size is the `reserve` knob, its statistics_resource_adaptor's counts are
`memory_stats()`'s `allocation.all.*` and `requested_bytes.all.*`, and its failure callback is an
out-of-memory observer (torch's: told before the error; the caller retries). Sizes in bytes."""
import ctypes
import queue
import random
import threading
import time

import pytest

import ascend_pool as ap
from ascend_pool import sim

MiB = 1 << 20
KNOBS = [{}, dict(expandable_segments=True), dict(stream_reuse="tied"), dict(release_policy="never")]
IDS = ["default", "expandable", "tied", "never"]
SIZES = [1, 7, 100, 511, 512, 513, 4095, 4096, 65537, MiB - 1, MiB, MiB + 1, 3 * MiB + 5, 11 * MiB,
         21 * MiB, 100 * MiB + 7]


@pytest.fixture(scope="module")
def lib():
    lib = ctypes.CDLL(ap.library_path())
    lib.ascend_pool_malloc.restype = ctypes.c_void_p
    lib.ascend_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ascend_pool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ascend_pool_last_error.restype = ctypes.c_char_p
    lib.ascend_pool_base_alloc.restype = ctypes.c_void_p
    lib.ascend_pool_base_alloc.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
    lib.ascend_pool_init(0)
    return lib


def _stats(pool, *keys):
    st = pool.memory_stats()
    return tuple(st[k] for k in keys)


@pytest.mark.parametrize("knobs", KNOBS + [dict(page_size="1g"), dict(no_split=True)],
                         ids=IDS + ["1g", "no_split"])
def test_every_address_is_512_byte_aligned_on_every_stream(knobs):
    # mr_ref_test's is_properly_aligned check on each allocation of AllocateDefault, AllocateOnStream,
    # RandomAllocations: the runtime gives 64-byte-aligned bases (include/ascend_pool.h promises
    # that much); blocks are 512-byte units carved from 2 MiB-aligned segments, so every address
    # the pool hands out is 512-byte aligned, as torch_npu's and what NPU kernels assume
    pool = ap.Pool(0, backend="sim", **knobs)
    try:
        s = pool.create_stream()
        live = []
        for n in SIZES:
            for stream in (None, s):
                p = pool.malloc(n, stream=stream)
                live.append((p, stream))
                assert p % 512 == 0, (n, hex(p))
        for p, stream in live:
            pool.free(p, stream=stream)
    finally:
        pool.close()


def test_c_abi_addresses_are_aligned_and_inside_their_segment(lib):
    # the same through the symbols frameworks call, with ascend_pool_base_alloc's segment holding
    # every byte of the block
    live = []
    try:
        for n in SIZES:
            p = lib.ascend_pool_malloc(n, 0, None)
            assert p, lib.ascend_pool_last_error()
            live.append((p, n))
            assert p % 512 == 0, (n, hex(p))
            size = ctypes.c_size_t()
            base = lib.ascend_pool_base_alloc(ctypes.c_void_p(p + n - 1), ctypes.byref(size))
            assert base and base <= p and p + n <= base + size.value, (n, hex(p), base, size.value)
    finally:
        for p, n in live:
            lib.ascend_pool_free(p, n, 0, None)


def test_allocate_zero_and_sizes_near_2_63(pool, lib):
    # mr_ref_test's AllocateZeroBytes (RMM hands back nullptr; here 0 bytes is the documented
    # InvalidSizeError, and torch's caching_allocator_alloc(0) the null address) and
    # AllocateTooMuch: a size beyond the device, up to ssize_t's largest, is an out of memory
    # in torch's words, counted, and the pool keeps serving
    with pytest.raises(ap.InvalidSizeError, match="size must be positive, got 0 bytes"):
        pool.malloc(0)
    assert ap.caching_allocator_alloc(0, device=0) == 0
    ooms = _stats(pool, "num_ooms")[0]
    for n in (1 << 40, 2**60, 2**62 + 1, 2**63 - 512, 2**63 - 1):
        with pytest.raises(ap.OutOfMemoryError, match="Tried to allocate"):
            pool.malloc(n)
    assert _stats(pool, "num_ooms")[0] == ooms + 5
    for n in (2**63 - 1, 2**63 - 33, 2**60):
        lib.ascend_pool_clear_last_error()
        assert not lib.ascend_pool_malloc(n, 0, None)
        assert lib.ascend_pool_last_error_code() == 1 and b"more than 1EB" in lib.ascend_pool_last_error()
    for n in (0, -1, -(2**63)):
        lib.ascend_pool_clear_last_error()
        assert not lib.ascend_pool_malloc(n, 0, None)
        assert lib.ascend_pool_last_error_code() == 3
    pool.free(pool.malloc(MiB))


def test_statistics_current_peak_and_total_after_each_operation(pool):
    # statistics_mr_tests (and test_rmm.py's test_statistics_resource_adaptor): counts and bytes,
    # current / peak / total, after every allocation and free; a failed request changes none
    keys = ("allocation.all.current", "allocation.all.peak", "allocation.all.allocated", "allocation.all.freed",
            "requested_bytes.all.current", "requested_bytes.all.peak", "requested_bytes.all.allocated",
            "requested_bytes.all.freed")
    assert _stats(pool, *keys) == (0,) * 8
    ptrs = [pool.malloc(1000) for _ in range(10)]
    assert _stats(pool, *keys) == (10, 10, 10, 0, 10000, 10000, 10000, 0)
    for i in range(9, 0, -2):
        pool.free(ptrs.pop(i))
    assert _stats(pool, *keys) == (5, 10, 10, 5, 5000, 10000, 10000, 5000)
    pool.set_limit(limit_bytes=2 * MiB)
    with pytest.raises(ap.OutOfMemoryError):
        pool.malloc(4 * MiB)
    assert _stats(pool, *keys) == (5, 10, 10, 5, 5000, 10000, 10000, 5000)
    pool.set_limit(None)
    big = pool.malloc(3 * MiB)
    assert _stats(pool, *keys) == (6, 10, 11, 5, 5000 + 3 * MiB, 5000 + 3 * MiB, 10000 + 3 * MiB, 5000)
    pool.reset_peak_stats()
    assert _stats(pool, "allocation.all.peak", "requested_bytes.all.peak") == (6, 5000 + 3 * MiB)
    for p in ptrs + [big]:
        pool.free(p)
    assert _stats(pool, *keys) == (0, 6, 11, 11, 0, 5000 + 3 * MiB, 10000 + 3 * MiB, 10000 + 3 * MiB)
    # tracking_mr's outstanding allocations: none left in the snapshot either
    assert not [b for s in pool.snapshot()["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]


@pytest.mark.parametrize("knobs", KNOBS, ids=IDS)
def test_limit_is_exact_at_its_boundary(knobs):
    # limiting_mr_tests' TooBig / UnderLimitDueToFrees / OverLimit: a request whose growth takes
    # the pool to exactly its limit is served, one byte more is refused, and frees make room again
    pool = ap.Pool(0, backend="sim", **knobs)
    try:
        pool.set_limit(limit_bytes=20 * MiB)
        a = pool.malloc(20 * MiB - 32)  # + the runtime's 32-byte pad: exactly 20 MiB of segment
        assert _stats(pool, "reserved_bytes.all.current")[0] == 20 * MiB
        with pytest.raises(ap.OutOfMemoryError, match="limit"):
            pool.malloc(1)
        pool.free(a)
        pool.empty_cache()
        with pytest.raises(ap.OutOfMemoryError, match="limit"):
            pool.malloc(20 * MiB - 31)
        pool.free(pool.malloc(20 * MiB - 32))
        assert _stats(pool, "reserved_bytes.all.peak")[0] <= 20 * MiB
    finally:
        pool.close()


@pytest.mark.parametrize("knobs", KNOBS, ids=IDS)
def test_growth_to_the_maximum_then_out_of_memory_then_recovery(knobs):
    # pool_mr_tests' ForceGrowth / ThrowAtomicMaximumPoolSize and arena's defragment case: the pool
    # grows to its maximum, the next request is out of memory, and after frees the same requests
    # are served again, a large one too from the room the small blocks' cache held
    pool = ap.Pool(0, backend="sim", **knobs)
    try:
        pool.set_limit(limit_bytes=64 * MiB)
        got = []
        with pytest.raises(ap.OutOfMemoryError):
            while True:
                got.append(pool.malloc(MiB))
        assert len(got) >= 31, len(got)  # 1 MiB + pad: 31 in 32 small 2 MiB segments at worst
        for p in got[:8]:
            pool.free(p)
        again = [pool.malloc(MiB) for _ in range(8)]
        for p in got[8:] + again:
            pool.free(p)
        big = pool.malloc(60 * MiB)
        assert _stats(pool, "reserved_bytes.all.current")[0] <= 64 * MiB
        pool.free(big)
        pool._check_invariants()
    finally:
        pool.close()


def test_reserve_equal_to_the_maximum(pool):
    # pool_mr_tests' InitialAndMaxPoolSizeEqual: initial_pool_size (reserve) == maximum; all of it
    # is served without another device call, no byte more
    p = ap.Pool(0, backend="sim", reserve=64 * MiB)
    try:
        p.set_limit(limit_bytes=64 * MiB)
        calls = _stats(p, "num_device_alloc")[0]
        a = p.malloc(64 * MiB - 32)
        assert _stats(p, "num_device_alloc", "reserved_bytes.all.current") == (calls, 64 * MiB)
        with pytest.raises(ap.OutOfMemoryError):
            p.malloc(1)
        p.free(a)
    finally:
        p.close()


def test_a_failure_callback_that_frees_memory_lets_the_retry_succeed(pool):
    # failure_callback_mr_tests / test_rmm.py's test_failure_callback_resource_adaptor: the callback
    # runs on the failure (no pool lock held: it may free), the caller's retry then succeeds
    pool.set_limit(limit_bytes=40 * MiB)
    hold = [pool.malloc(20 * MiB - 32)]
    calls = []

    def callback(device, size, allowed, free):
        calls.append((device, size, allowed))
        while hold:
            pool.free(hold.pop())

    a = pool.malloc(20 * MiB - 32)
    ap.attach_out_of_memory_observer(callback)
    try:
        with pytest.raises(ap.OutOfMemoryError):
            pool.malloc(20 * MiB - 32)
        b = pool.malloc(20 * MiB - 32)
    finally:
        ap.detach_out_of_memory_observer(callback)
    assert calls == [(0, 20 * MiB - 32, 40 * MiB)]
    pool.free(a)
    pool.free(b)


def test_threads_allocate_on_one_stream_and_free_on_another(pool, lib):
    # mr_ref_multithreaded_tests' AllocFreeDifferentThreadsDifferentStream, through Python and the
    # C ABI: every block comes back, the counts balance and the pool's structure holds
    s1, s2 = pool.create_stream(), pool.create_stream()
    done = queue.Queue(maxsize=64)
    errors = []

    def producer(capi):
        rng = random.Random(1)
        for _ in range(1500):
            n = rng.randrange(1, 4 * MiB)
            if capi:
                with ap.use_mem_pool(pool):
                    p = lib.ascend_pool_malloc(n, 0, ctypes.c_void_p(s1))
                if not p:
                    errors.append(lib.ascend_pool_last_error())
                    break
            else:
                p = pool.malloc(n, stream=s1)
            done.put((p, n))
        done.put(None)

    def consumer(capi):
        while (item := done.get()) is not None:
            if capi:  # the block is found in its pool from a thread where it is not current
                lib.ascend_pool_clear_last_error()
                lib.ascend_pool_free(item[0], item[1], 0, ctypes.c_void_p(s2))
                if lib.ascend_pool_last_error_code():
                    errors.append(lib.ascend_pool_last_error())
            else:
                pool.free(item[0], stream=s2)

    for capi in (False, True):
        threads = [threading.Thread(target=producer, args=(capi,)), threading.Thread(target=consumer, args=(capi,))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    pool.synchronize(s1)
    pool.synchronize(s2)
    n, allocated, freed = _stats(pool, "allocation.all.current", "allocation.all.allocated", "allocation.all.freed")
    assert (n, allocated, freed) == (0, 3000, 3000)
    pool._check_invariants()


@pytest.mark.parametrize("knobs", KNOBS, ids=IDS)
def test_random_allocations_across_many_streams_with_stream_sync(knobs):
    # mr_ref_test's RandomAllocationsStream / MixedRandomAllocationFreeStream, over 16 streams,
    # frees on any of them, with stream syncs between: everything goes back at the end
    pool = ap.Pool(0, backend="sim", **knobs)
    try:
        streams = [pool.create_stream() for _ in range(16)]
        rng = random.Random(5)
        live = []
        for i in range(2000):
            if live and rng.random() < 0.5:
                pool.free(live.pop(rng.randrange(len(live))), stream=rng.choice(streams))
            else:
                live.append(pool.malloc(rng.randrange(1, 4 * MiB), stream=rng.choice(streams)))
            if i % 400 == 0:
                for s in streams:
                    pool.synchronize(s)
        for p in live:
            pool.free(p)
        for s in streams:
            pool.destroy_stream(s)
        pool._check_invariants()
        pool.empty_cache()
        assert _stats(pool, "allocation.all.current", "reserved_bytes.all.current")[0] == 0
        assert _stats(pool, "reserved_bytes.all.current")[0] == 0 or knobs.get("expandable_segments")
    finally:
        pool.close()


def test_a_deleted_stream_then_the_default_stream(pool):
    # pool_mr_tests' DeletedStream and test_rmm.py's stream-lifetime case: a block of a stream
    # destroyed while its kernel still writes it is freed afterwards, the pool serves the default
    # stream, and the kernel's bytes land in no later block
    s = pool.create_stream()
    a = pool.malloc(30 * MiB, stream=s)
    sim.launch_fill(s, a, 30 * MiB, 1, delay_s=0.2)
    pool.destroy_stream(s)
    pool.free(a)
    b = pool.malloc(30 * MiB)
    sim.launch_fill(None, b, 30 * MiB, 2)
    pool.synchronize()
    assert sim.read(b, 8) + sim.read(b + 30 * MiB - 8, 8) == bytes([2]) * 16
    pool.free(b)
    pool.empty_cache()
    assert _stats(pool, "reserved_bytes.all.current")[0] == 0


@pytest.mark.parametrize("knobs", KNOBS, ids=IDS)
@pytest.mark.parametrize("how", ["free_on_other_stream", "record_stream"])
def test_a_block_freed_on_another_stream_is_not_reused_before_that_streams_work(knobs, how):
    # cudaFreeAsync(ptr, B) of memory allocated on A: the free is ordered on B, so a request on A
    # may not be given the block while B's work still writes it (the pool orders it or picks
    # another); torch's record_stream the same
    pool = ap.Pool(0, backend="sim", **knobs)
    try:
        for size in (1000, 3 * MiB, 30 * MiB):
            a_s, b_s = pool.create_stream(), pool.create_stream()
            x = pool.malloc(size, stream=a_s)
            sim.launch_fill(b_s, x, size, 1, delay_s=0.15)
            if how == "record_stream":
                pool.record_stream(x, b_s)
                pool.free(x)
            else:
                pool.free(x, stream=b_s)
            y = pool.malloc(size, stream=a_s)
            sim.launch_fill(a_s, y, size, 2)
            pool.synchronize(a_s)
            pool.synchronize(b_s)
            assert sim.read(y, 8) + sim.read(y + size - 8, 8) == bytes([2]) * 16, (size, x == y)
            pool.free(y, stream=a_s)
    finally:
        pool.close()


@pytest.mark.parametrize("knobs", [{}, dict(expandable_segments=True)], ids=["default", "expandable"])
def test_a_block_whose_free_completed_serves_another_stream_without_growth(knobs):
    # the stream-ordered allocator's opportunistic reuse: once the work before a free on A has
    # completed (nobody told the pool), a request on B takes the block rather than growing
    pool = ap.Pool(0, backend="sim", **knobs)
    try:
        a_s, b_s = pool.create_stream(), pool.create_stream()
        for size in (1000, 3 * MiB, 30 * MiB):
            x = pool.malloc(size, stream=a_s)
            sim.launch_fill(a_s, x, size, 1, delay_s=0.02)
            pool.free(x, stream=a_s)
            deadline = time.monotonic() + 5
            while sim.read(x + size - 8, 8) != bytes([1]) * 8 and time.monotonic() < deadline:
                time.sleep(0.01)
            before = _stats(pool, "num_device_alloc", "reserved_bytes.all.current")
            y = pool.malloc(size, stream=b_s)
            assert _stats(pool, "num_device_alloc", "reserved_bytes.all.current") == before, size
            pool.free(y, stream=b_s)
    finally:
        pool.close()


def test_threads_racing_at_the_maximum_all_finish_and_it_is_never_passed():
    # pool_mr_tests' ThrowAtomicMaximumPoolSize under mr_ref_multithreaded's spawn: threads whose
    # requests meet the maximum retry after the others' frees; every one finishes, the maximum holds
    pool = ap.Pool(0, backend="sim")
    try:
        pool.set_limit(limit_bytes=64 * MiB)
        failed = []

        def work(seed):
            rng = random.Random(seed)
            for _ in range(150):
                n = rng.choice([MiB, 4 * MiB, 12 * MiB, 25 * MiB])
                for _ in range(4000):
                    try:
                        p = pool.malloc(n)
                        break
                    except ap.OutOfMemoryError:
                        time.sleep(0.0005)
                else:
                    failed.append(n)
                    return
                pool.free(p)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failed
        assert _stats(pool, "reserved_bytes.all.peak")[0] <= 64 * MiB
        assert _stats(pool, "allocation.all.current")[0] == 0
        pool._check_invariants()
    finally:
        pool.close()

"""Every bad input gets a typed error naming the problem, and the pool keeps serving."""

import pytest

import ascend_pool as ap

MiB = 1 << 20


def assert_consistent(pool, live):
    st = pool.memory_stats()
    assert st["allocation.all.current"] == len(live)
    # the pool still serves
    ptr = pool.malloc(1234)
    pool.free(ptr)


@pytest.mark.parametrize("size, match", [
    (0, "positive"), (-1, "positive"), (-(2**63), "positive"),
    # below any ssize_t: still "positive" (before: "larger than any device")
    (-(2**64), "must be positive, got -18446744073709551616"), (-(2**70), "must be positive"),
    (1.5, "integer"), ("100", "integer"), (None, "integer"), (True, "integer"),
    (2**70, "larger than any device"),
])
def test_bad_sizes_raise_invalid_size(pool, size, match):
    live = [pool.malloc(100)]
    with pytest.raises(ap.InvalidSizeError, match=match):
        pool.malloc(size)
    assert_consistent(pool, live)


def test_a_size_whose_index_refuses_is_an_invalid_size(pool):
    """An object with an __index__ that raises (a numpy array of one or more items) is not a
    size: InvalidSizeError naming it (before: numpy's bare TypeError escaped); a 0-d integer
    array is a size."""
    np = pytest.importorskip("numpy")
    live = [pool.malloc(100)]
    for size in (np.array([5]), np.array([1, 2])):
        with pytest.raises(ap.InvalidSizeError, match="integer number of bytes, got ndarray"):
            pool.malloc(size)
    assert_consistent(pool, live)
    pool.free(pool.malloc(np.array(5)))


def test_a_pointer_or_device_whose_index_refuses_is_named(pool):
    """numpy.array([1, 2]) as a pointer or a device: InvalidPointerError / InvalidDeviceError
    (before: numpy's bare TypeError from free, record_stream, Pool() and the module functions)."""
    np = pytest.importorskip("numpy")
    live = [pool.malloc(100)]
    arr = np.array([1, 2])
    with pytest.raises(ap.InvalidPointerError, match="positive integer device address"):
        pool.free(arr)
    with pytest.raises(ap.InvalidPointerError, match="positive integer device address"):
        pool.record_stream(arr, None)
    with pytest.raises(ap.InvalidDeviceError):
        ap.Pool(arr)
    with pytest.raises(ap.InvalidDeviceError):
        ap.memory_stats(arr)
    assert_consistent(pool, live)


def test_larger_than_the_device_is_out_of_memory_without_trimming(pool):
    live = [pool.malloc(100)]
    total = pool.memory_stats()["device_total_bytes"]
    with pytest.raises(ap.OutOfMemoryError, match="larger than the device"):
        pool.malloc(total + 1)
    assert isinstance(ap.OutOfMemoryError("x"), MemoryError)
    assert_consistent(pool, live)


@pytest.mark.parametrize("size", [2**63 - 1, 2**63, 2**63 + 5, 2**64 - 1])
def test_a_size_up_to_the_largest_size_t_is_out_of_memory_on_every_path(pool, size):
    # one rule, CuPy's (its hook: OutOfMemoryError up to its size_t's 2**64-1) and torch's (past
    # the device, "more than 1EB"): from 2**63 on pool.malloc, ap.malloc, caching_allocator_alloc,
    # share_malloc and a tenant context raised InvalidSizeError where 2**63-1 was an out-of-memory
    np = pytest.importorskip("numpy")
    live = [pool.malloc(100)]
    ctx = pool.context("huge-size")
    try:
        calls = [pool.malloc, ctx.malloc, pool.share_malloc, ap.malloc, ap.caching_allocator_alloc,
                 lambda n: pool.malloc(np.uint64(n))]
        for call in calls:
            with pytest.raises(ap.OutOfMemoryError, match=rf"Tried to (allocate more than 1EB memory \({size} bytes\)|"
                                                          rf"share {size} bytes)"):
                call(size)
        with pytest.raises(ap.InvalidSizeError, match="larger than any device"):
            pool.malloc(2**64)  # no C size holds it: still a bad argument (CuPy's size_t refuses it)
    finally:
        ctx.close()
    assert_consistent(pool, live)


def test_double_free_is_named(pool):
    a = pool.malloc(4096)
    pool.free(a)
    with pytest.raises(ap.InvalidPointerError, match="not allocated"):
        pool.free(a)
    assert_consistent(pool, [])


def test_unknown_pointer(pool):
    with pytest.raises(ap.InvalidPointerError, match="not allocated by this pool"):
        pool.free(0xDEAD000)
    assert_consistent(pool, [])


@pytest.mark.parametrize("ptr", [0, -4096, 2**80, 1.0, "0x1000", None])
def test_malformed_pointer(pool, ptr):
    with pytest.raises(ap.InvalidPointerError):
        pool.free(ptr)
    assert_consistent(pool, [])


def test_numpy_integer_pointers_are_addresses_as_numpy_integer_sizes_are(pool):
    np = pytest.importorskip("numpy")
    for kind in (np.uint64, np.int64, np.uintp):
        ptr = pool.malloc(np.int64(4096))
        pool.free(kind(ptr))  # an array of pointers hands out numpy integers
    assert pool.memory_stats()["allocated_bytes.all.current"] == 0
    with pytest.raises(ap.InvalidPointerError):
        pool.free(np.bool_(True))  # not an address, though it converts to 1
    with pytest.raises(ap.InvalidPointerError):
        pool.free(True)


def test_interior_pointer_is_named(pool):
    a = pool.malloc(8192)
    with pytest.raises(ap.InvalidPointerError, match="inside the block"):
        pool.free(a + 512)
    assert_consistent(pool, [a])
    pool.free(a)


def test_pointer_of_another_device(pool):
    other = ap.Pool(1, backend="sim")
    try:
        a = other.malloc(4096)
        with pytest.raises(ap.InvalidPointerError):
            pool.free(a)
        other.free(a)
    finally:
        other.close()
    assert_consistent(pool, [])


@pytest.mark.parametrize("device", [-1, 99])
def test_bad_device(device):
    with pytest.raises(ap.InvalidDeviceError, match="does not exist"):
        ap.Pool(device, backend="sim")


@pytest.mark.parametrize("device", ["0", 1.0, None, True])
def test_device_of_the_wrong_type_is_named_as_such(device):
    with pytest.raises(ap.InvalidDeviceError, match="device must be an integer index"):
        ap.Pool(device, backend="sim")


@pytest.mark.parametrize("device", ["npu:1", "cuda:1"])
def test_a_torch_device_string_names_the_device(device):
    """ap.malloc(device="npu:1") works (torch's forms); so does Pool(device="npu:1")."""
    pool = ap.Pool(device=device, backend="sim")
    try:
        assert pool.device == 1
    finally:
        pool.close()


@pytest.mark.parametrize("device, words", [("npu", "names no index"), ("cpu:0", "Expected a npu or cuda device"),
                                           ("npu:x", "Invalid device string"), ("npu: 1", "Invalid device string"),
                                           ("npu:+1", "Invalid device string"), ("npu:1_0", "Invalid device string")])
def test_a_torch_device_string_without_a_usable_index_is_refused(device, words):
    with pytest.raises(ap.InvalidDeviceError, match=words):
        ap.Pool(device=device, backend="sim")


@pytest.mark.parametrize("device", ["npu:", "npu:01", "cuda:00"])
def test_a_device_string_torch_refuses_is_refused_not_read_as_a_device(device):
    """torch.device refuses an empty index and a leading zero ("Invalid device string"); the module
    functions read "npu:" as the current device and "npu:01" as device 1 (before)."""
    with pytest.raises(ap.InvalidDeviceError, match="Invalid device string"):
        ap.memory_allocated(device)
    with pytest.raises(ap.InvalidDeviceError, match="Invalid device string"):
        ap.Pool(device=device, backend="sim")
    assert ap.memory_allocated("npu:0") == ap.memory_allocated(0)


def test_numpy_integer_device_index_is_a_device():
    np = pytest.importorskip("numpy")
    pool = ap.Pool(np.int64(0), backend="sim")  # was: "device np.int64(0) does not exist"
    try:
        assert pool.device == 0
        pool.free(pool.malloc(4096))
    finally:
        pool.close()


def test_unknown_stream(pool):
    with pytest.raises(ap.InvalidStreamError, match="not a live stream"):
        pool.malloc(100, stream=12345)
    a = pool.malloc(100)
    with pytest.raises(ap.InvalidStreamError):
        pool.free(a, stream=12345)
    with pytest.raises(ap.InvalidStreamError):
        pool.record_stream(a, 12345)
    pool.free(a)
    assert_consistent(pool, [])


def test_closed_pool_raises(pool):
    p = ap.Pool(0, backend="sim")
    a = p.malloc(100)
    p.close()
    with pytest.raises(ap.PoolError, match="closed"):
        p.malloc(100)
    with pytest.raises(ap.PoolError, match="closed"):
        p.free(a)


def test_errors_share_one_base():
    for cls in (ap.OutOfMemoryError, ap.QuotaExceededError, ap.InvalidSizeError, ap.InvalidPointerError,
                ap.InvalidStreamError, ap.InvalidDeviceError, ap.ConfigError, ap.DeviceError):
        assert issubclass(cls, ap.PoolError)


_HOST_OOM = r"""
import json, resource, ascend_pool as ap
pool = ap.Pool(0, backend="sim")
spare = pool.malloc(8192)
live = [pool.malloc(512) for _ in range((1 << 17) - 1)]
pool.free(spare)                      # free space: the next mallocs need no device call
live.append(pool.malloc(512))         # 2**17 live blocks: the next one doubles the live map (8 MiB)
before = pool.memory_stats()["allocated_bytes.all.current"]
data = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmData"))
resource.setrlimit(resource.RLIMIT_DATA, (data + (1 << 20), resource.RLIM_INFINITY))
try:
    live.append(pool.malloc(512))
    error = None
except MemoryError as e:
    error = type(e).__name__
resource.setrlimit(resource.RLIMIT_DATA, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
st = pool.memory_stats()
try:
    pool._check_invariants()
    broken = None
except AssertionError as e:
    broken = str(e)
print(json.dumps({"error": error, "live": len(live), "allocation": st["allocation.all.current"],
                  "allocated_bytes": st["allocated_bytes.all.current"], "before": before, "broken": broken}))
"""


def test_host_out_of_memory_for_the_live_map_undoes_the_allocation(tmp_path):
    """When the live map cannot grow (host memory exhausted: RLIMIT_DATA in a child process), the
    malloc fails with MemoryError and the block goes back whole: not counted as allocated."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ)  # under scripts/asan.sh: a failed calloc returns NULL, as libc's does
    env["ASAN_OPTIONS"] = env.get("ASAN_OPTIONS", "") + ":allocator_may_return_null=1"
    r = subprocess.run([sys.executable, "-c", _HOST_OOM], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["error"] == "MemoryError", got  # the bookkeeping's own error, not a device OOM
    assert got["allocation"] == got["live"] == 1 << 17, got
    assert got["allocated_bytes"] == got["before"], got
    assert got["broken"] is None, got


def test_stream_zero_is_the_default_stream(pool):
    # 0, the null handle, is the default stream in CUDA and ACL (and in torch's snapshots):
    # CuPy's free_all_blocks(stream=0) and code that passes the default stream's handle work
    a = pool.malloc(100, stream=0)
    pool.free(a, stream=0)
    pool.synchronize(0)
    pool.free_all_blocks(stream=0)
    assert pool.memory_stats()["reserved_bytes.all.current"] == 0
    with pytest.raises(ap.InvalidStreamError):
        pool.malloc(100, stream=1)  # any other unknown handle is still refused
    assert_consistent(pool, [])


def test_a_lifetime_stats_wait_that_is_no_c_int_of_milliseconds_is_a_config_error(pool):
    """lifetime_stats(wait_ms=...) (what the metrics read) takes an int of milliseconds for a C int:
    a string, a float, None or a bool is a ConfigTypeError, 2**31 ms and more a ConfigError, each
    naming wait_ms (before: Cython's bare TypeError / OverflowError); any negative waits forever."""
    for bad in ("x", 1.5, None, True):
        with pytest.raises(ap.ConfigTypeError, match="wait_ms: expected an integer"):
            pool.lifetime_stats(bad)
    for bad in (2**31, 2**40):
        with pytest.raises(ap.ConfigError, match="wait_ms: must be below 2"):
            pool.lifetime_stats(wait_ms=bad)
    for good in (-(2**40), -1, 0, 2**31 - 1):
        assert pool.lifetime_stats(good)["allocation.all.current"] == 0

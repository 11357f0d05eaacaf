"""Bad calls through the C ABI return NULL or are ignored, set the calling thread's last error,
never abort, and leave the pools consistent. Also the calls beyond malloc/free: stream-ordered
frees, frees from another context, record_stream, base_alloc, memory fraction, empty_cache."""

import ctypes
import math
import threading

import pytest

import ascend_pool as ap
from ascend_pool import sim

OK, OOM, LIMIT, INVALID_SIZE, INVALID_PTR = 0, 1, 2, 3, 4
INVALID_DEVICE, NOT_READY, INVALID_ARG = 100, 101, 102


class CAPI:
    """The exported functions through ctypes, as a C caller sees them."""

    def __init__(self):
        lib = ctypes.CDLL(ap.library_path())
        lib.ascend_pool_malloc.restype = ctypes.c_void_p
        lib.ascend_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.ascend_pool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.ascend_pool_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.ascend_pool_base_alloc.restype = ctypes.c_void_p
        lib.ascend_pool_base_alloc.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        lib.ascend_pool_set_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
        lib.ascend_pool_reset.argtypes = [ctypes.c_bool]
        lib.ascend_pool_last_error.restype = ctypes.c_char_p
        self.lib = lib

    def __getattr__(self, name):
        return getattr(self.lib, "ascend_pool_" + name)

    def error(self):
        return self.lib.ascend_pool_last_error_code(), self.lib.ascend_pool_last_error().decode()


@pytest.fixture(scope="module")
def c():
    ap.default_pool(0)
    return CAPI()


@pytest.fixture
def clean(c):
    """Clears the last error, and checks after the test that device 0's default pool is back to
    what it held and still serves a malloc/free."""
    c.clear_last_error()
    before = ap.memory_stats(0)["allocated_bytes.all.current"]
    yield c
    assert ap.memory_stats(0)["allocated_bytes.all.current"] == before
    p = c.malloc(1000, 0, None)
    assert p
    c.free(p, 1000, 0, None)
    assert ap.memory_stats(0)["allocated_bytes.all.current"] == before


@pytest.mark.parametrize("size", [0, -1, -(1 << 62)])
def test_nonpositive_sizes_return_null(clean, size):
    assert clean.malloc(size, 0, None) is None
    code, msg = clean.error()
    assert code == INVALID_SIZE and "size must be positive" in msg and str(size) in msg


def test_size_beyond_the_device_is_out_of_memory(clean):
    assert clean.malloc(1 << 60, 0, None) is None
    code, msg = clean.error()
    assert code == OOM and "larger than the device" in msg


@pytest.mark.parametrize("device", [-1, 64, 1000, "count"])
def test_bad_devices_return_null_and_are_ignored_on_free(clean, device):
    if device == "count":
        device = ap.default_pool(0).backend.device_count
    assert clean.malloc(4096, device, None) is None
    code, msg = clean.error()
    assert code == INVALID_DEVICE and f"device {device} does not exist" in msg
    clean.clear_last_error()
    clean.free(ctypes.c_void_p(0x10000), 4096, device, None)
    assert clean.error()[0] == INVALID_DEVICE


def test_unknown_double_and_interior_pointers_are_ignored_on_free(clean):
    clean.free(ctypes.c_void_p(0x1234000), 10, 0, None)
    code, msg = clean.error()
    assert code == INVALID_PTR and "0x1234000" in msg
    p = clean.malloc(8192, 0, None)
    clean.clear_last_error()
    clean.free(p + 512, 8192, 0, None)
    assert clean.error()[0] == INVALID_PTR and "inside the block" in clean.error()[1]
    clean.free(p, 8192, 0, None)
    assert clean.error()[0] == INVALID_PTR  # still the earlier error: success does not clear it
    clean.clear_last_error()
    clean.free(p, 8192, 0, None)  # double free
    code, msg = clean.error()
    assert code == INVALID_PTR and "double free" in msg
    clean.clear_last_error()
    clean.free(None, 0, 0, None)  # free(NULL) is a no-op, like C's
    assert clean.error() == (OK, "")


def test_record_stream_and_base_alloc_refuse_unknown_pointers(clean):
    clean.record_stream(ctypes.c_void_p(0x5000), None)
    assert clean.error()[0] == INVALID_PTR
    clean.clear_last_error()
    size = ctypes.c_size_t(123)
    assert clean.base_alloc(ctypes.c_void_p(0x5000), ctypes.byref(size)) is None
    assert size.value == 0 and clean.error()[0] == INVALID_PTR
    clean.clear_last_error()
    p = clean.malloc(100, 0, None)
    assert clean.base_alloc(p, None) is None and clean.error()[0] == INVALID_ARG
    clean.free(p, 100, 0, None)


def test_last_error_is_per_thread(clean):
    assert clean.malloc(0, 0, None) is None
    seen = []
    t = threading.Thread(target=lambda: seen.append(clean.error()))
    t.start()
    t.join()
    assert seen == [(OK, "")]
    assert clean.error()[0] == INVALID_SIZE


def test_base_alloc_gives_the_segment_holding_a_block(clean):
    pool = ap.default_pool(0)
    p = clean.malloc(3 << 20, 0, None)
    size = ctypes.c_size_t()
    base = clean.base_alloc(p + 4096, ctypes.byref(size))  # any address inside the block
    segments = [s for s in pool.snapshot()["segments"] if s["address"] <= p < s["address"] + s["total_size"]]
    assert len(segments) == 1
    assert (base, size.value) == (segments[0]["address"], segments[0]["total_size"])
    clean.free(p, 3 << 20, 0, None)


def test_free_is_ordered_on_the_stream_given(clean):
    """A block freed on stream s is reused at once on s; another stream gets it only ordered after
    s's queued work (an event it waits on), so that stream's own writes land after s's late ones."""
    pool = ap.default_pool(0)
    # Created streams, not the default one: the simulator's default stream (None) is this thread's
    # current device's, which earlier tests in this process may have left on another device.
    s, t = pool.create_stream(), pool.create_stream()
    n = 1 << 16
    try:
        p = clean.malloc(n, 0, s)
        sim.launch_fill(s, p, n, 0xAB, delay_s=0.3)  # queued work still using p
        clean.free(p, n, 0, s)
        q = clean.malloc(n, 0, t)  # another stream: p only ordered after the fill
        sim.launch_fill(t, q, n, 0xCD)  # that stream's own use of q
        r = clean.malloc(n, 0, s)  # the same stream: p is reusable at once, unless q took it
        if q != p:
            assert r == p
        assert r != q
        pool.synchronize(s)
        pool.synchronize(t)
        assert sim.read(q, n) == b"\xcd" * n  # not overwritten by s's late fill
        for ptr in (q, r):
            clean.free(ptr, n, 0, None)  # NULL stream: the block's own allocation stream
        assert clean.error() == (OK, "")
    finally:
        pool.destroy_stream(s)
        pool.destroy_stream(t)


def test_record_stream_through_the_c_abi_delays_reuse(clean):
    pool = ap.default_pool(0)
    s = pool.create_stream()
    try:
        p = clean.malloc(1 << 16, 0, None)
        sim.launch_fill(s, p, 1 << 16, 0x11, delay_s=0.3)
        clean.record_stream(p, ctypes.c_void_p(s))
        assert clean.error() == (OK, "")
        clean.free(p, 1 << 16, 0, None)
        q = clean.malloc(1 << 16, 0, None)
        assert q != p  # p waits for the stream's fill
        clean.free(q, 1 << 16, 0, None)
        pool.synchronize(s)
    finally:
        pool.destroy_stream(s)


@pytest.mark.parametrize("device, n", [(0, 70), (1, 12)], ids=["past-64-of-its-device", "past-8-of-another"])
def test_record_stream_through_the_c_abi_past_the_inline_streams_delays_reuse(clean, device, n):
    # torch_npu's record_stream hook is void: a 65th stream of the block's device, or a 9th of
    # another device, was refused (error 5, which no caller reads) and dropped, and the freed
    # block went to the next malloc while that stream still wrote it.
    streams_pool = ap.default_pool(device)
    users = [streams_pool.create_stream() for _ in range(n)]
    try:
        p = clean.malloc(1 << 16, 0, None)
        for s in users:
            clean.record_stream(p, ctypes.c_void_p(s))
        assert clean.error() == (OK, "")
        sim.hang_stream(users[-1])
        sim.launch_fill(users[-1], p, 1 << 16, 0x11)
        clean.free(p, 1 << 16, 0, None)
        q = clean.malloc(1 << 16, 0, None)
        assert q != p  # p waits for the last stream's fill
        clean.free(q, 1 << 16, 0, None)
    finally:
        sim.release_stream(users[-1])
        for s in users:
            streams_pool.synchronize(s)
            streams_pool.destroy_stream(s)


def test_free_finds_the_context_that_allocated(clean):
    ctx = ap.default_pool(0).context("capi-errors-test")
    try:
        with ctx:
            p = clean.malloc(1 << 20, 0, None)
        assert ctx.memory_stats()["allocated_bytes.all.current"] >= 1 << 20
        done = []
        # Another thread, no context current there: the pointer is found in ctx all the same.
        t = threading.Thread(target=lambda: (clean.free(p, 1 << 20, 0, None), done.append(clean.error())))
        t.start()
        t.join()
        assert done == [(OK, "")]
        assert ctx.memory_stats()["allocated_bytes.all.current"] == 0
    finally:
        ctx.close()


def test_memory_fraction_caps_the_current_pool(clean):
    for bad in (-0.1, 1.5, math.nan):
        clean.clear_last_error()
        clean.set_memory_fraction(bad, 0)
        assert clean.error()[0] == INVALID_ARG
    clean.set_memory_fraction(0.0, 0)
    try:
        assert clean.malloc(64 << 20, 0, None) is None
        assert clean.error()[0] in (OOM, LIMIT) and "limit" in clean.error()[1]
    finally:
        clean.set_memory_fraction(1.0, 0)
    p = clean.malloc(64 << 20, 0, None)
    assert p
    clean.free(p, 64 << 20, 0, None)


def test_a_bad_memory_fraction_is_named_with_all_its_digits(clean):
    # %g showed 1.0000001 as "got 1", a fraction the message itself says is allowed
    limit = ap.default_pool(0).get_limit()
    for bad, shown in ((1.0000001, "1.0000001"), (1 + 2**-52, "1.0000000000000002"), (-1e-300, "-1e-300"),
                        (math.inf, "inf"), (math.nan, "nan")):
        clean.clear_last_error()
        clean.set_memory_fraction(bad, 0)
        code, msg = clean.error()
        assert code == INVALID_ARG and msg.endswith(f"device 0: fraction must be in [0, 1], got {shown}"), msg
    assert ap.default_pool(0).get_limit() == limit  # refused: the fraction in force is unchanged


def test_reset_and_empty_cache_release_cached_segments(clean):
    pool = ap.default_pool(0)
    p = clean.malloc(8 << 20, 0, None)
    clean.free(p, 8 << 20, 0, None)
    assert pool.memory_stats()["reserved_bytes.all.current"] >= 8 << 20
    clean.reset(True)
    assert pool.memory_stats()["reserved_bytes.all.current"] < 8 << 20
    p = clean.malloc(8 << 20, 0, None)
    clean.free(p, 8 << 20, 0, None)
    clean.empty_cache()
    assert pool.memory_stats()["reserved_bytes.all.current"] < 8 << 20
    assert clean.error() == (OK, "")


def test_init_creates_a_default_pool_and_tolerates_a_device_count(clean):
    count = ap.default_pool(0).backend.device_count
    clean.init(count)  # PyTorch passes its device count: not a device, not an error
    assert clean.error() == (OK, "")
    clean.init(count - 1)
    assert clean.error() == (OK, "")
    assert ap._core.capi_default_backend(count - 1) == "sim"


def test_python_wrappers_raise_typed_errors():
    from ascend_pool._core import capi_free, capi_last_error, capi_malloc

    with pytest.raises(ap.InvalidSizeError):
        capi_malloc(0)
    assert capi_last_error()[:2] == (INVALID_SIZE, "INVALID_SIZE")
    with pytest.raises(ap.InvalidDeviceError):
        capi_malloc(10, 999)
    with pytest.raises(ap.InvalidPointerError):
        capi_free(0x7000, 0, 0)
    p = capi_malloc(1000, 0)
    capi_free(p, 1000, 0)

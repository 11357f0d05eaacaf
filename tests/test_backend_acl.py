"""The acl backend, tested through its real loading code against the simulated NPU.

Both simulator builds are loaded exactly as a real libascendcl.so would be (dlopen by path, dlsym
by name): the normal one, and the legacy one that lacks aclrtMallocAlign32 and
aclrtQueryEventStatus like an old CANN, which exercises the fallbacks. Stream work is queued with
the simulator's control functions (ascendsim_hang_stream / ascendsim_launch_fill) through ctypes
on the same library file, so both sides see one runtime.

Exact memory figures run in a subprocess on a private simulated node (ASCEND_SIM_NODE), so that
other processes using the simulator at the same time cannot disturb them.
"""

import ctypes
import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import ascend_pool
from ascend_pool._core import Backend
from ascend_pool.backend import sim_library_path
from ascend_pool.errors import BackendUnavailableError, DeviceError, DeviceTimeoutError

PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(ascend_pool.__file__)))

# What the backend resolves, in order. The first list is a current CANN; the legacy build swaps
# in the older entry points (aclrtMalloc, aclrtQueryEvent) and lacks the newest (no timed device wait).
SYMBOLS = [
    "aclInit", "aclrtSetDevice", "aclrtResetDevice", "aclrtGetCurrentContext",
    "aclrtSetCurrentContext", "aclrtGetDevice", "aclrtGetDeviceCount", "aclrtMallocAlign32", "aclrtFree",
    "aclrtGetMemInfo", "aclrtCreateEventWithFlag", "aclrtRecordEvent", "aclrtQueryEventStatus",
    "aclrtSynchronizeEvent", "aclrtSynchronizeEventWithTimeout", "aclrtDestroyEvent",
    "aclrtStreamWaitEvent", "aclrtResetEvent", "aclrtCreateEventExWithFlag", "aclrtCreateStream",
    "aclrtSynchronizeStream", "aclrtSynchronizeStreamWithTimeout", "aclrtSynchronizeDevice",
    "aclrtSynchronizeDeviceWithTimeout", "aclrtDestroyStream", "aclGetRecentErrMsg", "aclrtGetSocName",
]
LEGACY_SYMBOLS = [{"aclrtMallocAlign32": "aclrtMalloc",
                   "aclrtQueryEventStatus": "aclrtQueryEvent"}.get(s, s) for s in SYMBOLS
                  if s not in ("aclrtCreateEventExWithFlag", "aclrtSynchronizeDeviceWithTimeout")]

PARAM_INVALID, INVALID_DEVICEID, MEMORY_ALLOCATION, MEMORY_FREE = 107000, 107001, 207001, 207002
INVALID_PARAM, STREAM_TIMEOUT, EVENT_TIMEOUT = 100000, 507046, 507047


class Sim:
    """The simulator's control functions (ascendsim.h) on the library a backend loaded."""

    def __init__(self, backend):
        lib = ctypes.CDLL(backend.path)
        self.lib = lib
        lib.ascendsim_launch_fill.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                              ctypes.c_int, ctypes.c_uint64]
        lib.ascendsim_read.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.ascendsim_hang_stream.argtypes = [ctypes.c_void_p]
        lib.ascendsim_release_stream.argtypes = [ctypes.c_void_p]
        lib.ascendsim_stats_fields.restype = ctypes.c_char_p
        lib.ascendsim_get_stats.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_uint32]

    def fill(self, stream, ptr, n, value, delay_s=0.0):
        assert self.lib.ascendsim_launch_fill(stream, ptr, n, value, int(delay_s * 1e6)) == 0

    def read(self, ptr, n):
        buf = ctypes.create_string_buffer(n)
        assert self.lib.ascendsim_read(ptr, buf, n) == 0
        return buf.raw

    def held(self, device):
        """Device bytes this process holds on `device`, as the simulator counts them."""
        fields = self.lib.ascendsim_stats_fields().decode().split(",")
        out = (ctypes.c_uint64 * len(fields))()
        assert self.lib.ascendsim_get_stats(device, out, len(fields)) == 0
        return out[fields.index("bytes_held")]

    def hang(self, stream):
        assert self.lib.ascendsim_hang_stream(stream) == 0

    def release(self, stream):
        assert self.lib.ascendsim_release_stream(stream) == 0


@pytest.fixture(scope="module", params=["normal", "legacy"])
def sim(request):
    """(backend, control) for each simulator build, through the acl loading code. Device 0 is
    held meanwhile, as a pool holds its device: a stream lives in its device's default context,
    which goes (with its streams, on CANN) when the device's last reference does."""
    backend = Backend("sim", sim_library_path(legacy=request.param == "legacy"))
    backend.device_retain(0)
    yield backend, Sim(backend)
    backend.device_release(0)


def run_py(code, **env):
    full = dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full.update(env)
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


# ---- loading ---------------------------------------------------------------------------------

@pytest.mark.parametrize("legacy", [False, True])
def test_every_used_symbol_is_resolved_by_dlsym(legacy):
    b = Backend("sim", sim_library_path(legacy))
    assert b.name == "sim" and b.kind == "acl"
    assert os.path.samefile(b.path, sim_library_path(legacy))
    assert b.resolved_symbols == (LEGACY_SYMBOLS if legacy else SYMBOLS)
    lib = ctypes.CDLL(b.path)
    for name in b.resolved_symbols:
        assert hasattr(lib, name), name
    # The legacy library really lacks the newer entry points; the normal one has both.
    assert hasattr(lib, "aclrtMallocAlign32") != legacy
    assert hasattr(lib, "aclrtQueryEventStatus") != legacy
    assert hasattr(lib, "aclrtCreateEventExWithFlag") != legacy
    assert hasattr(lib, "aclrtMalloc") and hasattr(lib, "aclrtQueryEvent")
    assert b.has_malloc_align32 != legacy and b.has_query_event_status != legacy
    assert b.has_sync_event_timeout and b.has_sync_stream_timeout
    assert b.device_count >= 1


def test_device_size_follows_the_malloc_entry_point():
    new, old = Backend("sim"), Backend("sim", sim_library_path(legacy=True))
    # aclrtMallocAlign32 rounds up to 32; aclrtMalloc rounds up to 32 and adds 32, but the
    # fallback asks it 32 bytes less for a whole number of 2 MiB pages, which then takes no more
    # (before 2026-12-05: 2 MiB + 32 bytes, 4 MiB of huge pages).
    assert [new.device_size(n) for n in (1, 32, 100, 2 << 20)] == [32, 32, 128, 2 << 20]
    assert [old.device_size(n) for n in (1, 32, 100, 2 << 20, 3 << 20)] == [64, 64, 160, 2 << 20, (3 << 20) + 32]
    assert new.device_size(0) == old.device_size(0) == 0


def test_repeat_initialize_is_tolerated():
    # The runtime is initialised already in this process (as a framework would have done);
    # opening another backend on the same library must still work.
    first = Backend("sim")
    assert ctypes.CDLL(first.path).aclInit(None) == 100002  # ACL_ERROR_REPEAT_INITIALIZE
    second = Backend("acl", sim_library_path())
    assert second.name == "acl" and second.device_count == first.device_count


def test_bad_path_is_backend_unavailable_naming_it():
    bad = "/nonexistent/ascend/lib64/libascendcl.so"
    for kind in ("acl", "sim"):
        with pytest.raises(BackendUnavailableError) as ei:
            Backend(kind, bad)
        assert ei.value.code == 990001 and bad in str(ei.value)
        assert isinstance(ei.value, DeviceError)


def test_library_without_acl_symbols_is_refused():
    libm = "libm.so.6"
    with pytest.raises(BackendUnavailableError) as ei:
        Backend("acl", libm)
    assert ei.value.code == 990002
    assert "aclInit" in str(ei.value) and "aclrtMalloc" in str(ei.value)


def drop_node(node):
    """Removes a private simulated node's shared records (the simulator keeps them for reuse)."""
    for f in glob.glob(f"/dev/shm/ascendsim-*-{node}-dev*"):
        os.unlink(f)


def test_env_library_and_bad_env_library():
    node = f"bk-env-{os.getpid()}"
    try:
        out = run_py("""
            from ascend_pool._core import Backend
            print(Backend("acl").path)
        """, ASCEND_POOL_ACL_LIB=sim_library_path(), ASCEND_SIM_NODE=node)
    finally:
        drop_node(node)
    assert os.path.samefile(out.strip(), sim_library_path())
    out = run_py("""
        from ascend_pool._core import Backend
        from ascend_pool.errors import BackendUnavailableError
        try:
            Backend("acl")
        except BackendUnavailableError as e:
            print(e.code, e)
    """, ASCEND_POOL_ACL_LIB="/nowhere/libascendcl.so")
    assert out.startswith("990001") and "/nowhere/libascendcl.so" in out


# ---- memory: exact figures on a private node ----------------------------------------------------

FIGURES = """
    import json
    from ascend_pool._core import Backend
    from ascend_pool.errors import DeviceError
    b = Backend("sim", {path!r})
    out = {{"devices": b.device_count, "info0": b.mem_info(0)}}
    p = b.malloc(0, 100)
    out["aligned"] = p % 64 == 0
    out["after_small"] = [b.mem_info(0), b.mem_info(1)]
    q = b.malloc(1, 4 << 20)                       # whole huge pages: the device takes exactly these
    out["after_dev1"] = [b.mem_info(0), b.mem_info(1)]
    big = b.malloc(0, 200 << 20)
    try:
        b.malloc(0, 100 << 20)
    except DeviceError as e:
        out["oom"] = [e.code, str(e)]
    out["after_oom"] = b.mem_info(0)
    for dev, ptr in ((0, p), (1, q), (0, big)):
        b.free(dev, ptr)
    out["end"] = [b.mem_info(0), b.mem_info(1)]
    out["sizes"] = [b.device_size(100), b.device_size(4 << 20), b.device_size(200 << 20)]
    print(json.dumps(out))
"""


@pytest.mark.parametrize("legacy", [False, True])
def test_malloc_free_mem_info_and_capacity(legacy):
    node = f"bk-fig-{os.getpid()}-{int(legacy)}"
    try:
        out = json.loads(run_py(FIGURES.format(path=sim_library_path(legacy)),
                                ASCEND_SIM_NODE=node, ASCEND_SIM_DEVICES="2",
                                ASCEND_SIM_HBM="256MiB"))
    finally:
        drop_node(node)
    total = 256 << 20
    small, mid, big = out["sizes"]
    assert small == (160 if legacy else 128)
    assert out["devices"] == 2 and out["aligned"]
    assert out["info0"] == [total, total]
    # aclrtGetMemInfo tells the truth: exactly the reserved size is gone, on the right device.
    assert out["after_small"] == [[total - small, total], [total, total]]
    assert out["after_dev1"] == [[total - small, total], [total - mid, total]]
    code, msg = out["oom"]
    assert code == MEMORY_ALLOCATION and "207001" in msg and "malloc" in msg
    assert out["after_oom"] == [total - small - big, total]  # a failed malloc holds nothing
    assert out["end"] == [[total, total], [total, total]]


# ---- events and streams ----------------------------------------------------------------------

def test_event_not_complete_until_queued_work_is_done(sim):
    b, ctl = sim
    s, ev = b.stream_create(0), b.event_create(0)
    p = b.malloc(0, 4096)
    try:
        ctl.hang(s)
        ctl.fill(s, p, 4096, 0x5A)
        b.event_record(ev, s)
        assert b.event_query(ev) is False  # right through either query enum
        with pytest.raises(DeviceTimeoutError) as ei:
            b.event_sync(ev, timeout_ms=20)  # the runtime's timed wait
        assert ei.value.code == EVENT_TIMEOUT
        with pytest.raises(DeviceTimeoutError) as ei:
            b.event_sync(ev, timeout_ms=0)  # a look, by query
        assert ei.value.code == EVENT_TIMEOUT and "event_sync" in str(ei.value)
        ctl.release(s)
        b.event_sync(ev, timeout_ms=5000)
        assert b.event_query(ev) is True
        assert ctl.read(p, 4096) == b"\x5a" * 4096
    finally:
        ctl.release(s)
        b.stream_sync(s)
        b.free(0, p)
        b.event_destroy(ev)
        b.stream_destroy(s)


def test_stream_sync_timeouts(sim):
    b, ctl = sim
    s = b.stream_create(0)
    try:
        ctl.hang(s)
        for timeout_ms in (20, 0):  # the runtime's timed wait; a temporary event polled
            with pytest.raises(DeviceTimeoutError) as ei:
                b.stream_sync(s, timeout_ms=timeout_ms)
            assert ei.value.code == STREAM_TIMEOUT
        ctl.release(s)
        b.stream_sync(s, timeout_ms=5000)
        b.stream_sync(s, timeout_ms=0)
    finally:
        ctl.release(s)
        b.stream_destroy(s)


def test_stream_wait_event_orders_two_streams(sim):
    b, ctl = sim
    s1, s2 = b.stream_create(0), b.stream_create(0)
    e1, e2 = b.event_create(0), b.event_create(0)
    p = b.malloc(0, 1024)
    try:
        ctl.hang(s1)
        ctl.fill(s1, p, 1024, 1)
        b.event_record(e1, s1)
        b.stream_wait_event(s2, e1)  # s2's fill must come after s1's
        ctl.fill(s2, p, 1024, 2)
        b.event_record(e2, s2)
        time.sleep(0.02)
        assert b.event_query(e2) is False  # held back by s1, which is hung
        ctl.release(s1)
        b.event_sync(e2, timeout_ms=5000)
        assert b.event_query(e1) is True
        assert ctl.read(p, 1024) == b"\x02" * 1024
    finally:
        ctl.release(s1)
        for s in (s1, s2):
            b.stream_sync(s)
        b.free(0, p)
        for e in (e1, e2):
            b.event_destroy(e)
        for s in (s1, s2):
            b.stream_destroy(s)


def test_default_stream_and_delayed_fill_release_the_gil(sim):
    # A host wait blocks only its own thread: the backend calls run without the GIL.
    b, ctl = sim
    # The default stream is the calling thread's device's (the backend never leaves a thread
    # on a device): this thread picks device 0 itself, as a framework does.
    assert ctl.lib.aclrtSetDevice(0) == 0
    p, ev = b.malloc(0, 256), b.event_create(0)
    try:
        ctl.fill(None, p, 256, 9, delay_s=0.2)  # None: the default stream
        b.event_record(ev, None)
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (b.event_sync(ev), done.set()))
        t0 = time.monotonic()
        waiter.start()
        spins = 0
        while not done.is_set() and time.monotonic() - t0 < 5:
            spins += 1
        waiter.join()
        assert 0.15 < time.monotonic() - t0 < 5
        assert spins > 1000  # this thread kept running Python meanwhile
        assert ctl.read(p, 256) == b"\x09" * 256
    finally:
        b.stream_sync(None)
        b.free(0, p)
        b.event_destroy(ev)
        assert ctl.lib.aclrtResetDevice(0) == 0


def test_set_device_per_thread(sim):
    # set_device is cached per thread: two threads working on different devices at once must
    # each allocate on their own device (the simulator's per-device held bytes say where).
    b, ctl = sim
    if b.device_count < 2:
        pytest.skip(reason="needs two simulated devices")
    before = [ctl.held(0), ctl.held(1)]
    sizes = {0: 4096, 1: 8192}
    got = {}
    barrier = threading.Barrier(2)

    def work(dev):
        barrier.wait()
        ptrs = []
        for _ in range(50):
            b.set_device(dev)  # cached after the first: no runtime call, same effect
            ptrs.append(b.malloc(dev, sizes[dev]))
        got[dev] = ptrs

    threads = [threading.Thread(target=work, args=(d,)) for d in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for dev in (0, 1):
        assert ctl.held(dev) - before[dev] == 50 * b.device_size(sizes[dev])
        for ptr in got[dev]:
            b.free(dev, ptr)
    assert [ctl.held(0), ctl.held(1)] == before


# ---- errors keep the process intact ------------------------------------------------------------

def test_bad_handles_and_arguments_give_runtime_codes(sim):
    b, _ = sim
    bogus = 0xDEAD0
    cases = [
        (lambda: b.event_query(bogus), PARAM_INVALID, "not a live event"),
        (lambda: b.event_record(bogus, None), PARAM_INVALID, "event"),
        (lambda: b.event_destroy(bogus), PARAM_INVALID, "event"),
        (lambda: b.stream_sync(bogus), PARAM_INVALID, "stream"),
        (lambda: b.free(0, bogus), MEMORY_FREE, "aclrtFree"),
        (lambda: b.set_device(b.device_count), INVALID_DEVICEID, "device"),
        (lambda: b.malloc(0, 0), INVALID_PARAM, "size"),
    ]
    for call, code, words in cases:
        with pytest.raises(DeviceError) as ei:
            call()
        assert ei.value.code == code, (ei.value.code, str(ei.value))
        assert type(ei.value) is DeviceError
        # The code's name and the runtime's own recent message are both in the text.
        assert str(code) in str(ei.value) and words in str(ei.value), str(ei.value)
    p = b.malloc(0, 64)  # still healthy
    b.free(0, p)


def test_a_device_no_c_int_holds_is_an_invalid_device_error(sim):
    # 2**31 and past (or below -2**31) fit no C int: before, the argument's conversion raised a
    # bare OverflowError ("value too large to convert to int") from every device-taking method.
    from ascend_pool.errors import InvalidDeviceError
    b, _ = sim
    calls = {
        "set_device": lambda d: b.set_device(d), "device_retain": lambda d: b.device_retain(d),
        "device_release": lambda d: b.device_release(d), "mem_info": lambda d: b.mem_info(d),
        "malloc": lambda d: b.malloc(d, 64), "stream_create": lambda d: b.stream_create(d),
        "event_create": lambda d: b.event_create(d), "physical_device": lambda d: b.physical_device(d),
        "vmm_granularity": lambda d: b.vmm_granularity(d), "host_malloc": lambda d: b.host_malloc(d, 64),
    }
    for name, call in calls.items():
        for device in (2**31, 2**64, -2**31 - 1):
            with pytest.raises(InvalidDeviceError, match=rf"device {device} does not exist: the sim backend has "
                                                          rf"{b.device_count} device\(s\)"):
                call(device)
    assert b.mem_info(0)[1] > 0  # still healthy


# ---- error texts ------------------------------------------------------------------------------

RUNTIME_CODE_NAMES = {
    107003: "ACL_ERROR_RT_STREAM_CONTEXT", 107017: "ACL_ERROR_RT_INVALID_HANDLE",
    207005: "ACL_ERROR_RT_RESOURCE_ALLOC_FAIL", 207008: "ACL_ERROR_RT_NO_STREAM_RESOURCE",
    507000: "ACL_ERROR_RT_INTERNAL_ERROR",
}


@pytest.mark.skipif(not shutil.which("gcc"), reason="builds a libascendcl.so in front of the simulator's with gcc")
def test_runtime_codes_are_named_in_the_backends_errors(tmp_path):
    """Codes CANN's rt_error_codes.h defines and the runtime answers on the pool's paths (a stream
    of another context, a stale handle, no host resources, the device's streams used up, an
    internal error) are named in DeviceError's text, as the others are: a library in front of
    the simulator's answers each from aclrtMallocAlign32 (tests/c/acl_code_shim.c)."""
    shim = str(tmp_path / "libascendcl.so")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", shim, os.path.join(os.path.dirname(__file__), "c", "acl_code_shim.c"),
                    "-Wl,--no-as-needed", sim_library_path()], check=True)
    node = f"bk-names-{os.getpid()}"
    try:
        out = run_py(f"""
            import ctypes, json
            from ascend_pool._core import Backend
            from ascend_pool.errors import DeviceError
            b = Backend("sim", {shim!r})
            lib = ctypes.CDLL({shim!r})
            out = {{}}
            for code in {sorted(RUNTIME_CODE_NAMES)!r}:
                lib.shim_set_code(code)
                try:
                    b.malloc(0, 64)
                except DeviceError as e:
                    out[code] = [e.code, str(e)]
            print(json.dumps(out))
        """, ASCEND_SIM_NODE=node)
    finally:
        drop_node(node)
    got = {int(k): v for k, v in json.loads(out).items()}
    assert sorted(got) == sorted(RUNTIME_CODE_NAMES), got
    for code, name in RUNTIME_CODE_NAMES.items():
        assert got[code][0] == code and f"{code} ({name}" in got[code][1], got[code]

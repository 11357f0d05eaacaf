"""The backends' virtual-memory table (has_vmm, vmm_*): the acl code on both simulator builds,
loaded exactly as a real libascendcl.so; the cuda code on the driver API where a GPU exists.

Exact capacity figures run in a child process on a private simulated node (sim_fixtures), so that
other processes using the simulator at the same time cannot disturb them.
"""
import ctypes
import os
import sys

import pytest

from ascend_pool._core import Backend
from ascend_pool.backend import sim_library_path
from ascend_pool.errors import BackendUnavailableError, DeviceError

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401  (pytest fixture)

MiB = 1 << 20
PARAM_INVALID, MEMORY_ALLOCATION = 107000, 207001
ACL_VMM = ["aclrtMemGetAllocationGranularity", "aclrtReserveMemAddress", "aclrtReleaseMemAddress",
           "aclrtMallocPhysical", "aclrtFreePhysical", "aclrtMapMem", "aclrtUnmapMem"]
CUDA_VMM = ["cuMemGetAllocationGranularity", "cuMemAddressReserve", "cuMemAddressFree", "cuMemCreate",
            "cuMemRelease", "cuMemMap", "cuMemSetAccess", "cuMemUnmap"]


class Control:
    """The simulator's read/fill on the library a backend loaded (one runtime for both)."""

    def __init__(self, backend):
        self.lib = lib = ctypes.CDLL(backend.path)
        lib.ascendsim_launch_fill.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                              ctypes.c_int, ctypes.c_uint64]
        lib.ascendsim_read.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]

    def fill(self, stream, ptr, n, value):
        assert self.lib.ascendsim_launch_fill(stream, ptr, n, value, 0) == 0

    def read(self, ptr, n):
        buf = ctypes.create_string_buffer(n)
        rc = self.lib.ascendsim_read(ptr, buf, n)
        return buf.raw if rc == 0 else rc


@pytest.fixture(params=["normal", "legacy"])
def sim(request):
    # device 0 held meanwhile, as a pool holds its device (test_backend_acl.py's fixture says why)
    backend = Backend("sim", sim_library_path(legacy=request.param == "legacy"))
    backend.device_retain(0)
    yield backend, Control(backend)
    backend.device_release(0)


def test_has_vmm_and_the_names_are_recorded_on_first_use(sim):
    b, _ = sim
    assert b.has_vmm            # both builds: the VMM calls are not among the legacy build's gaps
    assert not set(ACL_VMM) & set(b.resolved_symbols)
    assert b.vmm_granularity(0) == 2 * MiB
    assert b.resolved_symbols[-len(ACL_VMM):] == ACL_VMM
    b.vmm_granularity(0)
    assert b.resolved_symbols.count("aclrtMapMem") == 1
    lib = ctypes.CDLL(b.path)
    assert all(hasattr(lib, n) for n in ACL_VMM)


def test_round_trip_through_the_backend(sim):
    b, ctl = sim
    g = b.vmm_granularity(0)
    va = b.vmm_reserve(0, 16 * g)
    assert va % g == 0
    hs = [b.vmm_create(0, g) for _ in range(3)]
    for i, h in enumerate(hs):
        b.vmm_map(0, va + i * g, g, h)
    s = b.stream_create(0)
    ctl.fill(s, va + g - 8, g + 16, 0xA5)                 # across three handles mapped side by side
    b.stream_sync(s)
    assert ctl.read(va + g - 9, g + 18) == b"\0" + b"\xa5" * (g + 16) + b"\0"
    for i in range(3):
        b.vmm_unmap(0, va + i * g, g)
    assert ctl.read(va + g, 1) == PARAM_INVALID           # inaccessible again
    for h in hs:
        b.vmm_free(0, h)
    b.vmm_release(0, va, 16 * g)
    b.stream_destroy(s)


def test_misuse_raises_device_error_with_the_runtimes_code(sim):
    b, _ = sim
    g = b.vmm_granularity(0)
    va = b.vmm_reserve(0, 8 * g)
    h = b.vmm_create(0, 2 * g)

    def fails(code, words, fn, *args):
        with pytest.raises(DeviceError) as ei:
            fn(*args)
        assert ei.value.code == code, ei.value
        for w in words:
            assert w in str(ei.value), ei.value

    fails(PARAM_INVALID, ["aclrtReserveMemAddress", "multiple"], b.vmm_reserve, 0, 3 * MiB)
    fails(PARAM_INVALID, ["vmm_map", "aclrtMapMem", "size"], b.vmm_map, 0, va, g, h)
    fails(PARAM_INVALID, ["aclrtMapMem", "reservation"], b.vmm_map, 0, va + 7 * g, 2 * g, h)
    b.vmm_map(0, va + 2 * g, 2 * g, h)
    fails(PARAM_INVALID, ["aclrtMapMem", "overlaps"], b.vmm_map, 0, va + 3 * g, 2 * g, h)
    fails(PARAM_INVALID, ["aclrtUnmapMem", "start"], b.vmm_unmap, 0, va + 3 * g, g)
    fails(PARAM_INVALID, ["aclrtFreePhysical", "still mapped"], b.vmm_free, 0, h)
    fails(PARAM_INVALID, ["aclrtReleaseMemAddress", "mapping"], b.vmm_release, 0, va, 8 * g)
    fails(107001, ["aclrtSetDevice", "out of range"], b.vmm_create, 99, g)   # no such device
    b.vmm_unmap(0, va + 2 * g, 2 * g)
    b.vmm_free(0, h)
    fails(PARAM_INVALID, ["aclrtFreePhysical", "not a live physical"], b.vmm_free, 0, h)
    b.vmm_release(0, va, 8 * g)


def test_capacity_counts_physical_memory_only(sim_node):
    """Through the backend: 1 TiB of address space costs nothing, physical memory costs exactly
    its size, the device fills up with 207001, and injected faults reach vmm_create."""
    out = sim_node.run_json("""
        from ascend_pool._core import Backend
        from ascend_pool.errors import DeviceError
        b = Backend("sim")
        G = b.vmm_granularity(0)
        free0, total = b.mem_info(0)
        va = b.vmm_reserve(0, 1 << 40)
        after_reserve = b.mem_info(0)[0]
        h = b.vmm_create(0, 4 * G)
        after_create = b.mem_info(0)[0]
        b.vmm_map(0, va, 4 * G, h)
        after_map = b.mem_info(0)[0]
        codes = []
        try:
            b.vmm_create(0, total)
        except DeviceError as e:
            codes.append(e.code)
        sim.set_faults(fail_malloc_nth=1)
        try:
            b.vmm_create(0, G)
        except DeviceError as e:
            codes.append(e.code)
            codes.append("fail_malloc_nth" in str(e))
        h2 = b.vmm_create(0, G)                          # disarmed after firing once
        b.vmm_free(0, h2)
        b.vmm_unmap(0, va, 4 * G)
        b.vmm_free(0, h)
        b.vmm_release(0, va, 1 << 40)
        print(json.dumps(dict(G=G, free0=free0, total=total, after_reserve=after_reserve,
                              after_create=after_create, after_map=after_map, codes=codes,
                              end=b.mem_info(0)[0], st=sim.stats(0))))
    """)
    G = out["G"]
    assert out["free0"] == out["total"] == 1 << 30
    assert out["after_reserve"] == out["free0"]
    assert out["free0"] - out["after_create"] == 4 * G == 8 * MiB
    assert out["after_map"] == out["after_create"]
    assert out["codes"] == [MEMORY_ALLOCATION, MEMORY_ALLOCATION, True]
    assert out["end"] == out["free0"]
    st = out["st"]
    assert (st["phys_mallocs"], st["phys_frees"], st["maps"], st["unmaps"]) == (2, 2, 1, 1), st


# ---- cuda: the driver's virtual memory, where a GPU exists ------------------------------------

@pytest.fixture(scope="module")
def cuda():
    try:
        backend = Backend("cuda")
    except BackendUnavailableError as exc:
        pytest.skip(reason=f"no usable CUDA device here: {str(exc).splitlines()[0]}")
    if not backend.has_vmm:
        pytest.skip(reason="libcuda.so.1 without the virtual-memory calls")
    return backend


def test_cuda_vmm_round_trip(cuda):
    g = cuda.vmm_granularity(0)
    assert g >= 2 * MiB and g & (g - 1) == 0
    assert cuda.resolved_symbols[-len(CUDA_VMM):] == CUDA_VMM
    free0, _ = cuda.mem_info(0)
    va = cuda.vmm_reserve(0, 64 * g)
    h = cuda.vmm_create(0, 8 * g)
    assert free0 - cuda.mem_info(0)[0] >= 8 * g
    cuda.vmm_map(0, va + 4 * g, 8 * g, h)
    with pytest.raises(DeviceError):
        cuda.vmm_map(0, va + 4 * g, 8 * g, h)              # already mapped there
    cuda.vmm_unmap(0, va + 4 * g, 8 * g)
    cuda.vmm_free(0, h)
    cuda.vmm_release(0, va, 64 * g)

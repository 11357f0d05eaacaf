"""Pinned host memory through the backend table: host_malloc / host_free (aclrtMallocHost /
aclrtFreeHost on acl and the simulator, cudaHostAlloc / cudaFreeHost on cuda), resolved on first
use, failing with the runtime's own codes."""

import ctypes
import mmap

import pytest

from ascend_pool._core import Backend
from ascend_pool.backend import sim_library_path
from ascend_pool.errors import BackendUnavailableError, DeviceError

INVALID_PARAM, MEMORY_FREE = 100000, 207002
HOST_SYMBOLS = ["aclrtMallocHost", "aclrtFreeHost"]


@pytest.mark.parametrize("legacy", [False, True], ids=["sim", "sim-legacy"])
def test_host_memory_round_trip_on_the_simulator(legacy):
    b = Backend("sim", sim_library_path(legacy))
    assert not set(HOST_SYMBOLS) & set(b.resolved_symbols)  # not looked up until used
    p = b.host_malloc(0, 10_000)
    assert p % mmap.PAGESIZE == 0
    ctypes.memset(p, 0x5A, 10_000)  # host memory: the CPU reads and writes it directly
    assert ctypes.string_at(p + 9_990, 10) == b"\x5a" * 10
    b.host_free(0, p)
    assert b.resolved_symbols[-2:] == HOST_SYMBOLS
    q = b.host_malloc(1, 1)  # any device's context; one byte is a whole page underneath
    b.host_free(1, q)
    assert b.resolved_symbols.count("aclrtMallocHost") == 1  # resolved once


def test_host_errors_carry_the_runtime_codes():
    b = Backend("sim")
    with pytest.raises(DeviceError) as e:
        b.host_malloc(0, 0)
    assert e.value.code == INVALID_PARAM and "host_malloc(0)" in str(e.value)
    p = b.host_malloc(0, 4096)
    b.host_free(0, p)
    with pytest.raises(DeviceError) as e:
        b.host_free(0, p)  # double free: refused, never a crash
    assert e.value.code == MEMORY_FREE and "aclrtFreeHost" in str(e.value)
    with pytest.raises(DeviceError) as e:
        b.host_free(0, 0x1000)
    assert e.value.code == MEMORY_FREE


def test_cuda_host_memory_where_a_gpu_exists():
    try:
        b = Backend("cuda")
    except BackendUnavailableError as exc:
        pytest.skip(reason=f"no usable CUDA runtime here: {str(exc).splitlines()[0]}")
    p = b.host_malloc(0, 1 << 20)
    ctypes.memset(p, 1, 1 << 20)
    b.host_free(0, p)
    assert b.resolved_symbols[-2:] == ["cudaHostAlloc", "cudaFreeHost"]

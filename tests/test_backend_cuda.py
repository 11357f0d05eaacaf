"""The cuda backend: up to the dlopen edge everywhere, and the full round trip where a GPU exists.

Without a CUDA driver the backend must fail clearly: AP_ERR_NOT_LOADED (990001) naming the
libraries tried when no libcudart loads, AP_ERR_NO_DEVICE (990003) with the runtime's own words
when libcudart loads but finds no usable device.
"""

import ctypes
import ctypes.util

import pytest

from ascend_pool._core import Backend
from ascend_pool.errors import BackendUnavailableError, DeviceError, DeviceTimeoutError

NOT_LOADED, MISSING_SYMBOL, NO_DEVICE = 990001, 990002, 990003

CUDA_SYMBOLS = [
    "cudaSetDevice", "cudaGetDeviceCount", "cudaGetDevice", "cudaMalloc", "cudaFree", "cudaMemGetInfo",
    "cudaEventCreateWithFlags", "cudaEventRecord", "cudaEventQuery", "cudaEventSynchronize",
    "cudaEventDestroy", "cudaStreamWaitEvent", "cudaStreamCreate", "cudaStreamQuery",
    "cudaStreamSynchronize", "cudaStreamDestroy", "cudaGetErrorString", "cudaGetErrorName",
]


def open_cuda():
    try:
        return Backend("cuda"), None
    except BackendUnavailableError as exc:
        return None, exc


def test_cuda_default_search_fails_clearly_or_opens():
    backend, exc = open_cuda()
    if backend is not None:  # a machine with a GPU: nothing to refuse
        assert backend.kind == "cuda" and backend.device_count >= 1
        return
    assert exc.code in (NOT_LOADED, NO_DEVICE), exc
    if exc.code == NOT_LOADED:
        for name in ("libcudart.so", "libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0"):
            assert name in str(exc)
    else:
        # libcudart loaded (a toolkit without a driver): the message says which file and why.
        assert "libcudart" in str(exc) and "cudaGetDeviceCount" in str(exc)
        assert "no CUDA device" in str(exc)


def test_cuda_bad_path_names_it():
    with pytest.raises(BackendUnavailableError) as ei:
        Backend("cuda", "/nonexistent/libcudart.so.99")
    assert ei.value.code == NOT_LOADED
    assert "/nonexistent/libcudart.so.99" in str(ei.value)


def test_cuda_library_without_symbols():
    # A library that loads but is not a CUDA runtime: the missing symbols are named.
    with pytest.raises(BackendUnavailableError) as ei:
        Backend("cuda", ctypes.util.find_library("m") or "libm.so.6")
    assert ei.value.code == MISSING_SYMBOL
    assert "cudaMalloc" in str(ei.value)


@pytest.fixture(scope="module")
def cuda():
    backend, exc = open_cuda()
    if backend is None:
        pytest.skip(reason=f"no usable CUDA device here: {str(exc).splitlines()[0]}")
    return backend


def test_cuda_symbols_resolved(cuda):
    assert cuda.resolved_symbols == CUDA_SYMBOLS


def test_cuda_malloc_free_mem_info(cuda):
    free0, total = cuda.mem_info(0)
    assert 0 < free0 <= total
    size = 256 << 20
    p = cuda.malloc(0, size)
    assert p != 0 and p % 256 == 0
    free1, _ = cuda.mem_info(0)
    assert free1 <= free0 - size + (64 << 20)  # the driver may round to its own granularity
    cuda.free(0, p)
    assert cuda.device_size(1000) == 1000


def test_cuda_oom_is_device_error(cuda):
    _, total = cuda.mem_info(0)
    with pytest.raises(DeviceError) as ei:
        cuda.malloc(0, total * 2)
    assert ei.value.code == 2  # cudaErrorMemoryAllocation


def test_cuda_events_and_streams(cuda):
    s1, s2 = cuda.stream_create(0), cuda.stream_create(0)
    ev = cuda.event_create(0)
    cuda.event_record(ev, s1)
    cuda.event_sync(ev, timeout_ms=5000)
    assert cuda.event_query(ev) is True
    cuda.stream_wait_event(s2, ev)
    cuda.stream_sync(s2, timeout_ms=5000)
    cuda.stream_sync(s1)
    cuda.event_destroy(ev)
    cuda.stream_destroy(s1)
    cuda.stream_destroy(s2)
    assert issubclass(DeviceTimeoutError, DeviceError)

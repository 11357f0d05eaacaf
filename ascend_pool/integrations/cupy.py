"""CuPy arrays allocated by ascend_pool's pool on its cuda backend.

    import cupy
    import ascend_pool.integrations.cupy as ap_cupy
    ap_cupy.install()                             # cupy.cuda.set_allocator(ap_cupy.malloc)
    x = cupy.ones(1 << 20)                        # from the pool; back to it when x is dropped

Each allocation is ordered on CuPy's current stream and wrapped as
cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, size, owner), 0); CuPy holds `owner` as
long as any array uses the memory, and when it drops it the block is freed on that same stream
(reusable at once by later work on it, by other streams once that work is done: CuPy's own pool
keeps a freed block for its stream only, which stream_reuse="tied" gives). set_allocator is per
thread in CuPy: call install() in each allocating thread.
CuPy's per-thread default stream (CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1, the cudaStreamPerThread
handle) is refused with InvalidStreamError: one handle for a different stream in each thread,
which the pool cannot order frees on.

What CuPy's own code relies on holds under the hook: an allocation past the memory is a
cupy.cuda.memory.OutOfMemoryError (which CuPy's fallbacks catch; it is an
ascend_pool.OutOfMemoryError too, with CuPy's "Out of memory allocating N bytes" first and
ascend_pool's cause after), and $CUPY_GPU_MEMORY_LIMIT ("1073741824" bytes or "50%" of the device),
which CuPy's pool reads, caps each device's default pool from its first CuPy allocation (and a
closed default's replacement from the next).
"""

import gc
import logging
import os
import sys

from .. import api
from .._core import capi_free, capi_malloc
from ..errors import ConfigError, InvalidStreamError, OutOfMemoryError
from ._common import require, use_backend

__all__ = ["install", "uninstall", "malloc", "parse_limit"]

log = logging.getLogger("ascend_pool.integrations.cupy")
_HINT = "Install CuPy for your CUDA version (pip install cupy-cuda12x)."


class _Allocation:
    """Owns one pool block for CuPy; frees it when CuPy lets go of it."""

    __slots__ = ("ptr", "size", "device", "stream")

    def __init__(self, ptr, size, device, stream):
        self.ptr, self.size, self.device, self.stream = ptr, size, device, stream

    def __del__(self):
        global _returned
        _returned += 1  # a GIL-held counter: the out-of-memory retry asks whether any came back
        try:
            capi_free(self.ptr, self.size, self.device, self.stream)
        except InvalidStreamError:
            pass  # its stream was destroyed first (legal in CuPy): the C ABI freed it on its allocation stream
        except Exception as exc:  # a finalizer must not raise; say why the block was not returned
            log.warning("could not return CuPy's block 0x%x to ascend_pool: %s", self.ptr, exc)


# CUDA's pseudo-handles: cudaStreamLegacy names the legacy default stream (the pool's default),
# cudaStreamPerThread a different stream in each thread
_STREAM_LEGACY, _STREAM_PER_THREAD = 0x1, 0x2
_oom_classes = {}  # (CuPy's OutOfMemoryError class, the pool's error class) -> the class raised for them
_returned = 0      # CuPy blocks given back so far (_Allocation.__del__)
# device -> the default pool that got $CUPY_GPU_MEMORY_LIMIT: a closed default's replacement
# (api.process_default_pool makes one at the next allocation) gets it again
_limited_devices = {}


_SSIZE_MAX = 2**63 - 1  # the most the C ABI's ascend_pool_malloc takes
_MAX_LIMIT = 2**64 - 2  # the most pool.set_limit takes (2**64-1 is its "no limit")


def parse_limit(text=None):
    """$CUPY_GPU_MEMORY_LIMIT as CuPy reads it (text None: the variable itself, as CuPy's
    _parse_limit_string): "" -> None, "N" -> {"size": N, "fraction": None} bytes, "P%" ->
    {"size": None, "fraction": P / 100}, both keys always there as in CuPy's dict (code written
    for it reads param["fraction"] after a size); pool.set_limit(**it) takes it. Anything else
    is a ConfigError naming the variable."""
    if text is None:
        text = os.environ.get("CUPY_GPU_MEMORY_LIMIT")
    text = (text or "").strip()
    if not text:
        return None
    try:
        if text.endswith("%"):
            fraction = float(text[:-1]) / 100
            if not 0 <= fraction <= 1:
                raise ValueError
            return {"size": None, "fraction": fraction}
        size = int(text)
        if not 0 <= size <= _MAX_LIMIT:  # past it: refused at the first allocation, naming no variable
            raise ValueError
        return {"size": size, "fraction": None}
    except ValueError:
        raise ConfigError(f"CUPY_GPU_MEMORY_LIMIT={text!r}: expected a byte count or a percentage "
                          "from 0% to 100%") from None


def _apply_env_limit(device):
    pool = api.process_default_pool(device)  # the device's own pool, as CuPy's, not a context current here
    _limited_devices[device] = pool
    limit = parse_limit(os.environ.get("CUPY_GPU_MEMORY_LIMIT"))
    if limit is not None:
        pool.set_limit(**limit)


def _oom_for_cupy(cp, exc, nbytes, device):
    """exc as CuPy's OutOfMemoryError (and still an ascend_pool.OutOfMemoryError), with CuPy's
    attributes _size, _total (bytes the pool holds) and _limit (0: none)."""
    base = getattr(getattr(cp.cuda, "memory", None), "OutOfMemoryError", None)
    if not (isinstance(base, type) and issubclass(base, BaseException)) or isinstance(exc, base):
        return exc
    # one class per pair: a tenant's QuotaExceededError stays one, a plain out-of-memory never becomes one
    cls = _oom_classes.get((base, type(exc)))
    if cls is None:
        # pickled as CuPy's own class (a generated class has no module attribute to be found by):
        # a worker's out-of-memory reaches the parent of multiprocessing or dask, as CuPy's does,
        # with its own message (args, set back by BaseException's __setstate__): the pool's cause too
        cls = _oom_classes[(base, type(exc))] = type("CupyOutOfMemoryError", (base, type(exc)), {
            "__module__": __name__,
            "__reduce__": lambda e: (base, (e._size, e._total, e._limit), {"args": e.args})})
    pool = api.default_pool(device)
    total, limit = pool.memory_stats()["reserved_bytes.all.current"], pool.get_limit()
    cap = f", limit set to: {limit:,} bytes" if limit else ""
    err = cls.__new__(cls)
    BaseException.__init__(err, f"Out of memory allocating {nbytes:,} bytes (allocated so far: {total:,} bytes{cap}). "
                                f"{exc}")
    err._size, err._total, err._limit = nbytes, total, limit
    return err


def malloc(nbytes):
    """CuPy allocator function: nbytes on CuPy's current device and stream, as a MemoryPointer."""
    cp = sys.modules["cupy"]
    if nbytes == 0:  # empty arrays: CuPy's own zero-size memory, no device call
        return cp.cuda.MemoryPointer(cp.cuda.memory.Memory(0), 0)
    device = cp.cuda.runtime.getDevice()
    limited = _limited_devices.get(device)
    if limited is None or limited.closed:
        _apply_env_limit(device)
    stream = cp.cuda.get_current_stream().ptr or None
    if stream == _STREAM_LEGACY:  # the one legacy default stream under another name
        stream = None
    elif stream == _STREAM_PER_THREAD:
        raise InvalidStreamError(
            f"CuPy's current stream is CUDA's cudaStreamPerThread pseudo-handle ({stream:#x}, "
            "CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1): one handle for a different stream in every thread, so "
            "the pool could not order a block freed in one thread before its reuse in another; use "
            "cupy.cuda.Stream() streams (or the legacy default stream) with ascend_pool")
    try:
        ptr = capi_malloc(nbytes, device, stream)
    except OverflowError:
        if nbytes <= _SSIZE_MAX:
            raise
        # CuPy's size is a size_t; the C ABI's an ssize_t. Past it no device has the memory:
        # CuPy's out-of-memory, as every size past the device (not Cython's OverflowError)
        raise _oom_for_cupy(cp, OutOfMemoryError(
            f"ascend_pool_malloc({nbytes} bytes, device {device}): out of memory: Tried to allocate more than "
            f"1EB memory ({nbytes} bytes) on device {device}: larger than any device"), nbytes, device) from None
    except OutOfMemoryError as first:
        # As CuPy's own pool: after its cache is freed (the pool did that), collect garbage
        # (arrays kept only by reference cycles give their blocks back) and try once more, when
        # the collection gave a block back (else the retry could only fail again: one request
        # counted as two out-of-memory errors, its observers called twice).
        returned = _returned
        gc.collect()
        if _returned == returned:
            raise _oom_for_cupy(cp, first, nbytes, device) from None
        try:
            ptr = capi_malloc(nbytes, device, stream)
        except OutOfMemoryError as exc:
            raise _oom_for_cupy(cp, exc, nbytes, device) from None
    owner = _Allocation(ptr, nbytes, device, stream)
    return cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(ptr, nbytes, owner, device), 0)


def install():
    """Makes ascend_pool CuPy's allocator in the calling thread."""
    cp = require("cupy", "cupy", _HINT)
    parse_limit(os.environ.get("CUPY_GPU_MEMORY_LIMIT"))  # a bad value is refused here, not at an allocation
    use_backend("cuda", "CuPy")
    cp.cuda.set_allocator(malloc)


def uninstall():
    """Gives the calling thread CuPy's default memory pool back."""
    cp = require("cupy", "cupy", _HINT)
    cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)

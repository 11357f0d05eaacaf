"""CuPy arrays allocated by ascend_pool's pool on its cuda backend.

    import cupy
    import ascend_pool.integrations.cupy as ap_cupy
    ap_cupy.install()                             # cupy.cuda.set_allocator(ap_cupy.malloc)
    x = cupy.ones(1 << 20)                        # from the pool; back to it when x is dropped

Each allocation is ordered on CuPy's current stream and wrapped as
cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, size, owner), 0); CuPy holds `owner` as
long as any array uses the memory, and when it drops it the block is freed on that same stream
(reusable at once by later work on it, by other streams once that work is done), the order CuPy's
own pool keeps. set_allocator is per thread in CuPy: call install() in each allocating thread.
"""

import logging
import sys

from .._core import capi_free, capi_malloc
from ._common import require, use_backend

__all__ = ["install", "uninstall", "malloc"]

log = logging.getLogger("ascend_pool.integrations.cupy")
_HINT = "Install CuPy for your CUDA version (pip install cupy-cuda12x)."


class _Allocation:
    """Owns one pool block for CuPy; frees it when CuPy lets go of it."""

    __slots__ = ("ptr", "size", "device", "stream")

    def __init__(self, ptr, size, device, stream):
        self.ptr, self.size, self.device, self.stream = ptr, size, device, stream

    def __del__(self):
        try:
            capi_free(self.ptr, self.size, self.device, self.stream)
        except Exception as exc:  # a finalizer must not raise; say why the block was not returned
            log.warning("could not return CuPy's block 0x%x to ascend_pool: %s", self.ptr, exc)


def malloc(nbytes):
    """CuPy allocator function: nbytes on CuPy's current device and stream, as a MemoryPointer."""
    cp = sys.modules["cupy"]
    if nbytes == 0:  # empty arrays: CuPy's own zero-size memory, no device call
        return cp.cuda.MemoryPointer(cp.cuda.memory.Memory(0), 0)
    device = cp.cuda.runtime.getDevice()
    stream = cp.cuda.get_current_stream().ptr or None
    ptr = capi_malloc(nbytes, device, stream)
    owner = _Allocation(ptr, nbytes, device, stream)
    return cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(ptr, nbytes, owner, device), 0)


def install():
    """Makes ascend_pool CuPy's allocator in the calling thread."""
    cp = require("cupy", "cupy", _HINT)
    use_backend("cuda", "CuPy")
    cp.cuda.set_allocator(malloc)


def uninstall():
    """Gives the calling thread CuPy's default memory pool back."""
    cp = require("cupy", "cupy", _HINT)
    cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)

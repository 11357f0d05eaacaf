"""The process's pinned host pools: page-locked host memory for staging copies, and the memory
behind the numpy handler (ascend_pool.integrations.numpy).

    from ascend_pool.integrations.pinned import host_pool
    hp = host_pool()                  # device 0 of the process's backend
    buf = hp.malloc(64 << 20)         # pinned bytes; an async copy from it can run at full speed
    hp.record_stream(buf, stream)     # the copy was queued on `stream` ...
    hp.free(buf)                      # ... so buf is reused only once that copy has finished

One pool per device, created on first use and kept until the process exits (arrays and in-flight
copies may outlive every Python reference to it). See ascend_pool._core.HostPool for the policy.
"""

from .. import registry
from .._core import HostPool
from ..backend import check_device, device_index, open_backend

__all__ = ["host_pool"]


def _create(device):
    pool = HostPool(open_backend(), device)
    pool._make_immortal()
    return pool


def host_pool(device=0):
    """The pinned host pool pinning in `device`'s runtime context on the process's backend
    ($ASCEND_POOL_BACKEND, else automatic); kept in ascend_pool.registry. A device that is not an
    index of the backend's devices raises InvalidDeviceError."""
    device = device_index(device)
    check_device(open_backend(), device)
    return registry.host_pool(device, lambda: _create(device))

"""The process's pinned host pools: page-locked host memory for staging copies, and the memory
behind the numpy handler (ascend_pool.integrations.numpy).

    from ascend_pool.integrations.pinned import host_pool
    hp = host_pool()                  # a device the process already uses (see host_pool)
    buf = hp.malloc(64 << 20)         # pinned bytes; an async copy from it can run at full speed
    hp.record_stream(buf, stream)     # the copy was queued on `stream` ...
    hp.free(buf)                      # ... so buf is reused only once that copy has finished

One pool per device, created on first use and kept until the process exits (arrays and in-flight
copies may outlive every Python reference to it). See ascend_pool._core.HostPool for the policy.
"""

import sys

from .. import api, registry
from .._core import HostPool, unopened_host_memory_stats
from ..backend import check_device, device_index, open_backend
from ..units import as_index

__all__ = ["host_pool", "default_device", "host_memory_stats", "host_memory_stats_as_nested_dict", "reset_peak_host_memory_stats",
           "reset_accumulated_host_memory_stats", "host_empty_cache"]


def _create(device):
    pool = HostPool(open_backend(), device)
    pool._make_immortal()
    return pool


def default_device():
    """The device host_pool() pins in, as torch's CachingHostAllocator picks a device with a
    primary context (pinned memory serves copies to and from any device): the calling thread's
    current device (ap.set_device) if this process holds it already (an open pool or pinned pool
    on it), else the first device with a pinned pool, else the first with an open pool, else the
    current device. Before, device 0 always: a process on device 5 took a device-0 reference, a
    context on an NPU it never used, at its first pinned allocation. Where the thread never called
    ap.set_device and torch_npu has started, torch_npu's current device of the thread
    (torch.npu.set_device), where torch_npu holds a context, as torch's host allocator pins in
    the current device's primary context: before, ap's current device (0) took a device-0
    context from a rank on NPU 5 that pinned before its first tensor."""
    framework = _framework_device() if api.explicit_device() is None else None
    if framework is not None:
        return framework
    current = api.current_device()
    hosts = registry.host_pool_devices()
    backend = open_backend()
    opened = sorted({p.device for p in registry.live_pools() if p.backend is backend})
    if current in hosts or current in opened:
        return current
    return (hosts or opened or [current])[0]


def _framework_device():
    """torch_npu's current device of the calling thread once torch_npu has started, else None:
    read without importing it or starting it (its current_device() runs its lazy init)."""
    npu = sys.modules.get("torch_npu.npu") or getattr(sys.modules.get("torch_npu"), "npu", None)
    started = getattr(npu, "is_initialized", None)
    if not callable(started) or not callable(getattr(npu, "current_device", None)) or not started():
        return None
    index = as_index(npu.current_device())
    return index if index is not None and index >= 0 else None


def host_pool(device=None):
    """The pinned host pool pinning in `device`'s runtime context on the process's backend
    ($ASCEND_POOL_BACKEND, else automatic); kept in ascend_pool.registry. None: default_device(),
    a device the process already holds. A device that is not an index of the backend's devices
    raises InvalidDeviceError."""
    device = default_device() if device is None else device_index(device)
    check_device(open_backend(), device)
    return registry.host_pool(device, lambda: _create(device))


# torch.cuda's (and torch_npu.npu's) module-level names for the pinned host allocator, on the
# pinned pool of `device` (torch has one host allocator per process; here one pool per device;
# None: host_pool()'s, default_device()).

def host_memory_stats(device=None):
    """torch.cuda.host_memory_stats(): host_pool(device).host_memory_stats(); a pinned pool never
    made is not made to be read (a device reference, a context on an NPU, as the resets below):
    a new pool's figures, each 0, as torch's answers before it pinned anything."""
    pool = _made(device)
    return pool.host_memory_stats() if pool is not None else unopened_host_memory_stats()


def host_memory_stats_as_nested_dict(device=None):
    """torch.cuda.host_memory_stats_as_nested_dict(): the same figures, nested at the dots."""
    nested = {}
    for key, value in host_memory_stats(device).items():
        head, _, leaf = key.rpartition(".")
        (nested.setdefault(head, {}) if head else nested)[leaf] = value
    return nested


def _made(device):
    """The pinned pool of `device` (checked as host_pool checks it) if one was made, else None:
    the calls that only reset or give back make none, as torch's initialise nothing (a pool made
    for them took a reference on the device, a context on an NPU the process may never use)."""
    device = default_device() if device is None else device_index(device)
    check_device(open_backend(), device)
    return registry.open_host_pool(device)


def reset_peak_host_memory_stats(device=None):
    """torch.cuda.reset_peak_host_memory_stats(): peaks back to the current values."""
    pool = _made(device)
    if pool is not None:
        pool.reset_peak_stats()


def reset_accumulated_host_memory_stats(device=None):
    """torch.cuda.reset_accumulated_host_memory_stats(): .allocated/.freed, call counts and times to 0."""
    pool = _made(device)
    if pool is not None:
        pool.reset_accumulated_stats()


def host_empty_cache(device=None):
    """torch_npu.npu.host_empty_cache() (torch's torch._C._host_emptyCache): the cached buffers
    back to the runtime, after the streams' work their parked ones wait for; nothing when the
    device's pinned pool was never made."""
    pool = _made(device)
    if pool is not None:
        pool.empty_cache()

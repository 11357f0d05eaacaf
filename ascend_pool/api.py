"""Module-level functions on a default pool per device (like torch.npu.memory's functions).

The current device is per thread (set_device); each device's default pool is created on first
use with the knobs of $ASCEND_POOL_CONF and the backend of $ASCEND_POOL_BACKEND.
"""

import threading

from . import current as _current
from . import registry as _registry
from ._core import set_default_pool_hook
from .backend import open_backend
from .errors import InvalidDeviceError
from .pool import Pool
from .snapshot import dump as _dump_snapshot, merge as _merge_snapshots
from .tenants.default import default_tenant_pool

_lock = threading.Lock()
_local = threading.local()


def set_device(device):
    """Makes device (int) the current device of the calling thread for module-level calls."""
    if not isinstance(device, int) or isinstance(device, bool) or device < 0:
        raise InvalidDeviceError(f"device must be a non-negative int, got {device!r}")
    _local.device = device


def current_device():
    """The calling thread's current device (default 0)."""
    return getattr(_local, "device", 0)


def default_pool(device=None):
    """The pool module-level calls use for device (None: the current device): the thread's
    current context if one was made current, else the process default, created on first use."""
    device = current_device() if device is None else device
    pool = _current.top(device)
    if pool is not None:
        return pool
    pool = _registry.default_pool(device)
    if pool is None:  # a closed default is replaced, for Python and the C ABI alike
        with _lock:
            pool = _registry.default_pool(device)
            if pool is None:
                pool = _create_default(device)
                _registry.set_default_pool(device, pool)
    return pool


def _create_default(device):
    # With $ASCEND_POOL_TENANT set, the default pool is that tenant's context (its quota from
    # $ASCEND_POOL_CONFIG), so module-level calls and the C ABI allocate under the quota.
    pool = default_tenant_pool(device) or Pool(device)
    if _history is not None:
        enabled, stacks, max_entries = _history
        pool.record_memory_history(enabled, stacks=stacks, max_entries=max_entries)
    return pool


def _default_pool_for_c_abi(device):
    """The C ABI's hook (capi/capi.pxi): (backend, device's default pool), the pool None when the
    backend has no such device."""
    backend = open_backend()
    if not 0 <= device < backend.device_count:
        return backend, None
    return backend, default_pool(device)


set_default_pool_hook(_default_pool_for_c_abi)


def malloc(nbytes, stream=None, device=None):
    """Allocates nbytes on the default pool of device; returns the address (int)."""
    return default_pool(device).malloc(nbytes, stream)


def free(ptr, stream=None, device=None):
    """Frees ptr (from malloc) on the default pool of device."""
    default_pool(device).free(ptr, stream)


def record_stream(ptr, stream, device=None):
    """Marks ptr as used by stream (see Pool.record_stream)."""
    default_pool(device).record_stream(ptr, stream)


def empty_cache(device=None):
    """Returns the default pool's unused segments to the device."""
    default_pool(device).empty_cache()


def memory_stats(device=None):
    """The default pool's counters in PyTorch's schema (bytes)."""
    return default_pool(device).memory_stats()


def memory_summary(device=None):
    """A readable summary of the default pool's counters."""
    return default_pool(device).memory_summary()


def reset_peak_stats(device=None):
    """Resets the default pool's peak counters."""
    default_pool(device).reset_peak_stats()


def snapshot(device=None):
    """The default pool's snapshot in PyTorch's schema."""
    return default_pool(device).snapshot()


def reset_accumulated_memory_stats(device=None):
    """Zeroes the default pool's accumulated counters (allocated/freed totals, event counts)."""
    default_pool(device).reset_accumulated_stats()


def mem_get_info(device=None):
    """(free, total) bytes of the device, as torch.npu.mem_get_info()."""
    return default_pool(device).mem_get_info()


_history = None  # the last record_memory_history() settings: applied to default pools made later


def record_memory_history(enabled=True, stacks="python", max_entries=100_000, device=None):
    """torch.cuda.memory._record_memory_history for the default pools: turns the event history
    (and with stacks="python" the Python frames of each allocation and free) on or off at runtime
    on every device's default pool (device given: that one only); pools made later follow it."""
    global _history
    pools = [default_pool(device)] if device is not None else _registry.default_pools()
    for pool in pools:
        pool.record_memory_history(enabled, stacks=stacks, max_entries=max_entries)
    if device is None:
        _history = (enabled, stacks, max_entries)


def dump_snapshot(path, device=None):
    """Writes the default pools' snapshot (every device's that was used, or one device's) as the
    pickle that `python -m torch.cuda._memory_viz` reads (PyTorch's _dump_snapshot)."""
    if device is not None:
        snap = default_pool(device).snapshot()
    else:
        pools = _registry.default_pools() or [default_pool()]
        snap = _merge_snapshots([p.snapshot() for p in pools])
    _dump_snapshot(snap, path)


def memory_allocated(device=None):
    """Bytes currently allocated (rounded block sizes)."""
    return memory_stats(device)["allocated_bytes.all.current"]


def memory_reserved(device=None):
    """Bytes currently held from the device."""
    return memory_stats(device)["reserved_bytes.all.current"]

"""ascend_pool: a caching device-memory allocator for Huawei Ascend NPUs.

    import ascend_pool as ap
    pool = ap.Pool(device=0)          # backend from $ASCEND_POOL_BACKEND, else acl, else the simulator
    ptr = pool.malloc(1 << 20)
    pool.free(ptr)
    ap.malloc / ap.free / ap.memory_stats ...   # on a default pool per device
"""

from .errors import (
    BackendUnavailableError,
    ConfigError,
    DeviceError,
    DeviceTimeoutError,
    InvalidDeviceError,
    InvalidPointerError,
    InvalidSizeError,
    InvalidStreamError,
    OutOfMemoryError,
    PoolError,
    QuotaExceededError,
)
from .pool import Pool
from .api import (
    current_device,
    default_pool,
    empty_cache,
    free,
    malloc,
    memory_allocated,
    memory_reserved,
    memory_stats,
    memory_summary,
    record_stream,
    reset_peak_stats,
    set_device,
    snapshot,
)

from .capi import library_path
from .sharing import SharedBlock, SharedHandle, node_pid, open_shared

__version__ = "0.1.0"

"""ascend_pool: a caching device-memory allocator for Huawei Ascend NPUs.

    import ascend_pool as ap
    pool = ap.Pool(device=0)          # backend from $ASCEND_POOL_BACKEND, else acl, else the simulator
    ptr = pool.malloc(1 << 20)
    pool.free(ptr)
    ap.malloc / ap.free / ap.memory_stats ...   # on a default pool per device
"""

import importlib.util as _util
import os as _os

if _util.find_spec(f"{__name__}._core") is None:
    # Run from a source checkout without an in-place build, the current directory (first on
    # sys.path) shadows the installed package, whose compiled extension is then never found.
    raise ImportError(
        f"ascend_pool at {_os.path.dirname(__file__)} has no compiled extension (_core): this is a source "
        "tree that was not built in place. Run from another directory to use the installed package "
        "(pip install .), or build here with `python setup.py build_ext --inplace`.")

from .errors import (
    BackendUnavailableError,
    ConfigError,
    ConfigTypeError,
    DeviceError,
    DeviceTimeoutError,
    InvalidDeviceError,
    InvalidPointerError,
    InvalidSizeError,
    InvalidStreamError,
    OutOfMemoryError,
    PoolError,
    QuotaExceededError,
    StreamTypeError,
)
from .pool import Pool
from .api import (
    _allocation_traceback,
    _get_memory_metadata,
    _set_memory_metadata,
    attach_out_of_memory_observer,
    caching_allocator_alloc,
    caching_allocator_delete,
    context,
    create_stream,
    current_device,
    default_pool,
    destroy_stream,
    detach_out_of_memory_observer,
    dump_snapshot,
    dump_trace,
    empty_cache,
    erase_stream,
    free,
    get_memory_metadata,
    get_per_process_memory_fraction,
    malloc,
    max_memory_allocated,
    max_memory_cached,
    max_memory_reserved,
    memory_cached,
    memory_allocated,
    memory_reserved,
    memory_snapshot,
    memory_stats,
    memory_stats_as_nested_dict,
    mem_get_info,
    memory_summary,
    record_memory_history,
    record_stream,
    reset_accumulated_memory_stats,
    reset_accumulated_stats,
    reset_max_memory_allocated,
    reset_max_memory_cached,
    reset_peak_memory_stats,
    reset_peak_stats,
    set_device,
    set_memory_metadata,
    set_per_process_memory_fraction,
    share,
    share_free,
    share_malloc,
    snapshot,
    synchronize,
    use_mem_pool,
)

from .settings import set_allocator_settings
from .capi import library_path
from . import rmm_log_trace as _rmm_log_trace  # registers RMM's CSV logs with traces.load_trace
from .sharing import SharedBlock, SharedHandle, node_pid, open_shared
from .service import publisher as _publisher  # registers the stats publisher: it starts with the first pool
from .service.processes import list_gpu_processes as _list_processes
from .backend import check_device as _check_device
from .backend import device_index as _device_index
from .backend import open_backend as _open_backend
from .backend import torch_device_index as _torch_device_index


def list_gpu_processes(device=None):
    """torch.cuda.list_gpu_processes(device) for ascend_pool: the processes holding memory on the
    device (None: the current one; torch's "npu:1" forms too; one that does not exist is an
    InvalidDeviceError), one line each with its pid and MB held, then its tenant and instance (a
    pid is its container's): this user's processes that publish their figures (`ascend-pool ps`;
    a node service with --allow-uid sees other users') and this process's own pools."""
    index = _torch_device_index(device)
    backend = _open_backend(None)
    index = _device_index(current_device() if index is None else index)
    _check_device(backend, index)
    return _list_processes(index, "GPU" if backend.kind == "cuda" else "NPU", backend.physical_device(index))

from .version import __version__

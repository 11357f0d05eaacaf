"""numpy arrays whose data lives in ascend_pool's pinned host pool (a NEP 49 memory handler).

    import ascend_pool.integrations.numpy as ap_np
    ap_np.install()                   # this thread's (context's) new arrays: pinned, pooled
    a = np.ones(1 << 20)              # np.core.multiarray.get_handler_name(a) == "ascend_pool_pinned_host"
    ap_np.stats()["allocated_bytes.all.current"]

Scope: numpy keeps the current handler in a context variable, so install() applies to the calling
thread's context (and asyncio tasks created from it afterwards). Other threads, which start with a
fresh context, keep numpy's default handler until they call install() themselves; with
`installed()` the change is undone when the block ends. An array always frees through the handler
that allocated it, whatever is current then, so memory goes back to the pool that gave it.

numpy does not tell realloc (ndarray.resize) the old size; the pool looks the buffer up, grows it
in place while the new size stays in its power-of-two class, else moves it.

Why pinned: arrays staged for host<->device copies can be copied asynchronously at full speed.
Pinned memory is scarce: install it where arrays feed the device, not for a whole program.
"""

import contextlib
import importlib
import os
import threading

from .._core import numpy_handler_capsule, numpy_set_handler
from ._common import FrameworkMissingError, require
from .pinned import default_device as _default_device
from .pinned import host_pool as _host_pool

__all__ = ["install", "uninstall", "installed", "is_installed", "stats", "host_pool", "HANDLER_NAME"]

HANDLER_NAME = "ascend_pool_pinned_host"
_HINT = "Install numpy >= 1.22 (pip install numpy)."


def _numpy():
    np = require("numpy", "numpy", _HINT)
    major, minor = (int(x) for x in np.__version__.split(".")[:2])
    if (major, minor) < (1, 22):
        raise FrameworkMissingError(f"numpy {np.__version__} predates memory handlers (NEP 49). {_HINT}")
    return np


def _numpy_module(name):
    """numpy._core.X (numpy 2) or numpy.core.X (numpy 1)."""
    try:
        return importlib.import_module(f"numpy._core.{name}")
    except ImportError:
        return importlib.import_module(f"numpy.core.{name}")


def _after_fork_in_child():
    # The parent's pool is not the child's (capi/numpy_handler.h refuses it there): the forking
    # thread's new arrays go back to numpy's allocator, as they were before install().
    try:
        if is_installed():
            uninstall(None)
    except Exception:  # never fail a fork
        pass


os.register_at_fork(after_in_child=_after_fork_in_child)


_device = None  # the handler's device, chosen at its first use (its pool lives in ascend_pool.registry)
_device_lock = threading.Lock()


def host_pool():
    """The pinned host pool behind the handler: pinned.host_pool()'s device at the first use (a
    device the process already holds, pinned.default_device; before, device 0 always, a context on
    an NPU a process on device 5 never used), the same device from then on, whichever thread asks
    (its arrays and stats() stay in one pool; a pool closed since is made again there)."""
    global _device
    if _device is None:
        with _device_lock:
            if _device is None:
                _device = _default_device()
    return _host_pool(_device)


def install():
    """Makes numpy allocate new arrays' data from the pinned host pool in the calling context.
    Returns the handler that was current (a capsule), for uninstall()."""
    _numpy()
    capsule = numpy_handler_capsule(host_pool())
    return numpy_set_handler(_numpy_module("_multiarray_umath")._ARRAY_API, capsule)


def uninstall(previous=None):
    """Restores `previous` (what install() returned; None: numpy's default handler) in the calling
    context. Arrays already allocated keep freeing into the pool."""
    _numpy()
    numpy_set_handler(_numpy_module("_multiarray_umath")._ARRAY_API, previous)


@contextlib.contextmanager
def installed():
    """`with installed():` the handler is current inside the block only."""
    previous = install()
    try:
        yield host_pool()
    finally:
        uninstall(previous)


def is_installed():
    """True when new arrays in the calling context would come from the pool."""
    _numpy()
    return _numpy_module("multiarray").get_handler_name() == HANDLER_NAME


def stats():
    """The pinned host pool's counters (bytes and counts; see HostPool.memory_stats)."""
    return host_pool().memory_stats()

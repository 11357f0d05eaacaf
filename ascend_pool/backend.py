"""Which device backend this process uses: a real NPU (acl), the simulated NPU (sim) or CUDA.

    open_backend()              # $ASCEND_POOL_BACKEND, else acl if an NPU is there, else sim
    open_backend("sim")         # the bundled simulator, through the acl loading code
    open_backend("acl", "/opt/cann/lib64/libascendcl.so")

One Backend object is kept per (name, path) for the life of the process: the pool and every other
user of the same device then share one loaded runtime and one set of per-thread device caches.

A process forked after its parent opened a backend cannot use a device runtime (CANN and CUDA
cannot; the simulator behaves alike): open_backend, Pool() and every call on an inherited pool
raise BackendUnavailableError (code 990004) saying to start workers with the 'spawn' method.
"""

import logging
import os
import threading

from . import identity
from ._core import Backend, check_not_forked, fork_dropped_close, fork_dropped_lease, fork_dropped_open, fork_drops_fd
from ._sim import library_path as sim_library_path
from .errors import BackendUnavailableError, ConfigError, InvalidDeviceError
from .units import as_index

__all__ = ["open_backend", "backend_opened", "check_device", "device_index", "sim_library_path", "BACKEND_ENV", "BACKEND_NAMES"]

BACKEND_ENV = "ASCEND_POOL_BACKEND"
BACKEND_NAMES = ("acl", "sim", "cuda")
_NOT_LOADED = 990001  # AP_ERR_NOT_LOADED in backend.h

log = logging.getLogger("ascend_pool")

_lock = threading.RLock()  # held while a runtime is opened (dlopen, aclInit: long)
_cache = {}  # (name or None, path or None) -> Backend, for every request ever answered
_logged = False  # the choice is logged once per process


def _after_fork_in_child():
    # A fork while another thread opens a runtime copies this lock held; the child is refused
    # by check_not_forked (fork.c counts an open in progress as opened), not left hanging here.
    global _lock
    _lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)
# leases, stats files, life locks: a child forked from C drops them (fork.c)
identity.set_fork_guard(fork_drops_fd, fork_dropped_open, fork_dropped_close, fork_dropped_lease)


def _requested_name(name):
    """(name or None for automatic, where the choice came from)."""
    if name is not None:
        if name not in BACKEND_NAMES:
            raise ConfigError(f"unknown backend {name!r}: expected one of {', '.join(BACKEND_NAMES)}")
        return name, "argument"
    value = os.environ.get(BACKEND_ENV, "").strip()
    if not value:
        return None, "auto"
    if value not in BACKEND_NAMES:
        raise ConfigError(
            f"{BACKEND_ENV}={value!r} is not a backend: expected one of {', '.join(BACKEND_NAMES)}"
        )
    return value, f"${BACKEND_ENV}"


def _open(name, path):
    if name == "sim":
        # No path: the bundled simulator, unless a simulator copy is already loaded in the
        # process (then that one: one runtime per process).
        return Backend("sim", path)
    return Backend(name, path)


def _open_auto():
    """acl when libascendcl.so loads and reports a device, else sim. Returns (backend, why)."""
    try:
        backend = _cached("acl", None)
        return backend, f"found {backend.device_count} NPU(s) via {backend.path}"
    except BackendUnavailableError as exc:
        if os.environ.get("ASCEND_POOL_ACL_LIB"):
            # The user named a runtime and it failed: still run (on the simulator), but loudly.
            log.warning("$ASCEND_POOL_ACL_LIB is set but unusable: %s", exc)
        if exc.code == _NOT_LOADED:
            reason = "no libascendcl.so found in $ASCEND_POOL_ACL_LIB, the CANN locations or the loader path"
        else:
            reason = str(exc).splitlines()[0]
        log.debug("acl backend unavailable: %s", exc)
        return _cached("sim", None), f"{reason}; using the simulated NPU"


def _cached(name, path):
    key = (name, path)
    backend = _cache.get(key)
    if backend is None:
        backend = _open(name, path)
        _cache[key] = backend
    return backend


def open_backend(name=None, path=None):
    """The process's Backend for `name` ("acl", "sim", "cuda"; None: $ASCEND_POOL_BACKEND, else
    automatic) loaded from `path` (None: that backend's default search).

    Raises ConfigError for an unknown name or environment value, BackendUnavailableError when the
    chosen backend cannot be opened (an explicit choice never falls back to another backend), or
    when this process was forked after its parent had opened one (code 990004: use 'spawn').
    The choice is logged once at INFO on the "ascend_pool" logger.
    """
    global _logged
    check_not_forked()  # the cached backends below are the parent's
    name, source = _requested_name(name)
    key = (name, path)
    backend = _cache.get(key)  # opened already: no lock (a signal handler's Pool() must not wait for its thread)
    if backend is not None:
        return backend
    with _lock:
        backend = _cache.get(key)
        if backend is not None:
            return backend
        if name is None and path is None:
            backend, why = _open_auto()
        else:
            if name is None:
                name, source = "acl", "library path"  # a bare path means "load this ACL runtime"
            backend, why = _cached(name, path), f"selected by {source}"
        _cache[key] = backend
        if not _logged:
            _logged = True
            log.info(
                "device backend %s (%d device(s), %s): %s",
                backend.name, backend.device_count, backend.path, why,
            )
        return backend


def backend_opened():
    """True once open_backend has opened a backend (a device runtime) in this process; asks
    nothing and opens nothing. Calls that only read figures check a device index against the
    backend only then: opening it (aclInit) just to check made the process a runtime user
    (cython/backend/fork.c), so a child it forked afterwards was refused the device."""
    return bool(_cache)


def torch_device_index(device, kinds=("npu", "cuda")):
    """torch's device argument as an int index, None for the current device: None, an int (or
    numpy integer, checked later), "npu:1" / "cuda:1" ("npu": the current one) or a device object
    with .type and .index (torch.device). Another device type ("cpu") or form is an
    InvalidDeviceError, a ValueError as torch's _get_device_index raises."""
    if device is None or (isinstance(device, int) and not isinstance(device, bool)):
        return device
    if isinstance(device, str):
        kind, colon, index = device.partition(":")
        # as torch's parser: digits without a leading zero after a colon (int() would take " 1",
        # "+1", "1_0" and "01"; "npu:" was the current device)
        if colon and not (index.isascii() and index.isdigit() and (index == "0" or index[0] != "0")):
            raise InvalidDeviceError(f"Invalid device string: {device!r}")
        index = int(index) if index else None
    elif hasattr(device, "type") and not isinstance(device, bool):
        kind, index = device.type, getattr(device, "index", None)
    elif as_index(device) is not None:  # a numpy integer
        return device
    else:
        raise InvalidDeviceError(f"Expected a torch.device with a specified index or an integer, but got: {device!r}")
    if kind not in kinds:
        raise InvalidDeviceError(f"Expected a {' or '.join(kinds)} device, but got: {device}")
    return index


def device_index(device):
    """device as an int: an int or a numpy integer (as torch accepts), or torch's forms with an
    index ("npu:1", "cuda:1", a torch.device); never a bool or a float (InvalidDeviceError)."""
    index = as_index(device)
    if index is None and (isinstance(device, str) or hasattr(device, "type")):
        try:
            index = torch_device_index(device)
        except InvalidDeviceError as e:
            raise InvalidDeviceError(f"device must be an integer index or a device like 'npu:0', got {device!r}: "
                                     f"{e}") from None
        if index is None:
            raise InvalidDeviceError(f"device {device!r} names no index: a pool serves one device, say which "
                                     f"(e.g. 'npu:0')")
        index = as_index(index)
    if index is None:
        raise InvalidDeviceError(f"device must be an integer index, got {device!r}")
    return index


def check_device(backend, device):
    """Raises InvalidDeviceError naming the device count unless 0 <= device (an int) <
    backend.device_count."""
    if not 0 <= device < backend.device_count:
        raise InvalidDeviceError(
            f"device {device!r} does not exist: the {backend.name} backend has {backend.device_count} device(s)")

"""What the integrations share: importing a framework with a clear failure, the C ABI's symbol
addresses as frameworks resolve them, and choosing the backend a framework's memory needs."""

import ctypes
import importlib
import logging
import os

from .. import _core
from .. import backend as _backend
from ..backend import BACKEND_ENV
from ..capi import library_path
from ..errors import ConfigError, PoolError


class FrameworkMissingError(PoolError, ImportError):
    """The framework an integration plugs into is not installed (or not usable) here: an
    ImportError, and an ap.PoolError as every error the package raises (CONTRACT.md)."""


def require(module, integration, hint):
    """Imports `module` for `integration`, or raises FrameworkMissingError saying what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise FrameworkMissingError(
            f"ascend_pool.integrations.{integration} needs {module!r}, which is not importable here "
            f"({exc}). {hint}") from exc


def symbol_address(name):
    """The address of an exported C ABI symbol, found exactly as torch finds it: ctypes.CDLL on
    library_path() (dlopen) and attribute lookup (dlsym)."""
    lib = ctypes.CDLL(library_path())
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


TORCH_ALLOC_LIB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "libascend_pool_torch.so")
_torch_alloc_warned = False


def torch_alloc_functions():
    """(library path, alloc symbol, free symbol) for torch's pluggable allocators. Where the
    package was built with a C++ compiler: libascend_pool_torch.so, bound here to the C ABI, whose
    alloc throws on failure (torch raises torch.OutOfMemoryError "... out of memory ..." when memory
    ran out, RuntimeError for another refusal; it builds a tensor
    at address 0 from a NULL). Else the C ABI's own pair, said once in the log."""
    global _torch_alloc_warned
    if os.path.exists(TORCH_ALLOC_LIB):
        core = ctypes.CDLL(library_path())
        shim = ctypes.CDLL(TORCH_ALLOC_LIB)  # the handle torch's dlopen of the same path gets
        shim.ascend_pool_torch_bind.argtypes = [ctypes.c_void_p] * 4
        # the allocation with torch's size_t (2**63 and past reach the pool: counted, observed)
        shim.ascend_pool_torch_bind(_core._capi_torch_malloc_address(), *(ctypes.cast(getattr(core, n), ctypes.c_void_p) for n in
                                                                    ("ascend_pool_free", "ascend_pool_last_error",
                                                                     "ascend_pool_last_error_code")))
        return TORCH_ALLOC_LIB, "ascend_pool_torch_malloc", "ascend_pool_torch_free"
    if not _torch_alloc_warned:
        _torch_alloc_warned = True
        logging.getLogger("ascend_pool").warning(
            "%s is missing (ascend_pool was built without a C++ compiler): torch gets the C ABI's "
            "ascend_pool_malloc, whose NULL on out of memory torch does not check (a tensor at address 0); "
            "reinstall with g++ present", TORCH_ALLOC_LIB)
    return library_path(), "ascend_pool_malloc", "ascend_pool_free"


def use_backend(kind, why, open_now=True):
    """Makes the C ABI's default pools use backend `kind` ("acl" or "cuda"): a framework's device
    memory must come from its own runtime. Sets $ASCEND_POOL_BACKEND when unset; refuses when it
    names another backend or when a default pool already exists on another backend. open_now
    False leaves the runtime alone until the first allocation (for a framework that initialises
    it itself, with its own configuration)."""
    chosen = os.environ.get(BACKEND_ENV, "").strip()
    if chosen and chosen != kind:
        raise ConfigError(f"{why} needs the {kind} backend, but ${BACKEND_ENV}={chosen!r}")
    for device in range(64):
        name = _core.capi_default_backend(device)
        if name is not None and name != kind:
            raise ConfigError(f"{why} needs the {kind} backend, but device {device}'s default pool already "
                              f"runs on {name!r}; call install() before allocating with ascend_pool")
    backend = _backend.open_backend(kind) if open_now else None  # fails now, with the runtime's words
    os.environ[BACKEND_ENV] = kind
    return backend


def set_hooks(allocator, hooks):
    """Hands the C ABI's optional hooks to a pluggable allocator object: for each (setter, symbol)
    whose setter the framework offers, setter(address of symbol). Returns the symbols handed over."""
    done = []
    for setter, symbol in hooks:
        fn = getattr(allocator, setter, None)
        if fn is not None:
            fn(symbol_address(symbol))
            done.append(symbol)
    return done


def say_caching_stays(variable):
    """The framework's switch that turns its own caching allocator off (torch_npu's
    PYTORCH_NO_NPU_MEMORY_CACHING, PyTorch's PYTORCH_NO_CUDA_MEMORY_CACHING) set to a true value
    means nothing once ascend_pool replaces that allocator: said in the log at install(), instead of a
    user debugging with it believing every free went back to the device. Returns whether it was."""
    value = os.environ.get(variable, "").strip()
    if value.lower() in ("", "0", "false", "off", "no"):
        return False
    logging.getLogger("ascend_pool").warning(
        "%s=%s turns off the framework's own caching allocator, which ascend_pool replaces: ascend_pool "
        "still caches freed blocks (ascend_pool.empty_cache() gives them back to the device)", variable, value)
    return True

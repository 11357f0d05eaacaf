"""What the integrations share: importing a framework with a clear failure, the C ABI's symbol
addresses as frameworks resolve them, and choosing the backend a framework's memory needs."""

import ctypes
import importlib
import os

from .. import _core
from .. import backend as _backend
from ..backend import BACKEND_ENV
from ..capi import library_path
from ..errors import ConfigError


class FrameworkMissingError(ImportError):
    """The framework an integration plugs into is not installed (or not usable) here."""


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

"""The C ABI: where it lives, and how to reach it from Python.

    import ascend_pool
    path = ascend_pool.library_path()        # hand this to torch / ctypes / dlopen
    ascend_pool.capi.header_path()           # ascend_pool.h, the declarations for C users

The exported symbols (ascend_pool_malloc, ascend_pool_free, ascend_pool_init, ascend_pool_reset,
ascend_pool_set_memory_fraction, ascend_pool_base_alloc, ascend_pool_record_stream,
ascend_pool_erase_stream, ascend_pool_empty_cache, ascend_pool_last_error[_code], ascend_pool_clear_last_error) live in the
package's compiled extension, so the process must have imported ascend_pool before a framework
calls them: the first allocation on a device creates its default pool through Python. See
ascend_pool/include/ascend_pool.h for each call's exact rules.
"""

import os

from . import _core

__all__ = ["library_path", "header_path", "include_dir", "SYMBOLS"]

# Every symbol the C ABI exports (the names frameworks dlsym).
SYMBOLS = (
    "ascend_pool_malloc",
    "ascend_pool_free",
    "ascend_pool_init",
    "ascend_pool_reset",
    "ascend_pool_set_memory_fraction",
    "ascend_pool_base_alloc",
    "ascend_pool_record_stream",
    "ascend_pool_erase_stream",
    "ascend_pool_empty_cache",
    "ascend_pool_last_error_code",
    "ascend_pool_last_error",
    "ascend_pool_clear_last_error",
)


def library_path():
    """Absolute path of the shared object exporting the C ABI (the ascend_pool._core extension)."""
    return os.path.abspath(_core.__file__)


def include_dir():
    """The directory holding ascend_pool.h (for -I)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")


def header_path():
    """Path of ascend_pool.h, the C declarations of the exported symbols."""
    return os.path.join(include_dir(), "ascend_pool.h")

"""Python control of the simulated Ascend NPU.

The simulator is a C library, ``ascend_pool/_sim/libascendcl.so``, that exports the ACL runtime
API; the pool's acl backend ``dlopen()``s it exactly as it would the real ``libascendcl.so``. This
module opens the *same file* with ctypes, and since ``dlopen`` of one file returns one handle, it
drives the very runtime state the pool uses: it can put work on the pool's streams, read the
memory the pool handed out, and inject faults under the pool's feet.

Units: sizes and addresses are in bytes (ints), delays in seconds (floats), latencies in
microseconds, streams are the runtime's handles as ints (``0``/``None`` is the calling thread's
current device's default stream). Every failure raises :class:`SimError` (an
``ascend_pool.PoolError``) carrying the ACL error code and the runtime's message; a bad argument,
refused before the call, is a :class:`SimArgumentError` (also a ``ValueError``; a
:class:`SimTypeError`, also a ``TypeError``, for a value of the wrong type) with code 100000.

Most calls need an initialised runtime (``aclInit``, done by the pool, or by a test through
ctypes); ``configure`` needs the opposite. Functions that take ``stream=None`` use the default
stream of the calling thread's current device (``aclrtSetDevice``), as the runtime does.

This module must not import ``ascend_pool._core``: it is usable before and without the pool.
"""
from __future__ import annotations

import ctypes
import os
import threading

from .errors import PoolError
from .units import as_index

__all__ = [
    "SimError",
    "SimArgumentError",
    "SimTypeError",
    "library_path",
    "attach",
    "parse_size",
    "launch_fill",
    "read",
    "hang_stream",
    "release_stream",
    "set_faults",
    "reset_faults",
    "set_poison",
    "configure",
    "stats",
    "profile",
]

_HERE = os.path.dirname(os.path.abspath(__file__))
_lib = None
_lock = threading.RLock()


def _after_fork_in_child():
    # held across a dlopen by attach(): a fork meanwhile must not leave the child's copy locked
    global _lock
    _lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class SimError(PoolError):
    """A simulator call failed. ``code`` is the ACL error code (e.g. 207001 out of memory,
    107000 invalid handle or address, 100001 runtime not initialised). A PoolError, as every
    error of the package (CONTRACT.md)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code

    def __reduce__(self):
        # the two-argument constructor across pickling (multiprocessing), as DeviceError's
        return (type(self), (self.code, str(self)))


class SimArgumentError(SimError, ValueError):
    """An argument of a simulator control call refused before the runtime is called (code 100000,
    ACL_ERROR_INVALID_PARAM); the message names the argument."""

    def __init__(self, message: str):
        super().__init__(100000, message)

    def __reduce__(self):
        return (type(self), (str(self),))


class SimTypeError(SimArgumentError, TypeError):
    """An argument of the wrong type (a bool or a float where bytes are expected)."""


def library_path(legacy: bool = False) -> str:
    """Absolute path of the simulator library. ``legacy=True``: the build standing for an old
    CANN, without ``aclrtMallocAlign32`` and ``aclrtQueryEventStatus``."""
    parts = ("_sim", "legacy", "libascendcl.so") if legacy else ("_sim", "libascendcl.so")
    return os.path.join(_HERE, *parts)


_C = ctypes
_PROTOS = {
    "aclGetRecentErrMsg": (_C.c_char_p, []),
    "ascendsim_launch_fill": (_C.c_int, [_C.c_void_p, _C.c_void_p, _C.c_size_t, _C.c_int, _C.c_uint64]),
    "ascendsim_read": (_C.c_int, [_C.c_void_p, _C.c_void_p, _C.c_size_t]),
    "ascendsim_hang_stream": (_C.c_int, [_C.c_void_p]),
    "ascendsim_release_stream": (_C.c_int, [_C.c_void_p]),
    "ascendsim_set_fail_malloc_nth": (_C.c_int, [_C.c_uint64]),
    "ascendsim_set_fail_event_create_nth": (_C.c_int, [_C.c_uint64]),
    "ascendsim_set_fail_event_query_nth": (_C.c_int, [_C.c_uint64]),
    "ascendsim_set_fail_after_bytes": (_C.c_int, [_C.c_int64]),
    "ascendsim_set_malloc_latency_us": (_C.c_int, [_C.c_uint64]),
    "ascendsim_set_free_latency_us": (_C.c_int, [_C.c_uint64]),
    "ascendsim_reset_faults": (_C.c_int, []),
    "ascendsim_set_poison": (_C.c_int, [_C.c_int]),
    "ascendsim_configure": (_C.c_int, [_C.c_int32, _C.c_uint64]),
    "ascendsim_parse_size": (_C.c_int, [_C.c_char_p, _C.POINTER(_C.c_uint64)]),
    "ascendsim_get_stats": (_C.c_int, [_C.c_int32, _C.POINTER(_C.c_uint64), _C.c_uint32]),
    "ascendsim_stats_fields": (_C.c_char_p, []),
    "ascendsim_profile": (_C.c_char_p, []),
}


def attach(path: str | None = None) -> ctypes.CDLL:
    """Makes this module drive the simulator library at ``path`` (default: ``library_path()``),
    e.g. ``attach(library_path(legacy=True))`` when the pool was opened on the legacy build.
    Returns the ctypes handle (which tests may also use for the ACL calls themselves)."""
    global _lib
    path = path or library_path()
    if not os.path.exists(path):
        raise SimError(100003, f"simulator library {path} does not exist: build the package "
                               "(pip install . or python setup.py build_ext --inplace)")
    with _lock:
        lib = ctypes.CDLL(path)
        for name, (restype, argtypes) in _PROTOS.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        _lib = lib
    return lib


def _l() -> ctypes.CDLL:
    return _lib if _lib is not None else attach()


def _check(rc: int, what: str) -> None:
    if rc:
        msg = _l().aclGetRecentErrMsg()
        raise SimError(rc, msg.decode(errors="replace") if msg else f"{what} failed (aclError {rc})")


def _int(value, what: str, lo: int = 0, hi: int = 2 ** 63 - 1) -> int:
    """value as an int in [lo, hi] (numpy integers too), else SimArgumentError (a ValueError) naming it: a float, a bool,
    a string or an int that does not fit the C argument never reaches ctypes (whose errors name
    the argument by position only) or wraps."""
    v = as_index(value)
    if v is None:
        raise SimArgumentError(f"{what}={value!r} is not an int")
    if not lo <= v <= hi:
        raise SimArgumentError(f"{what}={v} is out of range ({lo}..{hi})")
    return v


def _stream(stream) -> int | None:
    return None if stream is None or stream == 0 else _int(stream, "stream", 1, 2 ** 64 - 1)


def parse_size(value: int | str) -> int:
    """Bytes from an int or a size text: ``"64GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"4096"``.
    KiB/MiB/GiB/TiB (and bare K/M/G/T) are powers of 1024, KB/MB/GB/TB powers of 1000; fractions
    round down to whole bytes. The grammar is the C simulator's own (ASCEND_SIM_HBM uses it), so
    Python and the environment always agree. Raises SimError (100000) on a malformed text."""
    if isinstance(value, bool):
        raise SimTypeError("a size must be an int or a str, not bool")
    if isinstance(value, int):
        if value < 0:
            raise SimError(100000, f"size {value} is negative")
        return value
    if not isinstance(value, str):
        raise SimTypeError(f"a size must be an int or a str, not {type(value).__name__}")
    out = ctypes.c_uint64()
    _check(_l().ascendsim_parse_size(value.encode(), ctypes.byref(out)), "ascendsim_parse_size")
    return out.value


def launch_fill(stream, ptr: int, nbytes: int, value: int, delay_s: float = 0.0) -> None:
    """Enqueues on ``stream`` a wait of ``delay_s`` seconds, then a memset of ``nbytes`` bytes at
    device address ``ptr`` to ``value`` (0..255). Returns at once; the stream's worker does the
    work. ``[ptr, ptr+nbytes)`` must lie in one live device allocation, or in one virtual-memory
    reservation with every page of it mapped (SimError 107000 otherwise); if it is freed or
    unmapped before the fill runs, the fill is dropped and counted in
    ``stats()["dropped_fills"]``."""
    if as_index(value) is None or not 0 <= value <= 255:
        raise SimArgumentError(f"fill value {value!r} is not a byte (0..255)")
    if isinstance(delay_s, bool) or not isinstance(delay_s, (int, float)) or not 0 <= delay_s <= 3600:
        raise SimArgumentError(f"delay_s={delay_s!r} is not a number of seconds from 0 to 3600")
    rc = _l().ascendsim_launch_fill(_stream(stream), _int(ptr, "ptr", 1, 2 ** 64 - 1), _int(nbytes, "nbytes"), value,
                                    round(delay_s * 1e6))
    _check(rc, "ascendsim_launch_fill")


def read(ptr: int, nbytes: int) -> bytes:
    """Copies ``nbytes`` bytes of device memory at ``ptr`` to the host, now: it does not wait for
    streams (synchronize first to see their effect). ``[ptr, ptr+nbytes)`` must lie in one live
    device allocation or mapped virtual-memory range, else SimError 107000 (a bad or unmapped
    address is refused, never dereferenced)."""
    ptr, nbytes = _int(ptr, "ptr", 1, 2 ** 64 - 1), _int(nbytes, "nbytes", 0, 1 << 40)
    buf = ctypes.create_string_buffer(max(nbytes, 1))
    _check(_l().ascendsim_read(ptr, buf, nbytes), "ascendsim_read")
    return buf.raw[:nbytes]


def hang_stream(stream) -> None:
    """Enqueues on ``stream`` an item that stops its worker until ``release_stream(stream)``:
    work after it, events recorded after it, and synchronizations wait (for timeout tests)."""
    _check(_l().ascendsim_hang_stream(_stream(stream)), "ascendsim_hang_stream")


def release_stream(stream) -> None:
    """Releases every hang enqueued on ``stream`` so far; the stream then proceeds."""
    _check(_l().ascendsim_release_stream(_stream(stream)), "ascendsim_release_stream")


def set_faults(fail_malloc_nth: int | None = None, fail_after_bytes: int | str | None = None,
               malloc_latency_us: int | None = None, free_latency_us: int | None = None,
               fail_event_create_nth: int | None = None,
               fail_event_query_nth: int | None = None) -> None:
    """Arms fault injection; arguments left at None keep their current setting.

    - ``fail_malloc_nth=N``: the Nth device malloc (aclrtMalloc[Align32] or aclrtMallocPhysical)
      from now fails once with 207001 (0 disarms).
    - ``fail_after_bytes=B`` (bytes, int or size text): a device malloc that would take this
      process's held device bytes (rounded sizes, all devices, physical memory included) above B
      fails with 207001; a negative int disarms.
    - ``malloc_latency_us`` / ``free_latency_us``: microseconds added to every aclrtMalloc /
      aclrtFree (and aclrtMallocPhysical / aclrtFreePhysical) (0: none).
    - ``fail_event_create_nth=N``: the Nth event creation from now fails once with 207007.
    - ``fail_event_query_nth=N``: the Nth event query from now fails once with 107000.
    """
    lib = _l()
    if fail_malloc_nth is not None:
        _check(lib.ascendsim_set_fail_malloc_nth(_count(fail_malloc_nth)), "set_fail_malloc_nth")
    if fail_after_bytes is not None:
        b = fail_after_bytes if isinstance(fail_after_bytes, int) and fail_after_bytes < 0 \
            else parse_size(fail_after_bytes)
        _check(lib.ascendsim_set_fail_after_bytes(b), "set_fail_after_bytes")
    if malloc_latency_us is not None:
        _check(lib.ascendsim_set_malloc_latency_us(_count(malloc_latency_us)), "set_malloc_latency_us")
    if free_latency_us is not None:
        _check(lib.ascendsim_set_free_latency_us(_count(free_latency_us)), "set_free_latency_us")
    if fail_event_create_nth is not None:
        _check(lib.ascendsim_set_fail_event_create_nth(_count(fail_event_create_nth)),
               "set_fail_event_create_nth")
    if fail_event_query_nth is not None:
        _check(lib.ascendsim_set_fail_event_query_nth(_count(fail_event_query_nth)),
               "set_fail_event_query_nth")


def _count(v: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise SimArgumentError(f"{v!r} is not a non-negative int")
    return v


def reset_faults() -> None:
    """Disarms every fault and latency, including those set through ASCEND_SIM_* variables."""
    _check(_l().ascendsim_reset_faults(), "ascendsim_reset_faults")


def set_poison(on: bool = True) -> None:
    """When on, aclrtFree fills freed device memory with 0xDD before unmapping it."""
    _check(_l().ascendsim_set_poison(1 if on else 0), "ascendsim_set_poison")


def configure(devices: int | None = None, hbm: int | str | None = None) -> None:
    """Sets the device count and the HBM bytes per device (int, or a size text such as "16GiB")
    for the next aclInit, overriding ASCEND_SIM_DEVICES / ASCEND_SIM_HBM; None means "from the
    environment, else the default" (8 devices x 64 GiB). Raises SimError (100002) once the
    runtime is initialised: the device layout cannot change under a running pool."""
    d = 0 if devices is None else devices
    if isinstance(d, bool) or not isinstance(d, int) or d < 0:
        raise SimArgumentError(f"devices={devices!r} is not a positive int")
    h = 0 if hbm is None else parse_size(hbm)
    _check(_l().ascendsim_configure(d, h), "ascendsim_configure")


def stats(device: int = 0) -> dict:
    """Counters of one device, as a dict of ints:

    - ``mallocs``, ``frees``: successful device mallocs/frees (aclrtMalloc) by this process;
    - ``bytes_held``: device bytes this process holds (rounded sizes; physical memory included);
    - ``node_bytes_used``: bytes held on the device by every live process of the simulated node;
    - ``total_bytes``: the device's HBM;
    - ``live_events``, ``events_created``: events alive now / ever created by this process;
    - ``live_streams``: streams alive now (the default stream counts once it is created);
    - ``dropped_fills``: fills whose memory was freed before they ran;
    - ``poisoned_bytes``: bytes filled with 0xDD by aclrtFree while ``set_poison`` was on;
    - ``phys_mallocs``, ``phys_frees``: successful aclrtMallocPhysical / physical frees;
    - ``phys_bytes``: physical memory this process holds on the device (rounded up to the
      granularity; also counted in ``bytes_held``);
    - ``maps``, ``unmaps``: successful aclrtMapMem / aclrtUnmapMem;
    - ``mapped_bytes``: bytes mapped now (a handle mapped twice counts twice);
    - ``device_refs``: the device's reference count, process-wide: aclrtSetDevice calls minus
      aclrtResetDevice calls (each open pool holds one; docs/cann-rules.md R2);
    - ``event_queries``: queries of the device's events (aclrtQueryEventStatus, aclrtQueryEvent)
      by this process, failed ones included.

    Fields are only ever appended, so positions of existing ones never change.
    """
    lib = _l()
    names = lib.ascendsim_stats_fields().decode().split(",")
    out = (ctypes.c_uint64 * len(names))()
    _check(lib.ascendsim_get_stats(_int(device, "device", 0, 2 ** 31 - 1), out, len(names)), "ascendsim_get_stats")
    return dict(zip(names, out))


def profile() -> str:
    """The active ``ASCEND_SIM_PROFILE`` (``strict``, ``cann8.0``, ``cann8.2``, ``cann8.3``, ``310p`` or
    ``950``: the CANN rules the simulator enforces, docs/cann-rules.md), read at aclInit."""
    name = _l().ascendsim_profile()
    if name is None:
        raise SimError(100001, "ascendsim_profile: the runtime is not initialised: call aclInit first")
    return name.decode()

"""The exceptions ascend_pool raises.

Every error the package raises on purpose is a :class:`PoolError`, so ``except PoolError`` catches
them all. Each class also derives from the built-in exception a caller would naturally expect
(``MemoryError`` and ``RuntimeError`` for out-of-memory, ``ValueError`` for bad arguments, ``TimeoutError`` for timeouts,
``RuntimeError`` for device failures), so code written against plain Python keeps working.
"""

__all__ = [
    "PoolError",
    "DeviceError",
    "BackendUnavailableError",
    "DeviceTimeoutError",
    "OutOfMemoryError",
    "QuotaExceededError",
    "InvalidSizeError",
    "InvalidPointerError",
    "InvalidStreamError",
    "InvalidDeviceError",
    "ConfigError",
    "ConfigTypeError",
    "LedgerError",
    "STATUS_NAMES",
    "STATUS_ERRORS",
    "from_code",
]


class PoolError(Exception):
    """Base class of every error raised by ascend_pool."""


class DeviceError(PoolError, RuntimeError):
    """A device runtime call failed (aclrtMalloc, aclrtRecordEvent, cudaEventQuery, ...).

    ``code`` is the runtime's own error code (an ``aclError`` such as 207001 for the acl and sim
    backends, a ``cudaError_t`` for cuda) or one of the backend's own codes 990001-990004 for
    failures before the runtime is reached. ``message`` is the readable text, including the
    runtime's recent error message when it gives one.
    """

    def __init__(self, code, message):
        super().__init__(code, message)
        self.code = int(code)
        self.message = str(message)

    def __str__(self):
        return self.message

    def __reduce__(self):
        # Keeps the two-argument constructor working across pickling (multiprocessing).
        return (type(self), (self.code, self.message))


class BackendUnavailableError(DeviceError):
    """A device backend could not be opened: its library did not load (``dlopen`` failed; code
    990001), a required symbol is missing (990002), the runtime reports no device (990003), or the
    runtime's initialisation failed (its own code). The message names the library path(s) tried.

    Code 990004: this process was forked after its parent had opened a device runtime, which no
    runtime supports (CANN, CUDA; the simulator alike). Every use of a backend or pool in the
    child raises it; start worker processes with ``multiprocessing.get_context("spawn")``.
    """


class DeviceTimeoutError(DeviceError, TimeoutError):
    """A host wait on an event or a stream passed its timeout (acl: 507047 for events, 507046 for
    streams; cuda: 600, cudaErrorNotReady). The work is still queued; waiting again is allowed."""


class OutOfMemoryError(PoolError, MemoryError, RuntimeError):
    """A request could not be served: the device has no memory left even after the pool released
    its cached blocks and retried. The message says how much is reserved but unallocated. A
    MemoryError, as CuPy's, and a RuntimeError, as torch's torch.OutOfMemoryError, so that code
    written for either catches it."""


class QuotaExceededError(OutOfMemoryError):
    """A tenant's byte quota (per device, node-wide) would be exceeded, even after trimming the
    tenant's own cache. Other tenants are unaffected."""


class InvalidSizeError(PoolError, ValueError):
    """A size in bytes is zero, negative, or larger than any device could hold."""


class InvalidPointerError(PoolError, ValueError):
    """A pointer passed to free/record_stream was not allocated by this pool or was already freed."""


class InvalidStreamError(PoolError, ValueError):
    """A stream handle is not a stream of this backend or belongs to another device."""


class StreamTypeError(InvalidStreamError, TypeError):
    """A stream argument is of the wrong type (not a handle or a stream object): a TypeError as
    torch's caching_allocator_alloc raises, still an InvalidStreamError."""


class InvalidDeviceError(PoolError, ValueError):
    """A device index is negative or not below the backend's device count."""


class ConfigError(PoolError, ValueError):
    """A configuration value (environment variable, TOML file, knob string or argument) is invalid.
    The message names the setting and the value."""


class ConfigTypeError(ConfigError, TypeError):
    """A configuration argument has the wrong type (a str or int where a float is required, as
    torch raises TypeError for them); still a ConfigError."""


class LedgerError(PoolError, OSError):
    """(Defined here, below the compiled core that raises it; ascend_pool.tenants re-exports it.)
    The node-wide quota ledger (a file under /dev/shm or $ASCEND_POOL_LEDGER_DIR) cannot be
    used: it is foreign (another owner or group, wrong permissions, a symbolic link), malformed
    (bad magic, version, layout or contents), full, or its lock is held by a wedged process.
    ``kind`` is one of "permission", "malformed", "full", "lock", "io", "argument". The ledger is
    never repaired or trusted in these cases; the message names the file and the reason."""

    def __init__(self, message, kind="io"):
        super().__init__(message)
        self.kind = kind

    def __str__(self):
        return self.args[0]

    def __reduce__(self):
        return (type(self), (self.args[0], self.kind))


# ---- the one map from status codes to exceptions ------------------------------------------------
# The pool's statuses (cython/core/pool.h, AP_*) and the C ABI's last-error codes
# (ascend_pool/include/ascend_pool.h, ASCEND_POOL_E_*) are the same numbers (capi/last_error.h
# asserts it); the C ABI adds 100-102. Both Cython faces (core/pool.pxi, capi/capi.pxi) turn a
# code into an exception through from_code, so a new code is added here once.

STATUS_NAMES = {
    0: "OK", 1: "OOM", 2: "LIMIT", 3: "INVALID_SIZE", 4: "INVALID_PTR", 5: "INVALID_STREAM", 6: "DEVICE",
    7: "TIMEOUT", 8: "HOST_NOMEM", 10: "QUOTA", 100: "INVALID_DEVICE", 101: "NOT_READY", 102: "INVALID_ARG",
}
"""Code -> the name after ASCEND_POOL_E_ (AP_E_ in the pool); 9 (AP_E_BUSY) never leaves the pool."""

STATUS_ERRORS = {
    1: OutOfMemoryError,       # OOM: device exhausted after trim + retry
    2: OutOfMemoryError,       # LIMIT: the pool's byte limit (memory fraction)
    3: InvalidSizeError,
    4: InvalidPointerError,
    5: InvalidStreamError,
    6: DeviceError,            # takes (runtime code, message)
    7: DeviceTimeoutError,     # takes (runtime code, message)
    8: MemoryError,            # host memory for bookkeeping: not the device's
    10: QuotaExceededError,
    100: InvalidDeviceError,
}
"""Code -> exception class; a code not listed (NOT_READY, INVALID_ARG, unknown) raises PoolError."""


def from_code(code, message, device_code=None):
    """The exception (not raised) for a failed call that returned status `code` (int) with
    `message` (str). device_code: the runtime's own error code for DEVICE and TIMEOUT (default:
    `code`, which is all the C ABI's last error carries)."""
    cls = STATUS_ERRORS.get(code)
    if cls is None:
        return PoolError(f"call failed with status {code} ({STATUS_NAMES.get(code, 'unknown')}): {message}")
    if issubclass(cls, DeviceError):
        return cls(code if device_code is None else device_code, message)
    return cls(message)

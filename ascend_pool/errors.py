"""The exceptions ascend_pool raises.

Every error the package raises on purpose is a :class:`PoolError`, so ``except PoolError`` catches
them all. Each class also derives from the built-in exception a caller would naturally expect
(``MemoryError`` for out-of-memory, ``ValueError`` for bad arguments, ``TimeoutError`` for timeouts,
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


class OutOfMemoryError(PoolError, MemoryError):
    """A request could not be served: the device has no memory left even after the pool released
    its cached blocks and retried. The message says how much is reserved but unallocated."""


class QuotaExceededError(OutOfMemoryError):
    """A tenant's byte quota (per device, node-wide) would be exceeded, even after trimming the
    tenant's own cache. Other tenants are unaffected."""


class InvalidSizeError(PoolError, ValueError):
    """A size in bytes is zero, negative, or larger than any device could hold."""


class InvalidPointerError(PoolError, ValueError):
    """A pointer passed to free/record_stream was not allocated by this pool or was already freed."""


class InvalidStreamError(PoolError, ValueError):
    """A stream handle is not a stream of this backend or belongs to another device."""


class InvalidDeviceError(PoolError, ValueError):
    """A device index is negative or not below the backend's device count."""


class ConfigError(PoolError, ValueError):
    """A configuration value (environment variable, TOML file, knob string or argument) is invalid.
    The message names the setting and the value."""

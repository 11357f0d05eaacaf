# The one map from a C status to a Python exception. Every .pxi that turns a failed C call into an
# exception goes through _c_error: the pool (pool.pxi's _raise), the C ABI's last error (capi.pxi),
# the host pool and the sharing calls. Keyed by the pool's statuses (AP_E_* in core/pool.h); the C
# ABI's last-error codes are the same numbers (capi/last_error.h asserts it at compile time) plus
# three of its own (ascend_pool.h). tests/test_name_tables.py checks the names against the headers.

from ascend_pool.errors import (OutOfMemoryError, QuotaExceededError, InvalidSizeError, InvalidPointerError,
                                InvalidStreamError, InvalidDeviceError, DeviceError, DeviceTimeoutError, PoolError)

cdef extern from "pool.h" nogil:
    enum:
        AP_OK, AP_E_OOM, AP_E_LIMIT, AP_E_INVALID_SIZE, AP_E_INVALID_PTR, AP_E_INVALID_STREAM,
        AP_E_DEVICE, AP_E_TIMEOUT, AP_E_HOST_NOMEM, AP_E_BUSY, AP_E_QUOTA

cdef extern from "ascend_pool.h" nogil:
    int ASCEND_POOL_OK, ASCEND_POOL_E_INVALID_DEVICE, ASCEND_POOL_E_NOT_READY, ASCEND_POOL_E_INVALID_ARG

# status -> (public name: ASCEND_POOL_E_<name> in ascend_pool.h, exception type or None for a plain
# PoolError, whether the type takes the runtime's error code first). AP_E_BUSY is internal (the
# GIL-held fast path's "take the slow path") and never reaches a caller: it has no public name.
_C_ERRORS = {
    AP_OK: ("OK", None, False),
    AP_E_OOM: ("OOM", OutOfMemoryError, False),
    AP_E_LIMIT: ("LIMIT", OutOfMemoryError, False),
    AP_E_INVALID_SIZE: ("INVALID_SIZE", InvalidSizeError, False),
    AP_E_INVALID_PTR: ("INVALID_PTR", InvalidPointerError, False),
    AP_E_INVALID_STREAM: ("INVALID_STREAM", InvalidStreamError, False),
    AP_E_DEVICE: ("DEVICE", DeviceError, True),
    AP_E_TIMEOUT: ("TIMEOUT", DeviceTimeoutError, True),
    AP_E_HOST_NOMEM: ("HOST_NOMEM", MemoryError, False),
    AP_E_QUOTA: ("QUOTA", QuotaExceededError, False),
    ASCEND_POOL_E_INVALID_DEVICE: ("INVALID_DEVICE", InvalidDeviceError, False),
    ASCEND_POOL_E_NOT_READY: ("NOT_READY", None, False),
    ASCEND_POOL_E_INVALID_ARG: ("INVALID_ARG", None, False),
}

# Public names of the C ABI's last-error codes, for Python callers of the C ABI.
CAPI_ERRORS = {code: name for code, (name, _, _) in _C_ERRORS.items()}


cdef object _c_error(int status, int device_code, str msg, str call):
    """The typed exception (not raised) for a C call (`call`, named in a generic error) that failed
    with status; device_code is the runtime's error code where the status is a device failure."""
    name, exc_type, with_code = _C_ERRORS.get(status, (str(status), None, False))
    if exc_type is None:
        return PoolError(f"{call} failed ({name}): {msg}")
    return exc_type(device_code, msg) if with_code else exc_type(msg)

# The one way from a C status to a Python exception. Every .pxi that turns a failed C call into an
# exception goes through _c_error: the pool (pool.pxi's _raise), the C ABI's last error (capi.pxi),
# the host pool and the sharing calls. Keyed by the pool's statuses (AP_E_* in core/pool.h); the C
# ABI's last-error codes are the same numbers (capi/last_error.h asserts it at compile time) plus
# three of its own (ascend_pool.h). tests/test_name_tables.py checks the names against the headers.

from ascend_pool.errors import PoolError, STATUS_ERRORS, STATUS_NAMES, from_code

cdef extern from "pool.h" nogil:
    enum:
        AP_OK, AP_E_OOM, AP_E_LIMIT, AP_E_INVALID_SIZE, AP_E_INVALID_PTR, AP_E_INVALID_STREAM,
        AP_E_DEVICE, AP_E_TIMEOUT, AP_E_HOST_NOMEM, AP_E_BUSY, AP_E_QUOTA

cdef extern from "ascend_pool.h" nogil:
    int ASCEND_POOL_OK, ASCEND_POOL_E_INVALID_DEVICE, ASCEND_POOL_E_NOT_READY, ASCEND_POOL_E_INVALID_ARG

# The table itself is Python's (ascend_pool/errors.py: STATUS_NAMES, STATUS_ERRORS, from_code), so
# Python callers of the C ABI and these Cython faces read one map. Here the header values are
# checked against it once, at import: a renumbered enum fails loudly instead of mapping wrongly.
_HEADER_NAMES = ((AP_OK, "OK"), (AP_E_OOM, "OOM"), (AP_E_LIMIT, "LIMIT"), (AP_E_INVALID_SIZE, "INVALID_SIZE"),
                 (AP_E_INVALID_PTR, "INVALID_PTR"), (AP_E_INVALID_STREAM, "INVALID_STREAM"),
                 (AP_E_DEVICE, "DEVICE"), (AP_E_TIMEOUT, "TIMEOUT"), (AP_E_HOST_NOMEM, "HOST_NOMEM"),
                 (AP_E_QUOTA, "QUOTA"), (ASCEND_POOL_E_INVALID_DEVICE, "INVALID_DEVICE"),
                 (ASCEND_POOL_E_NOT_READY, "NOT_READY"), (ASCEND_POOL_E_INVALID_ARG, "INVALID_ARG"))
_renumbered = [name for code, name in _HEADER_NAMES if STATUS_NAMES.get(code) != name]
# AP_E_BUSY is internal (the GIL-held fast path's "take the slow path"): it must have no public name.
_renumbered += ["BUSY"] * (AP_E_BUSY in STATUS_NAMES)
if _renumbered:
    raise ImportError(f"ascend_pool.errors.STATUS_NAMES disagrees with the C headers on {_renumbered}")

# Public names of the C ABI's last-error codes, for Python callers of the C ABI.
CAPI_ERRORS = dict(STATUS_NAMES)


cdef object _c_error(int status, int device_code, str msg, str call):
    """The typed exception (not raised) for a C call (`call`, named in a generic error) that failed
    with status; device_code is the runtime's error code where the status is a device failure."""
    if status not in STATUS_ERRORS:
        return PoolError(f"{call} failed ({STATUS_NAMES.get(status, str(status))}): {msg}")
    return from_code(status, msg, device_code)

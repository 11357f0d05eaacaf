# numpy's memory handler (NEP 49) backed by a HostPool (C functions in capi/numpy_handler.h).
#
# Installing needs PyDataMem_SetHandler from numpy's C API table. The extension is built without
# numpy's headers, so the table is taken from numpy's own capsule (_ARRAY_API) and the two entries
# used are called by their slot numbers, which numpy keeps stable across 1.22 - 2.x:
# 211 PyArray_GetNDArrayCFeatureVersion, 304 PyDataMem_SetHandler.

from cpython.pycapsule cimport PyCapsule_New, PyCapsule_GetPointer, PyCapsule_IsValid
from cpython.ref cimport PyObject, Py_DECREF

cdef extern from "capi/numpy_handler.h" nogil:
    ctypedef struct apnp_handler:
        pass
    const char *APNP_HANDLER_NAME
    apnp_handler *apnp_handler_for(ap_host_pool *hp)

ctypedef unsigned int (*_np_feature_version_fn)() noexcept
ctypedef PyObject *(*_np_set_handler_fn)(PyObject *handler) noexcept

NUMPY_HANDLER_NAME = APNP_HANDLER_NAME.decode()
cdef unsigned int _NPY_1_22_API_VERSION = 0x0f
cdef int _SLOT_FEATURE_VERSION = 211
cdef int _SLOT_SET_HANDLER = 304


def numpy_handler_capsule(HostPool pool not None):
    """A "mem_handler" capsule of the process's numpy handler, bound to pool. The handler is bound
    to the first pool it is asked for, for the life of the process (arrays free through it)."""
    pool._check()
    cdef apnp_handler *h = apnp_handler_for(pool.hp)
    if h == NULL:
        raise PoolError("the numpy handler is already bound to another host pool")
    return PyCapsule_New(<void *>h, "mem_handler", NULL)


def numpy_set_handler(api_capsule, handler):
    """Calls numpy's PyDataMem_SetHandler(handler) (None: numpy's default handler) through the C
    API table in api_capsule (numpy's _multiarray_umath._ARRAY_API). Applies to the calling
    context only (numpy keeps the handler in a context variable). Returns the previous handler."""
    cdef void **api = <void **>PyCapsule_GetPointer(api_capsule, NULL)
    cdef unsigned int version = (<_np_feature_version_fn>api[_SLOT_FEATURE_VERSION])()
    if version < _NPY_1_22_API_VERSION:
        raise PoolError(f"this numpy (C API feature version {version:#x}) predates memory handlers "
                        "(NEP 49, numpy 1.22)")
    # numpy takes a "mem_handler" capsule only, and refuses anything else with its own exception
    # set: checked here, so that a caller's mistake is one typed error, never a SystemError.
    if handler is not None and not PyCapsule_IsValid(handler, "mem_handler"):
        raise ConfigError(f"a numpy memory handler must be None or a 'mem_handler' capsule (what install() "
                          f"returned), got {handler!r}")
    cdef PyObject *arg = NULL if handler is None else <PyObject *>handler
    cdef PyObject *previous = (<_np_set_handler_fn>api[_SLOT_SET_HANDLER])(arg)
    if previous == NULL:
        raise PoolError("numpy refused the memory handler (PyDataMem_SetHandler failed)")
    result = <object>previous
    Py_DECREF(result)  # the cast took its own reference; drop the one SetHandler gave us
    return result

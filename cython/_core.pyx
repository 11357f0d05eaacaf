# cython: language_level=3
"""The compiled core of ascend_pool: device backends, the caching pool and the C ABI.

One extension module so that the pool's state, the backend table and the exported C symbols live
in one shared object (the file `ascend_pool.library_path()` returns). Each concept is its own
include file, in data-path order.
from libc.string cimport memset
"""
include "core/errors.pxi"
include "backend/fork.pxi"
include "backend/backend.pxi"
include "core/pool.pxi"
include "core/current.pxi"
include "core/share.pxi"
include "quota/quota.pxi"
include "capi/capi.pxi"
include "bench/floor.pxi"

"""Drop-in integrations: make a framework allocate through ascend_pool, each in one call.

    from ascend_pool.integrations import torch_npu, torch_cuda, cupy, numpy
    torch_npu.install()    # torch_npu tensors: NPUPluggableAllocator over the C ABI (acl backend)
    torch_cuda.install()   # PyTorch CUDA tensors: CUDAPluggableAllocator over the C ABI (cuda backend)
    cupy.install()         # CuPy arrays: cupy.cuda.set_allocator, memory returned when CuPy drops it
    numpy.install()        # numpy arrays' data in the pinned host pool (NEP 49), this context only

Each module imports its framework only when install() runs, and raises FrameworkMissingError (an
ImportError and an ascend_pool.PoolError) that names the package to install when the framework is not there. See
docs/integrations.md.
"""

from ._common import FrameworkMissingError

__all__ = ["FrameworkMissingError"]

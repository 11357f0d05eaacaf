"""PyTorch on NVIDIA GPUs: CUDA tensors allocated by ascend_pool's pool on its cuda backend.

    import torch
    import ascend_pool.integrations.torch_cuda as ap_cuda
    ap_cuda.install()                             # before the first CUDA tensor
    x = torch.empty(1 << 20, device="cuda")

install() selects the cuda backend for the C ABI's default pools ($ASCEND_POOL_BACKEND=cuda), builds
torch.cuda.memory.CUDAPluggableAllocator("libascend_pool_torch.so", "ascend_pool_torch_malloc",
"ascend_pool_torch_free") (the C ABI's pair, except that a failed allocation throws, which PyTorch
raises as torch.OutOfMemoryError "... out of memory ..." (a RuntimeError); _common.torch_alloc_functions), hands it the hooks its allocator object offers (init, reset -> empty_cache, memory_fraction,
base_alloc, record_stream) and makes it current with change_current_allocator. PyTorch refuses the
swap once its own allocator has served a tensor, so install first.

This runs the Ascend pool on GPUs (to compare it with PyTorch's, CuPy's and RMM's allocators);
torch.cuda.memory_stats() then reports nothing: read ascend_pool.memory_stats() instead.
"""

import importlib

from .. import config
from ._common import FrameworkMissingError, require, say_caching_stays, set_hooks, torch_alloc_functions, use_backend

__all__ = ["install", "build_allocator", "HOOKS"]

HOOKS = (
    ("set_init_fn", "ascend_pool_init"),
    ("set_reset_fn", "ascend_pool_reset"),
    ("set_memory_fraction_fn", "ascend_pool_set_memory_fraction"),
    ("set_base_alloc_fn", "ascend_pool_base_alloc"),
    ("set_record_stream_fn", "ascend_pool_record_stream"),
)
_installed = None  # torch keeps a raw pointer to the allocator: keep the object for the process


def build_allocator(memory):
    """A CUDAPluggableAllocator over the C ABI, from the torch.cuda.memory module given, with the
    hooks it accepts. Returns (allocator, names of the hooks set)."""
    alloc = memory.CUDAPluggableAllocator(*torch_alloc_functions())
    return alloc, set_hooks(alloc.allocator(), HOOKS)


def install():
    """Makes ascend_pool PyTorch's CUDA allocator. Returns the CUDAPluggableAllocator."""
    global _installed
    torch = require("torch", "torch_cuda", "Install a CUDA build of PyTorch (pip install torch).")
    if getattr(torch.version, "cuda", None) is None:
        raise FrameworkMissingError(
            f"ascend_pool.integrations.torch_cuda needs a CUDA build of PyTorch; torch {torch.__version__} "
            "was built without CUDA (use integrations.torch_npu on Ascend NPUs)")
    if not torch.cuda.is_available():
        raise FrameworkMissingError("ascend_pool.integrations.torch_cuda: PyTorch sees no CUDA device here")
    memory = importlib.import_module("torch.cuda.memory")
    use_backend("cuda", "torch_cuda")
    config.use_framework_conf("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # as torch reads them
    say_caching_stays("PYTORCH_NO_CUDA_MEMORY_CACHING")
    alloc, _ = build_allocator(memory)
    memory.change_current_allocator(alloc)
    _installed = alloc
    return alloc

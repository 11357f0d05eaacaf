"""torch_npu (PyTorch on Ascend NPUs): NPU tensors allocated by ascend_pool.

    import torch, torch_npu
    import ascend_pool.integrations.torch_npu as ap_npu
    ap_npu.install()                              # before the first NPU tensor
    x = torch.empty(1 << 20, device="npu")        # served by ascend_pool's pool on the acl backend

install() builds torch_npu.npu.memory.NPUPluggableAllocator(library_path(), "ascend_pool_malloc",
"ascend_pool_free"), hands it the hooks its allocator object offers (init, reset -> empty_cache,
memory_fraction -> set_memory_fraction, base_alloc), and makes it current. Not record_stream:
torch_npu passes that hook a C++ NPUStream, which no C function can take; tensor.record_stream()
is then a no-op, as it is for every NPUPluggableAllocator.

torch_npu refuses the swap once its own allocator has served a tensor, so install first. Tensors
are allocated from the calling thread's current ascend_pool context (`with ctx:`), else the
device's default pool, created on the first allocation.
"""

import importlib

from ..capi import library_path
from ._common import require, set_hooks, use_backend

__all__ = ["install", "build_allocator", "HOOKS"]

HOOKS = (
    ("set_init_fn", "ascend_pool_init"),
    ("set_reset_fn", "ascend_pool_reset"),
    ("set_memory_fraction_fn", "ascend_pool_set_memory_fraction"),
    ("set_base_alloc_fn", "ascend_pool_base_alloc"),
)
_HINT = "Install torch_npu for your PyTorch and CANN versions (pip install torch-npu)."
_installed = None  # the allocator object: torch keeps a raw pointer, so it must outlive the process


def build_allocator(memory):
    """An NPUPluggableAllocator over the C ABI, from the torch_npu.npu.memory module given, with
    the hooks it accepts. Returns (allocator, names of the hooks set)."""
    alloc = memory.NPUPluggableAllocator(library_path(), "ascend_pool_malloc", "ascend_pool_free")
    return alloc, set_hooks(alloc.allocator(), HOOKS)


def install():
    """Makes ascend_pool torch_npu's NPU allocator. Returns the NPUPluggableAllocator."""
    global _installed
    require("torch", "torch_npu", _HINT)
    require("torch_npu", "torch_npu", _HINT)
    memory = importlib.import_module("torch_npu.npu.memory")
    use_backend("acl", "torch_npu")
    alloc, _ = build_allocator(memory)
    memory.change_current_allocator(alloc)
    _installed = alloc
    return alloc

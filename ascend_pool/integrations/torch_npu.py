"""torch_npu (PyTorch on Ascend NPUs): NPU tensors allocated by ascend_pool.

    import torch, torch_npu
    import ascend_pool.integrations.torch_npu as ap_npu
    ap_npu.install()                              # before the first NPU tensor
    x = torch.empty(1 << 20, device="npu")        # served by ascend_pool's pool on the acl backend

install() builds torch_npu.npu.memory.NPUPluggableAllocator("libascend_pool_torch.so",
"ascend_pool_torch_malloc", "ascend_pool_torch_free") (the C ABI's pair, except that a failed
allocation throws, which torch raises as torch.OutOfMemoryError "... out of memory ..." (a
RuntimeError) where a NULL made a tensor at address 0; _common.torch_alloc_functions), hands it the hooks its allocator object offers (init, reset -> empty_cache,
memory_fraction -> set_memory_fraction, base_alloc), and makes it current. record_stream where
the installed torch_npu declares its hook as std::function<void(void* ptr, aclrtStream stream)>
(NPUPluggableAllocator.h; a C function takes that: ascend_pool_record_stream), so that
tensor.record_stream() keeps a block from reuse until that stream's work is done; a torch_npu whose
hook takes a C++ NPUStream (no C function can) or whose headers are missing leaves it unset, and
tensor.record_stream() is then a no-op, as it is for every NPUPluggableAllocator without the hook.
torch_npu.erase_stream(tensor, stream), which undoes a record_stream, goes to ascend_pool_erase_stream
where set_erase_stream_fn is declared the same way.

torch_npu refuses the swap once its own allocator has served a tensor, so install first. Tensors
are allocated from the calling thread's current ascend_pool context (`with ctx:`), else the
device's default pool, created on the first allocation.

The runtime is torch_npu's: install() neither loads nor initialises it (no aclInit), so torch_npu's
own aclInit, with its JSON configuration (dump_scene, defaultDevice for lazy set-device), happens
as usual; the pool attaches to that runtime at the first allocation.

Stats: torch_npu's NPUPluggableAllocator offers no stats or snapshot hook before v2.7.1 (its
getDeviceStats warns and returns nothing, which is undefined behaviour in C++); from v2.7.1 on it
takes set_get_device_stats_fn and set_reset_peak_status_fn, which install() registers (with or
without patch_stats) where the installed headers' DeviceStats can be built from C (torch_npu_stats),
so that C++ callers get ascend_pool's figures too. Either way install() replaces the Python
functions of torch_npu.npu.memory (and torch.npu) that would reach it: memory_stats and everything
built on it (memory_allocated, memory_reserved, max_memory_allocated, memory_summary ...),
memory_stats_as_nested_dict (which torch_npu's memory_stats calls), reset_peak_memory_stats,
reset_accumulated_memory_stats, memory_snapshot, _snapshot, _record_memory_history, _dump_snapshot,
_set_memory_metadata / _get_memory_metadata, mem_get_info (for a thread allocating from a tenant context
with a quota: the quota as total and what is left of it node-wide as free, as HAMi's limited
cudaMemGetInfo; else torch_npu's own, the runtime's figures), get_device_properties (its total_memory the quota there,
as HAMi's cuDeviceTotalMem, once the context's pool is open; under $ASCEND_POOL_TENANT before then, the
operator file's quota), _allocation_traceback (newer torch: a live block's
allocation frames, from whichever pool made it), _set_allocator_settings (ascend_pool.settings: the knobs
that change at runtime change every open pool; where it has them) and get_per_process_memory_fraction (newer torch_npu; the cap set_per_process_memory_fraction handed
to the pool through the hook) answer from ascend_pool (PyTorch's schema): the stats
for the pool the calling thread allocates from (no device given: torch_npu's current device of
that thread, torch.npu.set_device, not ascend_pool's own ap.set_device), and, as in torch, the history, _snapshot,
memory_snapshot and _dump_snapshot for the whole process (every device's default pool and every
tenant context; ascend_pool.record_memory_history, dump_snapshot). With torch >= 2.9 and the NPU
as the current accelerator, torch.accelerator.memory_stats (and memory_allocated,
max_memory_reserved ... built on it), reset_peak_memory_stats and reset_accumulated_memory_stats
too: they reach the same missing hook from C. They take torch's arguments: a device as an int, "npu:N"
or torch.device("npu", N) (another device type is a ValueError, as in torch), and
_record_memory_history's current and legacy (bool first) signatures, max_entries=sys.maxsize
clamped to config.MAX_HISTORY_ENTRIES, memory_snapshot's mempool_id and include_traces, and
_snapshot's and _dump_snapshot's augment_with_fx_traces (no FX frames here: True warns once). Before torch_npu has initialised the runtime
(torch_npu.npu.is_initialized() false) they open nothing, as torch_npu's own answer then: stats {}
(memory_allocated(0) reads 0), resets do nothing, _snapshot shows the pools made so far; a stats
call naming a device would otherwise open its pool, and with it call aclInit before torch_npu's
own. After it, as torch_npu's allocator answers for a device it never served, a
device whose pool was never opened answers an empty pool's figures (zeros, every key) and is not
opened for it (a context on every NPU a monitoring loop reads); the snapshots open nothing either. Without the patch (install(patch_stats=False)), call
ascend_pool.memory_stats(device) and friends instead.
"""

import importlib
import logging
import os
import re
import sys
import warnings
from collections import OrderedDict

from .. import api, config
from ..errors import ConfigError
from ..snapshot import dump as write_snapshot
from ..tenants.config import operator_quota, process_tenant
from ..settings import set_allocator_settings
from ._common import (TORCH_ALLOC_LIB, require, say_caching_stays, set_hooks, symbol_address, torch_alloc_functions,
                      use_backend)
from .torch_npu_stats import register_stats_hooks

__all__ = ["install", "build_allocator", "patch_memory_functions", "patch_accelerator", "HOOKS", "PATCHED",
           "ACCELERATOR_PATCHED"]

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
    alloc = memory.NPUPluggableAllocator(*torch_alloc_functions())
    return alloc, set_hooks(alloc.allocator(), HOOKS)


# set_record_stream_fn as the torch_npu versions whose hook a C function can serve declare it (the
# C++ NPUStream they pass converts to the aclrtStream it takes); others take a c10_npu::NPUStream.
# set_erase_stream_fn (torch_npu.erase_stream's hook) is declared the same way beside it.
def _c_stream_hook(setter):
    return re.compile(r"\b" + setter + r"\s*\(\s*std::function\s*<\s*void\s*\(\s*void\s*\*\s*\w*\s*,"
                      r"\s*aclrtStream\s*\w*\s*\)\s*>")


_C_RECORD_STREAM = _c_stream_hook("set_record_stream_fn")
_C_ERASE_STREAM = _c_stream_hook("set_erase_stream_fn")


def record_stream_hook_takes_acl_stream(torch_npu_dir):
    """Whether the NPUPluggableAllocator.h installed with torch_npu (under torch_npu_dir) declares
    set_record_stream_fn with std::function<void(void* ptr, aclrtStream stream)>: then the C ABI's
    ascend_pool_record_stream(void *ptr, void *stream) is that hook. False without the header."""
    return _declared_with_acl_stream(torch_npu_dir, _C_RECORD_STREAM)


def erase_stream_hook_takes_acl_stream(torch_npu_dir):
    """The same for set_erase_stream_fn, whose C function is ascend_pool_erase_stream."""
    return _declared_with_acl_stream(torch_npu_dir, _C_ERASE_STREAM)


def _declared_with_acl_stream(torch_npu_dir, pattern):
    path = os.path.join(torch_npu_dir, "include", "torch_npu", "csrc", "npu", "NPUPluggableAllocator.h")
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return False
    text = re.sub(r"//[^\n]*", " ", re.sub(r"/\*.*?\*/", " ", text, flags=re.S))
    return pattern.search(text) is not None


def set_record_stream_hook(allocator, torch_npu_dir):
    """Hands allocator (the NPUPluggableAllocator's allocator() object) ascend_pool_record_stream
    where its set_record_stream_fn takes a C function (record_stream_hook_takes_acl_stream).
    Returns whether it did: without it tensor.record_stream() does nothing, and a block freed on
    its allocation stream is reused there while another stream may still use it."""
    return _set_stream_hook(allocator, "set_record_stream_fn", torch_npu_dir, _C_RECORD_STREAM, "ascend_pool_record_stream",
                            "tensor.record_stream() does nothing; free such tensors on the stream that used them last")


def set_erase_stream_hook(allocator, torch_npu_dir):
    """Hands allocator ascend_pool_erase_stream where its set_erase_stream_fn takes a C function
    (erase_stream_hook_takes_acl_stream), so that torch_npu.erase_stream(tensor, stream) undoes
    tensor.record_stream(stream) as torch_npu's own allocator does. Returns whether it did:
    without it (and with record_stream's hook set) the block's free still waited for that
    stream's work, the memory held as long as the stream stayed busy."""
    return _set_stream_hook(allocator, "set_erase_stream_fn", torch_npu_dir, _C_ERASE_STREAM, "ascend_pool_erase_stream")


def _set_stream_hook(allocator, setter, torch_npu_dir, pattern, symbol, unset_means=None):
    """allocator.setter(the C function symbol) where the installed header declares setter with an
    aclrtStream (pattern); said in the log with unset_means where it does not. Whether it did."""
    if not callable(getattr(allocator, setter, None)):
        return False
    if not _declared_with_acl_stream(torch_npu_dir, pattern):
        if unset_means:
            logging.getLogger("ascend_pool").info(
                f"ascend_pool: torch_npu's {setter} not used (its installed NPUPluggableAllocator.h does not "
                f"declare it std::function<void(void*, aclrtStream)>): {unset_means}")
        return False
    getattr(allocator, setter)(symbol_address(symbol))
    return True


def _device_index(device, current=True):
    """torch's device argument (None, int, "npu:1", torch.device) as an int. None and "npu" (no
    index) are torch_npu's current device of the calling thread (torch.npu.set_device, per
    thread), as torch_npu's _get_device_index(device, optional=True) takes them; with current
    False they stay None (torch_npu's current_device() runs its lazy init, which must not start
    from here). Another device type ("cpu", torch.device("cuda")) or argument is an
    InvalidDeviceError, a ValueError as torch's _get_device_index raises."""
    index = None if device is None else api.torch_device_index(device, kinds=("npu",))
    if index is None and current:
        # not ascend_pool's own current device (ap.set_device, default 0): a thread on npu:1 read
        # device 0's figures, and opened device 0's pool to read them
        npu = getattr(importlib.import_module("torch_npu"), "npu", None)
        return npu.current_device() if npu is not None and hasattr(npu, "current_device") else None
    return index


def _record_memory_history_impl(enabled="all", context="all", stacks="all", max_entries=sys.maxsize, device=None,
                                clear_history=False, compile_context=False, global_record_annotations=False,
                                skip_actions=None):
    """torch's _record_memory_history(enabled, context, stacks, max_entries, ...): enabled None
    stops the history, "state"/"all" records it; context None records no frames; stacks "python"
    or "all" record Python frames (no C++ frames here); max_entries events per pool, clamped to
    config.MAX_HISTORY_ENTRIES (torch's default sys.maxsize included); clear_history drops the
    events recorded so far first; skip_actions leaves those actions out of the trace;
    compile_context and global_record_annotations as ascend_pool.record_memory_history's (one
    warning when set). device is accepted and ignored (the history covers every device's pools,
    as torch's)."""
    if enabled not in (None, "state", "all"):
        raise ConfigError(f"_record_memory_history: enabled must be None, 'state' or 'all', got {enabled!r}")
    api.record_memory_history(enabled, stacks="python" if stacks not in (None, "none") else None,
                              max_entries=max_entries, context=context, clear_history=clear_history,
                              compile_context=compile_context, global_record_annotations=global_record_annotations,
                              skip_actions=skip_actions)


def _record_memory_history_legacy(enabled, record_context=True, trace_alloc_max_entries=1,
                                  trace_alloc_record_context=False, device=None, record_context_cpp=False,
                                  clear_history=False, compile_context=False, global_record_annotations=False,
                                  skip_actions=None):
    """torch's legacy _record_memory_history(True|False, record_context, trace_alloc_max_entries,
    trace_alloc_record_context, device, record_context_cpp, ...): False stops the history; frames
    when record_context (on live blocks: torch's context "state") or trace_alloc_record_context
    (on allocation entries too: "alloc"); record_context_cpp adds no C++ frames here;
    trace_alloc_max_entries events (at least 1, as torch; clamped as above)."""
    # torch's legacy mapping: frames in the trace with trace_alloc_record_context, on live blocks
    # only with record_context
    context = "alloc" if trace_alloc_record_context else "state" if record_context else None
    n = trace_alloc_max_entries
    if isinstance(n, int) and not isinstance(n, bool):
        n = max(1, n)
    api.record_memory_history(True if enabled else None, stacks="python" if context else None, max_entries=n,
                              context=context, clear_history=clear_history, compile_context=compile_context,
                              global_record_annotations=global_record_annotations, skip_actions=skip_actions)


_fx_warned = []


def _fx_traces(augment):
    """torch's augment_with_fx_traces: accepted; True warns once, since the frames recorded here
    are Python's own, with no FX node fields to add (as compile_context is for the history)."""
    if augment and not _fx_warned:
        _fx_warned.append(True)
        warnings.warn("augment_with_fx_traces=True: ascend_pool's snapshot frames carry no FX graph information; "
                      "the snapshot is returned without it", RuntimeWarning, stacklevel=3)


def _framework_started():
    """False while torch_npu has not initialised the runtime (its lazy init: aclInit with its
    acl.json, the device set). A device's default pool opened before then would call aclInit
    first and torch_npu's own would fail with 100002, its configuration dropped; so, as
    torch_npu's own functions answer then ({} and no-ops), ours open nothing."""
    npu = sys.modules.get("torch_npu.npu") or getattr(sys.modules.get("torch_npu"), "npu", None)
    started = getattr(npu, "is_initialized", None)
    return not callable(started) or bool(started())


def _stats_call(device, started_call, open_call, none):
    """Once torch_npu has started: started_call(index), ascend_pool's module-level function, which
    reads the device's pool and opens none (a device never served answers an empty pool's zeros,
    as torch_npu's allocator answers it). Before: open_call(pool) on a pool already open (no
    device index from torch_npu, whose current_device() would run its lazy init), else none,
    torch_npu's own answer then."""
    started = _framework_started()
    index = _device_index(device, current=started)
    if started:
        return started_call(index)
    pool = api.open_pool(index)
    return open_call(pool) if pool is not None else none


def _replacements():
    def memory_stats(device=None):
        # not started yet: {}, as torch_npu's: memory_allocated() & co. read 0
        return _stats_call(device, api.memory_stats, api.device_stats, OrderedDict())

    def memory_stats_as_nested_dict(device=None):  # what torch_npu's own memory_stats calls
        return _stats_call(device, api.memory_stats_as_nested_dict, api.device_nested_stats, {})

    def reset_peak_memory_stats(device=None):
        # none open: nothing has been served, nothing to reset
        _stats_call(device, api.reset_peak_stats, lambda pool: pool.reset_peak_stats(), None)

    def reset_accumulated_memory_stats(device=None):
        _stats_call(device, api.reset_accumulated_memory_stats, lambda pool: pool.reset_accumulated_stats(), None)

    # torch's signatures, which torch.accelerator.memory.snapshot and user code pass on
    # (augment_with_fx_traces, mempool_id): the old ones raised TypeError for them
    def _snapshot(device=None, augment_with_fx_traces=False):
        # torch's covers the whole process, whatever device is given (_cuda_memorySnapshot(None)):
        # every device's and every pool's segments and traces, what _dump_snapshot pickles; the
        # device is still checked (another device type is a ValueError, as the other functions')
        _fx_traces(augment_with_fx_traces)
        _device_index(device, current=False)
        # the pools made so far (before torch_npu has started, none by its tensors): none opened
        return api._process_snapshot()

    def memory_snapshot(mempool_id=None, include_traces=True):
        if not _framework_started():
            segments = api._process_snapshot()["segments"]
            if mempool_id is None:
                return segments
            want = api._pool_id(mempool_id)
            return [s for s in segments if s["segment_pool_id"] == want]
        return api.memory_snapshot(mempool_id, include_traces)

    def _record_memory_history(enabled="all", *args, **kwargs):
        if isinstance(enabled, bool):  # torch's legacy form, as torch dispatches it
            return _record_memory_history_legacy(enabled, *args, **kwargs)
        return _record_memory_history_impl(enabled, *args, **kwargs)


    def get_per_process_memory_fraction(device=None):
        # torch_npu's getter asks its C++ allocator, which under a pluggable one does not hold the
        # cap that set_per_process_memory_fraction handed to ascend_pool_set_memory_fraction
        return _stats_call(device, api.get_per_process_memory_fraction,
                           lambda pool: api.get_per_process_memory_fraction(pool.device), 1.0)

    def _dump_snapshot(filename="dump_snapshot.pickle", augment_with_fx_traces=False):
        _fx_traces(augment_with_fx_traces)
        if not _framework_started():
            write_snapshot(api._process_snapshot(), filename)
            return
        api.dump_snapshot(filename)

    return {"memory_stats": memory_stats, "memory_stats_as_nested_dict": memory_stats_as_nested_dict,
            "reset_peak_memory_stats": reset_peak_memory_stats,
            "reset_accumulated_memory_stats": reset_accumulated_memory_stats, "_snapshot": _snapshot,
            "memory_snapshot": memory_snapshot, "_record_memory_history": _record_memory_history,
            "_dump_snapshot": _dump_snapshot, "get_per_process_memory_fraction": get_per_process_memory_fraction,
            # torch_npu's would tag its own allocator's trace, which serves nothing under ours
            "_set_memory_metadata": api.set_memory_metadata, "_get_memory_metadata": api.get_memory_metadata,
            # torch_npu's would look the address up in its own allocator, which made no block
            "_allocation_traceback": api._allocation_traceback,
            # torch_npu's would re-read its own allocator's config, which serves nothing under ours
            "_set_allocator_settings": set_allocator_settings}


PATCHED = ("memory_stats", "memory_stats_as_nested_dict", "reset_peak_memory_stats", "reset_accumulated_memory_stats",
           "_snapshot", "memory_snapshot", "_record_memory_history", "_dump_snapshot", "get_per_process_memory_fraction",
           "_set_memory_metadata", "_get_memory_metadata", "_set_allocator_settings", "_allocation_traceback")


def _quota_mem_get_info(original):
    """torch_npu's mem_get_info(device=None), answering for a tenant context with a quota as
    HAMi's limited cudaMemGetInfo does (Context.mem_get_info: the quota as total, what is left of
    it node-wide as free) when the calling thread allocates from one on that device (`with ctx:`,
    $ASCEND_POOL_TENANT); else torch_npu's own answer, the runtime's figures. Before, it gave the
    device's figures under a quota: a framework sizing its KV cache from it (vLLM's
    gpu_memory_utilization * total) asked for more than the quota and was refused."""
    def mem_get_info(device=None):
        # a device query (torch's makes the device's context): the calling thread's pool of the
        # device once torch_npu has started, opened if need be; before, only one already open
        started = _framework_started()
        index = _device_index(device, current=started)
        pool = api.default_pool(index) if started else api.open_pool(index)
        if pool is not None and getattr(pool, "quota_hook", None) is not None and pool.quota is not None:
            return pool.mem_get_info()
        return original(device) if device is not None else original()
    mem_get_info._ascend_pool_original = original
    return mem_get_info


class QuotaDeviceProperties:
    """torch_npu's device properties with total_memory the tenant's quota (at most the device's
    memory), as HAMi's limited cuDeviceTotalMem reports its limit there as in cudaMemGetInfo;
    every other attribute torch_npu's own (props)."""

    def __init__(self, props, total_memory):
        self._props, self.total_memory = props, total_memory

    def __getattr__(self, name):
        return getattr(self._props, name)

    def __repr__(self):
        text = repr(self._props)
        own = getattr(self._props, "total_memory", None)
        if own is not None and own // (1 << 20) != self.total_memory // (1 << 20):
            text = text.replace(f"total_memory={own // (1 << 20)}MB", f"total_memory={self.total_memory // (1 << 20)}MB")
        return text


def _quota_device_properties(original):
    """torch_npu's get_device_properties(device_name=None), its total_memory the quota (at most
    the device's memory) when the calling thread allocates from a tenant context with a quota on
    that device (`with ctx:`, $ASCEND_POOL_TENANT), as mem_get_info answers then
    (_quota_mem_get_info): a framework sizing its cache from total_memory (DeepSpeed's
    accelerator total_memory(), Megatron's) asked for the device where mem_get_info said the
    quota. Reads the pool only if it is open (torch_npu's own call ran its lazy init first); a
    device whose default pool is not open yet, under $ASCEND_POOL_TENANT, says the quota the
    operator's tenants file gives the tenant there, which its context opens with (mem_get_info,
    which opens it, says that one): before, the device's memory until the first allocation,
    where a framework reads total_memory at start-up. Nothing is opened for it (a loop over the
    node's devices must not take a context on each)."""
    def get_device_properties(device_name=None, *args, **kwargs):
        props = original(device_name, *args, **kwargs)
        total = getattr(props, "total_memory", None)
        if not isinstance(total, int) or not _framework_started():
            return props
        index = _device_index(device_name)
        pool = api.open_pool(index) if index is not None else None
        if pool is not None:
            quota = pool.quota if getattr(pool, "quota_hook", None) is not None else None
        else:
            quota = _unopened_tenant_quota(index, total)
        return props if quota is None else QuotaDeviceProperties(props, min(quota, total))
    get_device_properties._ascend_pool_original = original
    return get_device_properties


def _unopened_tenant_quota(index, total):
    """The quota in bytes of $ASCEND_POOL_TENANT's default context on device index as the
    operator's tenants file sets it (a percentage of total), or None: no tenant, no file, not
    named there, no quota, or no device index."""
    tenant = process_tenant() if index is not None else None
    found = operator_quota(tenant, index, total) if tenant is not None else None
    return found[0] if found else None


def patch_memory_functions(*modules):
    """Points the PATCHED functions of each module given (torch_npu.npu.memory, torch_npu.npu)
    at ascend_pool's, and wraps its mem_get_info (_quota_mem_get_info) and get_device_properties
    (_quota_device_properties); names a module lacks are
    left out. Returns the names replaced per module."""
    repl = _replacements()
    done = []
    for mod in modules:
        names = [n for n in PATCHED if hasattr(mod, n)]
        for n in names:
            setattr(mod, n, repl[n])
        original = getattr(mod, "mem_get_info", None)
        if callable(original):
            # a second patch wraps torch_npu's function, not the first wrapper
            setattr(mod, "mem_get_info", _quota_mem_get_info(getattr(original, "_ascend_pool_original", original)))
            names.append("mem_get_info")
        original = getattr(mod, "get_device_properties", None)
        if callable(original):
            setattr(mod, "get_device_properties",
                    _quota_device_properties(getattr(original, "_ascend_pool_original", original)))
            names.append("get_device_properties")
        done.append(names)
    return done


ACCELERATOR_PATCHED = ("memory_stats", "reset_peak_memory_stats", "reset_accumulated_memory_stats")


def patch_accelerator(torch):
    """torch >= 2.9's device-generic torch.accelerator.memory_stats (and memory_allocated,
    max_memory_reserved ..., which read it) reach the current accelerator's allocator in C, for
    torch_npu the pluggable allocator's missing stats hook: when the current accelerator is the
    NPU, points the ACCELERATOR_PATCHED functions of torch.accelerator.memory and
    torch.accelerator at ascend_pool's, and wraps their get_memory_info as torch.npu's
    mem_get_info (_quota_mem_get_info). Returns the names replaced (none for another
    accelerator, or a torch without torch.accelerator)."""
    acc = getattr(torch, "accelerator", None)
    memory = sys.modules.get("torch.accelerator.memory") or getattr(acc, "memory", None)
    current = getattr(acc, "current_accelerator", None)
    device = current() if callable(current) else None
    if memory is None or getattr(device, "type", None) != "npu":
        return []
    repl = _replacements()
    names = [n for n in ACCELERATOR_PATCHED if hasattr(memory, n)]
    for n in names:
        setattr(memory, n, repl[n])  # memory_allocated & co. call the module's memory_stats
        if hasattr(acc, n):
            setattr(acc, n, repl[n])
    original = getattr(memory, "get_memory_info", None)
    if callable(original):  # torch's mem_get_info for the current accelerator: a tenant's quota as HAMi's
        wrapped = _quota_mem_get_info(getattr(original, "_ascend_pool_original", original))
        setattr(memory, "get_memory_info", wrapped)
        if hasattr(acc, "get_memory_info"):
            setattr(acc, "get_memory_info", wrapped)
        names.append("get_memory_info")
    return names


def _package_dir(name):
    """The installed package's directory (its headers are under include/), or "" when unknown."""
    path = getattr(sys.modules.get(name), "__file__", None)
    return os.path.dirname(path) if path else ""


def _stats_hook_functions():
    """(memory_stats, reset_peak_memory_stats) for the allocator's C++ stats hooks
    (torch_npu_stats): the patched functions' own, whether or not patch_stats patches them."""
    repl = _replacements()
    return repl["memory_stats"], repl["reset_peak_memory_stats"]


def install(patch_stats=True):
    """Makes ascend_pool torch_npu's NPU allocator, leaving the runtime's initialisation to
    torch_npu; with patch_stats, torch.npu's memory-stats functions answer from ascend_pool (see
    the module docstring). Returns the NPUPluggableAllocator."""
    global _installed
    require("torch", "torch_npu", _HINT)
    require("torch_npu", "torch_npu", _HINT)
    memory = importlib.import_module("torch_npu.npu.memory")
    use_backend("acl", "torch_npu", open_now=False)  # no aclInit here: torch_npu's own comes first
    config.use_framework_conf("PYTORCH_NPU_ALLOC_CONF")  # the user's settings, without $ASCEND_POOL_CONF
    say_caching_stays("PYTORCH_NO_NPU_MEMORY_CACHING")
    alloc, _ = build_allocator(memory)
    set_record_stream_hook(alloc.allocator(), _package_dir("torch_npu"))
    set_erase_stream_hook(alloc.allocator(), _package_dir("torch_npu"))
    memory.change_current_allocator(alloc)
    _installed = alloc
    register_stats_hooks(alloc.allocator(), TORCH_ALLOC_LIB, _package_dir("torch_npu"), _package_dir("torch"),
                         *_stats_hook_functions())
    if patch_stats:
        patch_memory_functions(memory, importlib.import_module("torch_npu.npu"))
        patch_accelerator(importlib.import_module("torch"))
    return alloc

"""The stats hooks of newer torch_npu's NPUPluggableAllocator (set_get_device_stats_fn,
set_reset_peak_status_fn: torch_npu v2.7.1 and later), handed ascend_pool's figures so that C++
callers of its getDeviceStats / resetPeakStats (torch_npu's own bindings, torch.accelerator's, any
extension) get them; without them getDeviceStats is undefined behaviour (it returns nothing).

The stats hook returns c10_npu::NPUCachingAllocator::DeviceStats by value, a struct this package
cannot include (no torch headers at build time). Its field list is read from the headers installed
with torch_npu (torch_npu/include/torch_npu/csrc/core/npu/NPUCachingAllocator.h, or, where that
header takes torch's c10::CachingDeviceAllocator::DeviceStats, torch's
include/c10/core/CachingDeviceAllocator.h): only int64_t, Stat and StatArray members are
accepted, and only a size libascend_pool_torch.so has a function for (torch_stats.cpp). Anything
else (headers missing, a member of another type, as the hash map of private pools in torch 2.13's)
registers no stats hook: the Python patching of torch_npu.npu's functions then answers alone, as
for a torch_npu without the setters. set_snapshot_fn's SnapshotInfo holds C++ vectors and shared
pointers: not offered. Tested up to the edge: the struct as torch_npu's header declares it, built
with g++ against libascend_pool_torch.so; not against a torch_npu build.
"""

import atexit
import ctypes
import logging
import os
import re

from .._core import CallbackGuard

__all__ = ["device_stats_fields", "stats_keys", "register_stats_hooks", "STAT_KINDS"]

_log = logging.getLogger("ascend_pool")

# Figures per member type: Stat {current, peak, allocated, freed}; StatArray: 3 Stats (all,
# small_pool, large_pool: StatType's AGGREGATE, SMALL_POOL, LARGE_POOL); int64_t one.
STAT_KINDS = {"int64_t": 1, "Stat": 4, "StatArray": 12}
_STAT = ("current", "peak", "allocated", "freed")
_POOLS = ("all", "small_pool", "large_pool")
_MEMBER = re.compile(r"^(?:std::)?(int64_t|Stat|StatArray)\s+([A-Za-z_]\w*)\s*(?:=\s*[-\w]+|\{\s*\})?$")


def _struct_body(text, name):
    """The member declarations of `struct name { ... };` in header text, comments stripped, or None."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    m = re.search(r"\bstruct\s+" + name + r"\s*\{", text)
    if not m:
        return None
    depth, i = 1, m.end()
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[m.end():i - 1] if depth == 0 else None


def _fields(text):
    """[(kind, name)] of DeviceStats in header text, or None when it has a member of another type
    (or a method, or is not there)."""
    body = _struct_body(text, "DeviceStats")
    if body is None:
        return None
    out = []
    for decl in (d.strip() for d in body.split(";")):
        if not decl:
            continue
        m = _MEMBER.match(" ".join(decl.split()))
        if not m:
            return None
        out.append((m.group(1), m.group(2)))
    return out or None


def _three_pools(text):
    """StatType has 3 kinds (NUM_TYPES = 3) in header text: StatArray is 3 Stats."""
    return re.search(r"\bNUM_TYPES\s*=\s*3\b", text) is not None


def _read(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def device_stats_fields(torch_npu_dir, torch_dir):
    """The (kind, name) members of the DeviceStats the installed torch_npu (package directory
    torch_npu_dir) returns from getDeviceStats, transcribed from its header (torch's, under
    torch_dir, where torch_npu's takes c10::CachingDeviceAllocator::DeviceStats), or None with the
    reason when it cannot be built from C."""
    npu_h = os.path.join(torch_npu_dir, "include", "torch_npu", "csrc", "core", "npu", "NPUCachingAllocator.h")
    text = _read(npu_h)
    if text is None:
        return None, f"{npu_h} is not installed"
    if re.search(r"\bstruct\s+DeviceStats\s*\{", text):
        fields, where, pools = _fields(text), npu_h, _three_pools(text)
    elif re.search(r"using\s+c10::CachingDeviceAllocator::DeviceStats\s*;", text):
        c10_h = os.path.join(torch_dir, "include", "c10", "core", "CachingDeviceAllocator.h")
        c10_text = _read(c10_h)
        if c10_text is None:
            return None, f"{c10_h} is not installed"
        alloc_text = _read(os.path.join(torch_dir, "include", "c10", "core", "Allocator.h")) or ""
        fields, where, pools = _fields(c10_text), c10_h, _three_pools(alloc_text) or _three_pools(c10_text)
    else:
        return None, f"{npu_h} declares no DeviceStats"
    if fields is None:
        return None, f"DeviceStats in {where} has a member other than int64_t, Stat and StatArray"
    if not pools:
        return None, f"StatType in {where}'s headers is not 3 kinds"
    return fields, where


def stats_keys(fields):
    """The memory_stats() key of each int64 figure of DeviceStats, in memory order."""
    keys = []
    for kind, name in fields:
        if kind == "StatArray":
            keys += [f"{name}.{pool}.{stat}" for pool in _POOLS for stat in _STAT]
        elif kind == "Stat":
            keys += [f"{name}.{stat}" for stat in _STAT]
        else:
            keys.append(name)
    return keys


_FILL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t)
_RESET = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)
_bound = []  # the ctypes callbacks bound: kept for the life of the process, as the library keeps their addresses


def bind(lib_path, keys, memory_stats, reset_peak_memory_stats):
    """Binds libascend_pool_torch.so's stats hooks to memory_stats(device) (its figures under keys,
    0 where it lacks one) and reset_peak_memory_stats(device). Returns the loaded library."""
    def fill(device, out, n):
        try:
            stats = memory_stats(device)
            for i in range(min(n, len(keys))):
                out[i] = int(stats.get(keys[i], 0))
            return 0
        except Exception:  # a C++ caller gets runtime_error; the reason goes to the log
            _log.exception("ascend_pool: the torch_npu stats hook: memory_stats(%d) failed", device)
            return -1

    def reset(device):
        try:
            reset_peak_memory_stats(device)
            return 0
        except Exception:
            _log.exception("ascend_pool: the torch_npu reset hook: reset_peak_memory_stats(%d) failed", device)
            return -1

    lib = ctypes.CDLL(lib_path)
    # A KeyboardInterrupt or SystemExit (Ctrl-C, a SIGTERM's sys.exit, during a training loop's
    # torch.npu.memory_stats()) fails the call and reaches the program, not the log (CallbackGuard).
    cbs = (_FILL(CallbackGuard(fill, -1)), _RESET(CallbackGuard(reset, -1)))
    _bound.append(cbs)  # earlier ones too: a C++ caller may be inside one while this rebinds
    lib.ascend_pool_torch_bind_stats.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.ascend_pool_torch_bind_stats(*(ctypes.cast(c, ctypes.c_void_p) for c in cbs))
    if not _closing:
        _closing.append(lib)
        atexit.register(lib.ascend_pool_torch_stats_closed)
    return lib


_closing = []


def _address(lib, name):
    fn = getattr(lib, name, None)  # None: a library built before this hook's size existed
    return ctypes.cast(fn, ctypes.c_void_p).value if fn is not None else None


def register_stats_hooks(allocator, lib_path, torch_npu_dir, torch_dir, memory_stats, reset_peak_memory_stats):
    """Hands allocator (the NPUPluggableAllocator's allocator() object) the stats hooks it offers
    (set_get_device_stats_fn where the installed DeviceStats can be built, set_reset_peak_status_fn)
    answered by memory_stats(device) and reset_peak_memory_stats(device). Returns the setters
    called; none for an older torch_npu, or without libascend_pool_torch.so."""
    offers_stats = callable(getattr(allocator, "set_get_device_stats_fn", None))
    offers_reset = callable(getattr(allocator, "set_reset_peak_status_fn", None))
    if not (offers_stats or offers_reset) or not os.path.exists(lib_path):
        return []
    keys, stats_fn = [], None
    if offers_stats:
        fields, where = device_stats_fields(torch_npu_dir, torch_dir)
        if fields is None:
            _log.info("ascend_pool: torch_npu's set_get_device_stats_fn not used: %s; torch.npu.memory_stats "
                      "answers from ascend_pool through Python only", where)
        else:
            keys = stats_keys(fields)
            lib = ctypes.CDLL(lib_path)
            stats_fn = _address(lib, f"ascend_pool_torch_device_stats_{8 * len(keys)}")
            if stats_fn is None:
                _log.info("ascend_pool: torch_npu's set_get_device_stats_fn not used: DeviceStats in %s is %d "
                          "bytes, which %s has no function for", where, 8 * len(keys), lib_path)
    lib = bind(lib_path, keys, memory_stats, reset_peak_memory_stats)
    done = []
    if stats_fn is not None:
        allocator.set_get_device_stats_fn(stats_fn)
        done.append("set_get_device_stats_fn")
    if offers_reset:
        allocator.set_reset_peak_status_fn(_address(lib, "ascend_pool_torch_reset_peak_stats"))
        done.append("set_reset_peak_status_fn")
    return done

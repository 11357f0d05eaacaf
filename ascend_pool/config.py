"""Allocator knobs: from $ASCEND_POOL_CONF ("key:value,key:value", like PYTORCH_NPU_ALLOC_CONF)
and from keyword arguments (which win). Every unknown key or bad value is a ConfigError naming it.
Once a framework integration is installed (integrations.torch_npu / torch_cuda), a process without
$ASCEND_POOL_CONF takes the framework's own variable instead (PYTORCH_NPU_ALLOC_CONF;
PYTORCH_ALLOC_CONF, then PYTORCH_CUDA_ALLOC_CONF), which its users have already set (said once in
the log).

Knobs:
  max_split_size_mb            blocks this large (MiB) are never split; default unlimited
  garbage_collection_threshold release idle segments when reserved memory passes this fraction
                               (0, 1) of the limit (memory_fraction) or of the device: as
                               PyTorch, every one idle at least the average time, pass after
                               pass, until under it (expandable segments: the pages idle
                               longest first, until under it)
  reserve                      preallocate at start: bytes ("4GiB") or a fraction of the device's
                               free memory ("25%" or 0.25); kept until empty_cache(), or given
                               up (when idle) by a request larger than its free space that
                               fails otherwise; small requests under a full cap are cut from it
  record_history               keep a ring of allocator events for snapshots: true/false or a
                               number of entries (at most 2**20 are kept)
  page_size                    large-segment granularity: "2m" (default) or "1g"
  expandable_segments          true: segments grow and shrink in place through the runtime's
                               virtual-memory calls (needs a backend with them); default false
  release_policy               "budgeted" (default: trades idle segments for growth within a
                               device-call budget, docs/placement-policy.md), "under_peak" (trades
                               without a budget) or "never" (torch_npu's behaviour)
  stream_reuse                 "borrow" (default: a stream reuses blocks freed on another stream
                               once ordered after them by an event wait on the device) or
                               "tied" (a block serves only its own stream, PyTorch's policy)
  memory_fraction              cap on reserved memory, a fraction (0, 1] of the device
                               (alias: per_process_memory_fraction)
  sync_timeout_ms              bound on every host wait for the device; -1 waits forever
  pad_bytes                    bytes added to each request before rounding (acl/sim: 32, cuda: 0)
  roundup_power2_divisions     PyTorch's: round requests up to one of N equal steps between two
                               powers of two (N a power of two; 0/1 off), one N for all sizes or
                               a list per size interval in MiB: "[256:4,512:2,>:1]"
  large_segment_size_mb        PyTorch's and torch_npu's: the segment (MiB, more than 10; default
                               20) that requests from 1 to 10 MiB share; max_split_size_mb and
                               max_non_split_rounding_mb may not be below it

Every other key of torch_npu's PYTORCH_NPU_ALLOC_CONF (NPUAllocatorConfig and the common
allocator config) and of PyTorch's PYTORCH_CUDA_ALLOC_CONF (CUDAAllocatorConfig and
AcceleratorAllocatorConfig) is accepted, so a copied setting works; keys that mean nothing for this
pool (base_addr_aligned_kb, segment_size_mb, pinned memory, lock, graph-capture and reclaim
settings) warn once. PyTorch's and torch_npu's keys keep their value rules (TORCH_KEY_RULES):
True/False flags, backend native or cudaMallocAsync, pinned_num_register_threads a power of two
up to 128, max_non_split_rounding_mb at least large_segment_size_mb (20), segment_size_mb 20 to
512, sizes in MiB positive, expandable_segments_reserve
(and _by_class's "[class:value,...]") a fraction or GiB ("40G"), a malformed one only warned
about, as PyTorch does; a value PyTorch refuses is a ConfigError here too.
"""

import decimal
import logging
import math
import numbers
import os
import warnings

from .errors import ConfigError, ConfigTypeError
from .units import as_index, parse_bytes

ENV_VAR = "ASCEND_POOL_CONF"
log = logging.getLogger(__name__)
# The framework variables read in place of ENV_VAR when it is unset, in order (use_framework_conf).
_framework_vars = []
_told = set()
# Knob values that name a C policy; PoolBase maps each to its enum (core/pool.pxi's tables of the
# same names, checked equal by tests/test_one_home.py).
RELEASE_POLICIES = ("never", "under_peak", "budgeted")
STREAM_REUSE = ("borrow", "tied")
DEFAULT_HISTORY = 100_000
# The most history entries record_memory_history keeps (ascend_pool.record_memory_history and the
# patched torch.npu.memory._record_memory_history clamp larger requests, such as PyTorch's default
# sys.maxsize, to it): the C ring is allocated up front at 48 bytes an entry, so this bounds it at
# 48 MiB of host memory per pool.
MAX_HISTORY_ENTRIES = 1 << 20
HISTORY_STACKS = ("python", "all", None, "none")
HISTORY_CONTEXTS = (None, "state", "alloc", "all")  # torch's _record_memory_history(context=...)
# The trace's actions, in the C history's order (core/history.h AP_ACT_*): torch's names.
HISTORY_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom", "snapshot",
                   "segment_map", "segment_unmap")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def history_skip_mask(skip_actions):
    """torch's skip_actions (a list of action names, or None) as the C history's bit mask."""
    if skip_actions is None:
        return 0
    if isinstance(skip_actions, (str, bytes)) or not hasattr(skip_actions, "__iter__"):
        raise ConfigError(f"skip_actions must be a list of action names, got {skip_actions!r}")
    mask = 0
    for name in skip_actions:
        if name not in HISTORY_ACTIONS:
            raise ConfigError(f"skip_actions: unknown action {name!r} (known: {', '.join(HISTORY_ACTIONS)})")
        mask |= 1 << HISTORY_ACTIONS.index(name)
    return mask


def history_settings(enabled, stacks, max_entries, context="all"):
    """record_memory_history's arguments checked and normalised: (on, frames, entries) with
    entries the ring size in events (0 when off, 1 for enabled="state" as torch's, else
    max_entries clamped to [1, MAX_HISTORY_ENTRIES], 0 giving 1 as torch's); frames: Python frames are filed (stacks
    "python"/"all" and a context). ConfigError names a bad one, so that a setting kept for pools
    made later (ascend_pool.record_memory_history) is refused when given, not when a pool opens."""
    on = enabled not in (None, False)
    if enabled not in (None, False, True, "all", "state"):
        raise ConfigError(f"enabled must be True, 'all', 'state', None or False, got {enabled!r}")
    n = as_index(max_entries)  # a numpy integer too, as torch's int argument takes it
    if on and (n is None or n < 0):
        raise ConfigError(f"max_entries must be a non-negative int, got {max_entries!r}")
    # 0 keeps the latest event, as torch's and torch_npu's recordHistory (std::max(size_t(1), n)):
    # code that ran there must run here, and the legacy trace_alloc_max_entries path clamps so too
    max_entries = max(n, 1) if n is not None else n
    if stacks not in HISTORY_STACKS:
        raise ConfigError(f"stacks must be 'python', 'all' or None, got {stacks!r}")
    if context not in HISTORY_CONTEXTS:
        raise ConfigError(f"context must be None, 'state', 'alloc' or 'all', got {context!r}")
    entries = (1 if enabled == "state" else min(max_entries, MAX_HISTORY_ENTRIES)) if on else 0
    return on, on and stacks in ("python", "all") and context is not None, entries


def _is_bool(value):
    """A Python bool or a numpy one (np.True_: no int and no bool subclass, so int() read it as 1
    where a bool is refused, and a flag refused it)."""
    return isinstance(value, bool) or (getattr(getattr(value, "dtype", None), "kind", None) == "b"
                                       and getattr(value, "ndim", None) == 0)  # not an array of them


def flag_argument(where, name, value):
    """value as a bool when it is True or False (numpy's too), else ConfigTypeError naming the
    argument: a flag argument takes no other object (include_traces="no" kept the traces, as
    any non-empty string is true, and None dropped them)."""
    if not _is_bool(value):
        raise ConfigTypeError(f"{where}: {name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def _bool(key, value):
    if _is_bool(value):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


_REALS = (numbers.Real, decimal.Decimal)


def _whole(value):
    try:
        return math.isfinite(value) and float(value).is_integer()
    except (ValueError, OverflowError):  # Decimal("sNaN")
        return False


def _number(key, value, kind=float):
    # A keyword's bool is no number (sync_timeout_ms=True was 1 ms, memory_fraction=True the whole
    # device), and an integer knob takes no fraction (sync_timeout_ms=1.7 was cut to 1 ms silently;
    # the knob string's "1.7" was already refused). A Decimal is no numbers.Real, yet int() cuts it too.
    fraction = kind is int and isinstance(value, _REALS) and not isinstance(value, numbers.Integral)
    if _is_bool(value) or (fraction and not _whole(value)):
        raise ConfigError(f"{key}: expected {'an integer' if kind is int else 'a number'}, got {value!r}")
    try:
        n = kind(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if kind is float and not math.isfinite(n):  # nan/inf would reach the C config as garbage
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    return n


def _fraction_or_bytes(key, value):
    """('fraction', f) or ('bytes', n). A number with a point or an exponent ("1.0", "0.25", "1e-3",
    the float 0.25) is a fraction, whether a keyword's float or the knob string's text, so that
    "reserve:1.0" is the whole device as reserve=1.0 is (it was 1 byte, "1.5" too); digits alone
    (1073741824, "1073741824") are bytes, as a numpy integer is."""
    given = value
    if as_index(value) is not None:  # an int or a numpy integer: bytes
        value = as_index(value)
    elif isinstance(value, _REALS) and not isinstance(value, bool):  # a numpy float, a Decimal too
        value = float(value)
    if isinstance(value, str) and not value.strip().endswith("%"):
        try:
            f = float(value)
        except ValueError:  # "8GiB" and the like: bytes, read below
            pass
        else:
            # float() reads "1_000_000" too: digits with underscores are bytes, as int() reads
            # the other integer knobs (it was a fraction, refused as out of (0, 1])
            value = int(value) if value.strip().replace("_", "").isdigit() else f
    if isinstance(value, float) or (isinstance(value, str) and value.strip().endswith("%")):
        f = _number(key, value.strip()[:-1], float) / 100 if isinstance(value, str) else value
        if not 0 < f <= 1:
            raise ConfigError(f"{key}: a fraction must be in (0, 1] (or 0%..100%), got {given!r}")
        return ("fraction", f)
    try:
        return ("bytes", parse_bytes(value, key))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _split_items(text):
    """Splits at commas outside brackets ("a:1,b:[1:2,>:4]" -> ["a:1", "b:[1:2,>:4]"])."""
    items, depth, cur = [], 0, []
    for ch in text or "":
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth <= 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    items.append("".join(cur))
    return items


_warned = set()


def _torch_flag(key, value):
    # PyTorch's ConfigTokenizer::toBool: True/False (and their lower-case spellings) only.
    if isinstance(value, bool) or str(value).strip() in ("True", "False", "true", "false"):
        return
    raise ConfigError(f"{key}: expected True or False (as PyTorch), got {value!r}")


def _torch_mib(least):
    def check(key, value):
        n = _number(key, value, int)
        if n < least:
            raise ConfigError(f"{key}: must be at least {least} (MiB, as PyTorch), got {value!r}")
    return check


def _torch_mib_range(least, most):
    def check(key, value):
        n = _number(key, value, int)
        if not least <= n <= most:
            raise ConfigError(f"{key}: must be an integer from {least} to {most} (MiB, as torch_npu), got {value!r}")
    return check


def _torch_npu_int(least, most):
    # torch_npu's checks: an integer (not 1.5, not True) within its documented range.
    def check(key, value):
        text = str(value).strip()
        if isinstance(value, (bool, float)) or not (text.isascii() and text.isdigit()) or not least <= int(text) <= most:
            raise ConfigError(f"{key}: must be an integer from {least} to {most} (as torch_npu), got {value!r}")
    return check


def large_segment_bytes(value):
    """The large_segment_size_mb knob (MiB, more than 10: PyTorch's kMinLargeAlloc) as bytes."""
    mb = _number("large_segment_size_mb", value, int)
    if mb <= 10:
        raise ConfigError(f"large_segment_size_mb: must be more than 10 (MiB, as PyTorch), got {value!r}")
    if mb >= 2**43:
        raise ConfigError(f"large_segment_size_mb: {value!r} MiB is larger than any device")
    return mb << 20


def _torch_backend(key, value):
    if str(value).strip() not in ("native", "cudaMallocAsync"):
        raise ConfigError(f"{key}: PyTorch's allocator backend is native or cudaMallocAsync, got {value!r}")


def _torch_threads(key, value):
    n = _number(key, value, int)
    if not _pow2(n) or n > 128:
        raise ConfigError(f"{key}: must be a power of two from 1 to 128 (as PyTorch), got {value!r}")


def _torch_reserve(key, value):
    # PyTorch's parseReserveSpec: a positive fraction of the device, or GiB with a trailing G; a
    # malformed value is only a warning there (its default is kept), so it is here too.
    token = str(value).strip()
    num = token[:-1] if token[-1:] in ("G", "g") else token
    try:
        ok = math.isfinite(float(num)) and float(num) > 0
    except ValueError:
        ok = False
    if not ok:
        warnings.warn(f"{key}: ignoring invalid reserve value {token!r} (PyTorch expects a positive fraction "
                      "like 0.5 or a size like 40G)", RuntimeWarning, stacklevel=3)


def _torch_reserve_by_class(key, value):
    # "[name:value,...]": the brackets and each name:value pair are PyTorch's syntax (an error
    # there); a bad value in a pair is a warning, as above.
    text = str(value).strip()
    if not (text.startswith("[") and text.endswith("]")):
        raise ConfigError(f"{key}: expected [class:value,...] (as PyTorch), got {value!r}")
    for item in filter(None, (i.strip() for i in text[1:-1].split(","))):
        name, sep, spec = (s.strip() for s in item.partition(":"))
        if not sep or not name:
            raise ConfigError(f"{key}: item {item!r} of {value!r} is not class:value (as PyTorch)")
        _torch_reserve(key, spec)


# Keys of PyTorch's CUDA allocator config (c10 CUDAAllocatorConfig and AcceleratorAllocatorConfig)
# and of torch_npu's NPUAllocatorConfig that mean nothing for this pool, each with its owner's rule
# for its value: checked, then ignored with one warning. (Keys PyTorch shares with this pool,
# max_split_size_mb and the like, are knobs.)
TORCH_KEY_RULES = {
    "backend": _torch_backend,
    "release_lock_on_cudamalloc": _torch_flag,
    "release_lock_on_hipmalloc": _torch_flag,
    "pinned_use_cuda_host_register": _torch_flag,
    "pinned_use_host_register": _torch_flag,  # torch's newer name for the same setting
    "pinned_use_hip_host_register": _torch_flag,
    "pinned_use_background_threads": _torch_flag,
    "graph_capture_record_stream_reuse": _torch_flag,
    "pinned_free_catch_all": _torch_flag,
    "throw_on_cudamalloc_oom": _torch_flag,
    "pinned_num_register_threads": _torch_threads,
    "pinned_reserve_segment_size_mb": _torch_mib(1),
    "max_non_split_rounding_mb": _torch_mib(20),  # and at least large_segment_size_mb (knobs_to_config)
    # torch_npu's own (NPUAllocatorConfig), with its documented ranges
    "segment_size_mb": _torch_mib_range(20, 512),
    "multi_stream_lazy_reclaim": _torch_flag,
    "release_lock_on_npumalloc": _torch_flag,
    # refuse a request past per_process_memory_fraction before calling the runtime: this pool
    # never calls it past its cap, so True is what it does anyway
    "throw_on_npumalloc_oom": _torch_flag,
    "pin_memory_expandable_segments": _torch_flag,
    "pinned_mem_register": _torch_flag,
    "base_addr_aligned_kb": _torch_npu_int(0, 16),
    "pinned_max_round_threshold_mb": _torch_mib(0),
    "pinned_max_cached_size_mb": _torch_mib(0),
    "expandable_segments_reserve": _torch_reserve,
    "expandable_segments_reserve_by_class": _torch_reserve_by_class,
}


def _warn_ignored(key):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"allocator knob {key!r} (a torch_npu or PyTorch setting) has no effect on ascend_pool; "
                      "ignored", RuntimeWarning, stacklevel=3)


ROUNDUP_INTERVALS = 16  # as PyTorch: [1, 2) MiB, [2, 4) MiB, ... the last one open


def _pow2(n):
    return n > 0 and not n & (n - 1)


ROUNDUP_MAX_DIVISIONS = 1 << 31


def parse_roundup_divisions(value):
    """PyTorch's roundup_power2_divisions: a number (every interval) or "[MiB:N,...,>:N]" -> a
    list of 16 divisions, interval i holding sizes in [2^i, 2^(i+1)) MiB."""
    key = "roundup_power2_divisions"

    def div(v):
        n = _number(key, v, int)
        if n != 0 and not _pow2(n):
            raise ConfigError(f"{key}: divisions must be a power of two or 0, got {v!r}")
        if n > ROUNDUP_MAX_DIVISIONS:  # the C field's bound; far past it, steps are below 512 bytes anyway
            raise ConfigError(f"{key}: divisions must be at most {ROUNDUP_MAX_DIVISIONS} (2**31), got {v!r}")
        return n

    if isinstance(value, (list, tuple)):
        if len(value) != ROUNDUP_INTERVALS:
            raise ConfigError(f"{key}: a list must hold {ROUNDUP_INTERVALS} entries, got {len(value)}")
        return [div(v) for v in value]
    text = str(value).strip()
    if not text.startswith("["):
        return [div(text)] * ROUNDUP_INTERVALS
    if not text.endswith("]"):
        raise ConfigError(f"{key}: unclosed list {value!r}")
    out, last = [0] * ROUNDUP_INTERVALS, None
    for item in text[1:-1].split(","):
        if item.count(":") != 1:
            raise ConfigError(f"{key}: item {item!r} of {value!r} is not MiB:divisions")
        size, n = (x.strip() for x in item.split(":"))
        n = div(n)
        if size == ">":
            for i in range((last + 1) if last is not None else 0, ROUNDUP_INTERVALS):
                out[i] = n
            continue
        mib = _number(key, size, int)
        if not _pow2(mib):
            raise ConfigError(f"{key}: interval {size!r} must be a power of two (MiB)")
        idx = min(mib.bit_length() - 1, ROUNDUP_INTERVALS - 1)
        if last is None:
            out[:idx] = [n] * idx
        out[idx] = n
        last = idx
    return out


def parse_conf_string(text, source=ENV_VAR):
    """{key: value-string} from "key:value,key:value"; ConfigError on malformed items."""
    out = {}
    for item in _split_items(text):
        item = item.strip()
        if not item:
            continue
        if ":" not in item:
            raise ConfigError(f"{source}: item {item!r} is not key:value")
        key, value = (s.strip() for s in item.split(":", 1))
        if not key:
            raise ConfigError(f"{source}: item {item!r} has no key")
        out[key] = value
    return out


def max_split_bytes(value):
    """The max_split_size_mb knob (MiB, more than 20) as bytes."""
    mb = _number("max_split_size_mb", value)
    if mb <= 20:
        raise ConfigError(f"max_split_size_mb: must be more than 20 (MiB), got {value!r}")
    if mb * 2**20 >= 2**63:
        raise ConfigError(f"max_split_size_mb: {value!r} MiB is larger than any device")
    return int(mb * 2**20)


def _torch_flag_value(knobs, *keys):
    return any(str(knobs[k]).strip() in ("True", "true") for k in keys if k in knobs)


def allocator_settings(knobs):
    """A snapshot's allocator_settings, as PyTorch's _snapshot() reports them, from a pool's
    (checked) knobs: PyTorch's settings with their effective values, this pool's defaults where
    a knob is not set (max_split_size in bytes, -1 for unlimited as PyTorch; garbage_collection_
    threshold 0.0: off; expandable_segments; roundup_power2_divisions as {interval start in MiB:
    divisions}, 0: no rounding; pinned_num_register_threads, release_lock_on_cudamalloc,
    pinned_use_cuda_host_register, graph_capture_record_stream_reuse: PyTorch's settings this pool
    ignores, as set), the knob string under ENV_VAR, and each knob set, under its own name."""
    out = {str(k): str(v) for k, v in knobs.items()}
    out[ENV_VAR] = ",".join(f"{k}:{v}" for k, v in knobs.items())
    out["max_split_size"] = max_split_bytes(knobs["max_split_size_mb"]) if "max_split_size_mb" in knobs else -1
    out["garbage_collection_threshold"] = float(knobs.get("garbage_collection_threshold", 0.0))
    out["expandable_segments"] = _bool("expandable_segments", knobs.get("expandable_segments", False))
    out["pinned_num_register_threads"] = int(knobs.get("pinned_num_register_threads", 1))
    out["release_lock_on_cudamalloc"] = _torch_flag_value(knobs, "release_lock_on_cudamalloc", "release_lock_on_hipmalloc")
    out["pinned_use_cuda_host_register"] = _torch_flag_value(knobs, "pinned_use_cuda_host_register",
                                                             "pinned_use_hip_host_register")
    out["graph_capture_record_stream_reuse"] = _torch_flag_value(knobs, "graph_capture_record_stream_reuse")
    divisions = parse_roundup_divisions(knobs.get("roundup_power2_divisions", 0))
    out["roundup_power2_divisions"] = {str(1 << i): n for i, n in enumerate(divisions)}
    return out


def fraction_knob(key, value):
    """The fraction of memory_fraction (or per_process_memory_fraction) = value, else ConfigError."""
    f = _number(key, value)
    # PyTorch's per_process_memory_fraction takes 0 (nothing may be allocated); ours does not
    zero_ok = key == "per_process_memory_fraction"
    if not (0 <= f <= 1 and (f > 0 or zero_ok)):
        raise ConfigError(f"{key}: must be in {'[' if zero_ok else '('}0, 1], got {value!r}")
    return f


def knobs_fraction(knobs):
    """The memory fraction knobs set (the last of memory_fraction and per_process_memory_fraction,
    the cap in force, as knobs_to_config), or None: read without a device."""
    found = None
    for key, value in knobs.items():
        if key in ("memory_fraction", "per_process_memory_fraction"):
            found = fraction_knob(key, value)
    return found


def knobs_to_config(knobs, device_total_bytes, device_free_bytes, backend_kind="acl"):
    """Turns knobs into the compiled pool's config fields (bytes and flags)."""
    cfg = {"pad_bytes": 32 if backend_kind == "acl" else 0}
    cap_key = None
    for key, value in knobs.items():
        if key == "max_split_size_mb":
            cfg["max_split_size"] = max_split_bytes(value)
        elif key == "garbage_collection_threshold":
            t = _number(key, value)
            if not 0 < t < 1:
                raise ConfigError(f"garbage_collection_threshold: must be in (0, 1), got {value!r}")
            cfg["gc_threshold"] = t
        elif key == "reserve":
            kind, v = _fraction_or_bytes(key, value)
            n = int(v * device_free_bytes) if kind == "fraction" else v
            if n > device_free_bytes:
                raise ConfigError(f"reserve: {n} bytes is more than the device's {device_free_bytes} free bytes")
            cfg["reserve_bytes"] = n
        elif key == "record_history":
            if _is_bool(value) or (isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE):
                cfg["history_capacity"] = DEFAULT_HISTORY if _bool(key, value) else 0
            else:
                n = _number(key, value, int)
                if not 0 <= n < 2**63:
                    raise ConfigError(f"record_history: entries must be in [0, 2**63), got {value!r}")
                cfg["history_capacity"] = min(n, MAX_HISTORY_ENTRIES)  # as pool.record_memory_history clamps
        elif key == "page_size":
            v = str(value).strip().lower()
            if v in ("2m", "2mb", "2mib", str(2 << 20)):
                cfg["page_size"] = 2 << 20
            elif v in ("1g", "1gb", "1gib", str(1 << 30)):
                cfg["page_size"] = 1 << 30
            else:
                raise ConfigError(f"page_size: must be 2m or 1g, got {value!r}")
        elif key == "expandable_segments":
            cfg["expandable"] = 1 if _bool(key, value) else 0
        elif key == "release_policy":
            if value not in RELEASE_POLICIES:
                raise ConfigError(f"release_policy: must be one of {sorted(RELEASE_POLICIES)}, got {value!r}")
            cfg["release_policy"] = value  # the compiled pool maps the name to its enum
        elif key == "stream_reuse":
            if value not in STREAM_REUSE:
                raise ConfigError(f"stream_reuse: must be one of {sorted(STREAM_REUSE)}, got {value!r}")
            cfg["stream_reuse"] = value
        elif key in ("memory_fraction", "per_process_memory_fraction"):
            f = fraction_knob(key, value)
            cfg["limit_bytes"] = int(f * device_total_bytes)
            cap_key = key  # the last one set is the cap in force
        elif key == "sync_timeout_ms":
            ms = _number(key, value, int)
            if ms < -1 or ms == 0 or ms >= 2**31:
                raise ConfigError(f"sync_timeout_ms: must be positive (below 2**31) or -1 (forever), got {value!r}")
            cfg["sync_timeout_ms"] = ms
        elif key == "pad_bytes":
            n = _number(key, value, int)
            if not 0 <= n <= 4096:
                raise ConfigError(f"pad_bytes: must be in [0, 4096], got {value!r}")
            cfg["pad_bytes"] = n
        elif key == "roundup_power2_divisions":
            cfg["roundup_divisions"] = parse_roundup_divisions(value)
        elif key == "large_segment_size_mb":
            cfg["large_segment"] = large_segment_bytes(value)
        elif key in TORCH_KEY_RULES:
            TORCH_KEY_RULES[key](key, value)
            _warn_ignored(key)
        else:
            raise ConfigError(f"unknown allocator knob {key!r} (known: max_split_size_mb, "
                              "garbage_collection_threshold, reserve, record_history, page_size, "
                              "expandable_segments, release_policy, stream_reuse, memory_fraction, sync_timeout_ms, pad_bytes, "
                              "roundup_power2_divisions, large_segment_size_mb, and torch_npu's and PyTorch's "
                              "allocator keys)")
    large = cfg.get("large_segment", 20 << 20)
    if cfg.get("max_split_size", large) < large:
        raise ConfigError(f"max_split_size_mb: must be at least large_segment_size_mb ({large >> 20} MiB, as PyTorch), "
                          f"got {knobs['max_split_size_mb']!r}")
    if "max_non_split_rounding_mb" in knobs and _number("max_non_split_rounding_mb", knobs["max_non_split_rounding_mb"], int) << 20 < large:
        raise ConfigError(f"max_non_split_rounding_mb: must be at least large_segment_size_mb ({large >> 20} MiB, as "
                          f"PyTorch), got {knobs['max_non_split_rounding_mb']!r}")
    page = cfg.get("page_size", 2 << 20)
    held = -(-cfg.get("reserve_bytes", 0) // page) * page  # the reserve is taken in whole pages
    if held > cfg.get("limit_bytes", float("inf")):
        raise ConfigError(f"reserve: {cfg['reserve_bytes']} bytes ({held} in {page}-byte pages) is more than the "
                          f"{cap_key} cap of {cfg['limit_bytes']} bytes: the pool could never hold what it "
                          "preallocates")
    return cfg


def use_framework_conf(*names):
    """Called by a framework integration's install(): while $ASCEND_POOL_CONF is unset, pools
    take their knobs from the first of these variables that is set (the framework's own, e.g.
    PYTORCH_NPU_ALLOC_CONF), so a user who switches allocators keeps their settings."""
    for name in names:
        if name not in _framework_vars:
            _framework_vars.append(name)


def conf_source(env=None):
    """(variable, text): where pools read their knob string: $ASCEND_POOL_CONF when set (not
    blank), else the first framework variable set (use_framework_conf), else ($ASCEND_POOL_CONF,
    its value)."""
    env = os.environ if env is None else env
    if not env.get(ENV_VAR, "").strip():  # unset or blank: nothing of ours to take
        for name in _framework_vars:
            if env.get(name, "").strip():
                if name not in _told:
                    _told.add(name)
                    log.info("no $%s: the allocator knobs come from $%s=%r", ENV_VAR, name, env[name])
                return name, env[name]
    return ENV_VAR, env.get(ENV_VAR, "")


_runtime = ({}, ())  # (knobs, keys dropped first): the last _set_allocator_settings (ascend_pool.settings)


def set_runtime_knobs(knobs, reset=()):
    """Pools made from now on take these knobs over the environment string's, the `reset` keys
    dropped first (torch's _set_allocator_settings, whose parse resets them when not given)."""
    global _runtime
    _runtime = (dict(knobs), tuple(reset))  # one assignment: a pool opening meanwhile reads old or new


def runtime_state():
    """The last set_runtime_knobs' object (a new one at each call): ascend_pool.settings tells by
    its identity whether the settings changed while a pool was opening."""
    return _runtime


def effective_knobs(overrides=None, env=None):
    """Knobs from the environment string (conf_source), then the last _set_allocator_settings
    (set_runtime_knobs), overridden by keyword arguments."""
    name, text = conf_source(env)
    knobs = parse_conf_string(text, name)
    runtime, reset = _runtime
    if runtime or reset:
        for key in reset:
            knobs.pop(key, None)
        knobs.update(runtime)
    knobs.update(overrides or {})
    return knobs

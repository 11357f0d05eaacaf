"""torch's _set_allocator_settings at runtime: a knob string applied to every open pool of the
process and kept for the pools made later, as torch's allocator config is one per process.

What can change in an open pool is what torch re-reads on each call: max_split_size_mb,
garbage_collection_threshold and roundup_power2_divisions (each reset to off when a call does not
set it, as torch's parseArgs resets them) and the memory cap (memory_fraction,
per_process_memory_fraction). A knob that shapes the pool for its life (expandable_segments,
page_size, reserve, release_policy, large_segment_size_mb, ...) is accepted when it leaves every open pool as it is, and otherwise
refused with a ConfigError naming it, before anything changed: an open pool cannot take segments
of another kind. torch's settings that mean nothing here warn once, as in the knob string."""

import os
import threading

from . import config as _config
from . import registry as _registry
from ._core import config_defaults
from .errors import ConfigError, ConfigTypeError, PoolError

RESET_KEYS = ("max_split_size_mb", "garbage_collection_threshold", "roundup_power2_divisions")  # torch: off unless
# given again (its parseArgs resets them at each call)
LIMIT_KEYS = ("memory_fraction", "per_process_memory_fraction")
# ap_config_default's values (cython/core/pool.c) for the fields a pool's knobs did not set
_DEFAULT_FIELDS = config_defaults()

_lock = threading.RLock()  # one call's checks and changes at a time (re-entrant: a signal handler)
lock = _lock  # held by a Pool's second open (Pool.__init__): no call comes between its read and registration


def _after_fork_in_child():
    # A thread inside a call (or a Pool's second open) at the fork leaves the child's copy held for
    # good, and every Pool() of the child takes it to register (register_opened): each hung.
    global _lock, lock
    _lock = lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _kind(pool):
    return "acl" if pool.backend.kind == "acl" else "cuda"


def _plan(pool, given):
    """(knobs, cfg) the settings give pool, after checking that they leave its lifelong knobs
    as they are; ConfigError naming the first knob that would change one."""
    knobs = {k: v for k, v in pool.knobs.items() if k not in RESET_KEYS}
    knobs.update(given)
    free_b, total_b = pool.backend.mem_info(pool.device)
    cfg = _config.knobs_to_config(knobs, total_b, free_b, _kind(pool))
    for key, value in given.items():
        if key in RESET_KEYS or key in LIMIT_KEYS:
            continue
        fields = set(_config.knobs_to_config({key: value}, total_b, free_b, _kind(pool)))
        if key != "pad_bytes":
            fields.discard("pad_bytes")
        for field in sorted(fields):
            now, new = pool.config.get(field, _DEFAULT_FIELDS.get(field)), cfg[field]
            if (list(now) != list(new)) if field == "roundup_divisions" else now != new:
                raise ConfigError(
                    f"_set_allocator_settings: {key}:{value} cannot change at runtime: {pool!r} keeps what it "
                    f"was opened with for its life ({key} {pool.knobs.get(key, 'not set')}); set it in "
                    f"${_config.conf_source()[0]} before the first allocation (max_split_size_mb, "
                    "garbage_collection_threshold, roundup_power2_divisions and memory_fraction change at runtime)")
    return knobs, cfg


def register_opened(pool, seen):
    """Registers pool, just opened with the knobs read at runtime state `seen`
    (config.runtime_state()), when no set_allocator_settings came in between: then the next one
    sees it among the live pools. Returns False, registering nothing, when one did (the pool read
    the old settings and that call did not see it): the caller opens it again, as torch's
    settings reach its allocator at once."""
    with _lock:
        if _config.runtime_state() is not seen:
            return False
        _registry.register(pool)
        return True


def set_allocator_settings(settings):
    """torch.cuda.memory._set_allocator_settings(settings) (and torch_npu's): "key:value,..."
    as PYTORCH_NPU_ALLOC_CONF, applied to every open pool (default pools, tenant contexts, the
    program's own) and kept for pools made later (keyword arguments of a later Pool still win),
    a pool another thread is opening meanwhile included (opened again if it read the old ones).
    See the module docstring for what may change; ConfigError names a bad or fixed knob, and
    then nothing changed."""
    if not isinstance(settings, str):
        raise ConfigTypeError(f"_set_allocator_settings: settings must be a str, got {type(settings).__name__}")
    given = _config.parse_conf_string(settings, "_set_allocator_settings")
    with _lock:
        plans = []
        for pool in _registry.live_pools():
            try:
                plans.append((pool, *_plan(pool, given)))
            except PoolError:
                if not pool.closed:  # closed by another thread meanwhile: nothing to change
                    raise
        if not plans:  # no pool to check them against: checked as a new pool will read them
            _config.knobs_to_config(dict(given), 1 << 62, 1 << 62)
        for pool, knobs, cfg in plans:
            try:
                pool._set_tunables(cfg.get("max_split_size"), cfg.get("gc_threshold", 0.0),
                                   cfg.get("roundup_divisions", _DEFAULT_FIELDS["roundup_divisions"]))
                if any(k in given for k in LIMIT_KEYS):
                    pool.set_limit(limit_bytes=cfg["limit_bytes"])
            except PoolError:
                if not pool.closed:
                    raise
                continue
            pool.knobs = knobs  # what its snapshots' allocator_settings and its new contexts read
        _config.set_runtime_knobs(given, RESET_KEYS)

"""Replaying allocation traces (format: shared/traces/README.md) through the pool or directly
through the device, with the per-operation loop in C."""

from collections.abc import Mapping

import numpy as np

from ._core import replay_arrays
from .backend import open_backend
from .errors import ConfigTypeError
from .pool import Pool
from .traces import Trace, load_trace


def replay(trace, backend=None, mode="pool", device=0, pool_knobs=None):
    """Replays trace (a Trace or a path to NAME.npz) on a fresh pool (mode "pool") or with one
    device call per allocation and free (mode "direct"). Returns a dict: allocs, frees, seconds,
    ops_per_second, peak_live_bytes, peak_reserved_bytes, fragmentation_ratio (the
    ascend_pool_fragmentation_ratio metric, 1 - largest free block / cached free bytes, 0..1, read
    right after the allocation that first reaches peak reserved; 0 in direct mode, which caches
    nothing), reserved_to_live_ratio (= peak reserved / peak live), device_mallocs, device_frees, device_calls (mallocs and frees, plus maps and
    unmaps of expandable segments), device_calls_steady (the same, during the second half of the
    events), final_allocated_bytes (0 after a complete trace), plus trace, mode and backend.
    Streams other than 0 get streams of their own; stream 0 is the default stream."""
    if mode not in ("pool", "direct"):
        raise ValueError(f"mode must be 'pool' or 'direct', got {mode!r}")
    if pool_knobs is not None and not isinstance(pool_knobs, Mapping):
        raise ConfigTypeError(f"pool_knobs must be a dict of allocator knobs (config.parse_conf_string makes one of "
                              f"'key:value,...'), got {type(pool_knobs).__name__} {pool_knobs!r}")
    if not isinstance(trace, Trace):
        trace = load_trace(trace)
    be = backend if hasattr(backend, "device_count") else open_backend(backend)
    numbers = sorted(set(np.unique(trace.stream).tolist()))
    index = {n: i for i, n in enumerate(numbers)}
    stream_idx = np.ascontiguousarray(np.vectorize(index.get, otypes=[np.int32])(trace.stream)) \
        if len(numbers) > 1 or numbers != [0] else np.zeros(len(trace.op), dtype=np.int32)
    pool = Pool(device, backend=be, **(pool_knobs or {})) if mode == "pool" else None
    handles = [None if n == 0 else (pool.create_stream() if pool else be.stream_create(device)) for n in numbers]
    try:
        r = replay_arrays(pool, be, device, mode,
                          np.ascontiguousarray(trace.op, dtype=np.int8),
                          np.ascontiguousarray(trace.slot, dtype=np.int32),
                          np.ascontiguousarray(trace.size, dtype=np.int64),
                          stream_idx, handles, int(trace.n_slots))
        if pool is not None:
            r["pool_stats"] = pool.memory_stats()
    finally:
        if pool is not None:
            for h in handles:
                if h is not None:
                    pool.destroy_stream(h)
            pool.close()
        else:
            for h in handles:
                if h is not None:
                    be.stream_destroy(h)
    ops = r["allocs"] + r["frees"]
    r["ops_per_second"] = ops / r["seconds"] if r["seconds"] > 0 else float("inf")
    r["fragmentation_ratio"] = r.pop("fragmentation_at_peak") if pool is not None else 0.0
    r["reserved_to_live_ratio"] = r["peak_reserved_bytes"] / r["peak_live_bytes"] if r["peak_live_bytes"] else 0.0
    maps = r["pool_stats"]["num_device_map"] + r["pool_stats"]["num_device_unmap"] if pool is not None else 0
    r.update(trace=trace.name, mode=mode, backend=be.name, device_calls=r["device_mallocs"] + r["device_frees"] + maps)
    return r

"""Snapshots in PyTorch's memory-snapshot schema, so that `python -m torch.cuda._memory_viz
stats|trace FILE.pickle` and the memory_viz web page read them."""

import os
import pickle
import threading

from . import registry as _registry
from ._core import history_set_meta
from .config import HISTORY_ACTIONS, allocator_settings
from .errors import ConfigError, ConfigTypeError

_STATES = ("inactive", "active_allocated", "active_pending_free")

# torch's _set_memory_metadata: the C history records an id per entry, filed here. A string is kept
# while an entry of some pool's ring may name it (or it is the current one): past _meta_compact_at
# strings the rings are read and the others dropped, so that code tagging every step with a
# string of its own ("step 1234", torch's use) does not keep them all for the process's life.
# Ids are never reused: a history read just before a drop shows "" for a dropped one, not another's.
_meta_lock = threading.RLock()  # re-entrant, as every module lock (ARCHITECTURE.md: signal handlers)
_meta_texts = {0: ""}
_meta_ids = {"": 0}
_meta_current = 0
_meta_next = 1
META_COMPACT_MIN = 4096
_meta_compact_at = META_COMPACT_MIN


def _after_fork_in_child():
    global _meta_lock  # a thread of the parent may have held it at the fork: it is not ours
    _meta_lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _meta_in_use():
    """The ids the history rings of this process's open pools hold (_meta_lock held)."""
    used = {0, _meta_current}
    for pool in _registry.live_pools():
        try:
            used |= pool._history_metas()  # (a snapshot would add its own event to the trace)
        except Exception:  # closed meanwhile: its ring is gone
            continue
    return used


def _meta_compact():
    global _meta_compact_at
    used = _meta_in_use()
    for meta in [m for m in _meta_texts if m not in used]:
        del _meta_ids[_meta_texts.pop(meta)]
    _meta_compact_at = max(META_COMPACT_MIN, 2 * len(_meta_texts))


def set_memory_metadata(metadata):
    """torch.cuda.memory._set_memory_metadata(): every pool's history entries recorded from now
    on carry `metadata` (a str; "" clears it) as their user_metadata in snapshots, process-wide."""
    global _meta_current, _meta_next
    if not isinstance(metadata, str):
        raise ConfigTypeError(f"_set_memory_metadata: metadata must be a str, got {metadata!r}")
    with _meta_lock:
        meta = _meta_ids.get(metadata)
        if meta is None:
            if _meta_next > 0xFFFFFFFF:
                raise ConfigError("_set_memory_metadata: 2**32 distinct metadata strings filed already")
            if len(_meta_texts) >= _meta_compact_at:
                _meta_compact()
            meta = _meta_ids[metadata] = _meta_next
            _meta_texts[meta] = metadata
            _meta_next += 1
        _meta_current = meta
        history_set_meta(meta)


def get_memory_metadata():
    """torch.cuda.memory._get_memory_metadata(): the metadata set last ("" when none)."""
    return _meta_texts[_meta_current]


def build(device, segments, history, knobs, frames=None, entry_frames=True, pool_id=(0, 0)):
    """segments: [(base, size, pool, stream, [(addr, size, requested, state, ctx)], expandable[, ctx])]
    (a segment's ctx: the frames of the allocation that created it, as torch's segment frames);
    history: [(action, addr, size, stream, time_us[, ctx[, meta]])] oldest first (meta: a
    set_memory_metadata id); frames: {ctx: [frame
    dicts]} recorded with stacks="python" (a live block gets the frames of its allocation, which
    the block keeps: ctx); knobs:
    the pool's, whose effective values make allocator_settings (config.allocator_settings);
    entry_frames False: trace entries show no frames (torch's context="state"; blocks keep theirs).
    An oom entry carries the device's free bytes as device_free instead of addr, as torch's.
    pool_id: the pool's (Pool.pool_id), every segment's segment_pool_id and every trace entry's pool_id."""
    frames = frames or {}
    history = [(*h, 0, 0)[:7] for h in history]
    out_segments = []
    for base, size, pool, stream, blocks, expandable, *seg_ctx in sorted(segments, key=lambda s: s[0]):
        out_blocks = [
            {"address": addr, "size": bsize, "requested_size": req, "state": _STATES[state],
             "frames": frames.get(ctx, []) if state else []}
            for addr, bsize, req, state, ctx in blocks
        ]
        out_segments.append({
            "device": device,
            "address": base,
            "total_size": size,
            "allocated_size": sum(b["size"] for b in out_blocks if b["state"] == "active_allocated"),
            "active_size": sum(b["size"] for b in out_blocks if b["state"] != "inactive"),
            "requested_size": sum(b["requested_size"] for b in out_blocks if b["state"] != "inactive"),
            "stream": stream,
            "segment_type": "small" if pool == 0 else "large",
            "segment_pool_id": tuple(pool_id),
            "is_expandable": expandable,
            "frames": frames.get(seg_ctx[0], []) if seg_ctx else [],
            "blocks": out_blocks,
        })
    events = [
        {"action": HISTORY_ACTIONS[action], "device_free" if HISTORY_ACTIONS[action] == "oom" else "addr": addr,
         "size": size, "stream": stream, "time_us": t, "frames": frames.get(ctx, []) if entry_frames else [],
         "compile_context": "N/A", "user_metadata": _meta_texts.get(meta, ""),  # torch puts both on every entry
         "pool_id": tuple(pool_id)}  # torch's TraceEntry.pool_id: which MemPool the entry is of
        for action, addr, size, stream, t, ctx, meta in history
    ]
    return {
        "segments": out_segments,
        "device_traces": [[] for _ in range(device)] + [events],
        "allocator_settings": allocator_settings(knobs),
    }


def merge(snapshots):
    """One snapshot of several pools' (PyTorch's _snapshot() covers every device and every
    allocation): segments side by side, each device's trace in time order."""
    out = {"segments": [], "device_traces": [], "allocator_settings": {}}
    for snap in snapshots:
        out["segments"] += snap["segments"]
        traces = snap["device_traces"]
        while len(out["device_traces"]) < len(traces):
            out["device_traces"].append([])
        for dev, trace in enumerate(traces):
            out["device_traces"][dev] += trace
        out["allocator_settings"].update(snap["allocator_settings"])
    for trace in out["device_traces"]:
        trace.sort(key=lambda e: e["time_us"])  # stable: one pool's events keep their order
    return out


def output_path(path, what):
    """path if it names a file (str or os.PathLike), else ConfigError: open() would take an int as
    a file descriptor, and write to (then close) stdout or whatever else it is."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ConfigError(f"{what}: path must be a file name (str or os.PathLike), got {path!r}")
    return path


def dump(snapshot, path):
    """Writes a snapshot as the pickle file that torch.cuda._memory_viz reads (path: a file name)."""
    with open(output_path(path, "dump_snapshot"), "wb") as f:
        pickle.dump(snapshot, f)

"""Snapshots in PyTorch's memory-snapshot schema, so that `python -m torch.cuda._memory_viz
stats|trace FILE.pickle` and the memory_viz web page read them."""

import os
import pickle

from .config import HISTORY_ACTIONS, allocator_settings
from .errors import ConfigError

_STATES = ("inactive", "active_allocated", "active_pending_free")


def build(device, segments, history, knobs, frames=None, entry_frames=True, pool_id=(0, 0)):
    """segments: [(base, size, pool, stream, [(addr, size, requested, state, ctx)], expandable[, ctx])]
    (a segment's ctx: the frames of the allocation that created it, as torch's segment frames);
    history: [(action, addr, size, stream, time_us[, ctx])] oldest first; frames: {ctx: [frame
    dicts]} recorded with stacks="python" (a live block gets the frames of its allocation, which
    the block keeps: ctx); knobs:
    the pool's, whose effective values make allocator_settings (config.allocator_settings);
    entry_frames False: trace entries show no frames (torch's context="state"; blocks keep theirs).
    An oom entry carries the device's free bytes as device_free instead of addr, as torch's.
    pool_id: the pool's (Pool.pool_id), every segment's segment_pool_id."""
    frames = frames or {}
    history = [h if len(h) == 6 else (*h, 0) for h in history]
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
         "compile_context": "N/A", "user_metadata": ""}  # torch puts both on every entry (its defaults)
        for action, addr, size, stream, t, ctx in history
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

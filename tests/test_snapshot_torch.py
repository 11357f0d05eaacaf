"""Snapshots are read by PyTorch's own memory_viz tools (the real torch package)."""

import os
import pickle
import subprocess
import sys

import pytest

import ascend_pool as ap
from ascend_pool.replay import replay
from ascend_pool.snapshot import dump
from ascend_pool.traces import bundled_traces_dir, load_trace



def _replay_and_snapshot(tmp_path):
    trace = load_trace(os.path.join(bundled_traces_dir(), "resnet18_train_prefix.npz"))
    pool = ap.Pool(0, backend="sim", record_history=True)
    live = {}
    for op, slot, size in zip(trace.op[:600], trace.slot[:600], trace.size[:600]):
        if op:
            live[slot] = pool.malloc(int(size))
        elif slot in live:
            pool.free(live.pop(slot))
    snap = pool.snapshot()
    path = tmp_path / "snap.pickle"
    dump(snap, path)
    for ptr in live.values():
        pool.free(ptr)
    pool.close()
    return snap, path


def test_snapshot_schema(tmp_path):
    snap, path = _replay_and_snapshot(tmp_path)
    assert set(snap) >= {"segments", "device_traces", "allocator_settings"}
    for seg in snap["segments"]:
        assert set(seg) >= {"device", "address", "total_size", "allocated_size", "active_size",
                            "requested_size", "stream", "segment_type", "blocks"}
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
        assert seg["segment_type"] in ("small", "large")
        for b in seg["blocks"]:
            assert b["state"] in ("active_allocated", "active_pending_free", "inactive")
    actions = {e["action"] for e in snap["device_traces"][0]}
    assert {"alloc", "free_requested", "free_completed", "segment_alloc"} <= actions
    for e in snap["device_traces"][0]:  # torch's keys on every entry (code reads e["compile_context"])
        assert {"action", "size", "stream", "time_us", "frames", "compile_context", "user_metadata"} <= set(e)
        assert ("device_free" if e["action"] == "oom" else "addr") in e
    assert pickle.loads(path.read_bytes())["segments"] == snap["segments"]


@pytest.mark.parametrize("command", ["stats", "trace"])
def test_torch_memory_viz_reads_our_snapshot(tmp_path, command):
    snap, path = _replay_and_snapshot(tmp_path)
    out = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", command, str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    if command == "stats":
        assert f"segments: {len(snap['segments'])}" in out.stdout
        reserved_mib = sum(s["total_size"] for s in snap["segments"]) / 2**20
        assert f"total_reserved: {reserved_mib:.1f}MiB" in out.stdout
    else:  # torch names a segment allocation cudaMalloc and a free "del"
        assert "cudaMalloc(" in out.stdout and "del " in out.stdout

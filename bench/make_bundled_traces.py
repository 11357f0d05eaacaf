#!/usr/bin/env python3
"""Regenerate the small traces bundled with the package (``ascend_pool/traces/``).

Each bundled trace is a prefix of a shared trace (``../shared/traces/``), cut at a phase boundary
that the source's sidecar JSON names, followed by *closing frees*: one free for every allocation
still live at the cut, in reverse allocation order, carrying that allocation's id, size and stream,
so that the bundled trace ends with everything freed like the shared ones. The format is unchanged
(``op`` int8, ``id`` int64, ``size`` int64, ``stream`` int32); a sidecar ``.json`` says where the
trace came from. Files are written byte-for-byte reproducibly (fixed zip timestamps).

    python bench/make_bundled_traces.py [--source DIR] [--out DIR]
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import zipfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from ascend_pool.traces import load_trace, peak_live_bytes, trace_from_arrays  # noqa: E402

MAX_BYTES = 100_000

# (bundled name, source trace, phase at which the prefix stops, why)
CUTS = [
    ("resnet18_train_prefix", "resnet18_train", "eval10_b64",
     "model upload, 8 training steps (the last one with a short batch) and 2 evaluation passes: "
     "long enough to reach the full trace's peak reserved memory under torch_npu's policy"),
    ("resnet18_train_prefetch_2stream_prefix", "resnet18_train_prefetch_2stream", "train3",
     "model upload and 3 training steps with the prefetcher's copies on stream 1: "
     "a two-stream trace that reaches the full trace's peak reserved memory under torch_npu's policy"),
    ("bert_serving_varlen_prefix", "bert_serving_varlen", "batch80_b8_t507",
     "model upload and the first 80 variable-length serving batches"),
]


def default_source() -> Path:
    env = os.environ.get("ASCEND_POOL_TRACES")
    if env:
        return Path(env)
    for d in (Path.cwd() / ".." / "shared" / "traces", REPO.parent / "shared" / "traces"):
        if d.is_dir():
            return d.resolve()
    raise SystemExit("no source trace directory: pass --source or set ASCEND_POOL_TRACES")


def write_npz(path: Path, arrays: dict) -> None:
    """Like np.savez_compressed, but with fixed timestamps so the bytes do not change between runs."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for key, arr in arrays.items():
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            data = io.BytesIO()
            np.lib.format.write_array(data, np.ascontiguousarray(arr), allow_pickle=False)
            zf.writestr(info, data.getvalue(), compresslevel=9)
    path.write_bytes(buf.getvalue())


def cut(source_dir: Path, out_dir: Path, name: str, src: str, phase: str, why: str) -> dict:
    src_npz = source_dir / f"{src}.npz"
    with np.load(src_npz) as d:
        op, ids, size, stream = (d[k] for k in ("op", "id", "size", "stream"))
    meta = json.loads((source_dir / f"{src}.json").read_text())
    starts = {p["name"]: p["first_event_index"] for p in meta.get("phases", [])}
    if phase not in starts:
        raise SystemExit(f"{src}: no phase {phase!r} in its sidecar")
    n = int(starts[phase])
    op, ids, size, stream = op[:n], ids[:n], size[:n], stream[:n]

    # allocations still live at the cut, in allocation order
    alloc_pos = np.flatnonzero(op == 1)
    freed = set(ids[op == 0].tolist())
    live = [int(p) for p in alloc_pos if int(ids[p]) not in freed]
    close = np.array(live[::-1], dtype=np.int64)
    op_out = np.concatenate([op, np.zeros(close.size, dtype=np.int8)]).astype(np.int8)
    id_out = np.concatenate([ids, ids[close]]).astype(np.int64)
    size_out = np.concatenate([size, size[close]]).astype(np.int64)
    stream_out = np.concatenate([stream, stream[close]]).astype(np.int32)

    tr = trace_from_arrays(op_out, id_out, size_out, stream_out, name=name)  # validates
    out_npz = out_dir / f"{name}.npz"
    write_npz(out_npz, {"op": op_out, "id": id_out, "size": size_out, "stream": stream_out})
    nbytes = out_npz.stat().st_size
    if nbytes >= MAX_BYTES:
        raise SystemExit(f"{out_npz} is {nbytes} bytes (limit {MAX_BYTES}): cut earlier")

    side = {
        "name": name,
        "bundled": True,
        "description": f"Prefix of the shared trace {src!r} ({why}), then closing frees.",
        "source": {
            "trace": src,
            "file": f"shared/traces/{src}.npz",
            "sha256": hashlib.sha256(src_npz.read_bytes()).hexdigest(),
            "events_in_source": int(meta.get("counts", {}).get("n_events", 0)),
            "description": meta.get("description"),
            "workload": meta.get("workload"),
            "variant": meta.get("variant"),
        },
        "cut": {
            "prefix_events": n,
            "stops_before_phase": phase,
            "closing_frees": int(close.size),
            "closing_free_order": "reverse allocation order; each carries its allocation's id, size and stream",
        },
        "phases": [p for p in meta.get("phases", []) if p["first_event_index"] < n],
        "counts": {"n_events": tr.n_events, "n_alloc": tr.n_allocs, "n_free": tr.n_frees},
        "peak_live_bytes": peak_live_bytes(tr),
        "allocs_per_stream": {str(s): int(((op_out == 1) & (stream_out == s)).sum()) for s in tr.streams},
        "all_freed_at_end": True,
        "npz_bytes": nbytes,
        "format": meta.get("format", "npz arrays op(int8), id(int64), size(int64), stream(int32)"),
        "generator": {"script": "bench/make_bundled_traces.py",
                      "command": "python bench/make_bundled_traces.py",
                      "source_generator": meta.get("generator", {}).get("script")},
    }
    (out_dir / f"{name}.json").write_text(json.dumps(side, indent=1) + "\n")
    load_trace(out_npz)  # round trip
    return {"name": name, "events": tr.n_events, "closing_frees": int(close.size), "npz_bytes": nbytes,
            "peak_live_mib": round(peak_live_bytes(tr) / 2**20, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, default=None, help="shared trace directory (default ../shared/traces)")
    ap.add_argument("--out", type=Path, default=REPO / "ascend_pool" / "traces")
    args = ap.parse_args(argv)
    source = args.source or default_source()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, src, phase, why in CUTS:
        print(cut(source, args.out, name, src, phase, why))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

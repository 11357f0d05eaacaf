"""Bring your own workload: a PyTorch memory snapshot (``torch.cuda.memory._dump_snapshot`` or
torch_npu's, or ascend_pool's own) turned into a trace (ascend_pool.traces) that replays exactly
like the equivalent ``.npz``.

From one device's ``device_traces`` it takes ``alloc`` (address, requested size, stream) and the
free of each address: ``free_requested`` (the program's free call; PyTorch's older ``free`` too),
or ``free_completed`` where no request was recorded. Addresses are reused after frees, so each
alloc starts a new allocation id. Stream handles become small numbers in order of appearance,
0 for the default stream (handle 0). Events about memory allocated before the recording began
(frees of unknown addresses) are left out; allocations still live at the end stay live.

A snapshot is a pickle: it is read with an unpickler that builds only plain containers, numbers
and strings, so a file cannot run code.

This module is pure Python + numpy; it never imports the compiled extension.
"""
from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import numpy as np

from .traces import (OP_ALLOC, OP_FREE, NoAllocations, Trace, check_input_file, output_npz_path, register_reader,
                     trace_from_arrays)

__all__ = ["SNAPSHOT_SUFFIXES", "read_snapshot", "arrays_from_snapshot",
           "trace_from_snapshot", "convert"]

SNAPSHOT_SUFFIXES = (".pickle", ".pkl")
_MAX_BYTES = 4 << 30


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):  # a snapshot holds dicts, lists, tuples, str, int, float only
        raise pickle.UnpicklingError(f"snapshot refers to {module}.{name}: not a plain memory snapshot")


def read_snapshot(path) -> dict:
    """The snapshot dict in a pickle file (ValueError if it is not a memory snapshot)."""
    p = check_input_file(path, "snapshot file", "a PyTorch memory snapshot file NAME.pickle")
    if p.stat().st_size > _MAX_BYTES:
        raise ValueError(f"snapshot {p}: larger than {_MAX_BYTES} bytes")
    data = p.read_bytes()
    if data.startswith(b"PK\x03\x04"):  # pickle's reading of it is a two-line persistent-id error
        raise ValueError(f"snapshot {p}: a zip archive (an .npz trace?), not a memory snapshot pickle")
    try:
        snap = _PlainUnpickler(io.BytesIO(data)).load()
    except Exception as exc:
        # one line, as ascend-pool prints it (some of pickle's messages span two)
        raise ValueError(f"snapshot {p}: cannot read as a memory snapshot pickle: {' '.join(str(exc).split())}") from exc
    if not isinstance(snap, dict) or not isinstance(snap.get("device_traces"), list):
        raise ValueError(f"snapshot {p}: no device_traces (record with torch.cuda.memory._record_memory_history "
                         "or ascend_pool.record_memory_history before dumping)")
    return snap


_NO_HISTORY = ("dumped without memory history? Record with torch.cuda.memory._record_memory_history or "
               "ascend_pool.record_memory_history before dumping")


def _pick_device(traces, device, name):
    used = [d for d, t in enumerate(traces) if any(e.get("action") == "alloc" for e in t or [])]
    if not used:
        # torch and ascend_pool dump device_traces (one empty list per device) with history off too
        raise NoAllocations(f"snapshot {name!r}: no allocation events in its device_traces ({_NO_HISTORY})")
    if device is not None:
        if not 0 <= device < len(traces):
            raise ValueError(f"snapshot {name!r}: no device {device} (it has traces of {len(traces)} device(s))")
        if device not in used:  # an empty trace replays as nothing
            raise NoAllocations(f"snapshot {name!r}: no allocation events on device {device} "
                                f"(allocations on devices {used})")
        return device
    if len(used) != 1:
        raise ValueError(f"snapshot {name!r}: allocations on devices {used}; choose one (device=; "
                         "`ascend-pool trace convert --device`)")
    return used[0]


def _entries(trace, name, dev):
    if trace is None:
        return []
    if not isinstance(trace, (list, tuple)):
        raise ValueError(f"snapshot {name!r}: device_traces[{dev}] is a {type(trace).__name__}, not a list of events")
    return trace


def _field(e, key, name, i):
    """e[key] as an int (a whole float too, as JSON-converted snapshots carry) of 64 bits; a
    missing stream is the default (0)."""
    v = e.get(key)
    if key == "stream" and v is None:
        return 0
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    # torch writes handles and addresses as int64 (a pointer past 2**63 reads negative)
    high = 2**63 if key == "size" else 2**64
    if isinstance(v, bool) or not isinstance(v, int) or not -2**63 <= v < high:
        raise ValueError(f"snapshot {name!r}: event {i} ({e.get('action')}): {key} must be an int "
                         f"{'byte count within int64' if key == 'size' else 'within 64 bits'}, got {v!r}")
    return v


def arrays_from_snapshot(snap: dict, device=None, name="snapshot") -> dict:
    """{op, id, size, stream} event arrays (traces.py's format) from a snapshot's device_traces.
    A malformed snapshot (an entry that is not a dict, a missing or ill-typed addr, size or
    stream, a size past int64) is a ValueError naming the snapshot and the event."""
    traces = snap["device_traces"]
    for d, t in enumerate(traces):
        for i, e in enumerate(_entries(t, name, d)):
            if not isinstance(e, dict):
                raise ValueError(f"snapshot {name!r}: device_traces[{d}] event {i} is a {type(e).__name__}, not a dict")
    dev = _pick_device(traces, device, name)
    op, ids, size, stream = [], [], [], []
    live = {}  # address -> (id, size, stream number)
    stream_no = {0: 0}
    next_id = 0
    for i, e in enumerate(traces[dev] or []):
        action = e.get("action")
        if action == "alloc":
            addr, nbytes, handle = _field(e, "addr", name, i), _field(e, "size", name, i), _field(e, "stream", name, i)
            if addr in live:
                raise ValueError(f"snapshot {name!r}: event {i}: address {addr:#x} allocated again while live")
            if nbytes <= 0:
                raise ValueError(f"snapshot {name!r}: event {i}: allocation of {nbytes} bytes")
            s = stream_no.setdefault(handle, len(stream_no))
            live[addr] = (next_id, nbytes, s)
            op.append(OP_ALLOC), ids.append(next_id), size.append(nbytes), stream.append(s)
            next_id += 1
        elif action in ("free_requested", "free", "free_completed"):
            # free_completed follows its free_requested (already counted) unless none was recorded
            hit = live.pop(_field(e, "addr", name, i), None)
            if hit is not None:
                op.append(OP_FREE), ids.append(hit[0]), size.append(hit[1]), stream.append(hit[2])
    return {"op": np.array(op, dtype=np.int8), "id": np.array(ids, dtype=np.int64),
            "size": np.array(size, dtype=np.int64), "stream": np.array(stream, dtype=np.int32)}


def trace_from_snapshot(path, device=None) -> Trace:
    """A validated Trace from a snapshot pickle (see the module docstring)."""
    p = Path(path)
    name = p.name.rsplit(".", 1)[0]
    a = arrays_from_snapshot(read_snapshot(p), device, name)
    return trace_from_arrays(a["op"], a["id"], a["size"], a["stream"], name=name,
                             meta={"source": "pytorch memory snapshot", "snapshot": str(p)}, path=str(p))


def convert(path, out, device=None) -> Trace:
    """Writes the snapshot at path as OUT.npz (plus OUT.json describing its source); returns the trace."""
    p = Path(path)
    a = arrays_from_snapshot(read_snapshot(p), device, p.name)
    trace = trace_from_arrays(a["op"], a["id"], a["size"], a["stream"], name=p.name)
    out = output_npz_path(out, "trace convert OUT")
    np.savez(out, **a)
    out.with_suffix(".json").write_text(json.dumps({"source": "pytorch memory snapshot", "snapshot": str(p),
                                                    "device": device}, indent=1) + "\n")
    return trace


register_reader(SNAPSHOT_SUFFIXES, trace_from_snapshot)

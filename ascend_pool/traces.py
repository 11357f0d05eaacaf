"""Allocation traces: loading, validation and the trace directories.

A trace is the exact sequence of allocations and frees a program made (format: the README beside the
shared traces). ``NAME.npz`` holds four equal-length arrays, one entry per event:

    op      int8   1 = allocate, 0 = free
    id      int64  allocation id; a free names the id of an earlier, still-live allocation
    size    int64  requested bytes (a free carries the size of what it frees)
    stream  int32  stream number (a free carries the allocation's stream)

``NAME.json`` beside it (optional) describes the workload; it is loaded into ``Trace.meta``.

:func:`load_trace` checks the whole trace with vectorised numpy (the largest shared trace has 1.2 M
events) and turns allocation ids into dense *slots* ``0..n_slots-1`` -- one per allocation, in
allocation order -- so that a replay can keep its pointers in a flat array indexed by slot.

This module is pure Python + numpy; it never imports the compiled extension.
"""
from __future__ import annotations

import json
import os
import stat
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

__all__ = [
    "Trace",
    "load_trace",
    "trace_from_arrays",
    "peak_live_bytes",
    "bundled_traces_dir",
    "shipped_traces_dir",
    "default_traces_dir",
    "resolve_trace",
    "list_traces",
    "REQUIRED_ARRAYS",
]

#: arrays every ``.npz`` trace must hold
REQUIRED_ARRAYS = ("op", "id", "size", "stream")
#: the most events a trace file may declare (the largest shared trace has 1.2 M); refused before
#: reading, so a hostile file cannot make the loader take the host's memory
MAX_EVENTS = 1 << 26
#: the largest sidecar ``NAME.json`` read
MAX_SIDECAR_BYTES = 16 << 20

OP_FREE = 0
OP_ALLOC = 1

PathLike = Union[str, "os.PathLike[str]"]


class NoAllocations(ValueError):
    """A recording (snapshot, RMM log) or the device asked for has no allocation event to make a
    trace of."""


@dataclass(eq=False)
class Trace:
    """A validated trace. ``slot[i]`` is the dense index of the allocation event ``i`` creates or frees."""

    op: np.ndarray  # int8, 1 = alloc, 0 = free
    slot: np.ndarray  # int32, 0..n_slots-1 (one slot per allocation, in allocation order)
    size: np.ndarray  # int64, requested bytes (a free carries its allocation's size)
    stream: np.ndarray  # int32
    n_slots: int
    name: str = "trace"
    meta: dict = field(default_factory=dict)
    path: Optional[str] = None

    @property
    def n_events(self) -> int:
        return int(self.op.shape[0])

    @property
    def n_allocs(self) -> int:
        return int(self.n_slots)

    @property
    def n_frees(self) -> int:
        return self.n_events - self.n_slots

    @property
    def streams(self) -> list:
        return [int(s) for s in np.unique(self.stream)]

    def __len__(self) -> int:
        return self.n_events

    def __repr__(self) -> str:
        return (f"Trace(name={self.name!r}, events={self.n_events}, allocs={self.n_allocs}, "
                f"frees={self.n_frees}, streams={self.streams})")


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def trace_from_arrays(op, id, size, stream=None, *, name: str = "trace",
                      meta: Optional[dict] = None, path: Optional[str] = None) -> Trace:
    """Validate raw event arrays and build a :class:`Trace`.

    ``stream`` may be omitted here (all events on stream 0); :func:`load_trace` requires it in files.
    Raises ``ValueError`` naming the first offending event for: arrays that are not 1-D or of unequal
    length, op values other than 0/1, non-integer arrays, allocation sizes <= 0, a free of an id that
    is not live (never allocated, or already freed), an allocation of an id that is still live, and a
    free whose size or stream differs from its allocation's. Ids may be reused once freed.
    """
    arrays = {"op": op, "id": id, "size": size}
    if stream is not None:
        arrays["stream"] = stream
    conv = {}
    for key, val in arrays.items():
        a = np.asarray(val)
        if a.ndim != 1:
            raise ValueError(f"trace {name!r}: array {key!r} must be 1-D, got shape {a.shape}")
        if a.size and not (np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_):
            raise ValueError(f"trace {name!r}: array {key!r} must hold integers, got dtype {a.dtype}")
        conv[key] = a
    lengths = {k: int(a.shape[0]) for k, a in conv.items()}
    if len(set(lengths.values())) > 1:
        desc = ", ".join(f"{k}={n}" for k, n in lengths.items())
        raise ValueError(f"trace {name!r}: arrays have unequal lengths ({desc})")
    n = lengths["op"]

    op_raw = conv["op"].astype(np.int64, copy=False)
    bad = (op_raw != OP_ALLOC) & (op_raw != OP_FREE)
    if bad.any():
        i = _first(bad)
        raise ValueError(f"trace {name!r}: event {i}: op value {int(op_raw[i])} is not 0 (free) or 1 (alloc)")
    opa = op_raw.astype(np.int8)
    ids = conv["id"].astype(np.int64, copy=False)
    sizes = conv["size"].astype(np.int64, copy=False)
    if stream is None:
        streams = np.zeros(n, dtype=np.int32)
    else:
        s64 = conv["stream"].astype(np.int64, copy=False)
        if n and (s64.min() < np.iinfo(np.int32).min or s64.max() > np.iinfo(np.int32).max):
            i = _first((s64 < np.iinfo(np.int32).min) | (s64 > np.iinfo(np.int32).max))
            raise ValueError(f"trace {name!r}: event {i}: stream {int(s64[i])} does not fit in int32")
        streams = s64.astype(np.int32)

    is_alloc = opa == OP_ALLOC
    bad = is_alloc & (sizes <= 0)
    if bad.any():
        i = _first(bad)
        raise ValueError(f"trace {name!r}: event {i}: allocation of id {int(ids[i])} has size {int(sizes[i])} (must be > 0)")

    # Pair every free with its allocation: sort events by (id, position); within one id the events
    # must alternate alloc, free, alloc, free ... starting with an alloc.
    order = np.argsort(ids, kind="stable")
    sid = ids[order]
    sop = opa[order]
    group_start = np.ones(n, dtype=bool)
    if n > 1:
        group_start[1:] = sid[1:] != sid[:-1]
    prev_op = np.empty(n, dtype=np.int8)
    if n:
        prev_op[0] = -1
        prev_op[1:] = sop[:-1]
    # offending positions (in sorted order), reported by their original event index
    free_first = group_start & (sop == OP_FREE)
    double_free = (~group_start) & (sop == OP_FREE) & (prev_op == OP_FREE)
    alloc_live = (~group_start) & (sop == OP_ALLOC) & (prev_op == OP_ALLOC)
    def earliest(mask):  # the sorted position of mask's earliest offence, and its event index
        j = np.flatnonzero(mask)
        k = j[np.argmin(order[j])]
        return k, int(order[k])

    problems = []
    if free_first.any():
        k, ev = earliest(free_first)
        problems.append((ev, f"event {ev}: free of id {int(ids[ev])}, which was never allocated"))
    if double_free.any():
        k, ev = earliest(double_free)
        problems.append((ev, f"event {ev}: id {int(ids[ev])} freed twice (already freed at event {int(order[k - 1])})"))
    if alloc_live.any():
        k, ev = earliest(alloc_live)
        problems.append((ev, f"event {ev}: allocation of id {int(ids[ev])}, which is still live "
                             f"(allocated at event {int(order[k - 1])} and not freed)"))
    if problems:
        problems.sort()
        raise ValueError(f"trace {name!r}: {problems[0][1]}")

    # Slots: one per allocation, numbered in allocation order.
    slot = np.empty(n, dtype=np.int32)
    n_slots = int(is_alloc.sum())
    slot[is_alloc] = np.arange(n_slots, dtype=np.int32)
    free_pos = np.flatnonzero(sop == OP_FREE)  # sorted positions of frees; each follows its alloc
    if free_pos.size:
        f_ev = order[free_pos]
        a_ev = order[free_pos - 1]
        slot[f_ev] = slot[a_ev]
        bad = sizes[f_ev] != sizes[a_ev]
        if bad.any():
            k = int(np.argmin(np.where(bad, f_ev, n)))
            fe, ae = int(f_ev[k]), int(a_ev[k])
            raise ValueError(f"trace {name!r}: event {fe}: free of id {int(ids[fe])} carries size {int(sizes[fe])}, "
                             f"but its allocation (event {ae}) had size {int(sizes[ae])}")
        bad = streams[f_ev] != streams[a_ev]
        if bad.any():
            k = int(np.argmin(np.where(bad, f_ev, n)))
            fe, ae = int(f_ev[k]), int(a_ev[k])
            raise ValueError(f"trace {name!r}: event {fe}: free of id {int(ids[fe])} is on stream {int(streams[fe])}, "
                             f"but its allocation (event {ae}) was on stream {int(streams[ae])}")
    return Trace(op=opa, slot=slot, size=sizes.copy() if sizes is conv["size"] else sizes,
                 stream=streams, n_slots=n_slots, name=name, meta=dict(meta or {}), path=path)


def trace_name(path: PathLike) -> str:
    """A trace file's name without its extension (NAME.npz, NAME.pickle -> NAME)."""
    return Path(path).stem


# Readers of other trace formats, by file suffix: fn(path) -> Trace. A format whose module sits
# above this one registers here at its import (snapshot_trace.py: PyTorch snapshot pickles).
_READERS = {}
# Suffixes list_traces looks for besides .npz, each with the test a file must pass to be listed
# (None: every file): a folder of traces may hold other files of a common suffix (.csv).
_LISTED = {}


def register_reader(suffixes, fn, listed=None):
    """Makes load_trace read files ending in any of suffixes (e.g. (".pickle",)) with fn(path) -> Trace,
    and list_traces (bench --traces DIR) list them: every such file, or those for which
    listed(path) is true when it is given (a cheap look at the file, never raising)."""
    for s in suffixes:
        _READERS[s] = fn
        _LISTED[s] = listed


def check_input_file(path: PathLike, what: str, expected: str) -> Path:
    """Path(path) when it is a file; else FileNotFoundError: "no {what} at ...", or for a directory
    one naming it as such and what is expected (before: "no trace file at" a directory that was
    plainly there, as if the path were mistyped)."""
    p = Path(path)
    if p.is_dir():
        raise FileNotFoundError(f"{str(path)!r} is a directory; expected {expected}")
    if not p.is_file():
        kind = _not_a_file(p)  # there, but no file (/dev/null, a FIFO): not "no ... at" it
        if kind:
            raise FileNotFoundError(f"{str(path)!r} is {kind}, not a regular file; expected {expected}")
        raise FileNotFoundError(f"no {what} at {str(path)!r}")
    return p


def output_npz_path(path: PathLike, what: str) -> Path:
    """The NAME.npz file a trace is written to for path (".npz" added where it lacks it, as
    np.savez adds it); IsADirectoryError when that is a directory or path names one: np.savez
    made DIR.npz beside it, in its parent, and the command said it wrote DIR."""
    p = Path(path)
    out = p if p.suffix == ".npz" else p.with_name(p.name + ".npz")
    for q in (p, out):
        if q.is_dir():
            raise IsADirectoryError(f"{what}: {str(q)!r} is a directory; name the trace file to write, "
                                    f"e.g. {str(q / 'NAME.npz')!r}")
    return out


def _not_a_file(p):
    """What p is when it exists but is neither a file nor a directory ("a character device"...), else None."""
    try:
        mode = p.stat().st_mode
    except (OSError, ValueError):
        return None
    kinds = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "a special file")


def load_trace(path: PathLike) -> Trace:
    """Load and validate ``NAME.npz`` (and ``NAME.json`` beside it, if present, into ``meta``).

    ``path`` may omit the ``.npz`` suffix. Raises ``FileNotFoundError`` if there is no such file and
    ``ValueError`` for a malformed trace (see :func:`trace_from_arrays`).
    """
    if not isinstance(path, (str, os.PathLike)):  # Path() would raise a TypeError naming nothing
        what = "the file's bytes? pass its path" if isinstance(path, (bytes, bytearray)) else repr(path)[:80]
        raise TypeError(f"trace must be a Trace or a trace file's path (str or os.PathLike), "
                        f"got {type(path).__name__} ({what})")
    p = Path(path)
    reader = _READERS.get(p.suffix)
    if reader is not None:  # e.g. a PyTorch memory snapshot (snapshot_trace.py)
        return reader(p)
    if not p.exists() and p.suffix != ".npz" and p.with_name(p.name + ".npz").exists():
        p = p.with_name(p.name + ".npz")
    check_input_file(p if p.exists() else path, "trace file",
                     "a trace file NAME.npz, a memory snapshot NAME.pickle, an RMM log NAME.csv, or the name of a "
                     "shipped trace (`ascend-pool bench --traces` takes a directory of them)")
    name = trace_name(p)
    if not zipfile.is_zipfile(p):
        # A registered format under another name, known by its first line: RMM writes its log to
        # any file name (RMM_LOG_FILE=/tmp/rmm.log), not refused as a broken .npz.
        for suffix, listed in _LISTED.items():
            if listed is not None and listed(p):
                return _READERS[suffix](p)
        raise ValueError(f"trace {name!r} ({p}): cannot read as .npz: not a zip archive")
    try:
        data = np.load(p, allow_pickle=False)
    except Exception as exc:
        raise ValueError(f"trace {name!r} ({p}): cannot read as .npz: {exc}") from exc
    with data:
        missing = [k for k in REQUIRED_ARRAYS if k not in data.files]
        if missing:
            raise ValueError(f"trace {name!r} ({p}): missing array(s) {', '.join(missing)} "
                             f"(has: {', '.join(sorted(data.files)) or 'none'})")
        arrays = {}
        for k in REQUIRED_ARRAYS:
            events = _declared_length(data, k)
            if events is not None and events > MAX_EVENTS:
                raise ValueError(f"trace {name!r} ({p}): array {k!r} declares {events} events, more than the "
                                 f"{MAX_EVENTS} a trace may hold (ascend_pool.traces.MAX_EVENTS)")
            try:
                arrays[k] = data[k]
            except Exception as exc:  # object arrays, corrupt members
                raise ValueError(f"trace {name!r} ({p}): cannot read array {k!r}: {exc}") from exc
    meta: dict[str, Any] = {}
    side = p.with_suffix(".json")
    if side.is_file():
        if side.stat().st_size > MAX_SIDECAR_BYTES:
            raise ValueError(f"trace {name!r}: sidecar {side} is larger than {MAX_SIDECAR_BYTES} bytes")
        try:
            meta = json.loads(side.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"trace {name!r}: sidecar {side} is not valid JSON: {exc}") from exc
        except RecursionError:
            raise ValueError(f"trace {name!r}: sidecar {side} is not valid JSON: nested too deeply") from None
        if not isinstance(meta, dict):
            raise ValueError(f"trace {name!r}: sidecar {side} must hold a JSON object")
    return trace_from_arrays(arrays["op"], arrays["id"], arrays["size"], arrays["stream"],
                             name=name, meta=meta, path=str(p))


def _declared_length(data, key) -> Optional[int]:
    """The element count an .npz member's header declares, read before its data: a few bytes
    of header can claim (or a few KiB of compressed zeros can expand to) more than the host's
    memory. None when the header cannot be read here (np.load then reports the problem)."""
    try:
        with data.zip.open(key + ".npy") as f:
            version = np.lib.format.read_magic(f)
            read = {(1, 0): np.lib.format.read_array_header_1_0,
                    (2, 0): np.lib.format.read_array_header_2_0}.get(version)
            if read is None:
                return None
            shape, _, _ = read(f)
        return int(np.prod(shape, dtype=object)) if shape else 1
    except Exception:  # noqa: BLE001 - any unreadable header is np.load's to report
        return None


def live_bytes_series(trace: Trace) -> np.ndarray:
    """Running sum of requested live bytes after each event (int64)."""
    delta = np.where(trace.op == OP_ALLOC, trace.size, -trace.size)
    return np.cumsum(delta, dtype=np.int64)


def peak_live_bytes(trace: Trace) -> int:
    """Peak of the running sum of requested sizes (allocs add, frees subtract); 0 for an empty trace."""
    if trace.n_events == 0:
        return 0
    return max(0, int(live_bytes_series(trace).max()))


# ---------------------------------------------------------------------------------------------
# Where traces live
# ---------------------------------------------------------------------------------------------

def bundled_traces_dir() -> Path:
    """The small traces shipped inside the package (``ascend_pool/traces/``): prefixes of the shared
    traces, for fast tests."""
    return Path(__file__).resolve().parent / "traces"


def shipped_traces_dir() -> Path:
    """The six full shared traces shipped inside the package (``ascend_pool/traces/full/``, with the
    format README): what ``ascend-pool bench`` replays from an install, so that it reproduces the
    published table (bench/README.md)."""
    return bundled_traces_dir() / "full"


def resolve_trace(name: PathLike) -> Path:
    """A trace path as given, or (when no such file exists and it names no directory) the shipped
    trace of that name, with or without ``.npz``: ``resolve_trace("resnet18_train")``."""
    p = Path(name)
    if p.exists() or p.parent != Path("."):
        return p
    shipped = shipped_traces_dir() / (p.name if p.suffix == ".npz" else p.name + ".npz")
    return shipped if shipped.exists() else p


def _has_traces(d: Path) -> bool:
    return d.is_dir() and any(d.glob("*.npz"))


def default_traces_dir() -> Path:
    """The trace directory to use when none is given.

    In order: ``$ASCEND_POOL_TRACES`` (an error if set to something that is not a directory);
    ``../shared/traces`` relative to the current directory; ``shared/traces`` two levels up from the
    package directory (``<repo>/../shared/traces`` in a checkout); else :func:`shipped_traces_dir`
    (the same six traces, inside the package).
    """
    env = os.environ.get("ASCEND_POOL_TRACES")
    if env:
        d = Path(env).expanduser()
        if not d.is_dir():
            raise FileNotFoundError(f"ASCEND_POOL_TRACES={env!r} is not a directory")
        return d
    candidates = [
        Path.cwd() / ".." / "shared" / "traces",
        Path(__file__).resolve().parent.parent.parent / "shared" / "traces",
    ]
    for d in candidates:
        if _has_traces(d):
            return d.resolve()
    return shipped_traces_dir()


def list_traces(directory: Optional[PathLike] = None) -> list:
    """Sorted ``.npz`` paths in ``directory`` (default: :func:`default_traces_dir`) and those of the
    registered formats (register_reader: PyTorch snapshots ``.pickle``, RMM logs ``.csv`` whose
    first line is RMM's header)."""
    d = Path(directory) if directory is not None else default_traces_dir()
    if not d.is_dir():
        raise FileNotFoundError(f"trace directory {str(d)!r} " + ("is not a directory" if d.exists() else "does not exist"))
    found = list(d.glob("*.npz"))
    for suffix, listed in _LISTED.items():
        found += [p for p in d.glob("*" + suffix) if listed is None or listed(p)]
    return sorted(found)

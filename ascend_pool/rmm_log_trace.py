"""Bring your own workload from RAPIDS: the CSV log of RMM's logging_resource_adaptor
(``rmm.mr.LoggingResourceAdaptor``, ``RMM_LOG_FILE``; what RMM's own REPLAY_BENCHMARK replays)
turned into a trace (ascend_pool.traces) that replays exactly like the equivalent ``.npz``.
A ``.csv`` file is read as one; a file of another name (RMM takes any: ``RMM_LOG_FILE=rmm.log``)
when its first line is RMM's header.

The log's header is ``Thread,Time,Action,Pointer,Size,Stream``; each row is an ``allocate`` (the
pointer returned, the bytes asked for, the stream), a ``free`` (``deallocate`` in some versions) of
a pointer, or an ``allocate failure`` (nothing allocated: left out). Pointers and streams are
hexadecimal (``0x7f...``; ``0x0`` or ``(nil)`` for the default stream, and ``(nil)``, what RMM's ``%p``
writes for a null pointer on glibc, for the pointer of a 0-byte allocate and its free, which are
left out as RMM's own log parser reads them: address 0). Addresses are reused after
frees, so each allocate starts a new allocation id; a free is ordered on its allocation's stream
(the trace format's rule: RMM lets a free name another stream, which orders it after that
stream's work, not what the pool's replay measures). Streams become small numbers in order of
appearance, 0 for the default stream; threads are not kept (the replay is one ordered sequence,
the rows' order). Frees of pointers the log never allocated (allocated before logging began) are
left out; allocations still live at the end stay live.

This module is pure Python + numpy; it never imports the compiled extension.
"""
from __future__ import annotations

import csv
import json
import os
import stat
from pathlib import Path

import numpy as np

from .traces import (OP_ALLOC, OP_FREE, NoAllocations, Trace, check_input_file, output_npz_path, register_reader,
                     trace_from_arrays)

__all__ = ["RMM_LOG_SUFFIXES", "arrays_from_rmm_log", "trace_from_rmm_log", "convert", "is_rmm_log"]

RMM_LOG_SUFFIXES = (".csv",)
HEADER = ("Thread", "Time", "Action", "Pointer", "Size", "Stream")
_ALLOC, _FREES, _SKIPPED = "allocate", ("free", "deallocate"), ("allocate failure",)


def _number(text, what, name, line, base):
    """A pointer or stream (hex, base 16) or size (base 10) of row `line` as an int of 64 bits;
    the default stream's "(nil)" and "0" are 0, and so is a null pointer's "(nil)" (RMM logs
    pointers with printf's %p: glibc writes NULL so; RMM's log_parser reads it as 0)."""
    t = text.strip()
    if what == "stream" and t in ("(nil)", "nullptr", "") or what == "pointer" and t in ("(nil)", "nullptr"):
        return 0
    try:
        v = int(t, base)
    except ValueError:
        raise ValueError(f"RMM log {name!r}: line {line}: {what} {text!r} is not a "
                         f"{'hexadecimal address' if base == 16 else 'byte count'}") from None
    if not 0 <= v < 2**64 or (what == "size" and v >= 2**63):
        raise ValueError(f"RMM log {name!r}: line {line}: {what} {text!r} is out of range")
    return v


def _csv_rows(reader, name):
    """reader's rows; csv's own error (a field past its 128 KiB limit: a log cut off by a crash and
    padded with zero bytes, binary data) as a ValueError naming the log and line, as every other
    mistake in the file is (a bare _csv.Error was a traceback from `ascend-pool replay`)."""
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise ValueError(f"RMM log {name!r}: line {reader.line_num}: not RMM's CSV ({exc})") from None
        yield row


def arrays_from_rmm_log(lines, name="rmm log") -> dict:
    """{op, id, size, stream} event arrays (traces.py's format) from the lines of an RMM
    logging_resource_adaptor CSV. A file that is not one (no such header, a row of another
    width, an unknown action, a bad number, a pointer allocated again while live) is a ValueError
    naming the log and the line; one with no allocation is NoAllocations (a ValueError too)."""
    rows = _csv_rows(csv.reader(lines), name)
    header = next(rows, None)
    if header is None or tuple(h.strip() for h in header) != HEADER:
        raise ValueError(f"RMM log {name!r}: line 1 is {header!r}, not RMM's header {','.join(HEADER)}")
    op, ids, size, stream = [], [], [], []
    live = {}  # pointer -> (id, size, stream number)
    stream_no = {0: 0}
    next_id = 0
    for line, row in enumerate(rows, start=2):
        if not row:
            continue
        if len(row) != len(HEADER):
            raise ValueError(f"RMM log {name!r}: line {line} has {len(row)} fields, not {len(HEADER)}")
        action = row[2].strip()
        if action in _SKIPPED:
            continue
        ptr = _number(row[3], "pointer", name, line, 16)
        if action == _ALLOC:
            nbytes = _number(row[4], "size", name, line, 10)
            if nbytes == 0 or ptr == 0:  # RMM returns nullptr for 0 bytes: nothing to replay
                continue
            if ptr in live:
                raise ValueError(f"RMM log {name!r}: line {line}: pointer {ptr:#x} allocated again while live")
            s = stream_no.setdefault(_number(row[5], "stream", name, line, 16), len(stream_no))
            live[ptr] = (next_id, nbytes, s)
            op.append(OP_ALLOC), ids.append(next_id), size.append(nbytes), stream.append(s)
            next_id += 1
        elif action in _FREES:
            hit = live.pop(ptr, None)
            if hit is not None:
                op.append(OP_FREE), ids.append(hit[0]), size.append(hit[1]), stream.append(hit[2])
        else:
            raise ValueError(f"RMM log {name!r}: line {line}: unknown action {action!r} "
                             f"(RMM writes allocate, free, allocate failure)")
    if not next_id:  # as a snapshot dumped without history: replaying nothing would hide the mistake
        raise NoAllocations(f"RMM log {name!r}: no allocation to replay (only frees, failures or 0-byte "
                            f"requests); log the job's allocations with rmm.mr.LoggingResourceAdaptor")
    return {"op": np.array(op, dtype=np.int8), "id": np.array(ids, dtype=np.int64),
            "size": np.array(size, dtype=np.int64), "stream": np.array(stream, dtype=np.int32)}


def _read(path) -> dict:
    p = check_input_file(path, "RMM log", "an RMM log file NAME.csv (logging_resource_adaptor's)")
    with open(p, newline="", encoding="utf-8", errors="replace") as f:
        return arrays_from_rmm_log(f, p.name)


def trace_from_rmm_log(path) -> Trace:
    """A validated Trace from an RMM logging_resource_adaptor CSV (see the module docstring)."""
    p = Path(path)
    a = _read(p)
    return trace_from_arrays(a["op"], a["id"], a["size"], a["stream"], name=p.stem,
                             meta={"source": "rmm logging_resource_adaptor", "log": str(p)}, path=str(p))


def convert(path, out) -> Trace:
    """Writes the RMM log at path as OUT.npz (plus OUT.json describing its source); returns the trace."""
    p = Path(path)
    a = _read(p)
    trace = trace_from_arrays(a["op"], a["id"], a["size"], a["stream"], name=p.name)
    out = output_npz_path(out, "trace convert OUT")
    np.savez(out, **a)
    out.with_suffix(".json").write_text(json.dumps({"source": "rmm logging_resource_adaptor", "log": str(p)},
                                                   indent=1) + "\n")
    return trace


def is_rmm_log(path) -> bool:
    """True when the file's first line is RMM's header (what list_traces, and so bench --traces DIR,
    takes for an RMM log among a folder's other .csv files); never raises."""
    try:
        # without blocking: a FIFO named *.csv in the folder blocked bench --traces DIR for ever
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        # asked before open(): a directory's descriptor is an IsADirectoryError there ("Is a
        # directory: 3"), which failed trace convert DIR and bench --traces with a folder x.csv
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return False
    except OSError:
        os.close(fd)
        return False
    with open(fd, "rb") as f:
        try:
            first = f.readline(256).decode("utf-8", "replace")
        except OSError:
            return False
    return tuple(h.strip() for h in first.strip().split(",")) == HEADER


register_reader(RMM_LOG_SUFFIXES, trace_from_rmm_log, listed=is_rmm_log)

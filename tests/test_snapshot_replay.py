"""Bring your own workload: a PyTorch memory snapshot replays exactly as the equivalent .npz
(issue 18). The snapshot here is written by a small converter from PyTorch's documented
_dump_snapshot format (device_traces of alloc / free_requested / free_completed entries with
addr, size, stream), independent of ascend_pool's own snapshot writer, reusing addresses after
frees as a caching allocator does, with stream handles where 0 is the default stream."""

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ascend_pool as ap
from ascend_pool.replay import replay
from ascend_pool.traces import list_traces, load_trace, shipped_traces_dir

TRACE = shipped_traces_dir() / "resnet18_train_prefetch_2stream.npz"  # two streams, 7,122 events


def _write_pytorch_snapshot(npz, path):
    """Writes npz's events as a PyTorch memory snapshot pickle (plain dicts, lists, ints)."""
    d = np.load(npz)
    free_by_size = {}  # size -> addresses free for reuse (a caching allocator reuses them)
    addr_of, next_addr, t, trace = {}, 0x7F0000000000, 0, []
    handles = {0: 0}
    for op, i, size, stream in zip(d["op"].tolist(), d["id"].tolist(), d["size"].tolist(), d["stream"].tolist()):
        handle = handles.setdefault(stream, 0x5A5A0000 + 0x100 * stream)
        t += 1
        if op == 1:
            reuse = free_by_size.get(size)
            if reuse:
                addr = reuse.pop()
            else:
                addr = next_addr
                next_addr += (size + 511) // 512 * 512
            addr_of[i] = addr
            trace.append({"action": "alloc", "addr": addr, "size": size, "stream": handle, "time_us": t,
                          "frames": [{"filename": "train.py", "line": 1, "name": "forward"}]})
        else:
            addr = addr_of.pop(i)
            for action in ("free_requested", "free_completed"):
                trace.append({"action": action, "addr": addr, "size": size, "stream": handle, "time_us": t,
                              "frames": []})
            free_by_size.setdefault(size, []).append(addr)
    snap = {"segments": [], "device_traces": [trace], "allocator_settings": {}}
    with open(path, "wb") as f:
        pickle.dump(snap, f)
    reused = len(trace) - len(set(e["addr"] for e in trace))
    return reused


@pytest.fixture(scope="module")
def snapshot_path(tmp_path_factory):
    assert TRACE.is_file(), f"the package ships its full traces ({TRACE})"
    path = tmp_path_factory.mktemp("snap") / "resnet_2stream.pickle"
    assert _write_pytorch_snapshot(TRACE, path) > 1000, "addresses are reused after frees"
    return path


FIGURES = ("allocs", "frees", "peak_live_bytes", "peak_reserved_bytes", "device_mallocs")


def test_snapshot_replays_exactly_as_the_npz(snapshot_path):
    want = replay(str(TRACE), backend="sim")
    got = replay(str(snapshot_path), backend="sim")
    assert {k: got[k] for k in FIGURES} == {k: want[k] for k in FIGURES}
    a, b = load_trace(TRACE), load_trace(snapshot_path)
    assert a.streams == b.streams and (a.size == b.size).all() and (a.op == b.op).all()


def test_cli_replays_and_converts_a_snapshot(snapshot_path, tmp_path):
    run = lambda *args: subprocess.run([sys.executable, "-m", "ascend_pool.cli", *args], capture_output=True,
                                       text=True, timeout=300)
    out = run("replay", "--json", "--backend", "sim", str(snapshot_path))
    assert out.returncode == 0, out.stderr
    want = replay(str(TRACE), backend="sim")
    assert json.loads(out.stdout)["peak_reserved_bytes"] == want["peak_reserved_bytes"]
    npz = tmp_path / "mine.npz"
    out = run("trace", "convert", str(snapshot_path), str(npz))
    assert out.returncode == 0, out.stderr
    assert "allocs" in out.stdout
    assert replay(str(npz), backend="sim")["peak_reserved_bytes"] == want["peak_reserved_bytes"]
    assert snapshot_path in list_traces(snapshot_path.parent), "bench --traces DIR finds snapshots too"
    out = run("bench", "--traces", str(snapshot_path.parent), "--trace", "resnet_2stream", "--allocators",
              "ascend_pool", "--no-micro", "--backend", "sim", "--json", "-")
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)["rows"]
    assert (row["trace"], row["peak_reserved_bytes"]) == ("resnet_2stream", want["peak_reserved_bytes"])


def test_snapshot_that_is_not_plain_data_is_refused(tmp_path):
    bad = tmp_path / "evil.pickle"
    bad.write_bytes(pickle.dumps({"device_traces": [[]], "x": Path("/")}))
    with pytest.raises(ValueError, match="not a plain memory snapshot"):
        load_trace(bad)
    empty = tmp_path / "empty.pickle"
    empty.write_bytes(pickle.dumps({"segments": []}))
    with pytest.raises(ValueError, match="device_traces"):
        load_trace(empty)


def test_dump_trace_without_history_says_how_to_record_and_writes_nothing(tmp_path):
    pool = ap.Pool(0, backend="sim")
    try:
        pool.free(pool.malloc(1000))
        path = tmp_path / "none.npz"
        with pytest.raises(ap.PoolError, match=r"recorded no allocation .*record_memory_history\(True\)"):
            pool.dump_trace(path)
        assert not path.exists()  # before: an empty trace, which replays nothing
    finally:
        pool.close()


def test_a_snapshot_dumped_without_history_says_how_to_record_it(tmp_path):
    # torch's _dump_snapshot and ap.dump_snapshot with history off still write device_traces,
    # one empty list per device. replay and trace convert said "allocations on devices none;
    # choose one (device=)", and `trace convert --device 0` wrote an empty trace (exit 0).
    pool = ap.Pool(0, backend="sim")
    try:
        x = pool.malloc(1000)
        path = tmp_path / "nohist.pickle"
        pool.snapshot()
        ap.dump_snapshot(str(path))
        pool.free(x)
    finally:
        pool.close()
    traces = pickle.loads(path.read_bytes())["device_traces"]
    assert traces and not any(traces), traces
    out_npz = tmp_path / "out.npz"
    for args in (["replay", str(path)], ["trace", "convert", str(path), str(out_npz)],
                 ["trace", "convert", "--device", "0", str(path), str(out_npz)]):
        out = subprocess.run([sys.executable, "-m", "ascend_pool.cli", *args], capture_output=True, text=True,
                             timeout=60, cwd=tmp_path)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert "record_memory_history" in out.stderr and "choose one" not in out.stderr, out.stderr
    assert not out_npz.exists()


def test_a_snapshot_device_without_allocations_is_named(tmp_path):
    path = tmp_path / "two.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [
        [], [{"action": "alloc", "addr": 4096, "size": 512, "stream": 0}]]}))
    from ascend_pool.snapshot_trace import trace_from_snapshot
    with pytest.raises(ValueError, match=r"no allocation events on device 0 \(allocations on devices \[1\]\)"):
        trace_from_snapshot(path, device=0)
    assert trace_from_snapshot(path).n_allocs == 1


def test_pool_dump_trace_closes_the_loop(tmp_path):
    pool = ap.Pool(0, backend="sim")
    try:
        pool.record_memory_history(enabled=True, stacks=None, max_entries=10_000)
        s = pool.create_stream()
        live = [pool.malloc(n) for n in (1000, 3 << 20, 5000)]
        pool.free(live.pop(0))
        other = pool.malloc(777, stream=s)
        pool.free(other, stream=s)
        pool.free(pool.malloc(1000))  # reuses the first address
        path = tmp_path / "mine.npz"
        pool.dump_trace(path)
        trace = load_trace(path)
        assert trace.n_allocs == 5 and trace.n_frees == 3 and trace.streams == [0, 1]
        assert sorted(trace.size[trace.op == 1].tolist()) == sorted([1000, 3 << 20, 5000, 777, 1000])
        for p in live:
            pool.free(p)
    finally:
        pool.close()


@pytest.mark.parametrize("events,problem", [
    ([{"action": "alloc", "size": 512, "stream": 0}], "addr must be an int"),
    ([{"action": "alloc", "addr": 4096, "stream": 0}], "size must be an int byte count"),
    ([{"action": "alloc", "addr": [1], "size": 512}], "addr must be an int"),
    ([{"action": "alloc", "addr": 4096, "size": 512, "stream": [0]}], "stream must be an int"),
    ([{"action": "alloc", "addr": 4096, "size": 2**80}], "size must be an int byte count within int64"),
    ([{"action": "alloc", "addr": 4096, "size": float("inf")}], "size must be an int byte count"),
    ([{"action": "alloc", "addr": 4096, "size": 512}, {"action": "free_requested"}], "event 1 (free_requested): addr"),
    ([7], "device_traces[0] event 0 is a int, not a dict"),
])
def test_a_malformed_snapshot_is_one_line_naming_the_event(tmp_path, events, problem):
    # a hostile or broken pickle: one line and exit 2, never a traceback (KeyError, TypeError,
    # OverflowError before)
    path = tmp_path / "bad.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [events]}))
    for args in (["replay", str(path)], ["trace", "convert", str(path), str(tmp_path / "out.npz")]):
        out = subprocess.run([sys.executable, "-m", "ascend_pool.cli", *args], capture_output=True, text=True,
                             timeout=60, cwd=tmp_path)
        assert out.returncode == 2, out.stderr
        assert "Traceback" not in out.stderr and problem in out.stderr and "'bad" in out.stderr, out.stderr


def test_a_file_that_is_no_pickle_is_one_line_naming_it(tmp_path):
    # an .npz trace given as the snapshot (trace convert of a trace, a renamed file) and a pickle
    # whose error pickle writes on two lines: ascend-pool prints one line (before: pickle's
    # "A load persistent id instruction was encountered,\nbut no persistent_load ..." on two)
    npz = tmp_path / "t.npz"
    np.savez(npz, op=np.array([1, 0], np.int8), id=np.array([0, 0]), size=np.array([8, 8]),
             stream=np.array([0, 0], np.int32))
    renamed = tmp_path / "t.pickle"
    renamed.write_bytes(npz.read_bytes())
    persistent = tmp_path / "p.pickle"
    persistent.write_bytes(b"\x80\x04P0\n.")  # a persistent id: the two-line message
    cases = [(["trace", "convert", str(npz), str(tmp_path / "o.npz")], "a zip archive (an .npz trace?)"),
             (["replay", str(renamed)], "a zip archive (an .npz trace?)"),
             (["replay", str(persistent)], "cannot read as a memory snapshot pickle: A load persistent id")]
    for args, problem in cases:
        out = subprocess.run([sys.executable, "-m", "ascend_pool.cli", *args], capture_output=True, text=True,
                             timeout=60, cwd=tmp_path)
        assert out.returncode == 2, out.stderr
        assert len(out.stderr.splitlines()) == 1 and problem in out.stderr, out.stderr
    assert not (tmp_path / "o.npz").exists()


def test_an_output_that_is_a_directory_is_refused_not_written_beside_it(tmp_path):
    # trace convert SNAPSHOT DIR (or LOG.csv DIR) and pool.dump_trace(DIR): np.savez wrote
    # DIR.npz, in DIR's parent, with DIR.json beside it, and the command said "-> DIR", exit 0
    snap = tmp_path / "s.pickle"
    snap.write_bytes(pickle.dumps({"device_traces": [[{"action": "alloc", "addr": 4096, "size": 512}]]}))
    log = tmp_path / "l.csv"
    log.write_text("Thread,Time,Action,Pointer,Size,Stream\n1,10:00:00.000000,allocate,0x1000,512,0x0\n")
    out_dir = tmp_path / "out"
    (tmp_path / "t.npz").mkdir()  # a directory named like the file to write
    for src in (snap, log):
        for out in (out_dir, tmp_path / "t.npz", tmp_path / "t"):
            out_dir.mkdir(exist_ok=True)
            r = subprocess.run([sys.executable, "-m", "ascend_pool.cli", "trace", "convert", str(src), str(out)],
                               capture_output=True, text=True, timeout=60, cwd=tmp_path)
            assert r.returncode == 2 and "is a directory; name the trace file to write" in r.stderr, r.stderr
            assert len(r.stderr.splitlines()) == 1, r.stderr
    pool = ap.Pool(0)
    try:
        pool.record_memory_history(True)
        p = pool.malloc(1000)
        with pytest.raises(IsADirectoryError, match="dump_trace: .* is a directory"):
            pool.dump_trace(out_dir)
        pool.free(p)
    finally:
        pool.close()
    assert sorted(q.name for q in tmp_path.iterdir()) == ["l.csv", "out", "s.pickle", "t.npz"]
    assert not any(out_dir.iterdir())

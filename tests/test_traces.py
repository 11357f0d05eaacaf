"""Tests of ascend_pool.traces: loading, validation, slots, peak live bytes, trace directories."""
import json
import time
from pathlib import Path

import numpy as np
import pytest

import ascend_pool.traces as traces_mod
from ascend_pool.traces import (
    Trace, bundled_traces_dir, default_traces_dir, list_traces, load_trace, peak_live_bytes,
    trace_from_arrays)


def write_npz(path, **arrays):
    np.savez(path, **arrays)
    return path


def good_arrays():
    # alloc 0 (100 B), alloc 1 (300 B, stream 1), free 0, alloc 2 (50 B), free 2, free 1
    return dict(
        op=np.array([1, 1, 0, 1, 0, 0], dtype=np.int8),
        id=np.array([10, 11, 10, 12, 12, 11], dtype=np.int64),
        size=np.array([100, 300, 100, 50, 50, 300], dtype=np.int64),
        stream=np.array([0, 1, 0, 0, 0, 1], dtype=np.int32),
    )


# ---------------------------------------------------------------------------------------------
# a well-formed trace
# ---------------------------------------------------------------------------------------------

def test_load_small_trace_slots_and_peak(tmp_path):
    p = write_npz(tmp_path / "tiny.npz", **good_arrays())
    (tmp_path / "tiny.json").write_text(json.dumps({"note": "hello"}))
    tr = load_trace(p)
    assert isinstance(tr, Trace)
    assert tr.name == "tiny" and tr.meta == {"note": "hello"}
    assert tr.op.dtype == np.int8 and tr.slot.dtype == np.int32
    assert tr.size.dtype == np.int64 and tr.stream.dtype == np.int32
    # one slot per allocation, numbered in allocation order; a free carries its allocation's slot
    assert tr.n_slots == 3
    assert tr.slot.tolist() == [0, 1, 0, 2, 2, 1]
    assert (tr.n_events, tr.n_allocs, tr.n_frees) == (6, 3, 3)
    assert tr.streams == [0, 1]
    # running live bytes: 100, 400, 300, 350, 300, 0
    assert peak_live_bytes(tr) == 400


def test_load_without_suffix_and_without_sidecar(tmp_path):
    write_npz(tmp_path / "t.npz", **good_arrays())
    tr = load_trace(tmp_path / "t")
    assert tr.name == "t" and tr.meta == {}


def test_ids_may_be_reused_after_free():
    tr = trace_from_arrays([1, 0, 1, 0], [5, 5, 5, 5], [8, 8, 16, 16], [0, 0, 0, 0])
    assert tr.slot.tolist() == [0, 0, 1, 1]
    assert tr.n_slots == 2
    assert peak_live_bytes(tr) == 16


def test_empty_trace():
    tr = trace_from_arrays([], [], [], [])
    assert tr.n_events == 0 and tr.n_slots == 0 and peak_live_bytes(tr) == 0


# ---------------------------------------------------------------------------------------------
# validation: every malformed trace raises ValueError with a precise message
# ---------------------------------------------------------------------------------------------

def test_missing_array(tmp_path):
    a = good_arrays()
    del a["stream"]
    p = write_npz(tmp_path / "nostream.npz", **a)
    with pytest.raises(ValueError, match=r"missing array\(s\) stream"):
        load_trace(p)


def test_unequal_lengths(tmp_path):
    a = good_arrays()
    a["size"] = a["size"][:-1]
    p = write_npz(tmp_path / "short.npz", **a)
    with pytest.raises(ValueError, match=r"unequal lengths \(op=6, id=6, size=5, stream=6\)"):
        load_trace(p)


def test_free_of_never_allocated_id():
    a = good_arrays()
    a["id"][4] = 99  # event 4 frees id 99
    with pytest.raises(ValueError, match=r"event 4: free of id 99, which was never allocated"):
        trace_from_arrays(**a)


def test_double_free():
    with pytest.raises(ValueError, match=r"event 3: id 7 freed twice \(already freed at event 1\)"):
        trace_from_arrays([1, 0, 1, 0], [7, 7, 8, 7], [64, 64, 64, 64], [0, 0, 0, 0])


def test_alloc_of_live_id():
    with pytest.raises(ValueError, match=r"event 1: allocation of id 3, which is still live \(allocated at event 0"):
        trace_from_arrays([1, 1, 0], [3, 3, 3], [64, 64, 64], [0, 0, 0])


def test_first_problem_reported():
    # a double free at event 5 and a free of an unknown id at event 2: event 2 is reported
    with pytest.raises(ValueError, match=r"event 2: free of id 42"):
        trace_from_arrays([1, 0, 0, 1, 0, 0], [1, 1, 42, 2, 2, 2], [8] * 6, [0] * 6)


@pytest.mark.parametrize("bad_size", [0, -1, -4096])
def test_nonpositive_alloc_size(bad_size):
    a = good_arrays()
    a["size"][1] = bad_size
    with pytest.raises(ValueError, match=rf"event 1: allocation of id 11 has size {bad_size} \(must be > 0\)"):
        trace_from_arrays(**a)


@pytest.mark.parametrize("bad_op", [2, -1, 7])
def test_bad_op_values(bad_op):
    a = good_arrays()
    a["op"][3] = bad_op
    with pytest.raises(ValueError, match=rf"event 3: op value {bad_op} is not 0 \(free\) or 1 \(alloc\)"):
        trace_from_arrays(**a)


def test_free_size_must_match_allocation():
    a = good_arrays()
    a["size"][2] = 101
    with pytest.raises(ValueError, match=r"event 2: free of id 10 carries size 101, but its allocation \(event 0\) had size 100"):
        trace_from_arrays(**a)


def test_free_stream_must_match_allocation():
    a = good_arrays()
    a["stream"][5] = 0
    with pytest.raises(ValueError, match=r"event 5: free of id 11 is on stream 0, but its allocation \(event 1\) was on stream 1"):
        trace_from_arrays(**a)


def test_non_integer_and_non_1d_arrays():
    a = good_arrays()
    a["size"] = a["size"].astype(np.float64)
    with pytest.raises(ValueError, match=r"array 'size' must hold integers"):
        trace_from_arrays(**a)
    a = good_arrays()
    a["op"] = a["op"].reshape(2, 3)
    with pytest.raises(ValueError, match=r"array 'op' must be 1-D"):
        trace_from_arrays(**a)


def test_not_an_npz_and_missing_file(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip file")
    with pytest.raises(ValueError, match="cannot read as .npz"):
        load_trace(bad)
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "nothing_here.npz")


def test_bad_sidecar(tmp_path):
    write_npz(tmp_path / "s.npz", **good_arrays())
    (tmp_path / "s.json").write_text("{not json")
    with pytest.raises(ValueError, match="sidecar .* is not valid JSON"):
        load_trace(tmp_path / "s.npz")


def test_validation_is_vectorised_and_fast():
    # 1.2 M events like the largest shared trace: a0 a1 f0 a2 f1 a3 f2 ... a(n-1) f(n-2) f(n-1)
    n = 600_000
    alloc_pos = np.concatenate([[0], np.arange(1, 2 * n - 2, 2)])
    free_pos = np.concatenate([np.arange(2, 2 * n - 1, 2), [2 * n - 1]])
    op = np.zeros(2 * n, dtype=np.int8)
    op[alloc_pos] = 1
    id_ = np.empty(2 * n, dtype=np.int64)
    id_[alloc_pos] = np.arange(n)
    id_[free_pos] = np.arange(n)
    sizes = (id_ % 4096 + 1).astype(np.int64)
    stream = np.zeros(2 * n, dtype=np.int32)
    # CPU time, not wall time: a loaded machine delays the process, not its work (about 0.05 s
    # vectorised; a Python loop over the events takes seconds)
    t0 = time.process_time()
    tr = trace_from_arrays(op, id_, sizes, stream)
    dt = time.process_time() - t0
    assert tr.n_slots == n and tr.n_events == 2 * n
    assert dt < 1.0, f"validating 1.2 M events took {dt:.2f} s of CPU"


# ---------------------------------------------------------------------------------------------
# bundled and default trace directories
# ---------------------------------------------------------------------------------------------

def test_bundled_traces_are_small_valid_and_documented():
    d = bundled_traces_dir()
    assert d == Path(traces_mod.__file__).resolve().parent / "traces"
    paths = list_traces(d)
    assert 2 <= len(paths) <= 3
    names = {p.name[:-4] for p in paths}
    assert "resnet18_train_prefix" in names and "bert_serving_varlen_prefix" in names
    for p in paths:
        assert p.stat().st_size < 100_000, p
        tr = load_trace(p)
        meta = tr.meta
        assert meta["source"]["trace"] in ("resnet18_train", "bert_serving_varlen",
                                           "resnet18_train_prefetch_2stream")
        assert meta["counts"] == {"n_events": tr.n_events, "n_alloc": tr.n_allocs, "n_free": tr.n_frees}
        assert meta["peak_live_bytes"] == peak_live_bytes(tr)
        # like the shared traces, every bundled trace ends with everything freed
        assert tr.n_allocs == tr.n_frees
        assert int(np.where(tr.op == 1, tr.size, -tr.size).sum()) == 0
        assert meta["cut"]["prefix_events"] + meta["cut"]["closing_frees"] == tr.n_events


def test_default_traces_dir_env_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("ASCEND_POOL_TRACES", str(tmp_path))
    assert default_traces_dir() == tmp_path
    monkeypatch.setenv("ASCEND_POOL_TRACES", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="ASCEND_POOL_TRACES"):
        default_traces_dir()


def test_default_traces_dir_search_order(tmp_path, monkeypatch):
    monkeypatch.delenv("ASCEND_POOL_TRACES", raising=False)
    # a fake package two levels below a folder with no shared traces
    fake_pkg = tmp_path / "repo" / "ascend_pool"
    fake_pkg.mkdir(parents=True)
    monkeypatch.setattr(traces_mod, "__file__", str(fake_pkg / "traces.py"))
    work = tmp_path / "elsewhere" / "cwd"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    # nothing found: the full traces shipped in the (fake) package
    assert default_traces_dir() == fake_pkg / "traces" / "full"
    # shared/traces two levels up from the package
    up = tmp_path / "shared" / "traces"
    up.mkdir(parents=True)
    write_npz(up / "a.npz", **good_arrays())
    assert default_traces_dir() == up.resolve()
    # ../shared/traces relative to the current directory comes first
    rel = tmp_path / "elsewhere" / "shared" / "traces"
    rel.mkdir(parents=True)
    write_npz(rel / "b.npz", **good_arrays())
    assert default_traces_dir() == rel.resolve()


def test_a_trace_argument_that_is_no_path_is_a_type_error_naming_it():
    """load_trace / replay take a Trace or a path: None, a trace file's bytes or a number is a
    TypeError naming what was given and what is expected (before: pathlib's bare TypeError,
    "expected str, bytes or os.PathLike object, not NoneType", naming no trace)."""
    from ascend_pool.replay import replay
    for bad, said in ((None, r"NoneType \(None\)"), (b"PK\x03\x04", r"bytes \(the file's bytes\? pass its path\)"),
                      (7, r"int \(7\)")):
        with pytest.raises(TypeError, match="trace must be a Trace or a trace file's path .*got " + said):
            load_trace(bad)
        with pytest.raises(TypeError, match="trace must be a Trace or a trace file's path"):
            replay(bad)

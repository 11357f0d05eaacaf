"""Bring your own workload from RAPIDS: the CSV log of RMM's logging_resource_adaptor replays
exactly as the equivalent .npz. The log here is written by a small writer from RMM's documented
format (header Thread,Time,Action,Pointer,Size,Stream; rows `thread,HH:MM:SS.ffffff,allocate,0x..,
bytes,0x..` and `...,free,0x..,bytes,0x..`, as its do_allocate / do_deallocate log them),
independent of ascend_pool's readers, reusing addresses after frees as a pool does, with stream
pointers where 0x0 is the default stream, several threads, and a free on another stream than its
allocation (RMM allows it)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ascend_pool.replay import replay
from ascend_pool.traces import list_traces, load_trace, shipped_traces_dir

TRACE = shipped_traces_dir() / "resnet18_train_prefetch_2stream.npz"  # two streams, 7,122 events
FIGURES = ("allocs", "frees", "peak_live_bytes", "peak_reserved_bytes", "device_mallocs")


def _write_rmm_log(npz, path):
    """Writes npz's events as RMM's logging_resource_adaptor would log them. Returns how many
    allocations reuse an address freed before."""
    d = np.load(npz)
    free_by_size, addr_of, seen = {}, {}, set()
    next_addr, reused = 0x7F8A40000000, 0
    streams = {0: "0x0"}
    rows = ["Thread,Time,Action,Pointer,Size,Stream"]
    for k, (op, i, size, stream) in enumerate(zip(d["op"].tolist(), d["id"].tolist(), d["size"].tolist(),
                                                   d["stream"].tolist())):
        handle = streams.setdefault(stream, f"0x{0x7F8A38001020 + 0x100 * stream:x}")
        thread = 140573312345856 + (k % 3)  # the log interleaves threads; order is the rows'
        stamp = f"10:{k // 60000 % 60:02d}:{k // 1000 % 60:02d}.{k % 1000 * 1000:06d}"
        if op == 1:
            if free_by_size.get(size):
                addr = free_by_size[size].pop()
                reused += 1
            else:
                addr = next_addr
                next_addr += (size + 255) // 256 * 256
            addr_of[i] = addr
            rows.append(f"{thread},{stamp},allocate,0x{addr:x},{size},{handle}")
        else:
            addr = addr_of.pop(i)
            other = "0x0" if k % 7 == 0 else handle  # a free may name another stream in RMM
            rows.append(f"{thread},{stamp},free,0x{addr:x},{size},{other}")
            free_by_size.setdefault(size, []).append(addr)
        seen.add(addr)
    rows.insert(5, f"140573312345856,09:59:59.000000,allocate failure,0x0,{1 << 50},0x0")  # nothing allocated
    path.write_text("\n".join(rows) + "\n")
    return reused


@pytest.fixture(scope="module")
def log_path(tmp_path_factory):
    assert TRACE.is_file(), f"the package ships its full traces ({TRACE})"
    path = tmp_path_factory.mktemp("rmm") / "resnet_2stream.csv"
    assert _write_rmm_log(TRACE, path) > 1000, "addresses are reused after frees"
    return path


def test_an_rmm_log_replays_exactly_as_the_npz(log_path):
    want = replay(str(TRACE), backend="sim")
    got = replay(str(log_path), backend="sim")
    assert {k: got[k] for k in FIGURES} == {k: want[k] for k in FIGURES}
    a, b = load_trace(TRACE), load_trace(log_path)
    assert a.streams == b.streams and (a.size == b.size).all() and (a.op == b.op).all()


def test_cli_replays_and_converts_an_rmm_log(log_path, tmp_path):
    run = lambda *args: subprocess.run([sys.executable, "-m", "ascend_pool.cli", *args], capture_output=True,
                                       text=True, timeout=300)
    want = replay(str(TRACE), backend="sim")
    out = run("replay", "--json", "--backend", "sim", str(log_path))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["peak_reserved_bytes"] == want["peak_reserved_bytes"]
    npz = tmp_path / "mine.npz"
    out = run("trace", "convert", str(log_path), str(npz))
    assert out.returncode == 0, out.stderr
    assert replay(str(npz), backend="sim")["peak_reserved_bytes"] == want["peak_reserved_bytes"]
    out = run("trace", "convert", str(log_path), str(npz), "--device", "0")
    assert out.returncode == 2 and "--device" in out.stderr
    # bench --traces DIR takes the RMM logs of a folder, not its other CSV files
    (log_path.parent / "results.csv").write_text("trace,allocator,ops_per_second\nx,y,1\n")
    assert list_traces(log_path.parent) == [log_path]
    out = run("bench", "--traces", str(log_path.parent), "--allocators", "ascend_pool", "--no-micro",
              "--backend", "sim", "--json", "-")
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)["rows"]
    assert (row["trace"], row["peak_reserved_bytes"]) == ("resnet_2stream", want["peak_reserved_bytes"])


@pytest.mark.parametrize("text, problem", [
    ("Thread,Time,Action,Pointer,Size\n", "not RMM's header"),
    ("", "not RMM's header"),
    ("Thread,Time,Action,Pointer,Size,Stream\n1,10:00:00.0,allocate,0x10,100\n", "line 2 has 5 fields"),
    ("Thread,Time,Action,Pointer,Size,Stream\n1,10:00:00.0,grow,0x10,100,0x0\n", "unknown action 'grow'"),
    ("Thread,Time,Action,Pointer,Size,Stream\n1,10:00:00.0,allocate,zz,100,0x0\n", "pointer 'zz'"),
    ("Thread,Time,Action,Pointer,Size,Stream\n1,10:00:00.0,allocate,0x10,-5,0x0\n", "size '-5'"),
    ("Thread,Time,Action,Pointer,Size,Stream\n1,t,allocate,0x10,100,0x0\n1,t,allocate,0x10,100,0x0\n",
     "line 3: pointer 0x10 allocated again while live"),
    # no allocation to replay: refused as a snapshot dumped without history is, not "replayed" to zeros
    ("Thread,Time,Action,Pointer,Size,Stream\n", "no allocation to replay"),
    ("Thread,Time,Action,Pointer,Size,Stream\n1,t,free,0x10,100,0x0\n1,t,allocate failure,0x0,99,0x0\n",
     "no allocation to replay"),
    # a field past csv's 128 KiB limit (a log cut off by a crash, zero bytes after it): before, csv's
    # own _csv.Error, a traceback from the command
    # (a short id: the text in the test's id reaches PYTEST_CURRENT_TEST, and a 200 KB environment
    # string makes every subprocess fail with E2BIG)
    pytest.param("Thread,Time,Action,Pointer,Size,Stream\n1,t,allocate,0x10,100,0x0\n" + "\0" * 200_000,
                 "line 3: not RMM's CSV (field larger than field limit", id="field-past-csv-limit"),
])
def test_a_file_that_is_not_an_rmm_log_is_refused_naming_the_line(tmp_path, text, problem):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match="RMM log 'bad.csv'") as info:
        load_trace(path)
    assert problem in str(info.value)
    out = subprocess.run([sys.executable, "-m", "ascend_pool.cli", "replay", "--backend", "sim", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and problem in out.stderr, out.stderr


def test_a_null_pointer_as_rmm_logs_it_is_address_0(tmp_path):
    # RMM's logging_resource_adaptor logs pointers with printf's %p, which glibc writes "(nil)" for
    # NULL: a 0-byte allocate (RMM returns nullptr) and its free; RMM's own log_parser reads it as
    # 0. Before, the whole log was refused ("pointer '(nil)' is not a hexadecimal address").
    path = tmp_path / "job.csv"
    path.write_text("Thread,Time,Action,Pointer,Size,Stream\n"
                    "7,10:00:00.000001,allocate,0x7f0000000000,1024,0\n"
                    "7,10:00:00.000002,allocate,(nil),0,0\n"
                    "7,10:00:00.000003,free,(nil),0,0\n"
                    "7,10:00:00.000004,allocate failure,(nil),1125899906842624,0\n"
                    "7,10:00:00.000005,free,0x7f0000000000,1024,0\n")
    trace = load_trace(path)
    assert (trace.op.tolist(), trace.size.tolist()) == ([1, 0], [1024, 1024])


@pytest.mark.parametrize("name", ["rmm.dev0.log", "rmm_log.txt", "rmmlog"])
def test_an_rmm_log_of_another_name_is_known_by_its_header(log_path, tmp_path, name):
    # RMM writes its log to any file name (RMM_LOG_FILE, rmm.enable_logging(log_file_name=...));
    # before, replay and trace convert read a non-.csv one as a broken .npz or pickle and refused it
    path = tmp_path / name
    path.write_bytes(log_path.read_bytes())
    a, b = load_trace(log_path), load_trace(path)
    assert (a.op == b.op).all() and (a.size == b.size).all() and a.streams == b.streams
    npz = tmp_path / "mine.npz"
    out = subprocess.run([sys.executable, "-m", "ascend_pool.cli", "trace", "convert", str(path), str(npz)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert (load_trace(npz).op == a.op).all()
    (tmp_path / "junk.txt").write_text("not a trace\n")  # anything else is still refused as before
    with pytest.raises(ValueError, match="cannot read as .npz: not a zip archive"):
        load_trace(tmp_path / "junk.txt")


def test_a_fifo_named_csv_in_a_trace_folder_is_passed_over_not_waited_on(tmp_path):
    # list_traces (bench --traces DIR) opened each .csv to look for RMM's header: a FIFO named
    # x.csv blocked it for ever, waiting for a writer
    np.savez(tmp_path / "good.npz", op=np.array([1, 0], np.int8), id=np.array([0, 0]), size=np.array([8, 8]),
             stream=np.array([0, 0], np.int32))
    os.mkfifo(tmp_path / "x.csv")
    code = f"from ascend_pool.traces import list_traces; print([p.name for p in list_traces({str(tmp_path)!r})])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "['good.npz']", out.stderr


"""Hostile input that the other test files do not already cover (see docs/bad_input.md for the
whole catalogue and where each class is tested):

- trace files given to `ascend-pool replay`: not an npz, truncated, corrupted members, wrong
  dtypes, lying headers, a compressed "zip bomb", absurd sizes, too many streams, bad sidecars --
  each a one-line typed error and exit status 2, never a traceback or a crash;
- the tenants file: values nested too deeply, quotas no device could have, a FIFO or a device
  file instead of a file (refused at once, not waited on);
- allocator knob strings: fuzzed; every one is a ConfigError or a pool that works;
- the C ABI with garbage stream handles and more distinct streams than a pool tracks;
- the ledger file (C) and the stats file (Python reader): empty, oversized, FIFO, and random
  byte flips -- refused with a clear error or accepted, never a crash (the ledger is fuzzed in a
  child process, so that a crash would show as a failed child, not a dead test run);
- the metrics endpoint: too many headers, HTTP/0.9, control bytes, absolute URIs, bodies on GET,
  hundreds of idle connections, and what the server reveals about itself.

Sizes are bytes; MiB = 1 << 20."""

import json
import os
import random
import socket
import stat
import struct
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import ascend_pool as ap
from ascend_pool.config import knobs_to_config, parse_conf_string
from ascend_pool.tenants.config import ConfigErrors, load as load_tenants

TESTS = os.path.dirname(os.path.abspath(__file__))
# children import the same build as this process (installed package or in-place tree)
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(ap.__file__)))
MiB = 1 << 20
TRIED = {}  # class of bad input -> how many were tried (for a debugger or -s runs)


def tried(what, n=1):
    TRIED[what] = TRIED.get(what, 0) + n


def child_env(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([PKG_PARENT, TESTS])
    env["ASCEND_SIM_NODE"] = f"hostile{os.getpid()}"
    env["ASCEND_SIM_SHM_DIR"] = str(tmp_path)
    env["ASCEND_POOL_LEDGER_DIR"] = str(tmp_path)
    env["ASCEND_POOL_STATS_DIR"] = str(tmp_path)
    env["ASCEND_SIM_HBM"] = "8GiB"
    env["ASCEND_SIM_DEVICES"] = "2"
    env.pop("ASCEND_POOL_CONF", None)
    return env


def run_child(tmp_path, code, timeout=120):
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=child_env(tmp_path), capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, f"child crashed or failed ({p.returncode})\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


# -- trace files -----------------------------------------------------------------------------------

def _ok_arrays(n=4):
    return dict(op=np.array([1, 1, 0, 0], np.int8), id=np.array([1, 2, 1, 2]), size=np.array([100, 200, 100, 200]),
                stream=np.zeros(4, np.int32))


def _npz_with_header(path, declared, arrays=None, compress_zeros=False):
    """An npz whose members declare `declared` elements; with compress_zeros their data really is
    that many zeros, deflated (a few KiB per million events)."""
    arrays = arrays or _ok_arrays()
    comp = zipfile.ZIP_DEFLATED if compress_zeros else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", compression=comp) as z:
        for key, a in arrays.items():
            with z.open(key + ".npy", "w", force_zip64=True) as f:
                np.lib.format.write_array_header_1_0(f, {"descr": a.dtype.str, "fortran_order": False,
                                                         "shape": (declared,)})
                if compress_zeros:
                    left = declared * a.dtype.itemsize
                    chunk = bytes(min(left, 1 << 22))
                    while left:
                        w = min(left, len(chunk))
                        f.write(chunk[:w])
                        left -= w
                else:
                    f.write(a.tobytes())


def _make_traces(d):
    """{file name: (expected exit status, words the one error line must contain)}."""
    ok = _ok_arrays()
    cases = {}

    def save(name, expect, **over):
        np.savez(d / name, **{**ok, **over})
        cases[name] = expect

    save("float_sizes.npz", (2, ["ValueError", "'size' must hold integers"]), size=np.array([1.5, 2, 1.5, 2]))
    save("complex_ops.npz", (2, ["ValueError", "'op' must hold integers"]), op=np.array([1j, 1j, 0, 0]))
    save("string_ops.npz", (2, ["ValueError", "'op' must hold integers"]), op=np.array(["1", "1", "0", "0"]))
    save("object_sizes.npz", (2, ["ValueError", "allow_pickle=False"]),
         size=np.array([1, "x", 1, "x"], dtype=object))
    save("two_d.npz", (2, ["ValueError", "must be 1-D"]), size=np.array([[100, 200], [100, 200]]))
    save("unequal.npz", (2, ["ValueError", "unequal lengths"]), stream=np.zeros(3, np.int32))
    save("bad_op.npz", (2, ["ValueError", "op value 7"]), op=np.array([1, 7, 0, 0], np.int8))
    save("free_first.npz", (2, ["ValueError", "never allocated"]), op=np.array([0, 1, 1, 0], np.int8))
    save("stream_overflow.npz", (2, ["ValueError", "does not fit in int32"]), stream=np.array([0, 2**40, 0, 2**40]))
    save("u64_size_wraps.npz", (2, ["ValueError", "must be > 0"]),
         size=np.array([2**64 - 1, 200, 2**64 - 1, 200], np.uint64))
    save("one_tib.npz", (2, ["OutOfMemoryError", "larger than the device"]),
         size=np.array([1 << 40, 200, 1 << 40, 200]))
    save("int64_max.npz", (2, ["OutOfMemoryError", "larger than the device"]),
         size=np.array([2**63 - 1, 200, 2**63 - 1, 200]))
    np.savez(d / "missing.npz", op=ok["op"], id=ok["id"])
    cases["missing.npz"] = (2, ["ValueError", "missing array(s) size, stream"])
    m = 1100  # more distinct streams than a pool tracks (1023)
    np.savez(d / "many_streams.npz", op=np.tile(np.array([1, 0], np.int8), m), id=np.repeat(np.arange(m), 2),
             size=np.full(2 * m, 512), stream=np.repeat(np.arange(m, dtype=np.int32), 2))
    cases["many_streams.npz"] = (2, ["InvalidStreamError", "too many streams"])
    # not an npz at all
    (d / "random.npz").write_bytes(random.Random(1).randbytes(5000))
    cases["random.npz"] = (2, ["ValueError", "not a zip archive"])
    np.save(d / "plain.npy", ok["op"])
    os.rename(d / "plain.npy", d / "plain.npz")
    cases["plain.npz"] = (2, ["ValueError", "not a zip archive"])
    (d / "empty.npz").write_bytes(b"")
    cases["empty.npz"] = (2, ["ValueError", "not a zip archive"])
    os.mkdir(d / "directory.npz")
    cases["directory.npz"] = (2, ["FileNotFoundError", "is a directory; expected a trace file"])
    with zipfile.ZipFile(d / "not_npy.npz", "w") as z:
        for k in ok:
            z.writestr(k + ".npy", b"this is no npy member")
    cases["not_npy.npz"] = (2, ["ValueError", "array 'op' must be 1-D"])  # np.load gives such members as bytes
    # truncated at several points, and a member's bytes flipped (CRC error)
    good = (d / "trunc_src.npz")
    np.savez(good, **ok)
    data = good.read_bytes()
    for k in (30, len(data) // 3, len(data) // 2, len(data) - 22):
        (d / f"truncated_{k}.npz").write_bytes(data[:k])
        cases[f"truncated_{k}.npz"] = (2, ["ValueError", "trace"])
    flipped = bytearray(data)
    at = data.index(b"\x93NUMPY", data.index(b"id.npy")) + 80  # inside the id member's data
    flipped[at] ^= 0xFF
    (d / "bad_crc.npz").write_bytes(bytes(flipped))
    cases["bad_crc.npz"] = (2, ["ValueError", "cannot read array"])
    # lying headers: a trillion events declared in a few bytes; and real compressed zeros
    _npz_with_header(d / "liar.npz", 10**12)
    cases["liar.npz"] = (2, ["ValueError", "declares 1000000000000 events"])
    _npz_with_header(d / "zip_bomb.npz", 3_000_000, compress_zeros=True)
    cases["zip_bomb.npz"] = (2, ["ValueError", "declares 3000000 events, more than the 1000000"])
    # sidecars
    for name, text, words in (
        ("deep_sidecar", "[" * 100000 + "]" * 100000, ["ValueError", "nested too deeply"]),
        ("binary_sidecar", b'{"a": "\xff\xfe"}', ["ValueError", "not valid JSON"]),
        ("list_sidecar", "[1, 2]", ["ValueError", "must hold a JSON object"]),
        ("broken_sidecar", "{", ["ValueError", "not valid JSON"]),
    ):
        np.savez(d / f"{name}.npz", **ok)
        side = d / f"{name}.json"
        side.write_bytes(text) if isinstance(text, bytes) else side.write_text(text)
        cases[f"{name}.npz"] = (2, words)
    return cases


def test_malformed_trace_files_are_one_line_errors_from_ascend_pool_replay(tmp_path):
    d = tmp_path / "traces"
    d.mkdir()
    cases = _make_traces(d)
    cases["does_not_exist.npz"] = (2, ["FileNotFoundError", "no trace file"])
    # One child runs every case through the CLI's main(): a crash would kill it mid-way (and show
    # here), a traceback would be an exception escaping main().
    results = run_child(tmp_path, f"""
        import contextlib, io, json, os, sys
        import ascend_pool.traces
        from ascend_pool.cli import main
        ascend_pool.traces.MAX_EVENTS = 1_000_000   # the zip bomb case: a small bomb, a small cap
        for name in {sorted(cases)!r}:
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    rc = main(["replay", os.path.join({str(d)!r}, name), "--backend", "sim", "--json"])
                except BaseException as e:
                    rc = "escaped " + type(e).__name__ + ": " + str(e)[:300]
            print(json.dumps({{"name": name, "rc": rc, "err": err.getvalue()}}), flush=True)
    """, timeout=300)
    assert [r["name"] for r in results] == sorted(cases), "the child stopped early (crash?)"
    for r in results:
        rc, words = cases[r["name"]]
        assert r["rc"] == rc, r
        lines = r["err"].strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ascend-pool replay: "), r
        for w in words:
            assert w in lines[0], (w, r)
    tried("trace files", len(cases))


def test_bundled_replay_still_works_and_an_ordinary_trace_is_under_the_cap():
    from ascend_pool.traces import MAX_EVENTS, bundled_traces_dir, load_trace

    t = load_trace(bundled_traces_dir() / "resnet18_train_prefix.npz")
    assert 0 < t.n_events < MAX_EVENTS and MAX_EVENTS >= 50 * 1_200_000  # 50x the largest shared trace


# -- tenants file ------------------------------------------------------------------------------------

def _errors(path):
    with pytest.raises(ConfigErrors) as info:
        load_tenants(str(path))
    return info.value.errors


@pytest.mark.parametrize("text, words", [
    ("a = " + "[" * 50000 + "]" * 50000 + "\n", "not valid TOML: values nested too deeply"),
    ("[tenants.a]\nquota = " + "[" * 5000 + "]" * 5000 + "\n", "not valid TOML"),
    ("[tenants.a]\nquota = 99999999999999999999999999\n", "larger than any device"),
    ("[tenants.a]\nquota = \"9999999999TiB\"\n", "larger than any device"),
    ("[tenants.a]\nquota = \"" + "9" * 400 + "GiB\"\n", "larger than any device"),
    ("[tenants.a]\nquota = \"" + "9" * 400 + "%\"\n", "more than the whole device"),
    ("[tenants.a]\nquota = nan\n", "expected bytes"),
    ("[tenants.a]\nquota = inf\n", "expected bytes"),
    ("[tenants.a]\nquota = 1\nwarn = nan\n", "outside (0, 1]"),
    ("\x00\x01\x02binary\n", "not valid TOML"),
    ("[tenants." + "a" * 200 + "]\nquota = 1\n", "is not valid"),
])
def test_tenants_file_hostile_values(tmp_path, text, words):
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    errors = _errors(path)
    assert len(errors) == 1 and words in errors[0], errors
    tried("tenants file values")


def test_tenants_file_that_is_not_a_file_is_refused_at_once(tmp_path):
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    for path, words in ((fifo, "not a regular file"), ("/dev/zero", "not a regular file"),
                        (tmp_path, "cannot read the tenants file")):
        # a child, so that a loader waiting on the FIFO fails this test instead of hanging the run
        out = subprocess.run([sys.executable, "-m", "ascend_pool.cli", "check-config", str(path)],
                             env=child_env(tmp_path), capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and words in out.stderr + out.stdout, (path, out.stdout, out.stderr)
        tried("tenants file paths")


# -- ledger environment ------------------------------------------------------------------------------

@pytest.mark.parametrize("var, value, kind, words", [
    ("ASCEND_POOL_LEDGER_DIR", "/nonexistent/dir", "io", "does not exist or is not a directory"),
    ("ASCEND_POOL_LEDGER_DIR", "/etc/passwd", "io", "does not exist or is not a directory"),
    # relative, there or not (an existing one was taken: each working directory its own ledger)
    ("ASCEND_POOL_LEDGER_DIR", "relative/dir", "argument", "'relative/dir' is a relative path"),
    ("ASCEND_POOL_LEDGER_DIR", ".", "argument", "'.' is a relative path; processes in other working directories"),
    ("ASCEND_POOL_LEDGER_GROUP", "no-such-group-here", "argument", "is not a group on this system"),
])
def test_bad_ledger_environment_is_a_ledger_error(pool, monkeypatch, var, value, kind, words):
    from ascend_pool.tenants.errors import LedgerError

    monkeypatch.setenv(var, value)
    with pytest.raises(LedgerError) as info:
        pool.context("rel-env", quota="8MiB")
    assert info.value.kind == kind and words in str(info.value) and isinstance(info.value, ap.PoolError)
    pool.free(pool.malloc(1000))  # the pool itself is unaffected
    tried("environment values")


# -- allocator knobs ---------------------------------------------------------------------------------

KNOB_KEYS = ["max_split_size_mb", "garbage_collection_threshold", "reserve", "record_history", "page_size",
             "expandable_segments", "release_policy", "stream_reuse", "memory_fraction",
             "per_process_memory_fraction", "sync_timeout_ms", "pad_bytes", "bogus", ""]
KNOB_VALUES = st.one_of(
    st.sampled_from(["inf", "-inf", "nan", "1e30", "-1", "0", "1", "0.5", "25%", "200%", "nan%", "true", "maybe",
                     "9" * 400, "9" * 30, "2m", "1g", "4k", "under_peak", "never", "borrow", "tied", "21", "1.5",
                     "64MiB", "0.0000001", "", " ", "%", "-0", "0x10", "1e-300", "１２"]),
    st.text(max_size=12),
    st.integers(-2**70, 2**70).map(str),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(KNOB_KEYS), KNOB_VALUES), min_size=1, max_size=3))
def test_fuzzed_knob_strings_are_config_errors_or_work(items):
    text = ",".join(f"{k}:{v}" for k, v in items)
    try:
        knobs = parse_conf_string(text)
        cfg = knobs_to_config(knobs, 8 << 30, 8 << 30)
    except ap.ConfigError:
        tried("knob strings")
        return
    tried("knob strings")
    # accepted: the compiled pool must take it (no OverflowError from a C field)
    knobs.pop("reserve", None)  # preallocation is tested elsewhere; keep the fuzz fast
    try:
        pool = ap.Pool(0, backend="sim", **knobs)
    except MemoryError as e:  # record_history: more ring entries than the host can hold
        assert "record_history" in knobs and "host memory" in str(e)
        return
    try:
        pool.free(pool.malloc(1000))
    except ap.OutOfMemoryError:  # memory_fraction:1e-7: a limit below one segment; typed, and said so
        assert pool.config.get("limit_bytes", 1 << 62) < 2 * MiB
    finally:
        pool.close()
    assert isinstance(cfg, dict)


@pytest.mark.parametrize("conf", ["max_split_size_mb:inf", "max_split_size_mb:nan", "max_split_size_mb:1e30",
                                  "record_history:99999999999999999999", "sync_timeout_ms:99999999999",
                                  "reserve:" + "9" * 400 + "GiB", "garbage_collection_threshold:nan",
                                  "memory_fraction:inf", "roundup_power2_divisions:4294967296",
                                  "roundup_power2_divisions:[1:4,>:4294967296]"])
def test_knob_values_no_c_field_can_hold_are_config_errors(monkeypatch, conf):
    monkeypatch.setenv("ASCEND_POOL_CONF", conf)
    with pytest.raises(ap.ConfigError, match=conf.split(":")[0]):
        ap.Pool(0, backend="sim")
    tried("knob strings")


def test_replay_conf_option_with_an_impossible_knob_is_exit_2(tmp_path):
    from ascend_pool.traces import bundled_traces_dir

    trace = str(bundled_traces_dir() / "resnet18_train_prefix.npz")
    out = subprocess.run([sys.executable, "-m", "ascend_pool.cli", "replay", trace, "--backend", "sim",
                          "--conf", "max_split_size_mb:inf"], env=child_env(tmp_path), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "ConfigError: max_split_size_mb" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    tried("knob strings")


# -- the C ABI: garbage stream handles, stream-slot exhaustion ------------------------------------------

def test_c_abi_garbage_streams_and_too_many_streams(tmp_path):
    """Stream handles the pool never saw are asked about once (the simulator refuses unknown
    handles with an error code): garbage handles give error 5 (INVALID_STREAM) naming the stream,
    frees with them still free the block, and the pool keeps serving. In a child: the refused
    handles must not leak into this test run's default pool."""
    (r,) = run_child(tmp_path, """
        import ctypes, json
        import ascend_pool as ap
        lib = ctypes.CDLL(ap.library_path())
        lib.ascend_pool_malloc.restype = ctypes.c_void_p
        lib.ascend_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.ascend_pool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.ascend_pool_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.ascend_pool_last_error.restype = ctypes.c_char_p
        lib.ascend_pool_init(0)
        pool = ap.default_pool(0)
        out = {"garbage": 0}
        for s in (1, 0xdeadbeef, 0x7fffffffffff, 2**64 - 64):
            p = lib.ascend_pool_malloc(1000, 0, s)
            if p:
                lib.ascend_pool_record_stream(p, s + 64)
                lib.ascend_pool_free(p, 1000, 0, s)
            q = lib.ascend_pool_malloc(1000, 0, None)
            assert q, lib.ascend_pool_last_error()
            lib.ascend_pool_record_stream(q, s)
            lib.ascend_pool_free(q, 1000, 0, s)
            out["garbage"] += 1
        lib.ascend_pool_clear_last_error()
        for i in range(1100):
            p = lib.ascend_pool_malloc(512, 0, 0x100000 + 64 * i)
            if not p:
                out["refused_at"] = i
                out["code"] = lib.ascend_pool_last_error_code()
                out["message"] = lib.ascend_pool_last_error().decode()
                break
            lib.ascend_pool_free(p, 512, 0, None)
        p = lib.ascend_pool_malloc(4096, 0, None)   # still serves known streams
        out["still_serves"] = bool(p)
        lib.ascend_pool_free(p, 4096, 0, None)
        st = pool.memory_stats()
        out["allocations"] = st["allocation.all.current"]
        print(json.dumps(out))
    """)
    assert r["garbage"] == 4 and r["still_serves"] and r["allocations"] == 0
    assert r["refused_at"] == 0 and r["code"] == 5 and "not a stream the runtime knows" in r["message"], r
    tried("C ABI calls", 4 * 5 + r["refused_at"] + 1)


# -- the ledger file (C): empty, oversized, FIFO, fuzzed -----------------------------------------------

def test_ledger_empty_oversized_and_fifo_are_refused(tmp_path):
    from ascend_pool._core import Ledger
    from ascend_pool.tenants.errors import LedgerError

    path = str(tmp_path / "led")
    Ledger(path, 0, "sim", "n1")
    size = os.path.getsize(path)
    os.truncate(path, 0)
    with pytest.raises(LedgerError, match="is 0 bytes, expected"):
        Ledger(path, 0, "sim", "n1")
    os.truncate(path, size + 4096)
    with pytest.raises(LedgerError, match=f"expected {size}"):
        Ledger(path, 0, "sim", "n1")
    tried("ledger files", 2)
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo, 0o600)
    out = run_child(tmp_path, f"""
        import json
        from ascend_pool._core import Ledger
        from ascend_pool.tenants.errors import LedgerError
        try:
            Ledger({fifo!r}, 0, "sim", "n1")
            print(json.dumps({{"refused": False}}))
        except LedgerError as e:
            print(json.dumps({{"refused": True, "message": str(e)}}))
    """, timeout=60)
    assert out[0]["refused"] and "not a regular file" in out[0]["message"], out
    tried("ledger files")


def test_ledger_fuzzed_bytes_are_refused_or_accepted_never_crash(tmp_path):
    """500 ledgers, each with a few random bytes changed (header, tenant entries, process slots):
    each is refused with LedgerError or opened, and an opened one can be viewed and swept."""
    out = run_child(tmp_path, f"""
        import json, os, random, shutil
        from ascend_pool._core import Ledger
        from ascend_pool.tenants.errors import LedgerError
        d = {str(tmp_path)!r}
        base = os.path.join(d, "base")
        Ledger(base, 0, "sim", "n1")
        size = os.path.getsize(base)
        regions = [(0, 256), (256, 256 + 64 * 128), (256 + 64 * 128, size)]
        rnd = random.Random(2024)
        counts = {{"refused": 0, "accepted": 0, "reasons": {{}}}}
        for i in range(500):
            path = os.path.join(d, f"fuzz{{i}}")
            shutil.copyfile(base, path)
            os.chmod(path, 0o600)
            lo, hi = regions[i % 3]
            with open(path, "r+b") as f:
                for _ in range(rnd.randint(1, 4)):
                    f.seek(rnd.randrange(lo, hi))
                    f.write(bytes([rnd.randrange(256)]))
            try:
                L = Ledger(path, 0, "sim", "n1")
                L.view()
                L.sweep()
                counts["accepted"] += 1
            except LedgerError as e:
                counts["refused"] += 1
                reason = str(e).split("(")[1].split(")")[0] if "(" in str(e) else str(e)[:40]
                counts["reasons"][reason] = counts["reasons"].get(reason, 0) + 1
            os.unlink(path)
        print(json.dumps(counts))
    """, timeout=300)
    counts = out[0]
    assert counts["refused"] + counts["accepted"] == 500
    assert counts["refused"] > 100, counts  # header and entry damage is caught
    tried("ledger files", 500)


# -- the stats file (Python reader): fuzzed, truncated at every length ---------------------------------

def test_stats_file_fuzzed_and_truncated_are_refused_or_read_never_crash(tmp_path):
    from ascend_pool.metrics.sample import TenantSample
    from ascend_pool.metrics.schema import FIELDS, NO_QUOTA
    from ascend_pool.service import layout as L
    from ascend_pool.service.reader import Busy, Refused, Stale, read_stats_file
    from ascend_pool.service.statsfile import StatsFile

    src = tmp_path / "src"
    src.mkdir()
    sf = StatsFile(str(src))
    vals = {f: 5 for f in FIELDS}
    vals["quota_bytes"] = NO_QUOTA
    sf.publish([TenantSample(0, "default", vals), TenantSample(1, "batch", vals)])
    with open(sf.path, "rb") as f:
        good = f.read()
    me = {os.geteuid()}
    rnd = random.Random(7)
    outcomes = {"read": 0, "refused": 0}
    name = os.path.basename(sf.path)
    work = tmp_path / "work"
    work.mkdir()
    path = str(work / name)
    try:
        cases = []
        used = L.HEADER_SIZE + 2 * L.RECORD_SIZE
        for i in range(400):
            data = bytearray(good)
            for _ in range(rnd.randint(1, 3)):
                at = rnd.randrange(L.HEADER_SIZE) if i % 2 else rnd.randrange(L.HEADER_SIZE, used)
                data[at] = rnd.randrange(256)
            cases.append(bytes(data))
        cases += [good[:k] for k in range(0, len(good), 37)]
        for data in cases:
            with open(path, "wb") as f:
                f.write(data)
            os.chmod(path, 0o600)
            try:
                ps = read_stats_file(path, me)
                assert all(isinstance(s.values[f], int) for s in ps.samples for f in FIELDS)
                outcomes["read"] += 1
            except (Refused, Stale, Busy):
                outcomes["refused"] += 1
    finally:
        sf.close()
    assert outcomes["refused"] > 300, outcomes
    tried("stats files", len(cases))


def test_stats_files_are_created_owner_only_whatever_the_umask(tmp_path):
    from ascend_pool.service.statsfile import StatsFile

    old = os.umask(0o000)
    try:
        f = StatsFile(str(tmp_path))
    finally:
        os.umask(old)
    try:
        st = os.stat(f.path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    finally:
        f.close()


# -- the metrics endpoint ---------------------------------------------------------------------------

sys.path.insert(0, TESTS)
from test_metrics_http import _assert_alive, _raw, _request, _status, server  # noqa: E402,F401  (helpers, fixture)


def test_too_many_headers_is_431(server):
    raw = _raw(server.port, b"GET /metrics HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(150)) + b"\r\n")
    assert _status(raw) == 431
    _assert_alive(server.port)
    tried("HTTP requests")


ODD_REQUESTS = {
    "http_0_9": (b"GET /metrics\r\n", (None, 200, 400)),
    "control_bytes": (b"GET /\x00\x01\xff HTTP/1.1\r\n\r\n", (400, 404)),
    "absolute_uri": (b"GET http://evil.example/metrics HTTP/1.1\r\n\r\n", (404,)),
    "traversal": (b"GET /../../../etc/passwd HTTP/1.1\r\n\r\n", (404,)),
    "double_slash": (b"GET //etc/passwd HTTP/1.1\r\n\r\n", (404,)),
    "get_with_huge_length": (b"GET /metrics HTTP/1.1\r\nContent-Length: 5000000\r\n\r\nabc", (200,)),
    "negative_length": (b"GET /metrics HTTP/1.1\r\nContent-Length: -1\r\n\r\n", (200, 400)),
    "chunked_get": (b"GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
                    (200, 400)),
    "long_host": (b"GET /metrics HTTP/1.1\r\nHost: " + b"h" * 60000 + b"\r\n\r\n", (200, 400, 431)),
    "lowercase_method": (b"get /metrics HTTP/1.1\r\n\r\n", (405,)),
    "header_without_colon": (b"GET /metrics HTTP/1.1\r\n" + b"A" * 10 + b"\r\n\r\n", (200, 400)),
}


@pytest.mark.parametrize("case", sorted(ODD_REQUESTS))
def test_odd_requests_are_answered_and_the_server_survives(server, case):
    request_bytes, statuses = ODD_REQUESTS[case]
    raw = _raw(server.port, request_bytes)
    assert _status(raw) in statuses, raw[:120]
    assert b"evil.example" not in raw and b"root:" not in raw  # nothing echoed, no file served
    _assert_alive(server.port)
    tried("HTTP requests")


def test_hundreds_of_idle_connections_do_not_block_a_scrape(server):
    idle = []
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            s.sendall(b"GET /metr")  # a request that never finishes
            idle.append(s)
        _assert_alive(server.port)
    finally:
        for s in idle:
            s.close()
    _assert_alive(server.port)
    tried("HTTP requests", 300)


def test_server_reveals_no_versions_and_binds_loopback_by_default(server):
    status, headers, _ = _request(server.port, "GET", "/nope")
    assert status == 404
    assert headers.get("Server", "").strip() == "ascend-pool", headers  # no Python or library versions
    srv = ap.metrics.start_http_server(0)
    try:
        assert srv.server_address[0] == "127.0.0.1"
    finally:
        srv.close()
    from ascend_pool.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1"

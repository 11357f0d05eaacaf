"""What the command line says when its input is not what it takes: a directory or another non-file
given where a trace file is expected is named as such, with what is expected; a runtime that
does not load is one line."""

import os

import pytest

from ascend_pool.cli import main


def test_a_directory_given_for_a_trace_is_named_as_one(tmp_path, capsys):
    # Before: "ascend-pool replay: FileNotFoundError: no trace file at '/the/dir'", as if the path
    # were mistyped, with nothing about what the command takes.
    assert main(["replay", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{str(tmp_path)!r} is a directory; expected a trace file NAME.npz" in err, err


def test_a_directory_given_to_trace_convert_or_named_like_a_log_among_traces_is_named(tmp_path, capsys):
    # Before: "IsADirectoryError: [Errno 21] Is a directory: 3" (a descriptor's number) from the look
    # for RMM's header line, for trace convert DIR and for bench --traces with a folder x.csv in it
    assert main(["trace", "convert", str(tmp_path), str(tmp_path / "o.npz")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{str(tmp_path)!r} is a directory; expected a PyTorch memory snapshot" in err, err
    (tmp_path / "logs.csv").mkdir()
    assert main(["bench", "--traces", str(tmp_path), "--backend", "sim", "--no-micro"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"ascend-pool bench: ValueError: no .npz traces in {tmp_path}", err


def test_a_path_that_is_there_but_no_file_is_named_as_such(tmp_path, capsys):
    # Before: "no trace file at '/dev/null'", as if the path did not exist.
    fifo = tmp_path / "t.npz"
    os.mkfifo(fifo)
    for path, kind in (("/dev/null", "a character device"), (str(fifo), "a FIFO")):
        assert main(["replay", path]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"ascend-pool replay: FileNotFoundError: {path!r} is {kind}, not a regular file; "
                              "expected a trace file NAME.npz"), err
    assert main(["replay", str(tmp_path / "missing.npz")]) == 2
    assert "no trace file at" in capsys.readouterr().err


def test_a_runtime_that_does_not_load_is_one_line_naming_what_was_tried(monkeypatch, capsys):
    # The Python API's message lists the libraries tried one per line; the command printed them so
    # (5 lines) where it prints one line per error (docs/bad_input.md).
    monkeypatch.setenv("ASCEND_POOL_ACL_LIB", "/nonexistent/libascendcl.so")
    assert main(["bench", "--backend", "acl"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.strip() == ("ascend-pool bench: BackendUnavailableError: could not load libascendcl.so; tried: "
                           "/nonexistent/libascendcl.so: cannot open shared object file: No such file or directory"), err


@pytest.mark.parametrize("argv, option", [
    (["serve", "--port", "0", "--config", ""], "--config"),
    (["serve", "--port", "0", "--stats-dir", ""], "--stats-dir"),
    (["serve", "--port", "0", "--replay", "a.npz", ""], "--replay"),
    (["ps", "--stats-dir", ""], "--stats-dir"),
    (["replay", ""], "trace"),
    (["trace", "convert", "", "out.npz"], "snapshot"),
    (["trace", "convert", "in.pickle", ""], "out"),
    (["check-config", ""], "file"),
    (["bench", "--traces", ""], "--traces"),
    (["bench", "--json", ""], "--json"),
    (["bench", "--markdown", ""], "--markdown"),
])
def test_an_empty_path_from_an_unset_variable_is_named_before_any_work(argv, option, capsys):
    # Before: ps/serve --stats-dir "" read the default directory and serve --config "" the directory
    # ".", silently; replay "" said "'.' is a directory", trace convert X "" "PosixPath('.') has an
    # empty name", check-config "" ": cannot read the tenants file", bench --json "" "No such file: ''"
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(f"error: argument {option}: expected a path, got '' (an unset variable?)"), err


@pytest.mark.parametrize("argv, option", [
    (["check-config", "{toml}", "--device", "8"], "--device"),  # was --device-bytes 8, exit 0
    (["serve", "--conf", "{toml}"], "--conf"),                   # was --config
    (["bench", "--micro", "3", "--traces", "/nonexistent"], "--micro"),
    (["trace", "convert", "/nonexistent.pickle", "/nonexistent.npz", "--dev", "0"], "--dev"),
])
def test_an_option_is_never_taken_by_a_prefix_of_its_name(argv, option, tmp_path, capsys):
    # argparse's abbreviations read `check-config FILE --device 8` (as serve's and replay's
    # --device) as --device-bytes 8: an 8-byte device every quota overcommits, exit 0
    toml = tmp_path / "t.toml"
    toml.write_text('[tenants.online]\nquota = "1GiB"\n')
    with pytest.raises(SystemExit) as exc:
        main([a.format(toml=toml) for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"error: unrecognized arguments: {option}" in err, err


def test_trace_convert_names_the_file_it_wrote(tmp_path, capsys):
    # np.savez adds .npz to a name without it: `trace convert S out` wrote out.npz and said "-> out"
    import ascend_pool as ap

    pool = ap.Pool(0, backend="sim")
    try:
        pool.record_memory_history(True)
        pool.free(pool.malloc(4096))
        pool.dump_snapshot(str(tmp_path / "s.pickle"))
    finally:
        pool.close()
    assert main(["trace", "convert", str(tmp_path / "s.pickle"), str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert f" -> {tmp_path / 'out.npz'}: 1 allocs" in said, said
    assert (tmp_path / "out.npz").is_file() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("size", ["99999999999999999999999999GiB", str(2**63), "8388608TiB"])
def test_check_config_refuses_a_device_larger_than_any(size, tmp_path, capsys):
    # accepted before: "25%" of it was a quota of 2.6e34 bytes, which no ledger holds, said ok
    toml = tmp_path / "t.toml"
    toml.write_text('[tenants.a]\nquota = "25%"\n')
    assert main(["check-config", str(toml), "--device-bytes", size]) == 2
    out, err = capsys.readouterr()
    assert err.strip() == (f"ascend-pool check-config: --device-bytes: {size!r} is larger than any device "
                           f"(at most {2**63 - 1} bytes)") and out == ""
    assert main(["check-config", str(toml), "--device-bytes", str(2**63 - 1)]) == 0


def test_bench_json_to_stdout_says_the_failures_its_exit_1_stands_for(monkeypatch, capsys):
    # with --json - the report (and its "Errors" lines) is not printed: exit 1, nothing said on
    # stderr of why, the failures inside the JSON only
    import json

    from ascend_pool import OutOfMemoryError
    from ascend_pool.bench import run
    from ascend_pool.traces import bundled_traces_dir

    def failing(*args, **kwargs):
        raise OutOfMemoryError("out of memory: injected")
    monkeypatch.setattr(run._peers, "run_peer", failing)
    assert main(["bench", "--traces", str(bundled_traces_dir()), "--trace", "resnet18_train_prefix", "--no-micro",
                 "--allocators", "direct", "--backend", "sim", "--json", "-", "--no-progress"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["errors"]
    assert "error: direct on resnet18_train_prefix: OutOfMemoryError: out of memory: injected" in err.splitlines()


def test_bench_refuses_a_bad_ascend_pool_conf_before_any_replay(monkeypatch, capsys):
    # with --no-micro the ascend_pool rows failed one by one after the whole run ("## Errors"),
    # exit 1, where a bad --conf is refused up front
    from ascend_pool.bench import run
    from ascend_pool.traces import bundled_traces_dir

    def never(*args, **kwargs):
        raise AssertionError("a replay ran")
    monkeypatch.setattr(run._peers, "run_peer", never)
    monkeypatch.setenv("ASCEND_POOL_CONF", "max_split_size_mb:nan")
    assert main(["bench", "--traces", str(bundled_traces_dir()), "--trace", "resnet18_train_prefix", "--no-micro",
                 "--backend", "sim", "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == ["ascend-pool bench: ConfigError: ASCEND_POOL_CONF='max_split_size_mb:nan': "
                                        "max_split_size_mb: expected a finite number, got 'nan'"] and out == ""


@pytest.mark.parametrize("conf", ["max_split_size_mb:nan", "expandable_segments:true", ""])
def test_replay_direct_refuses_knobs_it_would_ignore(conf, capsys):
    # direct mode opens no pool: --conf was taken and ignored, a bad value (nan) too, exit 0
    from ascend_pool.traces import bundled_traces_dir

    trace = str(bundled_traces_dir() / "resnet18_train_prefix.npz")
    assert main(["replay", trace, "--backend", "sim", "--mode", "direct", "--conf", conf]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("ascend-pool replay: ConfigError: --conf: --mode direct replays without a pool") and out == ""


def test_an_empty_trace_name_from_an_unset_variable_is_named(capsys):
    # bench --trace "$T" with T unset said "ValueError: no trace(s)  in DIR", naming nothing
    with pytest.raises(SystemExit) as e:
        main(["bench", "--no-micro", "--trace", "resnet18_train_prefix", "--trace", ""])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("error: argument --trace: expected a name, got '' (an unset variable?)"), err

"""Every numeric option of every subcommand is range-checked before the command does any work:
nan, inf, 0 where a positive number is needed, negatives and out-of-range ints are refused with one
line on stderr naming the option and the value, exit 2 (audit: `serve --sweep-interval 0`, `-1` or
`nan` was accepted and spun at full CPU; `serve --port 99999` ended in an OverflowError traceback)."""

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_service_serve import env_for  # noqa: E402

from ascend_pool import cli  # noqa: E402

# Each case also carries an argument that fails on its own (a missing file or directory), so that
# a command which does not check the option fails fast instead of running: the test then sees a
# message that does not name the option.
MISSING = "/nonexistent/ascend-pool-test"
BAD = [
    ("serve", "--sweep-interval", "0"),
    ("serve", "--sweep-interval", "-1"),
    ("serve", "--sweep-interval", "nan"),
    ("serve", "--sweep-interval", "inf"),
    ("serve", "--sweep-interval", "1e300"),
    ("serve", "--port", "99999"),
    ("serve", "--port", "-1"),
    ("serve", "--replay-pause", "-0.5"),
    ("serve", "--replay-pause", "nan"),
    ("serve", "--device", "-1"),
    ("serve", "--allow-uid", "-5"),
    ("serve", "--allow-uid", str(2**40)),
    ("ps", "--allow-uid", "-1"),
    ("serve", "--allow-group", str(2**40)),  # a gid no directory has: accepted, matched nothing
    ("ps", "--allow-group", str(2**32 - 1)),
    ("bench", "--micro-runs", "0"),
    ("bench", "--micro-ms", "nan"),
    ("bench", "--micro-ms", "0"),
    ("bench", "--micro-ms", "-inf"),
    ("bench", "--malloc-latency-us", "-5"),
    ("bench", "--free-latency-us", str(2**64)),
    ("bench", "--variants", "-3"),
    ("bench", "--micro-runs", str(2**70)),  # accepted before: the bench never ended
    ("bench", "--micro-runs", "10001"),
    ("bench", "--variants", str(2**70)),
    ("bench", "--device", "-1"),
    ("replay", "--device", "-1"),
    ("trace", "--device", "-2"),
]
FAILING_OTHERWISE = {
    "serve": ["--stats-dir", MISSING],
    "ps": ["--stats-dir", MISSING],
    "bench": ["--traces", MISSING, "--no-micro"],
    "replay": [MISSING + ".npz"],
    "trace": ["convert", MISSING + ".pickle", MISSING + ".npz"],
}


def _argv(command, option, value):
    head = ["trace", "convert", MISSING + ".pickle", MISSING + ".npz"] if command == "trace" else (
        [command] + FAILING_OTHERWISE[command])
    return head + [f"{option}={value}"]


@pytest.mark.parametrize("command,option,value", BAD, ids=[" ".join(c) for c in BAD])
def test_bad_numeric_option_is_one_line_naming_it_exit_2(command, option, value, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("ASCEND_POOL_STATS_DIR", str(tmp_path))  # serve sets it from --stats-dir
    assert cli.main(_argv(command, option, value)) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"ascend-pool {command}: ConfigError: {option}: expected "), err
    assert value in lines[0] or str(float(value)) in lines[0] or str(int(value)) in lines[0], err
    assert out == ""


@pytest.mark.parametrize("command", ["serve", "ps"])
def test_an_unknown_group_is_one_line_naming_the_option(command, capsys, monkeypatch, tmp_path):
    # Before: "ValueError: 'no-such-group-here' is not a group on this system", no option named
    monkeypatch.setenv("ASCEND_POOL_STATS_DIR", str(tmp_path))
    assert cli.main([command, *FAILING_OTHERWISE[command], "--allow-group", "no-such-group-here"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"ascend-pool {command}: ConfigError: --allow-group: 'no-such-group-here' is not a "
                           "group on this system"), err


def _run(env, *args, timeout=20):
    return subprocess.run([sys.executable, "-m", "ascend_pool.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.mark.parametrize("value", ["0", "nan"])
def test_serve_refuses_a_spinning_sweep_interval_at_once(tmp_path, value):
    # Before: accepted, then the sweep thread spun at ~100 % CPU (the command never returned).
    try:
        r = _run(env_for(tmp_path), "serve", "--port", "0", "--sweep-interval", value)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve --sweep-interval {value} was accepted")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--sweep-interval: expected a finite number of seconds > 0" in r.stderr and value in r.stderr


@pytest.mark.parametrize("port", ["99999", "-1", "65536"])
def test_serve_port_out_of_range_is_one_line_exit_2(tmp_path, port):
    # Before: a traceback ending in "OverflowError: bind(): port must be 0-65535.", exit 1.
    r = _run(env_for(tmp_path), "serve", "--port", port)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"ascend-pool serve: ConfigError: --port: expected a port number, an int from "
                                f"0 to 65535 (0 picks a free one), got {port}"), r.stderr


@pytest.mark.parametrize("argv", [["ps", "--bogus"], ["check-config", MISSING, "--nope"],
                                  ["trace", "convert", MISSING, MISSING + ".npz", "--odd"]])
def test_an_unknown_option_after_a_command_shows_that_commands_usage(argv, capsys):
    """argparse printed the top-level usage ('ascend-pool [-h] [--version] {replay,...}') for a
    mistake in a command's options; the command's own usage is the one that helps."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    prog = " ".join(argv[:2] if argv[0] == "trace" else argv[:1])
    assert err.startswith(f"usage: ascend-pool {prog}"), err
    assert f"unrecognized arguments: {argv[-1]}" in err

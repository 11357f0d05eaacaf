"""Ctrl-C (SIGINT) in an `ascend-pool` command: one line and the shell's 130, no traceback, and the
process default pool keeps no block, stream or run the interrupted bench made in it."""

import os
import signal
import subprocess
import sys
import time

import ascend_pool as ap
from ascend_pool import _core, sim
from ascend_pool.bench import micro
from ascend_pool.cli import main

# the package this test imported (the installed one in CI, an in-place build by hand)
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(ap.__file__)))


def test_ctrl_c_in_bench_is_one_line_and_exit_130(tmp_path):
    env = dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-m", "ascend_pool.cli", "bench", "--backend", "sim",
                          "--json", str(tmp_path / "b.json")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                         # as a terminal's Ctrl-C finds it: a test run started in the background
                         # (`.ci/run &`) hands its children SIGINT ignored, and Python keeps that
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(4)  # started and inside the run (the whole bench takes minutes)
    assert p.poll() is None, p.communicate()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert err.strip().splitlines() == ["ascend-pool bench: interrupted"], err


def test_an_interrupted_tail_run_leaves_the_default_pool_as_it_was(monkeypatch, capsys):
    pool = ap.default_pool(0)
    micro.run_tail(0, pairs=1000, rounds=1)  # the default stream made (it counts once made), as by a whole run
    made = []

    class Interrupted(_core.TailRun):
        def __init__(self, *args):
            made.append(args)
            if len(made) == 2:  # the timed run: after its busy stream and block were made
                raise KeyboardInterrupt

    monkeypatch.setattr(micro._core, "TailRun", Interrupted)
    monkeypatch.setattr("ascend_pool.bench.run.run_micro",
                        lambda be, device, **kw: micro.run_tail(device, pairs=1000, rounds=1))
    before_blocks = pool.memory_stats()["allocation.all.current"]
    before_streams = sim.stats(0)["live_streams"]
    assert main(["bench", "--backend", "sim", "--json", "-"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["ascend-pool bench: interrupted"]
    assert len(made) == 2
    assert pool.memory_stats()["allocation.all.current"] == before_blocks
    assert sim.stats(0)["live_streams"] == before_streams

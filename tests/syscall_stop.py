"""Stopping a real process at one system call with strace, for tests of what a process killed at
the wrong moment leaves behind: killed there (action "signal=KILL") or held there alive
("delay_enter=MICROSECONDS")."""

import os
import signal
import shutil
import subprocess
import sys
import time

import pytest

needs_strace = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace to stop a process at a system call")


def child_env(tmp_path):
    """The environment of a started process: this tree's ascend_pool, and its own ledger and
    simulator directories (made) under tmp_path."""
    import ascend_pool

    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(ascend_pool.__file__)))
    e = dict(os.environ, PYTHONPATH=pkg_parent, ASCEND_POOL_LEDGER_DIR=str(tmp_path / "ledgers"),
             ASCEND_SIM_SHM_DIR=str(tmp_path / "sim"))
    os.mkdir(e["ASCEND_POOL_LEDGER_DIR"])
    os.mkdir(e["ASCEND_SIM_SHM_DIR"])
    return e


def at_syscall(env, code, syscall, action, nth=1, *args, **kw):
    """python -c code (with args) under strace, its nth call of syscall given action; a Popen in a
    session of its own (os.killpg ends strace and the process it holds)."""
    cmd = ["strace", "-f", "-qq", "-o", "/dev/null", "-e", f"trace={syscall}", "-e",
           f"inject={syscall}:{action}:when={nth}", sys.executable, "-c", code, *args]
    return subprocess.Popen(cmd, env=env, start_new_session=True, **kw)


def age(directory, names, seconds=3600):
    """Sets the named files' times seconds into the past (older than any staleness bound)."""
    old = time.time() - seconds
    for n in names:
        os.utime(os.path.join(directory, n), (old, old))


def run_printing(env, code, expected, timeout=60):
    """Runs python -c code to its end and checks it printed expected."""
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.stdout.strip() == expected, r.stderr


def held_makers_file_stays(maker, temporaries, age, start, timeout_s=15):
    """maker (at_syscall with "delay_enter=...") is held alive at the call that would publish its
    temporary file: once the file shows in temporaries(), aged past any staleness bound
    (age(names)), it survives a start (start(): a process whose start sweeps) while its maker
    lives, and goes at the next start once the maker is killed."""
    try:
        # The file it is held at: the first temporary seen may be one the maker links a moment
        # later (a lease's, before a record's), so wait until the set has stood still for 0.5 s.
        deadline, seen, still_since = time.monotonic() + timeout_s, None, time.monotonic()
        while time.monotonic() < deadline:
            now = temporaries()
            if now != seen:
                seen, still_since = now, time.monotonic()
            elif now and time.monotonic() - still_since >= 0.5:
                break
            time.sleep(0.02)
        (name,) = temporaries()
        time.sleep(0.2)
        age([name])
        start()
        assert temporaries() == [name] and maker.poll() is None
    finally:
        os.killpg(maker.pid, signal.SIGKILL)  # strace and the maker it holds
        maker.wait()
    age([name])
    start()
    assert temporaries() == []

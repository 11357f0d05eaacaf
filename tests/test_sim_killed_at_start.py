"""A process killed (SIGKILL) while the simulator makes its leases or a node record left the
temporary file (cython/sim/proc.c create_locked, node.c create_record_over; ~10 KB for a record)
in ASCEND_SIM_SHM_DIR for good. The next process to attach there removes those whose maker is gone
(proc.c sim_proc_sweep_abandoned), never one whose maker is alive. strace delivers the SIGKILL at
the link() that would publish the file, or holds a live maker there."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import ascend_pool as ap

PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(ap.__file__)))
START = "import ascend_pool as ap; ap.Pool(0, backend='sim').close(); print('started')"
# The simulator's links, in order: private lease, public lease, the device's node record.
LEASE_LINK, ALIVE_LINK, RECORD_LINK = 1, 2, 3

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace to stop a process at link()")


@pytest.fixture
def env(tmp_path):
    e = dict(os.environ, PYTHONPATH=PKG_PARENT, ASCEND_POOL_LEDGER_DIR=str(tmp_path / "ledgers"),
             ASCEND_SIM_SHM_DIR=str(tmp_path / "sim"))
    os.mkdir(e["ASCEND_POOL_LEDGER_DIR"])
    os.mkdir(e["ASCEND_SIM_SHM_DIR"])
    return e


def at_link(env, action, nth):
    cmd = ["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=link", "-e", f"inject=link:{action}:when={nth}",
           sys.executable, "-c", START]
    return subprocess.Popen(cmd, env=env, start_new_session=True)


def temporaries(env):
    return sorted(n for n in os.listdir(env["ASCEND_SIM_SHM_DIR"]) if n.startswith("ascendsim") and ".tmp" in n)


def age(env, names, seconds=3600):
    old = time.time() - seconds
    for n in names:
        os.utime(os.path.join(env["ASCEND_SIM_SHM_DIR"], n), (old, old))


def start(env):
    r = subprocess.run([sys.executable, "-c", START], env=env, capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "started", r.stderr


def test_the_simulators_files_of_makers_killed_while_starting_are_removed_by_the_next_start(env):
    for nth in (LEASE_LINK, ALIVE_LINK, RECORD_LINK):
        assert at_link(env, "signal=KILL", nth).wait() == -9
    left = temporaries(env)
    assert [n.split("-")[1] for n in left] == [str(os.geteuid()), "alive", "lease"], left
    assert os.path.getsize(os.path.join(env["ASCEND_SIM_SHM_DIR"], left[0])) > 4096  # the record
    start(env)
    assert temporaries(env) == left[1:]  # a lease's: a minute old at most, its maker may be before its lock
    age(env, left[1:])
    start(env)
    assert temporaries(env) == []
    leases = [n for n in os.listdir(env["ASCEND_SIM_SHM_DIR"]) if n.startswith("ascendsim-lease-")]
    assert len(leases) == 1  # the last start's: the killed makers' published leases went too


@pytest.mark.parametrize("nth", [LEASE_LINK, RECORD_LINK])
def test_a_live_makers_temporary_file_stays(env, nth):
    maker = at_link(env, "delay_enter=20000000", nth)  # alive, held 20 s at its link()
    try:
        deadline = time.monotonic() + 15
        while not temporaries(env) and time.monotonic() < deadline:
            time.sleep(0.02)
        (name,) = temporaries(env)
        time.sleep(0.2)
        age(env, [name])
        start(env)
        assert temporaries(env) == [name] and maker.poll() is None
    finally:
        os.killpg(maker.pid, signal.SIGKILL)  # strace and the maker it holds
        maker.wait()
    age(env, [name])
    start(env)
    assert temporaries(env) == []

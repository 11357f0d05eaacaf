"""A process killed (SIGKILL) while the simulator made its leases or a node record left the
temporary file (cython/sim/proc.c create_locked, node.c create_record_over; ~10 KB for a record)
in ASCEND_SIM_SHM_DIR for good; one killed after publishing an IPC record but before the record was
live left the record, as large as the memory exported. The next process to attach there (export,
for IPC records) removes those whose maker is gone (proc.c sim_proc_sweep_abandoned, ipc.c
sweep_stale), never one whose maker is alive. strace delivers the SIGKILL at the link() that would
publish the file (at the unlink() right after it, for an IPC record), or holds a live maker there."""

import os
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from syscall_stop import child_env, age as age_files, at_syscall, held_makers_file_stays, needs_strace, run_printing  # noqa: E402

START = "import ascend_pool as ap; ap.Pool(0, backend='sim').close(); print('started')"
# The simulator's links, in order: private lease, public lease, the device's node record.
LEASE_LINK, ALIVE_LINK, RECORD_LINK = 1, 2, 3

pytestmark = needs_strace


@pytest.fixture
def env(tmp_path):
    e = child_env(tmp_path)
    return e


def at_link(env, action, nth):
    return at_syscall(env, START, "link", action, nth)


def temporaries(env):
    return sorted(n for n in os.listdir(env["ASCEND_SIM_SHM_DIR"]) if n.startswith("ascendsim") and ".tmp" in n)


def age(env, names):
    age_files(env["ASCEND_SIM_SHM_DIR"], names)


def start(env):
    run_printing(env, START, "started")


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
    held_makers_file_stays(maker, lambda: temporaries(env), lambda names: age(env, names), lambda: start(env))


EXPORT = ("import ascend_pool as ap; p = ap.Pool(0, backend='sim'); "
          "s = p.share(p.share_malloc(8 << 20), any_process=True); print('exported', flush=True)")


def ipc_publication(env, tmp_path):
    """Which unlink() of an exporter removes its IPC record's temporary name, right after the link()
    that published the record (then not yet live: its memory is copied in next)."""
    log, fresh = str(tmp_path / "unlinks"), dict(env)
    for key in ("ASCEND_POOL_LEDGER_DIR", "ASCEND_SIM_SHM_DIR"):  # as empty as env's own: the same calls
        fresh[key] = str(tmp_path / "count" / key)
        os.makedirs(fresh[key])
    subprocess.run(["strace", "-f", "-qq", "-o", log, "-e", "trace=unlink", sys.executable, "-c", EXPORT],
                   env=fresh, check=True, capture_output=True)
    calls = [line for line in open(log) if "unlink(" in line]
    return 1 + next(i for i, line in enumerate(calls) if "-ipc-" in line and ".tmp." in line)


def ipc_records(env):
    return sorted(n for n in os.listdir(env["ASCEND_SIM_SHM_DIR"]) if "-ipc-" in n)


def export(env):
    r = subprocess.run([sys.executable, "-c", EXPORT], env=env, capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "exported", r.stderr


def test_an_ipc_record_whose_exporter_was_killed_before_it_was_live_is_removed(env, tmp_path):
    nth = ipc_publication(env, tmp_path)
    cmd = ["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=unlink", "-e", f"inject=unlink:signal=KILL:when={nth}",
           sys.executable, "-c", EXPORT]
    assert subprocess.run(cmd, env=env).returncode == -9
    left = ipc_records(env)
    assert len(left) == 2 and ".tmp." in left[1], left  # the record, and its temporary name
    assert os.path.getsize(os.path.join(env["ASCEND_SIM_SHM_DIR"], left[0])) > 8 << 20
    export(env)  # sweeps at export: a record never live whose exporter is dead, not only its temporary name
    assert not set(ipc_records(env)) & set(left)


def test_an_ipc_record_of_a_live_exporter_not_yet_live_stays(env, tmp_path):
    nth = ipc_publication(env, tmp_path)
    cmd = ["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=unlink", "-e",
           f"inject=unlink:delay_enter=20000000:when={nth}", sys.executable, "-c", EXPORT]
    maker = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 15
        while not ipc_records(env) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        held = ipc_records(env)
        assert len(held) == 2, held
        export(env)
        assert set(held) <= set(ipc_records(env)) and maker.poll() is None
    finally:
        os.killpg(maker.pid, signal.SIGKILL)
        maker.wait()
    export(env)
    assert not set(ipc_records(env)) & set(held)


def test_a_record_of_a_node_named_like_a_temporary_file_stays(env):
    # ascendsim-<uid>-x.tmp.<16 hex>.1-dev0: a published record of node "x.tmp.<hex>.1", not a temporary one
    node = "x.tmp.%016x.1" % 0xDEAD
    start(dict(env, ASCEND_SIM_NODE=node))
    records = [n for n in os.listdir(env["ASCEND_SIM_SHM_DIR"]) if n.startswith(f"ascendsim-{os.geteuid()}-x.tmp.")]
    assert records
    age(env, records)
    start(env)  # another node's process sweeps the directory
    assert all(os.path.exists(os.path.join(env["ASCEND_SIM_SHM_DIR"], n)) for n in records)

"""A process killed (SIGKILL) while it makes its quota ledger or its lease leaves a temporary file
(~74 KB for a ledger) in the ledger directory, /dev/shm by default; on a node whose pods are killed
while starting (the OOM killer, failed readiness) they piled up. The next process to start there
removes those whose maker is gone, never one whose maker is alive (identity.remove_dead_leases).
strace delivers the SIGKILL at the link() that would publish the file, or holds a live maker there."""

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from syscall_stop import child_env, age, at_syscall, held_makers_file_stays, needs_strace, run_printing  # noqa: E402
from ascend_pool import identity

START = "import ascend_pool as ap; ap.Pool(0, backend='sim').context('t', quota=8 << 20); print('started')"
PREP = ("import sys, ascend_pool as ap; from ascend_pool.private_dir import private_dir; "
        "ap.Pool(0, backend='sim').close(); print(private_dir(sys.argv[1]))")
LEASE = "import sys; from ascend_pool import identity; identity.ensure_lease(sys.argv[1])"
LEDGER_LINK = 3  # the process's third link(): after the simulator's two leases (cython/sim/proc.c)

pytestmark = needs_strace


@pytest.fixture
def env(tmp_path):
    e = child_env(tmp_path)
    e["PRIV"] = subprocess.run([sys.executable, "-c", PREP, e["ASCEND_POOL_LEDGER_DIR"]], env=e, check=True,
                               capture_output=True, text=True).stdout.strip()
    return e


def at_link(env, code, action, nth=1, *args, **kw):
    return at_syscall(env, code, "link", action, nth, *args, **kw)


def temporaries(priv):
    return sorted(n for n in os.listdir(priv) if ".tmp" in n)


def start(env):
    run_printing(env, START, "started")


def test_the_files_of_makers_killed_while_starting_are_removed_by_the_next_start(env):
    priv = env["PRIV"]
    assert at_link(env, START, "signal=KILL", LEDGER_LINK).wait() == -9  # inside apl_create
    assert at_link(env, LEASE, "signal=KILL", 1, priv).wait() == -9  # inside ensure_lease
    left = temporaries(priv)
    assert len(left) == 2 and left[0].startswith(".ascend_pool-lease-") and left[0].endswith(".tmp")
    assert left[1].startswith(f"ascend_pool-ledger-u{identity.host_uid()}-sim-") and ".tmp." in left[1]
    assert os.path.getsize(os.path.join(priv, left[1])) > 70000
    start(env)
    assert temporaries(priv) == left  # a minute old at most: its maker may be stopped before its lock
    age(priv, left)
    start(env)
    assert temporaries(priv) == []


@pytest.mark.parametrize("what", ["ledger", "lease"])
def test_a_live_makers_temporary_file_stays(env, what):
    priv = env["PRIV"]
    code, nth, args = (START, LEDGER_LINK, ()) if what == "ledger" else (LEASE, 1, (priv,))
    maker = at_link(env, code, "delay_enter=20000000", nth, *args)  # alive, held 20 s at its link()
    held_makers_file_stays(maker, lambda: temporaries(priv), lambda names: age(priv, names), lambda: start(env))


EXPORT = """
import os, signal, sys, time
import ascend_pool as ap
link = os.link
def at_link(src, dst, *a, **kw):  # the exporter's first share record, at its publication
    if "ascend_pool-share-" in os.path.basename(dst):
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        print("held", flush=True)
        time.sleep(60)
    return link(src, dst, *a, **kw)
os.link = at_link
pool = ap.Pool(0, backend="sim")
pool.share(pool.share_malloc(1 << 20), any_process=True)
"""


def test_a_share_record_killed_exporters_temporary_file_is_removed_a_live_ones_stays(env):
    priv = env["PRIV"]
    assert subprocess.run([sys.executable, "-c", EXPORT, "kill"], env=env).returncode == -9
    (dead,) = temporaries(priv)
    assert dead.startswith("ascend_pool-share-") and ".tmp." in dead
    live = subprocess.Popen([sys.executable, "-c", EXPORT, "hold"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert live.stdout.readline().strip() == "held"
        (held,) = set(temporaries(priv)) - {dead}
        age(priv, [dead, held])
        start(env)
        assert temporaries(priv) == [held] and live.poll() is None
    finally:
        live.kill()
        live.wait()
    start(env)  # its maker is gone now
    assert temporaries(priv) == []

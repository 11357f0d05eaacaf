"""Lease files of dead processes past the first 256 a start looks at (identity.remove_dead_leases:
each process's first lease in a directory removes the dead ones among the first 256 lease names
listed, bounded work at start): pods killed in a crash loop, or a node whose service was down,
leave more. What a user relies on: they do not stay for good (each later start removes up to 256,
the node service's sweep all of them), and a live process's lease is never taken among them."""
import os
import subprocess
import sys

import pytest

from ascend_pool import identity
from ascend_pool.tenants import ledger

PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(identity.__file__)))
HOLD = "import sys; from ascend_pool import identity; identity.ensure_lease(sys.argv[1]); print('ok', flush=True); " \
       "sys.stdin.read()"
START = "import sys; from ascend_pool import identity; identity.ensure_lease(sys.argv[1])"


def _dead(directory, n, first):
    for i in range(n):
        open(os.path.join(directory, f"{identity.LEASE_PREFIX}{first + i:016x}"), "w").close()


def _leases(directory):
    return {n for n in os.listdir(directory) if n.startswith(identity.LEASE_PREFIX)}


@pytest.fixture
def env(tmp_path):
    return dict(os.environ, PYTHONSAFEPATH="1", ASCEND_POOL_LEDGER_DIR=str(tmp_path), ASCEND_POOL_BACKEND="sim",
                PYTHONPATH=os.pathsep.join(filter(None, [PKG_PARENT, os.environ.get("PYTHONPATH")])))


def test_dead_leases_past_the_first_256_go_at_later_starts_and_at_one_service_sweep(tmp_path, env, monkeypatch):
    d = str(tmp_path / "leases")
    os.mkdir(d, 0o700)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, d], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "ok\n"
        live = _leases(d)
        _dead(d, 600, 1 << 40)
        counts = []
        for _ in range(3):  # each start: at most 256 looked at, its own lease made (dead once it exits)
            subprocess.run([sys.executable, "-c", START, d], env=env, check=True, timeout=60)
            counts.append(len(_leases(d) - live))
        assert counts[0] >= 600 + 1 - 256 and counts[-1] == 1, counts  # the last start's own lease is left
        assert live <= _leases(d)  # the holder's, alive, is never removed

        # The node service's sweep (ledger.sweep, in a directory holding a ledger) takes them all at once.
        monkeypatch.setenv("ASCEND_POOL_LEDGER_DIR", str(tmp_path))
        monkeypatch.delenv("ASCEND_POOL_LEDGER_GROUP", raising=False)
        own = ledger.ledger_dir()
        ledger.open_ledger(0, "sim")  # a ledger there, as a tenant's process leaves
        subprocess.run([sys.executable, "-c", HOLD, own], env=env, input="", text=True, check=True, timeout=60)
        _dead(own, 1000, 1 << 41)
        before = len(_leases(own))
        ledger.sweep()
        after = _leases(own)
        assert before == 1001 and after == set(), (before, len(after))  # 1000 + the exited holder's
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)

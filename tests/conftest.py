"""Shared test setup: every test session gets its own simulated node (isolated shared-memory
records), so runs never see each other's simulated devices."""

import atexit
import os
import shutil
import tempfile

import pytest

_SHM_DIR = tempfile.mkdtemp(prefix="ascend-sim-test-")
# Child processes must import the installed package (pip install .), not the source folder that
# `python -m`/`-c` would otherwise find first in the current directory (it has no compiled
# extension). A developer testing an in-place build sets PYTHONPATH=. explicitly.
os.environ.setdefault("PYTHONSAFEPATH", "1")
os.environ.setdefault("ASCEND_SIM_NODE", f"test{os.getpid()}")
os.environ.setdefault("ASCEND_SIM_SHM_DIR", _SHM_DIR)
os.environ.setdefault("ASCEND_POOL_BACKEND", "sim")
os.environ.setdefault("ASCEND_POOL_STATS_DIR", _SHM_DIR)    # per-process stats files of the node service
os.environ.setdefault("ASCEND_POOL_LEDGER_DIR", _SHM_DIR)   # tenants' quota ledgers
os.environ.pop("ASCEND_POOL_CONF", None)


# Removed at interpreter exit, after the stats publisher's own exit handler (atexit runs the
# handlers registered later first), so that its last write does not find the folder gone.
atexit.register(shutil.rmtree, _SHM_DIR, ignore_errors=True)


@pytest.fixture
def pool():
    """A fresh pool on simulated device 0, closed (all device memory returned) after the test."""
    import ascend_pool as ap

    p = ap.Pool(0, backend="sim")
    yield p
    p.close()


@pytest.fixture
def clean_faults():
    """Simulator fault injection disarmed before and after the test (the runtime is started first:
    fault setters need an initialised runtime)."""
    from ascend_pool import sim
    from ascend_pool.backend import open_backend

    open_backend("sim")
    sim.reset_faults()
    yield sim
    sim.reset_faults()

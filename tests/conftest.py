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


def _hypothesis_profiles():
    """Randomized tests are reproducible and bounded in CI, free to explore locally.

    ci (CI=true): derandomized (the same examples every run), no example database, a deadline
        per example (30 s: for a pathological example, not for a loaded machine's slow one,
        which Hypothesis fails as "Unreliable test timings" when its rerun is quicker), one bug
        reported, shrinking capped at 60 s (a failure still shows a small
        example, but a run never spends minutes shrinking).
    dev (default elsewhere): random seeds, the local database (.hypothesis/) replays past
        failures first; shrinking capped at 120 s.
    explore: like dev, 1000 examples where a test sets no max_examples, no shrink cap.
    HYPOTHESIS_PROFILE=ci|dev|explore picks one explicitly. A test's own @settings win over
    the profile for what they set (e.g. max_examples, deadline=None)."""
    from datetime import timedelta

    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.internal.conjecture import engine

    common = dict(deadline=timedelta(seconds=30), suppress_health_check=[HealthCheck.too_slow], print_blob=True)
    settings.register_profile("ci", derandomize=True, database=None, report_multiple_bugs=False, **common)
    settings.register_profile("dev", **common)
    settings.register_profile("explore", max_examples=1000, phases=tuple(Phase), **common)
    ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
    name = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if ci else "dev")
    settings.load_profile(name)
    # Hypothesis bounds shrinking only by an engine constant (300 s); lower it outside `explore`.
    if name != "explore" and hasattr(engine, "MAX_SHRINKING_SECONDS"):
        engine.MAX_SHRINKING_SECONDS = 60 if name == "ci" else 120


_hypothesis_profiles()


@pytest.fixture(scope="module")
def module_ledger_dir(tmp_path_factory):
    """ASCEND_POOL_LEDGER_DIR set to a directory of the module's own for all its tests (a module
    whose state machines open tenant contexts across examples), restored after it."""
    import os

    old = os.environ.get("ASCEND_POOL_LEDGER_DIR")
    os.environ["ASCEND_POOL_LEDGER_DIR"] = str(tmp_path_factory.mktemp("ledger"))
    yield
    if old is None:
        os.environ.pop("ASCEND_POOL_LEDGER_DIR", None)
    else:
        os.environ["ASCEND_POOL_LEDGER_DIR"] = old


@pytest.fixture
def pool():
    """A fresh pool on simulated device 0, closed (all device memory returned) after the test."""
    import ascend_pool as ap

    p = ap.Pool(0, backend="sim")
    yield p
    p.close()


@pytest.fixture
def block_freed_behind_a_stream():
    """torch_npu's test_mempool_block_free_not_deferred, as run(diverted, wait, delay_s): from the
    default pool of device 0, or a MemPool (ap.Pool(0)) with diverted, a 1 MiB block marked with a
    side stream whose kernel (after delay_s) fills it with 1s is freed, wait(side stream) is
    called, then a 1 MiB request is served and freed. Returns (a, b, the device allocations b's
    request made). The streams and MemPools go after the test."""
    import contextlib

    import ascend_pool as ap
    from ascend_pool import sim

    made = []

    def run(diverted, wait, delay_s=0.0):
        ap.empty_cache()
        pool = ap.Pool(0) if diverted else None
        s2 = ap.create_stream(device=0)
        made.append((s2, pool))
        with ap.use_mem_pool(pool) if diverted else contextlib.nullcontext():
            a = ap.malloc(1 << 20)
            ap.record_stream(a, s2)
            sim.launch_fill(s2, a, 1 << 20, 1, delay_s=delay_s)
            ap.free(a)
            wait(s2)
            mallocs = sim.stats(0)["mallocs"]
            b = ap.malloc(1 << 20)
            ap.free(b)
        return a, b, sim.stats(0)["mallocs"] - mallocs

    yield run
    for s2, pool in made:
        ap.destroy_stream(s2)
        if pool is not None:
            pool.close()


@pytest.fixture(autouse=True)
def _earlier_orphans_closed():
    """Pools dropped by earlier tests with blocks still allocated (orphans) are closed before the
    test, when there are any (nothing to do otherwise): the stats publisher's thread closes one
    once its blocks are freed (a collected cycle) and their streams' work is done, in the
    background, giving its memory back in the middle of whatever test runs then: under a device
    capped at the bytes held (fail_after_bytes) a request meant to fail succeeded, and a test's
    bytes_held before and after differed (fb6ec13). An orphan whose blocks are still referenced
    stays; its memory moves only when they are freed."""
    from ascend_pool import registry

    if not registry._orphans:
        return
    import gc
    import time

    def waiting():  # freed, their streams' work still queued (not a stream left hung for good)
        out = []
        for o in list(registry._orphans):
            try:
                if id(o) not in _STUCK_ORPHANS and not o.closed and not o._raw_stats()["active.all.current"]:
                    out.append(o)
            except Exception:  # closed meanwhile
                pass
        return out

    gc.collect()  # blocks held only by garbage are freed: their orphans become closable
    deadline = time.monotonic() + 5
    while True:
        registry.reap_orphans(wait=True)
        left = waiting()
        if not left:  # the rest keep their blocks: nothing moves while they do
            return
        if time.monotonic() > deadline:
            _STUCK_ORPHANS.update(id(o) for o in left)  # not waited for again
            return
        time.sleep(0.02)


_STUCK_ORPHANS = set()


@pytest.fixture
def peers_idle_released():
    """The process's open pools (other tests' default pools...) hold no idle cache: a test that
    caps the device at what the process holds now (fail_after_bytes) would otherwise see a pool
    out of device memory take its peers' idle cache back and succeed."""
    from ascend_pool import registry

    for other in registry.live_pools():
        other.empty_cache()


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

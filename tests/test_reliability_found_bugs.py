"""Regression tests for bugs the reliability suite found in cython/core and cython/sim (all fixed
now; each docstring says what was wrong). Sizes are bytes; MiB = 1 << 20."""

import os

import pytest

import ascend_pool as ap
from ascend_pool import sim

MiB = 1 << 20


@pytest.fixture(autouse=True)
def own_ledger_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ASCEND_POOL_LEDGER_DIR", str(tmp_path))


def test_one_shot_device_failure_is_retried_under_quota_pressure(clean_faults):
    """Found by test_reliability_property.py (ExpandablePoolMachine); fixed in 867d6e4
    (expandable.c release() now settles other streams' free pages).

    A tenant context in expandable mode holds a cached 2 MiB segment whose free was ordered on
    another stream, and asks for 6 MiB more under a 6 MiB quota. ap_obtain_block (segments.c)
    grows three times at most. The first attempt is refused by the quota; the first retry's
    release (ap_vmm_release, expandable.c) does not give back the other stream's free pages, so
    the second attempt is refused by the quota too (the ledger counts 2 refusals); only the
    "wait for every stream" step releases them, and a single transient device failure on that
    third and last attempt ends in OutOfMemoryError "out of device memory" with the device almost
    empty. In the classic mode the same scenario releases the segment before the first attempt
    (no refusal) and retries the transient failure; with the free on the allocation stream the
    failure is retried too (test_expandable.py::test_a_one_shot_fault_is_retried expects that).
    Minimal fix (cython/core): let only device failures use up the retry budget in
    ap_obtain_block (after a quota/limit refusal, release-and-retry without counting it), or have
    the first retry's release in expandable mode settle and return other streams' free pages as
    ap_release_free_segments does in the classic mode."""
    base = ap.Pool(0, backend="sim", expandable_segments=True)
    ctx = base.context("rel-bug-retry", quota=6 * MiB)
    s1 = base.create_stream()
    ctx.register_stream(s1)
    try:
        x = ctx.malloc(1)
        ctx.free(x, stream=s1)                      # cached on s1: 2 MiB held
        sim.set_faults(fail_malloc_nth=1)           # the next device malloc fails, once
        try:
            p = ctx.malloc(4 * MiB - 31)            # needs 6 MiB: quota forces the cached 2 MiB out
        except ap.OutOfMemoryError as e:
            st = ctx.memory_stats()
            pytest.fail("BUG (cython/core/segments.c ap_obtain_block): a single transient device malloc "
                        "failure was not retried because quota refusals used up the retries; got "
                        f"{type(e).__name__} with {st['device_free_bytes']} device bytes free "
                        f"(num_alloc_retries={st['num_alloc_retries']}): {str(e)[:160]}")
        ctx.free(p)
    finally:
        base.destroy_stream(s1)
        ctx.close()
        base.close()


@pytest.mark.parametrize("call", ["empty_cache", "synchronize"])
def test_default_stream_waits_work_from_a_fresh_thread(pool, call):
    """Found by test_reliability_stress.py (threads that call empty_cache before any device call);
    fixed in 867d6e4 (stream_order.c makes the pool's device current before waits and records).

    The ACL current device is per thread. The pool waits for the default stream (NULL) with
    backend->stream_sync, which calls aclrtSynchronizeStream[WithTimeout](NULL) without making the
    pool's device current on the calling thread first (cython/backend/acl.c acl_stream_sync has no
    device argument; cython/core/stream_order.c does not call backend->set_device before it). A
    thread whose first device-touching pool call is empty_cache() or synchronize() -- e.g. a
    serving thread that only ever got cached blocks -- gets DeviceError 107002
    (ACL_ERROR_RT_CONTEXT_NULL), and empty_cache's message even says it "failed after 60000 ms"
    though it failed at once. On a real NPU the same call would synchronize the wrong context or
    fail the same way. Minimal fix: call p->backend->set_device(p->backend, p->device) before
    every stream_sync / event record on the NULL stream in cython/core (or give the backend's
    stream_sync a device argument and call acl_set_device in it)."""
    import threading

    pool.free(pool.malloc(1000))  # a cached block: nothing below needs a device malloc
    outcome = []

    def fresh_thread():
        try:
            getattr(pool, call)()
            outcome.append(None)
        except ap.PoolError as e:
            outcome.append(e)

    t = threading.Thread(target=fresh_thread)
    t.start()
    t.join()
    assert outcome == [None], (
        f"BUG (cython/core stream_order.c / cython/backend/acl.c): pool.{call}() from a thread that has "
        f"not made a device call yet failed: {type(outcome[0]).__name__}: {str(outcome[0])[:200]}")


def test_lowered_quota_releases_a_free_segment_split_across_streams(clean_faults):
    """Found by test_reliability_property.py (PoolMachine.set_quota); fixed in 1199333 (explicit
    trims settle streams to free split segments).

    In the classic mode, ap_release_free_segments (segments.c) only considers segments that are
    one free block. A segment whose free space is split into blocks cached for different streams
    (a block borrowed from stream A's free tail, then freed on the default stream: the two free
    neighbours carry different stream tags and do not merge) is invisible to it. So lowering a
    tenant's quota (ap_pool_trim_to), lowering a memory fraction (ap_pool_set_limit), the
    garbage-collection threshold and the release-under-peak policy all keep a wholly free 2 MiB
    segment, and the tenant stays over its quota (its other processes are refused) until
    something calls empty_cache() or a growth reaches the "wait for every stream" retry.
    Minimal fix (cython/core/segments.c): when ap_release_free_segments finds no wholly free
    segment before reaching its target, settle the slots that hold free blocks (ap_settle_slot,
    as expandable.c's release() now does) and pick again."""
    base = ap.Pool(0, backend="sim")
    ctx = base.context("rel-bug-trim", quota=10 * MiB)
    s1 = base.create_stream()
    ctx.register_stream(s1)
    try:
        x = ctx.malloc(1, stream=s1)     # the small segment, made for s1
        y = ctx.malloc(1)                # the default stream borrows s1's free tail ...
        ctx.free(x, stream=s1)
        ctx.free(y)                      # ... and frees it: two free blocks, two stream tags
        a, b = ctx.malloc(2 * MiB - 4096), ctx.malloc(2 * MiB - 4096)  # two large 2 MiB segments in use
        assert ctx.held == 6 * MiB
        small = [s for s in ctx.snapshot()["segments"] if s["segment_type"] == "small"]
        assert [[bl["state"] for bl in s["blocks"]] for s in small] == [["inactive", "inactive"]], \
            "the premise: one wholly free small segment, split in two free blocks"
        ctx.set_quota(4 * MiB)           # over quota by exactly the free small segment
        kept = [s for s in ctx.snapshot()["segments"] if all(bl["state"] == "inactive" for bl in s["blocks"])]
        assert not kept and ctx.held <= 4 * MiB, (
            "BUG (cython/core/segments.c ap_release_free_segments): lowering the quota kept a wholly free "
            f"segment ({[(s['total_size'], [bl['size'] for bl in s['blocks']]) for s in kept]}: free space split "
            f"across stream tags); the tenant holds {ctx.held} bytes over its {4 * MiB} byte quota")
        ctx.free(a)
        ctx.free(b)
    finally:
        base.destroy_stream(s1)
        ctx.close()
        base.close()


def test_second_simulator_instance_in_a_process_keeps_the_node_accounting(tmp_path):
    """Found by scripts/asan.sh (its test order runs test_backend_acl.py after tests that leave
    memory in the default pool), still open. A bug of the simulator (cython/sim/node.c), which
    the whole test suite relies on.

    Opening the legacy simulator library (a second runtime instance in the same process, as
    test_backend_acl.py::test_every_used_symbol_is_resolved_by_dlsym[True] does) attaches to the
    node record with the same pid; sim_node_attach finds the pid's slot and zeroes its bytes
    although the first instance still holds memory. When the first instance then frees, the slot
    underflows (sim_node_release subtracts without a floor) to ~2**64: the node reports the
    device full, and every later device malloc in the session fails with OutOfMemoryError
    ("device: 0 free of 68719476736"). Minimal fix (node.c): give each runtime instance its own
    slot (match slots on pid plus a per-instance id, not the pid alone), and never let a release
    take a slot below zero. Runs in a child on its own node, since the bug breaks the node."""
    import json
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import json
        import ascend_pool as ap
        from ascend_pool import sim
        from ascend_pool._core import Backend
        pool = ap.Pool(0, backend="sim")
        x = pool.malloc(100 << 20)
        before = sim.stats(0)["node_bytes_used"]
        Backend("sim", sim.library_path(legacy=True))     # a second runtime instance
        after_open = sim.stats(0)["node_bytes_used"]
        pool.free(x)
        pool.empty_cache()
        after_free = sim.stats(0)["node_bytes_used"]
        try:
            pool.free(pool.malloc(1 << 20))
            malloc = "ok"
        except ap.OutOfMemoryError as e:
            malloc = str(e)[:160]
        print(json.dumps(dict(before=before, after_open=after_open, after_free=after_free, malloc=malloc)))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASCEND_SIM_")}
    env.update(ASCEND_SIM_NODE="relbug", ASCEND_SIM_SHM_DIR=str(tmp_path), ASCEND_POOL_LEDGER_DIR=str(tmp_path),
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(ap.__file__))))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["after_open"] == r["before"] and r["after_free"] == 0 and r["malloc"] == "ok", (
        "BUG (cython/sim/node.c sim_node_attach/sim_node_release): a second simulator instance in the "
        f"process reset this pid's node slot and the next free wrapped it: {r}")

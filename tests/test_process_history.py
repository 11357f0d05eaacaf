"""The process-wide history and snapshot cover tenant contexts, as torch's cover every allocation
of the process: ascend_pool.record_memory_history turns the history on in contexts open now and
made later, and dump_snapshot / memory_snapshot include their segments and events in time order."""

import os
import pickle
import sys

import pytest

import ascend_pool as ap

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401


def _alloc_in_tenant(n):
    return ap.malloc(n, device=0)


def test_history_and_dump_snapshot_cover_tenant_contexts(tmp_path):
    pool = ap.default_pool(0)
    before = pool.context("hist-before")
    try:
        ap.record_memory_history(True, stacks="python", max_entries=1000)
        after = pool.context("hist-after")  # made after the call: follows it
        try:
            with before:
                a = _alloc_in_tenant(4096)
            with after:
                b = _alloc_in_tenant(8192)
            c = ap.malloc(1536, device=0)  # the default pool, last
            for ctx, ptr, size in ((before, a, 4096), (after, b, 8192)):
                allocs = [e for e in ctx.snapshot()["device_traces"][0] if e["action"] == "alloc"]
                assert [e["addr"] for e in allocs] == [ptr] and allocs[0]["size"] == size
                assert any(f["name"] == "_alloc_in_tenant" for f in allocs[0]["frames"])

            path = tmp_path / "snap.pickle"
            ap.dump_snapshot(str(path))
            snap = pickle.loads(path.read_bytes())
            live = {b_["address"] for s in snap["segments"] for b_ in s["blocks"] if b_["state"] == "active_allocated"}
            assert {a, b, c} <= live
            trace = snap["device_traces"][0]
            assert [e["addr"] for e in trace if e["action"] == "alloc"][-3:] == [a, b, c], "one trace, in time order"
            assert [e["time_us"] for e in trace] == sorted(e["time_us"] for e in trace)
            assert {a, b, c} <= {b_["address"] for s in ap.memory_snapshot() for b_ in s["blocks"]}

            ap.record_memory_history(enabled=None)
            assert before.snapshot()["device_traces"][0] == [] and after.snapshot()["device_traces"][0] == []
            before.free(a)
            after.free(b)
            ap.free(c, device=0)
        finally:
            after.close()
    finally:
        ap.record_memory_history(enabled=None)
        before.close()


def _alloc_in_own_pool(pool, n):
    return pool.malloc(n)


def test_history_and_dump_snapshot_cover_the_programs_own_pools(tmp_path):
    """torch's history and snapshot cover every allocation of the process; a program's own
    ap.Pool, opened before or after record_memory_history(), is in them too (it was left out)."""
    own_before = ap.Pool(0, backend="sim")
    own_after = None
    try:
        ap.record_memory_history(True, stacks="python", max_entries=1000)
        own_after = ap.Pool(0, backend="sim")
        a = _alloc_in_own_pool(own_before, 4096)
        b = _alloc_in_own_pool(own_after, 8192)
        for pool, ptr in ((own_before, a), (own_after, b)):
            allocs = [e for e in pool.snapshot()["device_traces"][0] if e["action"] == "alloc"]
            assert [e["addr"] for e in allocs] == [ptr] and allocs[0]["frames"][0]["name"] == "_alloc_in_own_pool"
        path = tmp_path / "snap.pickle"
        ap.dump_snapshot(str(path))
        snap = pickle.loads(path.read_bytes())
        assert {a, b} <= {b_["address"] for s in snap["segments"] for b_ in s["blocks"]}
        assert {a, b} <= {e["addr"] for e in snap["device_traces"][0] if e["action"] == "alloc"}
        assert {a, b} <= {b_["address"] for s in ap.memory_snapshot() for b_ in s["blocks"]}
        ap.record_memory_history(enabled=None)
        assert own_before.snapshot()["device_traces"][0] == [] == own_after.snapshot()["device_traces"][0]
        own_before.free(a)
        own_after.free(b)
    finally:
        ap.record_memory_history(enabled=None)
        own_before.close()
        if own_after is not None:
            own_after.close()


def test_a_stopped_process_history_leaves_a_new_pools_own_history_knob():
    ap.record_memory_history(True, max_entries=100)
    ap.record_memory_history(enabled=None)
    pool = ap.Pool(0, backend="sim", record_history=True)  # its own knob: recorded all the same
    try:
        pool.free(pool.malloc(4096))
        assert [e["action"] for e in pool.snapshot()["device_traces"][0]][:1] == ["segment_alloc"]
        assert any(e["action"] == "alloc" for e in pool.snapshot()["device_traces"][0])
    finally:
        pool.close()


def test_a_context_closed_by_another_thread_meanwhile_is_skipped(tmp_path, monkeypatch):
    # The process-wide calls list the open pools (contexts among them), then call each; a context
    # whose `with` block ends on another thread in between must not fail them (found by a threaded
    # stress run).
    from ascend_pool import registry
    pool = ap.default_pool(0)
    gone = pool.context("hist-gone")
    gone.close()
    listed = registry.live_pools
    monkeypatch.setattr(registry, "live_pools", lambda: listed() + [gone])
    try:
        ap.record_memory_history(True, stacks="python", max_entries=1000)
        ap.dump_snapshot(str(tmp_path / "snap.pickle"))
        assert pickle.loads((tmp_path / "snap.pickle").read_bytes())["segments"] is not None
        assert ap.memory_snapshot() is not None
    finally:
        ap.record_memory_history(enabled=None)
    with pytest.raises(ap.PoolError, match="closed"):
        gone.record_memory_history(True)  # the pool itself still says it is closed



BAD_SETTINGS_CHILD = """
import ascend_pool as ap
from ascend_pool import registry
assert registry.default_pools() == []             # no pool yet: the settings are only kept
ap.record_memory_history(True, stacks=None, max_entries=50)
refused = []
for bad in ({"stacks": "cpp"}, {"enabled": "yes"}, {"max_entries": -1}):
    try:
        ap.record_memory_history(**dict(dict(enabled=True, stacks="python", max_entries=100), **bad))
    except ap.ConfigError as e:
        refused.append(str(e))
ptr = ap.malloc(4096, device=0)                    # the default pool opens with the kept settings
ap.free(ptr, device=0)
allocs = [e for e in ap.default_pool(0).snapshot()["device_traces"][0] if e["action"] == "alloc"]
print(json.dumps({"refused": refused, "allocs": [[e["addr"] == ptr, e["frames"]] for e in allocs]}))
"""


def test_bad_history_settings_are_refused_when_given_not_when_a_pool_opens_later(sim_node):
    """The process-wide settings are kept for default pools and contexts made later: a bad one
    must raise at the call and leave the earlier settings in force (it used to be kept when no
    pool was open yet, and the next default pool's creation raised the ConfigError instead)."""
    out = sim_node.run_json(BAD_SETTINGS_CHILD)
    assert len(out["refused"]) == 3, out
    assert "stacks" in out["refused"][0] and "enabled" in out["refused"][1] and "max_entries" in out["refused"][2]
    assert out["allocs"] == [[True, []]], out  # recording, without frames: the earlier call's settings


def _alloc_here(n):
    return ap.malloc(n, device=0)


def test_pytorchs_own_call_works_as_written():
    """torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="all",
    max_entries=sys.maxsize), copied as is: frames recorded; context=None: none; a context torch
    refuses is refused."""
    try:
        for context, framed in (("all", True), (None, False)):
            ap.record_memory_history(enabled="all", context=context, stacks="all", max_entries=sys.maxsize)
            ptr = _alloc_here(4096)
            ap.free(ptr, device=0)
            allocs = [e for e in ap.default_pool(0).snapshot()["device_traces"][0]
                      if e["action"] == "alloc" and e["addr"] == ptr]
            assert allocs and any(f["name"] == "_alloc_here" for f in allocs[-1]["frames"]) == framed, context
        with pytest.raises(ap.ConfigError, match="context"):
            ap.record_memory_history(enabled="all", context="everything", clear_history=True)
        assert ap.default_pool(0).snapshot()["device_traces"][0], "a refused call clears nothing"
        ap.record_memory_history(enabled="all", clear_history=True)
        assert ap.default_pool(0).snapshot()["device_traces"][0] == []
    finally:
        ap.record_memory_history(None)

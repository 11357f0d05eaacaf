"""The process-wide history and snapshot cover tenant contexts, as torch's cover every allocation
of the process: ascend_pool.record_memory_history turns the history on in contexts open now and
made later, and dump_snapshot / memory_snapshot include their segments and events in time order."""

import pickle

import pytest

import ascend_pool as ap


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


def test_a_context_closed_by_another_thread_meanwhile_is_skipped(tmp_path, monkeypatch):
    # The process-wide calls list the open contexts, then call each; a context whose `with` block
    # ends on another thread in between must not fail them (found by a threaded stress run).
    import ascend_pool.api as api
    pool = ap.default_pool(0)
    gone = pool.context("hist-gone")
    gone.close()
    listed = api.live_contexts
    monkeypatch.setattr(api, "live_contexts", lambda device=None: listed(device=device) + [gone])
    try:
        ap.record_memory_history(True, stacks="python", max_entries=1000)
        ap.dump_snapshot(str(tmp_path / "snap.pickle"))
        assert pickle.loads((tmp_path / "snap.pickle").read_bytes())["segments"] is not None
        assert ap.memory_snapshot() is not None
    finally:
        ap.record_memory_history(enabled=None)
    with pytest.raises(ap.PoolError, match="closed"):
        gone.record_memory_history(True)  # the pool itself still says it is closed

"""Events of aclrtCreateEventExWithFlag (CANN 8.0.RC1 on; docs/cann-rules-events.md, "Events of
aclrtCreateEventExWithFlag"): a fresh hardware id at every record, so a wait waits for the latest
record and no aclrtResetEvent is needed after it. The acl backend uses them where the runtime has
them (every simulator profile but `strict`, which refuses them as a runtime without the feature)
and then reuses events at once, as on CUDA; elsewhere it keeps the reset scheme."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401

SYNC, PARAM_INVALID, FEATURE_NOT_SUPPORT = 1, 107000, 207000


def test_simulator_new_mode_events_wait_for_their_latest_record_and_need_no_reset(sim_node):
    out = sim_node.run_json("""
        from ascend_pool import sim
        init()
        a, b = stream(), stream()
        ptr = malloc(4096)
        ev = event(1, ex=True)
        fresh = query_status(ev)                # never recorded: COMPLETE for these events
        ok("aclrtStreamWaitEvent", b, ev)       # never recorded: passes at once
        ok("aclrtRecordEvent", ev, a)
        ok("aclrtSynchronizeStream", a)
        ok("aclrtStreamWaitEvent", b, ev)
        sim.launch_fill(a, ptr, 4096, 7, delay_s=0.5)
        ok("aclrtRecordEvent", ev, a)           # again after a wait, no reset: allowed
        ok("aclrtStreamWaitEvent", b, ev)       # waits for this (latest) record
        sim.launch_fill(b, ptr, 4096, 9)
        ok("aclrtSynchronizeStream", b)
        ordered = sim.read(ptr, 1)[0]
        reset = code("aclrtResetEvent", ev, b)
        old_query = code("aclrtQueryEvent", ev, C.byref(C.c_int()))
        print(json.dumps({"fresh": fresh, "ordered": ordered, "reset": reset, "old_query": old_query}))
    """, ASCEND_SIM_PROFILE="cann8.3")
    # the deprecated query: ApiErrorDecorator::EventQuery refuses new mode with RT_ERROR_FEATURE_NOT_SUPPORT
    assert out == {"fresh": 1, "ordered": 9, "reset": PARAM_INVALID, "old_query": FEATURE_NOT_SUPPORT}, out


def test_simulator_new_mode_events_are_not_bounded_by_the_devices_event_limit(sim_node):
    sim_node.run("""
        init()
        evs = [event(1, ex=True) for _ in range(40)]   # past the limit of 16 set below
        e = C.c_void_p()
        assert code("aclrtCreateEventWithFlag", C.byref(e), 1) == 0
    """, ASCEND_SIM_PROFILE="310p", ASCEND_SIM_EVENT_LIMIT="16")


def test_strict_profile_refuses_new_mode_events_as_a_runtime_without_the_feature(sim_node):
    sim_node.run("""
        init()
        e = C.c_void_p()
        assert code("aclrtCreateEventExWithFlag", C.byref(e), 1) == 207000
        assert "strict" in errmsg()
    """)


PINGPONG = """
    import ascend_pool as ap
    MiB = 1 << 20
    pool = ap.Pool(0, backend="sim")
    p, c = pool.create_stream(), pool.create_stream()
    for step in range(30):                            # the host runs ahead of the device
        buf = pool.malloc(4 * MiB, stream=p)          # after the first step: c's block, borrowed
        sim.launch_fill(p, buf, 4096, 1, delay_s=0.002)
        pool.free(buf, stream=p)
        got = pool.malloc(4 * MiB, stream=c)          # borrows buf: ordered after p's fill
        sim.launch_fill(c, got, 4096, 2, delay_s=0.002)
        pool.free(got, stream=c)
    x = pool.malloc(4 * MiB, stream=p)                # last: the lender still writes when borrowed
    sim.launch_fill(p, x, 4096, 7, delay_s=0.3)
    pool.free(x, stream=p)
    y = pool.malloc(4 * MiB, stream=c)
    sim.launch_fill(c, y, 4096, 9)
    pool.synchronize(c); pool.synchronize(p)
    st = pool.memory_stats()
    lib.ascendsim_stats_fields.restype = C.c_char_p
    fields = lib.ascendsim_stats_fields().decode().split(",")
    out = (C.c_uint64 * len(fields))()
    lib.ascendsim_get_stats(0, out, len(fields))
    print(json.dumps({"events": st["events_created"], "migrations": st["stream_migrations"], "same": x == y,
                      "last": sim.read(y, 1)[0], "live_events": out[fields.index("live_events")]}))
    pool.free(y, stream=c)
    pool.destroy_stream(p); pool.destroy_stream(c); pool.close()
"""


@pytest.mark.parametrize("profile", ["cann8.3", "310p"])
def test_the_borrow_path_reuses_one_event_where_the_runtime_has_new_mode_events(sim_node, profile):
    # Before: every profile ran the reset scheme (aclrtResetEvent on the borrowing stream, one more
    # record there, the event parked until that record ran): one event per borrow the host was
    # ahead of the device by. With new-mode events an event is reusable as soon as its wait is queued.
    out = sim_node.run_json(PINGPONG, ASCEND_SIM_PROFILE=profile)
    assert out["migrations"] >= 60 and out["same"] and out["last"] == 9, out  # the borrower wrote second
    assert out["events"] == 1 and out["live_events"] == 0, out  # new-mode events take no device slot


def test_the_borrow_path_keeps_the_reset_scheme_where_the_runtime_refuses_new_mode_events(sim_node):
    out = sim_node.run_json(PINGPONG)               # strict: aclrtCreateEventExWithFlag answers 207000
    assert out["migrations"] >= 60 and out["same"] and out["last"] == 9, out
    assert out["events"] > 1 and out["live_events"] == out["events"], out  # parked until their records ran


def test_simulator_new_mode_records_take_an_event_id_until_they_have_run(sim_node):
    """hicann/runtime Event::Record: each record of a new-mode event takes a hardware event id
    (AllocEventIdResource), given back once it has run; the device's ids are its event limit,
    shared with the live events of aclrtCreateEvent[WithFlag]. Past them the runtime's record
    blocks the thread; the simulator refuses it with 207007 (before, records had no limit)."""
    sim_node.run("""
        init()
        a = stream()
        old = [event(1) for _ in range(4)]               # 4 of the 16 ids
        evs = [event(1, ex=True) for _ in range(13)]
        sim.hang_stream(a)
        for e in evs[:12]:
            ok("aclrtRecordEvent", e, a)                 # 12 records not run: 16 ids held
        assert code("aclrtRecordEvent", evs[12], a) == 207007 and "event id" in errmsg()
        ok("aclrtDestroyEvent", old.pop())               # an id back
        ok("aclrtRecordEvent", evs[12], a)
        assert code("aclrtRecordEvent", evs[0], a) == 207007
        assert code("aclrtCreateEventWithFlag", C.byref(C.c_void_p()), 1) == 207007   # the same ids
        sim.release_stream(a)
        ok("aclrtSynchronizeStream", a)                  # the records have run: their ids are back
        for e in evs:
            ok("aclrtRecordEvent", e, a)
        ok("aclrtSynchronizeStream", a)
    """, ASCEND_SIM_PROFILE="310p", ASCEND_SIM_EVENT_LIMIT="16")


def test_new_mode_records_in_flight_stay_under_half_the_devices_event_ids_and_never_wait(sim_node):
    """hicann/runtime Event::Record: each record of a new-mode event holds one of the device's event
    ids (1,023 on a 310P) until it has run, and past them aclrtRecordEvent blocks the thread. Frees
    marked for a hung stream each record one: the pool keeps at most half the ids in records not
    known complete, asks its own records first at the bound, and then lets a free owe the stream
    (no record, no wait under its lock). Before: it took every id (the framework's record was
    refused; on an NPU it blocks), and each free past them waited sync_timeout_ms for the hung
    stream under the pool lock (the simulator refuses such a record: 207007)."""
    out = sim_node.run_json('''
        import ascend_pool as ap
        pool = ap.Pool(0, backend="sim", sync_timeout_ms=10000)  # one wait costs more than the bound
        s = pool.create_stream()
        sim.hang_stream(s)
        ptrs = [pool.malloc(4096) for _ in range(1030)]
        t0 = time.monotonic()
        for x in ptrs:
            pool.record_stream(x, s)
            pool.free(x)
        took = time.monotonic() - t0
        ev = event(1, ex=True)
        framework = code("aclrtRecordEvent", ev, s)   # the framework's own record: ids are left
        pending = pool.memory_stats()["pending_free_blocks"]
        pool._check_invariants()                       # every record counted is one the pool holds
        sim.release_stream(s)
        pool.synchronize(s)
        for _ in range(4):                             # owed streams become events, then settle
            pool.empty_cache()
        st = pool.memory_stats()
        pool._check_invariants()
        again = [pool.malloc(4096) for _ in range(1030)]
        for x in again:
            pool.free(x)
        pool.close()
        print(json.dumps({"took": took, "framework": framework, "pending": pending,
                          "left": st["pending_free_blocks"]}))
    ''', ASCEND_SIM_PROFILE="310p")
    assert out["framework"] == 0, out
    # before: the limit (10 s here) for each free past the device's ids; the bound leaves a loaded
    # machine room for the 1,030 frees (a few ms in all when idle)
    assert out["took"] < 5.0, out
    assert out["pending"] == 1030 and out["left"] == 0, out

"""Events on CANN (issue 15 point 7, issue 17's event limit).

CANN documents (hicann/runtime docs/zh/api_ref/07_event_management.md, aclrtResetEvent): an
event is reset "usually after aclrtStreamWaitEvent" so that it can be used again, on the waiting
stream, and only events created with ACL_EVENT_SYNC may be reset. CUDA reuses an event right
after cudaStreamWaitEvent; on CANN the pool must reset it first. The simulator enforces the rule
(a record of a waited, unreset event fails), so these tests fail when the pool breaks it.

Devices hold few events (65,536; 1,023 on Atlas inference cards): the pool's idle-event cache is
bounded, and a workload freeing across streams far more often than the limit keeps working.
"""
import ctypes
import os
import sys

import pytest

import ascend_pool as ap
from ascend_pool import sim

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401

MiB = 1 << 20
PARAM_INVALID = 107000


def test_simulator_refuses_a_record_after_a_wait_without_reset(sim_node):
    sim_node.run("""
        init()
        a, b = stream(), stream()
        ev = event(flags=1)                     # ACL_EVENT_SYNC
        ok("aclrtRecordEvent", ev, a)
        ok("aclrtStreamWaitEvent", b, ev)
        assert code("aclrtRecordEvent", ev, a) == 107000
        assert "aclrtResetEvent" in errmsg()
        ok("aclrtResetEvent", ev, b)            # on the waiting stream, after its wait
        ok("aclrtRecordEvent", ev, a)           # usable again
        ok("aclrtStreamWaitEvent", b, ev)
        ok("aclrtSynchronizeStream", b)
        plain = event()                         # aclrtCreateEvent: CANN allows no reset on it
        assert code("aclrtResetEvent", plain, b) == 107000
        # recording again without any wait in between stays allowed
        ok("aclrtResetEvent", ev, b)
        ok("aclrtRecordEvent", ev, a)
        ok("aclrtRecordEvent", ev, a)
    """)


def test_simulator_lets_an_aclrtcreateevent_event_be_recorded_again_after_a_wait(sim_node):
    # hicann/runtime Event::Record: an event of aclrtCreateEvent (RT_EVENT_DEFAULT) gets a fresh
    # hardware id at each record, as new-mode ones do, so a wait waits for the record it was
    # queued after and the event is recorded again with no reset (which it does not support).
    # Until 2026-12-05 the simulator demanded a reset it then refused: such an event, once waited
    # on, could never be recorded again.
    sim_node.run("""
        from ascend_pool import sim
        init()
        a, b = stream(), stream()
        ptr = malloc(4096)
        ev = event()                            # aclrtCreateEvent
        ok("aclrtRecordEvent", ev, a)
        ok("aclrtStreamWaitEvent", b, ev)
        sim.launch_fill(a, ptr, 4096, 7, delay_s=0.3)
        ok("aclrtRecordEvent", ev, a)           # again after the wait, no reset
        ok("aclrtStreamWaitEvent", b, ev)       # waits for this record, after the fill
        sim.launch_fill(b, ptr, 4096, 9)
        ok("aclrtSynchronizeStream", b)
        assert sim.read(ptr, 1)[0] == 9
    """)


def test_simulator_refuses_a_wait_on_an_event_created_without_acl_event_sync(sim_node):
    # hicann/runtime ApiErrorDecorator::StreamWaitEvent: an event whose flags hold none of the
    # synchronizing bits (IsEventWithoutWaitTask) is refused with RT_ERROR_FEATURE_NOT_SUPPORT
    # (207000), recorded or not; ApiErrorDecorator::EventCreate[Ex] refuses flag 0 (107000);
    # aclrtCreateEvent's events carry RT_EVENT_DEFAULT (0x0E, with RT_EVENT_DDSYNC) and may be waited on
    sim_node.run("""
        init()
        a, b = stream(), stream()
        for flags, ex in ((8, False), (2, False), (8, True)):   # TIME_LINE, CAPTURE_STREAM_PROGRESS
            ev = event(flags, ex=ex)
            ok("aclrtRecordEvent", ev, a)
            assert code("aclrtStreamWaitEvent", b, ev) == 207000, flags
            assert "ACL_EVENT_SYNC" in errmsg()
            # ApiErrorDecorator::EventReset: IsEventWithoutWaitTask, 207000 too (before: 107000)
            assert code("aclrtResetEvent", ev, b) == 207000, flags
            ok("aclrtDestroyEvent", ev)
        for name in ("aclrtCreateEventWithFlag", "aclrtCreateEventExWithFlag"):
            assert code(name, C.byref(C.c_void_p()), 0) == 107000, name
            # a flag past RT_EVENT_FLAG_MAX: RT_ERROR_INVALID_VALUE too, not ACL's 100000
            assert code(name, C.byref(C.c_void_p()), 1 | (1 << 20)) == 107000, name
        for ev in (event(), event(9), event(1, ex=True)):        # plain, SYNC | TIME_LINE, new mode
            ok("aclrtRecordEvent", ev, a)
            ok("aclrtStreamWaitEvent", b, ev)
        ok("aclrtSynchronizeStream", b)
    """, ASCEND_SIM_PROFILE="cann8.3")                           # a profile with new-mode events


def _recent_error():
    lib = ctypes.CDLL(sim.library_path())
    lib.aclGetRecentErrMsg.restype = ctypes.c_char_p
    return (lib.aclGetRecentErrMsg() or b"").decode()


def test_borrowing_across_streams_resets_each_event_after_the_wait(pool):
    a, b = pool.create_stream(), pool.create_stream()
    _recent_error()                             # clears this thread's message
    for _ in range(20):
        # each malloc finds nothing cached on its own stream and borrows the other's block by
        # an event wait; the cached event is reused every time
        p = pool.malloc(2 * MiB, stream=a)
        pool.free(p, stream=a)
        q = pool.malloc(2 * MiB, stream=b)
        pool.free(q, stream=b)
    assert "not reset" not in _recent_error(), "the pool recorded an event it had not reset"
    st = pool.memory_stats()
    assert st["stream_migrations"] >= 39
    assert st["events_created"] <= 4, "events were not reused"
    for s in (a, b):
        pool.destroy_stream(s)


@pytest.mark.parametrize("limit_env", [{"ASCEND_SIM_PROFILE": "310p"}, {"ASCEND_SIM_EVENT_LIMIT": "1023"}],
                         ids=["310p-profile", "event-limit-knob"])
def test_over_the_310p_event_limit_cross_stream_frees_keep_working(sim_node, limit_env):
    out = sim_node.run_json("""
        import ascend_pool as ap
        from ascend_pool import sim
        pool = ap.Pool(0, backend="sim")
        streams = [pool.create_stream() for _ in range(24)]
        peak = 0
        frees = 0
        for i in range(1500):
            s, t = streams[i % 24], streams[(i * 7 + 3) % 24]
            p = pool.malloc(64 << 10, stream=s)
            sim.launch_fill(t, p, 64 << 10, i % 250 + 1, delay_s=0.002 if i % 3 == 0 else 0.0)
            pool.record_stream(p, t)
            pool.free(p, stream=s if i % 2 else t)
            frees += 1
            if i % 50 == 0:
                peak = max(peak, sim.stats(0)["live_events"])
        for s in streams:
            pool.synchronize(s)
        pool.empty_cache()
        st = pool.memory_stats()
        live_after = sim.stats(0)["live_events"]
        for s in streams:
            pool.destroy_stream(s)
        pool.close()
        print(json.dumps({"peak": peak, "frees": frees, "live_after": live_after,
                          "allocated": st["allocated_bytes.all.current"], "created": st["events_created"],
                          "closed": sim.stats(0)["live_events"]}))
    """, timeout=120, **limit_env)
    assert out["frees"] == 1500 and out["allocated"] == 0
    assert out["peak"] <= 1023
    assert out["live_after"] == 0, out          # empty_cache gives idle events back too (as PyTorch's)
    assert out["closed"] == 0, out


def test_many_pools_of_one_device_keep_few_idle_events_together(sim_node):
    # 12 tenant contexts of one device, each after a burst of cross-stream frees: the process
    # keeps at most 64 idle events for the device in all (each context alone could keep 64:
    # 12 x 64 would hold most of a 310P card's 1,023), and the framework can still create events.
    out = sim_node.run_json("""
        import ascend_pool as ap
        from ascend_pool import sim
        pool = ap.Pool(0, backend="sim")
        s1, s2 = pool.create_stream(), pool.create_stream()
        ctxs = [pool.context(f"t{i}") for i in range(12)]
        for c in ctxs:
            for s in (s1, s2):
                c.register_stream(s)
            ptrs = [c.malloc(4096, stream=s1) for _ in range(80)]
            sim.launch_fill(s2, ptrs[0], 4096, 1, delay_s=0.02)
            for p in ptrs:
                c.record_stream(p, s2)
            for p in ptrs:
                c.free(p, stream=s1)
            pool.synchronize(s2)
            c.free(c.malloc(4096, stream=s1), stream=s1)  # settles the pending frees: events idle
        idle = sim.stats(0)["live_events"]
        for c in ctxs + [pool]:
            c.empty_cache()
        after = sim.stats(0)["live_events"]
        print(json.dumps({"idle": idle, "after": after}))
    """, timeout=120, ASCEND_SIM_PROFILE="310p")
    assert out["idle"] <= 64, out
    assert out["after"] == 0, out


def test_a_waited_event_is_recorded_again_only_once_the_waiting_stream_ran_its_reset(pool):
    # aclrtResetEvent is asynchronous: it runs when the waiting stream reaches it, after its wait.
    # The pool put the event back in its cache at once, and the next record (here: the one-off
    # check of a new stream) took it while the borrowing stream still waited for the lender's
    # kernel. On an NPU such a record can satisfy the old wait early (the borrower runs over a
    # block the lender still writes) or be cleared by the late reset; the simulator refuses it.
    s1, s2 = pool.create_stream(), pool.create_stream()
    x = pool.malloc(4 * MiB, stream=s1)
    sim.launch_fill(s1, x, 4 * MiB, 7, delay_s=1.5)      # s1 writes x for 1.5 s
    pool.free(x, stream=s1)
    _recent_error()
    y = pool.malloc(4 * MiB, stream=s2)                  # borrows x: s2 waits for s1, then its reset
    assert pool.memory_stats()["stream_migrations"] == 1
    s3 = pool.create_stream()
    z = pool.malloc(1 * MiB, stream=s3)                  # events recorded while s2 still waits
    pool.free(z, stream=s3)
    assert "still queued" not in _recent_error(), "an event was recorded again before its reset ran"
    pool.synchronize(s2)
    assert sim.read(y, 16) == bytes([7]) * 16            # s2's block was written by s1's kernel first
    pool.free(y, stream=s2)
    before = pool.memory_stats()["events_created"]
    for _ in range(10):                                  # once the resets ran, the events are reused
        p = pool.malloc(4 * MiB, stream=s1)
        pool.free(p, stream=s1)
        q = pool.malloc(4 * MiB, stream=s2)
        pool.free(q, stream=s2)
        pool.synchronize(s1)                             # the streams ran their resets
        pool.synchronize(s2)
    assert pool.memory_stats()["events_created"] <= before + 2
    pool._check_invariants()
    for s in (s1, s2, s3):
        pool.destroy_stream(s)


def test_events_parked_after_borrows_count_toward_the_devices_idle_event_bound(sim_node):
    # rev17: an event a stream waited on is parked until that stream has run its reset; parked
    # events were outside the per-device bound on idle events (64 for all pools of a device), so
    # tenant pools whose hosts ran ahead kept 64 each after the work was done (310P: 1,023 events
    # a device).
    out = sim_node.run_json("""
        import ascend_pool as ap
        from ascend_pool import sim
        MiB = 1 << 20
        pools = []
        for k in range(4):
            pool = ap.Pool(0, backend="sim", stream_reuse="borrow")
            be = pool.backend
            p, c = pool.create_stream(), pool.create_stream()
            for step in range(60):                  # the host never waits: every borrow in flight
                buf = pool.malloc(8 * MiB, stream=p)
                ready = be.event_create(0)
                be.event_record(ready, p)
                be.stream_wait_event(c, ready)
                be.event_destroy(ready)
                sim.launch_fill(c, buf, 4096, 2, delay_s=0.005)
                pool.free(buf, stream=c)
            pools.append((pool, p, c))
        for pool, p, c in pools:                    # the framework waits itself, not through the pool
            pool.backend.stream_sync(p)
            pool.backend.stream_sync(c)
        live = sim.stats(0)["live_events"]
        migrations = sum(pl.memory_stats()["stream_migrations"] for pl, _, _ in pools)
        for pool, p, c in pools:
            pool._check_invariants()
            pool.destroy_stream(p)
            pool.destroy_stream(c)
            pool.close()
        print(json.dumps({"live": live, "migrations": migrations, "after": sim.stats(0)["live_events"]}))
    """)
    assert out["migrations"] >= 4 * 29, out   # every other malloc borrows (two blocks a segment)
    assert out["live"] <= 64, out            # before: 120 (a pool's own bound, 64, each)
    assert out["after"] == 0, out


def test_simulator_lets_a_wait_on_a_sync_event_pass_once_any_record_since_its_reset_ran(sim_node):
    # CANN (hicann/runtime Event::Record, Event::WaitSendCheck, Event::Reset): an ACL_EVENT_SYNC
    # event keeps one hardware id; a record sets its flag, every wait is sent to the device and
    # passes once the flag is set, and only aclrtResetEvent clears it. Recorded again without a
    # reset, the event lets a wait pass while the newer record is still queued.
    out = sim_node.run_json("""
        from ascend_pool import sim
        init()
        a, b = stream(), stream()
        ptr = malloc(4096)
        ev = event(flags=1)                     # ACL_EVENT_SYNC
        ok("aclrtRecordEvent", ev, a)
        ok("aclrtSynchronizeStream", a)         # its flag is set
        sim.launch_fill(a, ptr, 4096, 7, delay_s=0.5)
        ok("aclrtRecordEvent", ev, a)           # queued behind the fill; no reset before it
        ok("aclrtStreamWaitEvent", b, ev)       # passes at once: the flag is still set
        sim.launch_fill(b, ptr, 4096, 9)
        ok("aclrtSynchronizeStream", b)
        early = sim.read(ptr, 1)[0]
        ok("aclrtSynchronizeStream", a)
        ok("aclrtResetEvent", ev, b)            # after the reset, the next record sets the flag
        ok("aclrtSynchronizeStream", b)
        sim.launch_fill(a, ptr, 4096, 5, delay_s=0.3)
        ok("aclrtRecordEvent", ev, a)
        ok("aclrtStreamWaitEvent", b, ev)
        sim.launch_fill(b, ptr, 4096, 3)
        ok("aclrtSynchronizeStream", b)
        ordered = sim.read(ptr, 1)[0]
        print(json.dumps({"early": early, "ordered": ordered}))
    """)
    assert out == {"early": 9, "ordered": 3}, out


def test_a_borrowed_block_is_ordered_after_the_lenders_write_when_the_event_comes_from_the_cache(pool):
    # The pool's cached events have a record that ran since their last reset (the borrow path
    # records an event on the borrowing stream after its reset; probes and pending frees record
    # without one). Recorded again on a lending stream and waited on, such an event let the
    # borrower pass at once on an NPU (its flag was still set) and write a block the lender's
    # queued kernel still wrote.
    s1, s2 = pool.create_stream(), pool.create_stream()
    for _ in range(2):                                   # events go through the borrow path and back
        p = pool.malloc(2 * MiB, stream=s1)
        pool.free(p, stream=s1)
        q = pool.malloc(2 * MiB, stream=s2)
        pool.free(q, stream=s2)
        pool.synchronize(s1)
        pool.synchronize(s2)
    assert pool.memory_stats()["stream_migrations"] >= 1
    x = pool.malloc(6 * MiB, stream=s1)
    sim.launch_fill(s1, x, 4096, 7, delay_s=0.5)         # the lender still writes x
    pool.free(x, stream=s1)
    before = pool.memory_stats()["stream_migrations"]
    y = pool.malloc(6 * MiB, stream=s2)                  # borrows x through an event wait
    assert pool.memory_stats()["stream_migrations"] == before + 1
    assert y == x
    sim.launch_fill(s2, y, 4096, 9)                      # the borrower's write must come second
    pool.synchronize(s2)
    pool.synchronize(s1)
    assert sim.read(y, 16) == bytes([9]) * 16, "the borrower wrote before the lender's kernel ran"
    pool.free(y, stream=s2)
    pool._check_invariants()
    for s in (s1, s2):
        pool.destroy_stream(s)


def test_simulator_aclrtcreateevent_events_take_an_event_id_at_each_record_not_at_creation(sim_node):
    # CANN's aclrtCreateEvent page (hicann/runtime docs/api_docs/aclrtCreateEvent.md): "the system
    # applies for the event resource only when aclrtRecordEvent is called, so it is bound by the
    # number of events; at the limit the system waits for resources to be released"
    # (Event::Record: RT_EVENT_DEFAULT gets a fresh id at each record). Before, the simulator took
    # an id at creation, as for aclrtCreateEventWithFlag, and refused the creation past the limit.
    sim_node.run("""
        init()
        a = stream()
        evs = [event() for _ in range(6)]             # past the limit of 4 set below: no id yet
        assert sim.stats(0)["live_events"] == 6
        sim.hang_stream(a)
        for e in evs[:4]:
            ok("aclrtRecordEvent", e, a)              # 4 records not run: every id held
        assert code("aclrtRecordEvent", evs[4], a) == 207007 and "event id" in errmsg()
        assert code("aclrtCreateEventWithFlag", C.byref(C.c_void_p()), 1) == 207007
        sim.release_stream(a)
        ok("aclrtSynchronizeStream", a)               # run: their ids are back
        for e in evs:
            ok("aclrtRecordEvent", e, a)
        ok("aclrtSynchronizeStream", a)
    """, ASCEND_SIM_EVENT_LIMIT="4")


def test_reset_scheme_live_events_stay_under_half_the_devices_event_ids_and_never_wait(sim_node):
    """hicann/runtime Event::Record keeps an ACL_EVENT_SYNC event's hardware id for its life
    (docs/cann-rules-events.md, "One hardware flag"; CANN's aclrtCreateEventWithFlag page: 1,023
    events per device on Atlas inference cards). On a runtime without new-mode events (CANN before
    8.0.RC1: the legacy build), frees marked with record_stream for a busy stream each hold a live
    event: the pools of a process keep at most half the ids (511 on a 310P) in live events, and a
    free past them owes its stream (no wait under the pool lock). Before: the pool took all 1,023,
    the framework's own aclrtCreateEventWithFlag failed with 207007, and each free past them
    waited sync_timeout_ms for the stream under the pool lock."""
    out = sim_node.run_json(_hung_stream_script(legacy=True, stream_device=0), timeout=120, ASCEND_SIM_PROFILE="310p")
    assert out["soc"].startswith("Ascend310P"), out
    assert out["create"] == 0 and out["record"] == 0, out  # the framework can still use its events
    assert out["peak"] <= 512, out                    # half of 1,023 (and the framework's none yet)
    assert out["distinct"] == 1100, out               # no block reused while its stream still ran
    assert out["loop_s"] < 5, out                     # no 100 ms wait per free under the pool lock
    assert out["allocated"] == 0 and out["pending"] == 0 and out["live_after"] == 0, out


def _hung_stream_script(legacy, stream_device):
    """A script for sim_node.run_json: 1,100 frees of device 0's pool marked with record_stream for
    a hung stream of stream_device (0: the pool's own), then the framework's own event created and
    recorded on that stream's device, then the stream released and everything settled."""
    return f"""
    import ascend_pool as ap
    from ascend_pool import sim
    from ascend_pool.backend import Backend
    lib_path = sim.library_path(legacy={legacy})
    be = Backend("sim", lib_path)
    sim.attach(lib_path)
    acl = C.CDLL(lib_path)
    p0 = ap.Pool(0, backend=be, sync_timeout_ms=100)
    owner = p0 if {stream_device} == 0 else ap.Pool({stream_device}, backend=be)
    hung = owner.create_stream()
    sim.hang_stream(hung)
    t0 = time.monotonic()
    ptrs = []
    for i in range(1100):
        p = p0.malloc(4096)
        p0.record_stream(p, hung)
        p0.free(p)
        ptrs.append(p)
    loop_s = time.monotonic() - t0
    peak = sim.stats({stream_device})["live_events"]
    assert acl.aclrtSetDevice({stream_device}) == 0
    ev = C.c_void_p()
    create = acl.aclrtCreateEventWithFlag(C.byref(ev), 1)
    record = acl.aclrtRecordEvent(ev, C.c_void_p(hung)) if create == 0 else None
    sim.release_stream(hung)
    owner.synchronize(hung)
    p0.empty_cache()
    st = p0.memory_stats()
    if create == 0:
        acl.aclrtDestroyEvent(ev)
    owner.destroy_stream(hung)
    p0.close()
    if owner is not p0:
        owner.close()
    print(json.dumps({{"soc": be.soc_name, "create": create, "record": record, "peak": peak,
                      "loop_s": loop_s, "distinct": len(set(ptrs)),
                      "allocated": st["allocated_bytes.all.current"], "pending": st["pending_free_bytes"],
                      "live_after": sim.stats({stream_device})["live_events"]}}))
"""


def test_events_of_a_peer_devices_stream_stay_under_half_of_that_devices_event_ids(sim_node):
    """record_stream with a stream of another device (as torch allows): each free records an event
    of that device on it (docs/cann-rules-events.md). In the reset scheme (the legacy build, CANN
    before 8.0.RC1) such an event holds one of that device's ids for its life (hicann/runtime
    Event::Record); on a 310P (1,023 ids) they are counted with that device's own against the same
    share (511), and a free past it owes the peer stream, asked again at later passes. Before: they
    were counted nowhere, and frees marked for a busy peer stream took every id of the peer device:
    the framework's own aclrtCreateEventWithFlag there failed with 207007."""
    out = sim_node.run_json(_hung_stream_script(legacy=True, stream_device=1), timeout=120, ASCEND_SIM_PROFILE="310p")
    assert out["create"] == 0 and out["record"] == 0, out     # the framework's event on the peer device
    assert out["peak"] <= 512, out
    assert out["distinct"] == 1100, out                       # no block reused while the peer still ran
    assert out["loop_s"] < 5, out                             # no wait per free under the pool lock
    assert out["allocated"] == 0 and out["pending"] == 0, out  # the owed frees settled once it ran
    assert out["live_after"] == 0, out


def test_asking_a_peer_stream_its_device_takes_no_event_id(sim_node):
    """New-mode events (aclrtCreateEventExWithFlag, CANN 8.0.RC1 on): each record takes one of the
    device's ids until the stream reaches it (hicann/runtime Event::Record), and a wait on one never
    recorded sends no task (Event::WaitSendCheck). The acl backend asks whether a stream it created
    is still that device's stream at each record_stream with another device's stream (and at
    register_stream): now with such a wait, which the runtime checks against the stream's context
    as a record. Before, with a record: each record_stream on a busy peer stream left records
    there, and 1,100 of them took every id of the 310P peer device (the framework's
    aclrtCreateEventWithFlag there failed with 207007)."""
    out = sim_node.run_json(_hung_stream_script(legacy=False, stream_device=1), timeout=120, ASCEND_SIM_PROFILE="310p")
    assert out["create"] == 0 and out["record"] == 0, out
    assert out["distinct"] == 1100 and out["loop_s"] < 5, out
    assert out["allocated"] == 0 and out["pending"] == 0, out


@pytest.mark.parametrize("profile", ["cann8.3", "310p"])
def test_simulator_takes_the_event_flags_current_cann_defines(sim_node, profile):  # noqa: F811
    # acl_rt.h defines ACL_EVENT_DEVICE_USE_ONLY (0x10) and ACL_EVENT_EXTERNAL (0x20) for
    # aclrtCreateEventWithFlag and ACL_EVENT_IPC (0x40) for aclrtCreateEventExWithFlag; the runtime
    # (hicann/runtime ApiErrorDecorator::EventCreate[Ex]) takes them alone, DEVICE_USE_ONLY and IPC
    # only on Atlas A2/A3 and 950 (207000 elsewhere: torch_npu's IsSupportIpcEvent probe takes 207000
    # for "no IPC events" and raises on any other code). Before, every one answered 107000.
    out = sim_node.run_json("""
        init()
        a, b = stream(), stream()
        def make(name, flag):
            e = C.c_void_p()
            return code(name, C.byref(e), flag), e.value
        out = {}
        for name, flag in (("aclrtCreateEventWithFlag", 0x10), ("aclrtCreateEventWithFlag", 0x20),
                           ("aclrtCreateEventExWithFlag", 0x40)):
            rc, ev = make(name, flag)
            uses = {}
            if rc == 0:
                st = C.c_int()
                uses = {"record": code("aclrtRecordEvent", ev, a), "wait": code("aclrtStreamWaitEvent", b, ev),
                        "reset": code("aclrtResetEvent", ev, b), "sync": code("aclrtSynchronizeEvent", ev),
                        "query": code("aclrtQueryEventStatus", ev, C.byref(st))}
                ok("aclrtDestroyEvent", ev)
            out[hex(flag)] = [rc, uses]
        # alone only, and each call takes its own
        out["combined"] = [make("aclrtCreateEventWithFlag", 0x11)[0], make("aclrtCreateEventWithFlag", 0x30)[0],
                           make("aclrtCreateEventExWithFlag", 0x41)[0]]
        out["other_call"] = [make("aclrtCreateEventExWithFlag", 0x10)[0], make("aclrtCreateEventExWithFlag", 0x20)[0],
                             make("aclrtCreateEventWithFlag", 0x40)[0]]
        ok("aclrtSynchronizeStream", b)
        print(json.dumps(out))
    """, ASCEND_SIM_PROFILE=profile)
    assert out["combined"] == [PARAM_INVALID] * 3, out
    assert out["other_call"] == [PARAM_INVALID] * 3, out
    assert out["0x20"] == [0, {"record": 0, "wait": 207000, "reset": 207000, "sync": 207000, "query": 207000}], out
    if profile == "310p":  # neither device-only nor IPC events on an inference card
        assert out["0x10"] == [207000, {}] and out["0x40"] == [207000, {}], out
        return
    # device-only: no host record, wait or reset (107000); IPC: waited on in new mode, no reset
    assert out["0x10"] == [0, {"record": PARAM_INVALID, "wait": PARAM_INVALID, "reset": PARAM_INVALID,
                               "sync": 0, "query": 0}], out
    assert out["0x40"] == [0, {"record": 0, "wait": 0, "reset": PARAM_INVALID, "sync": 0, "query": 0}], out

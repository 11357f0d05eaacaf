"""Streams and events of the simulated NPU: asynchronous FIFO workers, events that complete when
the worker passes them, cross-stream ordering, both query enums, timeouts, handle validation
and thread safety. Each test runs in a child process on its own simulated node."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401  (pytest fixture)


def test_event_after_delayed_fill_completes_only_when_the_fill_is_done(sim_node):
    sim_node.run("""
        init()
        p = malloc(4096)
        s = stream(); e = event()
        never = event()   # never recorded: CANN's RT_EVENT_INIT, not CUDA's "complete"
        assert query_status(never) == 0 and query_old(never) == 0  # NOT_READY; deprecated: COMPLETE
        ok("aclrtSynchronizeEvent", never)                        # returns at once
        t0 = time.monotonic()
        sim.launch_fill(s, p, 4096, 0xAB, delay_s=0.3)
        ok("aclrtRecordEvent", e, s)
        # launching does not wait: the record and the memory below tell (a bound of 0.1 s on the
        # two calls failed when a loaded machine put the thread off for that long)
        # aclrtQueryEventStatus: NOT_READY=0, COMPLETE=1; deprecated aclrtQueryEvent: inverted
        assert query_status(e) == 0 and query_old(e) == 1
        assert sim.read(p, 4096) == bytes(4096)    # the fill has not happened yet
        ok("aclrtSynchronizeEvent", e)
        assert time.monotonic() - t0 >= 0.29
        assert query_status(e) == 1 and query_old(e) == 0
        assert sim.read(p, 4096) == b"\\xab" * 4096
        # the default stream (NULL) works the same way
        sim.launch_fill(None, p, 16, 0x01, delay_s=0.05)
        ok("aclrtRecordEvent", e, None)
        assert query_status(e) == 0
        ok("aclrtSynchronizeStream", None)
        assert query_status(e) == 1 and sim.read(p, 17) == b"\\x01" * 16 + b"\\xab"
    """)


def test_stream_wait_event_orders_two_streams(sim_node):
    sim_node.run("""
        init()
        p = malloc(1024)
        a, b, c = stream(), stream(), stream()
        ev = event(flags=1)  # ACL_EVENT_SYNC: what aclrtResetEvent needs

        # Without the wait, B's quick fill lands first and A's slow one overwrites it.
        sim.launch_fill(a, p, 1024, 0xAA, delay_s=0.2)
        sim.launch_fill(b, p, 1024, 0xBB)
        ok("aclrtSynchronizeStream", a); ok("aclrtSynchronizeStream", b)
        assert sim.read(p, 1024) == b"\\xaa" * 1024

        # With it, B waits for A's event: B's value is the last one written.
        sim.launch_fill(a, p, 1024, 0xAA, delay_s=0.2)
        ok("aclrtRecordEvent", ev, a)
        ok("aclrtStreamWaitEvent", b, ev)
        sim.launch_fill(b, p, 1024, 0xBB)
        # The reset CANN requires once a stream waited on an event is asynchronous, ordered on B
        # after its wait: recording the event again before B has run it is refused (on an NPU
        # that record could satisfy B's wait early).
        sim.hang_stream(c)
        ok("aclrtResetEvent", ev, b)
        assert code("aclrtRecordEvent", ev, c) == 107000
        ok("aclrtRecordEvent", ev, b)                # on B itself: ordered after the reset there
        ok("aclrtSynchronizeStreamWithTimeout", b, 5000)
        ok("aclrtSynchronizeStream", a)              # A's slow fill has landed too, before B's
        assert sim.read(p, 1024) == b"\\xbb" * 1024
        ok("aclrtRecordEvent", ev, c)                # B ran the reset: the event is usable again
        assert query_status(ev) == 0                 # the event now tracks the hung stream
        sim.release_stream(c)
        ok("aclrtSynchronizeEvent", ev)
        # CANN refuses a wait on a never-recorded event (Event::Wait: "the event has not been
        # recorded"); with ACL_EVENT_SYNC, or after a reset, the wait would block the stream until
        # the next record: the simulator refuses those too
        assert code("aclrtStreamWaitEvent", b, event()) == 107000 and "never been recorded" in errmsg()
        assert code("aclrtStreamWaitEvent", b, event(flags=1)) == 107000
        ok("aclrtRecordEvent", ev, a); ok("aclrtStreamWaitEvent", b, ev); ok("aclrtResetEvent", ev, b)
        assert code("aclrtStreamWaitEvent", c, ev) == 107000 and "reset" in errmsg()
        ok("aclrtSynchronizeStreamWithTimeout", b, 1000)
    """)


def test_a_reset_event_still_answers_for_its_last_record(sim_node):
    """CANN's Event::Reset keeps the latest record: aclrtQueryEventStatus and aclrtSynchronizeEvent
    still answer for it (before, the simulator forgot it and answered COMPLETE at once)."""
    sim_node.run("""
        init()
        a, b = stream(), stream()
        e = event(flags=1)
        sim.hang_stream(a)
        ok("aclrtRecordEvent", e, a); ok("aclrtStreamWaitEvent", b, e); ok("aclrtResetEvent", e, b)
        assert query_status(e) == 0 and query_old(e) == 1          # the record on A has not run
        assert code("aclrtSynchronizeEventWithTimeout", e, 100) == 507047
        sim.release_stream(a)
        ok("aclrtSynchronizeEvent", e)
        assert query_status(e) == 1 and query_old(e) == 0
        ok("aclrtSynchronizeStream", b)
    """)


def test_timeouts_on_a_hung_stream_then_it_works_after_release(sim_node):
    sim_node.run("""
        init()
        p = malloc(64)
        s = stream(); e = event()
        sim.hang_stream(s)
        sim.launch_fill(s, p, 64, 0x77)
        ok("aclrtRecordEvent", e, s)
        t0 = time.monotonic()
        assert code("aclrtSynchronizeStreamWithTimeout", s, 100) == 507046
        dt = time.monotonic() - t0
        # waits its 100 ms, then returns; the upper bound is generous (a loaded machine can put
        # the thread off for a second): a timeout read in seconds, or ignored, still fails it
        assert 0.09 <= dt < 10.0, dt
        assert "aclrtSynchronizeStreamWithTimeout" in errmsg()
        t0 = time.monotonic()
        assert code("aclrtSynchronizeEventWithTimeout", e, 100) == 507047
        assert 0.09 <= time.monotonic() - t0 < 10.0
        # 0: refused by the runtime (ApiErrorDecorator::StreamSynchronize/EventSynchronize: timeout
        # == 0 is RT_ERROR_INVALID_VALUE); before, the simulator answered it as a look (507046)
        assert code("aclrtSynchronizeStreamWithTimeout", s, 0) == 107000
        assert code("aclrtSynchronizeEventWithTimeout", e, 0) == 107000
        # below -1: ACL's own check answers the runtime's 107000, not 100000 (hicann/runtime stream.cpp, event.cpp)
        assert code("aclrtSynchronizeStreamWithTimeout", s, -2) == 107000
        assert code("aclrtSynchronizeEventWithTimeout", e, -2) == 107000
        assert query_status(e) == 0 and sim.read(p, 4) == bytes(4)
        # a thread without a current context is refused, as by the runtime (107002)
        bare = []
        t = threading.Thread(target=lambda: bare.append(code("aclrtSynchronizeStream", s)))
        t.start(); t.join(30)
        assert bare == [107002], bare
        # a host thread blocked in an untimed sync is released with the stream
        done = []
        t = threading.Thread(target=lambda: (ok("aclrtSetDevice", 0), done.append(code("aclrtSynchronizeStream", s))))
        t.start(); time.sleep(0.05)
        assert not done
        sim.release_stream(s)
        t.join(30)
        assert done == [0]
        ok("aclrtSynchronizeEventWithTimeout", e, -1)
        assert sim.read(p, 64) == b"\\x77" * 64
        sim.launch_fill(s, p, 64, 0x78)
        ok("aclrtSynchronizeStreamWithTimeout", s, 1000)
        assert sim.read(p, 64) == b"\\x78" * 64
    """)


def test_destroyed_and_garbage_handles_get_107000(sim_node):
    sim_node.run("""
        init()
        s, e = stream(), event()
        ok("aclrtDestroyStream", s)
        ok("aclrtDestroyEvent", e)
        buf = C.create_string_buffer(256)      # a real, readable address that is no handle
        st = C.c_int()
        for h in [s, 0xdeadbeef, 0x10, C.addressof(buf)]:
            assert code("aclrtDestroyStream", h) == 107000
            assert code("aclrtSynchronizeStream", h) == 107000
            assert code("aclrtDestroyEvent", h) == 107000
            assert code("aclrtQueryEventStatus", h, C.byref(st)) == 107000
            assert code("aclrtQueryEvent", h, C.byref(st)) == 107000
            assert code("aclrtSynchronizeEvent", h) == 107000
            assert code("aclrtSetCurrentContext", h) == 107000
            assert code("aclrtDestroyContext", h) == 107000
        assert "not a live event" in (code("aclrtSynchronizeEvent", e), errmsg())[1]
        live_e, live_s = event(), stream()
        assert code("aclrtRecordEvent", e, live_s) == 107000
        assert code("aclrtRecordEvent", live_e, s) == 107000
        assert code("aclrtStreamWaitEvent", live_s, e) == 107000
        assert code("aclrtStreamWaitEvent", s, live_e) == 107000
        assert code("aclrtRecordEvent", live_s, live_e) == 107000   # types are checked too
        for fn in (sim.hang_stream, sim.release_stream):
            try:
                fn(0xdeadbeef)
            except sim.SimError as err:
                assert err.code == 107000
            else:
                raise AssertionError("bad stream accepted")
        assert code("aclrtDestroyStream", None) == 100000
        assert code("aclrtDestroyEvent", None) == 100000
        assert code("aclrtQueryEventStatus", live_e, None) == 100000
        # unknown flag bits: hicann/runtime ApiErrorDecorator::EventCreate, RT_ERROR_INVALID_VALUE
        assert code("aclrtCreateEventWithFlag", C.byref(C.c_void_p()), 0x100) == 107000
        assert code("aclrtCreateEventWithFlag", C.byref(C.c_void_p()), 0) == 107000  # no flag bit: CANN refuses it
        for flag in (1, 2, 8, 9):
            ok("aclrtDestroyEvent", event(flag))
        st = sim.stats(0)
        assert st["live_events"] == 1 and st["events_created"] == 6, st
        assert st["live_streams"] == 1, st
        print("alive")
    """)


def test_contexts_switch_the_threads_device(sim_node):
    sim_node.run("""
        init(0)
        dev = C.c_int32(); cur = C.c_void_p()
        ok("aclrtGetCurrentContext", C.byref(cur)); default0 = cur.value
        assert default0
        ctx = C.c_void_p()
        ok("aclrtCreateContext", C.byref(ctx), 1)        # becomes current
        ok("aclrtGetDevice", C.byref(dev)); assert dev.value == 1
        ok("aclrtGetCurrentContext", C.byref(cur)); assert cur.value == ctx.value
        p = malloc(1000)
        assert sim.stats(1)["bytes_held"] == 1056 and sim.stats(0)["bytes_held"] == 0
        ok("aclrtSetCurrentContext", default0)
        ok("aclrtGetDevice", C.byref(dev)); assert dev.value == 0
        assert code("aclrtDestroyContext", default0) == 107000   # default contexts go with reset
        ok("aclrtSetCurrentContext", ctx)
        ok("aclrtDestroyContext", ctx)                          # destroying the current one clears it
        assert code("aclrtGetDevice", C.byref(dev)) == 107002
        assert code("aclrtGetCurrentContext", C.byref(cur)) == 107002
        assert code("aclrtDestroyContext", ctx) == 107000
        assert code("aclrtSetCurrentContext", ctx) == 107000
        free(p)                                                 # frees need no current device
        ok("aclrtSetDevice", 1)
        ok("aclrtResetDevice", 1)
        assert code("aclrtGetDevice", C.byref(dev)) == 107002
        # the current device is per thread
        ok("aclrtSetDevice", 1)
        seen = []
        def other():
            seen.append(code("aclrtGetDevice", C.byref(C.c_int32())))
            ok("aclrtSetDevice", 0)
            d = C.c_int32(); ok("aclrtGetDevice", C.byref(d)); seen.append(d.value)
        t = threading.Thread(target=other); t.start(); t.join()
        ok("aclrtGetDevice", C.byref(dev))
        assert seen == [107002, 0] and dev.value == 1, (seen, dev.value)
    """)


def test_stream_calls_run_only_in_the_streams_own_context(sim_node):
    # CANN (runtime api_impl.cc): EventRecord, StreamWaitEvent, EventReset and StreamDestroy need a
    # current context (107002) and a stream of that context (107003, "stream not in current
    # context"); queries and syncs of events need none; the default stream is any context's of
    # its device; IpcMemSetImportPid needs a context too
    sim_node.run("""
        init(0)
        cur = C.c_void_p(); ok("aclrtGetCurrentContext", C.byref(cur)); default0 = cur.value
        s0 = stream()                                        # in device 0's default context
        own = C.c_void_p(); ok("aclrtCreateContext", C.byref(own), 0)   # current now
        s1 = stream()                                        # in `own`
        e = event(0x1)                                       # ACL_EVENT_SYNC
        assert code("aclrtRecordEvent", e, s0) == 107003 and "not in the current context" in errmsg()
        assert code("aclrtStreamWaitEvent", s0, e) == 107003
        assert code("aclrtResetEvent", e, s0) == 107003
        assert code("aclrtDestroyStream", s0) == 107003
        ok("aclrtRecordEvent", e, s1); ok("aclrtStreamWaitEvent", s1, e); ok("aclrtResetEvent", e, s1)
        ok("aclrtRecordEvent", e, None)                      # the default stream: any context's
        ok("aclrtSetCurrentContext", default0)
        ok("aclrtRecordEvent", e, s0)
        assert code("aclrtRecordEvent", e, s1) == 107003
        ok("aclrtSynchronizeEvent", e); query_status(e)      # event queries and syncs need no context
        seen = []
        def contextless():                                   # a thread that never set a device
            seen.append(code("aclrtRecordEvent", e, s0))
            seen.append(code("aclrtDestroyStream", s0))
            seen.append(code("aclrtSynchronizeEvent", e))
            st = C.c_int(-1); seen.append(code("aclrtQueryEventStatus", e, C.byref(st)))
        t = threading.Thread(target=contextless); t.start(); t.join()
        assert seen == [107002, 107002, 0, 0], seen
        ok("aclrtDestroyStream", s0)
        ok("aclrtSetCurrentContext", own); ok("aclrtDestroyStream", s1)
        ok("aclrtDestroyEvent", e)
        p = malloc(2 << 20)
        key = C.create_string_buffer(65)
        lib.aclrtIpcMemGetExportKey.argtypes = [C.c_void_p, C.c_size_t, C.c_char_p, C.c_size_t, C.c_uint64]
        lib.aclrtIpcMemSetImportPid.argtypes = [C.c_char_p, C.POINTER(C.c_int32), C.c_size_t]
        ok("aclrtIpcMemGetExportKey", p, 2 << 20, key, 65, 0)
        pid = (C.c_int32 * 1)(os.getpid())
        out = []
        t = threading.Thread(target=lambda: out.append(code("aclrtIpcMemSetImportPid", key, pid, 1)))
        t.start(); t.join()
        assert out == [107002], out
    """)


def test_event_limit_is_65536_live_events_per_device(sim_node):
    sim_node.run("""
        init()
        evs = [event(1) for _ in range(65536)]
        e = C.c_void_p()
        assert code("aclrtCreateEventWithFlag", C.byref(e), 1) == 207007 and "65536" in errmsg()
        ok("aclrtSetDevice", 1)
        other = event(1)                    # the limit is per device
        ok("aclrtSetDevice", 0)
        ok("aclrtDestroyEvent", evs.pop())
        evs.append(event(1))
        assert sim.stats(0)["live_events"] == 65536
        for x in evs: ok("aclrtDestroyEvent", x)
        assert sim.stats(0)["live_events"] == 0
    """, timeout=60)


def test_many_threads_use_memory_events_and_streams_at_once(sim_node):
    sim_node.run("""
        init()
        errors = []
        def worker(k):
            try:
                ok("aclrtSetDevice", k % 2)
                s = stream()
                held = []
                for i in range(150):
                    p = malloc(64 + 32 * (i % 50))
                    e = event()
                    sim.launch_fill(s, p, 64, k)
                    ok("aclrtRecordEvent", e, s)
                    ok("aclrtStreamWaitEvent", None, e)
                    query_status(e)
                    if i % 10 == 0:
                        ok("aclrtSynchronizeEvent", e)
                        assert sim.read(p, 64) == bytes([k]) * 64, (k, sim.read(p, 64))
                    ok("aclrtDestroyEvent", e)
                    if i % 3 == 0:
                        free(malloc(4096))
                    held.append(p)
                # Free only once the stream is done with the memory: a free while a fill is
                # queued lets another thread get the address and the late fill corrupt it.
                ok("aclrtSynchronizeStream", s)
                for p in held:
                    free(p)
                ok("aclrtDestroyStream", s)
            except BaseException as exc:
                errors.append(repr(exc))
        ts = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in ts: t.start()
        for t in ts: t.join()
        assert not errors, errors
        for d in (0, 1):
            st = sim.stats(d)
            assert st["mallocs"] == st["frees"] == 800 and st["bytes_held"] == 0, st
            assert st["live_events"] == 0 and st["events_created"] == 600, st
            assert st["node_bytes_used"] == 0, st
    """, timeout=60)


def test_destroying_a_stream_drains_it_and_frees_during_fills_are_safe(sim_node):
    sim_node.run("""
        init()
        p, q = malloc(1 << 20), malloc(1 << 20)
        s = stream()
        sim.launch_fill(s, p, 1 << 20, 9, delay_s=0.1)
        t0 = time.monotonic()
        ok("aclrtDestroyStream", s)               # drains: the fill has run
        assert time.monotonic() - t0 >= 0.09
        assert sim.read(p, 8) == b"\\x09" * 8
        # aclrtFree does not wait for work: a fill whose memory is gone is dropped, not a crash
        s = stream()
        sim.launch_fill(s, q, 1 << 20, 5, delay_s=0.1)
        free(q)
        ok("aclrtSynchronizeStream", s)
        assert sim.stats(0)["dropped_fills"] == 1
        free(p)
    """)


def test_legacy_build_runs_the_same_runtime_through_the_old_calls(sim_node):
    import ascend_pool.sim as sim
    sim_node.run("""
        assert not HAS_NEW and not hasattr(lib, "aclrtQueryEventStatus")
        init()
        p = malloc(100)
        assert used() == 160
        s, e = stream(), event()
        sim.launch_fill(s, p, 100, 0x3C, delay_s=0.1)
        ok("aclrtRecordEvent", e, s)
        assert query_old(e) == 1                  # NOT_READY in the deprecated numbering
        ok("aclrtSynchronizeEvent", e)
        assert query_old(e) == 0 and sim.read(p, 100) == b"\\x3c" * 100
    """, SIM_LIB=sim.library_path(legacy=True))


def test_a_stream_being_destroyed_stays_alive_to_other_threads_until_its_work_is_done(sim_node):
    # CANN's aclrtDestroyStream waits for the stream's tasks (aclrtDestroyStreamForce does not).
    # Meanwhile the handle is still a stream to other threads: an event recorded on it completes
    # with the drained work. The simulator used to invalidate the handle first: a pool asking the
    # stream then took it for destroyed and handed its blocks out while the work still wrote them.
    sim_node.run("""
        init()
        p = malloc(1 << 20)
        s, e = stream(), event()
        sim.launch_fill(s, p, 1 << 20, 9, delay_s=0.3)
        done = {}
        def destroy():
            ok("aclrtSetDevice", 0)
            done["rc"] = lib.aclrtDestroyStream(s)
        t = threading.Thread(target=destroy); t.start()
        time.sleep(0.1)                            # destroy is draining s now
        ok("aclrtRecordEvent", e, s)              # before: 107000, "is being destroyed"
        assert query_status(e) == 0                # not done: the fill is still queued
        ok("aclrtSynchronizeEvent", e)
        assert sim.read(p, 8) == b"\\x09" * 8
        t.join()
        assert done["rc"] == 0
        assert lib.aclrtRecordEvent(e, s) == 107000  # once destroyed, the handle is gone
        free(p)
    """)


def test_destroying_a_context_drains_and_destroys_its_streams(sim_node):
    # A context's resources go with it. Its streams used to live on with a context no thread
    # could enter again: never destroyable (107003 from every context), their workers kept.
    sim_node.run("""
        init()
        p = malloc(1 << 20)
        st = {}
        def app():
            ok("aclrtSetDevice", 0)
            ctx = C.c_void_p(); ok("aclrtCreateContext", C.byref(ctx), 0)
            y = stream()
            sim.launch_fill(y, p, 1 << 20, 7, delay_s=0.2)
            t0 = time.monotonic()
            ok("aclrtDestroyContext", ctx)
            st.update(y=y, took=time.monotonic() - t0)
        t = threading.Thread(target=app); t.start(); t.join()
        assert st["took"] >= 0.15, st                 # drained first: the fill has run
        assert sim.read(p, 8) == b"\\x07" * 8
        e = event()
        assert lib.aclrtRecordEvent(e, st["y"]) == 107000  # the stream is gone with its context
        free(p)
    """)


def test_a_destroyed_streams_handle_goes_to_the_next_stream_when_reuse_is_on(sim_node):
    # CANN's stream handles are heap pointers, which the runtime may give to the next stream;
    # ASCEND_SIM_REUSE_STREAM_HANDLES=1 does the same (most recently destroyed first), so callers
    # that remember streams can be tested against that ABA. Off by default: never reused.
    out = sim_node.run_json("""
        init()
        def create():
            s = C.c_void_p()
            assert lib.aclrtCreateStream(C.byref(s)) == 0
            return s.value
        a = create()
        assert lib.aclrtDestroyStream(C.c_void_p(a)) == 0
        b = create()
        c = create()
        print(json.dumps({"reused": b == a, "fresh": c not in (a, b)}))
    """, ASCEND_SIM_REUSE_STREAM_HANDLES="1")
    assert out == {"reused": True, "fresh": True}
    out = sim_node.run_json("""
        init()
        s = C.c_void_p(); assert lib.aclrtCreateStream(C.byref(s)) == 0
        a = s.value
        assert lib.aclrtDestroyStream(C.c_void_p(a)) == 0
        assert lib.aclrtCreateStream(C.byref(s)) == 0
        print(json.dumps({"reused": s.value == a}))
    """)
    assert out == {"reused": False}


def test_an_event_is_recorded_only_on_a_stream_of_its_own_device(sim_node):
    # CANN: an event and the stream it is recorded on share a device (the pool records an event
    # of the peer's device for a cross-device record_stream). The simulator took any pair.
    sim_node.run("""
        init(0)
        e = event()
        ok("aclrtSetDevice", 1)
        s = stream()
        assert code("aclrtRecordEvent", e, s) == 107003
        assert "belongs to device 0" in errmsg()
        ok("aclrtRecordEvent", event(), s)
    """)


def test_destroy_stream_force_drops_what_has_not_started(sim_node):
    """aclrtDestroyStreamForce (CANN: "does not wait for the stream's unfinished tasks"): the items
    not started never run, a hung one is abandoned, the call returns at once, and events recorded
    there complete (waits on them pass) so that nothing waits for work that will never run."""
    sim_node.run("""
        import time
        init()
        MiB = 1 << 20
        s, b = stream(), stream()
        p = malloc(MiB)
        sim.launch_fill(b, p, MiB, 0x11); ok("aclrtSynchronizeStream", b)
        e = event(flags=1)
        sim.hang_stream(s)
        sim.launch_fill(s, p, MiB, 0x77)
        ok("aclrtRecordEvent", e, s)
        ok("aclrtStreamWaitEvent", b, e)
        t = time.monotonic()
        ok("aclrtDestroyStreamForce", s)
        assert time.monotonic() - t < 10  # the stream stays hung: a wait for it never returns
        ok("aclrtSynchronizeStreamWithTimeout", b, 2000)       # B's wait passed
        assert query_status(e) == 1
        time.sleep(0.1)
        assert sim.read(p, MiB) == b"\\x11" * MiB              # the dropped fill never ran
        assert code("aclrtDestroyStreamForce", s) == 107000    # a destroyed handle
        assert code("aclrtDestroyStreamForce", None) == 100000
        s2 = stream()
        sim.launch_fill(s2, p, MiB, 0x22, delay_s=0.2)
        ok("aclrtDestroyStreamForce", s2)     # dropped if not started, else waited for: no later write
        before = sim.read(p, MiB)
        assert before in (b"\\x11" * MiB, b"\\x22" * MiB)
        time.sleep(0.3)
        assert sim.read(p, MiB) == before
    """)


@pytest.mark.parametrize("profile, most", [("310p", 1024), ("strict", 1984), ("cann8.0", 2048)])
def test_simulator_refuses_streams_past_the_devices_most(sim_node, profile, most):
    """CANN's aclrtCreateStream page: each SoC holds at most so many streams per device, default
    streams included (Atlas A2/A3 and 950: 1984 in the current pages, 2048 in CANN 8.0's; Atlas
    inference cards: 1024), and past them creation fails (ACL_ERROR_RT_NO_STREAM_RESOURCE,
    207008). Before, the simulator made streams without a bound. The pool's create_stream then
    raises the runtime's code and the pool keeps working once a stream is destroyed."""
    out = sim_node.run_json("""
        import ascend_pool as ap
        pool = ap.Pool(0, backend="sim")
        made, err = [], None
        while len(made) < 4000:
            try:
                made.append(pool.create_stream())
            except ap.PoolError as e:
                err = e
                break
        live = sim.stats(0)["live_streams"]
        pool.destroy_stream(made.pop())
        again = pool.create_stream()
        p = pool.malloc(1 << 20, stream=again)
        pool.free(p, stream=again)
        for s in made + [again]:
            pool.destroy_stream(s)
        pool.close()
        print(json.dumps({"made": len(made) + 1, "live": live, "code": getattr(err, "code", None),
                          "named": "streams" in str(err), "refs": sim.stats(0)["device_refs"]}))
    """, timeout=120, ASCEND_SIM_PROFILE=profile)
    assert out["live"] == most and out["code"] == 207008 and out["named"], out
    assert out["refs"] == 0, out


def test_synchronize_device_waits_for_every_stream_of_the_current_contexts_device(sim_node):
    # CANN's aclrtSynchronizeDevice[WithTimeout]: the device of the thread's current context,
    # every stream of it (the default one and each created one); 507046 past the limit
    sim_node.run("""
        init(0)
        p0 = malloc(64); s0 = stream()
        ok("aclrtSetDevice", 1)
        p1 = malloc(64); q1 = malloc(64); s1 = stream()
        sim.launch_fill(s1, p1, 64, 0x11, 0.3)
        sim.hang_stream(s0)                                  # device 0's: not device 1's wait
        sim.launch_fill(s0, p0, 64, 0x22)
        sim.launch_fill(None, q1, 64, 0x33, 0.2)             # device 1's default stream
        ok("aclrtSynchronizeDevice")
        assert sim.read(p1, 64) == b"\\x11" * 64 and sim.read(q1, 64) == b"\\x33" * 64
        ok("aclrtSetDevice", 0)
        t0 = time.monotonic()
        assert code("aclrtSynchronizeDeviceWithTimeout", 100) == 507046
        assert 0.09 <= time.monotonic() - t0 < 10.0
        assert "aclrtSynchronizeDeviceWithTimeout" in errmsg()
        assert code("aclrtSynchronizeDeviceWithTimeout", 0) == 107000
        assert code("aclrtSynchronizeDeviceWithTimeout", -2) == 107000
        bare = []
        t = threading.Thread(target=lambda: bare.append(code("aclrtSynchronizeDevice")))
        t.start(); t.join(30)
        assert bare == [107002], bare
        sim.release_stream(s0)
        ok("aclrtSynchronizeDeviceWithTimeout", 5000)
        assert sim.read(p0, 64) == b"\\x22" * 64
    """)

"""The simulator's aclrtResetDeviceForce (CANN R2, docs/cann-rules.md): it takes back every
aclrtSetDevice reference of the process at once and releases the device's default context; a
device with no reference left refuses both resets, and the next aclrtSetDevice makes a new
context. Run in a fresh process (sim_node): a forced reset in the test process would take the
references of every pool the other tests opened."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401


def test_a_forced_reset_takes_every_reference_and_the_context(sim_node):
    out = sim_node.run_json("""
        from ascend_pool import sim
        acl = C.CDLL(sim.library_path())
        acl.aclrtGetCurrentContext.argtypes = [C.POINTER(C.c_void_p)]
        acl.aclrtSetCurrentContext.argtypes = [C.c_void_p]
        assert acl.aclInit(None) == 0
        for _ in range(3):
            assert acl.aclrtSetDevice(0) == 0
        first = C.c_void_p()
        assert acl.aclrtGetCurrentContext(C.byref(first)) == 0
        refs_set = sim.stats(0)["device_refs"]
        force = acl.aclrtResetDeviceForce(0)
        refs_forced = sim.stats(0)["device_refs"]
        again = [acl.aclrtResetDevice(0), acl.aclrtResetDeviceForce(0)]
        switch_dead = acl.aclrtSetCurrentContext(first)
        assert acl.aclrtSetDevice(0) == 0
        second = C.c_void_p()
        assert acl.aclrtGetCurrentContext(C.byref(second)) == 0
        bad_device = acl.aclrtResetDeviceForce(7)
        print(json.dumps({"refs_set": refs_set, "force": force, "refs_forced": refs_forced, "again": again,
                          "switch_dead": switch_dead, "new_context": second.value != first.value,
                          "refs_after": sim.stats(0)["device_refs"], "bad_device": bad_device}))
    """)
    assert out["refs_set"] == 3 and out["force"] == 0 and out["refs_forced"] == 0, out
    assert out["again"] == [107000, 107000], out       # nothing left to reset
    assert out["switch_dead"] != 0, out                # the released context is refused
    assert out["new_context"] and out["refs_after"] == 1, out
    assert out["bad_device"] == 107001, out            # ACL_ERROR_RT_INVALID_DEVICEID


def test_the_last_reset_waits_for_the_default_contexts_work_and_takes_its_streams(sim_node):
    # CANN: the last aclrtResetDevice releases the default context with its default stream and
    # every stream made in it, after waiting for their unfinished work. The simulator returned at
    # once and left the streams alive: a caller holding a lock across the reset never showed.
    out = sim_node.run_json("""
        import time
        from ascend_pool import sim
        acl = C.CDLL(sim.library_path())
        assert acl.aclInit(None) == 0
        assert acl.aclrtSetDevice(0) == 0 and acl.aclrtSetDevice(0) == 0
        s, p = C.c_void_p(), C.c_void_p()
        assert acl.aclrtCreateStream(C.byref(s)) == 0            # in the default context
        assert acl.aclrtMalloc(C.byref(p), 2 << 20, 0) == 0
        sim.launch_fill(s.value, p.value, 2 << 20, 0x5A, delay_s=1.5)
        t0 = time.monotonic()
        assert acl.aclrtResetDevice(0) == 0                       # not the last: no wait
        not_last_s = time.monotonic() - t0
        assert acl.aclrtResetDevice(0) == 0                       # the last
        last_s = time.monotonic() - t0
        assert acl.aclrtSetDevice(0) == 0
        stream_after = acl.aclrtSynchronizeStream(s)
        written = sim.read(p.value, 64) == b"\\x5a" * 64
        print(json.dumps({"not_last_s": not_last_s, "last_s": last_s, "stream_after": stream_after,
                          "written": written}))
    """)
    assert out["not_last_s"] < 0.9 and out["last_s"] >= 1.4, out
    assert out["stream_after"] != 0 and out["written"], out    # the stream went, after its work

"""The simulator's aclrtResetDeviceForce (CANN R2, docs/cann-rules.md): it takes back every
aclrtSetDevice reference of the process at once and releases the device's default context; a
device with no reference left refuses both resets, and the next aclrtSetDevice makes a new
context. Run in a fresh process (sim_node): a forced reset in the test process would take the
references of every pool the other tests opened."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ascend_pool import sim

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401

ROOT = Path(__file__).resolve().parent.parent


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
        sim.launch_fill(s.value, p.value, 2 << 20, 0x5A, delay_s=4.0)
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
    # a wait costs the kernel's 4 s: the bound below it leaves room for a loaded machine
    assert out["not_last_s"] < 3.0 and out["last_s"] >= 3.9, out
    assert out["stream_after"] != 0 and out["written"], out    # the stream went, after its work


def test_a_device_set_and_reset_again_and_again_keeps_no_context_and_stale_threads_stay_refused(sim_node):
    # Each last aclrtResetDevice released the default context and the next aclrtSetDevice made a
    # new one, the old kept for good: 64 B of host memory per cycle (131 B per Pool open/close of
    # a device's only pool), without bound. A dead context's struct now serves the next one; a
    # thread still naming the old one is refused as before, and a stream pins its context.
    out = sim_node.run_json("""
        import threading
        from ascend_pool import sim
        acl = C.CDLL(sim.library_path())
        acl.aclrtCreateContext.argtypes = [C.POINTER(C.c_void_p), C.c_int32]
        acl.aclrtDestroyContext.argtypes = [C.c_void_p]
        acl.aclrtDestroyStream.argtypes = [C.c_void_p]
        acl.aclrtSetCurrentContext.argtypes = [C.c_void_p]
        class MI(C.Structure):
            _fields_ = [(n, C.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]
        libc = C.CDLL("libc.so.6"); libc.mallinfo2.restype = MI
        heap = lambda: libc.mallinfo2().uordblks + libc.mallinfo2().hblkhd
        assert acl.aclInit(None) == 0
        def cycle():
            assert acl.aclrtSetDevice(0) == 0 and acl.aclrtResetDevice(0) == 0
        def user_context():
            c = C.c_void_p()
            assert acl.aclrtCreateContext(C.byref(c), 0) == 0 and acl.aclrtDestroyContext(c) == 0
        for _ in range(200):
            cycle(); user_context()
        before = heap()
        for _ in range(3000):
            cycle(); user_context()
        per_cycle = (heap() - before) / 3000
        # a thread whose current context was released, then reused for the next default context
        got, go, done = {}, threading.Event(), threading.Event()
        def stale():
            assert acl.aclrtSetDevice(0) == 0
            go.wait()
            p = C.c_void_p()
            got["malloc"] = acl.aclrtMalloc(C.byref(p), 4096, 0)
            done.set()
        t = threading.Thread(target=stale); t.start()
        while sim.stats(0)["device_refs"] != 1:
            time.sleep(0.01)
        assert acl.aclrtResetDevice(0) == 0          # the thread's context goes
        assert acl.aclrtSetDevice(0) == 0            # a new one, in the old one's struct
        go.set(); done.wait(10); t.join()
        # a stream keeps its (destroyed) context's struct from serving another context meanwhile
        c1, s = C.c_void_p(), C.c_void_p()
        assert acl.aclrtCreateContext(C.byref(c1), 0) == 0 and acl.aclrtCreateStream(C.byref(s)) == 0
        c2 = C.c_void_p()
        assert acl.aclrtCreateContext(C.byref(c2), 0) == 0
        in_other = acl.aclrtDestroyStream(s)         # s is c1's: 107003 from c2
        assert acl.aclrtSetCurrentContext(c1) == 0 and acl.aclrtDestroyStream(s) == 0
        print(json.dumps({"per_cycle": per_cycle, "stale_malloc": got["malloc"], "in_other": in_other,
                          "distinct": c1.value != c2.value}))
    """)
    assert out["per_cycle"] < 16, out               # 128 B (two contexts) per cycle before
    assert out["stale_malloc"] == 107002, out       # ACL_ERROR_RT_CONTEXT_NULL, as before
    assert out["in_other"] == 107003 and out["distinct"], out


def _context_race(mode, tmp_path):
    # tests/c/sim_context_races.c: an interleaving made deterministic by pausing a thread inside
    # the simulator at its first mutex unlock (or lock), which the program interposes
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.fail("no C compiler (cc) on this machine: the extension needs one too (README: prerequisites)")
    exe = tmp_path / "races"
    # scripts/asan.sh and tsan.sh preload their runtime into Python: not into cc, but into the
    # program, which loads the instrumented simulator
    subprocess.run([cc, "-O1", "-g", "-rdynamic", "-o", str(exe), str(ROOT / "tests" / "c" / "sim_context_races.c"),
                    "-ldl", "-lpthread"], check=True, env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
    env = dict(os.environ)
    env.update(ASCEND_SIM_DEVICES="2", ASCEND_SIM_SHM_DIR=str(tmp_path), ASCEND_SIM_NODE=f"races{os.getpid()}")
    r = subprocess.run([str(exe), sim.library_path(), mode], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_set_device_racing_the_last_reset_never_lands_in_a_reused_context(tmp_path):
    # aclrtSetDevice found the default context, let go of the device's lock, then raised the
    # device's count and made the context current: the last aclrtResetDevice on another thread
    # released it in between, an aclrtCreateContext on device 1 reused its struct, and the thread
    # ran in device 1's context (its current context's handle was device 1's new one)
    _context_race("setdevice", tmp_path)


def test_a_child_forked_while_a_context_was_being_made_can_make_its_own(tmp_path):
    # context.c's spare-context lock (new with the reuse of dead contexts) was not re-initialised
    # in a forked child: forked while another thread held it, the child's first new context
    # (aclInit + aclrtSetDevice) waited for good
    _context_race("fork", tmp_path)

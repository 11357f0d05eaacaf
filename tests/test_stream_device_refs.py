"""The device reference a stream from create_stream() holds (acl backend, acl_stream_create) goes
back whichever way the stream dies: through the pool, or destroyed by the framework with the raw
aclrtDestroyStream (then at the backend's next stream create or destroy, or the pool's close:
never where the stale note is found, which may be under a pool lock), and a create racing a
destroy never has the destroy give back the new stream's reference. sim.stats(dev)["device_refs"]
is the process's aclrtSetDevice count minus its aclrtResetDevice count."""
import os
import sys
import textwrap

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401  (pytest fixture)

RAW = """
import ascend_pool as ap
from ascend_pool import sim
acl = sim.attach()
for n, a in {"aclrtSetDevice": [C.c_int32], "aclrtResetDevice": [C.c_int32],
             "aclrtDestroyStream": [C.c_void_p]}.items():
    getattr(acl, n).argtypes, getattr(acl, n).restype = a, C.c_int

def raw_destroy(dev, s):  # the framework's own thread, on its device
    assert acl.aclrtSetDevice(dev) == 0
    assert acl.aclrtDestroyStream(C.c_void_p(s)) == 0
    assert acl.aclrtResetDevice(dev) == 0
"""


def raw(code):
    """RAW, then the test's code (the child runs it dedented)."""
    return RAW + textwrap.dedent(code)


def test_a_create_racing_a_destroy_never_moves_a_reference_to_the_wrong_device(sim_node):
    # destroy_stream destroyed the stream first and read its note after: a create on the other
    # device got the same handle meanwhile (the runtime reuses handles), re-pointed the note, and
    # the destroy gave back the new stream's reference (on the other device): references piled up
    # on one device (dozens in 2 s) and went missing on the other.
    out = sim_node.run_json("""
        import ascend_pool as ap
        from ascend_pool import sim
        pools = [ap.Pool(d, backend="sim") for d in (0, 1)]
        base = [sim.stats(d)["device_refs"] for d in (0, 1)]
        errors = []

        def churn(pool, until):
            try:
                while time.monotonic() < until:
                    pool.destroy_stream(pool.create_stream())
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

        until = time.monotonic() + 2.0
        ts = [threading.Thread(target=churn, args=(pools[i % 2], until)) for i in range(4)]
        for t in ts: t.start()
        for t in ts: t.join(30)
        churned = [sim.stats(d)["device_refs"] for d in (0, 1)]
        for p in pools: p.close()
        print(json.dumps({"base": base, "churned": churned, "errors": errors[:2],
                          "closed": [sim.stats(d)["device_refs"] for d in (0, 1)]}))
    """, ASCEND_SIM_REUSE_STREAM_HANDLES="1", timeout=60)
    assert out["errors"] == [], out
    assert out["churned"] == out["base"] == [1, 1] and out["closed"] == [0, 0], out


def test_a_stream_the_framework_destroys_gives_its_reference_back(sim_node):
    # The framework destroys the pool's side stream itself (aclrtDestroyStream), as torch_npu does
    # with a stream it owns: the backend only dropped its note when it found the stream gone, and
    # the reference was never given back (one per stream, for the process's life; the device's
    # default context never released).
    out = sim_node.run_json(raw("""
        pool = ap.Pool(0, backend="sim")
        base = sim.stats(0)["device_refs"]
        for _ in range(5):
            s = pool.create_stream()
            pool.free(pool.malloc(4096, stream=s), stream=s)
            raw_destroy(0, s)
            try:
                pool.synchronize(s)          # the pool finds the stream gone
            except ap.InvalidStreamError:
                pass
        pool.destroy_stream(pool.create_stream())   # the backend's next stream call
        found = sim.stats(0)["device_refs"]
        t = pool.create_stream()
        raw_destroy(0, t)                    # this one nothing here names again before the close
        pool.close()
        print(json.dumps({"base": base, "found": found, "closed": sim.stats(0)["device_refs"]}))
    """))
    assert out == {"base": 1, "found": 1, "closed": 0}, out


def test_a_reused_handle_gives_the_destroyed_streams_reference_back(sim_node):
    # A stream destroyed with the raw runtime whose handle the runtime gives to the next stream the
    # backend makes, on another device: the note was re-pointed to the new device, and the old
    # device kept the reference for good.
    out = sim_node.run_json(raw("""
        from ascend_pool.backend import open_backend
        be = open_backend("sim")
        x = be.stream_create(0)
        raw_destroy(0, x)
        y = be.stream_create(1)
        reused = x == y
        be.stream_destroy(y)
        print(json.dumps({"reused": reused, "refs": [sim.stats(d)["device_refs"] for d in (0, 1)]}))
    """), ASCEND_SIM_REUSE_STREAM_HANDLES="1")
    assert out == {"reused": True, "refs": [0, 0]}, out


def test_a_busy_stream_left_at_close_then_destroyed_by_the_framework_gives_its_reference_back(sim_node):
    # close() leaves a busy stream to the runtime, with its reference (the device's last reset
    # would destroy it, or wait). The framework then destroys it with the runtime: its reference
    # stayed for the process's life. The backend hears of it at its next call: here the next pool
    # on the device, whose close asks the device's streams.
    out = sim_node.run_json(raw("""
        pool = ap.Pool(0, backend="sim")
        s = pool.create_stream()
        x = pool.malloc(1 << 20, stream=s)
        sim.launch_fill(s, x, 1 << 20, 7, delay_s=0.3)   # still running at close
        pool.free(x, stream=s)
        pool.close()
        left = sim.stats(0)["device_refs"]
        raw_destroy(0, s)
        later = ap.Pool(0, backend="sim")
        later.close()
        print(json.dumps({"left": left, "closed": sim.stats(0)["device_refs"],
                          "streams": sim.stats(0)["live_streams"]}))
    """))
    assert out["left"] == 1 and out["closed"] == 0, out

"""Fault injection and configuration of the simulated NPU: each fault fires exactly when
configured (the Nth call, not before, not after), latency is really added, and bad settings are
refused with a message naming the variable. Each test runs in a child process on its own node."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401  (pytest fixture)


def test_fail_malloc_nth_from_the_environment_fails_exactly_the_nth(sim_node):
    sim_node.run("""
        init()
        assert code("aclrtMalloc", C.byref(C.c_void_p()), 0, 0) == 100000   # invalid: not counted
        results = []
        for i in range(1, 8):
            p = C.c_void_p()
            fn = "aclrtMallocAlign32" if i % 2 else "aclrtMalloc"           # both are device mallocs
            rc = code(fn, C.byref(p), 100, 0)
            results.append(rc)
            if rc == 207001:
                assert "injected fault" in errmsg()
        assert results == [0, 0, 207001, 0, 0, 0, 0], results
        st = sim.stats(0)
        assert st["mallocs"] == 6 and used() == st["bytes_held"], st
    """, ASCEND_SIM_FAIL_MALLOC_NTH="3")


def test_fail_malloc_nth_from_python_counts_from_the_call(sim_node):
    sim_node.run("""
        init()
        def attempts(n):
            return [code("aclrtMalloc", C.byref(C.c_void_p()), 64, 0) for _ in range(n)]
        assert attempts(3) == [0, 0, 0]
        sim.set_faults(fail_malloc_nth=2)
        assert attempts(5) == [0, 207001, 0, 0, 0]
        sim.set_faults(fail_malloc_nth=1)
        assert attempts(2) == [207001, 0]
        sim.set_faults(fail_malloc_nth=2)
        sim.set_faults(malloc_latency_us=0)        # None arguments leave the armed count alone
        sim.set_faults(fail_malloc_nth=0)          # 0 disarms
        assert attempts(4) == [0, 0, 0, 0]
    """)


def test_fail_after_bytes_counts_this_process_rounded_bytes(sim_node):
    sim_node.run("""
        init()
        a = malloc(512, align32=True)
        b = malloc(480)                      # 480 -> 512 reserved: held 1024, the limit
        p = C.c_void_p()
        assert code("aclrtMallocAlign32", C.byref(p), 1, 0) == 207001
        assert "fail_after_bytes=1024" in errmsg()
        ok("aclrtSetDevice", 1)              # the limit is for the process, all devices
        assert code("aclrtMallocAlign32", C.byref(p), 1, 0) == 207001
        ok("aclrtSetDevice", 0)
        free(a)
        c = malloc(512, align32=True)        # room again
        assert code("aclrtMallocAlign32", C.byref(p), 32, 0) == 207001
        sim.set_faults(fail_after_bytes="2KiB")
        d = malloc(1024, align32=True)
        assert code("aclrtMallocAlign32", C.byref(p), 32, 0) == 207001
        sim.set_faults(fail_after_bytes=-1)  # disarmed
        e = malloc(1 << 20)
        for x in (b, c, d, e): free(x)
    """, ASCEND_SIM_FAIL_AFTER_BYTES="1KiB")


def test_latency_is_measurably_added_to_malloc_and_free(sim_node):
    sim_node.run("""
        init()
        def timed(fn, n=5):
            t0 = time.monotonic(); out = [fn() for _ in range(n)]; return time.monotonic() - t0, out
        base_m, ptrs = timed(lambda: malloc(4096))
        base_f, _ = timed(lambda: free(ptrs.pop()))
        # latencies long enough that 5 calls without them (a loaded machine's scheduling) stay
        # well under a quarter of 5 with them
        sim.set_faults(malloc_latency_us=100000, free_latency_us=150000)
        lat_m, ptrs = timed(lambda: malloc(4096))
        lat_f, _ = timed(lambda: free(ptrs.pop()))
        assert lat_m >= 0.5 and lat_m >= base_m + 0.45, (base_m, lat_m)
        assert lat_f >= 0.75 and lat_f >= base_f + 0.7, (base_f, lat_f)
        sim.reset_faults()
        fast, ptrs = timed(lambda: malloc(4096))
        assert fast < lat_m / 4, (fast, lat_m)
        for p in ptrs: free(p)
        # microsecond latencies (spun, not slept) are added too: 200 x 250 us >= 50 ms
        sim.set_faults(malloc_latency_us=250)
        t, ptrs = timed(lambda: malloc(64), n=200)
        assert t >= 0.05, t
    """)


def test_latency_from_the_environment(sim_node):
    sim_node.run("""
        init()
        t0 = time.monotonic(); p = malloc(64); free(p); dt = time.monotonic() - t0
        assert dt >= 0.05, dt
    """, ASCEND_SIM_MALLOC_LATENCY_US="25000", ASCEND_SIM_FREE_LATENCY_US="25000")


def test_event_create_and_query_faults_fire_once_at_the_nth_call(sim_node):
    sim_node.run("""
        init()
        sim.set_faults(fail_event_create_nth=2)
        rcs = [code("aclrtCreateEvent", C.byref(C.c_void_p())) for _ in range(4)]
        assert rcs == [0, 207007, 0, 0], rcs
        st = sim.stats(0)
        assert st["events_created"] == 3 and st["live_events"] == 3, st
        e = event()
        sim.set_faults(fail_event_query_nth=3)
        s = C.c_int()
        rcs = [code("aclrtQueryEventStatus", e, C.byref(s)), code("aclrtQueryEvent", e, C.byref(s)),
               code("aclrtQueryEventStatus", e, C.byref(s)), code("aclrtQueryEvent", e, C.byref(s))]
        assert rcs == [0, 0, 107000, 0], rcs
    """)


def test_reset_faults_disarms_the_environment_faults(sim_node):
    sim_node.run("""
        init()
        assert code("aclrtMalloc", C.byref(C.c_void_p()), 64, 0) == 207001   # 1st fails
        sim.reset_faults()
        free(malloc(64))                                               # after-bytes gone too
    """, ASCEND_SIM_FAIL_MALLOC_NTH="1", ASCEND_SIM_FAIL_AFTER_BYTES="0")


BAD_VALUES = [
    ("ASCEND_SIM_DEVICES", "0"), ("ASCEND_SIM_DEVICES", "65"), ("ASCEND_SIM_DEVICES", "two"),
    ("ASCEND_SIM_DEVICES", "-1"), ("ASCEND_SIM_DEVICES", "3.5"),
    ("ASCEND_SIM_HBM", "lots"), ("ASCEND_SIM_HBM", "0"), ("ASCEND_SIM_HBM", "64XB"),
    ("ASCEND_SIM_HBM", "-5GiB"), ("ASCEND_SIM_HBM", "2048TiB"),
    ("ASCEND_SIM_MALLOC_LATENCY_US", "fast"), ("ASCEND_SIM_MALLOC_LATENCY_US", "-1"),
    ("ASCEND_SIM_MALLOC_LATENCY_US", "99999999999"), ("ASCEND_SIM_FREE_LATENCY_US", "1ms"),
    ("ASCEND_SIM_FAIL_MALLOC_NTH", "third"), ("ASCEND_SIM_FAIL_MALLOC_NTH", "-2"),
    ("ASCEND_SIM_FAIL_AFTER_BYTES", "1.2.3"), ("ASCEND_SIM_FAIL_AFTER_BYTES", "a lot"),
    ("ASCEND_SIM_HOST_PINNED", "all"), ("ASCEND_SIM_HOST_PINNED", "-1GiB"), ("ASCEND_SIM_HOST_PINNED", "2048TiB"),
    ("ASCEND_SIM_NODE", "../etc"), ("ASCEND_SIM_NODE", "a/b"), ("ASCEND_SIM_NODE", ".hidden"),
    ("ASCEND_SIM_NODE", "x" * 65),
    ("ASCEND_SIM_SHM_DIR", "relative/dir"), ("ASCEND_SIM_SHM_DIR", "/nonexistent/ascendsim"),
]


def test_bad_environment_values_fail_aclinit_naming_the_variable(sim_node):
    sim_node.run(f"""
        good = dict(os.environ)
        for var, value in {BAD_VALUES!r}:
            os.environ.clear(); os.environ.update(good); os.environ[var] = value
            rc = code("aclInit", None)
            msg = errmsg()
            assert rc == 100000, (var, value, rc, msg)
            assert var in msg and value in msg, (var, value, msg)
            if var == "ASCEND_SIM_DEVICES":
                assert code("aclrtGetDeviceCount", C.byref(C.c_uint32())) == 100000
        os.environ.clear(); os.environ.update(good)
        init()                                   # the good environment still works
        n = C.c_uint32(); ok("aclrtGetDeviceCount", C.byref(n)); assert n.value == 2
        assert os.listdir(os.environ["ASCEND_SIM_SHM_DIR"]) != []
    """)


def test_control_calls_need_a_runtime_and_configure_needs_none(sim_node):
    sim_node.run("""
        n = C.c_uint32()
        ok("aclrtGetDeviceCount", C.byref(n)); assert n.value == 2     # works before aclInit
        for call in (lambda: sim.set_faults(fail_malloc_nth=1), sim.reset_faults,
                     lambda: sim.stats(0), lambda: sim.read(0x1000, 1),
                     lambda: sim.launch_fill(None, 0x1000, 1, 1), lambda: sim.set_poison(True)):
            try:
                call()
            except sim.SimError as e:
                assert e.code == 100001 and "aclInit" in str(e), e
            else:
                raise AssertionError("worked before aclInit")
        for bad in (dict(devices=65), dict(devices=-1), dict(hbm="garbage")):
            try:
                sim.configure(**bad)
            except (sim.SimError, ValueError):
                pass
            else:
                raise AssertionError(bad)
        sim.configure(devices=4, hbm="3MiB")
        ok("aclrtGetDeviceCount", C.byref(n)); assert n.value == 4
        init(3)
        assert meminfo() == (3 << 20, 3 << 20)
        st = sim.stats(3)
        assert st["total_bytes"] == 3 << 20 and st["node_bytes_used"] == 0, st
    """)



def test_control_calls_name_a_bad_argument(sim_node):
    """The simulator's Python control calls check their integers before ctypes sees them: ctypes'
    own error names an argument by position only ("argument 1: TypeError: wrong type"), and an
    int too wide for the C parameter would wrap."""
    out = sim_node.run_json("""
        from ascend_pool import sim
        init()
        calls = {"device": lambda: sim.stats(None), "device ": lambda: sim.stats(2 ** 40),
                 "ptr": lambda: sim.read(1.5, 8), "nbytes": lambda: sim.read(4096, -1),
                 "stream": lambda: sim.hang_stream("x"), "stream ": lambda: sim.release_stream(object()),
                 "fill value": lambda: sim.launch_fill(None, 4096, 8, True),
                 "delay_s": lambda: sim.launch_fill(None, 4096, 8, 1, delay_s="1")}
        said = {}
        for what, call in calls.items():
            try:
                call()
                said[what] = "accepted"
            except ValueError as e:
                said[what] = what.strip() in str(e)
            except Exception as e:
                said[what] = type(e).__name__
        print(json.dumps({"said": said, "total": sim.stats(0)["total_bytes"]}))
    """)
    assert all(v is True for v in out["said"].values()), out["said"]
    assert out["total"] > 0


def test_every_simulator_failure_is_a_pool_error(sim_node):
    """CONTRACT.md: ap.PoolError is the base of the package's errors, ascend_pool.sim included:
    a runtime refusal is a SimError (a PoolError) with the ACL code, a bad argument a
    SimArgumentError (also a ValueError, code 100000), a wrong type a SimTypeError (also a
    TypeError). Before: SimError derived from Exception alone and bad arguments were bare
    ValueError/TypeError."""
    sim_node.run("""
        import ascend_pool as ap
        assert issubclass(sim.SimError, ap.PoolError)
        pool = ap.Pool(0)
        ptr = pool.malloc(4096)
        refusals = {
            lambda: sim.read(0x1000, 16): (107000, None),
            lambda: sim.launch_fill(12345, ptr, 16, 1): (107000, None),
            lambda: sim.stats(9): (200002, None),
            lambda: sim.launch_fill(None, ptr, 16, 256): (100000, ValueError),
            lambda: sim.launch_fill(None, ptr, 16, 1, delay_s=-1): (100000, ValueError),
            lambda: sim.read(ptr, -1): (100000, ValueError),
            lambda: sim.set_faults(fail_malloc_nth=-1): (100000, ValueError),
            lambda: sim.parse_size(True): (100000, TypeError),
        }
        for call, (rc, builtin) in refusals.items():
            try:
                call()
                raise AssertionError("accepted")
            except ap.PoolError as e:
                assert isinstance(e, sim.SimError) and e.code == rc, (e, e.code)
                assert builtin is None or isinstance(e, builtin), e
        pool.free(ptr)
        pool.free(pool.malloc(100))   # still serving
    """)


def test_a_simulator_error_survives_pickling():
    # multiprocessing pickles a worker's exception: SimError(code, message) kept only its message
    # and unpickling raised TypeError (missing 'message'), as DeviceError did before its __reduce__
    import pickle
    from ascend_pool.sim import SimArgumentError, SimError, SimTypeError
    for e in (SimError(207001, "out of memory"), SimArgumentError("delay_s=-1"), SimTypeError("a bool")):
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and back.code == e.code and str(back) == str(e)

"""Device discipline (issue 15 point 4, issue 17 device references): the pool lives in a
framework's process, whose threads switch devices themselves (torch_npu calls aclrtSetDevice).

A pool never changes the calling thread's current device, never trusts a cached one, puts its
memory on its own device whatever the thread's device is, holds one device reference (CANN counts
aclrtSetDevice/aclrtResetDevice per process) from creation to close, and refuses another device's
stream. The "framework" here calls the simulator's ACL entry points through ctypes, on the same
runtime the pool loaded, as torch_npu would on the real one.
"""
import ctypes as C
import os
import sys
import threading

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401

import ascend_pool as ap  # noqa: E402
from ascend_pool import sim  # noqa: E402
from ascend_pool.errors import InvalidStreamError  # noqa: E402

MiB = 1 << 20


@pytest.fixture
def acl():
    """The runtime the pools use, opened for the framework's own calls (ctypes)."""
    ap.Pool(0, backend="sim").close()  # make sure the runtime is initialised
    lib = sim.attach()
    lib.aclrtGetDevice.argtypes = [C.POINTER(C.c_int32)]
    if sim.stats(0)["total_bytes"] and ap.Pool(0, backend="sim").backend.device_count < 2:
        pytest.skip(reason="needs two simulated devices")
    return lib


def current_device(lib):
    dev = C.c_int32(-1)
    rc = lib.aclrtGetDevice(C.byref(dev))
    return dev.value if rc == 0 else None


def on_framework_thread(fn):
    """Runs fn on a fresh thread (its own current device, as a framework's worker has) and
    re-raises what it raised."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


def test_pool_keeps_the_frameworks_device_and_allocates_on_its_own(acl):
    def framework():
        pool0 = ap.Pool(0, backend="sim")
        try:
            assert acl.aclrtSetDevice(1) == 0          # the framework works on device 1
            warm = pool0.malloc(4096)                   # first use of device 0 from this thread
            assert current_device(acl) == 1, "malloc switched the caller's device"
            assert acl.aclrtSetDevice(1) == 0          # the framework switches again (no-op here)
            held = [sim.stats(0)["bytes_held"], sim.stats(1)["bytes_held"]]
            big = pool0.malloc(64 * MiB)
            assert sim.stats(1)["bytes_held"] == held[1], "a device-0 pool took device-1 memory"
            assert sim.stats(0)["bytes_held"] >= held[0] + 64 * MiB
            assert current_device(acl) == 1
            pool0.free(big)
            pool0.free(warm)
            pool0.empty_cache()
            assert current_device(acl) == 1, "empty_cache left the thread on the pool's device"
            assert sim.stats(0)["bytes_held"] < held[0] + 64 * MiB
            s = pool0.create_stream()
            p = pool0.malloc(MiB, stream=s)
            pool0.free(p, stream=s)
            pool0.synchronize(s)
            pool0.destroy_stream(s)
            assert current_device(acl) == 1, "stream calls left the thread on the pool's device"
        finally:
            pool0.close()
            assert current_device(acl) == 1
            assert acl.aclrtResetDevice(1) == 0

    on_framework_thread(framework)


def test_switch_behind_the_pools_back(acl):
    # The backend used to remember "this thread is on device 0" after its own aclrtSetDevice(0):
    # a framework switching to device 1 afterwards made the device-0 pool allocate on device 1.
    def framework():
        pool0 = ap.Pool(0, backend="sim")
        try:
            assert acl.aclrtSetDevice(0) == 0
            pool0.free(pool0.malloc(30 * MiB))
            pool0.empty_cache()
            assert acl.aclrtSetDevice(1) == 0
            held1 = sim.stats(1)["bytes_held"]
            p = pool0.malloc(64 * MiB)
            assert sim.stats(1)["bytes_held"] == held1
            pool0.free(p)
            assert current_device(acl) == 1
        finally:
            pool0.close()
            assert acl.aclrtResetDevice(1) == 0
            assert acl.aclrtResetDevice(0) == 0

    on_framework_thread(framework)


def test_device_reference_count_returns_after_close(acl):
    before = [sim.stats(d)["device_refs"] for d in (0, 1)]
    pools = [ap.Pool(0, backend="sim"), ap.Pool(0, backend="sim"), ap.Pool(1, backend="sim")]
    assert [sim.stats(d)["device_refs"] for d in (0, 1)] == [before[0] + 2, before[1] + 1]
    for p in pools:
        p.free(p.malloc(MiB))
    for p in pools:
        p.close()
    assert [sim.stats(d)["device_refs"] for d in (0, 1)] == before


def test_reset_device_pairs_with_set_device(acl):
    # The simulator counts references as CANN documents: a reset without a set is refused.
    def thread():
        before = sim.stats(1)["device_refs"]
        assert acl.aclrtSetDevice(1) == 0
        assert sim.stats(1)["device_refs"] == before + 1
        assert acl.aclrtResetDevice(1) == 0
        assert sim.stats(1)["device_refs"] == before
        if before == 0:
            assert acl.aclrtResetDevice(1) == 107000

    on_framework_thread(thread)


def test_stream_of_another_device_is_refused(acl):
    pool0, pool1 = ap.Pool(0, backend="sim"), ap.Pool(1, backend="sim")
    try:
        s0 = pool0.create_stream()
        with pytest.raises(InvalidStreamError, match="device 0"):
            pool1.register_stream(s0)
        assert pool0.backend.stream_device(s0) == 0

        def foreign():  # a stream the framework created itself on device 0
            acl.aclrtCreateStream.argtypes = [C.POINTER(C.c_void_p)]
            acl.aclrtDestroyStream.argtypes = [C.c_void_p]
            assert acl.aclrtSetDevice(0) == 0
            h = C.c_void_p()
            assert acl.aclrtCreateStream(C.byref(h)) == 0
            try:
                with pytest.raises(InvalidStreamError):
                    pool1.register_stream(h.value)
                pool0.register_stream(h.value)  # its own device: fine
                pool0.free(pool0.malloc(MiB, stream=h.value), stream=h.value)
                pool0.synchronize(h.value)
                pool0.destroy_stream(h.value)
            finally:
                assert acl.aclrtResetDevice(0) == 0

        on_framework_thread(foreign)
        pool0.destroy_stream(s0)
    finally:
        pool0.close()
        pool1.close()


def test_c_abi_refuses_a_stream_of_another_device(acl):
    """ascend_pool_malloc(size, device 1, a device-0 stream): NULL and last error 5 (invalid stream),
    nothing allocated; ascend_pool_free of a device-1 block given a device-0 stream (a peer's kernel
    used it last, as ascend_pool.h tells the caller to name) frees it after that stream's work,
    with no error (it was error 5 and an immediate free before 695914f)."""
    lib = C.CDLL(ap.library_path())
    lib.ascend_pool_malloc.restype = C.c_void_p
    lib.ascend_pool_malloc.argtypes = [C.c_ssize_t, C.c_int, C.c_void_p]
    lib.ascend_pool_free.argtypes = [C.c_void_p, C.c_ssize_t, C.c_int, C.c_void_p]
    lib.ascend_pool_last_error.restype = C.c_char_p
    pool0 = ap.Pool(0, backend="sim")
    try:
        s0 = pool0.create_stream()
        lib.ascend_pool_clear_last_error()
        assert lib.ascend_pool_malloc(4096, 1, C.c_void_p(s0)) is None
        assert lib.ascend_pool_last_error_code() == 5, lib.ascend_pool_last_error()
        assert b"another device" in lib.ascend_pool_last_error()
        ptr = lib.ascend_pool_malloc(4096, 1, None)
        assert ptr
        lib.ascend_pool_clear_last_error()
        lib.ascend_pool_free(C.c_void_p(ptr), 4096, 1, C.c_void_p(s0))
        assert lib.ascend_pool_last_error_code() == 0, lib.ascend_pool_last_error()
        assert lib.ascend_pool_malloc(4096, 1, None) == ptr  # s0 is idle: freed at once
        lib.ascend_pool_free(C.c_void_p(ptr), 4096, 1, None)
        pool0.destroy_stream(s0)
    finally:
        pool0.close()


def test_reading_stats_from_a_thread_without_a_device_leaves_it_without_one(acl):
    # A monitoring thread that never chose a device reads a pool's figures (torch.npu.memory_stats(1)
    # under the torch_npu integration). The device query ran in that thread, which ACL cannot
    # unbind again: it came back on device 1, and torch_npu, which takes a thread's device from the
    # runtime when it has none of its own, put that thread's next tensor on npu:1.
    pool = ap.Pool(1, backend="sim")
    try:
        seen = on_framework_thread(lambda: (current_device(acl), pool.memory_stats(), current_device(acl)))
        before, stats, after = seen
        assert (before, after) == (None, None), f"the thread was on device {before}, then {after}"
        assert stats["device_total_bytes"] > 0 and 0 < stats["device_free_bytes"] <= stats["device_total_bytes"]
    finally:
        pool.close()


def test_a_device_being_released_stalls_no_other_devices_pools(sim_node):
    # The last aclrtResetDevice waits for the work queued in the device's default context
    # (CANN). The backend held one lock for every device's references across it: opening a pool
    # on device 0 waited for device 1's reset (and so for device 1's queued work).
    out = sim_node.run_json("""
        import threading, time
        import ascend_pool as ap
        from ascend_pool import sim
        p1 = ap.Pool(1, backend="sim")
        be = p1.backend
        acl = C.CDLL(sim.library_path())
        made = []

        def framework_thread():
            # A framework's stream in device 1's default context, holding no device reference
            # of its own (its thread entered the context with aclrtSetCurrentContext).
            ctx, s = C.c_void_p(), C.c_void_p()
            assert acl.aclrtSetDevice(1) == 0 and acl.aclrtGetCurrentContext(C.byref(ctx)) == 0
            assert acl.aclrtResetDevice(1) == 0                  # the pool's reference remains
            assert acl.aclrtSetCurrentContext(ctx) == 0
            assert acl.aclrtCreateStream(C.byref(s)) == 0
            made.append(s.value)

        t = threading.Thread(target=framework_thread)
        t.start()
        t.join()
        s = made[0]
        buf = be.malloc(1, 2 << 20)
        sim.launch_fill(s, buf, 2 << 20, 0x5A, delay_s=6.0)
        closer = threading.Thread(target=p1.close)   # the last reference: the reset waits ~6 s
        t0 = time.monotonic()
        closer.start()
        time.sleep(0.2)
        t1 = time.monotonic()
        p0 = ap.Pool(0, backend="sim")               # device 0's reference meanwhile
        open0 = time.monotonic() - t1
        closer.join()
        closed1 = time.monotonic() - t0
        p0.close()
        be.free(1, buf)
        print(json.dumps({"open0": open0, "closed1": closed1}))
    """, ASCEND_SIM_DEVICES="2")
    assert out["closed1"] >= 5.7, out   # the reset did wait for device 1's work
    assert out["open0"] < 3.0, out   # before: behind the whole reset (~5.8 s); room for load


def test_a_stream_made_outside_any_pool_lives_until_it_is_destroyed(sim_node):
    # The last aclrtResetDevice destroys the default context's streams (CANN): a stream the
    # backend made with a reference for that call only (replay's direct mode, no pool open) was
    # dead when it was returned ("is not a live stream"). Each stream holds a reference of its own.
    out = sim_node.run_json("""
        from ascend_pool import sim
        from ascend_pool.backend import open_backend
        be = open_backend("sim")
        s = be.stream_create(0)
        refs_with_stream = sim.stats(0)["device_refs"]
        be.stream_sync(s, 1000)
        be.stream_destroy(s)
        print(json.dumps({"refs_with_stream": refs_with_stream, "refs_after": sim.stats(0)["device_refs"]}))
    """)
    assert out == {"refs_with_stream": 1, "refs_after": 0}, out


def test_closing_the_last_pool_while_its_own_stream_runs_a_long_kernel_returns(sim_node):
    # A kernel on the pool's stream touching no block of the pool (a collective on a framework
    # buffer): the pool's close reached the device's last reset, which waited for the kernel
    # (for ever, were it hung). The stream holds the device while it lives.
    out = sim_node.run_json("""
        import time
        import ascend_pool as ap
        from ascend_pool import sim
        pool = ap.Pool(0, backend="sim", sync_timeout_ms=300)
        s = pool.create_stream()
        buf = pool.backend.malloc(0, 2 << 20)
        sim.launch_fill(s, buf, 2 << 20, 0x5A, delay_s=3.0)
        sim.hang_stream(s)
        t0 = time.monotonic()
        pool.close()
        took = time.monotonic() - t0
        sim.release_stream(s)
        print(json.dumps({"took": took}))
    """)
    assert out["took"] < 10, out   # before: for ever (the hung kernel); room for load


def test_empty_cache_without_a_device_opens_no_device_the_process_never_used(sim_node):
    # A process on device 5 only (its ranks' device) calls ap.empty_cache() in its loop: the
    # current device's pool (ap's current device: 0, never set) was made to be emptied, a device
    # reference and, on an NPU, a context on device 0 held until exit (every rank on NPU 0).
    # As torch.cuda.empty_cache(): the open pools are emptied, no device is initialised for it.
    out = sim_node.run_json("""
        import ascend_pool as ap
        from ascend_pool import registry, sim
        ap.free(ap.malloc(12 << 20, device=5), device=5)    # a segment of its own, now idle
        held = ap.memory_reserved(5)
        ap.empty_cache()
        print(json.dumps({"emptied_5": held - ap.memory_reserved(5) >= 12 << 20,
                          "pool_0": registry.default_pool(0) is not None, "refs_0": sim.stats(0)["device_refs"]}))
    """, ASCEND_SIM_DEVICES="8")
    assert out == {"emptied_5": True, "pool_0": False, "refs_0": 0}, out


def test_a_module_level_free_of_another_devices_block_opens_no_pool_on_the_current_device(sim_node):
    # ap.free(ptr) with no device finds the block's own pool (the current device changed since
    # the allocation); a thread that never set ap's current device (0) opened device 0's pool
    # first, to look there: a device reference (a context on an NPU) the process never needed.
    out = sim_node.run_json("""
        import ascend_pool as ap
        from ascend_pool import registry, sim
        s = ap.create_stream(device=5)
        a = ap.malloc(1 << 20, device=5)
        b = ap.malloc(1 << 20, device=5, stream=s)
        ap.free(a)
        ap.free(b, stream=s)
        out = {"allocated_5": ap.memory_allocated(5), "pool_0": registry.default_pool(0) is not None,
               "refs_0": sim.stats(0)["device_refs"]}
        try:
            ap.free(a)
        except ap.InvalidPointerError:
            out["double_free"] = "InvalidPointerError"
        print(json.dumps(out))
    """, ASCEND_SIM_DEVICES="8")
    assert out == {"allocated_5": 0, "pool_0": False, "refs_0": 0, "double_free": "InvalidPointerError"}, out


def test_a_module_level_record_stream_of_another_devices_block_marks_it_in_its_own_pool(sim_node):
    # ap.record_stream(ptr, s) with no device, as ap.free: a device-5 block used by a device-5
    # stream's kernel, from a thread whose ap current device is 0 (never set). It was refused
    # (InvalidPointerError: "not allocated by this pool (device 0)"), device 0's pool opened to
    # say so, and the block freed after it went to the next request under the kernel.
    out = sim_node.run_json("""
        import ascend_pool as ap
        from ascend_pool import registry, sim
        n = 4 << 20
        s = ap.create_stream(device=5)
        x = ap.malloc(n, device=5)
        sim.launch_fill(s, x, n, 0xAA, delay_s=0.4)
        ap.record_stream(x, s)
        ap.free(x, device=5)
        y = ap.malloc(n, device=5)
        sim.launch_fill(None, y, n, 0x33)
        ap.synchronize(s, device=5)
        ap.synchronize(device=5)
        print(json.dumps({"overwritten": sim.read(y, n) != b"\\x33" * n,
                          "pool_0": registry.default_pool(0) is not None, "refs_0": sim.stats(0)["device_refs"]}))
    """, ASCEND_SIM_DEVICES="8")
    assert out == {"overwritten": False, "pool_0": False, "refs_0": 0}, out


def test_the_pinned_pools_empty_and_reset_calls_make_no_pool(sim_node):
    # host_empty_cache() (torch_npu.npu.host_empty_cache) and the host stats resets in a process
    # that never pinned memory: each made device 0's pinned pool to empty or reset it, and with
    # it a device-0 reference (a context on an NPU the process never used), held until exit.
    out = sim_node.run_json("""
        import ascend_pool as ap
        from ascend_pool import registry, sim
        from ascend_pool.integrations import pinned
        ap.free(ap.malloc(1 << 20, device=5), device=5)
        pinned.host_empty_cache()
        pinned.reset_peak_host_memory_stats()
        pinned.reset_accumulated_host_memory_stats()
        try:
            pinned.host_empty_cache(8)
        except ap.InvalidDeviceError:
            bad = "InvalidDeviceError"
        print(json.dumps({"pinned_0": registry.open_host_pool(0) is not None, "refs_0": sim.stats(0)["device_refs"],
                          "device_8": bad}))
    """, ASCEND_SIM_DEVICES="8")
    assert out == {"pinned_0": False, "refs_0": 0, "device_8": "InvalidDeviceError"}, out


def test_module_level_synchronize_and_destroy_stream_find_the_streams_device(sim_node):
    # A stream from ap.create_stream(device=5), waited for and destroyed with no device from a
    # thread whose ap current device is 0 (never set), as a torch stream carries its device:
    # both were refused ("not a live stream of this pool (device 0)"), after device 0's pool was
    # opened to say so, and the stream's work was not waited for.
    out = sim_node.run_json("""
        import time
        import ascend_pool as ap
        from ascend_pool import registry, sim
        s = ap.create_stream(device=5)
        x = ap.malloc(1 << 20, device=5, stream=s)
        sim.launch_fill(s, x, 1 << 20, 0x5A, delay_s=0.3)
        t0 = time.monotonic()
        ap.synchronize(s)
        waited = time.monotonic() - t0
        done = sim.read(x, 1 << 20) == b"\\x5a" * (1 << 20)
        ap.free(x, stream=s, device=5)
        ap.destroy_stream(s)
        print(json.dumps({"waited": waited >= 0.25, "done": done, "pool_0": registry.default_pool(0) is not None,
                          "refs_0": sim.stats(0)["device_refs"], "refs_5": sim.stats(5)["device_refs"]}))
    """, ASCEND_SIM_DEVICES="8")
    assert out == {"waited": True, "done": True, "pool_0": False, "refs_0": 0, "refs_5": 1}, out



def test_reading_figures_of_a_device_never_used_opens_no_pool_and_answers_an_empty_pools(sim_node):
    # A monitoring loop over every device (memory_allocated(d), memory_stats(d), memory_summary(d)
    # ...) from a process on device 5 made each device's default pool to read it: a device
    # reference, on an NPU a context on every NPU from every rank. As torch's memory_stats(d):
    # the allocator's figures for a device it never served, zeros, no context. torch's
    # memory_summary reads keys directly: the key set must be an empty open pool's.
    out = sim_node.run_json("""
        import os
        import ascend_pool as ap
        from ascend_pool import api, registry, sim
        ap.malloc(1 << 20, device=5)
        mine = ap.Pool(7)                                            # a private pool of device 7
        mine.malloc(3 << 20)
        read = {
            "memory_stats": ap.memory_stats(0), "nested": ap.memory_stats_as_nested_dict(1),
            "allocated": ap.memory_allocated(2), "reserved": ap.memory_reserved(3),
            "max_allocated": ap.max_memory_allocated(4), "max_reserved": ap.max_memory_reserved(6),
            "summary": ap.memory_summary(0, abbreviated=True), "snapshot": ap.snapshot(1),
            "fraction": ap.get_per_process_memory_fraction(2), "memory_snapshot": len(ap.memory_snapshot()),
            "stats_7": ap.memory_stats(7),
        }
        ap.reset_peak_memory_stats(3)
        ap.reset_accumulated_memory_stats(4)
        ap.dump_snapshot(os.devnull, device=6)
        try:
            ap.memory_stats(99)
        except Exception as e:
            bad = type(e).__name__
        refs = {d: sim.stats(d)["device_refs"] for d in (0, 1, 2, 3, 4, 6)}
        opened = [d for d in (0, 1, 2, 3, 4, 6, 7) if registry.default_pool(d) is not None]
        empty = ap.Pool(0)                                           # what an empty open pool reports
        want = dict(empty.memory_stats(), device_free_bytes=0, device_total_bytes=0)
        a, b = mine.pool_id
        print(json.dumps({
            "refs": refs, "opened": opened,
            "stats_equal": read["memory_stats"] == want and list(read["memory_stats"]) == list(want),
            "nested_equal": read["nested"] == dict(api.nested_stats(want), reserved_bytes_by_private_pools={}),
            "scalars": [read[k] for k in ("allocated", "reserved", "max_allocated", "max_reserved")],
            "summary_rows": read["summary"].splitlines()[2:-1] == empty.memory_summary(True).splitlines()[2:-1],
            "summary_device": read["summary"].splitlines()[-1],
            "snapshot": [read["snapshot"]["segments"], len(read["snapshot"]["device_traces"]),
                         read["snapshot"]["allocator_settings"] == empty.snapshot()["allocator_settings"]],
            "fraction": read["fraction"], "memory_snapshot": read["memory_snapshot"], "bad": bad,
            "private_7": read["stats_7"][f"reserved_bytes_by_private_pools.{a}_{b}.all.current"],
            "own_7": read["stats_7"]["reserved_bytes.all.current"],
        }))
    """, ASCEND_SIM_DEVICES="8")
    assert out == {"refs": {"0": 0, "1": 0, "2": 0, "3": 0, "4": 0, "6": 0}, "opened": [],
                   "stats_equal": True, "nested_equal": True, "scalars": [0, 0, 0, 0], "summary_rows": True,
                   # not "0 B free of 0 B": the device's memory is not read without a context
                   "summary_device": "device memory: not read (no pool of this device is open)",
                   "snapshot": [[], 2, True], "fraction": 1.0, "memory_snapshot": 2, "bad": "InvalidDeviceError",
                   "private_7": 20 << 20, "own_7": 0}, out


@pytest.mark.parametrize("env, fraction", [
    (dict(ASCEND_POOL_CONF="memory_fraction:0.3"), 0.3),
    (dict(ASCEND_POOL_TENANT="frac-reader"), 1.0),
    (dict(ASCEND_POOL_TENANT="frac-reader", ASCEND_POOL_CONF="per_process_memory_fraction:0.25"), 0.25),
], ids=["knob", "tenant", "tenant-and-knob"])
def test_reading_the_memory_fraction_of_a_device_never_used_opens_nothing_with_a_knob_or_tenant(
        sim_node, tmp_path, env, fraction):
    # get_per_process_memory_fraction(d) opened device d's default pool (a device reference, a
    # context on an NPU) when a fraction knob or $ASCEND_POOL_TENANT was set: a read, as the stats
    # (a monitoring loop over the devices took one on every NPU); it answers the cap that pool
    # would open with, the same as once it is open
    out = sim_node.run_json("""
        import ascend_pool as ap
        from ascend_pool import registry, sim
        read = ap.get_per_process_memory_fraction(1)
        from ascend_pool.backend import open_backend
        open_backend()  # the runtime (no device reference) the read no longer opens, for sim.stats
        untouched = [sim.stats(1)["device_refs"], registry.default_pool(1) is None]
        ap.malloc(1 << 20, device=1)
        print(json.dumps({"read": read, "untouched": untouched, "open": ap.get_per_process_memory_fraction(1)}))
    """, ASCEND_POOL_LEDGER_DIR=str(tmp_path), **env)
    assert out == {"read": fraction, "untouched": [0, True], "open": fraction}, out


def test_a_tenants_figures_of_a_device_never_used_say_the_operators_quota(sim_node, tmp_path):
    # memory_stats(d) of a device whose default pool (the tenant's context) was never opened said
    # quota_bytes 0, no quota, for a tenant the operator's file gives 64 MiB: known without the
    # device, it is what the context opens with. A percentage needs the device's total, which is
    # not read without a context: 0 there, as before.
    conf = tmp_path / "tenants.toml"
    conf.write_text('[tenants.fixed]\nquota = "64MiB"\nwarn = 0.8\n[tenants.share]\nquota = "25%"\n')
    code = """
        import ascend_pool as ap
        from ascend_pool import registry
        keys = ("quota_bytes", "quota_warn")
        read = [ap.memory_stats(1)[k] for k in keys]
        nested = ap.memory_stats_as_nested_dict(1)["quota_bytes"]
        untouched = registry.default_pool(1) is None
        ap.malloc(1 << 20, device=1)
        print(json.dumps({"read": read, "nested": nested, "untouched": untouched,
                          "open": [ap.memory_stats(1)[k] for k in keys]}))
    """
    env = dict(ASCEND_POOL_LEDGER_DIR=str(tmp_path), ASCEND_POOL_CONFIG=str(conf))
    out = sim_node.run_json(code, ASCEND_POOL_TENANT="fixed", **env)
    assert out == {"read": [64 << 20, 0.8], "nested": 64 << 20, "untouched": True, "open": [64 << 20, 0.8]}, out
    out = sim_node.run_json(code, ASCEND_POOL_TENANT="share", **env)
    assert out["read"] == [0, 0.0] and out["untouched"] and out["open"][0] == 256 << 20, out


def test_the_pinned_pools_pin_in_a_device_the_process_already_holds(sim_node):
    # host_pool() and the numpy handler's pool pinned in device 0 always: a process on device 5
    # (ap's current device never set: 0) took a device-0 reference, on an NPU a context on a device
    # it never used, at its first pinned allocation. As torch's CachingHostAllocator: the current
    # device if the process holds it, else one it holds; an explicit device keeps its meaning.
    out = sim_node.run_json("""
        import numpy as np
        import ascend_pool as ap
        from ascend_pool import registry, sim
        from ascend_pool.integrations import numpy as ap_np, pinned
        ap.free(ap.malloc(1 << 20, device=5), device=5)
        hp = pinned.host_pool()
        hp.free(hp.malloc(4096))
        with ap_np.installed() as handler_pool:
            a = np.ones(1 << 16)
            numpy_device = handler_pool.device
            del a
        refs_0 = sim.stats(0)["device_refs"]
        ap.set_device(3)                                          # a thread now on device 3 ...
        on_3_unopened = pinned.host_pool().device                 # ... which it holds nothing on yet
        ap.free(ap.malloc(1 << 20))                               # now it does
        on_3 = pinned.host_pool().device
        print(json.dumps({"host_pool": hp.device, "numpy": numpy_device,
                          "numpy_stays": ap_np.host_pool().device, "refs_0": refs_0,
                          "on_3_unopened": on_3_unopened, "on_3": on_3, "explicit_1": pinned.host_pool(1).device,
                          "stats_device": pinned.host_memory_stats() == pinned.host_pool(3).host_memory_stats()}))
    """, ASCEND_SIM_DEVICES="8")
    assert out == {"host_pool": 5, "numpy": 5, "numpy_stays": 5, "refs_0": 0, "on_3_unopened": 5,
                   "on_3": 3, "explicit_1": 1, "stats_device": True}, out


def test_the_pinned_pool_pins_in_torch_npus_current_device_before_any_pool_opens(sim_node):
    # A rank that torch.npu.set_device(5)'d and pinned (host_pool(), the numpy handler) before its
    # first tensor pinned in ap's current device, 0: a device-0 reference, on an NPU a context on
    # a device it never used, from every rank. torch's host allocator pins in the current
    # device's context, torch_npu's (which holds one there once started); ap.set_device, where
    # the thread called it, and an explicit device keep their meaning; not started: as before.
    out = sim_node.run_json("""
        import sys, threading, types
        import ascend_pool as ap
        from ascend_pool import sim
        from ascend_pool.integrations import pinned
        npu = types.SimpleNamespace(started=False, device=5)
        npu.is_initialized = lambda: npu.started
        npu.current_device = lambda: npu.device
        sys.modules["torch_npu"] = types.SimpleNamespace(npu=npu)   # torch_npu as the process imported it
        before_start = pinned.default_device()
        npu.started = True
        hp = pinned.host_pool()
        hp.free(hp.malloc(4096))
        seen = {}
        def other():
            ap.set_device(2)                                  # this thread chose its device itself
            ap.free(ap.malloc(4096))
            seen["own"] = pinned.default_device()
        t = threading.Thread(target=other)
        t.start()
        t.join()
        print(json.dumps({"before_start": before_start, "pinned": hp.device, "refs_0": sim.stats(0)["device_refs"],
                          "own": seen["own"], "explicit": pinned.host_pool(1).device}))
    """, ASCEND_SIM_DEVICES="8")
    assert out == {"before_start": 0, "pinned": 5, "refs_0": 0, "own": 2, "explicit": 1}, out


def test_reading_the_pinned_pools_stats_makes_no_pool(sim_node):
    # pinned.host_memory_stats() (torch.cuda.host_memory_stats) and its nested form in a process
    # that never pinned on the device made its pinned pool to read it: a device reference, on an
    # NPU a context. As torch's: a new pool's figures (the same keys, each 0), nothing made.
    out = sim_node.run_json("""
        from ascend_pool import api, registry, sim
        from ascend_pool.integrations import pinned
        st, nested = pinned.host_memory_stats(3), pinned.host_memory_stats_as_nested_dict(4)
        made = [d for d in (3, 4) if registry.open_host_pool(d) is not None]
        refs = [sim.stats(d)["device_refs"] for d in (3, 4)]
        new = pinned.host_pool(3).host_memory_stats()
        print(json.dumps({"made": made, "refs": refs, "equal": st == new and list(st) == list(new),
                          "nested": nested["active_requests"]["peak"], "host_alloc_time": nested["host_alloc_time"]["avg"]}))
    """, ASCEND_SIM_DEVICES="8")
    assert out == {"made": [], "refs": [0, 0], "equal": True, "nested": 0, "host_alloc_time": 0}, out

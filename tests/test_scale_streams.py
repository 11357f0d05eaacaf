"""Framework processes at scale: a pool's table of streams full (1,023 live side streams), streams
created and destroyed by the thousand, many threads on many devices. Each limit is either absent
or a typed error; none may hand a block to a request while a stream's work still writes it."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401  (pytest fixture)

# What every child here starts with: the C ABI's library with the signatures the tests call.
CAPI = """
        import ascend_pool as ap
        from ascend_pool import sim
        VP = C.c_void_p
        lib = C.CDLL(ap.library_path())
        lib.ascend_pool_malloc.restype = VP
        lib.ascend_pool_malloc.argtypes = [C.c_ssize_t, C.c_int, VP]
        lib.ascend_pool_free.argtypes = [VP, C.c_ssize_t, C.c_int, VP]
        lib.ascend_pool_record_stream.argtypes = [VP, VP]
        lib.ascend_pool_last_error.restype = C.c_char_p
"""

# A child's start: the C ABI's default pool of device 0 orders work on the default stream and on
# 1,023 live streams of the framework's: its table of 1,023 side streams is full, every one alive.
FULL_TABLE = CAPI + """
        lib.ascend_pool_init(0)
        be = ap.default_pool(0).backend
        n = 1 << 20
        lib.ascend_pool_free(lib.ascend_pool_malloc(512, 0, None), 512, 0, None)
        live = [be.stream_create(0) for _ in range(1023)]
        for s in live:
            lib.ascend_pool_free(lib.ascend_pool_malloc(512, 0, s), 512, 0, s)
        extra = be.stream_create(0)                    # one stream more than the table holds
        assert not lib.ascend_pool_malloc(512, 0, extra)
        assert b"too many streams" in lib.ascend_pool_last_error(), lib.ascend_pool_last_error()
        def reused_under_the_kernel(free):
            # a kernel on `extra` writes x for 0.4 s; x is then freed as `free` says, and the next
            # request's owner fills what it got: the kernel must not overwrite it
            x = lib.ascend_pool_malloc(n, 0, None)
            sim.launch_fill(extra, x, n, 0xAA, delay_s=0.4)
            lib.ascend_pool_clear_last_error()
            free(x)
            code = lib.ascend_pool_last_error_code()
            y = lib.ascend_pool_malloc(n, 0, None)
            sim.launch_fill(None, y, n, 0x33)
            be.stream_sync(extra)
            be.stream_sync(0)
            bad = sim.read(y, n) != b"\\x33" * n
            lib.ascend_pool_free(y, n, 0, None)
            return {"code": code, "overwritten": bad}
"""


def test_record_stream_and_free_on_a_stream_past_the_full_table_wait_for_its_work(sim_node):
    # The C ABI's record_stream and free are void: a use refused for want of a slot was dropped
    # (error 5 set), and the block went to the next request while the stream's kernel still wrote
    # it. Such a stream is waited for with an event of its own at the free, as a peer device's.
    out = sim_node.run_json(FULL_TABLE + """
        def marked(x):
            lib.ascend_pool_record_stream(x, extra)
            lib.ascend_pool_free(x, n, 0, None)
        def freed_on_it(x):
            lib.ascend_pool_free(x, n, 0, extra)
        print(json.dumps({"record_stream": reused_under_the_kernel(marked),
                          "free": reused_under_the_kernel(freed_on_it),
                          "allocated": ap.default_pool(0).memory_stats()["allocated_bytes.all.current"]}))
    """, timeout=120)
    assert out == {"record_stream": {"code": 0, "overwritten": False},
                   "free": {"code": 0, "overwritten": False}, "allocated": 0}


def test_blocks_of_a_stream_whose_handle_went_to_another_device_serve_the_next_stream(sim_node):
    # A framework on two devices makes and destroys streams, never telling the pool, and the
    # runtime gives a destroyed device-0 stream's handle to a new device-1 stream (CANN's handles
    # are heap pointers). The blocks cached for the dead stream must serve device 0's next stream:
    # a borrow asked the handle, the runtime refused device 0's event there (107003), the pool
    # took the stream for busy, and each new stream grew the pool by a segment (5 of 5 rounds,
    # 120 MiB reserved for one 8 MiB block).
    out = sim_node.run_json("""
        import ascend_pool as ap
        MiB = 1 << 20
        p = ap.Pool(0, backend="sim")
        be = p.backend
        n = 8 * MiB
        keep = [be.stream_create(1)]               # device 1's context is made first
        grew = moved = 0
        for i in range(6):
            s = be.stream_create(0)
            p.register_stream(s)
            before = p.memory_stats()["num_device_alloc"]
            p.free(p.malloc(n, stream=s), stream=s)
            grew += i > 0 and p.memory_stats()["num_device_alloc"] > before
            be.stream_destroy(s)                   # behind the pool's back
            keep.append(be.stream_create(1))
            moved += keep[-1] == s                 # the runtime reused the handle on device 1
        st = p.memory_stats()
        p._check_invariants()
        print(json.dumps({"moved": moved, "grew": grew, "reserved_mib": st["reserved_bytes.all.current"] >> 20}))
    """, ASCEND_SIM_REUSE_STREAM_HANDLES="1")
    assert out == {"moved": 6, "grew": 0, "reserved_mib": 20}, out


def test_a_block_freed_on_the_new_stream_of_a_moved_handle_waits_for_its_work(sim_node):
    # The same move, but the pool still has the old stream's slot when a device-1 kernel on the
    # new stream writes a device-0 block and the C ABI frees it naming that stream (the one it was
    # last used on): the block lands in the old stream's slot. Finding the handle moved, the pool
    # must not hand that slot's blocks to its other streams while the new stream's work runs.
    out = sim_node.run_json(CAPI + """
        lib.ascend_pool_init(0)
        lib.ascend_pool_init(1)
        be = ap.default_pool(0).backend
        keep = be.stream_create(1)                     # device 1's context is made first
        n = 20 << 20                                   # a whole segment: nothing else serves n
        x = lib.ascend_pool_malloc(n, 0, None)         # before the move: no miss asks h after it
        h = be.stream_create(0)
        lib.ascend_pool_free(lib.ascend_pool_malloc(512, 0, h), 512, 0, h)  # device 0's slot for h
        be.stream_destroy(h)                           # behind the pool's back
        t = be.stream_create(1)                        # the runtime gives h to device 1's stream
        sim.launch_fill(t, x, n, 0xAA, delay_s=0.4)    # which writes x
        lib.ascend_pool_free(x, n, 0, t)               # lands in h's old slot
        other = be.stream_create(0)
        y = lib.ascend_pool_malloc(n, 0, other)        # a miss: settles and borrows
        sim.launch_fill(other, y, n, 0x33)
        be.stream_sync(other)
        be.stream_sync(t)
        bad = sim.read(y, n) != b"\\x33" * n
        zs = [lib.ascend_pool_malloc(n, 0, other) for _ in range(2)]  # t has run its work: x serves
        print(json.dumps({"moved": t == h, "overwritten": bad, "x_reused_once_done": x in zs}))
    """, ASCEND_SIM_REUSE_STREAM_HANDLES="1")
    assert out == {"moved": True, "overwritten": False, "x_reused_once_done": True}, out


def test_a_c_abi_free_on_another_devices_stream_waits_for_that_streams_work(sim_node):
    # ascend_pool.h tells the caller to free on the stream the block was last used on; a peer
    # device's kernel used it last. The free was done on the allocation stream at once with error
    # 5 ("belongs to another device"), and the next request got the block while the peer's kernel
    # still wrote it. It waits for that stream's work, as record_stream with a peer's stream.
    out = sim_node.run_json(CAPI + """
        lib.ascend_pool_init(0)
        lib.ascend_pool_init(1)
        peer = ap.default_pool(1).create_stream()      # a stream of device 1
        n = 1 << 20
        x = lib.ascend_pool_malloc(n, 0, None)
        sim.launch_fill(peer, x, n, 0xAA, delay_s=0.4)  # the peer's kernel writes x
        lib.ascend_pool_clear_last_error()
        lib.ascend_pool_free(x, n, 0, peer)
        code = lib.ascend_pool_last_error_code()
        y = lib.ascend_pool_malloc(n, 0, None)
        sim.launch_fill(None, y, n, 0x33)
        ap.default_pool(1).synchronize(peer)
        ap.default_pool(0).synchronize()
        bad = sim.read(y, n) != b"\\x33" * n
        lib.ascend_pool_free(y, n, 0, None)
        st = ap.default_pool(0).memory_stats()
        print(json.dumps({"code": code, "overwritten": bad, "allocated": st["allocated_bytes.all.current"]}))
    """)
    assert out == {"code": 0, "overwritten": False, "allocated": 0}, out


def test_a_pool_told_a_handle_is_another_devices_keeps_its_blocks_until_that_streams_work_is_done(sim_node):
    # register_stream tells the pool that a handle it knew is device 1's stream now: its old stream
    # was destroyed, and the slot's blocks go to the pool's other streams. Among them is a block
    # freed naming the new stream (a device-1 kernel still writing it): handed out at once, the
    # next request's data was overwritten. It waits for that stream's queued work.
    out = sim_node.run_json(CAPI + """
        lib.ascend_pool_init(0)
        lib.ascend_pool_init(1)
        pool = ap.default_pool(0)
        be = pool.backend
        keep = be.stream_create(1)
        n = 20 << 20
        x = lib.ascend_pool_malloc(n, 0, None)
        h = be.stream_create(0)
        pool.register_stream(h)
        pool.free(pool.malloc(512, stream=h), stream=h)
        be.stream_destroy(h)                           # behind the pool's back
        t = be.stream_create(1)                        # h is device 1's stream now
        sim.launch_fill(t, x, n, 0xAA, delay_s=0.4)
        lib.ascend_pool_free(x, n, 0, t)               # lands in h's old slot
        try:
            pool.register_stream(h)
            told = "accepted"
        except ap.InvalidStreamError as e:
            told = "another device" if "belongs to device 1" in str(e) else str(e)
        y = lib.ascend_pool_malloc(n, 0, None)
        sim.launch_fill(None, y, n, 0x33)
        pool.synchronize()
        be.stream_sync(t)
        bad = sim.read(y, n) != b"\\x33" * n
        print(json.dumps({"moved": t == h, "told": told, "overwritten": bad}))
    """, ASCEND_SIM_REUSE_STREAM_HANDLES="1")
    assert out == {"moved": True, "told": "another device", "overwritten": False}, out


def test_the_default_stream_is_served_after_1023_side_streams_and_a_1024th_side_stream_is_not(sim_node):
    # A framework that ordered work on 1,023 side streams before its first use of the default
    # stream was refused the default stream ("too many streams"): it has a slot of its own.
    out = sim_node.run_json("""
        import ascend_pool as ap
        p = ap.Pool(0, backend="sim")
        streams = [p.create_stream() for _ in range(1024)]
        for s in streams[:1023]:
            p.free(p.malloc(512, stream=s), stream=s)
        out = {}
        for name, s in (("default", None), ("side_1024", streams[1023])):
            try:
                p.free(p.malloc(512, stream=s), stream=s)
                out[name] = "served"
            except ap.InvalidStreamError as e:
                out[name] = str(e)
        print(json.dumps(out))
    """, timeout=120)
    assert out == {"default": "served", "side_1024": "too many streams (limit 1023) on device 0"}


def test_destroy_stream_of_a_stream_past_the_full_table_waits_within_sync_timeout_ms(sim_node):
    # A live stream with no slot (the table of side streams full) was not waited for at all: the
    # runtime's destroy that follows then waited for its 3 s of work, past sync_timeout_ms.
    out = sim_node.run_json("""
        import time
        import ascend_pool as ap
        from ascend_pool import sim
        p = ap.Pool(0, backend="sim", sync_timeout_ms=300)
        streams = [p.create_stream() for _ in range(1024)]
        for s in streams[:1023]:
            p.free(p.malloc(512, stream=s), stream=s)
        extra = streams[1023]
        x = p.malloc(1 << 20)
        sim.launch_fill(extra, x, 1 << 20, 0xAA, delay_s=3)
        t = time.monotonic()
        try:
            p.destroy_stream(extra)
            error = None
        except ap.DeviceTimeoutError as e:
            error = type(e).__name__
        took = time.monotonic() - t
        p.backend.stream_sync(extra)
        p.destroy_stream(extra)           # its work done: destroyed, no error
        print(json.dumps({"error": error, "bounded": took < 1.5}))
    """, timeout=120)
    assert out == {"error": "DeviceTimeoutError", "bounded": True}


def test_c_abi_record_stream_finds_the_owner_among_many_pools(sim_node):
    # record_stream is not told the device: the threads' current pools are asked first (it held
    # and asked every registered pool: 1.8-2.3 us with 129 pools against 0.5 us with one, measured
    # by bench/capi_record_stream.py); a block of another device, or of a pool not current (found
    # in the registry), still waits for the stream.
    out = sim_node.run_json(CAPI + """
        for d in range(8):
            lib.ascend_pool_init(d)
        be = ap.default_pool(0).backend
        pools = [ap.Pool(d, backend="sim") for d in range(8) for _ in range(16)]
        n = 1 << 20
        def waits(device, malloc, free):
            s = be.stream_create(device)
            x = malloc()
            sim.launch_fill(s, x, n, 0xAA, delay_s=0.4)
            lib.ascend_pool_record_stream(x, s)
            free(x)
            y = malloc()
            sim.launch_fill(None, y, n, 0x33)
            be.stream_sync(s)
            bad = sim.read(y, n) != b"\\x33" * n
            free(y)
            return bad
        out = {"overwritten": [
            waits(5, lambda: lib.ascend_pool_malloc(n, 5, None), lambda x: lib.ascend_pool_free(x, n, 5, None)),
            waits(0, lambda: pools[3].malloc(n), pools[3].free),
            waits(7, lambda: pools[120].malloc(n), pools[120].free)],
            "code": lib.ascend_pool_last_error_code()}
        print(json.dumps(out))
    """, timeout=120, ASCEND_SIM_DEVICES="8")
    assert out == {"overwritten": [False, False, False], "code": 0}


def test_a_c_abi_free_on_a_stream_of_an_unreachable_context_waits_for_its_work(sim_node):
    # A stream of an application's own context, never used with the pool from a thread in it, is
    # out of reach of another thread (107003; ACL cannot tell a stream's context): the C ABI's
    # free on it from there freed the block on its allocation stream with error 5, and the next
    # request got it while the stream's kernel still wrote it. It now waits in that stream's
    # slot; empty_cache (a stream sync, which needs no context) gives it back once that work is
    # done, never under it. record_stream from a thread in the context, then a free on the
    # allocation stream elsewhere, waits too (as before).
    out = sim_node.run_json(CAPI + """
        lib.ascend_pool_init(0)
        n = 1 << 20
        def case(record_first):
            st = {}
            def app():
                ok("aclrtSetDevice", 0)
                ctx = C.c_void_p(); ok("aclrtCreateContext", C.byref(ctx), 0)
                y = C.c_void_p(); ok("aclrtCreateStream", C.byref(y))
                st["y"], st["x"] = y.value, lib.ascend_pool_malloc(n, 0, None)
                sim.launch_fill(y.value, st["x"], n, 0xAA, delay_s=0.4)
                if record_first:
                    lib.ascend_pool_record_stream(st["x"], y.value)
            t = threading.Thread(target=app); t.start(); t.join()
            ok("aclrtSetDevice", 0)
            lib.ascend_pool_clear_last_error()
            lib.ascend_pool_free(st["x"], n, 0, None if record_first else st["y"])
            code = lib.ascend_pool_last_error_code()
            q = lib.ascend_pool_malloc(n, 0, None)
            sim.launch_fill(None, q, n, 0x33)
            ok("aclrtSynchronizeStream", None)
            time.sleep(0.6)                                  # y's kernel done
            bad = sim.read(q, n) != b"\\x33" * n
            lib.ascend_pool_free(q, n, 0, None)
            return {"code": code, "overwritten": bad}
        out = {"free_on_y": case(False), "record_stream_first": case(True)}
        st = {}
        def app():                                           # the block freed on y, under its kernel
            ok("aclrtSetDevice", 0)
            ctx = C.c_void_p(); ok("aclrtCreateContext", C.byref(ctx), 0)
            y = C.c_void_p(); ok("aclrtCreateStream", C.byref(y))
            st["y"], st["x"] = y.value, lib.ascend_pool_malloc(24 * n, 0, None)
            sim.launch_fill(y.value, st["x"], 24 * n, 0xAA, delay_s=0.4)
        t = threading.Thread(target=app); t.start(); t.join()
        ok("aclrtSetDevice", 0)
        lib.ascend_pool_free(st["x"], 24 * n, 0, st["y"])
        ap.default_pool(0).empty_cache()                     # waits for y: its memory goes back after
        time.sleep(0.6)
        out["dropped"] = sim.stats(0)["dropped_fills"]
        out["reserved"] = ap.default_pool(0).memory_stats()["reserved_bytes.all.current"]
        print(json.dumps(out))
    """, timeout=60)
    assert out == {"free_on_y": {"code": 0, "overwritten": False},
                   "record_stream_first": {"code": 0, "overwritten": False}, "dropped": 0, "reserved": 0}

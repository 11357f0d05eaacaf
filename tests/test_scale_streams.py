"""Framework processes at scale: a pool's table of streams full (1,023 live streams), streams
created and destroyed by the thousand, many threads on many devices. Each limit is either absent
or a typed error; none may hand a block to a request while a stream's work still writes it."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401  (pytest fixture)

# A child's start: the C ABI's default pool of device 0 orders work on the default stream and on
# 1,022 live streams of the framework's: its table of 1,023 streams is full, every one alive.
FULL_TABLE = """
        import ascend_pool as ap
        from ascend_pool import sim
        VP = C.c_void_p
        lib = C.CDLL(ap.library_path())
        lib.ascend_pool_malloc.restype = VP
        lib.ascend_pool_malloc.argtypes = [C.c_ssize_t, C.c_int, VP]
        lib.ascend_pool_free.argtypes = [VP, C.c_ssize_t, C.c_int, VP]
        lib.ascend_pool_record_stream.argtypes = [VP, VP]
        lib.ascend_pool_last_error.restype = C.c_char_p
        lib.ascend_pool_init(0)
        be = ap.default_pool(0).backend
        n = 1 << 20
        lib.ascend_pool_free(lib.ascend_pool_malloc(512, 0, None), 512, 0, None)
        live = [be.stream_create(0) for _ in range(1022)]
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

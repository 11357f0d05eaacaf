"""The pool on a framework's threads, under CANN's context rules (docs/cann-rules.md, "Contexts
and streams"): a stream's record, wait, event reset and destroy run only in the stream's own
context, and the IPC pid list needs a current context. The simulator enforces these rules as the
runtime does (107002 without a context, 107003 with another one), so each test here fails if the
acl backend runs such a call in the wrong context. Each test runs in a child process on its own
node with two simulated devices."""
import os
import sys
import textwrap

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401  (pytest fixture)

# Run before each test's code in its child: the package, a framework's thread whose exception
# (if any) lands in res["error"], so that a refusal shows in the assertion's message, and an
# application's own context with a stream in it, on which a block can be freed under a kernel.
ON_A_THREAD = """
import ascend_pool as ap
MiB = 1 << 20
res = {}
def on_a_thread(fn):
    def run():
        try:
            fn()
        except Exception as e:
            res["error"] = f"{type(e).__name__}: {e}"
    t = threading.Thread(target=run); t.start(); t.join()
def own_context_and_stream():
    # An application thread's context of its own on device 0 and a stream in it (int handles).
    ok("aclrtSetDevice", 0)
    ctx = C.c_void_p(); ok("aclrtCreateContext", C.byref(ctx), 0)
    y = C.c_void_p(); ok("aclrtCreateStream", C.byref(y))
    return ctx.value, y.value
def freed_under_a_kernel(pool, y, n, delay_s):
    # A block of n bytes allocated on y, still written by a "kernel" queued on y, freed on y.
    pool.register_stream(y)
    p = pool.malloc(n, stream=y)
    sim.launch_fill(y, p, n, 0xAA, delay_s=delay_s)
    pool.free(p, stream=y)
    return p
"""


def run_child(node, body, **env):
    """The JSON the child printed last, after ON_A_THREAD and body (a test's indented code);
    env: variables for the child (the simulator's, say)."""
    return node.run_json(ON_A_THREAD + textwrap.dedent(body), **env)


def test_cross_stream_reuse_from_a_thread_on_another_device_reuses_its_event(sim_node):
    # A framework thread whose current device is 1 uses the device-0 pool: a block freed on
    # stream a is reused on stream b (b waits on a's event, which is then reset on b and kept).
    # Reset outside b's context fails on CANN: the event would be destroyed and a new one made
    # at every reuse, and the thread's error message left set.
    out = run_child(sim_node, """
        pool = ap.Pool(0, backend="sim")
        def framework_thread():
            ok("aclrtSetDevice", 1)
            a, b = pool.create_stream(), pool.create_stream()
            reused = 0
            for _ in range(20):
                p = pool.malloc(8 * MiB, stream=a); pool.free(p, stream=a)
                q = pool.malloc(8 * MiB, stream=b); pool.free(q, stream=b)
                reused += p == q
                p = pool.malloc(8 * MiB, stream=b); pool.free(p, stream=b)  # back to a next round
            dev = C.c_int32(); ok("aclrtGetDevice", C.byref(dev))
            res.update(reused=reused, events=pool.memory_stats()["events_created"], device=dev.value,
                       message=errmsg())
            pool.destroy_stream(a); pool.destroy_stream(b)
        on_a_thread(framework_thread)
        pool.close()
        print(json.dumps(res))
    """)
    assert out["reused"] == 20 and out["device"] == 1, out
    assert out["events"] <= 2, f"an event per reuse: its reset failed outside the stream's context ({out})"
    assert not out["message"], out


def test_a_stream_of_the_frameworks_own_context_serves_allocations(sim_node):
    # An ACL application (or an inference server) creates its own context on device 0 and a
    # stream there, and hands the pool that stream: the pool's record and wait calls on it must
    # run in that context, not in the device's default one.
    out = run_child(sim_node, """
        pool = ap.Pool(0, backend="sim")
        def app_thread():
            ok("aclrtSetDevice", 0)
            ctx = C.c_void_p(); ok("aclrtCreateContext", C.byref(ctx), 0)
            s = C.c_void_p(); ok("aclrtCreateStream", C.byref(s))
            mine = pool.create_stream()                 # the pool's own, in the default context
            pool.register_stream(s.value)
            p = pool.malloc(MiB, stream=s.value)
            sim.launch_fill(s.value, p, MiB, 0x5A, delay_s=0.02)
            pool.free(p, stream=s.value)                # records an event on s
            q = pool.malloc(MiB, stream=mine)           # reuse on another stream: waits on s's event
            pool.synchronize(mine)
            res["same_block"] = p == q
            res["bytes"] = sim.read(q, 4).hex()         # s's fill was done before mine could use it
            pool.free(q, stream=mine)
            r = pool.malloc(MiB, stream=s.value)        # and back on s: waits on mine's event
            pool.free(r, stream=s.value)
            pool.synchronize(s.value)
            cur = C.c_void_p(); ok("aclrtGetCurrentContext", C.byref(cur))
            res["context_kept"] = cur.value == ctx.value
            pool.destroy_stream(mine)
            ok("aclrtDestroyStream", s); ok("aclrtDestroyContext", ctx)
        on_a_thread(app_thread)
        pool.close()
        print(json.dumps(res))
    """)
    assert out == {"same_block": True, "bytes": "5a5a5a5a", "context_kept": True}, out


def test_allowing_importers_from_a_thread_without_a_context(sim_node):
    # A service thread (no device set) relays an importer's id: aclrtIpcMemSetImportPid needs a
    # current context, which the backend enters for the shared block's device.
    out = run_child(sim_node, """
        from ascend_pool import sharing
        pool = ap.Pool(1, backend="sim")
        ptr = sharing.share_malloc(pool, 2 << 20)
        h = sharing.share(pool, ptr)
        me = sharing.node_pid(pool.backend)
        def service_thread():
            try:
                sharing.allow(h, [me + 1])
                res["allowed"] = True
            except Exception as e:
                res["allowed"] = f"{type(e).__name__}: {e}"
        on_a_thread(service_thread)
        sharing.share_free(pool, ptr)
        pool.close()
        print(json.dumps(res))
    """)
    assert out == {"allowed": True}, out


def test_a_default_context_stream_used_from_a_thread_in_a_context_of_its_own(sim_node):
    # The other way round: a framework's stream of the device's default context, used from a
    # thread that works in a context it created on the same device. The backend first runs the
    # call in the caller's context (someone else's stream usually belongs to it), then, told the
    # stream is not in it (107003), in the device's default context.
    out = run_child(sim_node, """
        pool = ap.Pool(0, backend="sim")
        ok("aclrtSetDevice", 0)
        framework_stream = stream()                      # raw, in device 0's default context
        pool.register_stream(framework_stream)
        def app_thread():
            ctx = C.c_void_p(); ok("aclrtCreateContext", C.byref(ctx), 0)
            mine = pool.create_stream()
            p = pool.malloc(MiB, stream=framework_stream)
            pool.free(p, stream=framework_stream)
            q = pool.malloc(MiB, stream=mine)            # waits on framework_stream's event
            pool.free(q, stream=mine)
            pool.synchronize(framework_stream)
            cur = C.c_void_p(); ok("aclrtGetCurrentContext", C.byref(cur))
            res.update(same_block=p == q, context_kept=cur.value == ctx.value, message=errmsg())
            pool.destroy_stream(mine)
            ok("aclrtDestroyContext", ctx)
        on_a_thread(app_thread)
        ok("aclrtDestroyStream", framework_stream)
        pool.close()
        print(json.dumps(res))
    """)
    assert out == {"same_block": True, "context_kept": True, "message": None}, out


def test_blocks_freed_on_a_stream_of_another_context_wait_for_its_work(sim_node):
    # Thread A has a context of its own on device 0 and a stream y in it; it frees a block on y
    # while a "kernel" queued on y still writes it. The main thread, in the device's default
    # context, cannot ask y anything (107003): the pool used to take that for a destroyed stream,
    # retire y and hand its blocks out at once (or return them to the device), while the
    # kernel still ran. Now the backend asks y in the context y was last used in, and a stream
    # it cannot reach is treated as busy, never as gone.
    out = run_child(sim_node, """
        pool = ap.Pool(0, backend="sim")
        N = 24 * MiB
        st = {}
        def app_thread():
            st["p"] = freed_under_a_kernel(pool, own_context_and_stream()[1], N, 0.3)
        on_a_thread(app_thread)
        ok("aclrtSetDevice", 0)                             # the device's default context
        q = pool.malloc(N)                                  # may be p, ordered after y's kernel
        sim.launch_fill(None, q, N, 0x33)
        ok("aclrtSynchronizeStream", None)
        pool.free(q)
        t = time.monotonic()
        pool.empty_cache()                                  # must not free p under y's kernel
        took = time.monotonic() - t
        time.sleep(0.4)
        res.update(same=q == st["p"], byte=sim.read(q, 1)[0] if pool.memory_stats()["segment.all.current"] else None,
                   dropped=sim.stats(0)["dropped_fills"], took=took)
        pool.close()
        print(json.dumps(res))
    """)
    assert "error" not in out, out
    assert out["dropped"] == 0, f"a segment went back to the device under y's queued kernel: {out}"
    assert out["byte"] in (None, 0x33), f"y's kernel overwrote the block handed to another stream: {out}"


def test_a_stream_of_another_context_is_refused_by_name(sim_node):
    out = run_child(sim_node, """
        pool = ap.Pool(0, backend="sim")
        st = {}
        def app_thread():
            st["y"] = own_context_and_stream()[1]
        on_a_thread(app_thread)
        ok("aclrtSetDevice", 0)
        pool.register_stream(st["y"])
        try:
            pool.malloc(4096, stream=st["y"])
        except ap.InvalidStreamError as e:
            res["refused"] = str(e)
        pool.free(pool.malloc(4096))                        # still serving
        pool.close()
        print(json.dumps(res))
    """)
    # before: "... is not a stream the runtime knows on device 0 (destroyed, or not a stream handle)"
    assert "not in this thread's context (ACL 107003)" in out.get("refused", ""), out


def test_a_stream_out_of_reach_is_busy_not_idle(sim_node):
    # The backend remembers the contexts of the 256 foreign streams used last; y's is pushed out
    # by 300 streams of the main thread's own context, so the main thread can no longer ask y
    # anything (107003). y's blocks must then wait, not go to another stream: "out of reach" was
    # read as idle when the pool settled y's blocks, and y's queued kernel overwrote them.
    out = run_child(sim_node, """
        pool = ap.Pool(0, backend="sim")
        N = 24 * MiB
        st = {}
        def app_thread():
            st["p"] = freed_under_a_kernel(pool, own_context_and_stream()[1], N, 0.5)
        on_a_thread(app_thread)
        ok("aclrtSetDevice", 0)
        for _ in range(300):                          # streams of the default context, learned
            s = C.c_void_p(); ok("aclrtCreateStream", C.byref(s))
            pool.register_stream(s.value)
            pool.free(pool.malloc(4096, stream=s.value), stream=s.value)
        q = pool.malloc(N)
        sim.launch_fill(None, q, N, 0x33)
        ok("aclrtSynchronizeStream", None)
        time.sleep(0.6)
        res.update(same=q == st["p"], byte=sim.read(q, 1)[0], dropped=sim.stats(0)["dropped_fills"])
        pool.free(q)
        pool.close()
        print(json.dumps(res))
    """)
    assert "error" not in out, out
    assert out["byte"] == 0x33 and out["dropped"] == 0, out


def test_a_thread_without_a_context_is_not_left_in_another_threads_context(sim_node):
    # The backend runs calls on a learned stream in that stream's context; a thread that had no
    # context before such a call ends in the device's default context (as after any call of the
    # pool), never in the application thread's own context (which that thread may destroy).
    out = run_child(sim_node, """
        pool = ap.Pool(0, backend="sim")
        st = {}
        def app_thread():
            ctx, y = own_context_and_stream()
            pool.register_stream(y)
            st.update(p=pool.malloc(4096, stream=y), y=y, ctx=ctx)  # y's context is learned here
        on_a_thread(app_thread)
        def bare_thread():                            # never set a device: no context
            pool.synchronize(st["y"])                 # a call on y, made in y's context
            cur = C.c_void_p(); lib.aclrtGetCurrentContext(C.byref(cur))
            res["left_in"] = "app" if cur.value == st["ctx"] else "none" if not cur.value else "default"
        on_a_thread(bare_thread)
        pool.free(st["p"], stream=st["y"])
        pool.close()
        print(json.dumps(res))
    """)
    assert out.get("left_in") == "default", out


def test_a_request_threads_context_teardown_does_not_grow_the_pool(sim_node):
    # A server runs each request on a thread with its own context and stream: allocate on the
    # stream, a kernel, a stream-ordered free, then aclrtDestroyContext (which waits for the
    # stream's work). Meanwhile the main thread allocates the same size. Before, the simulator
    # invalidated the context before draining its streams: calls on the stream answered 107003
    # during the drain, the pool could neither order after its blocks nor reuse them, and with
    # expandable segments it mapped a request's size more at every request (726 MiB after 10
    # requests of 64 MiB); now the main thread orders after the stream's work and reuses them.
    for expandable in (True, False):
        out = run_child(sim_node, f"""
            pool = ap.Pool(0, backend="sim", expandable_segments={expandable})
            n = 64 * MiB
            def request(started):
                ctx, y = own_context_and_stream()
                freed_under_a_kernel(pool, y, n, 0.2)
                started.set()
                ok("aclrtDestroyContext", C.c_void_p(ctx))   # the stream goes with it
            for _ in range(6):
                started = threading.Event()
                t = threading.Thread(target=request, args=(started,))
                t.start()
                started.wait()
                time.sleep(0.05)                             # the context is being torn down
                pool.free(pool.malloc(n))
                t.join()
            st = pool.memory_stats()
            print(json.dumps({{"reserved": st["reserved_bytes.all.current"], "peak": st["allocated_bytes.all.peak"]}}))
        """)
        assert out["peak"] <= 2 * 64 << 20 and out["reserved"] <= 2 * out["peak"], (expandable, out)


def test_a_handle_the_backend_made_and_the_runtime_gave_to_another_contexts_stream(sim_node):
    # pool.create_stream() makes a stream in the device's default context; the framework
    # destroys it with the runtime directly, and the runtime gives its handle to a stream a
    # framework thread creates in a context of its own (CANN's handles are heap pointers). The
    # backend's note of the stream it made must not send that stream's calls to the default
    # context for good (before: every allocation on it refused, "not in this thread's context").
    out = run_child(sim_node, """
        pool = ap.Pool(0, backend="sim")
        s1 = pool.create_stream()
        ok("aclrtSetDevice", 0)
        ok("aclrtDestroyStream", C.c_void_p(s1))        # behind the pool's back
        got = {}
        def framework():
            ctx, s2 = own_context_and_stream()
            got["reused"] = s2 == s1
            abi = C.CDLL(ap.library_path())
            abi.ascend_pool_malloc.restype = C.c_void_p
            abi.ascend_pool_malloc.argtypes = [C.c_ssize_t, C.c_int, C.c_void_p]
            abi.ascend_pool_free.argtypes = [C.c_void_p, C.c_ssize_t, C.c_int, C.c_void_p]
            abi.ascend_pool_last_error.restype = C.c_char_p
            served = 0
            for _ in range(3):
                p = abi.ascend_pool_malloc(MiB, 0, C.c_void_p(s2))
                if p:
                    served += 1
                    abi.ascend_pool_free(p, MiB, 0, C.c_void_p(s2))
                else:
                    got["error"] = abi.ascend_pool_last_error().decode()
            got["served"] = served
            ok("aclrtDestroyContext", C.c_void_p(ctx))
        on_a_thread(framework)
        print(json.dumps({**got, **res}))
    """, ASCEND_SIM_REUSE_STREAM_HANDLES="1")
    assert out.get("reused") is True and out.get("served") == 3, out

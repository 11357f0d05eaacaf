"""Closing a pool or tenant context that is current somewhere leaves nothing dangling behind the
C ABI: a thread whose current context was closed (nested `with`, another thread, a new context
opened since at the same place in memory) gets a clear last error (NOT_READY, "closed") from
ascend_pool_malloc until it leaves the context's `with` block, then allocates from the default
pool again; frees of blocks of live pools keep working.

Each test runs in a fresh process (sim_node): a use of a freed pool is a crash (exit 139) or a
silent allocation from the wrong pool there, and fails the test instead of killing pytest.
"""
import os
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401

PRELUDE = """
import ascend_pool as ap
from ascend_pool import _core

def capi_malloc_error(nbytes=4096, device=0):
    try:
        p = _core.capi_malloc(nbytes, device)
    except ap.PoolError as e:
        return _core.capi_last_error()
    _core.capi_free(p, 0, device)
    return "allocated"
"""


def _not_a_directory(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("")
    return str(path)


def _run(sim_node, body):
    # No stats publisher: its thread may hold a dropped context for a moment, and when the
    # context becomes an orphan is part of what these tests check.
    return sim_node.run_json(PRELUDE + textwrap.dedent(body), ASCEND_POOL_STATS="0")


def test_closing_the_outer_of_two_nested_contexts(sim_node):
    out = _run(sim_node, """
        pool = ap.Pool(0, backend="sim")
        a, b = pool.context("outer"), pool.context("inner")
        with a:
            with b:
                a.close()
                p = _core.capi_malloc(4096, 0)          # b is current: it serves
                in_b = b.block_info(p) is not None
                _core.capi_free(p, 0, 0)
            # back in a's block, and a is closed
            closed_err = capi_malloc_error()
            try:
                ap.malloc(4096)
                py_err = None
            except ap.PoolError as e:
                py_err = str(e)
        p = _core.capi_malloc(4096, 0)                  # out of every block: the default pool
        default_serves = ap.default_pool(0).block_info(p) is not None
        _core.capi_free(p, 0, 0)
        b.close()
        print(json.dumps({"in_b": in_b, "closed_err": closed_err, "py_err": py_err,
                          "default_serves": default_serves}))
    """)
    assert out["in_b"] and out["default_serves"], out
    code, name, msg = out["closed_err"]
    assert name == "NOT_READY" and "outer" in msg and "closed" in msg, out
    assert "closed" in out["py_err"], out


def test_a_context_closed_while_another_thread_has_it_current(sim_node):
    """The other thread's next ascend_pool_malloc refuses (it used to use the freed pool), even
    when a new context has been opened since (its pool may sit where the closed one was)."""
    out = _run(sim_node, """
        pool = ap.Pool(0, backend="sim")
        ctx = pool.context("leaving")
        ready, go = threading.Event(), threading.Event()
        res = {}
        def worker():
            with ctx:
                p = _core.capi_malloc(4096, 0)
                res["before"] = ctx.block_info(p) is not None
                _core.capi_free(p, 0, 0)
                ready.set()
                go.wait()
                res["after_close"] = capi_malloc_error()
                _core.capi_free(kept, 0, 0)            # blocks of live pools still free from here
                res["kept_freed"] = default.block_info(kept) is None
            p = _core.capi_malloc(4096, 0)
            res["default_after"] = default.block_info(p) is not None
            _core.capi_free(p, 0, 0)
        default = ap.default_pool(0)
        kept = default.malloc(1 << 20)
        t = threading.Thread(target=worker)
        t.start()
        ready.wait()
        ctx.close()
        others = [pool.context(f"newcomer{i}") for i in range(8)]  # reuse the freed memory
        go.set()
        t.join()
        res["newcomers_untouched"] = all(c.memory_stats()["allocation.all.allocated"] == 0 for c in others)
        print(json.dumps(res))
    """)
    code, name, msg = out["after_close"]
    assert name == "NOT_READY" and "leaving" in msg and "closed" in msg, out
    assert out["before"] and out["kept_freed"] and out["default_after"] and out["newcomers_untouched"], out


def test_a_closed_default_pool_is_replaced(sim_node):
    """Closing the process default pool: the C ABI and module-level calls get a new default."""
    out = _run(sim_node, """
        first = ap.default_pool(0)
        p = _core.capi_malloc(4096, 0)
        _core.capi_free(p, 0, 0)
        first.close()
        p = _core.capi_malloc(4096, 0)
        second = ap.default_pool(0)
        res = {"new": second is not first and not second.closed,
               "serves": second.block_info(p) is not None}
        _core.capi_free(p, 0, 0)
        q = ap.malloc(4096)
        ap.free(q)
        print(json.dumps(res))
    """)
    assert out == {"new": True, "serves": True}, out


def test_a_context_dropped_while_a_framework_still_holds_its_blocks_keeps_their_memory(sim_node):
    # `with pool.context("batch"): x = torch.empty(...)` (the C ABI's malloc) drops the context
    # when the block ends: it was destroyed with x still allocated, and x's memory went to the next
    # request (torch's MemPool outlives its tensors). Kept until x is freed, then closed.
    out = _run(sim_node, """
        import gc
        from ascend_pool import sim
        from ascend_pool.tenants.ledger import open_ledger
        pool = ap.Pool(0, backend="sim")
        free0 = pool.mem_get_info()[0]
        with pool.context("batch", quota="64MiB"):
            x = _core.capi_malloc(8 << 20, 0)
        gc.collect()
        sim.launch_fill(0, x, 8 << 20, 0x5A)
        other = pool.context("next-request")         # a new tenant: must not get x's memory
        y = other.malloc(8 << 20)
        sim.launch_fill(0, y, 8 << 20, 0x33)
        pool.synchronize(None)                       # both fills done (the default stream)
        intact = sim.read(x, 8 << 20) == bytes([0x5A]) * (8 << 20)
        held = open_ledger(0, pool.backend).tenant("batch")["held_bytes"]
        _core.capi_free(x, 0, 0)                     # the framework frees its tensor
        other.free(y)
        other.close()
        reaped = ap.Pool(0, backend="sim")           # the next pool opened closes the orphan
        reaped.close()
        print(json.dumps({"intact": intact, "held_while_allocated": held,
                          "booking_back": open_ledger(0, pool.backend).tenant("batch")["held_bytes"],
                          "device_back": pool.mem_get_info()[0] == free0}))
        pool.close()
    """)
    assert out["intact"], out
    assert out["held_while_allocated"] >= 8 << 20 and out["booking_back"] == 0, out
    assert out["device_back"], out


def test_a_dropped_context_whose_freed_block_a_kernel_still_writes_waits_for_it_without_blocking(sim_node):
    # A block freed after record_stream while another stream's kernel still writes it: the
    # context dropped then (and an orphan reaped then) was destroyed at once, waiting in the
    # caller up to sync_timeout_ms and giving the memory back under the kernel (its write
    # dropped). It stays an orphan until that work is done; nothing waits for it.
    out = _run(sim_node, """
        import gc, time
        from ascend_pool import sim
        pool = ap.Pool(0, backend="sim")
        free0 = pool.mem_get_info()[0]
        writer = pool.create_stream()
        ctx = pool.context("pending")
        x = ctx.malloc(8 << 20)
        sim.launch_fill(writer, x, 8 << 20, 0x5A, delay_s=3.0)  # waiting for it costs 3 s
        ctx.record_stream(x, writer)
        ctx.free(x)
        t0 = time.monotonic()
        del ctx
        gc.collect()
        ap.empty_cache()                                 # a reap while the kernel runs: no wait
        quick = time.monotonic() - t0
        held_meanwhile = pool.mem_get_info()[0] < free0
        pool.synchronize(writer)
        dropped = sim.stats(0)["dropped_fills"]
        ap.empty_cache()                                 # its work done: closed now
        print(json.dumps({"quick_s": quick, "held_meanwhile": held_meanwhile, "dropped": dropped,
                          "back": pool.mem_get_info()[0] == free0}))
        pool.destroy_stream(writer)
        pool.close()
    """)
    assert out["quick_s"] < 2.0 and out["held_meanwhile"], out  # below the kernel's 3 s; slack for load
    assert out["dropped"] == 0 and out["back"], out


def test_an_orphan_closed_later_leaves_its_streams_as_a_drop_does(sim_node):
    # A dropped pool's dealloc leaves the streams create_stream made (a framework may use them);
    # the same pool kept as an orphan and closed later destroyed them.
    out = _run(sim_node, """
        import gc
        pool = ap.Pool(0, backend="sim")
        ctx = pool.context("streams")
        s = ctx.create_stream()
        x = ctx.malloc(1 << 20, stream=s)
        del ctx
        gc.collect()
        ap.free(x, stream=s)                            # its last block: the orphan closes
        ap.empty_cache()
        print(json.dumps({"stream_alive": code("aclrtSynchronizeStream", C.c_void_p(s)) == 0}))
        ok("aclrtDestroyStream", C.c_void_p(s))
        pool.close()
    """)
    assert out["stream_alive"], out


def test_a_pool_resurrected_by_another_finalizer_never_gives_back_what_it_allocates_since(sim_node):
    # A pool collected in a garbage cycle with nothing allocated, whose finalizer ran, then
    # resurrected by another finalizer of the cycle (a framework's wrapper keeping it), allocated
    # on; dropped again, no finalizer ran a second time (one per object) and its dealloc closed it
    # under that block: 64 MiB given back to the device while the program held the pointer. The
    # finalizer closes it: the resurrected pool refuses (PoolError), or keeps what it allocates.
    out = _run(sim_node, """
        import gc
        from ascend_pool import sim
        kept = []

        class Wrapper:
            def __del__(self):
                kept.append(self.pool)

        pool = ap.Pool(0, backend="sim", release_policy="never")
        w = Wrapper()
        w.pool, pool.wrapper = pool, w
        del pool, w
        gc.collect()
        (pool,) = kept
        try:
            x = pool.malloc(64 << 20)
        except ap.PoolError as e:
            print(json.dumps({"refused": str(e), "held": sim.stats(0)["bytes_held"]}))
            raise SystemExit(0)
        kept.clear()
        del pool
        gc.collect()
        print(json.dumps({"refused": None, "held": sim.stats(0)["bytes_held"]}))
    """)
    if out["refused"] is None:
        assert out["held"] >= 64 << 20, f"the block's memory went back to the device under the program: {out}"
    else:
        assert "closed" in out["refused"] and out["held"] == 0, out


def test_a_tenant_over_its_quota_takes_back_an_orphans_idle_cache(sim_node):
    # A dropped context kept for a framework's tensor; the tensor freed through the C ABI (no
    # reap there): its 42 MiB stayed booked in the tenant's 64 MiB quota, idle, and a 40 MiB
    # request of another context of the tenant (or another process) was refused. An orphan's
    # free gives its idle segments back at once.
    out = _run(sim_node, """
        import gc
        pool = ap.Pool(0, backend="sim")
        other = pool.context("shared-quota", quota="64MiB")
        with pool.context("shared-quota", quota="64MiB"):
            x = _core.capi_malloc(40 << 20, 0)
        gc.collect()
        _core.capi_free(x, 0, 0)                      # the framework frees its tensor
        held_idle = other.held
        try:
            y = other.malloc(40 << 20)
            got = "granted"
            other.free(y)
        except ap.QuotaExceededError as e:
            got = str(e)
        print(json.dumps({"held_idle": held_idle, "got": got}))
        other.close()
        pool.close()
    """)
    assert out["held_idle"] < 40 << 20 and out["got"] == "granted", out  # given back at the C ABI's free


@pytest.mark.parametrize("expandable", [False, True], ids=["classic", "expandable"])
@pytest.mark.parametrize("how", ["on_its_stream", "free_stream"])
def test_a_context_dropped_after_a_stream_ordered_free_keeps_the_block_for_its_kernel(sim_node, how, expandable):
    # A block freed on the stream that still writes it (torch's usual case), then its context
    # dropped: the dealloc waited in the finalizer up to sync_timeout_ms and gave the memory back
    # under the kernel. It is kept as an orphan until the stream's work is done (rev12 1).
    out = _run(sim_node, f"""
        import gc, time
        from ascend_pool import sim
        pool = ap.Pool(0, backend="sim", sync_timeout_ms=300, expandable_segments={expandable})
        writer = pool.create_stream()
        ctx = pool.context("stream-ordered")
        if "{how}" == "on_its_stream":
            x = ctx.malloc(8 << 20, stream=writer)
            sim.launch_fill(writer, x, 8 << 20, 0x5A, delay_s=3.0)
            ctx.free(x)
        else:
            x = ctx.malloc(8 << 20)
            sim.launch_fill(writer, x, 8 << 20, 0x5A, delay_s=3.0)
            ctx.free(x, stream=writer)
        t0 = time.monotonic()
        del ctx
        gc.collect()
        drop_s = time.monotonic() - t0
        deadline = time.monotonic() + 30             # the kernel finishes (beyond sync_timeout_ms)
        while True:
            try:
                pool.synchronize(writer)
                break
            except ap.DeviceTimeoutError:
                assert time.monotonic() < deadline
        ap.empty_cache()
        print(json.dumps({{"drop_s": drop_s, "dropped": sim.stats(0)["dropped_fills"],
                          "contexts": len(ap.tenants.live_contexts())}}))
        pool.destroy_stream(writer)
        pool.close()
    """)
    # a wait up to the limit gave the memory back under the kernel (dropped); one for the
    # kernel takes its 3 s: neither is load, which the bound leaves room for
    assert out["drop_s"] < 2.0 and out["dropped"] == 0, out
    assert out["contexts"] == 0, out


def test_live_contexts_leaves_out_the_orphans(sim_node):
    # tenants.live_contexts() listed a dropped context kept for its blocks: a program that took
    # it up again had it closed under it at the next reap (rev12 4).
    out = _run(sim_node, """
        import gc
        pool = ap.Pool(0, backend="sim")
        ctx = pool.context("kept")
        x = ctx.malloc(1 << 20)
        del ctx
        gc.collect()
        listed = [c.tenant for c in ap.tenants.live_contexts()]
        ap.free(x)
        print(json.dumps({"listed": listed}))
        pool.close()
    """)
    assert out["listed"] == [], out


@pytest.mark.parametrize("stats_dir", ["usable", "unusable"])
def test_an_orphan_freed_on_a_busy_stream_gives_back_its_quota_without_another_call(sim_node, tmp_path, stats_dir):
    # A context dropped after a stream-ordered free whose kernel still ran stayed an orphan, its
    # memory booked in its tenant's quota, until some later Pool(), ap.free or ap.empty_cache: a
    # process that went on through another context of the tenant was refused. The stats
    # publisher's thread reaps too, so the booking goes once the kernel is done; also when its
    # stats file cannot be made (it then only reaps).
    out = sim_node.run_json(PRELUDE + textwrap.dedent("""
        import gc, time
        from ascend_pool import sim
        pool = ap.Pool(0, backend="sim")
        writer = pool.create_stream()
        other = pool.context("reaped-in-time", quota="64MiB")
        ctx = pool.context("reaped-in-time", quota="64MiB")
        x = ctx.malloc(40 << 20, stream=writer)
        sim.launch_fill(writer, x, 40 << 20, 0x5A, delay_s=0.5)
        ctx.free(x)
        del ctx
        gc.collect()
        held_meanwhile = other.held
        time.sleep(1.5)                              # the kernel ends; no call into the pool
        held_after = other.held
        try:
            other.free(other.malloc(40 << 20))
            got = "granted"
        except ap.QuotaExceededError as e:
            got = str(e)
        print(json.dumps({"meanwhile": held_meanwhile, "after": held_after, "got": got}))
        other.close()
        pool.destroy_stream(writer)
        pool.close()
    """), ASCEND_POOL_STATS="1", ASCEND_POOL_STATS_INTERVAL="0.05",
       **({"ASCEND_POOL_STATS_DIR": _not_a_directory(tmp_path)} if stats_dir == "unusable" else {}))
    assert out["meanwhile"] >= 40 << 20, out      # the kernel still writes it
    assert out["after"] == 0 and out["got"] == "granted", out


def test_stop_publisher_ends_the_thread_that_only_reaps(sim_node, tmp_path):
    # With no stats file to publish in, the publisher's thread only reaps dropped pools;
    # stop_publisher() (and the exit hook) could not reach it.
    out = sim_node.run_json("""
        import threading, time
        import ascend_pool as ap
        from ascend_pool.service import publisher
        pool = ap.Pool(0, backend="sim")
        time.sleep(0.3)
        alive = [t for t in threading.enumerate() if t.name == "ascend-pool-stats"]
        publisher.stop_publisher()
        for t in alive:
            t.join(timeout=30)
        print(json.dumps({"threads": len(alive), "after": sum(t.is_alive() for t in alive)}))
        pool.close()
    """, ASCEND_POOL_STATS="1", ASCEND_POOL_STATS_INTERVAL="0.05", ASCEND_POOL_STATS_DIR=_not_a_directory(tmp_path))
    assert out == {"threads": 1, "after": 0}, out

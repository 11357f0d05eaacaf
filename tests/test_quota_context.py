"""Tenant contexts in one process: quotas, QuotaExceededError, trimming before refusing,
quota changes with live blocks, `with ctx:`, stats. Sizes are bytes; MiB = 1 << 20."""

import logging
import os
import sys

import pytest

import ascend_pool as ap
from ascend_pool.errors import ConfigError
from ascend_pool.tenants import Context
from ascend_pool.traces import OP_ALLOC, bundled_traces_dir, load_trace

sys.path.insert(0, os.path.dirname(__file__))
from quota_fixtures import MiB, base, large, ledger_dir  # noqa: E402,F401  (pytest fixtures)



def test_two_tenants_one_hits_its_quota_other_unaffected(base):
    a = base.context("alpha", quota="8MiB")
    b = base.context("beta", quota=8 * MiB)
    try:
        pa = [a.malloc(large(4)), a.malloc(large(4))]
        pb = b.malloc(large(4))
        b_before = b.memory_stats()
        with pytest.raises(ap.QuotaExceededError) as info:
            a.malloc(large(2))
        e = info.value
        assert isinstance(e, ap.OutOfMemoryError) and isinstance(e, MemoryError)
        assert (e.tenant, e.device, e.quota, e.held, e.requested) == ("alpha", 0, 8 * MiB, 8 * MiB, large(2))
        msg = str(e)
        for piece in ("'alpha'", "device 0", f"quota {8 * MiB} bytes", f"held {8 * MiB} bytes",
                      f"requested {large(2)} bytes"):
            assert piece in msg, (piece, msg)
        # alpha keeps working: its blocks are intact, and after a free it allocates again.
        a.free(pa.pop())
        pa.append(a.malloc(large(4)))
        assert a.held == 8 * MiB
        # beta was untouched by all this, and still has its own room.
        b_after = b.memory_stats()
        assert b_after["allocated_bytes.all.current"] == b_before["allocated_bytes.all.current"]
        assert b_after["num_quota_exceeded"] == 0
        pb2 = b.malloc(large(4))
        assert b.held == 8 * MiB
        assert a.memory_stats()["num_quota_exceeded"] == 1
        for p in pa:
            a.free(p)
        b.free(pb)
        b.free(pb2)
    finally:
        a.close()
        b.close()


def test_cached_segments_are_trimmed_before_refusing(base):
    ctx = base.context("trim", quota=10 * MiB)
    try:
        keep = ctx.malloc(large(4))
        cached = ctx.malloc(large(4))
        ctx.free(cached)  # its 4 MiB segment stays cached (release_policy=never)
        st = ctx.memory_stats()
        assert st["reserved_bytes.all.current"] == 8 * MiB and st["cached_free_bytes"] >= 4 * MiB - 1024
        frees_before = st["num_device_free"]
        # 6 MiB more would make 14 > 10: the cached 4 MiB segment is released, then 4 + 6 = 10 fits.
        big = ctx.malloc(large(6))
        st = ctx.memory_stats()
        assert st["num_device_free"] == frees_before + 1
        assert st["reserved_bytes.all.current"] == 10 * MiB
        assert ctx.held == 10 * MiB
        assert st["num_quota_exceeded"] == 0
        ctx.free(big)
        # When even a trimmed cache is not enough, the cache is still given back, then it refuses.
        with pytest.raises(ap.QuotaExceededError) as info:
            ctx.malloc(large(8))
        assert info.value.held == 4 * MiB  # only the live block's segment remains booked
        assert ctx.memory_stats()["reserved_bytes.all.current"] == 4 * MiB
        ctx.free(keep)
    finally:
        ctx.close()


def test_quota_down_and_up_with_live_blocks(base):
    ctx = base.context("elastic", quota=16 * MiB)
    try:
        live = [ctx.malloc(large(4)) for _ in range(3)]
        spare = ctx.malloc(large(4))
        ctx.free(spare)  # cached
        allocated = ctx.memory_stats()["allocated_bytes.all.current"]
        assert ctx.held == 16 * MiB
        ctx.set_quota("6MiB")  # below what the live blocks hold
        assert ctx.quota == 6 * MiB
        st = ctx.memory_stats()
        assert st["allocated_bytes.all.current"] == allocated  # no live block freed
        assert st["reserved_bytes.all.current"] == 12 * MiB  # the cached segment was trimmed
        assert ctx.held == 12 * MiB
        for p in live:
            assert ctx.block_info(p) is not None
        with pytest.raises(ap.QuotaExceededError):
            ctx.malloc(large(2))  # growth stopped
        ctx.free(live.pop())
        ctx.empty_cache()
        with pytest.raises(ap.QuotaExceededError):
            ctx.malloc(large(2))  # 8 MiB held, still over 6
        ctx.set_quota(32 * MiB)
        live += [ctx.malloc(large(4)) for _ in range(5)]
        assert ctx.held == 28 * MiB
        assert ctx.memory_stats()["quota_bytes"] == 32 * MiB
        for p in live:
            ctx.free(p)
    finally:
        ctx.close()


def test_quota_forms(base):
    total = base.backend.mem_info(0)[1]
    import numpy
    # a numpy integer is bytes, as malloc and set_limit take it (it was refused: "expected bytes")
    for quota, expect in ((3 * MiB, 3 * MiB), (numpy.int64(3 * MiB), 3 * MiB), ("512MiB", 512 * MiB),
                          ("1.5GiB", 3 * 512 * MiB), ("25%", total // 4), ("100%", total)):
        ctx = base.context("forms", quota=quota)
        assert ctx.quota == expect, quota
        ctx.close()
    for bad, text in ((0, "zero quota"), (-1, "negative quota"), ("-3GiB", "negative quota"),
                      ("8XB", "bad unit 'XB'"), ("0%", "zero quota"), ("150%", "more than the whole device"),
                      (0.25, "percentage"), (True, "expected bytes"), ("lots", "cannot read 'lots'"),
                      (numpy.float64(3 * MiB), "expected bytes"), (numpy.int64(-1), "negative quota")):
        with pytest.raises(ConfigError) as info:
            base.context("forms", quota=bad)
        assert text in str(info.value), (bad, str(info.value))
    for name in ("bad name", "abc\n"):  # a trailing newline passed a "$"-anchored check, then the ledger refused it
        with pytest.raises(ConfigError, match="not valid"):
            base.context(name, quota=MiB)
    with pytest.raises(ConfigError, match=r"outside \(0, 1\]"):
        base.context("w", quota=MiB, warn=1.5)


def test_a_quota_below_one_segment_is_said_in_the_log(base, caplog):
    """1024 (a unit left out of "1024MiB") is a legal quota under which nothing can ever be
    allocated: every request needs at least one 2 MiB segment. Said once, at the context."""
    with caplog.at_level(logging.WARNING, logger="ascend_pool.tenants"):
        ctx = base.context("tiny", quota=1024)
        with pytest.raises(ap.QuotaExceededError):
            ctx.malloc(512)
        ctx.set_quota("2MiB")  # a segment fits: nothing said
        ctx.free(ctx.malloc(512))
        ctx.close()
    said = [r.getMessage() for r in caplog.records if "below one" in r.getMessage()]
    assert len(said) == 1 and "quota 1024 bytes is below one 2097152-byte segment" in said[0], said


def test_context_is_its_own_pool_on_the_same_device(base):
    ctx = base.context("own", quota=64 * MiB)
    try:
        assert isinstance(ctx, ap.Pool) and isinstance(ctx, Context)
        assert ctx.device == base.device and ctx.backend is base.backend
        assert ctx.knobs == base.knobs
        p = ctx.malloc(MiB)
        assert base.block_info(p) is None  # not a block of the parent pool
        assert base.memory_stats()["reserved_bytes.all.current"] == 0
        s = ctx.create_stream()
        ctx.record_stream(p, s)
        ctx.free(p, s)
        ctx.synchronize(s)
        ctx.empty_cache()
        assert ctx.memory_stats()["reserved_bytes.all.current"] == 0 and ctx.held == 0
    finally:
        ctx.close()


def test_with_ctx_routes_module_level_calls(base):
    ctx = base.context("current", quota=4 * MiB)
    try:
        with ctx:
            assert ap.default_pool(0) is ctx
            p = ap.malloc(large(4))
            assert ctx.block_info(p) is not None
            with pytest.raises(ap.QuotaExceededError) as info:
                ap.malloc(large(2))
            assert info.value.tenant == "current"
            ap.free(p)
        assert ap.default_pool(0) is not ctx
    finally:
        ctx.close()


def test_with_blocks_of_interleaved_asyncio_tasks_leave_python_and_the_c_abi_on_one_pool(base):
    # Two requests of an asyncio server (one thread) each hold `with ctx:` across an await, and
    # exit in the order they entered. A plain LIFO pop restored the wrong entry: Python then saw
    # the default pool while the C ABI (what a framework's tensors use) stayed on tenant "a",
    # and after "a" closed, ascend_pool_malloc on that thread returned NULL for good.
    import asyncio
    import ctypes

    lib = ctypes.CDLL(ap.library_path())
    lib.ascend_pool_malloc.restype = ctypes.c_void_p
    lib.ascend_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ascend_pool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    a, b = base.context("a"), base.context("b")
    outside = ap.default_pool(0)

    def c_abi_pool():
        ptr = lib.ascend_pool_malloc(MiB, 0, None)
        assert ptr, "the C ABI refused an allocation"
        owner = [q for q in ap.registry.live_pools() if q.block_info(ptr) is not None]
        lib.ascend_pool_free(ptr, MiB, 0, None)
        return owner

    async def request(ctx, first, second):
        with ctx:
            await asyncio.sleep(first)
            assert ap.default_pool(0) is ctx or ap.default_pool(0) in (a, b)
            await asyncio.sleep(second)
        assert c_abi_pool() == [ap.default_pool(0)], "Python and the C ABI disagree"

    async def main():
        await asyncio.gather(request(a, 0.01, 0.01), request(b, 0.0, 0.05))

    try:
        asyncio.run(main())
        assert ap.default_pool(0) is outside
        assert c_abi_pool() == [outside]
        a.close()
        assert c_abi_pool() == [outside], "the thread's C ABI stayed on a closed context"
    finally:
        a.close()
        b.close()


def test_a_with_block_left_from_another_task_undoes_this_threads_entry(base):
    # An ExitStack entered in a startup task and closed in a shutdown task (or a context manager
    # handed between tasks): the exit runs in another task than the enter. It must still undo
    # the thread's entry, as a plain thread-local stack did (before: ignored, the thread stayed on
    # the tenant, and on its closed pool once it closed).
    import asyncio
    import contextlib

    ctx = base.context("entered-elsewhere")
    outside = ap.default_pool(0)
    stack = contextlib.ExitStack()

    async def startup():
        stack.enter_context(ctx)

    async def shutdown():
        stack.close()

    async def main():
        await asyncio.create_task(startup())
        assert ap.default_pool(0) is ctx
        await asyncio.create_task(shutdown())

    try:
        asyncio.run(main())
        assert ap.default_pool(0) is outside
        ctx.close()
        ap.free(ap.malloc(MiB))                  # the thread is not left on the closed context
    finally:
        ctx.close()


def test_a_quota_change_skips_a_context_another_thread_closed_meanwhile(base, monkeypatch):
    # set_quota (and a tenants-file reload) trims the tenant's contexts of this process; one
    # that another thread closes while it is being trimmed (a request ending) must be skipped,
    # not fail the change half-way (the quota already stored, the other contexts untrimmed).
    from ascend_pool.tenants import context as context_module

    ctx = base.context("resized", quota=64 * MiB)
    gone = base.context("resized")
    for c in (gone, ctx):
        c.free(c.malloc(large(8)))                   # 8 MiB cached by each
    real_trim = context_module.pool_trim_to

    def closed_by_another_thread_first(pool, target):
        if pool is gone:
            gone.close()                             # the other thread wins the race
        return real_trim(pool, target)

    monkeypatch.setattr(context_module, "pool_trim_to", closed_by_another_thread_first)
    monkeypatch.setattr(context_module, "live_contexts", lambda tenant=None, device=None: [gone, ctx])
    try:
        ctx.set_quota(4 * MiB)
        assert ctx.quota == 4 * MiB and ctx.memory_stats()["reserved_bytes.all.current"] == 0
    finally:
        ctx.close()
        gone.close()


def test_stats_warn_and_close_return_the_share(base, caplog):
    ctx = base.context("watched", quota=10 * MiB, warn=0.5)
    other = base.context("watched")  # joins on the node's terms: same quota
    assert other.quota == 10 * MiB and other.warn == 0.5
    with caplog.at_level(logging.WARNING, logger="ascend_pool.tenants"):
        p1 = ctx.malloc(large(4))
        assert not caplog.records
        p2 = other.malloc(large(2))  # 6 MiB >= 5 MiB: crosses the warn level
    assert any("past its warn level 50%" in r.getMessage() for r in caplog.records)
    st = ctx.memory_stats()
    assert st["quota_bytes"] == 10 * MiB and st["quota_held_bytes"] == 6 * MiB
    assert st["quota_context_bytes"] == 4 * MiB and st["quota_warn"] == 0.5
    assert other.memory_stats()["quota_warn_events"] == 1
    other.close()  # its 2 MiB go back to the tenant
    assert ctx.held == 4 * MiB
    ctx.free(p1)
    ctx.close()
    assert "closed" in repr(ctx)
    del p2


def test_preallocated_reserve_is_booked_or_refused():
    fits = Context("prealloc", 0, "sim", quota=16 * MiB, reserve="8MiB")
    try:
        assert fits.held == 8 * MiB and fits.memory_stats()["reserved_bytes.all.current"] == 8 * MiB
        assert "tenant prealloc: quota 16.00 MiB, held 8.00 MiB node-wide" in fits.memory_summary()
    finally:
        fits.close()
    with pytest.raises(ap.QuotaExceededError) as info:
        Context("prealloc", 0, "sim", quota=4 * MiB, reserve="8MiB")
    assert (info.value.quota, info.value.held, info.value.requested) == (4 * MiB, 0, 8 * MiB)
    assert "the preallocated reserve" in str(info.value)


def _drive(ctx, trace, streams):
    """Replays trace through ctx.malloc/free as an application would; on a refusal frees what
    it holds and returns the error (else None)."""
    live = {}
    try:
        for op, slot, size, st in zip(trace.op.tolist(), trace.slot.tolist(), trace.size.tolist(),
                                      trace.stream.tolist()):
            s = streams[st] if st else None
            if op == OP_ALLOC:
                live[slot] = (ctx.malloc(size, stream=s), s)
            else:
                ptr, s0 = live.pop(slot)
                ctx.free(ptr, stream=s0)
    except ap.QuotaExceededError as e:
        return e
    finally:
        for ptr, s0 in live.values():
            ctx.free(ptr, stream=s0)
    return None


@pytest.mark.parametrize("release_policy", ["under_peak", "budgeted"])
def test_a_tenant_refused_by_its_quota_keeps_working(release_policy):
    """After a job that needs more than the tenant's quota is refused, a job that fits runs again
    (the serve --replay demo's tight tenant): the pool's growths must not leave memory in shapes
    that no trim can give back (one large segment pinned by a few live blocks)."""
    traces = {n: load_trace(bundled_traces_dir() / f"{n}.npz")
              for n in ("bert_serving_varlen_prefix", "resnet18_train_prefix")}
    base = ap.Pool(0, backend="sim", release_policy=release_policy)  # (the fixture's never releases)
    ctx = base.context("tight", quota=430 * MiB)
    streams = {}
    try:
        for t in traces.values():
            for st in set(t.stream.tolist()) - {0} - set(streams):
                streams[st] = base.create_stream()
                ctx.register_stream(streams[st])
        assert _drive(ctx, traces["bert_serving_varlen_prefix"], streams) is None  # fits alone
        for _ in range(2):
            assert isinstance(_drive(ctx, traces["resnet18_train_prefix"], streams), ap.QuotaExceededError)
            err = _drive(ctx, traces["bert_serving_varlen_prefix"], streams)
            assert err is None, f"the job that fits was refused after the one that did not: {err}"
        assert ctx.memory_stats()["allocated_bytes.all.current"] == 0
    finally:
        for s in streams.values():
            base.synchronize(s)
            base.destroy_stream(s)
        ctx.close()
        base.close()


def test_a_module_level_free_finds_the_context_that_allocated_the_block():
    # torch frees a tensor on its allocator whatever the current context is; the C ABI's free
    # finds the owning pool: ap.free under another context (or none) does too
    pool = ap.Pool(0, backend="sim")
    a, b = pool.context("free-owner-a", quota="64MiB"), pool.context("free-owner-b", quota="64MiB")
    try:
        with a:
            p = ap.malloc(1 << 20)
        with b:
            ap.free(p)  # b did not allocate it: a frees it
        assert a.memory_stats()["allocated_bytes.all.current"] == 0
        with a:
            q = ap.malloc(4096)
        ap.free(q)  # no context current: the default pool does not hold it, a does
        assert a.memory_stats()["allocation.all.current"] == 0
        with pytest.raises(ap.InvalidPointerError):
            ap.free(q)  # a double free is still one
    finally:
        a.close()
        b.close()
        pool.close()


def test_a_tenant_context_reports_its_quota_in_mem_get_info(base):
    # HAMi's limited cudaMemGetInfo reports the limit as total and the limit less what is used as
    # free; frameworks size themselves from it (a KV cache at a fraction of total). A context
    # with a quota does the same (node-wide held bytes, cached ones included); without a quota,
    # the device's figures. ap.mem_get_info() under `with ctx:` is the context's.
    dev_free, dev_total = base.mem_get_info()
    ctx = base.context("sized-by-mem-get-info", quota="256MiB")
    try:
        assert ctx.mem_get_info() == (256 * MiB, 256 * MiB)
        x = ctx.malloc(large(100))
        free, total = ctx.mem_get_info()
        assert total == 256 * MiB and free == 256 * MiB - ctx.held
        y = ctx.malloc(free - 1024)                 # what it reports free is there to take
        with ctx:
            assert ap.mem_get_info() == ctx.mem_get_info()
        assert ctx.mem_get_info()[0] < MiB
        ctx.free(y)
        ctx.free(x)
        ctx.set_quota(None)
        assert ctx.mem_get_info()[1] == dev_total
        ctx.set_quota(2 * dev_total)                # a tenants file written for a larger card
        assert ctx.mem_get_info()[1] == dev_total
    finally:
        ctx.close()


def test_a_growth_the_device_refused_leaves_no_warning_behind(base, caplog):
    # the booking that crossed the warn level went back when the device refused the segment (out
    # of device memory: serve --replay on a small device), but its warning stayed pending, and the
    # next allocation that grew the pool logged "holds 2.00 MiB node-wide, past its warn level 50%
    # of its quota 10.00 MiB" (serve's log: every replay, a tenant far below its level)
    from ascend_pool import sim

    ctx = base.context("refused", quota=10 * MiB, warn=0.5)
    try:
        sim.set_faults(fail_after_bytes=0)  # no segment to be had, whatever other pools give back
        with caplog.at_level(logging.WARNING, logger="ascend_pool.tenants"):
            try:
                with pytest.raises(ap.OutOfMemoryError):
                    ctx.malloc(large(6))  # booked 6 MiB >= 5 MiB, then refused by the device
            finally:
                sim.reset_faults()
            assert ctx.held == 0
            p = ctx.malloc(large(2))  # grows the pool, well below the level
        assert not [r.getMessage() for r in caplog.records if "warn level" in r.getMessage()]
        assert ctx.memory_stats()["quota_warn_events"] == 0
        ctx.free(p)
    finally:
        ctx.close()


def test_an_interrupt_while_a_context_logs_its_quota_conflict_gives_its_ledger_slot_back(base, monkeypatch):
    # attach_ledger opens the tenant's slot, then logs a quota conflict, then hands the slot to the
    # pool's hook: a Ctrl-C in between (the log call runs handlers) kept the slot for the process's
    # life, after its last context of the tenant closed
    from ascend_pool import _core
    first = base.context("ctrl-c", quota=64 * MiB)
    ledger = first.ledger

    def slots(ledger=ledger):
        return sum(1 for s in ledger.view()["slots"] if s["tenant"] == "ctrl-c" and s["pid"] == os.getpid())

    try:
        assert slots() == 1
        monkeypatch.setattr(_core, "_log_conflict", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            base.context("ctrl-c", quota=128 * MiB)  # disagrees: the conflict is logged
        monkeypatch.undo()
    finally:
        first.close()
    assert slots() == 0
    again = base.context("ctrl-c", quota=64 * MiB)   # the process opens contexts as before
    assert slots(again.ledger) == 1
    again.close()


def test_an_interrupt_in_a_contexts_last_opening_step_closes_it_while_its_traceback_is_kept(monkeypatch):
    # Context.__init__ closes itself on any exception after the pool opened; its last step (the
    # warning of a quota below one segment) ran outside that: a Ctrl-C there left the context open,
    # its slot and its preallocated booking held, as long as the traceback was kept (an interactive
    # session keeps the last one), though the caller never got the context
    kept = []
    with monkeypatch.context() as m:  # not undo(): the ledger directory's variable stays
        m.setattr(Context, "_say_if_nothing_fits", lambda self, q: (_ for _ in ()).throw(KeyboardInterrupt))
        try:
            Context("last-step", 0, "sim", quota=64 * MiB, reserve="8MiB")
        except KeyboardInterrupt:
            kept.append(sys.exc_info())  # as sys.last_traceback keeps it
    assert kept
    probe = Context("last-step", 0, "sim", quota=64 * MiB)
    try:
        mine = [s for s in probe.ledger.view()["slots"] if s["tenant"] == "last-step" and s["pid"] == os.getpid()]
        assert [s["held_bytes"] for s in mine] == [0]  # the probe's own slot only
        assert probe.held == 0
    finally:
        probe.close()

"""The in-process collector: figures equal memory_stats(), labels and units as CONTRACT.md names
them, counters that survive a pool's close, pools of one tenant summed, quota exported only when
set, and an exposition that an application's own registry accepts."""

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import ascend_pool as ap
from ascend_pool import registry
from ascend_pool.metrics import PoolCollector
from ascend_pool.metrics.node import node_name
from ascend_pool.metrics.schema import FIELDS

CONTRACT_NAMES = {
    "ascend_pool_reserved_bytes", "ascend_pool_allocated_bytes", "ascend_pool_requested_bytes",
    "ascend_pool_cached_free_bytes", "ascend_pool_largest_free_block_bytes", "ascend_pool_fragmentation_ratio",
    "ascend_pool_segments", "ascend_pool_pending_free_bytes", "ascend_pool_quota_bytes",
    "ascend_pool_allocations_total", "ascend_pool_device_mallocs_total", "ascend_pool_device_frees_total",
    "ascend_pool_ooms_total", "ascend_pool_quota_exceeded_total", "ascend_pool_alloc_retries_total",
    "ascend_pool_device_free_bytes", "ascend_pool_device_total_bytes",
}


def scrape(collector):
    """{(sample name, frozenset(labels)): value} and the exposition text."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    text = generate_latest(registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, f"duplicate series {key}"
            out[key] = s.value
    return out, text


def val(samples, name, **labels):
    labels.setdefault("node", node_name())  # every series carries the node (metrics.node)
    return samples[(name, frozenset({k: str(v) for k, v in labels.items()}.items()))]


def test_every_contract_name_is_exported(pool):
    pool.quota_bytes = 1 << 30  # as a tenant context with a quota has it
    pool.malloc(4096)
    samples, text = scrape(PoolCollector(pools=lambda: [pool]))
    assert {name for name, _ in samples} == CONTRACT_NAMES
    assert "# TYPE ascend_pool_ooms_total counter" in text
    assert "# TYPE ascend_pool_reserved_bytes gauge" in text


def test_figures_equal_memory_stats(pool):
    ptrs = [pool.malloc(1000) for _ in range(5)] + [pool.malloc(4 << 20) for _ in range(3)]
    pool.free(ptrs.pop(0))
    st = pool.memory_stats()
    samples, _ = scrape(PoolCollector(pools=lambda: [pool]))
    lab = dict(device=0, tenant="default")
    for kind in ("small", "large"):
        for metric, key in (("reserved_bytes", "reserved_bytes"), ("allocated_bytes", "allocated_bytes"),
                            ("requested_bytes", "requested_bytes"), ("segments", "segment")):
            assert val(samples, f"ascend_pool_{metric}", pool=kind, **lab) == st[f"{key}.{kind}_pool.current"]
        assert val(samples, "ascend_pool_allocations_total", pool=kind, **lab) == st[f"allocation.{kind}_pool.allocated"]
    assert val(samples, "ascend_pool_requested_bytes", pool="small", **lab) == 4000
    assert val(samples, "ascend_pool_requested_bytes", pool="large", **lab) == 3 * (4 << 20)
    assert val(samples, "ascend_pool_allocations_total", pool="small", **lab) == 5
    assert val(samples, "ascend_pool_device_mallocs_total", **lab) == st["num_device_alloc"]
    assert val(samples, "ascend_pool_cached_free_bytes", **lab) == st["cached_free_bytes"]
    assert val(samples, "ascend_pool_largest_free_block_bytes", **lab) == st["largest_free_block_bytes"]
    assert val(samples, "ascend_pool_fragmentation_ratio", **lab) == pytest.approx(st["external_fragmentation"])
    assert 0 <= val(samples, "ascend_pool_fragmentation_ratio", **lab) <= 1
    assert val(samples, "ascend_pool_device_total_bytes", device=0) == st["device_total_bytes"]
    assert 0 < val(samples, "ascend_pool_device_free_bytes", device=0) <= st["device_total_bytes"]
    assert ("ascend_pool_quota_bytes", frozenset({"device": "0", "tenant": "default"}.items())) not in samples


def test_failures_are_counted(pool):
    total = pool.memory_stats()["device_total_bytes"]
    pool.malloc(total // 10 * 6)
    with pytest.raises(ap.OutOfMemoryError):
        pool.malloc(total // 10 * 6)
    samples, _ = scrape(PoolCollector(pools=lambda: [pool]))
    assert val(samples, "ascend_pool_ooms_total", device=0, tenant="default") == pool.memory_stats()["num_ooms"] >= 1


def test_counters_survive_a_pool_close_and_gauges_follow_it():
    pools = [ap.Pool(0, backend="sim")]
    collector = PoolCollector(pools=lambda: [p for p in pools if not p.closed])
    for _ in range(4):
        pools[0].free(pools[0].malloc(1000))
    before, _ = scrape(collector)
    assert val(before, "ascend_pool_allocations_total", pool="small", device=0, tenant="default") == 4
    pools[0].close()
    pools.append(ap.Pool(0, backend="sim"))
    pools[1].malloc(1000)
    after, _ = scrape(collector)
    assert val(after, "ascend_pool_allocations_total", pool="small", device=0, tenant="default") == 5
    assert val(after, "ascend_pool_device_mallocs_total", device=0, tenant="default") >= 2
    assert val(after, "ascend_pool_requested_bytes", pool="small", device=0, tenant="default") == 1000
    pools[1].close()
    gone, _ = scrape(collector)
    assert val(gone, "ascend_pool_allocations_total", pool="small", device=0, tenant="default") == 5
    assert val(gone, "ascend_pool_reserved_bytes", pool="small", device=0, tenant="default") == 0


def test_a_context_dropped_in_a_reference_cycle_with_a_live_block_is_counted_once():
    # The collector clears a cycle's weak references before Pool.__del__ keeps the context as an
    # orphan (a block is still allocated): the exporter took it for a retired pool and a live one,
    # and counted its allocation twice; its close, once the block was freed, was missed.
    import gc
    base = ap.Pool(0, backend="sim")
    collector = PoolCollector()  # the registry's live pools, orphans included
    try:
        ctx = base.context("cycle-orphan")
        ctx.me = ctx  # any cycle: a traceback, a closure, an object pointing back
        x = ctx.malloc(4 << 20)
        scrape(collector)
        del ctx
        gc.collect()
        for _ in range(2):
            out, _ = scrape(collector)
            assert val(out, "ascend_pool_allocations_total", pool="large", device=0, tenant="cycle-orphan") == 1
            assert val(out, "ascend_pool_reserved_bytes", pool="large", device=0, tenant="cycle-orphan") > 0
        ap.free(x)  # its last block: the orphan is closed
        # by this free's reap, or by the one another thread (the stats thread) has under way
        registry.reap_orphans(wait=True)
        out, _ = scrape(collector)
        assert val(out, "ascend_pool_allocations_total", pool="large", device=0, tenant="cycle-orphan") == 1
        assert val(out, "ascend_pool_reserved_bytes", pool="large", device=0, tenant="cycle-orphan") == 0
    finally:
        base.close()


def test_a_pool_that_lives_between_two_scrapes_is_counted():
    # A serving process makes a tenant context per request and closes it when the request ends:
    # most never see a scrape. What they counted must reach the exported totals (before: only
    # pools read while open were counted, so a context refused over its quota and closed at
    # once left ascend_pool_quota_exceeded_total at 0 and the alert silent).
    base = ap.Pool(0, backend="sim")
    mine = set()
    collector = PoolCollector(pools=lambda: [p for p in [base, *mine] if not p.closed])
    try:
        scrape(collector)
        for _ in range(5):
            ctx = base.context("per-request", quota="4MiB")
            mine.add(ctx)
            ctx.free(ctx.malloc(1000))
            with pytest.raises(ap.QuotaExceededError):
                ctx.malloc(8 << 20)
            ctx.close()
        other = ap.Pool(0, backend="sim")        # not one of this collector's pools: not counted
        other.free(other.malloc(1000))
        other.close()
        out, _ = scrape(collector)
        assert val(out, "ascend_pool_allocations_total", pool="small", device=0, tenant="per-request") == 5
        assert val(out, "ascend_pool_quota_exceeded_total", device=0, tenant="per-request") == 5
        assert val(out, "ascend_pool_allocations_total", pool="small", device=0, tenant="default") == 0
        again, _ = scrape(collector)               # folded in once, not at every scrape
        assert val(again, "ascend_pool_quota_exceeded_total", device=0, tenant="per-request") == 5
    finally:
        base.close()


@pytest.mark.parametrize("cycle", [False, True], ids=["dropped", "dropped-in-a-cycle"])
def test_a_pool_dropped_without_close_between_two_scrapes_is_counted(cycle):
    # The usual Python way: a request's context (or a Pool) goes out of scope, nobody calls
    # close(), and its dealloc closes it. Only close() told the exporter, so what such a pool
    # counted since the last scrape was lost: its tenant's series never appeared (a loop over two
    # devices lost device 0's context at every turn), its quota refusals never reached the alert.
    import gc
    import uuid
    tenant, plain_tenant = (f"{what}-{uuid.uuid4().hex[:8]}" for what in ("dropped", "plain"))
    base = ap.Pool(0, backend="sim")
    collector = PoolCollector()
    try:
        scrape(collector)

        def request():
            ctx = base.context(tenant, quota="4MiB")
            if cycle:
                ctx.me = ctx
            for _ in range(3):
                ctx.free(ctx.malloc(1000))
            with pytest.raises(ap.QuotaExceededError):
                ctx.malloc(8 << 20)
            plain = ap.Pool(0, backend="sim")
            plain.tenant = plain_tenant  # its own label among the process's default pools
            plain.free(plain.malloc(1000))

        for _ in range(2):
            request()
        gc.collect()
        for _ in range(2):  # folded in once, not at every scrape
            out, _ = scrape(collector)
            assert val(out, "ascend_pool_allocations_total", pool="small", device=0, tenant=tenant) == 6
            assert val(out, "ascend_pool_quota_exceeded_total", device=0, tenant=tenant) == 2
            assert val(out, "ascend_pool_allocations_total", pool="small", device=0, tenant=plain_tenant) == 2
    finally:
        base.close()


def test_the_series_of_tenants_with_no_open_pool_are_bounded():
    # A service that names a tenant per job: each job's series stayed for the process's life
    # (thousands after a few hundred jobs). The most recent PoolAggregator.RETIRED_KEEP closed
    # tenants keep their counters (gauges at 0); older ones' series end. A live tenant's counters
    # never go, however many others come and go.
    from ascend_pool.metrics.sample import PoolAggregator

    base = ap.Pool(0, backend="sim")
    jobs = set()
    collector = PoolCollector(pools=lambda: [p for p in [base, *jobs] if not p.closed])
    keep, n_jobs = PoolAggregator.RETIRED_KEEP, PoolAggregator.RETIRED_KEEP + 36
    try:
        base.free(base.malloc(1000))
        for i in range(n_jobs):
            ctx = base.context(f"job-{i}")
            jobs.add(ctx)
            for _ in range(i % 3 + 1):
                ctx.free(ctx.malloc(1000))
            ctx.close()
            if i % 10 == 0:
                scrape(collector)
        out, _ = scrape(collector)
        tenants = {dict(labels).get("tenant") for name, labels in out if name == "ascend_pool_allocations_total"}
        assert tenants == {"default"} | {f"job-{i}" for i in range(n_jobs - keep, n_jobs)}, sorted(tenants)
        last = n_jobs - 1
        assert val(out, "ascend_pool_allocations_total", pool="small", device=0, tenant=f"job-{last}") == last % 3 + 1
        assert val(out, "ascend_pool_allocations_total", pool="small", device=0, tenant="default") == 1
    finally:
        base.close()


def test_a_tenant_open_again_keeps_its_counters_while_others_come_and_go():
    # The bound on closed tenants' series must never take the retired counters of a tenant that
    # is open (again) now: closed and reopened since the last scrape, it was counted idle, and
    # other jobs closing before the next scrape pushed its sums out (its counter went 4 -> 1).
    from ascend_pool.metrics.sample import PoolAggregator

    base = ap.Pool(0, backend="sim")
    open_now = set()
    collector = PoolCollector(pools=lambda: [p for p in [base, *open_now] if not p.closed])
    try:
        x = base.context("x")
        open_now.add(x)
        for _ in range(3):
            x.free(x.malloc(1000))
        scrape(collector)
        x.close()
        x = base.context("x")                       # the job runs again, no scrape in between
        open_now.add(x)
        x.free(x.malloc(1000))
        for i in range(PoolAggregator.RETIRED_KEEP + 6):
            job = base.context(f"job-{i}")
            open_now.add(job)
            job.free(job.malloc(1000))
            job.close()
        out, _ = scrape(collector)
        assert val(out, "ascend_pool_allocations_total", pool="small", device=0, tenant="x") == 4
    finally:
        base.close()


def test_a_pool_closed_by_two_threads_at_once_is_counted_once():
    # A request ending while a shutdown path closes every context: both close() calls read the
    # pool before it closes (registry.closing runs once per call); its counters are folded in once.
    from ascend_pool import registry

    base = ap.Pool(0, backend="sim")
    ctx = base.context("closed-twice")
    collector = PoolCollector(pools=lambda: [p for p in (base, ctx) if not p.closed])
    try:
        for _ in range(5):
            ctx.free(ctx.malloc(1000))
        registry.closing(ctx)                      # the other thread's close, up to its read
        ctx.close()
        out, _ = scrape(collector)
        assert val(out, "ascend_pool_allocations_total", pool="small", device=0, tenant="closed-twice") == 5
    finally:
        base.close()


def test_a_reset_of_accumulated_stats_never_makes_an_exported_counter_go_down():
    """reset_accumulated_stats() zeroes the pool's own counters (torch's); the exported counters
    keep what was counted, or Prometheus would take the drop for a restart and count the whole
    new value as an increase (a false out-of-memory or quota alert)."""
    pool = ap.Pool(0, backend="sim")
    try:
        collector = PoolCollector(pools=lambda: [pool])
        for _ in range(10):
            pool.free(pool.malloc(1000))
        first, _ = scrape(collector)
        assert val(first, "ascend_pool_allocations_total", pool="small", device=0, tenant="default") == 10
        pool.reset_accumulated_stats()
        assert pool.memory_stats()["allocation.small_pool.allocated"] == 0
        pool.free(pool.malloc(1000))
        after, _ = scrape(collector)
        assert val(after, "ascend_pool_allocations_total", pool="small", device=0, tenant="default") == 11  # was 1
        pool.reset_accumulated_stats()
        again, _ = scrape(collector)
        assert val(again, "ascend_pool_allocations_total", pool="small", device=0, tenant="default") == 11
        pool.reset_accumulated_stats()  # then more than before, between two scrapes: no drop to see
        for _ in range(25):
            pool.free(pool.malloc(1000))
        later, _ = scrape(collector)
        assert val(later, "ascend_pool_allocations_total", pool="small", device=0, tenant="default") == 36
    finally:
        pool.close()


def test_pools_of_one_tenant_are_summed_and_tenants_kept_apart():
    a, b, c = (ap.Pool(0, backend="sim") for _ in range(3))
    try:
        c.tenant = "batch"
        c.quota_bytes = 256 << 20
        a.malloc(3 << 20)
        b.malloc(5 << 20)
        c.malloc(1 << 20)
        samples, _ = scrape(PoolCollector(pools=lambda: [a, b, c]))
        assert val(samples, "ascend_pool_requested_bytes", pool="large", device=0, tenant="default") == 8 << 20
        assert val(samples, "ascend_pool_requested_bytes", pool="large", device=0, tenant="batch") == 1 << 20
        assert val(samples, "ascend_pool_quota_bytes", device=0, tenant="batch") == 256 << 20
        largest = max(p.memory_stats()["largest_free_block_bytes"] for p in (a, b))
        assert val(samples, "ascend_pool_largest_free_block_bytes", device=0, tenant="default") == largest
    finally:
        for p in (a, b, c):
            p.close()


def test_default_collector_reads_the_registry_of_live_pools(pool):
    pool.malloc(12345)
    samples, _ = scrape(PoolCollector())
    assert val(samples, "ascend_pool_requested_bytes", pool="small", device=0, tenant="default") >= 12345


def test_record_fields_cover_every_family():
    assert len(FIELDS) == len(set(FIELDS))
    assert "quota_bytes" in FIELDS and "device_total_bytes" in FIELDS


def test_a_collector_made_per_scrape_leaves_nothing_behind(pool):
    # Each PoolCollector registers a close listener (registry.on_close); a dead one was pruned
    # only when a pool closed, so an exporter building its registry per scrape, in a process
    # whose pools stay open, kept one per scrape (~7 objects) without bound.
    import gc

    from ascend_pool import registry

    scrape(PoolCollector())
    gc.collect()
    before = len(registry._closing)
    for _ in range(300):
        scrape(PoolCollector())
    gc.collect()
    assert len(registry._closing) <= before + 1
    kept = PoolCollector()  # a live one still hears a close (its final counters are folded in)
    ctx = pool.context("closing-heard")
    ctx.free(ctx.malloc(1 << 20))
    scrape(kept)
    ctx.close()
    assert any(key[1] == "closing-heard" for key in kept._agg._retired)


FINALIZER_WHILE_SCRAPED = r"""
import os, sys, threading, time
import ascend_pool as ap
from ascend_pool import sharing
from ascend_pool.metrics import PoolCollector

base = ap.Pool(0, backend="sim")
agg = PoolCollector()._agg
agg.samples()
done = threading.Event()

def request():
    with sharing._lock:  # as inside sharing's code when a collection runs a finalizer
        scrape = threading.Thread(target=agg.samples, daemon=True)
        scrape.start()
        time.sleep(0.3)  # the scrape holds the collector's lock now and waits for sharing's
        ctx = base.context("finalized")  # made after the scrape listed the pools
        ctx.free(ctx.malloc(1000))
        del ctx  # Pool.__del__: the close listeners, in this thread
    scrape.join()
    done.set()

threading.Thread(target=request, daemon=True).start()
if not done.wait(20):
    print("HUNG", flush=True)
    os._exit(1)
print({s.tenant: s.values["allocations.small"] for s in agg.samples()}.get("finalized"), flush=True)
os._exit(0)
"""


def test_a_pool_finalized_while_a_scrape_waits_does_not_deadlock():
    # The close listeners run from Pool.__del__, in whatever thread drops the pool, maybe one that
    # holds sharing's lock; a scrape holding the collector's lock waits for that one (pool_values).
    # A listener that waited for the collector's lock hung both threads for good; it queues now.
    import os
    import subprocess
    import sys
    import uuid
    parent = os.path.dirname(os.path.dirname(os.path.abspath(ap.__file__)))
    env = dict(os.environ, ASCEND_POOL_BACKEND="sim", ASCEND_SIM_NODE=f"fz{uuid.uuid4().hex[:10]}", ASCEND_POOL_STATS="0",
               PYTHONPATH=os.pathsep.join(filter(None, [parent, os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", FINALIZER_WHILE_SCRAPED], env=env, capture_output=True, text=True,
                       timeout=60, cwd="/")
    assert r.returncode == 0 and r.stdout.split() == ["1"], (r.returncode, r.stdout, r.stderr[-2000:])


def test_contexts_closed_dropped_and_collected_from_threads_while_scraped_are_counted_exactly_once():
    # Request threads make a tenant context each, use it and close it, drop it, or drop it in a
    # reference cycle (the collector finalizes it, perhaps inside a scrape), while a scrape runs
    # in a loop. Every allocation is counted once: the dropped ones were lost; and a dropped
    # context that the orphan reaper (any new pool runs it) closed while its finalizer was still
    # deciding was closed twice, and counted twice. The scraped figures never go down.
    import gc
    import threading
    bases = [ap.Pool(0, backend="sim"), ap.Pool(0, backend="sim")]
    collector = PoolCollector(pools=None)
    agg = collector._agg
    per_thread, threads = 120, 4
    stop, last, backwards = threading.Event(), {}, []

    def work(k):
        for i in range(per_thread):
            ctx = bases[i % 2].context(f"stress-{k}")
            if i % 3 == 0:
                ctx.me = ctx
            ctx.free(ctx.malloc(1000))
            if i % 5 == 0:
                ctx.close()
            del ctx
            if i % 7 == 0:
                gc.collect()

    def scrape():
        while not stop.is_set():
            for s in agg.samples():
                key, v = (s.device, s.tenant), s.values["allocations.small"]
                if v < last.get(key, 0):
                    backwards.append((key, last[key], v))
                last[key] = v

    scraper = threading.Thread(target=scrape)
    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    try:
        scraper.start()
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        stop.set()
        scraper.join()
        gc.collect()
        got = {s.tenant: s.values["allocations.small"] for s in agg.samples()}
        assert {k: got.get(f"stress-{k}") for k in range(threads)} == {k: per_thread for k in range(threads)}
        assert not backwards
    finally:
        stop.set()
        for b in bases:
            b.close()


def test_a_read_inside_a_read_counts_a_vanished_pool_once():
    # A signal handler's samples() that runs in the middle of another's sums (here: right after
    # that one retired a pool gone from the list) made the same retirement again: the pool's
    # counters were in the tenant's totals twice, for good.
    from ascend_pool.metrics.sample import PoolAggregator

    pool = ap.Pool(0, backend="sim")
    try:
        for _ in range(3):
            pool.free(pool.malloc(4096))  # small pool
        pools = [pool]
        agg = PoolAggregator(pools=lambda: list(pools))
        first = {s.tenant: s.values["allocations.small"] for s in agg.samples()}["default"]
        assert first == 3
        pools.clear()  # gone from the list without a close (the collector's orphan moment)
        add = agg._add_retired
        inner = []

        def add_then_signal(key, counters):
            add(key, counters)
            if not inner:
                inner.append(None)
                inner[0] = agg.samples()  # the "signal handler"

        agg._add_retired = add_then_signal
        outer = {s.tenant: s.values["allocations.small"] for s in agg.samples()}
        del agg._add_retired
        after = {s.tenant: s.values["allocations.small"] for s in agg.samples()}
        assert inner and {s.tenant: s.values["allocations.small"] for s in inner[0]}["default"] == 3
        assert outer["default"] == 3 and after["default"] == 3
    finally:
        pool.close()


def test_a_vanished_pool_whose_tenant_sums_were_forgotten_is_not_taken_off_a_later_sum():
    # A pool retired when a read missed it is taken back off its tenant's retired sums when it
    # comes back. Once those sums were forgotten (RETIRED_KEEP idle tenants), the take-back came
    # off the sums of the tenant's later pools instead: its counters went missing for good.
    from ascend_pool.metrics.sample import PoolAggregator

    base = ap.Pool(0, backend="sim")
    made = []

    def ctx(name, n):
        made.append(base.context(name))
        for _ in range(n):
            made[-1].free(made[-1].malloc(4096))
        return made[-1]

    def small(samples):
        return {s.tenant: s.values["allocations.small"] for s in samples}

    try:
        first = ctx("forgot-a", 3)
        pools = [first]
        agg = PoolAggregator(pools=lambda: list(pools))
        agg.RETIRED_KEEP = 1
        assert small(agg.samples())["forgot-a"] == 3
        pools[:] = []                       # a missed read: retired, kept while it may come back
        agg.samples()
        pools[:] = [ctx("forgot-d", 5)]
        agg.samples()
        pools[:] = []                       # forgot-d retired too: forgot-a's sums are forgotten
        assert "forgot-a" not in small(agg.samples())
        pools[:] = [ctx("forgot-a", 2)]     # the tenant's next pool
        agg.samples()
        pools[:] = []
        assert small(agg.samples())["forgot-a"] == 2
        pools[:] = [first]                  # the first pool back (the collector's orphan moment over)
        assert small(agg.samples())["forgot-a"] == 3 + 2
    finally:
        for c in made:
            c.close()
        base.close()


def test_a_read_during_a_collection_keeps_every_pool_the_collection_may_bring_back():
    # The cycle collector clears a pool's weak references (out of the registry) before its
    # finalizer runs (an orphan, or closed and folded in). A read in between retires it as
    # vanished, to be taken back off; past FOLDED_KEEP pending, the oldest were dropped, and
    # their finalizers' closes then counted them a second time, for good (a read in the middle
    # of a collection of 3,000 pools in cycles: 4,976 allocations exported for 3,000).
    import gc
    from ascend_pool.metrics.sample import PoolAggregator

    base = ap.Pool(0, backend="sim")
    agg = PoolAggregator()
    agg.FOLDED_KEEP = 2
    reads = []

    class ReadWhenCollected:  # its finalizer reads in the middle of the collection
        def __del__(self):
            reads.append(agg.samples())

    def small(samples):
        return {s.tenant: s.values["allocations.small"] for s in samples}.get("vanish-in-gc")

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        reader = ReadWhenCollected()
        reader.me = reader
        for _ in range(10):
            ctx = base.context("vanish-in-gc")
            ctx.free(ctx.malloc(1000))
            ctx.me = ctx  # a cycle: only the collector frees it
        del ctx, reader
        assert small(agg.samples()) == 10
        gc.collect()
    finally:
        if was_enabled:
            gc.enable()
        base.close()
    assert reads, "the reader was not collected"
    assert small(agg.samples()) == 10


def test_a_close_listener_call_for_a_pool_another_thread_closed_meanwhile_is_quiet(caplog):
    # A dropped context's finalizer calls the close listeners while the stats publisher's orphan
    # reaper (another thread) closes it: the finalizer's call found it closed, and "pool close
    # listener ... failed: this pool is closed" went to the user's stderr (once in ~11,000
    # contexts dropped in cycles). The reaper's close had read it: counted once, nothing to say.
    import logging
    from ascend_pool import registry
    from ascend_pool.metrics.sample import PoolAggregator

    pool = ap.Pool(0, backend="sim")
    pools = [pool]
    agg = PoolAggregator(pools=lambda: list(pools))
    pool.free(pool.malloc(4096))
    agg.samples()
    pool.close()  # the reaper's close: its listener call reads the final counters
    with caplog.at_level(logging.WARNING, logger="ascend_pool"):
        registry.closing(pool)  # the finalizer's, late: the pool still listed (as an orphan is)
    assert "failed" not in caplog.text, caplog.text
    pools.clear()
    assert {s.tenant: s.values["allocations.small"] for s in agg.samples()}["default"] == 1

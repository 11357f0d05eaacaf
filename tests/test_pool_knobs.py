"""Allocator knobs from $ASCEND_POOL_CONF and keyword arguments."""

import contextlib

import pytest

import ascend_pool as ap
from ascend_pool import sim
from ascend_pool.config import parse_conf_string

MiB = 1 << 20


def test_conf_string_parsing():
    assert parse_conf_string("max_split_size_mb:128, record_history:true,") == {
        "max_split_size_mb": "128", "record_history": "true"}
    with pytest.raises(ap.ConfigError, match="not key:value"):
        parse_conf_string("max_split_size_mb=128")


@pytest.mark.parametrize("conf, match", [
    ("bogus:1", "unknown allocator knob 'bogus'"),
    ("max_split_size_mb:abc", "max_split_size_mb"),
    ("max_split_size_mb:10", "more than 20"),
    ("garbage_collection_threshold:1.5", "garbage_collection_threshold"),
    ("reserve:lots", "reserve"),
    ("reserve:200%", "reserve"),
    ("record_history:maybe", "record_history"),
    ("page_size:4k", "page_size"),
    ("expandable_segments:maybe", "expandable_segments"),
    ("release_policy:sometimes", "release_policy"),
    ("memory_fraction:0", "memory_fraction"),
    ("sync_timeout_ms:0", "sync_timeout_ms"),
])
def test_bad_knobs_are_named(monkeypatch, conf, match):
    monkeypatch.setenv("ASCEND_POOL_CONF", conf)
    with pytest.raises(ap.ConfigError, match=match):
        ap.Pool(0, backend="sim")


def test_keyword_overrides_environment(monkeypatch):
    monkeypatch.setenv("ASCEND_POOL_CONF", "max_split_size_mb:bad")
    p = ap.Pool(0, backend="sim", max_split_size_mb=64)
    assert p.knobs["max_split_size_mb"] == 64
    p.close()


def test_reserve_preallocates_and_serves_without_device_calls():
    before = sim.stats(0)["mallocs"]
    p = ap.Pool(0, backend="sim", reserve="64MiB")
    try:
        assert sim.stats(0)["mallocs"] - before == 1
        ptrs = [p.malloc(8 * MiB) for _ in range(6)]
        for x in ptrs:
            p.free(x)
        assert sim.stats(0)["mallocs"] - before == 1
        st = p.memory_stats()
        assert st["reserved_bytes.all.current"] == 64 * MiB
        p.empty_cache()
        assert p.memory_stats()["reserved_bytes.all.current"] == 0
    finally:
        p.close()


@contextlib.contextmanager
def reserve_64mib_under(cap_mib):
    """A sim pool on device 0 that preallocates 64 MiB under a memory_fraction cap of cap_mib MiB."""
    total = sim.stats(0)["total_bytes"]
    p = ap.Pool(0, backend="sim", reserve="64MiB", memory_fraction=cap_mib * MiB / total)
    try:
        yield p
    finally:
        p.close()


@pytest.mark.parametrize("cap_mib, nbytes", [(64, 1000), (96, 80 * MiB)], ids=["small-request", "request-above-the-reserve"])
def test_an_idle_reserve_that_fills_the_cap_gives_way_to_a_request_it_cannot_serve(cap_mib, nbytes):
    # RMM's pool whose initial size equals its maximum serves a 1000-byte request (rmm#527).
    # The reserve is one large-pool segment: a small request never uses it, and a request larger
    # than it cannot. Under a cap the reserve (nearly) fills, such requests failed beside 64 MiB
    # of idle reserve; the out-of-memory path now returns the idle reserve before it gives up.
    with reserve_64mib_under(cap_mib) as p:
        assert p.get_limit() == cap_mib * MiB and p.memory_stats()["reserved_bytes.all.current"] == 64 * MiB
        x = p.malloc(nbytes)
        st = p.memory_stats()
        assert st["reserved_bytes.all.current"] <= cap_mib * MiB and st["allocated_bytes.all.current"] >= nbytes
        p.free(x)
        p._check_invariants()


def test_a_request_that_fails_whatever_is_released_keeps_the_reserve():
    # The reserve gives way only when that can let the request through: a request above the cap
    # even without the reserve fails as before and the reserve stays (it was released for
    # nothing: the next request paid device calls, another process could take the memory).
    with reserve_64mib_under(96) as p:
        with pytest.raises(ap.OutOfMemoryError):
            p.malloc(128 * MiB)
        assert p.memory_stats()["reserved_bytes.all.current"] == 64 * MiB
        assert p.memory_stats()["num_device_free"] == 0


def test_a_reserve_in_use_still_stays_when_a_request_fails():
    # Only an idle reserve gives way: one holding a live block is not released, and a request
    # the cap cannot take fails as before, the reserve and its block intact. (A small request is
    # served from the reserve's free part since 2026-12-05: tests/test_limit_small_room.py.)
    with reserve_64mib_under(64) as p:
        x = p.malloc(8 * MiB)
        with pytest.raises(ap.OutOfMemoryError):
            p.malloc(60 * MiB)
        assert p.memory_stats()["reserved_bytes.all.current"] == 64 * MiB
        p.free(x)


def test_reserve_as_a_fraction_of_free_memory():
    p = ap.Pool(0, backend="sim", reserve="0.1%")
    try:
        free_b = sim.stats(0)["total_bytes"]
        reserved = p.memory_stats()["reserved_bytes.all.current"]
        assert 0.0009 * free_b <= reserved <= 0.0011 * free_b + 2 * MiB
    finally:
        p.close()


def test_max_split_size_keeps_big_blocks_whole():
    p = ap.Pool(0, backend="sim", max_split_size_mb=32)
    try:
        big = p.malloc(40 * MiB)
        p.free(big)
        small = p.malloc(8 * MiB)     # must not split the cached 40 MiB block: a new segment
        assert p.memory_stats()["num_device_alloc"] == 2

        p.free(small)
    finally:
        p.close()


def test_record_history_feeds_the_snapshot_trace():
    p = ap.Pool(0, backend="sim", record_history=100)
    try:
        a = p.malloc(4096)
        p.free(a)
        actions = [e["action"] for e in p.snapshot()["device_traces"][0]]
        assert actions[:4] == ["segment_alloc", "alloc", "free_requested", "free_completed"]
    finally:
        p.close()


def test_history_is_off_by_default(pool):
    pool.free(pool.malloc(4096))
    assert [e["action"] for e in pool.snapshot()["device_traces"][0]] == []


def test_release_policy_never_keeps_segments(pool):
    p = ap.Pool(0, backend="sim", release_policy="never")
    try:
        for size in (10, 20, 30, 40):
            p.free(p.malloc(size * MiB))
        assert p.memory_stats()["num_device_free"] == 0
    finally:
        p.close()
    # the default releases idle segments rather than grow past its earlier peak
    for size in (10, 20, 30, 40):
        pool.free(pool.malloc(size * MiB))
    st = pool.memory_stats()
    assert st["num_device_free"] == 3
    assert st["reserved_bytes.all.peak"] == 42 * MiB


def test_garbage_collection_threshold_releases_idle_segments():
    total = sim.stats(0)["total_bytes"]
    p = ap.Pool(0, backend="sim", memory_fraction=0.002, garbage_collection_threshold=0.5,
                release_policy="never")
    try:
        limit = int(total * 0.002)
        a = p.malloc(limit // 4)
        p.free(a)
        b = p.malloc(limit // 3)     # over half the limit: the idle segment goes first
        st = p.memory_stats()
        assert st["num_device_free"] == 1
        p.free(b)
    finally:
        p.close()


def test_garbage_collection_frees_every_segment_idle_as_long_as_the_average_as_torch_npu():
    # torch_npu's test_cachingallocator_gc: blocks freed together are equally old, so the
    # collection takes them all (reserved = the new block alone). The pool released just enough
    # to get under the threshold and kept the rest, for the next growth to collect again.
    p = ap.Pool(0, backend="sim", garbage_collection_threshold=0.5, release_policy="never")
    B30, B60 = 30 * MiB - 512, 60 * MiB - 512  # each its segment of 30 / 60 MiB exactly (32-byte pad)
    try:
        p.set_limit(size=1 << 30)
        blocks = [p.malloc(B30) for _ in range(20)]
        for b in blocks:
            p.free(b)
        x = p.malloc(B60)
        assert p.memory_stats()["reserved_bytes.all.current"] == 60 * MiB
        p.free(x)
        p.empty_cache()
        # Ages count from the free: of two cohorts, the one freed long ago goes first, and the
        # collection stops once a pass has released enough.
        old = [p.malloc(B30) for _ in range(10)]
        for b in old:
            p.free(b)
        for _ in range(50):                    # allocations: the pool's clock
            p.free(p.malloc(4096))
        young = [p.malloc(B30) for _ in range(10)]  # served from the old cohort's cache
        more = [p.malloc(B30) for _ in range(10)]
        for b in young:
            p.free(b)
        for _ in range(50):
            p.free(p.malloc(4096))
        for b in more:
            p.free(b)                          # the young cohort: freed just now
        x = p.malloc(B60)
        st = p.memory_stats()
        assert st["reserved_bytes.all.current"] == 60 * MiB + 10 * 30 * MiB + 2 * MiB, st["reserved_bytes.all.current"]
        assert st["num_device_free"] == 20 + 2 + 10, st["num_device_free"]  # empty_cache: 60 MiB + small
        p.free(x)
    finally:
        p.close()


def test_set_limit_takes_cupys_size_and_fraction_forms_and_get_limit_reads_it():
    pool = ap.Pool(0, backend="sim")
    try:
        total = pool.mem_get_info()[1]
        assert pool.get_limit() == 0, "CuPy's get_limit: 0 without a cap"
        pool.set_limit(size=64 << 20)
        assert pool.get_limit() == 64 << 20
        with pytest.raises(ap.OutOfMemoryError):
            pool.malloc(128 << 20)
        pool.set_limit(fraction=0.5)
        assert pool.get_limit() == int(0.5 * total)
        pool.set_limit(fraction=1.0)
        assert pool.get_limit() == total
        pool.set_limit(size=0)  # CuPy: 0 lifts the cap, and get_limit reads 0
        assert pool.get_limit() == 0 and pool.malloc(128 << 20)
        pool.set_limit(1 << 30)
        pool.set_limit()        # neither form: no cap
        assert pool.get_limit() == 0
        for bad in ({"fraction": 1.5}, {"fraction": -0.1}, {"size": -1}, {"size": 1, "fraction": 0.5},
                    {"size": 1.5}, {"fraction": True}):
            with pytest.raises(ap.ConfigError):
                pool.set_limit(**bad)
        assert pool.get_limit() == 0, "a refused call changes nothing"
    finally:
        pool.close()


def test_record_history_knob_is_clamped_like_record_memory_history():
    # PyTorch users pass sys.maxsize for "everything"; the ring is allocated up front, so the knob
    # keeps at most config.MAX_HISTORY_ENTRIES (2**20 entries, 48 MiB) as the calls do.
    import sys
    from ascend_pool.config import MAX_HISTORY_ENTRIES
    for n in (2**40, sys.maxsize):
        pool = ap.Pool(0, backend="sim", record_history=n)  # was: MemoryError at creation
        try:
            assert pool.config["history_capacity"] == MAX_HISTORY_ENTRIES
            pool.free(pool.malloc(4096))
            actions = [e["action"] for e in pool.snapshot()["device_traces"][0]]
            assert actions[:4] == ["segment_alloc", "alloc", "free_requested", "free_completed"]
        finally:
            pool.close()


def test_a_knob_mistake_in_the_environment_names_the_variable(monkeypatch):
    # the same mistake from a keyword names only the knob (the caller wrote it there)
    monkeypatch.setenv("ASCEND_POOL_CONF", "max_split_size_mb:abc")
    with pytest.raises(ap.ConfigError, match=r"^ASCEND_POOL_CONF='max_split_size_mb:abc': max_split_size_mb: expected a number"):
        ap.Pool(0, backend="sim")
    monkeypatch.setenv("ASCEND_POOL_CONF", "bogus:1")
    with pytest.raises(ap.ConfigError, match=r"^ASCEND_POOL_CONF='bogus:1': unknown allocator knob 'bogus'"):
        ap.Pool(0, backend="sim")
    monkeypatch.delenv("ASCEND_POOL_CONF")
    with pytest.raises(ap.ConfigError, match=r"^max_split_size_mb: expected a number"):
        ap.Pool(0, backend="sim", max_split_size_mb="abc")
    ap.Pool(0, backend="sim").close()


def test_a_context_out_of_device_memory_takes_the_default_pools_idle_cache():
    # A tenant context (its own pool) asks for more than the device has left while the
    # process's default pool of the device caches gigabytes it no longer uses: PyTorch's
    # allocator frees the default pool's cached blocks for a MemPool's request. It raised
    # OutOfMemoryError ("Pool: 0 bytes reserved").
    # (the default pool itself: another plain Pool is a MemPool, which keeps its idle cache
    # unless made with use_on_oom=True, as torch's)
    base = ap.default_pool(0)
    total = base.memory_stats()["device_total_bytes"]
    ctx = base.context("reclaim")
    try:
        x = base.malloc(total * 3 // 4)
        base.free(x)                                   # cached idle by the default pool
        assert base.memory_stats()["reserved_bytes.all.current"] >= total * 3 // 4
        y = ctx.malloc(total // 2)
        assert base.memory_stats()["reserved_bytes.all.current"] < total * 3 // 4
        ctx.free(y)
    finally:
        ctx.close()
        base.empty_cache()


def test_a_context_made_from_a_plain_pool_takes_that_pools_idle_cache_which_other_pools_cannot():
    # A plain Pool keeps its idle cache from other pools' out-of-memory (torch's MemPool without
    # use_on_oom), but a tenant context made from it with pool.context() is the same allocator to
    # its user: out of device memory, it takes the pool's idle cache. It raised OutOfMemoryError
    # ("Pool: 0 bytes reserved") once plain pools kept their cache.
    base = ap.Pool(0, backend="sim")
    other = ap.Pool(0, backend="sim")
    total = base.memory_stats()["device_total_bytes"]
    ctx = base.context("family")
    try:
        base.free(base.malloc(total * 3 // 4))         # cached idle by the plain pool
        with pytest.raises(ap.OutOfMemoryError):
            other.malloc(total // 2)                     # another pool: the cache stays the base's
        assert base.memory_stats()["reserved_bytes.all.current"] >= total * 3 // 4
        y = ctx.malloc(total // 2)                       # its own context: taken
        assert base.memory_stats()["reserved_bytes.all.current"] < total * 3 // 4
        ctx.free(y)
        assert base.memory_stats()["allocated_bytes.all.current"] == 0
    finally:
        ctx.close()
        other.close()
        base.close()


def test_garbage_collection_ages_a_segment_freed_on_two_streams_from_its_last_free():
    # A segment whose blocks were freed on two streams becomes wholly free when the streams are
    # settled (its parts merged by a retag): its age kept the segment's creation, so the one
    # freed just now was collected before one idle for 100 allocations.
    p = ap.Pool(0, backend="sim", garbage_collection_threshold=0.5, release_policy="never")
    try:
        p.set_limit(size=256 * MiB)                    # the collector's threshold: 128 MiB
        s1, s2 = p.create_stream(), p.create_stream()
        keep = p.malloc(4096)                          # keeps the small segment in use
        x = p.malloc(4 * MiB, stream=s1)               # S: the 20 MiB segment medium requests share
        y = p.malloc(4 * MiB, stream=s2)
        t = p.malloc(24 * MiB - 512)                   # T: a segment of its own
        p.free(t)                                      # T wholly free from now
        for _ in range(100):
            p.free(p.malloc(4096))                     # the pool's clock
        p.free(y, stream=s2)
        p.free(x, stream=s1)                           # S wholly free once the streams settle
        p.synchronize(s1)
        p.synchronize(s2)
        z = p.malloc(90 * MiB)                         # over the threshold: the collector runs
        sizes = sorted(s["total_size"] for s in p.snapshot()["segments"])
        assert 24 * MiB not in sizes and 20 * MiB in sizes, sizes  # T (the older) went, S stayed
        p.free(z)
        p.free(keep)
        p.destroy_stream(s1)
        p.destroy_stream(s2)
    finally:
        p.close()


@pytest.mark.parametrize("nbytes", [1000, 5 * MiB, 200 * MiB])
def test_max_split_size_a_trade_never_hands_a_request_the_room_it_absorbed(nbytes):
    # The budgeted release policy trades a free 300 MiB segment for the new one, which absorbs the
    # room under the peak; with max_split_size set such a segment (>= it) was never split, so the
    # request got all of it: 266 MiB allocated for 1000 bytes.
    p = ap.Pool(0, backend="sim", max_split_size_mb=128)
    try:
        p.free(p.malloc(300 * MiB))
        x = p.malloc(nbytes)
        block = p.block_info(x)[1]
        assert block <= p.round_size(nbytes) + 2 * MiB, f"{nbytes} bytes got a {block}-byte block"
        assert p.memory_stats()["allocated_bytes.all.current"] == block
        p._check_invariants()
        p.free(x)
    finally:
        p.close()


@pytest.mark.parametrize("knobs, nbytes", [
    ({"max_split_size_mb": 40, "large_segment_size_mb": 40}, 8 * MiB + 555),  # the shared medium segment
    ({"max_split_size_mb": 21}, 20 * MiB + 1),                                # 22 MiB in whole pages
])
def test_max_split_size_a_smaller_request_splits_its_fresh_segment(knobs, nbytes):
    # PyTorch's rule: only a request of max_split_size or more keeps its block whole. Its fresh
    # segment reaching max_split_size, a smaller request got all of it (40 MiB for 8 MiB).
    p = ap.Pool(0, backend="sim", **knobs)
    try:
        x = p.malloc(nbytes)
        assert p.block_info(x)[1] == p.round_size(nbytes)
        assert p.memory_stats()["allocated_bytes.all.current"] == p.round_size(nbytes)
        p._check_invariants()
        p.free(x)
    finally:
        p.close()


@pytest.mark.parametrize("text, value", [("1.0", 1.0), ("0.5", 0.5), ("1.", 1.0), (".25", 0.25), ("1e-3", 1e-3)])
def test_a_reserve_written_as_a_decimal_is_the_same_fraction_in_the_knob_string_as_a_keyword(text, value):
    """"reserve:1.0" in $ASCEND_POOL_CONF was read as 1 byte (only texts below 1 were fractions,
    else the byte parser took "1.0" as 1 byte, "1.5" as 1), while reserve=1.0 was the whole
    device: the same number meant the whole device or a page. A number with a point is a fraction
    both ways; digits alone stay bytes, numpy numbers read as Python's."""
    import numpy as np
    from ascend_pool.config import knobs_to_config
    total, free = 64 << 30, 60 << 30
    reserve = lambda v: knobs_to_config({"reserve": v}, total, free)["reserve_bytes"]
    assert reserve(text) == reserve(value) == reserve(np.float64(value)) == int(value * free)
    assert reserve("1073741824") == reserve(1 << 30) == reserve(np.int64(1 << 30)) == 1 << 30
    for bad in ("1.5", "2.0", "5e8", "nan"):
        with pytest.raises(ap.ConfigError, match="reserve: a fraction must be in"):
            reserve(bad)


@pytest.mark.parametrize("knob, value, words", [
    ("sync_timeout_ms", 1.7, "sync_timeout_ms: expected an integer, got 1.7"),
    ("sync_timeout_ms", True, "sync_timeout_ms: expected an integer, got True"),
    ("pad_bytes", True, "pad_bytes: expected an integer, got True"),
    ("large_segment_size_mb", 64.5, "large_segment_size_mb: expected an integer, got 64.5"),
    ("record_history", 2.5, "record_history: expected an integer, got 2.5"),
    ("memory_fraction", True, "memory_fraction: expected a number, got True"),
])
def test_a_keyword_knob_that_is_a_bool_or_a_fraction_of_an_integer_is_refused(knob, value, words):
    """int(1.7) and int(True): sync_timeout_ms=1.7 was 1 ms and True 1 ms, pad_bytes=True one byte,
    memory_fraction=True the whole device, all silently (the knob string's "1.7" was refused). A
    whole float (2.0) and a numpy integer still read as the integer."""
    import numpy as np
    from ascend_pool.config import knobs_to_config
    with pytest.raises(ap.ConfigError, match=words):
        knobs_to_config({knob: value}, 64 << 30, 64 << 30)
    assert knobs_to_config({"sync_timeout_ms": 2.0}, 1, 1)["sync_timeout_ms"] == 2
    assert knobs_to_config({"sync_timeout_ms": np.int64(5)}, 1, 1)["sync_timeout_ms"] == 5


def test_a_numpy_bool_knob_is_a_bool():
    """np.True_ (a numpy bool: neither a bool subclass nor an index) went through int(): as
    record_history it was a ring of 1 entry instead of the default, as sync_timeout_ms 1 ms and as
    memory_fraction the whole device, silently; as expandable_segments (a flag) it was refused."""
    import numpy as np
    from ascend_pool.config import DEFAULT_HISTORY, knobs_to_config
    assert knobs_to_config({"record_history": np.True_}, 1 << 30, 1 << 30)["history_capacity"] == DEFAULT_HISTORY
    assert knobs_to_config({"record_history": np.False_}, 1 << 30, 1 << 30)["history_capacity"] == 0
    assert knobs_to_config({"expandable_segments": np.True_}, 1 << 30, 1 << 30)["expandable"] == 1
    for knob, words in (("sync_timeout_ms", "expected an integer"), ("memory_fraction", "expected a number"),
                        ("pad_bytes", "expected an integer")):
        with pytest.raises(ap.ConfigError, match=f"{knob}: {words}, got np.True_"):
            knobs_to_config({knob: np.True_}, 64 << 30, 64 << 30)


def test_a_decimal_or_fraction_knob_is_not_cut_and_an_underscored_reserve_is_bytes():
    """decimal.Decimal is no numbers.Real, so sync_timeout_ms=Decimal("1.7") passed the fraction
    check and int() cut it to 1 ms silently; a reserve given as a Decimal was refused as not bytes
    although the same float or Fraction is a fraction. The knob string's reserve "1_000_000"
    (float() reads underscores) was taken for a fraction and refused as out of (0, 1]: it is bytes,
    as int() reads the other integer knobs' "1_000"."""
    import decimal
    import fractions
    from ascend_pool.config import knobs_to_config
    for value in (decimal.Decimal("1.7"), fractions.Fraction(17, 10), decimal.Decimal("NaN"), decimal.Decimal("sNaN")):
        with pytest.raises(ap.ConfigError, match="sync_timeout_ms: expected an integer"):
            knobs_to_config({"sync_timeout_ms": value}, 64 << 30, 64 << 30)
    assert knobs_to_config({"sync_timeout_ms": decimal.Decimal("5")}, 1, 1)["sync_timeout_ms"] == 5
    for value in (decimal.Decimal("1.7"), fractions.Fraction(17, 10)):
        with pytest.raises(ap.ConfigError, match=r"reserve: a fraction must be in \(0, 1\]"):
            knobs_to_config({"reserve": value}, 1 << 30, 1 << 30)
    for value in (decimal.Decimal("0.5"), fractions.Fraction(1, 2)):
        assert knobs_to_config({"reserve": value}, 1 << 30, 1 << 30)["reserve_bytes"] == 1 << 29
    knobs = parse_conf_string("reserve:1_000_000", "ASCEND_POOL_CONF")
    assert knobs_to_config(knobs, 1 << 30, 1 << 30)["reserve_bytes"] == 1_000_000

"""CuPy's MemoryPool names on a pool (used_bytes, total_bytes, free_bytes, n_free_blocks,
free_all_blocks, set_limit/get_limit), so that code and tests written for cupy.cuda.MemoryPool
port as they are; sizes in bytes."""
import time

import pytest

import ascend_pool as ap

MiB = 1 << 20


def test_cupy_memory_pool_figures_follow_allocations_and_frees():
    pool = ap.Pool(0, backend="sim")
    try:
        assert (pool.used_bytes(), pool.total_bytes(), pool.free_bytes(), pool.n_free_blocks()) == (0, 0, 0, 0)
        a, b = pool.malloc(3 * MiB), pool.malloc(1000)
        used = pool.used_bytes()
        assert used == pool.memory_stats()["allocated_bytes.all.current"] >= 3 * MiB + 1000
        assert pool.total_bytes() >= used and pool.free_bytes() == pool.total_bytes() - used
        pool.free(a)
        assert pool.used_bytes() == used - pool.round_size(3 * MiB)
        assert pool.free_bytes() == pool.total_bytes() - pool.used_bytes()
        assert pool.n_free_blocks() >= 1
        pool.free(b)
        pool.free_all_blocks()
        assert (pool.used_bytes(), pool.total_bytes(), pool.free_bytes(), pool.n_free_blocks()) == (0, 0, 0, 0)
    finally:
        pool.close()


def test_cupys_deprecated_free_all_free_frees_all_blocks_with_its_warning():
    # CuPy's test_free_all_free and test_free_all_free_without_malloc (pool and MemoryPool): the
    # deprecated name still frees every cached block, with a DeprecationWarning
    pool = ap.Pool(0, backend="sim")
    try:
        with pytest.warns(DeprecationWarning, match="free_all_free"):
            pool.free_all_free()                          # without a malloc
        assert pool.n_free_blocks() == 0
        pool.free(pool.malloc(1))
        assert pool.n_free_blocks() >= 1
        with pytest.warns(DeprecationWarning, match="free_all_blocks"):
            pool.free_all_free()
        assert (pool.n_free_blocks(), pool.total_bytes()) == (0, 0)
    finally:
        pool.close()


def test_n_free_blocks_counts_what_a_snapshot_shows_and_records_nothing():
    pool = ap.Pool(0, backend="sim")
    try:
        pool.record_memory_history(True)
        held = [pool.malloc(s) for s in (512, 1000, 3000, 512, 70000, 2 * MiB, 3 * MiB, 512, 512)]
        for i in (0, 2, 4, 6, 7):  # small frees with live neighbours stay cached, apart
            pool.free(held[i])
        first = pool.snapshot()
        inactive = sum(b["state"] == "inactive" for seg in first["segments"] for b in seg["blocks"])
        assert pool.n_free_blocks() == inactive >= 4
        pool.n_free_blocks()
        actions = [e["action"] for e in pool.snapshot()["device_traces"][0]]
        # only the first snapshot's own event was added since: counting is not a snapshot
        assert actions == [e["action"] for e in first["device_traces"][0]] + ["snapshot"]
        for i in (1, 3, 5, 8):
            pool.free(held[i])
        pool.empty_cache()
        assert pool.n_free_blocks() == 0
    finally:
        pool.close()


def _one_cached_segment_per_stream(pool):
    """A cached 12 MiB segment (a size that gets a segment of its own) made for the default stream and one made for a created stream
    (the first is live while the second is made); returns that stream and both addresses."""
    s = pool.create_stream()
    p1 = pool.malloc(12 * MiB)
    p2 = pool.malloc(12 * MiB, stream=s)
    pool.free(p1)
    pool.free(p2, stream=s)
    return s, p1, p2


def test_free_all_blocks_of_one_stream_keeps_the_other_streams_cache():
    """cupy's test_free_all_blocks_stream: free_all_blocks(stream=null) returns only the segments
    the null stream's allocations made; the other stream still reuses its own cached block
    without a device call. stream_reuse='tied' is cupy's (and torch's) stream rule."""
    pool = ap.Pool(0, backend="sim", pad_bytes=0, stream_reuse="tied", release_policy="never")
    try:
        s, p1, p2 = _one_cached_segment_per_stream(pool)
        assert pool.memory_stats()["segment.all.current"] == 2
        pool.free_all_blocks(stream=0)
        st = pool.memory_stats()
        assert st["segment.all.current"] == 1 and st["num_device_free"] == 1
        assert pool.malloc(12 * MiB, stream=s) == p2  # its cache survived
        assert pool.memory_stats()["num_device_alloc"] == st["num_device_alloc"]
        pool.free_all_blocks(stream=s)
        assert pool.memory_stats()["segment.all.current"] == 1  # p2 is live: nothing to return
        pool.free(pool.malloc(1), stream=0)
        pool.free_all_blocks()  # None: every stream's
        assert pool.memory_stats()["segment.all.current"] == 1
    finally:
        pool.close()


class _CupyStream:
    """What cupy.cuda.Stream exposes to an allocator: the handle in .ptr (Stream.null.ptr == 0)."""

    def __init__(self, ptr):
        self.ptr = ptr


def test_free_all_blocks_takes_cupys_stream_object():
    """cupy's test_free_all_blocks_stream passes free_all_blocks(stream=cupy.cuda.Stream.null), a
    Stream object: its .ptr is the handle (before: StreamTypeError)."""
    pool = ap.Pool(0, backend="sim", pad_bytes=0, stream_reuse="tied", release_policy="never")
    try:
        s, p1, p2 = _one_cached_segment_per_stream(pool)
        pool.free_all_blocks(stream=_CupyStream(0))
        assert pool.memory_stats()["segment.all.current"] == 1
        assert pool.malloc(12 * MiB, stream=s) == p2  # the other stream's cache survived
        pool.free(p2, stream=s)
        pool.free_all_blocks(stream=_CupyStream(s))
        assert pool.memory_stats()["segment.all.current"] == 0
        with pytest.raises(ap.StreamTypeError):
            pool.free_all_blocks(stream=object())  # no handle at all: refused as before
    finally:
        pool.close()


def test_free_all_blocks_of_one_stream_under_the_default_stream_rule():
    """With stream_reuse='borrow' (the default) a block freed on one stream serves others once
    its work is done; free_all_blocks(stream=s) still returns only s's segments."""
    pool = ap.Pool(0, backend="sim")
    try:
        s, p1, p2 = _one_cached_segment_per_stream(pool)
        assert pool.memory_stats()["segment.all.current"] == 2
        pool.free_all_blocks(stream=s)
        assert pool.memory_stats()["segment.all.current"] == 1
        pool.free_all_blocks(stream=s)  # nothing of s's left: a no-op
        assert pool.memory_stats()["segment.all.current"] == 1
        pool.free_all_blocks(stream=0)
        assert pool.memory_stats()["reserved_bytes.all.current"] == 0
        pool.destroy_stream(s)
    finally:
        pool.close()


@pytest.mark.parametrize("first", ["creator", "freer"])
def test_free_all_blocks_of_one_stream_returns_a_segment_another_stream_borrowed_and_freed(first):
    """CuPy's free_all_blocks(stream): a block belongs to the stream it was freed on. A segment s's
    allocation made, whose block the default stream then borrowed (stream_reuse borrow) and freed,
    was returned by neither free_all_blocks(s) (its block tagged with the default stream's slot)
    nor free_all_blocks(0) (made by s): only a full empty_cache returned it. Now the stream that
    freed it returns it (after its work), and so does its creator once that work is done."""
    pool = ap.Pool(0, backend="sim")
    try:
        s = pool.create_stream()
        a = pool.malloc(5 * MiB, stream=s)
        pool.free(a, stream=s)
        b = pool.malloc(5 * MiB)          # the default stream borrows s's idle block
        assert b == a
        pool.free(b)
        pool.free_all_blocks(stream=s if first == "creator" else 0)
        assert pool.memory_stats()["reserved_bytes.all.current"] == 0
        other = pool.malloc(5 * MiB, stream=s)   # a segment of s's kept by the default stream's call
        pool.free(other, stream=s)
        pool.free_all_blocks(stream=0)
        assert pool.memory_stats()["reserved_bytes.all.current"] > 0
        pool.destroy_stream(s)
    finally:
        pool.close()


def test_free_all_blocks_of_the_creating_stream_keeps_a_segment_the_borrowers_queued_work_uses():
    """The creator's free_all_blocks(s) asks whether the borrowing stream's work is done, never
    waits for it: while that work is queued the segment stays (its kernel still writes the
    block); the borrower's free_all_blocks(0) returns it after waiting for that work."""
    from ascend_pool import sim
    pool = ap.Pool(0, backend="sim")
    try:
        s = pool.create_stream()
        a = pool.malloc(5 * MiB, stream=s)
        pool.free(a, stream=s)
        b = pool.malloc(5 * MiB)
        assert b == a
        sim.hang_stream(0)   # the default stream's queued kernel on b, held until released
        sim.launch_fill(0, b, 5 * MiB, 7)
        pool.free(b)
        try:
            pool.free_all_blocks(stream=s)
            assert pool.memory_stats()["reserved_bytes.all.current"] > 0
        finally:
            sim.release_stream(0)
        pool.free_all_blocks(stream=0)
        assert pool.memory_stats()["reserved_bytes.all.current"] == 0
        pool.destroy_stream(s)
    finally:
        pool.close()


def test_free_all_blocks_of_one_stream_waits_for_that_stream_only():
    """Another stream's hung work (a block record_stream'd onto it) neither delays
    free_all_blocks(stream=s2) nor keeps s2's idle segments (it waited for every pending free,
    then gave up on the timeout and freed nothing)."""
    from ascend_pool import sim
    # a long limit, bounded at half: waiting on s costs the whole limit, a loaded machine less
    pool = ap.Pool(0, backend="sim", sync_timeout_ms=20000)
    try:
        s, s2 = pool.create_stream(), pool.create_stream()
        sim.hang_stream(s)
        held = pool.malloc(12 * MiB)
        pool.record_stream(held, s)
        pool.free(held)                                   # pending on s's hung work
        pool.free(pool.malloc(12 * MiB, stream=s2), stream=s2)
        before = pool.memory_stats()["segment.all.current"]
        t = time.monotonic()
        pool.free_all_blocks(stream=s2)
        assert time.monotonic() - t < 10.0
        assert pool.memory_stats()["segment.all.current"] == before - 1
        sim.release_stream(s)
        pool.synchronize(s)
    finally:
        pool.close()


@pytest.mark.parametrize("expandable", [False, True], ids=["classic", "expandable"])
def test_free_all_blocks_of_one_stream_keeps_the_preallocated_reserve(expandable):
    pool = ap.Pool(0, backend="sim", reserve="64MiB", expandable_segments=expandable)
    try:
        pool.free(pool.malloc(30 * MiB))
        pool.free_all_blocks(stream=0)
        assert pool.memory_stats()["reserved_bytes.all.current"] >= 64 * MiB  # it went with expandable
        pool.free_all_blocks()                            # empty_cache: the reserve goes too
        assert pool.memory_stats()["reserved_bytes.all.current"] == 0
    finally:
        pool.close()


def test_expandable_release_skips_a_busy_streams_pages_and_returns_the_rest():
    """A busy stream's free pages are left; every other unused page still goes back (the release
    gave up at the first block of a busy stream and returned nothing)."""
    from ascend_pool import sim
    pool = ap.Pool(0, backend="sim", expandable_segments=True, sync_timeout_ms=500)
    try:
        s = pool.create_stream()
        a = pool.malloc(100 * MiB)
        x = pool.malloc(4 * MiB)                          # keeps a's and c's free pages apart
        c = pool.malloc(150 * MiB, stream=s)
        pool.free(a)
        sim.hang_stream(s)
        pool.free(c, stream=s)                            # its pages wait for s's hung work
        before = pool.memory_stats()["reserved_bytes.all.current"]
        pool.free_all_blocks(stream=0)
        after = pool.memory_stats()["reserved_bytes.all.current"]
        assert 150 * MiB <= after <= before - 96 * MiB, (before >> 20, after >> 20)
        sim.release_stream(s)
        pool.synchronize(s)
        pool.free(x)
        pool.free_all_blocks()
        assert pool.memory_stats()["reserved_bytes.all.current"] == 0
    finally:
        pool.close()

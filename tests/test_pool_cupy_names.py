"""CuPy's MemoryPool names on a pool (used_bytes, total_bytes, free_bytes, n_free_blocks,
free_all_blocks, set_limit/get_limit), so that code and tests written for cupy.cuda.MemoryPool
port as they are; sizes in bytes."""
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

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

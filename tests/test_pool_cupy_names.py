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

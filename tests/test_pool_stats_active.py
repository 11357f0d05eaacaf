"""Active stats keep PyTorch's meaning: a block is active while allocated, and after its free
while another stream's queued work may still use it (record_stream). The pool derives them from
the allocated stats plus the blocks waiting on events, so they are checked here against that
meaning in both pool kinds, while blocks wait and after they are released."""

import pytest

from ascend_pool import sim


@pytest.mark.parametrize("nbytes, kind", [(64 << 10, "small_pool"), (4 << 20, "large_pool")])
def test_active_counts_blocks_that_wait_for_another_stream(pool, nbytes, kind):
    a, b = pool.create_stream(), pool.create_stream()
    r = pool.round_size(nbytes)
    try:
        ptr = pool.malloc(nbytes, stream=a)
        sim.launch_fill(b, ptr, nbytes, 0xBB, delay_s=0.3)  # stream B still writes after the free
        pool.record_stream(ptr, b)
        pool.free(ptr)
        st = pool.memory_stats()
        for t in ("all", kind):
            assert st[f"allocated_bytes.{t}.current"] == 0
            assert st[f"active_bytes.{t}.current"] == r, "a waiting block is still active"
            assert st[f"active.{t}.current"] == 1
            assert st[f"active_bytes.{t}.freed"] == 0
            assert st[f"active_bytes.{t}.allocated"] == r
            assert st[f"requested_bytes.{t}.current"] == nbytes, \
                "requested bytes leave with the active bytes, when the free completes (torch's free_block)"
        assert st["internal_waste_bytes"] == r - nbytes

        other = pool.malloc(nbytes, stream=a)  # while the first one waits
        st = pool.memory_stats()
        for t in ("all", kind):
            assert st[f"active_bytes.{t}.current"] == 2 * r
            assert st[f"active_bytes.{t}.peak"] == 2 * r, "the active peak counts the waiting block"
            assert st[f"active.{t}.peak"] == 2
            assert st[f"allocated_bytes.{t}.peak"] == r
        pool.free(other, stream=a)
        pool.synchronize(b)  # B's work is done: the waiting block is released
        pool.synchronize(a)
        st = pool.memory_stats()
        assert st["pending_free_bytes"] == 0
        for t in ("all", kind):
            assert st[f"active_bytes.{t}.current"] == 0
            assert st[f"requested_bytes.{t}.current"] == 0
            assert st[f"requested_bytes.{t}.freed"] == 2 * nbytes
            assert st[f"active.{t}.freed"] == 2
            assert st[f"active_bytes.{t}.freed"] == 2 * r
            assert st[f"active_bytes.{t}.allocated"] == 2 * r
            assert st[f"active_bytes.{t}.peak"] == 2 * r
        pool.reset_peak_stats()
        st = pool.memory_stats()
        assert st["active_bytes.all.peak"] == 0 and st[f"active.{kind}.peak"] == 0
    finally:
        pool.destroy_stream(a)
        pool.destroy_stream(b)


def test_reset_peak_while_a_block_waits_keeps_it_in_the_peak(pool):
    a, b = pool.create_stream(), pool.create_stream()
    n = 64 << 10
    r = pool.round_size(n)
    try:
        ptr = pool.malloc(n, stream=a)
        sim.launch_fill(b, ptr, n, 0xBB, delay_s=0.3)
        pool.record_stream(ptr, b)
        pool.free(ptr)
        pool.reset_peak_stats()
        st = pool.memory_stats()
        assert st["active_bytes.all.peak"] == r and st["allocated_bytes.all.peak"] == 0
        pool.synchronize(b)
        pool.synchronize(a)
        assert pool.memory_stats()["active_bytes.all.peak"] == r
    finally:
        pool.destroy_stream(a)
        pool.destroy_stream(b)


def test_active_equals_allocated_without_record_stream(pool):
    ptrs = [pool.malloc(n) for n in (512, 70 << 10, 3 << 20, 5 << 20)]
    for p in ptrs[:2]:
        pool.free(p)
    st = pool.memory_stats()
    for t in ("all", "small_pool", "large_pool"):
        for field in ("current", "peak", "allocated", "freed"):
            assert st[f"active_bytes.{t}.{field}"] == st[f"allocated_bytes.{t}.{field}"]
            assert st[f"active.{t}.{field}"] == st[f"allocation.{t}.{field}"]
    for p in ptrs[2:]:
        pool.free(p)

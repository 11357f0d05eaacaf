"""torch's TestMemPool / memory-fraction tests of test/test_cuda.py, ported to ascend_pool's names
(torch.cuda.MemPool -> ap.Pool(0, ...), use_mem_pool -> ap.use_mem_pool, torch.empty on the device
-> ap.malloc, set_per_process_memory_fraction -> ap.set_per_process_memory_fraction). Sizes: the
acl pad (32 bytes) makes a 40 MiB request a 42 MiB segment, so the fractions leave 42 MiB a block
where torch's leave 40."""

import gc

import pytest

import ascend_pool as ap

MiB = 1 << 20


@pytest.fixture
def limited():
    """torch's _setup_mempool_limited_memory_test: a fraction of what the default pool holds plus
    `extra` bytes; undone (and the cache emptied) after the test."""
    default = ap.default_pool(0)
    ap.empty_cache()
    total = ap.mem_get_info(0)[1]

    def setup(extra):
        ap.set_per_process_memory_fraction((extra + default.total_bytes()) / total, 0)
        return default

    yield setup
    ap.set_per_process_memory_fraction(1.0, 0)
    default.set_limit()
    ap.empty_cache()


def test_mempool_limited_memory_use_on_oom_lends_in_place(limited):
    # torch's test_mempool_limited_memory_with_allocator: the default pool's request takes the
    # use_on_oom MemPool's free block (same address, no device allocation, the MemPool keeps its
    # segment), never the other MemPool's. ascend_pool released the lender's segment and grew the
    # default pool a new one elsewhere (repros/use_on_oom_lends_in_place.py).
    keep, lend = ap.Pool(0), ap.Pool(0, use_on_oom=True)
    try:
        default = limited(84 * MiB)
        with ap.use_mem_pool(keep):
            a = ap.malloc(40 * MiB)
        with ap.use_mem_pool(lend):
            b = ap.malloc(40 * MiB)
        with pytest.raises(ap.OutOfMemoryError):
            ap.malloc(40 * MiB)
        keep.free(a)
        lend.free(b)
        allocs, held = default.memory_stats()["num_device_alloc"], lend.total_bytes()
        c = ap.malloc(30 * MiB)
        assert c == b
        assert default.memory_stats()["num_device_alloc"] == allocs and lend.total_bytes() == held
        with pytest.raises(ap.OutOfMemoryError):
            ap.malloc(30 * MiB)  # the MemPool without use_on_oom keeps its free block
        default.free(c)  # freed by the pool it was asked of: back to the lender
        with ap.use_mem_pool(lend):
            e = ap.malloc(20 * MiB)
        assert e == c
        lend.free(e)
    finally:
        keep.close()
        lend.close()


def test_deleted_mempool_not_used_on_oom(limited):
    # torch's test_deleted_mempool_not_used_on_oom: dropped use_on_oom pools lend nothing; the
    # live one lends two blocks of its free segment
    limited(42 * MiB)
    for _ in range(10):
        pool = ap.Pool(0, use_on_oom=True)
        with ap.use_mem_pool(pool):
            a = ap.malloc(40 * MiB)
        pool.free(a)
        del pool
        gc.collect()
    new = ap.Pool(0, use_on_oom=True)
    try:
        with ap.use_mem_pool(new):
            new.free(ap.malloc(40 * MiB))
        b = ap.malloc(20 * MiB)
        c = ap.malloc(20 * MiB)
        assert new.block_info(b) is not None and new.block_info(c) is not None
        ap.free(b)
        ap.free(c)
    finally:
        new.close()


def test_a_lent_block_takes_record_stream_through_the_pool_it_was_asked_of(limited):
    # torch's record_stream works on any block of the allocator; a lent block is the lender's, and
    # the default pool's record_stream of it was an InvalidPointerError
    lend = ap.Pool(0, use_on_oom=True)
    try:
        default = limited(42 * MiB)
        with ap.use_mem_pool(lend):
            lend.free(ap.malloc(40 * MiB))
        c = default.malloc(30 * MiB)
        assert lend.block_info(c) is not None
        s = lend.create_stream()
        default.record_stream(c, s)
        default.free(c)
        lend.synchronize(s)
        assert lend.memory_stats()["allocated_bytes.all.current"] == 0
    finally:
        lend.close()


_GC_UNDER_FRACTION = """
import ascend_pool as ap
MiB = 1 << 20
default = ap.default_pool(0)
mp = ap.Pool(0)
ap.set_per_process_memory_fraction(100 * MiB / ap.mem_get_info(0)[1], 0)
ap.set_allocator_settings("garbage_collection_threshold:0.5")
with ap.use_mem_pool(mp):
    live = ap.malloc(40 * MiB)
ap.free(ap.malloc(10 * MiB))
b = ap.malloc(20 * MiB)
print(default.memory_stats()["num_device_free"], (default.total_bytes() + mp.total_bytes()) // MiB)
"""


def test_garbage_collection_under_a_fraction_counts_the_mempools_segments():
    """torch's garbage_collect_cached_blocks: past garbage_collection_threshold * the fraction's
    allowed bytes, counted over the device's allocator (total_allocated_memory: MemPools' segments
    too), the default pool's idle segments go. Its own reserved bytes were counted: a MemPool held
    42 MiB of a 100 MiB fraction (gc 0.5), the default pool kept its idle 12 MiB segment and grew
    22 MiB beside it, 76 MiB in all (repros/gc_threshold_counts_the_mempools.py). A fresh process:
    the default pool holds nothing else, and release_policy never leaves the release to the gc."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(ap.__file__))),
               ASCEND_POOL_CONF="release_policy:never")
    proc = subprocess.run([sys.executable, "-c", _GC_UNDER_FRACTION], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "64"]

"""Ports of PyTorch's and torch_npu's own allocator tests (test/test_cuda.py, test/npu/*.py) that
failed on ascend_pool: each test names the one it ports. Sizes in bytes."""
import ascend_pool as ap

MiB = 1 << 20
PAD = 32  # acl/sim pad each request by 32 bytes (torch_npu's): 40 MiB - PAD asks for 40 MiB


def test_max_split_expandable():
    # test_cuda.py TestCudaMallocAsync.test_max_split_expandable: expandable segments with
    # max_split_size_mb:40 under a 120 MiB cap; three 40 MiB tensors fit, a fourth is out of
    # memory, and once they are freed 120 MiB fits again. Then (what torch's test leaves out) the
    # 120 MiB block is freed and three 40 MiB tensors fit once more: each request of max_split_size
    # takes 40 MiB of the segment's free tail, not all of it (torch splits every expandable block).
    pool = ap.Pool(0, backend="sim", expandable_segments=True, max_split_size_mb=40)
    try:
        pool.set_limit(limit_bytes=120 * MiB)
        a, b, c = (pool.malloc(40 * MiB - PAD) for _ in range(3))
        try:
            pool.malloc(40 * MiB - PAD)
            raise AssertionError("a fourth 40 MiB block fitted under a 120 MiB cap")
        except ap.OutOfMemoryError:
            pass
        for ptr in (a, b, c):
            pool.free(ptr)
        big = pool.malloc(120 * MiB - PAD)
        pool.free(big)
        again = [pool.malloc(40 * MiB - PAD) for _ in range(3)]
        assert [pool.block_info(ptr)[1] for ptr in again] == [40 * MiB] * 3
        assert pool.memory_stats()["allocated_bytes.all.current"] == 120 * MiB
        for ptr in again:
            pool.free(ptr)
        pool._check_invariants()
    finally:
        pool.close()

"""Small blocks parked in the recent-free cache behave as if merged at free (issue 18, point 2):
a request that would otherwise cut fresh space or grow the pool reuses the hole they leave, as in
PyTorch and RMM. The cache is invisible (free_cache.h): placement is merge-at-free's, checked here
against the independent torch_npu_policy model and in tests/test_pool_model.py."""

import pytest

import ascend_pool as ap

MiB = 1 << 20


@pytest.mark.parametrize("expandable", [False, True], ids=["classic", "expandable"])
@pytest.mark.parametrize("policy", ["under_peak", "budgeted", "never"])
def test_two_adjacent_freed_512_byte_blocks_serve_a_1kib_request(policy, expandable):
    # Expandable segments fit small blocks by page, and reuse it too.
    pool = ap.Pool(0, backend="sim", release_policy=policy, expandable_segments=expandable)
    try:
        a, b, c = (pool.malloc(480) for _ in range(3))  # 512 bytes each, adjacent, c keeps the hole closed
        assert (b - a, c - b) == (512, 512)
        pool.free(a)
        pool.free(b)
        d = pool.malloc(992)  # 992 + 32 pad = 1 KiB
        assert d == a, f"the 1 KiB request was cut from fresh space at +{d - a} instead of the hole at {a:#x}"
        st = pool.memory_stats()
        assert st["segment.all.current"] == 1
        assert st["inactive_split.all.current"] == 1  # only the segment's untouched tail is free
        for p in (c, d):
            pool.free(p)
    finally:
        pool.close()


@pytest.mark.parametrize("expandable", [False, True], ids=["classic", "expandable"])
@pytest.mark.parametrize("policy", ["under_peak", "budgeted", "never"])
def test_a_larger_hole_of_freed_neighbours_serves_a_smaller_request(policy, expandable):
    # Three freed 512-byte neighbours leave a 1.5 KiB hole: best fit over the merged picture takes
    # it for a 1 KiB request (PyTorch: the smallest block that fits), not the segment's rest.
    pool = ap.Pool(0, backend="sim", release_policy=policy, expandable_segments=expandable)
    try:
        a, b, c, d = (pool.malloc(480) for _ in range(4))
        for p in (a, b, c):
            pool.free(p)
        e = pool.malloc(992)
        assert e == a, f"the 1 KiB request was cut at +{e - a} instead of the 1.5 KiB hole at {a:#x}"
        for p in (e, d):
            pool.free(p)
        pool._check_invariants()
    finally:
        pool.close()


@pytest.mark.parametrize("seed", range(3))
def test_small_pool_placement_is_torch_npus(seed):
    """Small requests on one stream (release_policy=never, so no segment is returned): every block
    lands where the independent torch_npu_policy model (merge at free, best fit by size then
    address, 2 MiB small segments: bench/torch_npu_policy.py) puts it, segment by segment, with
    the recent-free cache in between. Recurring sizes make the cache serve many of them."""
    import random

    from ascend_pool.bench.torch_npu_policy import TorchNpuPolicy

    rnd = random.Random(seed)
    pool = ap.Pool(0, backend="sim", release_policy="never")
    model = TorchNpuPolicy()
    ours, theirs, base = {}, {}, {}  # slot -> pointer; model segment base -> our segment base
    try:
        for step in range(4000):
            slot = rnd.randrange(64)
            if slot in ours:
                pool.free(ours.pop(slot))
                model.free(theirs.pop(slot))
                continue
            n = rnd.choice([480, 4000, 4000, 4000, 8000, 1000, 64 * 1024, rnd.randint(1, 1 << 20)])
            ptr, m = pool.malloc(n), model.malloc(n)
            seg = max(s for s in model._segments if s <= m)
            if seg not in base:  # the model made a segment: so must the pool, a new one
                assert ptr - (m - seg) not in base.values(), f"step {step}: malloc({n}) reused a segment"
                base[seg] = ptr - (m - seg)
            assert ptr == base[seg] + (m - seg), f"step {step}: malloc({n}) at {ptr:#x}, the model's placement is " \
                                                 f"segment {sorted(base).index(seg)} + {m - seg:#x}"
            ours[slot], theirs[slot] = ptr, m
        assert pool.memory_stats()["segment.all.current"] == model.n_segments
        pool._check_invariants()
    finally:
        for p in ours.values():
            pool.free(p)
        pool.close()


@pytest.mark.parametrize("expandable", [False, True], ids=["classic", "expandable"])
def test_the_hole_is_reused_on_a_stream_too(expandable):
    pool = ap.Pool(0, backend="sim", expandable_segments=expandable)
    try:
        s = pool.create_stream()
        a, b, c = (pool.malloc(480, stream=s) for _ in range(3))
        pool.free(a, stream=s)
        pool.free(b, stream=s)
        assert pool.malloc(992, stream=s) == a
        pool.free(a, stream=s)
        pool.free(c, stream=s)
        pool.synchronize(s)
        pool._check_invariants()
    finally:
        pool.close()


def test_exact_size_reuse_still_takes_the_cached_block(pool):
    # The cache's purpose: a freed block of the very size asked again comes straight back.
    a, b = pool.malloc(3000), pool.malloc(3000)
    pool.free(a)
    assert pool.malloc(3000) == a
    for p in (a, b):
        pool.free(p)


def test_cached_neighbours_merge_before_a_new_segment_is_made(pool):
    # A small segment filled, then two neighbours freed: a request their merged hole fits must not
    # grow the pool by a second segment.
    ptrs = [pool.malloc(64 * 1024 - 32) for _ in range(32)]  # exactly one 2 MiB small segment
    assert pool.memory_stats()["segment.all.current"] == 1
    pool.free(ptrs[10])
    pool.free(ptrs[11])
    big = pool.malloc(128 * 1024 - 32)
    assert big == ptrs[10]
    st = pool.memory_stats()
    assert st["segment.all.current"] == 1 and st["num_device_alloc"] == 1
    ptrs[10] = big
    del ptrs[11]
    for p in ptrs:
        pool.free(p)


_C_ENTRY_CHILD = """
import ctypes, ascend_pool as ap
lib = ctypes.CDLL(ap.library_path())
lib.ascend_pool_malloc.restype = ctypes.c_void_p
lib.ascend_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.ascend_pool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
a, b, c = (lib.ascend_pool_malloc(480, 0, None) for _ in range(3))
lib.ascend_pool_free(a, 480, 0, None)
lib.ascend_pool_free(b, 480, 0, None)
d = lib.ascend_pool_malloc(992, 0, None)
lib.ascend_pool_free(d, 992, 0, None)
lib.ascend_pool_free(c, 480, 0, None)
print(b - a, c - b, d - a)
"""


@pytest.mark.parametrize("conf", ["", "expandable_segments:True"])
def test_the_c_entry_point_reuses_the_hole(tmp_path, conf):
    """Through the C ABI's default pool, in a fresh process (this one's default pool holds what
    earlier tests left: its holes would decide where the three blocks go)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, ASCEND_POOL_CONF=conf)
    out = subprocess.run([sys.executable, "-c", _C_ENTRY_CHILD], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    ab, bc, da = map(int, out.stdout.split())
    assert (ab, bc) == (512, 512)  # adjacent in a fresh segment
    assert da == 0, f"the 1 KiB request was cut at +{da} instead of the hole the two freed blocks left"

"""Sizes, limits and stream handles are checked before the pool looks anything up (issue 15, 1).

A size beyond any device must never be served from the recent-free cache (which keys on the
rounded size shifted left: a huge request used to alias a small cached block), and bad limits or
handles get the package's typed errors instead of a raw OverflowError or silent acceptance.
"""
import pytest

import ascend_pool as ap


def test_huge_malloc_after_small_free_is_refused_not_served_from_cache(pool):
    p = pool.malloc(100)
    pool.free(p)
    # ~20 PiB: rsize << 16 wraps onto the 512-byte cached block's key
    with pytest.raises(ap.OutOfMemoryError):
        pool.malloc(22236523160142304)
    assert pool.memory_stats()["allocated_bytes.all.current"] == 0
    q = pool.malloc(100)  # the cached block is still there for a real request
    assert q == p
    pool.free(q)


@pytest.mark.parametrize("size", [2**62, 2**63 - 1, 2**48 + 100])
def test_sizes_beyond_the_device_never_alias_cached_blocks(pool, size):
    blocks = [pool.malloc(n) for n in (100, 600, 4000, 70000)]
    for b in blocks:
        pool.free(b)
    with pytest.raises(ap.OutOfMemoryError):
        pool.malloc(size)
    assert pool.memory_stats()["allocation.all.current"] == 0


@pytest.mark.parametrize("bad", [-1, 2**64, 2**70, 1.5, "1GiB", True])
def test_set_limit_rejects_what_is_not_a_byte_count(pool, bad):
    with pytest.raises(ap.ConfigError):
        pool.set_limit(bad)
    # the pool keeps serving with its old (absent) limit
    pool.free(pool.malloc(4 << 20))


def test_set_limit_takes_cupys_positional_size_where_0_lifts_the_cap_and_numpys_numbers(pool):
    import numpy as np
    pool.set_limit(pool.get_limit())  # CuPy's save and restore: no cap before, none after
    assert pool.get_limit() == 0
    pool.free(pool.malloc(4 << 20))
    pool.set_limit(np.int64(8 << 20))
    assert pool.get_limit() == 8 << 20
    with pytest.raises(ap.OutOfMemoryError):
        pool.malloc(16 << 20)
    saved = pool.get_limit()
    pool.set_limit(0)
    assert pool.get_limit() == 0
    pool.free(pool.malloc(16 << 20))
    pool.set_limit(saved)
    assert pool.get_limit() == 8 << 20
    pool.set_limit(fraction=np.float32(0.5))
    assert pool.get_limit() == int(0.5 * pool.mem_get_info()[1])
    pool.set_limit(size=float(32 << 20))  # a whole float, as CuPy's fraction path makes
    assert pool.get_limit() == 32 << 20
    pool.set_limit(limit_bytes=0)  # an exact cap of 0 bytes: nothing new may be reserved
    with pytest.raises(ap.OutOfMemoryError):
        pool.malloc(64 << 20)
    with pytest.raises(ap.ConfigError):
        pool.set_limit(1 << 20, limit_bytes=1 << 20)
    pool.set_limit(None)
    assert pool.get_limit() == 0 and pool._limit() is None


def test_set_limit_accepts_byte_counts_and_none(pool):
    pool.set_limit(8 << 20)
    p = pool.malloc(4 << 20)
    with pytest.raises(ap.OutOfMemoryError):
        pool.malloc(8 << 20)
    pool.set_limit(None)
    q = pool.malloc(8 << 20)
    pool.free(p)
    pool.free(q)


@pytest.mark.parametrize("bad", [2**64, 2**65, -5, 0, 1.0, None])
def test_register_stream_rejects_handles_that_are_not_pointers(pool, bad):
    with pytest.raises(ap.InvalidStreamError):
        pool.register_stream(bad)


def test_malloc_on_a_handle_too_large_for_a_pointer_is_a_typed_error(pool):
    with pytest.raises(ap.InvalidStreamError):
        pool.register_stream(2**64)
    with pytest.raises(ap.InvalidStreamError):
        pool.malloc(100, stream=2**64)
    pool.free(pool.malloc(100))

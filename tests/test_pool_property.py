"""Property test: random malloc/free sequences against a reference model. After every step: live
blocks never overlap, every block lies in a segment, block sizes tile each segment, and the
stats equal the model's."""

from hypothesis import HealthCheck, given, settings, strategies as st

import ascend_pool as ap

MiB = 1 << 20

sizes = st.one_of(
    st.integers(1, 4096),              # small pool
    st.integers(4097, 1 * MiB),        # small pool, up to the boundary
    st.integers(1 * MiB + 1, 24 * MiB),  # large pool
)
ops = st.lists(st.tuples(st.booleans(), sizes, st.integers(0, 1 << 30)), min_size=1, max_size=60)


def check(pool, live):
    pool._check_invariants()  # the C-side invariants (cython/core/check.c)
    snap = pool.snapshot()
    stats = pool.memory_stats()
    spans = []
    for seg in snap["segments"]:
        total = 0
        cursor = seg["address"]
        for b in seg["blocks"]:
            assert b["address"] == cursor, "blocks must tile the segment in address order"
            cursor += b["size"]
            total += b["size"]
            if b["state"] == "active_allocated":
                spans.append((b["address"], b["address"] + b["size"]))
        assert total == seg["total_size"]
    spans.sort()
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        assert a1 <= b0, "live blocks overlap"
    assert {s[0] for s in spans} == set(live)
    for ptr, size in live.items():
        base, bsize, req = pool.block_info(ptr)
        assert base == ptr and req == size and bsize == pool.round_size(size)
        assert any(s["address"] <= ptr and ptr + bsize <= s["address"] + s["total_size"] for s in snap["segments"])
    assert stats["allocation.all.current"] == len(live)
    assert stats["requested_bytes.all.current"] == sum(live.values())
    assert stats["allocated_bytes.all.current"] == sum(pool.round_size(s) for s in live.values())
    assert stats["reserved_bytes.all.current"] == sum(s["total_size"] for s in snap["segments"])
    assert stats["segment.all.current"] == len(snap["segments"])
    free_blocks = [b["size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "inactive"]
    assert stats["cached_free_bytes"] == sum(free_blocks)
    assert stats["largest_free_block_bytes"] == max(free_blocks, default=0)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_random_sequences_match_the_model(pool, sequence):
    live = {}
    try:
        for is_alloc, size, pick in sequence:
            if is_alloc or not live:
                ptr = pool.malloc(size)
                assert ptr not in live
                live[ptr] = size
            else:
                ptr = sorted(live)[pick % len(live)]
                pool.free(ptr)
                del live[ptr]
            check(pool, live)
    finally:
        for ptr in list(live):
            pool.free(ptr)
        pool.empty_cache()
    assert pool.memory_stats()["reserved_bytes.all.current"] == 0

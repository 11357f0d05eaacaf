"""Expandable segments: the pool maps physical pages into reserved address space through the
runtime's virtual-memory calls (the simulator implements them for real)."""

import pytest

import ascend_pool as ap
from ascend_pool import sim

MiB = 1 << 20


@pytest.fixture
def xpool(clean_faults):
    p = ap.Pool(0, backend="sim", expandable_segments=True)
    yield p
    p.close()


def segments(pool):
    return sorted(pool.snapshot()["segments"], key=lambda s: s["address"])


def test_a_segment_grows_in_place(xpool):
    a = xpool.malloc(3 * MiB)                       # 4 MiB mapped
    xpool.free(a)
    b = xpool.malloc(7 * MiB)                       # the free 4 MiB tail grows by 4 MiB more
    assert b == a, "the new pages extend the free block in place"
    segs = segments(xpool)
    assert len(segs) == 1 and segs[0]["total_size"] == 8 * MiB and segs[0]["is_expandable"]
    st = xpool.memory_stats()
    assert st["reserved_bytes.all.current"] == 8 * MiB
    assert st["num_device_map"] == 4                 # one physical page per map
    xpool.free(b)


def test_holes_are_unmapped_and_filled_again(xpool):
    held0 = sim.stats(0)["bytes_held"]
    a, b, c = (xpool.malloc(4 * MiB - 32) for _ in range(3))  # +32 pad: exactly 2 pages each
    assert b == a + 4 * MiB and c == b + 4 * MiB
    xpool.free(b)
    xpool.empty_cache()                              # b's pages go back: the segment splits
    segs = segments(xpool)
    assert [s["total_size"] for s in segs] == [4 * MiB, 4 * MiB]
    assert sim.stats(0)["bytes_held"] - held0 == 8 * MiB
    with pytest.raises(sim.SimError) as info:        # the hole is unmapped: access is refused
        sim.read(b, 16)
    assert info.value.code == 107000
    b2 = xpool.malloc(4 * MiB - 32)                # mapped into the hole: one segment again
    assert b2 == b
    assert [s["total_size"] for s in segments(xpool)] == [12 * MiB]
    for p in (a, b2, c):
        xpool.free(p)
    xpool.empty_cache()
    assert sim.stats(0)["bytes_held"] == held0
    assert xpool.memory_stats()["reserved_bytes.all.current"] == 0


def test_failure_in_the_middle_of_growing_is_rolled_back(xpool):
    held0 = sim.stats(0)["bytes_held"]
    sim.set_faults(fail_after_bytes=held0 + 6 * MiB)  # the 4th page of a 5-page growth fails
    with pytest.raises(ap.OutOfMemoryError):
        xpool.malloc(10 * MiB - 32)
    assert sim.stats(0)["bytes_held"] == held0, "pages mapped before the failure must be returned"
    st = xpool.memory_stats()
    assert st["reserved_bytes.all.current"] == 0 and st["num_ooms"] == 1
    sim.reset_faults()
    p = xpool.malloc(10 * MiB - 32)                # and the pool keeps serving
    xpool.free(p)


def test_a_one_shot_fault_is_retried(xpool):
    sim.set_faults(fail_malloc_nth=2)
    p = xpool.malloc(6 * MiB - 32)
    st = xpool.memory_stats()
    assert st["num_alloc_retries"] == 1 and st["reserved_bytes.all.current"] == 6 * MiB
    xpool.free(p)


def test_snapshot_trace_names_maps_and_unmaps():
    p = ap.Pool(0, backend="sim", expandable_segments=True, record_history=True)
    try:
        a = p.malloc(2 * MiB)
        p.free(a)
        p.empty_cache()
        actions = [e["action"] for e in p.snapshot()["device_traces"][0]]
        assert "segment_map" in actions and "segment_unmap" in actions
    finally:
        p.close()


def test_stream_order_holds_in_expandable_mode(xpool):
    a, b = xpool.create_stream(), xpool.create_stream()
    n = 4 * MiB
    ptr = xpool.malloc(n, stream=a)
    sim.launch_fill(a, ptr, n, 0xAA, delay_s=0.2)
    xpool.free(ptr, stream=a)
    other = xpool.malloc(n, stream=b)
    sim.launch_fill(b, other, n, 0xBB)
    xpool.synchronize(a)
    xpool.synchronize(b)
    assert sim.read(other, n) == b"\xbb" * n
    xpool.free(other, stream=b)
    xpool.destroy_stream(a)
    xpool.destroy_stream(b)


def test_quota_counts_mapped_memory():
    from ascend_pool.tenants.context import Context

    ctx = Context("xq", device=3, backend="sim", quota="16MiB", expandable_segments=True)
    try:
        a = ctx.malloc(10 * MiB)
        with pytest.raises(ap.QuotaExceededError):
            ctx.malloc(10 * MiB)
        ctx.free(a)
        b = ctx.malloc(14 * MiB)                    # fits once a's pages are reused in place
        assert ctx.memory_stats()["reserved_bytes.all.current"] <= 16 * MiB
        ctx.free(b)
    finally:
        ctx.close()

"""The pool's stream, context, sharing and trace calls at module level (ap.create_stream(),
ap.synchronize(s), ap.context(...), ap.share_malloc/share/share_free, ap.dump_trace,
ap.reset_accumulated_stats), on the default pool of the current device, as ap.malloc is."""

import pickle

import pytest

import ascend_pool as ap
from ascend_pool import sim

MiB = 1 << 20


@pytest.fixture
def on_device_1():
    before = ap.current_device()
    assert ap.default_pool(0).backend.device_count >= 2, "the simulated node has several devices"
    ap.set_device(1)
    yield ap.default_pool(1)
    ap.set_device(before)


def test_streams_follow_the_current_device_and_synchronize_waits_for_queued_work(on_device_1):
    s = ap.create_stream()
    assert ap.default_pool(1).backend.stream_device(s) in (1, None)
    ptr = ap.malloc(MiB, stream=s)
    assert ap.default_pool(1).block_info(ptr) is not None and ap.default_pool(0).block_info(ptr) is None
    sim.launch_fill(s, ptr, 4096, 0x5A, delay_s=0.2)
    ap.synchronize(s)                                   # returns only once the fill has run
    assert sim.read(ptr, 4096) == b"\x5a" * 4096
    ap.free(ptr, stream=s)
    ap.destroy_stream(s)
    with pytest.raises(ap.InvalidStreamError):
        ap.malloc(MiB, stream=s)                        # gone from the pool that made it
    ap.synchronize()                                    # the default stream of device 1
    with pytest.raises(ap.InvalidStreamError):
        ap.destroy_stream(0)                            # the default stream is not the caller's


def test_a_module_level_context_has_its_own_quota_and_does_not_nest(on_device_1):
    ctx = ap.context("module-level-tenant", quota="4MiB")
    try:
        assert ctx.device == 1 and ctx.quota == 4 * MiB
        with ctx:
            assert ap.default_pool() is ctx
            ptr = ap.malloc(3 * MiB)
            with pytest.raises(ap.QuotaExceededError):
                ap.malloc(3 * MiB)
            inner = ap.context("module-level-sibling")  # made from the process default, not ctx
            try:
                assert inner.quota is None and inner.device == 1
            finally:
                inner.close()
            ap.free(ptr)
        assert ap.default_pool() is not ctx
    finally:
        ctx.close()


def test_sharing_calls_act_on_the_default_pool_of_the_current_device(on_device_1):
    ptr = ap.share_malloc(2 * MiB)
    assert ap.default_pool(1).block_info(ptr) is not None
    handle = ap.share(ptr)
    assert isinstance(pickle.loads(pickle.dumps(handle)), ap.SharedHandle)
    assert ap.share_free(ptr) is True
    assert ap.default_pool(1).block_info(ptr) is None


def test_dump_trace_and_reset_accumulated_stats_on_the_current_device(on_device_1, tmp_path):
    pool = ap.default_pool()
    pool.record_memory_history(enabled=True, stacks=None)
    try:
        ptrs = [ap.malloc(n) for n in (1000, 3 * MiB, 512)]
        for p in ptrs:
            ap.free(p)
        trace = ap.dump_trace(tmp_path / "module.npz")
        assert (tmp_path / "module.npz").exists()
        assert trace.size[trace.op == 1].tolist()[-3:] == [1000, 3 * MiB, 512]
    finally:
        pool.record_memory_history(enabled=False)
    ap.free(ap.malloc(1000, device=0), device=0)
    on_0 = ap.memory_stats(0)["allocation.all.allocated"]
    assert on_0 >= 1 and ap.memory_stats()["allocation.all.allocated"] >= 3
    ap.reset_accumulated_stats()
    assert ap.memory_stats()["allocation.all.allocated"] == 0
    assert ap.memory_stats(0)["allocation.all.allocated"] == on_0, "only the current device's pool is reset"


def test_empty_cache_without_a_device_empties_every_devices_default_pool_as_torchs():
    before = ap.current_device()
    sizes = {}
    for dev in (0, 1):
        ap.free(ap.malloc(12 * MiB, device=dev), device=dev)   # a segment of its own, now idle
        sizes[dev] = ap.memory_reserved(dev)
        assert sizes[dev] >= 12 * MiB
    try:
        ap.set_device(0)
        ap.empty_cache()
        for dev in (0, 1):
            assert ap.memory_reserved(dev) <= sizes[dev] - 12 * MiB, f"device {dev} kept its idle segment"
        ap.free(ap.malloc(12 * MiB, device=1), device=1)
        ap.empty_cache(0)                                       # a device named: that one only
        assert ap.memory_reserved(1) >= 12 * MiB
    finally:
        ap.empty_cache(1)
        ap.set_device(before)

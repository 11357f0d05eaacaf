"""torch.cuda's module-level memory functions, under their torch names, on the default pool of
the current device: peaks, memory_snapshot, caching_allocator_alloc/delete and the per-process
memory fraction."""

import types

import numpy
import pytest

import ascend_pool as ap

MiB = 1 << 20


def test_max_memory_allocated_and_reserved_follow_peaks_until_reset():
    ap.reset_peak_memory_stats(0)
    base = ap.max_memory_allocated(0)
    a = ap.malloc(8 * MiB, device=0)
    b = ap.malloc(4 * MiB, device=0)
    peak = ap.max_memory_allocated(0)
    assert peak >= base + 12 * MiB
    assert ap.max_memory_reserved(0) >= ap.memory_reserved(0) >= 12 * MiB
    ap.free(a, device=0)
    assert ap.max_memory_allocated(0) == peak, "a peak stays after the free"
    ap.reset_peak_memory_stats(0)
    assert ap.max_memory_allocated(0) == ap.memory_allocated(0) < peak
    assert ap.max_memory_reserved(0) == ap.memory_reserved(0)
    ap.free(b, device=0)


def test_memory_snapshot_is_the_list_of_segments():
    ptr = ap.malloc(3 * MiB, device=0)
    try:
        segments = ap.memory_snapshot()
        assert isinstance(segments, list)
        blocks = [b for s in segments for b in s["blocks"] if b["address"] == ptr]
        assert len(blocks) == 1 and blocks[0]["state"] == "active_allocated"
        assert all({"device", "address", "total_size", "blocks"} <= set(s) for s in segments)
    finally:
        ap.free(ptr, device=0)


def test_each_pools_segments_carry_its_id_and_a_snapshot_can_be_asked_for_one_pool():
    # torch: segment_pool_id is (0, 0) for the default pool and a MemPool's id for its segments;
    # memory_snapshot(mempool_id) gives that pool's segments only (MemPool.snapshot()).
    default = ap.default_pool(0)
    ctx = default.context("pool-ids")
    own = ap.Pool(0, backend=default.backend)
    ptrs = [(default, default.malloc(3 * MiB)), (ctx, ctx.malloc(3 * MiB)), (own, own.malloc(3 * MiB))]
    try:
        assert default.pool_id == (0, 0)
        assert ctx.pool_id != own.pool_id and ctx.pool_id[0] == own.pool_id[0] == 0 and ctx.pool_id[1] > 0
        for pool, ptr in ptrs:
            # the default pools of other devices (other tests') share the id (0, 0): this device's
            mine = [s for s in ap.memory_snapshot(pool.pool_id) if s["device"] == 0]
            assert mine and all(s["segment_pool_id"] == pool.pool_id for s in mine)
            assert ptr in {b["address"] for s in mine for b in s["blocks"]}
            assert [s["segment_pool_id"] for s in pool.snapshot()["segments"]] == [pool.pool_id] * len(mine)
            others = [b["address"] for q, _ in ptrs if q is not pool
                      for s in ap.memory_snapshot(q.pool_id) for b in s["blocks"]]
            assert ptr not in others
        assert ap.memory_snapshot(list(ctx.pool_id)) == ap.memory_snapshot(ctx.pool_id)
    finally:
        for pool, ptr in ptrs:
            pool.free(ptr)
        ctx.close()
        own.close()


def test_memory_stats_has_torchs_reserved_bytes_by_private_pools():
    # torch 2.x memory_stats: "reserved_bytes_by_private_pools" per MemPool id, the reserved_bytes
    # {all,small_pool,large_pool}.{current,peak,allocated,freed} of that pool; flat keys join the
    # id with "_" ("...pools.0_1.all.current"), the nested dict is keyed by the id tuple and always has it
    default = ap.default_pool(0)
    before = set(ap.memory_stats_as_nested_dict(0)["reserved_bytes_by_private_pools"])  # other tests' pools
    assert (0, 0) not in before
    ctx = default.context("private-ids")
    own = ap.Pool(0, backend=default.backend)
    ptrs = [(ctx, ctx.malloc(3 * MiB)), (own, own.malloc(1000)), (own, own.malloc(5 * MiB))]
    try:
        flat, nested = ap.memory_stats(0), ap.memory_stats_as_nested_dict(0)
        assert set(nested["reserved_bytes_by_private_pools"]) == before | {ctx.pool_id, own.pool_id}
        for pool in (ctx, own):
            a, b = pool.pool_id
            theirs = pool.memory_stats()
            for kind in ("all", "small_pool", "large_pool"):
                for metric in ("current", "peak", "allocated", "freed"):
                    want = theirs[f"reserved_bytes.{kind}.{metric}"]
                    assert flat[f"reserved_bytes_by_private_pools.{a}_{b}.{kind}.{metric}"] == want
                    assert nested["reserved_bytes_by_private_pools"][pool.pool_id][kind][metric] == want
        assert flat["reserved_bytes_by_private_pools.%d_%d.small_pool.current" % own.pool_id] > 0
        assert list(flat) == sorted(flat), "an OrderedDict sorted by key, as torch's memory_stats"
        assert flat["reserved_bytes.all.current"] == default.memory_stats()["reserved_bytes.all.current"]
        with ctx:  # the context is the pool reported: the device's default pool is not a private one
            assert not any(k.startswith("reserved_bytes_by_private_pools.%d_%d." % ctx.pool_id)
                           or k.startswith("reserved_bytes_by_private_pools.0_0.") for k in ap.memory_stats(0))
    finally:
        for pool, ptr in ptrs:
            pool.free(ptr)
        ctx.close()
        own.close()
    assert set(ap.memory_stats_as_nested_dict(0)["reserved_bytes_by_private_pools"]) == before


def test_the_device_figures_do_not_build_every_other_pools_stats(monkeypatch):
    # memory_allocated() & co. (and torch.npu's, through memory_stats) built memory_stats() of
    # every other open pool of the device for reserved_bytes_by_private_pools, which they do
    # not return: 73 us alone, 7 ms with 100 pools open, each waiting for that pool's lock (and
    # a context's reading its ledger). They read the default pool; the private pools' figures
    # come from each pool's counters (less its reset_accumulated_stats base, as memory_stats).
    default = ap.default_pool(0)
    ctx = default.context("private-cost")
    own = ap.Pool(0, backend=default.backend)
    ptrs = [(ctx, ctx.malloc(3 * MiB)), (own, own.malloc(5 * MiB))]
    built = []
    real = ap.Pool.memory_stats

    def counting(self):
        built.append(self)
        return real(self)

    try:
        ctx.free(ctx.malloc(MiB))
        ctx.reset_accumulated_stats()
        ctx.free(ctx.malloc(7 * MiB))
        want = {pool.pool_id: {k: v for k, v in pool.memory_stats().items() if k.startswith("reserved_bytes.")}
                for pool in (ctx, own)}
        monkeypatch.setattr(ap.Pool, "memory_stats", counting)
        for f in (ap.memory_allocated, ap.memory_reserved, ap.max_memory_allocated, ap.max_memory_reserved,
                  ap.memory_stats, ap.memory_stats_as_nested_dict):
            f(0)
        assert not [p for p in built if p is not default], "another pool's memory_stats() was built"
        flat = ap.memory_stats(0)
        for (a, b), figures in want.items():
            for k, v in figures.items():
                assert flat[f"reserved_bytes_by_private_pools.{a}_{b}.{k[len('reserved_bytes.'):]}"] == v, k
    finally:
        monkeypatch.undo()
        for pool, ptr in ptrs:
            pool.free(ptr)
        ctx.close()
        own.close()


def test_caching_allocator_alloc_and_delete_find_the_pool_that_made_the_block():
    pool = ap.default_pool(0)
    ctx = pool.context("torch-raw")
    try:
        with ctx:
            ptr = ap.caching_allocator_alloc(1 * MiB, device=0)
        assert ctx.memory_stats()["allocated_bytes.all.current"] >= 1 * MiB
        ap.caching_allocator_delete(ptr)  # outside the context: found all the same
        assert ctx.memory_stats()["allocated_bytes.all.current"] == 0
        with pytest.raises(ap.InvalidPointerError, match="not a live block"):
            ap.caching_allocator_delete(ptr)
    finally:
        ctx.close()
    s = pool.create_stream()
    ptr = ap.caching_allocator_alloc(4096, stream=s)
    ap.caching_allocator_delete(ptr)
    # an address kept in a numpy integer, as torch's raw_delete (an int argument) and pool.free take it
    ap.caching_allocator_delete(numpy.uint64(ap.caching_allocator_alloc(4096)))
    with pytest.raises(ap.InvalidPointerError, match="int address"):
        ap.caching_allocator_delete(numpy.float64(4096))
    # torch raises TypeError for a stream of the wrong type: ours is both
    with pytest.raises(TypeError, match="stream") as e:
        ap.caching_allocator_alloc(4096, stream="side")
    assert isinstance(e.value, ap.InvalidStreamError) and isinstance(e.value, ap.StreamTypeError)
    # torch takes its Stream objects (their .cuda_stream; torch_npu's .npu_stream) as well as ints
    ap.caching_allocator_delete(ap.caching_allocator_alloc(4096, stream=types.SimpleNamespace(npu_stream=s)))
    with pytest.raises(ap.InvalidStreamError, match="stream 4660 "):  # the object's handle is the one used
        ap.caching_allocator_alloc(4096, stream=types.SimpleNamespace(cuda_stream=0x1234))
    for bad in (types.SimpleNamespace(npu_stream="s"), types.SimpleNamespace(cuda_stream=True), object()):
        with pytest.raises(ap.StreamTypeError, match="npu_stream or cuda_stream"):
            ap.caching_allocator_alloc(4096, stream=bad)


def test_caching_allocator_alloc_of_zero_bytes_is_the_null_address_as_in_torch():
    """torch.cuda.caching_allocator_alloc(0) returns 0 and caching_allocator_delete(0) does nothing
    (the allocator's raw_alloc/raw_delete); ours raised InvalidSizeError and InvalidPointerError."""
    pool = ap.default_pool(0)
    before = pool.memory_stats()
    assert ap.caching_allocator_alloc(0, device=0) == 0
    assert ap.caching_allocator_alloc(numpy.int64(0)) == 0
    ap.caching_allocator_delete(0)
    after = pool.memory_stats()
    for key in ("allocation.all.current", "allocated_bytes.all.current", "num_device_alloc"):
        assert after[key] == before[key], key
    with pytest.raises(ap.InvalidSizeError):  # only 0 is special: a negative size is still refused
        ap.caching_allocator_alloc(-1)
    with pytest.raises(ap.InvalidDeviceError):  # and the device is checked all the same
        ap.caching_allocator_alloc(0, device=99)


def test_per_process_memory_fraction_caps_the_default_pool():
    pool = ap.default_pool(0)
    total = pool.mem_get_info()[1]
    assert ap.get_per_process_memory_fraction(0) == 1.0
    try:
        ap.set_per_process_memory_fraction(0.25, 0)
        assert ap.get_per_process_memory_fraction(0) == 0.25
        with pytest.raises(ap.OutOfMemoryError):
            ap.malloc(total // 4 + 64 * MiB, device=0)
        ap.free(ap.malloc(16 * MiB, device=0), device=0)
        # torch's own test_set_per_process_memory_fraction: an int is a TypeError ("Invalid
        # type"), a float outside [0, 1] a ValueError ("Invalid fraction value")
        for bad in (1, 0, True, "half", None):
            with pytest.raises(TypeError, match="Invalid type") as raised:
                ap.set_per_process_memory_fraction(bad, 0)
            assert isinstance(raised.value, ap.ConfigError)
        for bad in (1.5, 2.0, -0.1, float("nan")):
            with pytest.raises(ValueError, match="Invalid fraction value") as raised:
                ap.set_per_process_memory_fraction(bad, 0)
            assert isinstance(raised.value, ap.ConfigError) and not isinstance(raised.value, TypeError)
        assert ap.get_per_process_memory_fraction(0) == 0.25, "a refused value changes nothing"
    finally:
        ap.set_per_process_memory_fraction(1.0, 0)
    assert ap.get_per_process_memory_fraction(0) == 1.0
    ap.free(ap.malloc(total // 4 + 64 * MiB, device=0), device=0)


def test_in_a_tenant_context_a_fraction_is_of_the_device_from_python_and_from_c():
    # A context answers mem_get_info with its quota (HAMi's view); the fraction's base was that
    # quota from Python and the device from the C hook (torch_npu) and the knob: 0.5 capped
    # 512 MiB one way and half the device the other, and the C hook's read back above 1.
    import ctypes
    lib = ctypes.CDLL(ap.library_path())
    lib.ascend_pool_set_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
    ctx = ap.default_pool(0).context("fraction-base", quota="1GiB")
    device_total = ctx.backend.mem_info(0)[1]
    try:
        with ctx:
            assert ctx.mem_get_info()[1] == 1 << 30
            ap.set_per_process_memory_fraction(0.5, 0)
            assert ctx.get_limit() == int(0.5 * device_total)
            assert ap.get_per_process_memory_fraction(0) == 0.5
            lib.ascend_pool_set_memory_fraction(0.25, 0)
            assert ctx.get_limit() == int(0.25 * device_total)
            assert ap.get_per_process_memory_fraction(0) == 0.25
    finally:
        ctx.close()


def test_the_fraction_set_through_the_c_hook_is_the_one_python_reads():
    # torch_npu calls ascend_pool_set_memory_fraction; torch.npu.get_per_process_memory_fraction
    # (patched to ours) must read that cap, not a value Python remembered.
    import ctypes
    lib = ctypes.CDLL(ap.library_path())
    lib.ascend_pool_set_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
    pool = ap.default_pool(0)
    total = pool.mem_get_info()[1]
    try:
        ap.set_per_process_memory_fraction(0.25, 0)
        lib.ascend_pool_set_memory_fraction(0.5, 0)
        assert pool.get_limit() == int(0.5 * total)
        assert abs(ap.get_per_process_memory_fraction(0) - 0.5) < 1e-9
        pool.set_limit(None)
        assert pool.get_limit() == 0 and ap.get_per_process_memory_fraction(0) == 1.0
        ap.set_per_process_memory_fraction(0.0, 0)  # torch: a cap of 0 bytes, not "no cap"
        assert pool.get_limit() == 0 and ap.get_per_process_memory_fraction(0) == 0.0
        with pytest.raises(ap.OutOfMemoryError):  # no cached block this large: a growth, refused
            pool.malloc(256 * MiB)
    finally:
        pool.set_limit(None)


def test_set_device_refuses_a_device_the_backend_does_not_have():
    """torch's set_device raises on a device that does not exist; ours did not, and every later
    module-level call of the thread then failed naming a device the caller never passed."""
    n = ap.default_pool(0).backend.device_count
    before = ap.current_device()
    for bad in (n, n + 91):
        with pytest.raises(ap.InvalidDeviceError, match=f"device {bad} does not exist"):
            ap.set_device(bad)
    assert ap.current_device() == before
    ap.set_device(n - 1)
    try:
        assert ap.memory_allocated() == ap.memory_allocated(n - 1)
    finally:
        ap.set_device(before)


def test_free_without_a_device_finds_the_block_of_another_device():
    # The current device changed between the allocation and the free (a framework switching
    # devices; HAMi charges such a free to the block's own device): ap.free(ptr) with no device
    # frees it on the pool that made it, as caching_allocator_delete does. Named with a device,
    # the free stays on that device: a wrong one is refused and frees nothing.
    n = ap.default_pool(0).backend.device_count
    assert n >= 2, "the simulated node has several devices"
    before = ap.current_device()
    ap.set_device(0)
    ptr = ap.malloc(4 * MiB)
    ap.set_device(1)
    try:
        with pytest.raises(ap.InvalidPointerError):
            ap.free(ptr, device=1)
        assert ap.default_pool(0).block_info(ptr) is not None
        ap.free(ptr)
        assert ap.default_pool(0).block_info(ptr) is None
        with pytest.raises(ap.InvalidPointerError):
            ap.free(ptr)                              # a double free is still named
        ap.set_device(0)
        s = ap.default_pool(0).create_stream()
        ptr = ap.malloc(4 * MiB, stream=s)
        ap.set_device(1)
        ap.free(ptr, stream=s)                        # with its own stream, a device-0 stream
        assert ap.default_pool(0).block_info(ptr) is None
        ap.default_pool(0).destroy_stream(s)
    finally:
        ap.set_device(before)


def test_module_free_skips_a_pool_another_thread_closed_meanwhile(monkeypatch):
    # ap.free looks for the block's owner among the device's open pools; one closed by another
    # thread after the listing (a request's context ending) must be passed over, not fail the
    # free and leave the block allocated in its open owner.
    from ascend_pool import registry

    pool = ap.default_pool(0)
    owner = pool.context("owner-of-the-block")
    gone = pool.context("closed-meanwhile")
    try:
        with owner:
            ptr = ap.malloc(MiB)
        gone.close()
        monkeypatch.setattr(registry, "device_peers", lambda p: [gone, owner])
        ap.free(ptr)
        assert owner.memory_stats()["allocated_bytes.all.current"] == 0
        with owner:
            ptr = ap.malloc(MiB)
        monkeypatch.setattr(registry, "live_pools", lambda: [gone, owner])
        ap.caching_allocator_delete(ptr)
        assert owner.memory_stats()["allocated_bytes.all.current"] == 0
    finally:
        owner.close()
        gone.close()


def test_torchs_older_names_answer_with_its_future_warning():
    """torch.cuda.memory_cached / max_memory_cached / reset_max_memory_allocated /
    reset_max_memory_cached still work in torch, with a FutureWarning; code using them runs here."""
    pool = ap.default_pool(0)
    ptr = ap.malloc(3 * MiB, device=0)
    try:
        with pytest.warns(FutureWarning, match="memory_reserved"):
            assert ap.memory_cached(0) == ap.memory_reserved(0) > 0
        with pytest.warns(FutureWarning, match="max_memory_reserved"):
            assert ap.max_memory_cached(0) == ap.max_memory_reserved(0)
        big = ap.malloc(64 * MiB, device=0)
        ap.free(big, device=0)
        assert ap.max_memory_allocated(0) > ap.memory_allocated(0)
        with pytest.warns(FutureWarning, match="resets /all/ peak"):
            ap.reset_max_memory_allocated(0)
        assert ap.max_memory_allocated(0) == ap.memory_allocated(0)
        pool.empty_cache()
        assert ap.max_memory_reserved(0) > ap.memory_reserved(0)
        with pytest.warns(FutureWarning, match="resets /all/ peak"):
            ap.reset_max_memory_cached(0)
        assert ap.max_memory_reserved(0) == ap.memory_reserved(0)
    finally:
        ap.free(ptr, device=0)


def test_module_functions_take_torchs_forms():
    # torch's memory_stats is an OrderedDict sorted by key; dump_snapshot has a default file
    # name; memory_snapshot takes (mempool_id=None, include_traces=True)
    import collections
    import os
    st = ap.memory_stats(0)
    assert isinstance(st, collections.OrderedDict) and list(st) == sorted(st)
    assert isinstance(ap.memory_snapshot(None, include_traces=False), list)
    with pytest.raises(ap.ConfigError, match="mempool_id"):
        ap.memory_snapshot("default")
    assert ap.memory_snapshot((7, 7000)) == []  # no such pool: none of its segments
    cwd = os.getcwd()
    try:
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            os.chdir(d)
            ap.dump_snapshot()
            assert os.path.getsize(os.path.join(d, "dump_snapshot.pickle")) > 0
    finally:
        os.chdir(cwd)


def test_a_fraction_set_through_the_c_hook_reads_back_as_given():
    # torch's get_per_process_memory_fraction returns the fraction set (0.3, not 0.29999999981)
    import ctypes
    lib = ctypes.CDLL(ap.library_path())
    lib.ascend_pool_set_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
    try:
        for f in (0.3, 0.7, 0.123):
            lib.ascend_pool_set_memory_fraction(f, 0)
            assert ap.get_per_process_memory_fraction(0) == f
    finally:
        ap.set_per_process_memory_fraction(1.0, 0)


def test_module_functions_take_torchs_device_forms():
    # torch.npu.memory_allocated("npu:0") / torch.device("npu", 0): the module-level functions
    # take the device as torch does; another device type is a ValueError, as torch's
    import types
    ptr = ap.malloc(3 << 20, device="npu:0")
    try:
        want = ap.memory_allocated(0)
        for form in ("npu:0", "cuda:0", types.SimpleNamespace(type="npu", index=0)):
            assert ap.memory_allocated(form) == want
        assert ap.memory_stats("npu")["allocated_bytes.all.current"] == want  # the current device
        for bad in ("cpu", "npu:x", types.SimpleNamespace(type="cpu", index=0), 1.5):
            with pytest.raises(ap.InvalidDeviceError):
                ap.memory_allocated(bad)
    finally:
        ap.free(ptr, device=0)


def test_set_device_takes_torchs_device_forms():
    """torch.npu.set_device("npu:1") and set_device(torch.device("npu", 1)) are what users write;
    ours refused every form but a plain int (README: the module-level functions take torch's forms)."""
    n = ap.default_pool(0).backend.device_count
    last = n - 1
    before = ap.current_device()
    try:
        for form in (f"npu:{last}", f"cuda:{last}", types.SimpleNamespace(type="npu", index=last), numpy.int64(last)):
            ap.set_device(0)
            ap.set_device(form)
            assert ap.current_device() == last and type(ap.current_device()) is int
        for bad in ("npu", "cpu:0", "npu:x", 1.0, True, -1, f"npu:{n}"):
            ap.set_device(0)
            with pytest.raises(ap.InvalidDeviceError):
                ap.set_device(bad)
            assert ap.current_device() == 0
    finally:
        ap.set_device(before)


def test_allocation_traceback_records_nothing_in_the_history():
    # It looked the block up through a snapshot, which records a snapshot entry in the history:
    # a tool asking where each live tensor came from filled the history's ring with them,
    # pushing out the allocations and frees it keeps (torch's records nothing).
    ap.record_memory_history(True)
    ptr = ap.malloc(MiB, device=0)
    try:
        before = len(ap.snapshot()["device_traces"][0])
        for _ in range(10):
            assert ap._allocation_traceback(ptr) is not None
        assert len(ap.snapshot()["device_traces"][0]) == before + 1  # the second snapshot's own entry
    finally:
        ap.free(ptr, device=0)
        ap.record_memory_history(None)


def test_allocation_traceback_gives_a_live_blocks_allocation_frames_from_the_pool_that_made_it():
    # torch 2.13's torch.cuda.memory._allocation_traceback(data_ptr): the frames of a live
    # allocation starting at data_ptr, None for an address inside it, a freed block, or a block
    # allocated while no frames were recorded
    def allocate_here(pool=None):
        return pool.malloc(MiB) if pool is not None else ap.malloc(MiB, device=0)

    untraced = ap.malloc(MiB, device=0)
    other = ap.Pool(0)
    ap.record_memory_history(True)
    try:
        assert ap._allocation_traceback(untraced) is None
        mine, theirs = allocate_here(), allocate_here(other)
        for ptr in (mine, theirs):
            frames = ap._allocation_traceback(ptr)
            assert frames[0]["name"] == "allocate_here" and frames[0]["filename"] == __file__
            assert set(frames[0]) == {"filename", "line", "name"}
            assert ap._allocation_traceback(ptr + 512) is None  # a view's address, as torch's
        ap.free(mine, device=0)
        assert ap._allocation_traceback(mine) is None
        assert ap._allocation_traceback(0) is None
        with pytest.raises(ap.InvalidPointerError):
            ap._allocation_traceback("0x10")
        other.free(theirs)
    finally:
        ap.record_memory_history(None)
        other.close()
        ap.free(untraced, device=0)

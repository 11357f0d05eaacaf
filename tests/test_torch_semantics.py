"""Stats, traces and knobs that carry PyTorch's names keep PyTorch's meaning (issue 18 points
1-7): what a user who ports torch.npu.memory_* code or copies PYTORCH_NPU_ALLOC_CONF relies on."""

import warnings

import pytest

import ascend_pool as ap
from ascend_pool.config import knobs_to_config, parse_conf_string

SMALL = 480  # + 32 bytes of padding: one 512-byte block


@pytest.fixture
def hpool():
    p = ap.Pool(0, backend="sim", record_history=1000)
    yield p
    p.close()


def _trace(pool):
    return pool.snapshot()["device_traces"][pool.device]


def test_freed_small_blocks_are_not_counted_as_split_inactive_memory(pool):
    a, b = pool.malloc(SMALL), pool.malloc(SMALL)
    pool.free(a)
    pool.free(b)
    st = pool.memory_stats()
    # The whole segment is free again: PyTorch's inactive_split ("non-releasable") is 0.
    assert st["inactive_split.all.current"] == 0
    assert st["inactive_split_bytes.all.current"] == 0
    assert st["inactive_split.small_pool.current"] == 0
    assert st["largest_free_block_bytes"] == 2 << 20, "the merged segment is one free block"
    pool._check_invariants()


def test_non_releasable_memory_of_wholly_free_segments_is_zero(pool):
    ptrs = [pool.malloc(SMALL + 512 * (i % 7)) for i in range(400)]
    for p in ptrs[::2] + ptrs[1::2]:
        pool.free(p)
    st = pool.memory_stats()
    assert st["allocated_bytes.all.current"] == 0
    assert st["inactive_split_bytes.all.current"] == 0
    assert st["cached_free_bytes"] == st["reserved_bytes.all.current"]
    assert "Non-releasable memory" in pool.memory_summary()
    snap = pool.snapshot()
    for seg in snap["segments"]:
        assert [b["state"] for b in seg["blocks"]] == ["inactive"], "a free segment is one inactive block"
    pool._check_invariants()


def test_split_inactive_counts_a_hole_between_live_blocks(pool):
    a, b, c = (pool.malloc(SMALL) for _ in range(3))
    pool.free(b)
    st = pool.memory_stats()
    # b's hole and the segment's free tail: two split inactive blocks, as in PyTorch.
    assert st["inactive_split.all.current"] == 2
    assert st["inactive_split_bytes.all.current"] == (2 << 20) - 2 * 512
    pool.free(a)
    st = pool.memory_stats()
    assert st["inactive_split.all.current"] == 2  # a and b merged into one hole
    pool.free(c)
    assert pool.memory_stats()["inactive_split.all.current"] == 0


def test_same_size_reuse_still_hits(pool):
    a = pool.malloc(SMALL)
    pool.free(a)
    assert pool.malloc(SMALL) == a


def test_device_traces_record_requested_sizes(hpool):
    p = hpool.malloc(1000)
    q = hpool.malloc(3 << 20)
    hpool.free(p)
    hpool.free(q)
    trace = _trace(hpool)
    by_action = {}
    for e in trace:
        by_action.setdefault(e["action"], []).append(e["size"])
    assert by_action["alloc"] == [1000, 3 << 20]
    assert by_action["free_requested"] == [1000, 3 << 20]
    assert by_action["free_completed"] == [1000, 3 << 20]
    assert all(s % (2 << 20) == 0 for s in by_action["segment_alloc"]), "segments keep their own size"


def test_request_larger_than_device_counts_as_oom(hpool):
    total = hpool.memory_stats()["device_total_bytes"]
    with pytest.raises(ap.OutOfMemoryError):
        hpool.malloc(total + 1)
    st = hpool.memory_stats()
    # torch counts the failed device call's retry too (alloc_block(isRetry=true) after freeing its cache)
    assert st["num_ooms"] == 1 and st["num_alloc_retries"] == 1
    ooms = [e for e in _trace(hpool) if e["action"] == "oom"]
    assert len(ooms) == 1 and ooms[0]["size"] == total + 1
    hpool.free(hpool.malloc(4096))  # and the pool keeps serving


def test_snapshot_trace_is_gathered_before_its_own_snapshot_event(hpool):
    hpool.free(hpool.malloc(4096))
    first = _trace(hpool)
    assert [e["action"] for e in first if e["action"] == "snapshot"] == []
    assert first[-1]["action"] == "free_completed"
    second = _trace(hpool)
    assert [e["action"] for e in second].count("snapshot") == 1, "the first snapshot shows in the next one"


def test_a_snapshot_event_records_the_bytes_active_then(hpool):
    """torch's snapshot() records its trace entry with the total active bytes as its size."""
    live = [hpool.malloc(n) for n in (3 << 20, 5000)]
    active = hpool.memory_stats()["active_bytes.all.current"]
    assert active >= (3 << 20) + 5000
    _trace(hpool)
    hpool.free(live.pop())
    snaps = [e for e in _trace(hpool) if e["action"] == "snapshot"]
    assert [e["size"] for e in snaps] == [active]  # before: 0
    hpool.free(live.pop())


def test_empty_cache_counts_a_sync_of_all_streams(pool):
    before = pool.memory_stats()["num_sync_all_streams"]
    pool.free(pool.malloc(4096))
    pool.empty_cache()
    assert pool.memory_stats()["num_sync_all_streams"] == before + 1
    pool.empty_cache()
    assert pool.memory_stats()["num_sync_all_streams"] == before + 2


# -- point 7: every key torch_npu's NPUAllocatorConfig accepts --------------------------------

TOTAL = 64 << 30


def _cfg(text):
    return knobs_to_config(parse_conf_string(text), TOTAL, TOTAL)


def test_roundup_power2_divisions_rounds_like_pytorch():
    p = ap.Pool(0, backend="sim", roundup_power2_divisions=4, pad_bytes=0)
    try:
        # PyTorch: 1.1 MiB with 4 divisions per power of two rounds up to 1.25 MiB.
        assert p.round_size(int(1.1 * 2**20)) == 5 * 2**18
        assert p.round_size(2**20) == 2**20           # powers of two stay
        assert p.round_size(1000) == 1024             # small sizes: 512-byte rounding only
        assert p.round_size(5000) == 5120             # 4 divisions apply above 512 * 4 bytes
        ptr = p.malloc(int(1.1 * 2**20))
        assert p.block_info(ptr)[1] == 5 * 2**18
        p.free(ptr)
    finally:
        p.close()


def test_roundup_power2_divisions_list_form_from_the_environment():
    text = "expandable_segments:False,roundup_power2_divisions:[256:4,512:2,>:1],max_split_size_mb:100"
    knobs = parse_conf_string(text)
    assert knobs["roundup_power2_divisions"] == "[256:4,512:2,>:1]"
    cfg = knobs_to_config(knobs, TOTAL, TOTAL)
    assert cfg["max_split_size"] == 100 << 20
    p = ap.Pool(0, backend="sim", roundup_power2_divisions="[1:4,2:8,>:1]", pad_bytes=0)
    try:
        assert p.round_size(int(1.1 * 2**20)) == 5 * 2**18          # 1 MiB interval: 4 divisions
        assert p.round_size(int(2.1 * 2**20)) == 2**21 + 2**18      # 2 MiB interval: 8 divisions
        assert p.round_size(int(4.1 * 2**20)) == int(4.1 * 2**20) + 512 - int(4.1 * 2**20) % 512
    finally:
        p.close()


@pytest.mark.parametrize("bad", ["roundup_power2_divisions:3", "roundup_power2_divisions:[256:4,>]",
                                 "roundup_power2_divisions:[300:4]"])
def test_roundup_power2_divisions_bad_values_are_config_errors(bad):
    with pytest.raises(ap.ConfigError, match="roundup_power2_divisions"):
        _cfg(bad)


@pytest.mark.parametrize("bad,named", [
    ("large_segment_size_mb:5", "large_segment_size_mb"),                          # torch: must be > 10 MB
    ("large_segment_size_mb:50,max_split_size_mb:30", "max_split_size_mb"),         # below the large segment
    ("large_segment_size_mb:64,max_non_split_rounding_mb:32", "max_non_split_rounding_mb"),
    ("large_segment_size_mb:abc", "large_segment_size_mb"),
    ("segment_size_mb:abc", "segment_size_mb"), ("segment_size_mb:10", "segment_size_mb"),
    ("segment_size_mb:1024", "segment_size_mb"),                                  # torch_npu: 20 to 512
    ("multi_stream_lazy_reclaim:none", "multi_stream_lazy_reclaim"),
    ("release_lock_on_npumalloc:none", "release_lock_on_npumalloc"),
    ("throw_on_npumalloc_oom:maybe", "throw_on_npumalloc_oom"),                  # torch_npu's test_config_parsing_invalid_value
    ("base_addr_aligned_kb:abc", "base_addr_aligned_kb"),
])
def test_segment_size_values_torch_npu_refuses_are_config_errors(bad, named):
    # torch_npu's test_large_segment_size (test_invalid_large_segment_size_rejected,
    # test_max_split_size_less_than_large_segment_rejected): the process fails at start. These
    # were accepted with a "has no effect" warning.
    with pytest.raises(ap.ConfigError, match=named):
        _cfg(bad)


def test_large_segment_size_is_the_segment_medium_requests_share():
    # PyTorch's large_segment_size_mb (kLargeBuffer): requests from 1 to 10 MiB are cut from
    # segments of this size (20 MiB by default).
    for conf, segment in ((None, 20 << 20), ("large_segment_size_mb:64", 64 << 20)):
        pool = ap.Pool(0, backend="sim", **({} if conf is None else {"large_segment_size_mb": conf.split(":")[1]}))
        try:
            ptrs = [pool.malloc(3 << 20) for _ in range(4)]
            st = pool.memory_stats()
            assert st["reserved_bytes.large_pool.current"] == segment and st["segment.large_pool.current"] == 1, st
            for p in ptrs:
                pool.free(p)
        finally:
            pool.close()


def test_every_torch_npu_key_is_accepted_with_one_warning_where_it_means_nothing():
    text = ("base_addr_aligned_kb:16,pin_memory_expandable_segments:False,pinned_mem_register:False,"
            "segment_size_mb:64,multi_stream_lazy_reclaim:True,pinned_reserve_segment_size_mb:8,"
            "release_lock_on_npumalloc:True,max_non_split_rounding_mb:256,pinned_use_background_threads:False,"
            "per_process_memory_fraction:0.5,page_size:1g,garbage_collection_threshold:0.6,"
            "throw_on_npumalloc_oom:True")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cfg = _cfg(text)
        _cfg(text)
    assert cfg["limit_bytes"] == TOTAL // 2 and cfg["page_size"] == 1 << 30 and cfg["gc_threshold"] == 0.6
    msgs = [str(x.message) for x in w]
    for key in ("base_addr_aligned_kb", "segment_size_mb", "multi_stream_lazy_reclaim", "release_lock_on_npumalloc",
                "throw_on_npumalloc_oom"):
        assert sum(repr(key) in m for m in msgs) == 1, f"{key}: one warning, once per process"
    with pytest.raises(ap.ConfigError, match="no_such_knob"):
        _cfg("no_such_knob:1")

"""A snapshot's allocator_settings report what PyTorch's _snapshot() reports, with the pool's
effective values (defaults included), not only the knobs the user set."""

import warnings

import ascend_pool as ap

MiB = 1 << 20
INTERVALS = [str(1 << i) for i in range(16)]  # PyTorch's keys: interval starts in MiB, "1" .. "32768"


def test_a_pool_without_knobs_reports_its_defaults(monkeypatch):
    monkeypatch.delenv("ASCEND_POOL_CONF", raising=False)
    pool = ap.Pool(0)
    try:
        settings = pool.snapshot()["allocator_settings"]
    finally:
        pool.close()
    assert settings["max_split_size"] == -1, "unlimited, as PyTorch reports SIZE_MAX"
    assert settings["garbage_collection_threshold"] == 0.0
    assert settings["expandable_segments"] is False
    assert settings["roundup_power2_divisions"] == dict.fromkeys(INTERVALS, 0)
    assert settings["release_lock_on_cudamalloc"] is False and settings["pinned_use_cuda_host_register"] is False
    assert settings["pinned_num_register_threads"] == 1
    assert settings["ASCEND_POOL_CONF"] == ""


def test_knobs_appear_with_their_effective_values(monkeypatch):
    monkeypatch.setenv("ASCEND_POOL_CONF", "garbage_collection_threshold:0.6")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the PyTorch keys' one-time "no effect" warning
        pool = ap.Pool(0, max_split_size_mb=40, roundup_power2_divisions="[64:8,>:1]", release_policy="never",
                       pinned_use_cuda_host_register="True", pinned_num_register_threads=8)
    try:
        settings = pool.snapshot()["allocator_settings"]
    finally:
        pool.close()
    assert settings["max_split_size"] == 40 * MiB
    assert settings["garbage_collection_threshold"] == 0.6
    divisions = settings["roundup_power2_divisions"]
    assert list(divisions) == INTERVALS
    assert [divisions[k] for k in ("1", "32", "64", "128", "32768")] == [8, 8, 8, 1, 1]
    assert settings["pinned_use_cuda_host_register"] is True and settings["pinned_num_register_threads"] == 8
    assert settings["release_policy"] == "never", "ascend_pool's own knobs under their names"
    assert "garbage_collection_threshold:0.6" in settings["ASCEND_POOL_CONF"]
    assert "max_split_size_mb:40" in settings["ASCEND_POOL_CONF"]

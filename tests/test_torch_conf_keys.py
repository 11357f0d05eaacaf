"""PyTorch's allocator settings copied into ASCEND_POOL_CONF: every key PYTORCH_CUDA_ALLOC_CONF
accepts is accepted here (a key meaningless for this pool warns once and is ignored), and a value
PyTorch refuses for such a key is a ConfigError naming the key, as in PyTorch."""

import warnings

import pytest

import ascend_pool as ap
from ascend_pool import config
from ascend_pool.config import knobs_to_config, parse_conf_string

GiB = 1 << 30

# A setting as a PyTorch user writes it (c10's AllocatorConfig tests and the CUDA docs' keys).
TORCH_SETTING = ("max_split_size_mb:40,max_non_split_rounding_mb:30,garbage_collection_threshold:0.5,"
                 "roundup_power2_divisions:[64:8,>:1],expandable_segments:False,backend:native,"
                 "pinned_use_cuda_host_register:True,pinned_num_register_threads:8,"
                 "pinned_use_background_threads:True,release_lock_on_cudamalloc:False,"
                 "graph_capture_record_stream_reuse:True,pinned_reserve_segment_size_mb:64,"
                 "per_process_memory_fraction:0.5")


def cfg(text):
    return knobs_to_config(parse_conf_string(text), 64 * GiB, 64 * GiB, "acl")


def test_a_pytorch_cuda_alloc_conf_string_is_accepted(monkeypatch):
    monkeypatch.setattr(config, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = cfg(TORCH_SETTING)
    assert out["max_split_size"] == 40 << 20 and out["gc_threshold"] == 0.5 and out["limit_bytes"] == 32 * GiB
    warned = " ".join(str(w.message) for w in caught)
    for key in ("pinned_use_cuda_host_register", "pinned_num_register_threads", "graph_capture_record_stream_reuse",
                "release_lock_on_cudamalloc", "backend"):
        assert f"'{key}'" in warned and "no effect" in warned, key


def test_each_meaningless_key_warns_once_per_process(monkeypatch):
    monkeypatch.setattr(config, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg("pinned_use_cuda_host_register:True")
        cfg("pinned_use_cuda_host_register:False")
    assert [str(w.message).count("pinned_use_cuda_host_register") for w in caught] == [1]


def test_a_pool_opens_with_pytorch_keys(monkeypatch):
    monkeypatch.setenv("ASCEND_POOL_CONF", "pinned_use_cuda_host_register:True,throw_on_cudamalloc_oom:False")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pool = ap.Pool(0)
    try:
        pool.free(pool.malloc(4096))
    finally:
        pool.close()


@pytest.mark.parametrize("text,named", [
    ("pinned_use_background_threads:yes", "pinned_use_background_threads"),
    ("release_lock_on_cudamalloc:1", "release_lock_on_cudamalloc"),
    ("pinned_num_register_threads:3", "pinned_num_register_threads"),      # not a power of two
    ("pinned_num_register_threads:256", "pinned_num_register_threads"),    # over PyTorch's 128
    ("pinned_reserve_segment_size_mb:0", "pinned_reserve_segment_size_mb"),
    ("max_non_split_rounding_mb:10", "max_non_split_rounding_mb"),         # below 20 MiB
    ("backend:fastest", "backend"),
    ("pinned_use_host_register:none", "pinned_use_host_register"),     # torch's True/False rule
])
def test_values_pytorch_refuses_are_config_errors_naming_the_key(text, named):
    with pytest.raises(ap.ConfigError, match=named):
        cfg(text)


def test_pytorchs_expandable_segment_reserve_keys_are_accepted(monkeypatch):
    """PyTorch 2.10's expandable_segments_reserve (a fraction, or GiB with G) and its per-class
    form: accepted and ignored with one warning each; a malformed value only warns, as in
    PyTorch (its default is kept), while a broken [class:value] list is an error there too."""
    monkeypatch.setattr(config, "_warned", set())
    text = "expandable_segments:True,expandable_segments_reserve:0.5,expandable_segments_reserve_by_class:[tiny:0.05,big:40G]"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = cfg(text)
    assert out["expandable"] == 1
    warned = [str(w.message) for w in caught]
    for key in ("expandable_segments_reserve", "expandable_segments_reserve_by_class"):
        assert any(f"'{key}'" in m and "no effect" in m for m in warned), (key, warned)
    assert not any("invalid" in m for m in warned), warned
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg("expandable_segments_reserve:-1,expandable_segments_reserve_by_class:[tiny:abc]")
    bad = [str(w.message) for w in caught if "invalid" in str(w.message)]
    assert len(bad) == 2 and "'-1'" in bad[0] and "'abc'" in bad[1], bad


@pytest.mark.parametrize("text", ["expandable_segments_reserve_by_class:tiny:0.05",
                                  "expandable_segments_reserve_by_class:[tiny]"])
def test_a_reserve_class_list_pytorch_cannot_parse_is_a_config_error(text):
    with pytest.raises(ap.ConfigError, match="expandable_segments_reserve_by_class"):
        cfg(text)


def test_per_process_memory_fraction_zero_is_pytorchs_no_memory_cap(monkeypatch):
    """PyTorch accepts per_process_memory_fraction:0 (its range is [0, 1]): every allocation is
    then refused, a typed OutOfMemoryError, and the pool keeps serving once the cap is raised."""
    assert cfg("per_process_memory_fraction:0")["limit_bytes"] == 0
    with pytest.raises(ap.ConfigError, match=r"memory_fraction: must be in \(0, 1\]"):
        cfg("memory_fraction:0")
    pool = ap.Pool(0, backend="sim", per_process_memory_fraction=0)
    try:
        with pytest.raises(ap.OutOfMemoryError):
            pool.malloc(4096)
        pool.set_limit(None)
        pool.free(pool.malloc(4096))
    finally:
        pool.close()

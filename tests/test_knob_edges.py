"""Every allocator knob at the edges of what it accepts: the last value accepted becomes exactly
the config field it documents; the first value past the edge is a ConfigError naming the knob."""

import pytest

from ascend_pool.config import DEFAULT_HISTORY, MAX_HISTORY_ENTRIES, knobs_to_config
from ascend_pool.errors import ConfigError

MiB, GiB = 1 << 20, 1 << 30
TOTAL, FREE = 64 * GiB, 60 * GiB


def cfg(**knobs):
    return knobs_to_config(knobs, TOTAL, FREE)


@pytest.mark.parametrize("knob,value,field,expected", [
    ("max_split_size_mb", "20.5", "max_split_size", int(20.5 * MiB)),
    ("max_split_size_mb", 21, "max_split_size", 21 * MiB),
    ("max_split_size_mb", 2**43 - 1, "max_split_size", (2**43 - 1) * MiB),
    ("garbage_collection_threshold", "1e-9", "gc_threshold", 1e-9),
    ("garbage_collection_threshold", 0.999999, "gc_threshold", 0.999999),
    ("reserve", "0.5", "reserve_bytes", 30 * GiB),
    ("reserve", "100%", "reserve_bytes", FREE),
    ("reserve", 1.0, "reserve_bytes", FREE),
    ("reserve", "60GiB", "reserve_bytes", FREE),      # exactly the free memory
    ("reserve", "1", "reserve_bytes", 1),             # "1" is one byte, not 100 %
    ("reserve", "0", "reserve_bytes", 0),
    ("reserve", "64GB", "reserve_bytes", 64 * 10**9),  # decimal: fits in the 60 GiB free (64 GiB would not)
    ("record_history", "true", "history_capacity", DEFAULT_HISTORY),
    ("record_history", "off", "history_capacity", 0),
    ("record_history", 0, "history_capacity", 0),
    ("record_history", 2**63 - 1, "history_capacity", MAX_HISTORY_ENTRIES),  # clamped, as the calls are
    ("page_size", "2M", "page_size", 2 * MiB),
    ("page_size", "2MiB", "page_size", 2 * MiB),
    ("page_size", str(2 * MiB), "page_size", 2 * MiB),
    ("page_size", "1G", "page_size", GiB),
    ("page_size", "1gb", "page_size", GiB),
    ("expandable_segments", "True", "expandable", 1),
    ("expandable_segments", "0", "expandable", 0),
    ("memory_fraction", 1, "limit_bytes", TOTAL),
    ("memory_fraction", "0.25", "limit_bytes", TOTAL // 4),
    ("per_process_memory_fraction", 1e-9, "limit_bytes", int(1e-9 * TOTAL)),
    ("sync_timeout_ms", -1, "sync_timeout_ms", -1),
    ("sync_timeout_ms", 1, "sync_timeout_ms", 1),
    ("sync_timeout_ms", 2**31 - 1, "sync_timeout_ms", 2**31 - 1),
    ("pad_bytes", 0, "pad_bytes", 0),
    ("pad_bytes", "4096", "pad_bytes", 4096),
])
def test_last_accepted_value_sets_its_field_exactly(knob, value, field, expected):
    assert cfg(**{knob: value})[field] == expected


@pytest.mark.parametrize("knob,value", [
    ("max_split_size_mb", 20), ("max_split_size_mb", "20"), ("max_split_size_mb", 2**43), ("max_split_size_mb", "nan"),
    ("garbage_collection_threshold", 0), ("garbage_collection_threshold", 1), ("garbage_collection_threshold", -0.1),
    ("garbage_collection_threshold", "inf"),
    ("reserve", "0%"), ("reserve", "100.1%"), ("reserve", 1.5), ("reserve", FREE + 1), ("reserve", "64GiB"), ("reserve", "-1GiB"),
    ("record_history", -1), ("record_history", 2**63), ("record_history", "maybe"),
    ("page_size", "4m"), ("page_size", "1m"), ("page_size", "2g"), ("page_size", 0),
    ("expandable_segments", "2"), ("expandable_segments", ""),
    ("memory_fraction", 0), ("memory_fraction", "1.0001"), ("per_process_memory_fraction", -1),
    ("sync_timeout_ms", 0), ("sync_timeout_ms", -2), ("sync_timeout_ms", 2**31), ("sync_timeout_ms", "1.5"),
    ("pad_bytes", -1), ("pad_bytes", 4097),
    ("release_policy", "sometimes"), ("stream_reuse", "shared"), ("no_such_knob", 1),
])
def test_first_value_past_the_edge_is_a_config_error_naming_the_knob(knob, value):
    with pytest.raises(ConfigError, match=knob):
        cfg(**{knob: value})


def test_defaults_without_knobs():
    assert cfg() == {"pad_bytes": 32}
    assert knobs_to_config({}, TOTAL, FREE, backend_kind="cuda") == {"pad_bytes": 0}


@pytest.mark.parametrize("cap", ["memory_fraction", "per_process_memory_fraction"])
def test_a_reserve_past_the_memory_fraction_cap_is_a_config_error_naming_both(cap):
    """RMM refuses an initial pool size above its maximum at construction; here the same mistake
    used to surface as an OutOfMemoryError 'limit reached' when the pool opened."""
    assert cfg(reserve="32GiB", **{cap: 0.5})["reserve_bytes"] == 32 * GiB  # exactly the cap
    with pytest.raises(ConfigError, match=f"reserve: .* more than the {cap} cap"):
        cfg(reserve=32 * GiB + 1, **{cap: 0.5})  # taken in whole 2 MiB pages: 32 GiB + 2 MiB


def test_the_cap_named_is_the_one_in_force():
    with pytest.raises(ConfigError, match="more than the per_process_memory_fraction cap"):
        knobs_to_config({"memory_fraction": 0.9, "per_process_memory_fraction": 0.25, "reserve": "20GiB"}, TOTAL, FREE)

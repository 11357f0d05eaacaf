"""ascend-pool replay: the CLI, its JSON, and the figures' meaning."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ascend_pool.replay import replay
from ascend_pool.traces import bundled_traces_dir, load_trace, peak_live_bytes

KEYS = ("allocs", "frees", "seconds", "ops_per_second", "peak_live_bytes", "peak_reserved_bytes",
        "fragmentation_ratio", "reserved_to_live_ratio", "device_mallocs", "device_frees", "device_calls_steady",
        "final_allocated_bytes")


def bundled(name):
    return os.path.join(bundled_traces_dir(), name + ".npz")


@pytest.mark.parametrize("mode", ["pool", "direct"])
def test_cli_replay_json(mode):
    out = subprocess.run([sys.executable, "-m", "ascend_pool.cli", "replay", bundled("bert_serving_varlen_prefix"),
                          "--backend", "sim", "--mode", mode, "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    for k in KEYS:
        assert k in r
    trace = load_trace(bundled("bert_serving_varlen_prefix"))
    assert r["allocs"] == int(trace.op.sum()) and r["frees"] == len(trace.op) - r["allocs"]
    assert r["peak_live_bytes"] == peak_live_bytes(trace)
    assert r["final_allocated_bytes"] == 0
    assert r["reserved_to_live_ratio"] == pytest.approx(r["peak_reserved_bytes"] / r["peak_live_bytes"])
    # the metric's meaning (0..1), not reserved/live
    assert 0.0 <= r["fragmentation_ratio"] <= 1.0
    if mode == "direct":
        assert r["fragmentation_ratio"] == 0.0  # nothing is ever cached
        assert r["device_mallocs"] == r["allocs"] and r["device_frees"] == r["frees"]
    else:
        assert r["device_mallocs"] < r["allocs"] / 20


def test_two_stream_trace_replays_on_two_streams():
    r = replay(bundled("resnet18_train_prefetch_2stream_prefix"), backend="sim")
    assert r["final_allocated_bytes"] == 0
    assert r["pool_stats"]["allocation.all.allocated"] == r["allocs"]


def test_replay_of_a_broken_trace_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.npz"
    np.savez(bad, op=np.array([0], np.int8), id=np.array([1]), size=np.array([10]), stream=np.array([0], np.int32))
    out = subprocess.run([sys.executable, "-m", "ascend_pool.cli", "replay", str(bad)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert "ValueError" in out.stderr and "free" in out.stderr


def test_fragmentation_ratio_is_the_metrics_value_at_the_peak_of_reserved():
    """replay's fragmentation_ratio is what ascend_pool_fragmentation_ratio (1 - largest free block /
    cached free bytes) reads right after the allocation that first reaches peak reserved: the same
    sequence driven from Python, reading pool.memory_stats() after every allocation, gives it."""
    from ascend_pool.backend import open_backend
    from ascend_pool.pool import Pool
    from ascend_pool.traces import trace_from_arrays

    MiB = 1 << 20
    # three 6 MiB blocks, the middle one freed, then one that cannot fit the hole: the pool grows
    # while a 6 MiB hole is cached
    op = [1, 1, 1, 0, 1, 0, 0, 0]
    ids = [1, 2, 3, 2, 4, 1, 3, 4]
    size = [6 * MiB, 6 * MiB, 6 * MiB, 6 * MiB, 30 * MiB, 6 * MiB, 6 * MiB, 30 * MiB]
    tr = trace_from_arrays(np.array(op, np.int8), np.array(ids), np.array(size), name="hole")
    r = replay(tr, backend="sim")
    be = open_backend("sim")
    pool = Pool(0, backend=be)
    try:
        ptrs, high, expect = {}, 0, None
        for o, i, s in zip(op, ids, size):
            if o:
                ptrs[i] = pool.malloc(s)
                st = pool.memory_stats()
                if st["reserved_bytes.all.current"] > high:
                    high = st["reserved_bytes.all.current"]
                    expect = st["external_fragmentation"]
            else:
                pool.free(ptrs.pop(i))
    finally:
        pool.close()
    assert r["peak_reserved_bytes"] == high
    assert r["fragmentation_ratio"] == pytest.approx(expect)
    assert r["reserved_to_live_ratio"] == pytest.approx(high / r["peak_live_bytes"])


def test_pool_knobs_that_are_no_mapping_are_a_config_type_error_naming_them():
    # the knob string itself, or any non-mapping: Pool(**pool_knobs)'s bare TypeError before
    # ("argument after ** must be a mapping, not str"), naming neither pool_knobs nor the fix
    import ascend_pool as ap

    for knobs in ("max_split_size_mb:100", 5, ["a"]):
        with pytest.raises(ap.ConfigTypeError, match=r"^pool_knobs must be a dict of allocator knobs .* got "):
            replay(bundled("bert_serving_varlen_prefix"), backend="sim", pool_knobs=knobs)
    r = replay(bundled("bert_serving_varlen_prefix"), backend="sim", pool_knobs={"max_split_size_mb": "100"})
    assert r["final_allocated_bytes"] == 0


def test_direct_mode_gives_back_what_the_trace_leaves_allocated():
    # a snapshot's trace ends with its live tensors allocated: direct mode's device allocations of
    # them were never freed, so each replay (each bench run of the direct allocator) kept them
    from ascend_pool import sim
    from ascend_pool.traces import trace_from_arrays

    trace = trace_from_arrays(np.array([1, 1, 0], np.int8), np.array([0, 1, 0]),
                              np.array([1 << 20, 3 << 20, 1 << 20], np.int64), np.zeros(3, np.int32),
                              name="live_at_end")
    replay(trace, backend="sim", mode="direct")  # the backend open, the device's first figures
    held = sim.stats(0)["bytes_held"]
    for _ in range(3):
        r = replay(trace, backend="sim", mode="direct")
        assert r["final_allocated_bytes"] == 3 << 20  # the figure still says what was left
        assert sim.stats(0)["bytes_held"] == held


def test_a_failed_device_call_in_direct_mode_is_a_device_error_with_the_runtimes_reason():
    # direct mode returned the runtime's code (207001) as the status, which no error type maps:
    # "PoolError: pool call failed (207001): device malloc of 256 bytes failed (207001)", the
    # runtime's reason (out of device memory, an injected fault) lost
    from ascend_pool import DeviceError, sim

    replay(bundled("resnet18_train_prefix"), backend="sim", mode="direct")  # the backend open
    held = sim.stats(0)["bytes_held"]
    sim.set_faults(fail_malloc_nth=5)
    try:
        with pytest.raises(DeviceError) as e:
            replay(bundled("resnet18_train_prefix"), backend="sim", mode="direct")
    finally:
        sim.reset_faults()
    assert e.value.code == 207001
    assert "device malloc of" in str(e.value) and "on device 0 failed (207001)" in str(e.value)
    assert "fail_malloc_nth" in str(e.value)  # the runtime's own reason
    assert sim.stats(0)["bytes_held"] == held  # what it had allocated went back


def test_pool_mode_frees_what_the_trace_leaves_allocated_before_closing_its_pool(caplog):
    # `ascend-pool replay SNAPSHOT.pickle` (a snapshot ends with its live tensors) closed the pool
    # with them allocated, and the close warned the user "closed with 2 block(s) still allocated
    # ... free them before close()", blocks that were the replay's own
    import logging

    from ascend_pool.traces import trace_from_arrays

    trace = trace_from_arrays(np.array([1, 1, 0], np.int8), np.array([0, 1, 0]),
                              np.array([1 << 20, 3 << 20, 1 << 20], np.int64), np.zeros(3, np.int32),
                              name="live_at_end")
    with caplog.at_level(logging.WARNING, logger="ascend_pool"):
        r = replay(trace, backend="sim", mode="pool")
    assert r["final_allocated_bytes"] >= 3 << 20  # the figure still says what was left
    assert not [m for m in caplog.messages if "still allocated" in m]

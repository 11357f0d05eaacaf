"""bench/call_sources.py, the tool that tells a workload's own growth from the policy's trades in
a call-target miss: its counts must add up to the replay's device calls, whole and steady, and it
must sort a hand-made sequence's calls as a reader would."""
import importlib.util
import os

import numpy as np
import pytest

from ascend_pool.replay import replay
from ascend_pool.traces import trace_from_arrays

MiB = 1 << 20
TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "call_sources.py")


@pytest.fixture(scope="module")
def call_sources():
    spec = importlib.util.spec_from_file_location("call_sources", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.call_sources


def _random_trace(seed, n=1500):
    """Allocations of mixed sizes on two streams, each freed a little later: phases of growing
    sizes so that the pool grows, trades and refills."""
    rng = np.random.default_rng(seed)
    op, ids, size, stream, live = [], [], [], [], {}
    for i in range(n):
        if live and (rng.random() < 0.45 or len(live) > 40):
            k = list(live)[int(rng.integers(len(live)))]
            s, st = live.pop(k)
            op.append(0), ids.append(k), size.append(s), stream.append(st)
        else:
            scale = 1 + 4 * (i // 300)
            s = int(rng.choice([700, 60_000, 3 * MiB, 12 * MiB]) * scale * rng.uniform(0.5, 1.5))
            st = int(rng.integers(2))
            live[i] = (s, st)
            op.append(1), ids.append(i), size.append(s), stream.append(st)
    for k, (s, st) in live.items():
        op.append(0), ids.append(k), size.append(s), stream.append(st)
    return trace_from_arrays(op, ids, size, stream, name=f"random{seed}")


@pytest.mark.parametrize("knobs", [{}, {"expandable_segments": True}], ids=["classic", "expandable"])
@pytest.mark.parametrize("seed", [1, 2])
def test_counts_add_up_to_the_replays_device_calls(call_sources, knobs, seed):
    trace = _random_trace(seed)
    c = call_sources(trace, knobs)
    r = replay(trace, "sim", pool_knobs=knobs)
    first = c["peak"][0] + c["refill"][0] + c["release"][0]
    second = c["peak"][1] + c["refill"][1] + c["release"][1]
    assert first + second == r["device_calls"] > 0
    assert second == r["device_calls_steady"]
    assert c["second_half_allocs"] == int((trace.op[trace.n_events // 2:] == 1).sum())


def test_a_hand_made_sequence_is_sorted_as_a_reader_would(call_sources):
    # 30 MiB (a growth to a new high), freed, 30 MiB again (cached: no call), then 50 MiB beside it
    # (nothing idle to trade: a new high, 80 MiB); both freed; then 80 MiB, which no idle segment
    # holds: a trade, its two idle segments released and one growth back up to the 80 MiB high.
    op = [1, 0, 1, 1, 0, 0, 1, 0]
    ids = [1, 1, 2, 3, 2, 3, 4, 4]
    size = [30 * MiB, 30 * MiB, 30 * MiB, 50 * MiB, 30 * MiB, 50 * MiB, 80 * MiB, 80 * MiB]
    c = call_sources(trace_from_arrays(op, ids, size), {})
    assert c["peak"] == [2, 0]
    assert c["refill"] == [0, 1] and c["release"] == [0, 2]

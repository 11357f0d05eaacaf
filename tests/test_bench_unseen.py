"""bench/unseen_check.py, the workload families no shared trace was derived from: each family's
workload is the same for the same seed, is a valid trace that ends with everything freed, keeps
the shape its --help promises, survives the .npz round trip and replays through ascend_pool and
the torch_npu_policy model with the same allocations; the script's run reports every workload."""
import importlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ascend_pool.bench import torch_npu_policy
from ascend_pool.replay import replay
from ascend_pool.traces import load_trace

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


@pytest.fixture(scope="module")
def unseen():
    # imported by name, as the script runs: its pool's workers unpickle its functions by module name
    sys.path.insert(0, BENCH)
    try:
        yield importlib.import_module("unseen_check")
    finally:
        sys.path.remove(BENCH)
        for m in ("unseen_check", "placement_check", "call_sources"):
            sys.modules.pop(m, None)


FAMILIES = ["rmm_uniform", "rmm_normal", "rmm_geometric", "torch_fuzz", "kv_serving", "dp_multistream",
            "tiny_huge", "ratchet", "two_phase"]


def test_the_families_are_the_documented_ones(unseen):
    assert list(unseen.FAMILIES) == FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_is_deterministic_per_seed_and_ends_with_everything_freed(unseen, family):
    a, b, c = unseen.generate(family, 3), unseen.generate(family, 3), unseen.generate(family, 4)
    for x in ("op", "slot", "size", "stream"):
        assert np.array_equal(getattr(a, x), getattr(b, x))
    assert a.meta == b.meta
    assert a.n_events != c.n_events or not np.array_equal(a.size, c.size)  # another seed, another workload
    live = np.cumsum(np.where(a.op == 1, a.size, -a.size))
    assert live[-1] == 0 and a.n_allocs * 2 == a.n_events and a.n_allocs > 1000


def test_the_families_keep_the_shapes_their_help_promises(unseen):
    for s in range(3):
        th = unseen.generate("tiny_huge", s)
        sizes = th.size[th.op == 1]
        assert (sizes < KiB).sum() > 1000 and ((sizes > GiB) & (sizes <= 4 * GiB + MiB)).sum() >= 1
        assert not ((sizes >= KiB) & (sizes <= GiB)).any()
        tf = unseen.generate("torch_fuzz", s)
        assert tf.size.max() < 100 * MiB
        dp = unseen.generate("dp_multistream", s)
        assert len(dp.streams) >= 2
        tp = unseen.generate("two_phase", s)
        # two disjoint size sets: no size of the first period (after the 4 persistent allocations)
        # occurs in the second
        pa = tp.meta["params"]
        la, lb = 2 * pa["reps"] * pa["sizes_a"], 2 * pa["reps"] * pa["sizes_b"]
        first, second = set(tp.size[4:4 + la].tolist()), set(tp.size[4 + la:4 + la + lb].tolist())
        assert len(first) == pa["sizes_a"] and len(second) == pa["sizes_b"] and not first & second
        rt = unseen.generate("ratchet", s)
        live = np.cumsum(np.where(rt.op == 1, rt.size, -rt.size))
        q = len(live) // 4
        # leak-like: the live floor of the last quarter above the first quarter's
        assert live[3 * q:-1000].min() >= live[:q].min()


@pytest.mark.parametrize("family", ["kv_serving", "dp_multistream", "tiny_huge"])
@pytest.mark.parametrize("knobs", [{}, {"expandable_segments": True}], ids=["classic", "expandable"])
def test_a_written_workload_replays_through_both_allocators_with_the_same_allocations(unseen, tmp_path, family,
                                                                                       knobs):
    tr = unseen.generate(family, 1)
    path = unseen.write(tr, str(tmp_path))
    back = load_trace(path)
    for x in ("op", "slot", "size", "stream"):
        assert np.array_equal(getattr(back, x), getattr(tr, x))
    assert json.load(open(path[:-4] + ".json"))["params"] == tr.meta["params"]
    ap = replay(back, "sim", pool_knobs=knobs)
    ref = torch_npu_policy.replay(back)
    assert ap["allocs"] == ref["allocs"] == tr.n_allocs
    assert ap["final_allocated_bytes"] == ref["final_allocated_bytes"] == 0
    assert ap["peak_reserved_bytes"] >= ap["peak_live_bytes"] > 0


def test_a_tiny_run_reports_every_workload_and_saves_the_distribution(tmp_path):
    # its own process, as a user runs it: this one has opened the simulated runtime, which its
    # forked workers could not use
    save = tmp_path / "out.json"
    p = subprocess.run([sys.executable, os.path.join(BENCH, "unseen_check.py"), "--family", "two_phase",
                        "--family", "torch_fuzz", "--seeds", "2", "--jobs", "1", "--dir", str(tmp_path / "w"),
                        "--cache", str(tmp_path / "c"), "--save", str(save)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    d = json.load(open(save))
    assert [(r["family"], r["seed"]) for r in d["rows"]] == [("two_phase", 0), ("two_phase", 1),
                                                              ("torch_fuzz", 0), ("torch_fuzz", 1)]
    assert d["overall"]["workloads"] == 4 and set(d["per_family"]) == {"two_phase", "torch_fuzz"}
    for r in d["rows"]:
        tr = load_trace(r["path"])
        assert r["reserves_more"] == (r["peak_mib"] > r["reference_peak_mib"]) or \
            abs(r["peak_mib"] - r["reference_peak_mib"]) < 1  # peak_mib is whole MiB
        assert r["events"] == tr.n_events
    out = p.stdout
    assert "4 workloads: waste reduction mean" in out and "torch_fuzz_s1" in out

"""Pinned replay figures: every bundled trace in classic and expandable mode must reproduce the
exact peak reserved and live bytes, device mallocs, frees and calls, and steady-state calls in
tests/golden/replay_figures.json. A placement change that moves a figure re-pins the file in the
same commit (python scripts/pin_figures.py), saying why."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from golden_figures import FIELDS, MODES, compute, load  # noqa: E402

from ascend_pool.traces import bundled_traces_dir  # noqa: E402


def test_every_bundled_trace_reproduces_its_pinned_figures(tmp_path):
    pinned = load()
    names = sorted(f[:-len(".npz")] for f in os.listdir(bundled_traces_dir()) if f.endswith(".npz"))
    assert names, "no bundled traces found"
    assert sorted(pinned) == sorted(f"{n}/{m}" for n in names for m in MODES), \
        "every bundled trace must be pinned in both modes: run python scripts/pin_figures.py"
    now = compute(tmp_path)
    diffs = [f"{key} {field}: pinned {pinned[key].get(field)}, now {now[key].get(field)}"
             for key in sorted(pinned) for field in FIELDS if pinned[key].get(field) != now[key].get(field)]
    assert not diffs, ("replay figures moved (if on purpose, re-pin with python scripts/pin_figures.py and say why "
                       "in the commit):\n  " + "\n  ".join(diffs))
    for key, fig in now.items():  # and they mean what they say
        assert fig["final_allocated_bytes"] == 0, key
        assert fig["peak_reserved_bytes"] >= fig["peak_live_bytes"] > 0, key

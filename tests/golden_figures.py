"""The replay figures pinned in tests/golden/replay_figures.json: how they are computed (shared by
tests/test_golden_figures.py and scripts/pin_figures.py, which rewrites the file).

Placement is deterministic, so every figure is exact. Each run is in a child process on a fresh
simulated node with the default device (64 GiB), so nothing else in the test session (pools,
injected faults, other tests' memory) can move a figure."""

import json
import os
import subprocess
import sys
import uuid

import ascend_pool

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "replay_figures.json")
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(ascend_pool.__file__)))
FIELDS = ("allocs", "frees", "peak_live_bytes", "peak_reserved_bytes", "device_mallocs", "device_frees",
          "device_calls", "device_calls_steady", "final_allocated_bytes")
MODES = {"classic": {}, "expandable": {"expandable_segments": True}}

_CHILD = """
import glob, json, os, sys
from ascend_pool.replay import replay
from ascend_pool.traces import bundled_traces_dir
fields, modes = json.loads(sys.argv[1])
out = {}
for path in sorted(glob.glob(os.path.join(str(bundled_traces_dir()), "*.npz"))):
    name = os.path.basename(path)[:-len(".npz")]
    for mode, knobs in modes.items():
        r = replay(path, backend="sim", pool_knobs=knobs)
        out[name + "/" + mode] = {k: int(r[k]) for k in fields}
print(json.dumps(out, sort_keys=True))
"""


def compute(shm_dir):
    """{"TRACE/MODE": {field: int}} for every bundled trace in classic and expandable mode, from a
    child process on a fresh simulated node whose records live in shm_dir."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ASCEND_SIM_", "ASCEND_POOL_"))}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [PKG_PARENT, os.environ.get("PYTHONPATH")])),
               PYTHONSAFEPATH="1", ASCEND_SIM_NODE="golden" + uuid.uuid4().hex[:10], ASCEND_SIM_SHM_DIR=str(shm_dir),
               ASCEND_POOL_BACKEND="sim", ASCEND_POOL_STATS_DIR=str(shm_dir), ASCEND_POOL_LEDGER_DIR=str(shm_dir))
    p = subprocess.run([sys.executable, "-c", _CHILD, json.dumps([FIELDS, MODES])], env=env, cwd=str(shm_dir),
                       capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise RuntimeError(f"replaying the bundled traces failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def load():
    with open(GOLDEN) as f:
        return json.load(f)["figures"]

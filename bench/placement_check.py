#!/usr/bin/env python3
"""Replay figures of one build on many workloads, and how they moved against another build's.

A placement or release change moves which segments are wholly free when a growth comes, and so
every later trade: its effect is a distribution over workloads, not one trace's figure. This
replays each trace of the given folders and N perturbed variants of each (the robustness
harness's derivation, ascend_pool.bench.variants) through the installed ascend_pool, two processes
at a time, and prints per trace peak reserved MiB / device calls / steady-state calls, then the
distribution (waste reduction against the torch_npu_policy model, workloads reserving more than
it, call-target misses). The model's figures are cached in --cache (they depend on the workload
only). --save keeps this build's figures; --compare OLD.json counts, workload by workload, the
figures that went up and down against a saved run (the figures of issue 18's "only downward").

  python bench/placement_check.py --variants 20 --save /tmp/new.json --compare /tmp/old.json
  python bench/placement_check.py --expandable ...
"""
import argparse
import glob
import json
import multiprocessing
import os
import sys

from ascend_pool.bench.robustness import summarize

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.join(os.path.dirname(os.path.dirname(HERE)), "shared", "traces")


def _one(job):
    path, k, knobs, cache_dir = job
    from ascend_pool.backend import open_backend
    from ascend_pool.bench import peers
    from ascend_pool.bench.variants import derive
    from ascend_pool.traces import load_trace

    be = open_backend("sim")
    tr = load_trace(path)
    v = tr if k < 0 else derive(tr, k)
    key = f"{os.path.basename(path)[:-4]}:{k}"
    ap = peers.run_peer("ascend_pool", v, be, 0, pool_knobs=knobs)
    cached = os.path.join(cache_dir, key + ".json")
    if os.path.exists(cached):
        with open(cached) as f:
            ref = json.load(f)
    else:
        r = peers.run_peer("torch_npu_policy", v, be, 0)
        ref = {"peak_reserved_bytes": r["peak_reserved_bytes"], "waste_bytes": r["waste_bytes"]}
        with open(cached, "w") as f:
            json.dump(ref, f)
    wa, wr = ap["waste_bytes"], ref["waste_bytes"]
    red = 100.0 * (1 - wa / wr) if wr else (0.0 if wa == 0 else None)  # as the harness (robustness.py)
    # the robustness harness's workload keys, so that its summarize() reads these rows
    return {"name": key, "peak_mib": ap["peak_reserved_bytes"] >> 20, "calls": ap["device_calls"],
            "steady": ap["device_calls_steady"], "steady_pct": ap["device_calls_steady_pct_of_allocs"],
            "whole_pct": ap["device_calls_pct_of_allocs"], "waste_reduction_pct": red,
            "reserves_more": ap["peak_reserved_bytes"] > ref["peak_reserved_bytes"]}


def _init():
    os.environ["ASCEND_SIM_NODE"] = f"placement-check-{os.getpid()}"  # each worker its own simulated node


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="*", default=[SHARED, os.path.join(SHARED, "variants")],
                    help="folders of NAME.npz traces (default: ../shared/traces and its variants/)")
    ap.add_argument("--variants", type=int, default=20, help="perturbed variants per trace (0-1000, default 20)")
    ap.add_argument("--first", type=int, default=0,
                    help="seed of the first variant (default 0; e.g. 100 for workloads no rule was chosen on)")
    ap.add_argument("--no-originals", action="store_true", help="replay only the variants, not the traces themselves")
    ap.add_argument("--expandable", action="store_true", help="expandable segments")
    ap.add_argument("--policy", choices=["budgeted", "under_peak", "never"], help="release_policy (default: the pool's)")
    ap.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "ascend_pool_reference"),
                    help="folder for the reference model's figures")
    ap.add_argument("--save", help="write this run's figures here (JSON)")
    ap.add_argument("--compare", help="a JSON file an earlier --save wrote")
    a = ap.parse_args(argv)
    if not 0 <= a.variants <= 1000:
        ap.error(f"--variants must be 0-1000, got {a.variants}")
    if not 0 <= a.first <= 100000:
        ap.error(f"--first must be 0-100000, got {a.first}")
    paths = sorted(p for d in a.dirs for p in glob.glob(os.path.join(d, "*.npz")))
    if not paths:
        ap.error(f"no .npz traces in {a.dirs}")
    os.makedirs(a.cache, exist_ok=True)
    knobs = {"expandable_segments": True} if a.expandable else {}
    if a.policy:
        knobs["release_policy"] = a.policy
    seeds = ([] if a.no_originals else [-1]) + list(range(a.first, a.first + a.variants))
    jobs = [(p, k, knobs, a.cache) for p in paths for k in seeds]
    with multiprocessing.Pool(2, initializer=_init) as pool:
        rows = pool.map(_one, jobs, chunksize=1)
    for r in rows:
        if r["name"].endswith(":-1"):
            print(f"{r['name'][:-3]:40} {r['peak_mib']:7} MiB {r['calls']:5} calls {r['steady']:4} steady "
                  f"{'-' if r['waste_reduction_pct'] is None else format(r['waste_reduction_pct'], '6.1f')} %"
                  f"{'  reserves more than torch_npu_policy' if r['reserves_more'] else ''}")
    o = summarize(rows)
    print(f"{o['workloads']} workloads: waste reduction mean {o['mean']:.2f} %, min {o['min']:.1f} %; reserve more "
          f"than torch_npu_policy: {o['reserves_more']}; miss a call target (steady > 1 % or whole > 3 %): "
          f"{o['misses_call_target']}")
    if a.save:
        with open(a.save, "w") as f:
            json.dump({"knobs": knobs, "rows": rows}, f)
    if a.compare:
        with open(a.compare) as f:
            old = {r["name"]: r for r in json.load(f)["rows"]}
        both = [(old[r["name"]], r) for r in rows if r["name"] in old]
        for fig in ("peak_mib", "calls", "steady"):
            up = sum(n[fig] > o[fig] for o, n in both)
            down = sum(n[fig] < o[fig] for o, n in both)
            print(f"{fig:9} against {os.path.basename(a.compare)}: higher on {up}, lower on {down}, "
                  f"equal on {len(both) - up - down} of {len(both)} workloads")
    return 0


if __name__ == "__main__":
    sys.exit(main())

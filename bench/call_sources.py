#!/usr/bin/env python3
"""Where a workload's device calls come from, per half of the trace.

Replays each workload (TRACE:K, K a robustness-harness variant seed, -1 the trace itself) through
the installed ascend_pool, one Python call per event, and sorts every change of the pool's device
counters: a device allocation (or map) that lifts reserved memory to a new high is a *peak-lifting
growth*, one that stays under it a *refill*; frees and unmaps are *releases*. Prints the three
counts for the first and second halves of the events (the replay's split: the second half's sum
is its device_calls_steady) and that sum as a % of the second half's allocations (the
steady-state figure of `ascend-pool bench`). For a call-target miss this tells
the workload's own growth from the policy's trades.

  python bench/call_sources.py resnet18_train:14 synthetic_frag_v2:4 --conf expandable_segments:True
"""
import argparse
import os
import sys

def call_sources(trace, pool_knobs=None):
    """{"peak": [first, second], "refill": [...], "release": [...], "second_half_allocs": n}:
    device calls by kind in the first and second halves of trace's events, for one replay."""
    from ascend_pool.backend import open_backend
    from ascend_pool.pool import Pool

    pool = Pool(0, backend=open_backend("sim"), **(pool_knobs or {}))
    streams, ptrs = {}, {}
    half_at = trace.n_events // 2
    out = {"peak": [0, 0], "refill": [0, 0], "release": [0, 0],
           "second_half_allocs": int((trace.op[half_at:] == 1).sum())}
    high = 0
    before = (0, 0)
    try:
        for i, (op, slot, size, st) in enumerate(zip(trace.op.tolist(), trace.slot.tolist(), trace.size.tolist(),
                                                     trace.stream.tolist())):
            if st and st not in streams:
                streams[st] = pool.create_stream()
            if op == 1:
                ptrs[slot] = pool.malloc(size, streams.get(st))
            else:
                pool.free(ptrs.pop(slot))
            s = pool.memory_stats()
            now = (s["num_device_alloc"] + s["num_device_map"], s["num_device_free"] + s["num_device_unmap"])
            if now != before:
                half = 1 if i >= half_at else 0
                reserved = s["reserved_bytes.all.current"]
                out["peak" if reserved > high else "refill"][half] += now[0] - before[0]
                out["release"][half] += now[1] - before[1]
                high, before = max(high, reserved), now
        for p in ptrs.values():
            pool.free(p)
    finally:
        for h in streams.values():
            pool.destroy_stream(h)
        pool.close()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workloads", nargs="+", help="TRACE:K (K = variant seed, -1 = the trace itself)")
    ap.add_argument("--conf", default="", help="pool knobs, key:value,key:value (as ASCEND_POOL_CONF)")
    ap.add_argument("--traces", help="folder of NAME.npz, its variants/ too (default: ascend_pool.traces."
                                     "default_traces_dir(), ../shared/traces in a checkout)")
    a = ap.parse_args(argv)
    os.environ.setdefault("ASCEND_SIM_NODE", f"call-sources-{os.getpid()}")
    from ascend_pool.bench.variants import derive
    from ascend_pool.config import parse_conf_string
    from ascend_pool.traces import default_traces_dir, load_trace

    knobs = parse_conf_string(a.conf, "--conf") if a.conf else {}
    traces = a.traces or str(default_traces_dir())
    for w in a.workloads:
        name, _, k = w.rpartition(":")
        if not name or not k.lstrip("-").isdigit():
            ap.error(f"a workload is TRACE:K, got {w!r}")
        path = next((p for p in (os.path.join(traces, name + ".npz"), os.path.join(traces, "variants", name + ".npz"))
                     if os.path.exists(p)), None)
        if path is None:
            ap.error(f"no {name}.npz in {traces} or its variants/")
        trace = load_trace(path)
        c = call_sources(trace if int(k) < 0 else derive(trace, int(k)), knobs)
        steady = c["peak"][1] + c["refill"][1] + c["release"][1]
        print(f"{w:45} second-half allocs {c['second_half_allocs']:6}  first half: peak {c['peak'][0]:4} refill {c['refill'][0]:4} "
              f"release {c['release'][0]:4}  second half: peak {c['peak'][1]:4} refill {c['refill'][1]:4} "
              f"release {c['release'][1]:4} = {100 * steady / max(1, c['second_half_allocs']):.2f} %", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

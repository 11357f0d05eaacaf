"""Device memory and start-up time of N inference workers, each with its own copy of the model
weights ("copy") or all mapping one copy that the parent loaded and shared ("share"), on the
simulated NPU.

copy:  each worker (a spawned process) creates a pool, allocates the weights and loads them.
share: the parent shares pool.share_malloc() memory and loads the weights into it once; each
       worker creates a pool and opens the handle (ascend_pool.open_shared).
Every worker then checks three 1 MiB samples of the pattern and reports ready; the parent reads the
node's device usage (the simulator's node-wide accounting, all processes) while all N are ready.

"Loading" is a fill of the whole buffer on a device stream (the simulator touching every page), plus
--load-gbps: a modelled transfer time (size / bandwidth) standing for reading the weights from disk
and copying them host-to-device, which the simulator cannot measure (0: none).

Start-up time of a worker: from the parent's Process.start() to the worker's "ready" - interpreter
start and imports included, identical in both modes; load_s is the part after the worker's pool was
created (its own load, or opening the handle). total_s: from the beginning of the run (the parent's
load included, for share) until all N workers are ready.

    python bench/sharing.py [--size-mib 512] [--workers 1,2,4,8] [--load-gbps 0] [--repeat 3] [--json out.json]
"""

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time

MiB = 1 << 20
PATTERN = 0xA7


def _isolated_node():
    """A simulated node of its own (records in a temporary directory), 1 device of 64 GiB."""
    d = tempfile.mkdtemp(prefix="ascend-share-bench-")
    os.environ.update(ASCEND_SIM_NODE=f"bench{os.getpid()}", ASCEND_SIM_SHM_DIR=d, ASCEND_POOL_LEDGER_DIR=d,
                      ASCEND_POOL_STATS_DIR=d, ASCEND_SIM_DEVICES="1", ASCEND_SIM_HBM="64GiB",
                      ASCEND_POOL_BACKEND="sim")
    os.environ.pop("ASCEND_POOL_CONF", None)
    return d


def _samples(size):
    return [0, size // 2 - MiB // 2, size - MiB]


def worker(mode, arg, load_s, t_launch, results, go):
    t_start = time.time()
    import ascend_pool as ap
    from ascend_pool import sim

    pool = ap.Pool(0, backend="sim")
    t_pool = time.time()
    block = None
    if mode == "copy":
        size = arg
        ptr = pool.malloc(size)
        sim.launch_fill(None, ptr, size, PATTERN, delay_s=load_s)
        pool.synchronize()
    else:
        block = ap.open_shared(arg, pool=pool)
        ptr, size = block.ptr, block.size
    ok = all(sim.read(ptr + off, MiB) == bytes([PATTERN]) * MiB for off in _samples(size))
    t_ready = time.time()
    results.put({"pid": os.getpid(), "ok": ok, "ready_s": t_ready - t_launch, "load_s": t_ready - t_pool,
                 "interp_s": t_start - t_launch, "reserved": pool.memory_stats()["reserved_bytes.all.current"]})
    go.wait(timeout=300)
    if block is not None:
        block.close()
    pool.close()


def run(mode, n, size, load_s, parent_pool):
    from ascend_pool import sim

    ctx = mp.get_context("spawn")
    results, go = ctx.Queue(), ctx.Event()
    t0 = time.time()
    parent_load = 0.0
    ptr = None
    if mode == "share":
        # Shared before it is loaded: the simulator then has no pages to copy into the shared file
        # (exporting loaded memory copies its present pages once; a real NPU exports in place).
        ptr = parent_pool.share_malloc(size)
        handle = parent_pool.share(ptr, read_only=True, any_process=True)
        share_s = time.time() - t0
        sim.launch_fill(None, ptr, size, PATTERN, delay_s=load_s)
        parent_pool.synchronize()
        parent_load = time.time() - t0 - share_s
        arg = handle
    else:
        share_s = 0.0
        arg = size
    procs = []
    for _ in range(n):
        p = ctx.Process(target=worker, args=(mode, arg, load_s, time.time(), results, go))
        p.start()
        procs.append(p)
    got = [results.get(timeout=300) for _ in procs]
    t_all = time.time()
    device_bytes = sim.stats(0)["node_bytes_used"]
    go.set()
    for p in procs:
        p.join(timeout=120)
    if ptr is not None:
        while not parent_pool.share_free(ptr):  # workers have closed by now: never loops in practice
            time.sleep(0.05)
    assert all(r["ok"] for r in got), got
    return {
        "mode": mode, "workers": n, "size_bytes": size,
        "device_bytes": device_bytes, "device_gib": round(device_bytes / (1 << 30), 3),
        "parent_load_s": round(parent_load, 3), "export_s": round(share_s, 3),
        "worker_ready_mean_s": round(statistics.mean(r["ready_s"] for r in got), 3),
        "worker_ready_max_s": round(max(r["ready_s"] for r in got), 3),
        "worker_load_mean_s": round(statistics.mean(r["load_s"] for r in got), 4),
        "worker_reserved_bytes": max(r["reserved"] for r in got),
        "total_s": round(t_all - t0, 3),
    }


def median_row(runs):
    """Field by field median of repeated runs of one configuration (with the spread of total_s)."""
    out = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("workers", "size_bytes"):
            out[k] = statistics.median(r[k] for r in runs)
    out["runs"] = len(runs)
    out["total_min_s"] = min(r["total_s"] for r in runs)
    out["total_max_s"] = max(r["total_s"] for r in runs)
    return out


def table(rows):
    """The markdown table of docs/sharing.md."""
    out = ["| mode | N | device memory, node-wide (GiB) | parent: share + load (s) | worker start-up (s) "
           "| worker load (s) | all N ready (s), median (min–max) |", "|" + "---|" * 7]
    for r in rows:
        parent = "—" if r["mode"] == "copy" else f"{r['export_s'] + r['parent_load_s']:.2f}"
        out.append(f"| {r['mode']} | {r['workers']} | {r['device_gib']:.3f} | {parent} | "
                   f"{r['worker_ready_mean_s']:.2f} | {r['worker_load_mean_s']:.3f} | "
                   f"{r['total_s']:.2f} ({r['total_min_s']:.2f}–{r['total_max_s']:.2f}) |")
    return "\n".join(out)


def main():
    ap_ = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap_.add_argument("--size-mib", type=int, default=512, help="weights per copy (MiB)")
    ap_.add_argument("--workers", default="1,2,4,8", help="comma-separated worker counts")
    ap_.add_argument("--load-gbps", type=float, default=0.0,
                     help="modelled load bandwidth in GB/s (disk + host-to-device); 0: the fill only")
    ap_.add_argument("--repeat", type=int, default=3, help="runs of each configuration; the table shows medians")
    ap_.add_argument("--json", help="also write the rows to this file")
    args = ap_.parse_args()
    d = _isolated_node()
    try:
        import ascend_pool as ap

        size = args.size_mib * MiB
        load_s = size / (args.load_gbps * 1e9) if args.load_gbps > 0 else 0.0
        parent = ap.Pool(0, backend="sim")
        rows = []
        for n in [int(x) for x in args.workers.split(",")]:
            for mode in ("copy", "share"):
                runs = []
                for _ in range(max(1, args.repeat)):
                    runs.append(run(mode, n, size, load_s, parent))
                    print(json.dumps(runs[-1]), flush=True)
                rows.append(median_row(runs))
        parent.close()
        print()
        print(f"weights {args.size_mib} MiB per copy; modelled load {args.load_gbps or 'none'} GB/s; "
              f"{os.cpu_count()} CPUs; medians of {max(1, args.repeat)} runs")
        print(table(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Allocation throughput with and without a Prometheus-style scraper hitting /metrics 10 times a
second, in one run.

The workload is cached malloc/free pairs from Python on one simulated device (the pool's hot
path, GIL held by the caller, as an application's Python code would call it). The process
publishes its stats file all along (every process using ascend_pool does), so "without" is the
real baseline. Two scrape targets are measured:

  in-process   ascend_pool.metrics.start_http_server() in the benchmark process itself: the
               scrape's Python work competes with the workload for the GIL (the worst case);
  node         `ascend-pool serve` in its own process, reading the stats file: the workload's
               process does nothing more than without a scraper.

The scraper is a separate process (so its own work is not counted against the workload), paused
with SIGSTOP between "with" runs. Runs alternate without/with so that drift (frequency scaling,
other load) hits both alike; the medians of the repeated runs are compared.

    python bench/scrape_overhead.py [--runs 15] [--pairs 2000000] [--mode both|in-process|node]
"""

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SCRAPER = r"""
import sys, time, urllib.request
url, hz = sys.argv[1], float(sys.argv[2])
n = errors = 0
period = 1.0 / hz
next_t = time.monotonic()
try:
    while True:
        try:
            urllib.request.urlopen(url, timeout=5).read()
            n += 1
        except OSError:
            errors += 1
        next_t += period
        # After a SIGSTOP pause, do not fire a burst of catch-up scrapes: keep the rate.
        next_t = max(next_t, time.monotonic())
        time.sleep(max(0.0, next_t - time.monotonic()))
except KeyboardInterrupt:
    print(n, errors, flush=True)
"""


def workload(pool, pairs, size):
    """Cached malloc/free pairs per second (the first pair warms the cache)."""
    malloc, free = pool.malloc, pool.free
    free(malloc(size))
    t0 = time.perf_counter()
    for _ in range(pairs):
        free(malloc(size))
    return pairs / (time.perf_counter() - t0)


class Scraper:
    def __init__(self, url, hz):
        self.proc = subprocess.Popen([sys.executable, "-c", SCRAPER, url, str(hz)], stdout=subprocess.PIPE, text=True)
        self.proc.send_signal(signal.SIGSTOP)

    def run(self, on):
        self.proc.send_signal(signal.SIGCONT if on else signal.SIGSTOP)

    def close(self):
        self.proc.send_signal(signal.SIGCONT)
        self.proc.send_signal(signal.SIGINT)
        out = self.proc.communicate(timeout=10)[0].split()
        return (int(out[0]), int(out[1])) if len(out) == 2 else (None, None)


def measure(pool, scraper, runs, pairs, size):
    """(pairs/s without, pairs/s with, seconds the scraper ran) over alternating runs."""
    without, with_, on_seconds = [], [], 0.0
    for i in range(2 * runs):
        on = i % 2 == 1
        scraper.run(on)
        t0 = time.monotonic()
        if on:
            time.sleep(0.15)  # let the scraper get going
        (with_ if on else without).append(workload(pool, pairs, size))
        if on:
            on_seconds += time.monotonic() - t0
    scraper.run(False)
    return without, with_, on_seconds


def report(name, without, with_, scrapes, errors, seconds):
    a, b = statistics.median(without), statistics.median(with_)
    # Each "with" run against the "without" run just before it: robust to slow drift.
    paired = statistics.median(w / wo - 1 for wo, w in zip(without, with_)) * 100
    spread = (max(without) - min(without)) / a * 100
    print(f"{name}:")
    print(f"  without scraper: median {a / 1e6:.3f} M pairs/s (runs {len(without)}, spread {spread:.1f} %)")
    print(f"  with scraper   : median {b / 1e6:.3f} M pairs/s (runs {len(with_)}, "
          f"{scrapes} scrapes, {errors} errors, {scrapes / seconds:.1f} scrapes/s while on)")
    print(f"  difference     : {(b - a) / a * 100:+.2f} % of the medians; {paired:+.2f} % median of paired runs")
    return (b - a) / a * 100


def cost_line(pool, hz):
    """The deterministic side: CPU time one in-process scrape and one publish take (median of many),
    as a share of one core at the scrape rate and at the publish rate. The scrape's share is the
    most the workload can lose to it for the GIL; the throughput figures below are that plus noise."""
    from prometheus_client import CollectorRegistry, generate_latest

    from ascend_pool.metrics import PoolCollector
    from ascend_pool.service.publisher import current

    registry = CollectorRegistry(auto_describe=False)
    registry.register(PoolCollector())
    pub = current()

    def median_cpu(fn, n=300):
        out = []
        for _ in range(n):
            t0 = time.thread_time()
            fn()
            out.append(time.thread_time() - t0)
        return statistics.median(out)

    scrape = median_cpu(lambda: generate_latest(registry))
    line = f"cost: {scrape * 1e3:.3f} ms CPU per in-process scrape ({scrape * hz * 100:.2f} % of a core at {hz:g} Hz)"
    if pub is not None:
        publish = median_cpu(pub.publish_now)
        line += f"; {publish * 1e3:.3f} ms per publish ({publish / pub.interval * 100:.3f} % at {1 / pub.interval:g} Hz)"
    print(line)


def main():
    ap_ = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap_.add_argument("--runs", type=int, default=15, help="runs with and without the scraper (each)")
    ap_.add_argument("--pairs", type=int, default=2_000_000, help="malloc/free pairs per run")
    ap_.add_argument("--size", type=int, default=4096, help="bytes per allocation")
    ap_.add_argument("--hz", type=float, default=10.0, help="scrapes per second")
    ap_.add_argument("--mode", choices=("both", "in-process", "node"), default="both")
    args = ap_.parse_args()

    tmp = tempfile.mkdtemp(prefix="ascend-scrape-bench-")
    os.environ.setdefault("ASCEND_POOL_BACKEND", "sim")
    os.environ.setdefault("ASCEND_SIM_NODE", f"bench{uuid.uuid4().hex[:8]}")
    os.environ["ASCEND_POOL_STATS_DIR"] = tmp

    import ascend_pool as ap
    from ascend_pool.metrics import start_http_server
    from ascend_pool.service.publisher import ensure_publisher, stop_publisher

    pool = ap.Pool(0, backend="sim")
    ensure_publisher()  # the process publishes in both arms, as every ascend_pool process does
    print(f"{args.runs} runs x {args.pairs} cached malloc/free pairs of {args.size} B each arm, "
          f"scraper at {args.hz:g} Hz; python {sys.version.split()[0]}")
    results = {}
    cost_line(pool, args.hz)
    try:
        if args.mode in ("both", "in-process"):
            server = start_http_server(0)
            scraper = Scraper(f"http://127.0.0.1:{server.port}/metrics", args.hz)
            without, with_, on_seconds = measure(pool, scraper, args.runs, args.pairs, args.size)
            n, errors = scraper.close()
            results["in-process"] = report("in-process exporter (start_http_server in the workload's process)",
                                           without, with_, n, errors, on_seconds)
            server.close()
        if args.mode in ("both", "node"):
            serve = subprocess.Popen([sys.executable, "-m", "ascend_pool.cli", "serve", "--port", "0",
                                      "--stats-dir", tmp], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            port = int(re.search(r":(\d+)/metrics", serve.stdout.readline()).group(1))
            scraper = Scraper(f"http://127.0.0.1:{port}/metrics", args.hz)
            without, with_, on_seconds = measure(pool, scraper, args.runs, args.pairs, args.size)
            n, errors = scraper.close()
            serve.send_signal(signal.SIGTERM)
            serve.wait(timeout=10)
            results["node"] = report("node service (ascend-pool serve reading the stats file)",
                                     without, with_, n, errors, on_seconds)
    finally:
        stop_publisher()  # before the close: the publisher must not be reading a closing pool
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

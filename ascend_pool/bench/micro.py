"""Microbenchmarks of the pool's cached path, each with its floor measured in the same run.

Four figures, each the median over ``runs`` repetitions, in nanoseconds per malloc+free pair:

* ``c_pair``: a warm cached ``ap_pool_malloc``/``ap_pool_free`` pair in a C loop with the GIL
  released (``ascend_pool._core.bench_c_pool_pairs``); floor ``c_floor``: the same loop over a
  trivial mutex-guarded free list (``bench_c_freelist_pairs``) -- what any thread-safe cached pair
  costs.
* ``c_pair_2threads``: the same, two threads on one pool at once (each thread's own ns per pair);
  floor ``c_floor_2threads``: two threads on one free list.
* ``py_pair``: ``pool.malloc``/``pool.free`` from a Python loop (``for s in repeat(size, n):
  free(malloc(s))``); floor ``py_floor``: the same loop calling a no-op Cython ``def``
  (``bench_noop``) once per iteration. Both include the loop's own iteration cost, reported
  separately as ``py_loop_ns``.
* ``py_pair_2threads``: two Python threads each running that loop on one pool (the GIL
  serialises them: this is the latency each thread sees); floor ``py_floor_2threads``.

Information (no floor): ``c_pair_merging``, the C-loop pair of a block that borders free space: it
merges at free and is split again at the next malloc, as in PyTorch (only blocks with no free
neighbour wait in the recent-free cache, which keeps placement exactly merge-at-free's).

* ``tail_under_maintenance``: percentiles (``p50_ns``, ``p99_ns``, ``p999_ns``) of single warm
  ``ascend_pool_malloc``/``ascend_pool_free`` pairs through the C ABI, timed one by one on a C
  thread that never holds the GIL, while a Python thread keeps calling ``synchronize()`` on a busy
  stream, ``empty_cache()``, ``snapshot()`` and a metrics scrape on the same pool (the device's
  default pool); ``baseline_p50_ns`` is the median of the same pair without that maintenance, in
  the same run. Target: p99.9 at most 100x the baseline (no maintenance call holds the pool mutex
  across a device wait).

Every figure is also given as a ratio to its floor. The repetitions are interleaved (run 1 of
every figure, then run 2, ...) so that floors and figures see the same machine conditions.
"""
from __future__ import annotations

import contextlib
import statistics
import threading
import time
from itertools import repeat
from typing import Optional

from .. import _core, sim as _sim
from ..api import default_pool
from ..errors import PoolError
from ..metrics.collector import PoolCollector
from ..pool import Pool

__all__ = ["run_micro", "FIGURES", "FLOORS", "DESCRIPTIONS"]

#: figure -> its floor
FIGURES = {
    "c_pair": "c_floor",
    "c_pair_2threads": "c_floor_2threads",
    "py_pair": "py_floor",
    "py_pair_2threads": "py_floor_2threads",
}
FLOORS = tuple(FIGURES.values())

DESCRIPTIONS = {
    "c_pair": "warm cached malloc+free pair, C loop (ap_pool_malloc/ap_pool_free, GIL released)",
    "c_pair_2threads": "the same, 2 threads contending on one pool (per-thread ns per pair)",
    "py_pair": "warm cached pair from Python (pool.malloc/pool.free in a loop)",
    "py_pair_2threads": "the same, 2 Python threads on one pool (per-thread ns per pair)",
    "c_floor": "trivial free-list pair in C (mutex lock/unlock in malloc and in free)",
    "c_floor_2threads": "the same, 2 threads contending on one free list (the pool's adaptive mutex kind)",
    "py_floor": "no-op Cython def call in the same Python loop",
    "py_floor_2threads": "the same, 2 Python threads",
    "c_floor_nolock": "trivial free-list pair in C without the mutex (information only)",
    "py_loop": "the Python loop's own iteration (information only)",
    "c_pair_merging": "C-loop pair of a block beside free space: merged at free, split at malloc (information only)",
}


def _py_pairs(malloc, free, size: int, n: int) -> float:
    t0 = time.perf_counter_ns()
    for s in repeat(size, n):
        free(malloc(s))
    return (time.perf_counter_ns() - t0) / n


def _py_calls(fn, size: int, n: int) -> float:
    t0 = time.perf_counter_ns()
    for s in repeat(size, n):
        fn(s)
    return (time.perf_counter_ns() - t0) / n


def _py_empty(size: int, n: int) -> float:
    t0 = time.perf_counter_ns()
    for s in repeat(size, n):
        pass
    return (time.perf_counter_ns() - t0) / n


def _in_threads(threads: int, fn, *args) -> list:
    """Runs fn(*args) in `threads` Python threads started together; returns their results."""
    barrier = threading.Barrier(threads)
    out = [None] * threads
    errors = []

    def body(i):
        try:
            barrier.wait()
            out[i] = fn(*args)
        except BaseException as e:  # reported below
            errors.append(e)

    ts = [threading.Thread(target=body, args=(i,), name=f"ascend-pool-bench-{i}") for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    return out


def _device_calls(pool) -> int:
    st = pool.memory_stats()
    return int(st.get("num_device_alloc", 0)) + int(st.get("num_device_free", 0))


def _calibrate(fn, target_ms: float, lo: int = 10_000, hi: int = 20_000_000) -> int:
    """Pairs per run so that fn(n) -> ns per pair runs for about target_ms."""
    ns = max(fn(lo), 0.5)
    ns = max(min(ns, fn(lo)), 0.5)  # the better of two tries: the first one also warms caches
    return int(min(max(target_ms * 1e6 / ns, lo), hi))


def _maintain(pool, run, rounds, counts, busy_stream, buf, sim):
    """Maintains pool for `rounds` rounds (or until the timed run is done), then stops the run:
    a busy stream synchronized, empty_cache, a snapshot and a metrics scrape each round."""
    collector = PoolCollector(pools=lambda: [pool])
    while counts["rounds"] < rounds and not run.done():
        if sim is not None:
            sim.launch_fill(busy_stream, buf, 1 << 20, 7, delay_s=0.002)  # 2 ms of device work
        pool.synchronize(busy_stream)
        pool.empty_cache()
        pool.snapshot()
        for _ in collector.collect():
            pass
        counts["rounds"] += 1
    run.stop()


def run_tail(device: int = 0, pairs: int = 4_000_000, size: int = 4096, rounds: int = 40) -> dict:
    """tail_under_maintenance (see the module docstring): the C-ABI pair's percentiles on a C
    thread under maintenance, and its uncontended median measured the same way just before."""
    pool = default_pool(device)
    sim = _sim if pool.backend.name == "sim" else None
    base = _core.TailRun(device, size, min(pairs, 200_000)).finish()
    counts = {"rounds": 0}
    busy = pool.create_stream()
    buf = run = None
    try:  # the block, stream and run are the default pool's, open after the bench: an interrupt
        # (Ctrl-C) between them left a live block and a stream in it for the process's life
        buf = pool.malloc(1 << 20, stream=busy)
        run = _core.TailRun(device, size, pairs)
        _maintain(pool, run, rounds, counts, busy, buf, sim)  # this (Python) thread maintains
    finally:
        if run is not None:
            run.stop()
            res = run.finish()
        if buf is not None:
            pool.free(buf, stream=busy)
        pool.destroy_stream(busy)
    out = {"p50_ns": res["p50_ns"], "p99_ns": res["p99_ns"], "p999_ns": res["p999_ns"],
           "baseline_p50_ns": base["p50_ns"], "pairs": res["pairs"], "maintenance_rounds": counts["rounds"],
           "size_bytes": size, "description": "C-ABI cached pair on a C thread while another thread runs "
           "synchronize(busy stream), empty_cache, snapshot and a metrics scrape on the same pool"}
    out["p999_vs_baseline_p50"] = out["p999_ns"] / out["baseline_p50_ns"] if out["baseline_p50_ns"] else None
    return out


def run_micro(backend, device: int = 0, runs: int = 7, target_ms: float = 20.0, c_pairs: Optional[int] = None,
              py_pairs: Optional[int] = None, size: int = 4096, threads: int = 2, progress=None,
              tail_pairs: int = 4_000_000) -> dict:
    """Measures the micro figures on a fresh pool of `backend` (a Backend or a name). Each loop
    runs about target_ms (pairs per run calibrated per figure) unless c_pairs / py_pairs fix the
    count; contended loops run that many pairs in each thread; tail_pairs pairs are timed for
    tail_under_maintenance (0: not measured). Returns
    ``{"figures": {name: {...}}, "floors": {name: {...}}, "info": {...}, "config": {...}}`` plus
    flat ``NAME_ns`` and ``NAME_vs_floor`` keys for every figure and floor."""
    if runs < 1 or target_ms <= 0 or (c_pairs is not None and c_pairs < 1) or \
            (py_pairs is not None and py_pairs < 1) or threads < 2:
        raise ValueError("runs, target_ms, c_pairs and py_pairs must be positive, threads >= 2")
    pool = Pool(device, backend=backend)
    merging = None
    try:
        # warm: one cached block per thread, so every timed pair is a cache hit; a live guard
        # after each keeps it from merging with free space (free_cache.h: only isolated blocks wait)
        ptrs, guards = [], []
        for _ in range(threads):
            ptrs.append(pool.malloc(size))
            guards.append(pool.malloc(size))
        while ptrs:
            pool.free(ptrs[-1])
            ptrs.pop()
        calls_before = _device_calls(pool)
        merging = Pool(device, backend=pool.backend)  # a fresh pool: its one block borders the free rest
        samples = {k: [] for k in list(FIGURES) + list(FLOORS) + ["c_floor_nolock", "py_loop", "c_pair_merging"]}
        malloc, free, noop = pool.malloc, pool.free, _core.bench_noop
        fl = _core.bench_c_freelist_pairs
        cp = _core.bench_c_pool_pairs
        if progress is not None:
            progress.note("calibrating")
        n = {
            "c_floor": c_pairs or _calibrate(lambda k: fl(k, size, True, 1)[0], target_ms),
            "c_floor_nolock": c_pairs or _calibrate(lambda k: fl(k, size, False, 1)[0], target_ms),
            "c_pair": c_pairs or _calibrate(lambda k: cp(pool, k, size, 1)[0], target_ms),
            "c_pair_merging": c_pairs or _calibrate(lambda k: cp(merging, k, size, 1)[0], target_ms),
            "py_loop": py_pairs or _calibrate(lambda k: _py_empty(size, k), target_ms),
            "py_floor": py_pairs or _calibrate(lambda k: _py_calls(noop, size, k), target_ms),
            "py_pair": py_pairs or _calibrate(lambda k: _py_pairs(malloc, free, size, k), target_ms),
        }
        for r in range(runs):
            if progress is not None:
                progress.note(f"run {r + 1}/{runs}")
            samples["c_floor"].append(fl(n["c_floor"], size, True, 1)[0])
            samples["c_floor_nolock"].append(fl(n["c_floor_nolock"], size, False, 1)[0])
            samples["c_pair"].append(cp(pool, n["c_pair"], size, 1)[0])
            samples["c_pair_merging"].append(cp(merging, n["c_pair_merging"], size, 1)[0])
            samples["c_floor_2threads"].append(statistics.fmean(fl(n["c_floor"], size, True, threads)))
            samples["c_pair_2threads"].append(statistics.fmean(cp(pool, n["c_pair"], size, threads)))
            samples["py_loop"].append(_py_empty(size, n["py_loop"]))
            samples["py_floor"].append(_py_calls(noop, size, n["py_floor"]))
            samples["py_pair"].append(_py_pairs(malloc, free, size, n["py_pair"]))
            samples["py_floor_2threads"].append(
                statistics.fmean(_in_threads(threads, _py_calls, noop, size, n["py_floor"])))
            samples["py_pair_2threads"].append(
                statistics.fmean(_in_threads(threads, _py_pairs, malloc, free, size, n["py_pair"])))
        calls_during = _device_calls(pool) - calls_before
        backend_name = pool.backend.name
        while guards:
            pool.free(guards[-1])
            guards.pop()
    finally:
        for p in ptrs + guards:  # an interrupted run's blocks, not left to close()'s warning
            with contextlib.suppress(PoolError):  # one an interrupt caught between free and pop
                pool.free(p)
        if merging is not None:
            merging.close()
        pool.close()

    def entry(name):
        s = samples[name]
        return {"ns": statistics.median(s), "min_ns": min(s), "max_ns": max(s),
                "samples_ns": [round(x, 3) for x in s], "description": DESCRIPTIONS[name]}

    floors = {name: entry(name) for name in FLOORS}
    figures = {}
    for name, floor in FIGURES.items():
        e = entry(name)
        e["floor"] = floor
        e["floor_ns"] = floors[floor]["ns"]
        e["vs_floor"] = e["ns"] / e["floor_ns"] if e["floor_ns"] > 0 else None
        figures[name] = e
    out = {
        "figures": figures,
        "floors": floors,
        "info": {"c_floor_nolock": entry("c_floor_nolock"), "py_loop": entry("py_loop"),
                 "c_pair_merging": entry("c_pair_merging")},
        "config": {"runs": runs, "target_ms_per_loop": None if (c_pairs and py_pairs) else target_ms,
                   "pairs_per_run": n, "pairs_per_thread_when_contended": "as the single-thread run of the same kind",
                   "size_bytes": size, "threads": threads, "backend": backend_name, "device": device,
                   "statistic": "median over runs",
                   "device_calls_during_timed_loops": calls_during},
    }
    for name, e in figures.items():
        out[f"{name}_ns"] = e["ns"]
        out[f"{name}_vs_floor"] = e["vs_floor"]
    if tail_pairs:
        if progress is not None:
            progress.note("tail under maintenance")
        figures["tail_under_maintenance"] = run_tail(device, pairs=tail_pairs, size=size)
    for name, e in floors.items():
        out[f"{name}_ns"] = e["ns"]
    return out

"""One benchmark run: microbenchmarks, then every trace through every allocator, then the table.

``run_bench(...)`` returns ``{"meta", "micro", "rows", "variants", "skipped", "errors", "targets"}``;
the JSON file the `bench` command writes is exactly this object (``rows`` and ``micro`` as issue 8
asks; ``variants``: the robustness harness, :mod:`.robustness`, None unless asked for).
"""
from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path
from typing import Optional

from ..traces import default_traces_dir, list_traces, load_trace, trace_name as _trace_name
from .. import sim
from ..backend import open_backend
from ..version import __version__
from .robustness import run_variants
from .torch_npu_policy import TORCH_NPU_PUBLISHED_MIB
from .variants import DEFAULT_SEED
from . import peers as _peers
from .micro import run_micro
from .progress import Progress
from .table import add_ratios, evaluate_targets

__all__ = ["run_bench", "SIM_MALLOC_LATENCY_US", "SIM_FREE_LATENCY_US"]

#: a realistic device allocation cost for the simulator during replays (aclrtMalloc / aclrtFree)
SIM_MALLOC_LATENCY_US = 20
SIM_FREE_LATENCY_US = 10


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{platform.node()}: {os.cpu_count()} CPUs ({cpu}), {platform.system()} {platform.release()}"


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _versions() -> dict:
    import numpy

    out = {"python": platform.python_version(), "numpy": numpy.__version__, "ascend_pool": __version__}
    for mod in ("torch", "cupy", "rmm"):
        m = sys.modules.get(mod)
        if m is not None:
            out[mod] = getattr(m, "__version__", "?")
    return out


class _SimLatency:
    """Sets the simulator's device latencies for the replays and clears them afterwards."""

    def __init__(self, backend, malloc_us, free_us):
        self.on = backend.name == "sim" and (malloc_us or free_us)
        self.malloc_us, self.free_us = malloc_us, free_us
        self.path = getattr(backend, "path", None)

    def __enter__(self):
        if self.on:
            sim.attach(self.path)
            sim.set_faults(malloc_latency_us=int(self.malloc_us), free_latency_us=int(self.free_us))
        return self

    def __exit__(self, *exc):
        if self.on:
            sim.set_faults(malloc_latency_us=0, free_latency_us=0)
        return False


def run_bench(traces_dir=None, backend: Optional[str] = None, device: int = 0, *, traces: Optional[list] = None,
              allocators: Optional[list] = None, micro: bool = True, micro_runs: int = 7,
              micro_target_ms: float = 20.0, micro_c_pairs: Optional[int] = None,
              micro_py_pairs: Optional[int] = None,
              sim_malloc_latency_us: int = SIM_MALLOC_LATENCY_US, sim_free_latency_us: int = SIM_FREE_LATENCY_US,
              pool_knobs: Optional[dict] = None, progress: bool = False, command: Optional[str] = None,
              log=None, variants: int = 0, variants_seed: Optional[int] = None) -> dict:
    """Runs the benchmark. traces: names (without .npz) to keep from the directory; allocators:
    names to run (default: all for the backend; those that cannot run are listed in "skipped" with
    the reason). log(text): where skip notices go as they happen (default: nowhere). variants: how
    many perturbed workloads to derive from each trace for the robustness harness (0: none)."""
    if variants < 0:
        raise ValueError(f"--variants must be >= 0, got {variants}")
    be = open_backend(backend)
    directory = Path(traces_dir) if traces_dir is not None else default_traces_dir()
    paths = list_traces(directory)
    if traces:
        wanted = set(traces)
        missing = wanted - {_trace_name(p) for p in paths}
        if missing:
            raise ValueError(f"no trace(s) {', '.join(sorted(missing))} in {directory}")
        paths = [p for p in paths if _trace_name(p) in wanted]
    if not paths:
        raise ValueError(f"no .npz traces in {directory}")
    backend_kind = "cuda" if be.kind == "cuda" else be.name
    names = list(_peers.allocators_for(backend_kind))
    if allocators:
        unknown = [a for a in allocators if a not in _peers.ALLOCATORS]
        if unknown:
            raise ValueError(f"unknown allocator(s) {', '.join(unknown)}: choose from {', '.join(_peers.ALLOCATORS)}")
        names = [a for a in names if a in allocators] + [a for a in allocators if a not in names]
    log = log or (lambda text: None)

    skipped, runnable = [], []
    for a in names:
        why = _peers.probe(a, backend_kind)
        if why:
            skipped.append({"allocator": a, "trace": None, "reason": why})
            log(f"skipped {a}: {why}")
        else:
            runnable.append(a)

    meta = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command or "ascend-pool bench",
        "machine": _machine(),
        "backend": be.name,
        "backend_path": be.path,
        "device": device,
        "traces_dir": str(directory.resolve()),
        "traces": [_trace_name(p) for p in paths],
        "allocators": runnable,
        "sim_latency_us": ({"malloc": sim_malloc_latency_us, "free": sim_free_latency_us}
                           if be.name == "sim" else None),
        "pool_knobs": pool_knobs or {},
        "ascend_pool_conf_env": os.environ.get("ASCEND_POOL_CONF", ""),
        "load_average_at_start": _loadavg(),
    }
    steps = (1 if micro else 0) + len(paths) * len(runnable) + len(paths) * max(0, variants)
    prog = Progress(steps, enabled=progress)
    rows, errors = [], []
    micro_res = variants_res = None
    try:
        if micro:
            prog.step("microbenchmarks", tick=False)
            micro_res = run_micro(be, device, runs=micro_runs, target_ms=micro_target_ms, c_pairs=micro_c_pairs,
                                  py_pairs=micro_py_pairs,
                                  progress=prog)
        with _SimLatency(be, sim_malloc_latency_us, sim_free_latency_us):
            for path in paths:
                trace = load_trace(path)
                for a in runnable:
                    prog.step(f"{trace.name}: {a} ({trace.n_events:,} events)")
                    try:
                        rows.append(_peers.run_peer(a, trace, be, device,
                                                    pool_knobs=pool_knobs if a == "ascend_pool" else None))
                    except _peers.PeerSkipped as e:
                        skipped.append({"allocator": a, "trace": trace.name, "reason": str(e)})
                        log(f"skipped {a} on {trace.name}: {e}")
                    except Exception as e:  # a peer failing must not lose the others' figures
                        errors.append({"allocator": a, "trace": trace.name, "error": f"{type(e).__name__}: {e}"})
                        log(f"error: {a} on {trace.name}: {type(e).__name__}: {e}")
        if variants > 0:
            variants_res = run_variants(paths, variants, be, device, pool_knobs=pool_knobs,
                                        seed=DEFAULT_SEED if variants_seed is None else variants_seed, progress=prog)
    finally:
        prog.done()
    add_ratios(rows)
    published = {t: v[0] for t, v in TORCH_NPU_PUBLISHED_MIB.items()}
    meta["versions"] = _versions()
    meta["load_average_at_end"] = _loadavg()
    return {
        "meta": meta,
        "micro": micro_res,
        "rows": rows,
        "variants": variants_res,
        "skipped": skipped,
        "errors": errors,
        "targets": evaluate_targets(rows, micro_res, published) + (variants_res["targets"] if variants_res else []),
    }

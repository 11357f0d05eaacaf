"""The allocators a benchmark replays a trace through, each through its own public API.

Every peer returns one *row* (see :func:`make_row`) for one trace. Names:

* ``ascend_pool``: this package's pool (``ascend_pool.replay.replay(mode="pool")``, loop in C);
* ``direct``: one device call per allocation and free (``replay(mode="direct")``, loop in C);
* ``torch_npu_policy``: :mod:`ascend_pool.bench.torch_npu_policy`, a pure-Python
  re-implementation of torch_npu's caching policy on an address model (no device, no torch_npu);
* on a CUDA GPU (``--backend cuda``), each driven from the same Python loop
  (:func:`python_replay`):

  - ``torch_caching``: PyTorch's caching allocator, ``torch.cuda.caching_allocator_alloc`` /
    ``caching_allocator_delete``; peak reserved and device calls from ``torch.cuda.memory_stats()``;
  - ``torch_cudamallocasync``: the same calls in a subprocess started with
    ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`` (the allocator backend is fixed at
    process start); peak reserved from ``memory_stats()`` (the CUDA pool's reserved high
    watermark); that backend does not count device calls;
  - ``cupy_pool``: ``cupy.cuda.MemoryPool().malloc``, freed by dropping the ``MemoryPointer``;
    its upstream allocator is wrapped to count device allocations; peak reserved is the highest
    ``pool.total_bytes()`` seen after an allocation;
  - ``rmm_pool``: ``rmm.mr.PoolMemoryResource`` (initial size 0) over a
    ``StatisticsResourceAdaptor(CudaMemoryResource())``: the adaptor's peak bytes are the pool's
    peak reserved and its allocation count the device mallocs;
  - ``ascend_pool_pyloop``: ascend_pool's ``pool.malloc``/``pool.free`` from that same Python loop,
    so that the GPU peers' ops/s can be compared with ours on equal terms.

Peers that cannot run here raise :class:`PeerSkipped` with the reason; :func:`probe` tells in
advance. This module imports torch, cupy and rmm only inside the peer that needs them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Callable, Optional

import numpy as np

from ..traces import Trace, load_trace, peak_live_bytes
from ..pool import Pool
from ..replay import replay
from . import torch_npu_policy

__all__ = ["PeerSkipped", "ALLOCATORS", "BASE_ALLOCATORS", "GPU_ALLOCATORS", "allocators_for", "probe",
           "run_peer", "make_row", "python_replay", "second_half_allocs"]


class PeerSkipped(Exception):
    """This peer cannot run here; str(exc) says why."""


#: name -> (label, how the replay loop is driven)
ALLOCATORS = {
    "ascend_pool": ("ascend_pool caching pool", "C"),
    "direct": ("one device call per allocation and free", "C"),
    "torch_npu_policy": ("torch_npu caching policy (re-implementation, not torch_npu itself; "
                         "pure-Python model, no device)", "Python model"),
    "torch_caching": ("PyTorch CUDA caching allocator (torch.cuda.caching_allocator_alloc)", "Python"),
    "torch_cudamallocasync": ("PyTorch with PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync", "Python"),
    "cupy_pool": ("CuPy MemoryPool", "Python"),
    "rmm_pool": ("RMM PoolMemoryResource", "Python"),
    "ascend_pool_pyloop": ("ascend_pool driven from the peers' Python loop", "Python"),
}
BASE_ALLOCATORS = ("ascend_pool", "direct", "torch_npu_policy")
GPU_ALLOCATORS = ("torch_caching", "torch_cudamallocasync", "cupy_pool", "rmm_pool")


def allocators_for(backend_name: str) -> tuple:
    """Allocators a run on this backend lists (runnable or not)."""
    if backend_name == "cuda":
        return BASE_ALLOCATORS + GPU_ALLOCATORS + ("ascend_pool_pyloop",)
    return BASE_ALLOCATORS + GPU_ALLOCATORS


def second_half_allocs(trace: Trace) -> int:
    """Allocations among the second half of the events (the events from n // 2 on)."""
    return int(np.count_nonzero(trace.op[trace.n_events // 2:] == 1))


def _pct(num, den):
    return 100.0 * num / den if num is not None and den else None


def make_row(trace: Trace, allocator: str, fig: dict, **extra) -> dict:
    """One table row from a peer's figures. fig needs seconds, peak_reserved_bytes,
    device_mallocs, device_frees, device_calls_steady (None where the peer cannot count them);
    allocs, frees, peak_live_bytes and final_allocated_bytes default to the trace's;
    fragmentation_ratio (the ascend_pool_fragmentation_ratio metric's formula at the peak of
    reserved) is None where the peer cannot tell it."""
    label, loop = ALLOCATORS[allocator]
    allocs = fig.get("allocs", trace.n_allocs)
    frees = fig.get("frees", trace.n_frees)
    seconds = fig["seconds"]
    live = fig.get("peak_live_bytes")
    if live is None:
        live = peak_live_bytes(trace)
    reserved = fig["peak_reserved_bytes"]
    dm, df = fig.get("device_mallocs"), fig.get("device_frees")
    calls = fig.get("device_calls")
    if calls is None and dm is not None and df is not None:
        calls = dm + df
    steady = fig.get("device_calls_steady")
    half_allocs = second_half_allocs(trace)
    row = {
        "trace": trace.name,
        "allocator": allocator,
        "label": label,
        "loop": loop,
        "events": trace.n_events,
        "allocs": allocs,
        "frees": frees,
        "seconds": seconds,
        "ops_per_second": (allocs + frees) / seconds if seconds and seconds > 0 else None,
        "peak_live_bytes": live,
        "peak_reserved_bytes": reserved,
        "waste_bytes": reserved - live if reserved is not None else None,
        # the metric's meaning (0..1) at the peak of reserved, where the peer can tell it
        "fragmentation_ratio": fig.get("fragmentation_ratio"),
        "reserved_to_live_ratio": reserved / live if reserved is not None and live else None,
        "device_mallocs": dm,
        "device_frees": df,
        "device_calls": calls,
        "device_calls_steady": steady,
        "allocs_second_half": half_allocs,
        "device_calls_pct_of_allocs": _pct(calls, allocs),
        "device_calls_steady_pct_of_allocs": _pct(steady, half_allocs),
        "final_allocated_bytes": fig.get("final_allocated_bytes"),
    }
    row.update(extra)
    return row


# -------------------------------------------------------------------------------------------
# Availability
# -------------------------------------------------------------------------------------------

def _import_reason(module: str) -> Optional[str]:
    try:
        __import__(module)
    except Exception as e:  # ImportError, or a broken install raising anything
        return f"{module} is not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


def _torch_cuda_reason() -> Optional[str]:
    why = _import_reason("torch")
    if why:
        return why
    import torch

    if not torch.cuda.is_available():
        return (f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False"
                f"{'; a CPU-only build' if torch.version.cuda is None else ''})")
    return None


def probe(name: str, backend_name: str) -> Optional[str]:
    """None when peer `name` can run on this backend here, else the reason it cannot."""
    if name not in ALLOCATORS:
        return f"unknown allocator {name!r}"
    if name in BASE_ALLOCATORS:
        return None
    if backend_name != "cuda":
        return f"a CUDA peer: runs only with --backend cuda on a GPU (this run: {backend_name})"
    if name == "ascend_pool_pyloop":
        return None
    if name in ("torch_caching", "torch_cudamallocasync"):
        return _torch_cuda_reason()
    if name == "cupy_pool":
        why = _import_reason("cupy")
        if why:
            return why
        import cupy

        try:
            n = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:
            return f"cupy {cupy.__version__} finds no CUDA device ({type(e).__name__}: {e})"
        return None if n > 0 else f"cupy {cupy.__version__} finds no CUDA device"
    if name == "rmm_pool":
        why = _import_reason("rmm")
        if why:
            return why
        import rmm

        if not hasattr(rmm, "mr") or not hasattr(rmm.mr, "PoolMemoryResource"):
            return f"rmm {getattr(rmm, '__version__', '?')} has no rmm.mr.PoolMemoryResource"
        return None
    return None


# -------------------------------------------------------------------------------------------
# The peers
# -------------------------------------------------------------------------------------------

def _stream_index(trace: Trace):
    numbers = sorted(set(np.unique(trace.stream).tolist()))
    index = {n: i for i, n in enumerate(numbers)}
    return numbers, [index[s] for s in trace.stream.tolist()]


def python_replay(trace: Trace, alloc: Callable, free: Callable, counters: Optional[Callable] = None,
                  after: Optional[Callable] = None) -> dict:
    """Replays trace from a Python loop: handle = alloc(size, stream_index); free(handle, size,
    stream_index). counters() -> device calls so far (or None), read at the start, at the half
    (the time it takes is not counted) and at the end; after() runs before the clock stops (e.g. a
    device synchronize). Returns seconds, device_calls, device_calls_steady."""
    ops = trace.op.tolist()
    slots = trace.slot.tolist()
    sizes = trace.size.tolist()
    _, sidx = _stream_index(trace)
    n = len(ops)
    half = n // 2
    ptr = [None] * int(trace.n_slots)
    c0 = counters() if counters else None
    c_half, pause = None, 0.0
    t0 = time.perf_counter()
    for part, (lo, hi) in enumerate(((0, half), (half, n))):
        if part:  # the half: the counters' read there is not timed
            tm = time.perf_counter()
            c_half = counters() if counters else None
            pause = time.perf_counter() - tm
        for i in range(lo, hi):
            if ops[i]:
                ptr[slots[i]] = alloc(sizes[i], sidx[i])
            else:
                s = slots[i]
                free(ptr[s], sizes[i], sidx[i])
                ptr[s] = None
    if after:
        after()
    seconds = time.perf_counter() - t0 - pause
    c_end = counters() if counters else None
    calls = steady = None
    if c0 is not None and c_half is not None and c_end is not None:
        calls, steady = c_end - c0, c_end - c_half
    return {"seconds": seconds, "device_calls": calls, "device_calls_steady": steady}


def _replay_ascend(trace, backend, device, mode, pool_knobs=None):
    r = replay(trace, backend=backend, mode=mode, device=device, pool_knobs=pool_knobs)
    return {k: r[k] for k in ("allocs", "frees", "seconds", "peak_live_bytes", "peak_reserved_bytes",
                              "device_mallocs", "device_frees", "device_calls", "device_calls_steady",
                              "final_allocated_bytes", "fragmentation_ratio")}


def _replay_policy(trace):
    r = torch_npu_policy.replay(trace)
    return {k: r[k] for k in ("allocs", "frees", "seconds", "peak_reserved_bytes", "device_mallocs",
                              "device_frees", "device_calls_steady", "final_allocated_bytes", "fragmentation_ratio")}


def _replay_pyloop(trace, backend, device):
    pool = Pool(device, backend=backend)
    numbers, _ = _stream_index(trace)
    handles = [None if n == 0 else pool.create_stream() for n in numbers]
    try:
        malloc, free = pool.malloc, pool.free

        def alloc(size, s):
            return malloc(size, handles[s])

        def release(ptr, size, s):
            free(ptr)

        def counters():
            st = pool.memory_stats()
            return int(st["num_device_alloc"]) + int(st["num_device_free"])

        r = python_replay(trace, alloc, release, counters, after=lambda: pool.synchronize())
        st = pool.memory_stats()
        r.update(peak_reserved_bytes=int(st["reserved_bytes.all.peak"]),
                 device_mallocs=int(st["num_device_alloc"]), device_frees=int(st["num_device_free"]),
                 final_allocated_bytes=int(st["allocated_bytes.all.current"]))
        r["device_calls"] = r["device_mallocs"] + r["device_frees"]
        return r
    finally:
        for h in handles:
            if h is not None:
                pool.destroy_stream(h)
        pool.close()


def torch_replay(trace: Trace, device: int = 0) -> dict:
    """trace through torch.cuda.caching_allocator_alloc/delete in this process, with whatever
    allocator backend PYTORCH_CUDA_ALLOC_CONF chose at torch's start. Figures from
    torch.cuda.memory_stats()."""
    import torch

    torch.cuda.init()
    torch.cuda.set_device(device)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    try:
        torch.cuda.reset_accumulated_memory_stats(device)
    except RuntimeError:
        pass  # cudaMallocAsync: accumulated stats are not supported
    torch.cuda.reset_peak_memory_stats(device)
    numbers, _ = _stream_index(trace)
    streams = [torch.cuda.current_stream(device).cuda_stream if n == 0 else torch.cuda.Stream(device).cuda_stream
               for n in numbers]
    alloc_fn, delete_fn = torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete

    def alloc(size, s):
        return alloc_fn(size, device, streams[s])

    def release(ptr, size, s):
        delete_fn(ptr)

    backend = torch.cuda.get_allocator_backend() if hasattr(torch.cuda, "get_allocator_backend") else "native"
    counts_calls = backend != "cudaMallocAsync"  # that backend reports no device-call counters

    def counters():
        if not counts_calls:
            return None
        st = torch.cuda.memory_stats(device)
        if "num_device_alloc" in st:
            return int(st["num_device_alloc"]) + int(st.get("num_device_free", 0))
        if "segment.all.allocated" in st:
            return int(st["segment.all.allocated"]) + int(st.get("segment.all.freed", 0))
        return None

    r = python_replay(trace, alloc, release, counters, after=torch.cuda.synchronize)
    st = torch.cuda.memory_stats(device)
    r["peak_reserved_bytes"] = int(st.get("reserved_bytes.all.peak", 0)) or None
    if not counts_calls:
        r["device_mallocs"] = r["device_frees"] = None
        r["note"] = "the cudaMallocAsync backend does not count device calls"
    elif "num_device_alloc" in st:
        r["device_mallocs"], r["device_frees"] = int(st["num_device_alloc"]), int(st.get("num_device_free", 0))
    elif "segment.all.allocated" in st:
        r["device_mallocs"], r["device_frees"] = int(st["segment.all.allocated"]), int(st.get("segment.all.freed", 0))
    else:
        r["device_mallocs"] = r["device_frees"] = None
    r["final_allocated_bytes"] = int(st["allocated_bytes.all.current"]) if "allocated_bytes.all.current" in st else None
    r["torch_version"] = torch.__version__
    r["torch_allocator_backend"] = backend
    r["pytorch_cuda_alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    torch.cuda.empty_cache()
    return r


def _torch_subprocess(trace: Trace, device: int, conf: str, timeout: float = 3600) -> dict:
    if not trace.path:
        raise PeerSkipped("the trace has no file for the subprocess to load")
    env = dict(os.environ)
    env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "ascend_pool.bench.peers", "torch-worker", trace.path, "--device", str(device)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"torch worker with PYTORCH_CUDA_ALLOC_CONF={conf} failed (rc {p.returncode}): "
                           + " | ".join(tail))
    return json.loads(p.stdout.strip().splitlines()[-1])


def _replay_cupy(trace: Trace, device: int) -> dict:
    import cupy

    with cupy.cuda.Device(device):
        counts = {"mallocs": 0}

        def upstream(size):  # the pool's device allocations (cudaMalloc through cupy.cuda.Memory)
            counts["mallocs"] += 1
            return cupy.cuda.MemoryPointer(cupy.cuda.Memory(size), 0)

        pool = cupy.cuda.MemoryPool(upstream)
        numbers, _ = _stream_index(trace)
        streams = [cupy.cuda.Stream.null if n == 0 else cupy.cuda.Stream(non_blocking=True) for n in numbers]
        state = {"cur": 0, "peak": 0, "drops": 0, "last_total": 0}
        streams[0].use()
        malloc, total = pool.malloc, pool.total_bytes

        def alloc(size, s):
            if s != state["cur"]:
                streams[s].use()
                state["cur"] = s
            mp = malloc(size)
            t = total()
            if t > state["peak"]:
                state["peak"] = t
            elif t < state["last_total"]:
                state["drops"] += 1  # the pool returned memory (it frees only on OOM retries)
            state["last_total"] = t
            return mp

        def release(mp, size, s):
            pass  # the caller drops its reference: the MemoryPointer goes back to the pool

        def counters():
            return counts["mallocs"] + state["drops"]

        r = python_replay(trace, alloc, release, counters, after=cupy.cuda.Device(device).synchronize)
        cupy.cuda.Stream.null.use()
        r.update(peak_reserved_bytes=state["peak"], device_mallocs=counts["mallocs"],
                 device_frees=state["drops"], final_allocated_bytes=int(pool.used_bytes()),
                 cupy_version=cupy.__version__,
                 note="device frees counted as drops of pool.total_bytes() (lower bound)")
        pool.free_all_blocks()
        return r


def _rmm_stats(adaptor) -> dict:
    s = adaptor.allocation_counts
    s = s() if callable(s) else s
    get = (lambda k: s[k]) if isinstance(s, dict) else (lambda k: getattr(s, k))
    return {k: int(get(k)) for k in ("current_bytes", "peak_bytes", "total_bytes", "current_count",
                                     "peak_count", "total_count")}


def _replay_rmm(trace: Trace, device: int) -> dict:
    import rmm

    try:
        from rmm.pylibrmm.stream import DEFAULT_STREAM, Stream
    except ImportError:  # older rmm
        from rmm._cuda.stream import DEFAULT_STREAM, Stream
    if hasattr(rmm, "_cuda") and hasattr(rmm._cuda, "gpu"):
        try:
            rmm._cuda.gpu.setDevice(device)
        except Exception:
            pass
    upstream = rmm.mr.StatisticsResourceAdaptor(rmm.mr.CudaMemoryResource())
    try:
        pool = rmm.mr.PoolMemoryResource(upstream, initial_pool_size=0)
    except Exception:
        pool = rmm.mr.PoolMemoryResource(upstream, initial_pool_size=256)
    numbers, _ = _stream_index(trace)
    streams = [DEFAULT_STREAM]
    note = ""
    for n in numbers[1:]:
        try:
            import cupy

            streams.append(Stream(cupy.cuda.Stream(non_blocking=True)))
        except Exception as e:
            streams.append(DEFAULT_STREAM)
            note = f"stream {n} replayed on the default stream (no cupy stream to wrap: {type(e).__name__})"
    allocate, deallocate = pool.allocate, pool.deallocate
    try:  # rmm >= 24: allocate(nbytes, stream); older: allocate(nbytes). Tried outside the pool.
        plain = rmm.mr.CudaMemoryResource()
        plain.deallocate(plain.allocate(256, streams[0]), 256, streams[0])
        with_stream = True
    except TypeError:
        with_stream = False
        note = "this rmm's allocate() takes no stream: every event on the default stream"
    if not with_stream:
        def alloc(size, s):
            return allocate(size)

        def release(ptr, size, s):
            deallocate(ptr, size)
    else:
        def alloc(size, s):
            return allocate(size, streams[s])

        def release(ptr, size, s):
            deallocate(ptr, size, streams[s])

    def counters():
        st = _rmm_stats(upstream)
        return st["total_count"] + (st["total_count"] - st["current_count"])

    def sync():
        for s in streams:
            s.synchronize()

    r = python_replay(trace, alloc, release, counters, after=sync)
    st = _rmm_stats(upstream)
    r.update(peak_reserved_bytes=st["peak_bytes"], device_mallocs=st["total_count"],
             device_frees=st["total_count"] - st["current_count"], final_allocated_bytes=None,
             rmm_version=getattr(rmm, "__version__", "?"))
    if note:
        r["note"] = note
    del pool
    return r


def run_peer(name: str, trace, backend, device: int = 0, pool_knobs: Optional[dict] = None) -> dict:
    """Replays trace (a Trace or a path) through allocator `name` on backend (a Backend); returns
    its row. Raises PeerSkipped when the peer cannot run here."""
    if not isinstance(trace, Trace):
        trace = load_trace(trace)
    backend_name = backend.name if hasattr(backend, "name") else str(backend)
    kind = "cuda" if getattr(backend, "kind", backend_name) == "cuda" or backend_name == "cuda" else backend_name
    why = probe(name, kind)
    if why:
        raise PeerSkipped(why)
    extra = {"backend": backend_name}
    if name == "ascend_pool":
        fig = _replay_ascend(trace, backend, device, "pool", pool_knobs)
        if pool_knobs:
            extra["pool_knobs"] = dict(pool_knobs)
    elif name == "direct":
        fig = _replay_ascend(trace, backend, device, "direct")
    elif name == "torch_npu_policy":
        fig = _replay_policy(trace)
        extra["backend"] = "model"
    elif name == "ascend_pool_pyloop":
        fig = _replay_pyloop(trace, backend, device)
    elif name == "torch_caching":
        fig = torch_replay(trace, device)
    elif name == "torch_cudamallocasync":
        fig = _torch_subprocess(trace, device, "backend:cudaMallocAsync")
        if fig.get("torch_allocator_backend") not in (None, "cudaMallocAsync"):
            raise RuntimeError(f"the worker ran torch's {fig.get('torch_allocator_backend')!r} allocator, "
                               "not cudaMallocAsync")
    elif name == "cupy_pool":
        fig = _replay_cupy(trace, device)
    elif name == "rmm_pool":
        fig = _replay_rmm(trace, device)
    else:
        raise PeerSkipped(f"unknown allocator {name!r}")
    for k in ("torch_version", "torch_allocator_backend", "pytorch_cuda_alloc_conf", "cupy_version",
              "rmm_version", "note"):
        if k in fig:
            extra[k] = fig[k]
    return make_row(trace, name, fig, **extra)


def _main(argv=None) -> int:
    """`python -m ascend_pool.bench.peers torch-worker TRACE [--device N]`: one torch replay in
    this fresh process (its allocator backend set by PYTORCH_CUDA_ALLOC_CONF); prints the figures
    as one JSON line."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m ascend_pool.bench.peers")
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("torch-worker")
    w.add_argument("trace")
    w.add_argument("--device", type=int, default=0)
    args = ap.parse_args(argv)
    why = _torch_cuda_reason()
    if why:
        print(why, file=sys.stderr)
        return 3
    r = torch_replay(load_trace(args.trace), args.device)
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())

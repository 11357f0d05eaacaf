"""Perturbed workloads for the robustness harness (`ascend-pool bench --variants N`).

Each trace gives N variants, each derived with its own seeded generator (``zlib.crc32`` of the
trace name and the variant's number, plus ``seed``), so a run repeats exactly. Every variant
applies a size scale and then one to three of the other perturbations, each drawn from the range
below. The result is always a valid trace (every allocation freed once, on its own stream, with its
own size), ending with everything freed.

Phases: the trace is cut where live bytes fall back near their floor (at most
``live_floor + 5 % of (peak - floor)``, the floor being the 10th percentile of live bytes; cuts at
least 1/40 of the events apart): a training step, a served batch. An allocation made and freed
inside one phase is *local* to it; the others (weights, optimizer state, KV caches that live
across batches) are *cross-phase* and keep their place.

Perturbations and their ranges (``RANGES``):

- ``scale``: every size times a factor, log-uniform in [0.5, 2.0] (another model width);
- ``mix``: each phase's local sizes times its own factor, log-uniform in [0.6, 1.6] (other batch
  sizes or sequence lengths per step);
- ``truncate``: keep the first 40-90 % of the events, then free what is live (latest first);
- ``reorder``: the phases' local events in a random order (cross-phase events stay where they
  were, ahead of the local ones of their slot);
- ``repeat``: 1-3 phases' local events played once more, right after themselves;
- ``streams``: merge every stream into stream 0, or (single-stream traces) put the local
  allocations of every other phase on stream 1 (a side stream's pipeline).
"""
from __future__ import annotations

import math
import zlib
from typing import Optional

import numpy as np

from ..traces import Trace, load_trace, trace_from_arrays

__all__ = ["RANGES", "PERTURBATIONS", "derive", "derive_all", "phases"]

#: documented ranges of the perturbations
RANGES = {
    "scale": (0.5, 2.0),
    "mix": (0.6, 1.6),
    "truncate": (0.4, 0.9),
    "repeat_phases": (1, 3),
}
PERTURBATIONS = ("mix", "truncate", "reorder", "repeat", "streams")
DEFAULT_SEED = 19


def _loguniform(rng, lo, hi):
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def phases(trace: Trace) -> np.ndarray:
    """Phase number of every event (0, 1, ...): cuts after events where live bytes fall back near
    their floor (see the module's docstring)."""
    n = trace.n_events
    if n == 0:
        return np.zeros(0, np.int32)
    live = np.cumsum(np.where(trace.op == 1, trace.size, -trace.size))
    floor = float(np.percentile(live, 10))
    top = float(live.max())
    low = np.flatnonzero((live <= floor + 0.05 * (top - floor)) & (trace.op == 0))
    gap = max(1, n // 40)
    cuts, last = [], -gap
    for i in low.tolist():
        if i - last >= gap and i < n - 1:
            cuts.append(i + 1)
            last = i
    ph = np.zeros(n, np.int32)
    for c in cuts:
        ph[c:] += 1
    return ph


def _build(op, slot, size, stream, name, meta) -> Trace:
    return trace_from_arrays(np.asarray(op, np.int8), np.asarray(slot, np.int64), np.asarray(size, np.int64),
                             np.asarray(stream, np.int32), name=name, meta=meta)


def _close(op, slot, size, stream):
    """Appends a free for every allocation still live (latest first)."""
    live = {}
    for o, s, z, st in zip(op, slot, size, stream):
        if o:
            live[s] = (z, st)
        else:
            live.pop(s, None)
    for s in reversed(list(live)):
        z, st = live[s]
        op.append(0)
        slot.append(s)
        size.append(z)
        stream.append(st)


def derive(trace: Trace, k: int, seed: int = DEFAULT_SEED) -> Trace:
    """Variant k of trace (deterministic for a given trace name, k and seed)."""
    rng = np.random.default_rng([seed, zlib.crc32(trace.name.encode()), k])
    n = trace.n_events
    op = trace.op
    slot = trace.slot.astype(np.int64)
    ph = phases(trace)
    n_ph = int(ph[-1]) + 1 if n else 1
    # per-slot facts: the phases of its alloc and free, its size and stream
    alloc_ev = np.flatnonzero(op == 1)
    free_ev = np.flatnonzero(op == 0)
    a_ph = np.empty(trace.n_slots, np.int32)
    a_ph[slot[alloc_ev]] = ph[alloc_ev]
    f_ph = np.full(trace.n_slots, -1, np.int32)
    f_ph[slot[free_ev]] = ph[free_ev]
    local = a_ph == f_ph
    s_size = np.empty(trace.n_slots, np.float64)
    s_size[slot[alloc_ev]] = trace.size[alloc_ev]
    s_stream = np.zeros(trace.n_slots, np.int32)
    s_stream[slot[alloc_ev]] = trace.stream[alloc_ev]

    applied = {}
    f = _loguniform(rng, *RANGES["scale"])
    applied["scale"] = round(f, 3)
    s_size *= f
    chosen = [p for p in PERTURBATIONS if n_ph > 1 or p in ("truncate", "streams")]
    m = int(rng.integers(1, 4))
    picks = [chosen[i] for i in sorted(rng.choice(len(chosen), size=min(m, len(chosen)), replace=False))]

    if "mix" in picks:
        fac = np.exp(rng.uniform(math.log(RANGES["mix"][0]), math.log(RANGES["mix"][1]), n_ph))
        s_size = np.where(local, s_size * fac[a_ph], s_size)
        applied["mix"] = [round(float(x), 3) for x in fac[:8]] + (["..."] if n_ph > 8 else [])
    if "streams" in picks:
        if len(np.unique(s_stream)) > 1:
            s_stream[:] = 0
            applied["streams"] = "merged"
        else:
            s_stream = np.where(local & (a_ph % 2 == 1), 1, s_stream).astype(np.int32)
            applied["streams"] = "split"
    sizes_int = np.maximum(1, np.rint(s_size)).astype(np.int64)

    # event order: phases' local events permuted / repeated; cross-phase events keep their place
    order = None
    if "reorder" in picks or "repeat" in picks:
        perm = np.arange(n_ph)
        if "reorder" in picks:
            perm = rng.permutation(n_ph)
            applied["reorder"] = True
        reps = np.ones(n_ph, np.int64)
        if "repeat" in picks:
            lo, hi = RANGES["repeat_phases"]
            which = rng.choice(n_ph, size=min(n_ph, int(rng.integers(lo, hi + 1))), replace=False)
            reps[which] += 1
            applied["repeat"] = sorted(int(x) for x in which)
        ev_local = local[slot]
        by_phase = [np.flatnonzero(ph == p) for p in range(n_ph)]
        parts = []
        for pos in range(n_ph):
            idx = by_phase[pos]
            parts.append(("cross", idx[~ev_local[idx]]))
            q = perm[pos]
            loc = by_phase[q][ev_local[by_phase[q]]]
            for r in range(int(reps[q])):
                parts.append(("copy" if r else "local", loc))
        order = parts

    out_op, out_slot, out_size, out_stream = [], [], [], []
    next_slot = trace.n_slots
    if order is None:
        out_op = op.tolist()
        out_slot = slot.tolist()
        out_size = sizes_int[slot].tolist()
        out_stream = s_stream[slot].tolist()
    else:
        for kind, idx in order:
            if not len(idx):
                continue
            sl = slot[idx]
            if kind == "copy":  # fresh ids for the repeated allocations
                uniq, inv = np.unique(sl, return_inverse=True)
                new = np.arange(next_slot, next_slot + len(uniq))
                next_slot += len(uniq)
                ids = new[inv]
            else:
                ids = sl
            out_op += op[idx].tolist()
            out_slot += ids.tolist()
            out_size += sizes_int[sl].tolist()
            out_stream += s_stream[sl].tolist()
    if "truncate" in picks:
        frac = rng.uniform(*RANGES["truncate"])
        cut = max(1, int(len(out_op) * frac))
        out_op, out_slot, out_size, out_stream = out_op[:cut], out_slot[:cut], out_size[:cut], out_stream[:cut]
        _close(out_op, out_slot, out_size, out_stream)
        applied["truncate"] = round(frac, 3)
    meta = {"variant_of": trace.name, "variant": k, "seed": seed, "perturbations": applied}
    return _build(out_op, out_slot, out_size, out_stream, f"{trace.name}~v{k}", meta)


def derive_all(trace: Trace, n: int, seed: int = DEFAULT_SEED, first: int = 0) -> list:
    """Variants first .. first + n - 1 of trace."""
    return [derive(trace, k, seed) for k in range(first, first + n)]


def describe(meta: dict) -> str:
    """A short text of a variant's perturbations: ``scale 1.32, truncate 0.61``."""
    parts = []
    for key, val in meta.get("perturbations", {}).items():
        if isinstance(val, list):
            val = "phases " + ",".join(str(v) for v in val) if key == "repeat" else "per phase"
        parts.append(f"{key} {val}" if val is not True else key)
    return ", ".join(parts)


def _main(argv: Optional[list] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Print the perturbations of a trace's variants.")
    ap.add_argument("trace")
    ap.add_argument("-n", type=int, default=5)
    args = ap.parse_args(argv)
    tr = load_trace(args.trace)
    for v in derive_all(tr, args.n):
        print(f"{v.name}: {v.n_events:,} events; {describe(v.meta)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())

"""The robustness harness: ascend_pool against the torch_npu-policy model on perturbed workloads.

``run_variants(paths, n, ...)`` derives n variants of every trace (:mod:`.variants`), replays each
through ``ascend_pool`` (with the run's knobs) and ``torch_npu_policy``, and returns the JSON
object the bench stores under ``variants``::

    {"config": {n, seed, ranges, perturbations, pool_knobs},
     "per_trace": {trace: summary}, "overall": summary,
     "workloads": [one entry per variant], "targets": [...]}

A summary holds ``workloads``, the waste reduction against the reference in % (``min``,
``median``, ``max``, ``mean``; the reduction is 1 - ascend_pool's waste / the reference's, waste
= peak reserved - peak live), the worst device-call rates (``worst_steady_pct``: device calls in
the second half of the events per allocation in that half; ``worst_whole_pct``: over the whole
trace), ``reserves_more`` (workloads where ascend_pool's peak reserved exceeds the
reference's) and ``misses_call_target`` (workloads above 1 % steady-state or 3 % whole-trace
device calls). Replays run without simulated device latency: the figures do not depend on it.
"""
from __future__ import annotations

import statistics
import time
from typing import Optional

from ..traces import load_trace
from . import peers as _peers
from .variants import DEFAULT_SEED, PERTURBATIONS, RANGES, derive, describe

__all__ = ["run_variants", "summarize", "variant_targets", "variants_markdown"]

MiB = 1024 * 1024


def _workload(v, ap: dict, ref: dict) -> dict:
    wa, wr = ap["waste_bytes"], ref["waste_bytes"]
    red = (1.0 - wa / wr) if wr else (0.0 if wa == 0 else None)
    return {
        "name": v.name, "trace": v.meta["variant_of"], "variant": v.meta["variant"],
        "perturbations": describe(v.meta), "events": v.n_events, "allocs": v.n_allocs,
        "peak_live_bytes": ap["peak_live_bytes"],
        "ascend_pool_reserved_bytes": ap["peak_reserved_bytes"], "reference_reserved_bytes": ref["peak_reserved_bytes"],
        "ascend_pool_waste_bytes": wa, "reference_waste_bytes": wr,
        "waste_reduction_pct": None if red is None else 100.0 * red,
        "steady_pct": ap["device_calls_steady_pct_of_allocs"], "whole_pct": ap["device_calls_pct_of_allocs"],
        "reference_steady_pct": ref["device_calls_steady_pct_of_allocs"],
        "reserves_more": ap["peak_reserved_bytes"] > ref["peak_reserved_bytes"],
    }


#: issue 19's device-call targets, per workload: % of allocations (second half, whole trace)
STEADY_TARGET_PCT, WHOLE_TARGET_PCT = 1.0, 3.0


def _misses_call_target(w: dict) -> bool:
    return (w["steady_pct"] or 0) > STEADY_TARGET_PCT or (w["whole_pct"] or 0) > WHOLE_TARGET_PCT


def summarize(workloads: list) -> dict:
    """The distribution over workloads (see the module's docstring)."""
    reds = [w["waste_reduction_pct"] for w in workloads if w["waste_reduction_pct"] is not None]
    steady = [w["steady_pct"] for w in workloads if w["steady_pct"] is not None]
    whole = [w["whole_pct"] for w in workloads if w["whole_pct"] is not None]
    out = {"workloads": len(workloads),
           "min": min(reds) if reds else None, "median": statistics.median(reds) if reds else None,
           "max": max(reds) if reds else None, "mean": statistics.fmean(reds) if reds else None,
           "worst_steady_pct": max(steady) if steady else None, "worst_whole_pct": max(whole) if whole else None,
           "reserves_more": sum(1 for w in workloads if w["reserves_more"]),
           "misses_call_target": sum(1 for w in workloads if _misses_call_target(w))}
    if workloads:
        out["worst_reduction_workload"] = min(
            workloads, key=lambda w: w["waste_reduction_pct"] if w["waste_reduction_pct"] is not None else 1e9)["name"]
        out["worst_steady_workload"] = max(workloads, key=lambda w: w["steady_pct"] or 0)["name"]
    return out


def variant_targets(overall: dict, expandable: bool) -> list:
    """Issue 19's targets on the perturbed workloads, in the bench's target format."""
    mean_goal = 85.0 if expandable else 60.0
    o = overall

    def t(tid, text, passed, detail):
        if not o["workloads"]:  # every variant failed (the device's memory, a fault): nothing to judge
            passed, detail = None, "no perturbed workload replayed (the variants' errors say why)"
        return {"id": tid, "target": text, "passed": passed, "detail": detail, "per_trace": {}}

    fmt = (lambda x, s=".1f": "-" if x is None else format(x, s))
    return [
        t("variants_never_more", "perturbed workloads: ascend_pool reserves no more than torch_npu_policy on any",
          o["reserves_more"] == 0, f"{o['reserves_more']} of {o['workloads']} workloads above the reference"),
        t("variants_mean_reduction",
          f"perturbed workloads: mean waste reduction >= {mean_goal:.0f} % "
          f"({'expandable segments' if expandable else 'classic segments'})",
          o["mean"] is not None and o["mean"] >= mean_goal,
          f"mean {fmt(o['mean'])} %, median {fmt(o['median'])} %, min {fmt(o['min'])} % "
          f"({o.get('worst_reduction_workload', '-')})"),
        t("variants_steady_calls", "perturbed workloads: steady-state device calls <= 1 % of allocations on every one",
          o["worst_steady_pct"] is not None and o["worst_steady_pct"] <= STEADY_TARGET_PCT,
          f"worst {fmt(o['worst_steady_pct'], '.3f')} % ({o.get('worst_steady_workload', '-')})"),
        t("variants_whole_calls", "perturbed workloads: whole-trace device calls <= 3 % of allocations on every one",
          o["worst_whole_pct"] is not None and o["worst_whole_pct"] <= WHOLE_TARGET_PCT,
          f"worst {fmt(o['worst_whole_pct'], '.3f')} %"),
    ]


def run_variants(paths: list, n: int, backend, device: int = 0, pool_knobs: Optional[dict] = None,
                 seed: int = DEFAULT_SEED, progress=None) -> dict:
    """Derives n variants of every trace in paths and replays them (see the module's docstring).
    backend: an open Backend; progress: a Progress (optional)."""
    t0 = time.perf_counter()
    workloads, per_trace, errors = [], {}, []
    for path in paths:
        tr = load_trace(path)
        mine = []
        for k in range(n):
            v = derive(tr, k, seed)
            if progress is not None:
                progress.step(f"variants: {v.name} ({v.n_events:,} events)")
            try:
                ap = _peers.run_peer("ascend_pool", v, backend, device, pool_knobs=pool_knobs)
                ref = _peers.run_peer("torch_npu_policy", v, backend, device)
            except Exception as e:  # one failing variant must not lose the others' figures
                errors.append({"workload": v.name, "error": f"{type(e).__name__}: {e}"})
                continue
            mine.append(_workload(v, ap, ref))
        per_trace[tr.name] = summarize(mine)
        workloads += mine
    overall = summarize(workloads)
    expandable = bool((pool_knobs or {}).get("expandable_segments"))
    return {
        "config": {"n": n, "seed": seed, "ranges": RANGES, "perturbations": ("scale",) + PERTURBATIONS,
                   "pool_knobs": pool_knobs or {}, "seconds": time.perf_counter() - t0},
        "per_trace": per_trace, "overall": overall, "workloads": workloads, "errors": errors,
        "targets": variant_targets(overall, expandable),
    }


def _f(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def variants_markdown(v: dict) -> list:
    """The harness's summary table (markdown lines)."""
    cfg = v["config"]
    lines = [f"{cfg['n']} perturbed variants of each trace (seed {cfg['seed']}; perturbations and ranges: "
             f"`ascend_pool/bench/variants.py`), each replayed through ascend_pool"
             f"{' (' + ', '.join(f'{k}:{x}' for k, x in cfg['pool_knobs'].items()) + ')' if cfg['pool_knobs'] else ''}"
             f" and torch_npu_policy; {cfg['seconds']:.0f} s. Waste reduction = 1 − ascend_pool's waste / "
             "torch_npu_policy's, in %.", "",
             "| trace | workloads | reduction min | median | max | mean | worst steady % allocs "
             "| worst whole-trace % allocs | reserves more than torch_npu_policy | miss a call target |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in list(v["per_trace"].items()) + [("**all**", v["overall"])]:
        lines.append(f"| {name} | {s['workloads']} | {_f(s['min'])} | {_f(s['median'])} | {_f(s['max'])} "
                     f"| {_f(s['mean'])} | {_f(s['worst_steady_pct'], '.3f')} | {_f(s['worst_whole_pct'], '.3f')} "
                     f"| {s['reserves_more']} | {s.get('misses_call_target', '-')} |")
    worst = sorted(v["workloads"], key=lambda w: w["waste_reduction_pct"] if w["waste_reduction_pct"] is not None
                   else 1e9)[:3]
    if worst:
        lines += ["", "Lowest reductions: " + "; ".join(
            f"{w['name']} ({w['perturbations']}): {_f(w['waste_reduction_pct'])} % "
            f"({w['ascend_pool_waste_bytes'] / MiB:,.1f} vs {w['reference_waste_bytes'] / MiB:,.1f} MiB)"
            for w in worst) + "."]
    for e in v.get("errors", []):
        lines.append(f"- error on {e['workload']}: {e['error']}")
    return lines

"""The benchmark's table: ratios to ascend_pool, the markdown rendering and the targets.

Ratios (``*_vs_ascend_pool``) are the row's figure divided by the ascend_pool row's figure on the
same trace (so 0.5 means half of ascend_pool's, 10 means ten times); None where either figure is
missing or ascend_pool's is 0.
"""
from __future__ import annotations

import statistics
from typing import Optional

from .robustness import variants_markdown

__all__ = ["RATIO_FIELDS", "add_ratios", "evaluate_targets", "to_markdown", "summary_lines", "TARGETS"]

MiB = 1024 * 1024

#: row field -> its ratio field
RATIO_FIELDS = {
    "ops_per_second": "ops_per_second_vs_ascend_pool",
    "peak_reserved_bytes": "peak_reserved_vs_ascend_pool",
    "waste_bytes": "waste_vs_ascend_pool",
    "device_calls": "device_calls_vs_ascend_pool",
}

#: the targets of issues 3 and 8
TARGETS = {
    "waste_every_trace": "ascend_pool waste (peak reserved - peak live) <= torch_npu_policy's, on every trace",
    "waste_average": "ascend_pool waste >= 50 % lower than torch_npu_policy's, on average over the traces",
    "device_calls_steady": "ascend_pool device calls <= 1 % of allocations in the second half of each trace",
    "device_calls_overall": "ascend_pool device calls <= 3 % of allocations over each whole trace",
    "ops_vs_direct": "ascend_pool ops/s >= 10x direct on every trace",
    "c_pair_40ns": "C-loop cached malloc+free pair <= 40 ns",
    "c_pair_3x_floor": "C-loop cached pair within 3x of the trivial free-list floor",
    "py_pair_120ns": "Python pool.malloc/pool.free pair <= 120 ns",
    "reference_published": "torch_npu_policy reproduces torch_npu's published peak reserved within 2 %",
}


def _ratio(a, b) -> Optional[float]:
    if a is None or b is None or b == 0:
        return None
    return a / b


def add_ratios(rows: list) -> list:
    """Adds the *_vs_ascend_pool fields to every row (in place); returns rows."""
    ap = {r["trace"]: r for r in rows if r["allocator"] == "ascend_pool"}
    for r in rows:
        base = ap.get(r["trace"])
        for field, rf in RATIO_FIELDS.items():
            r[rf] = _ratio(r.get(field), base.get(field)) if base is not None else None
    return rows


def _by(rows, allocator):
    return {r["trace"]: r for r in rows if r["allocator"] == allocator}


def _mib(b):
    return "-" if b is None else f"{b / MiB:,.1f}"


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def evaluate_targets(rows: list, micro: Optional[dict], published: Optional[dict] = None) -> list:
    """Each target as {"id", "target", "passed" (True/False/None when not measurable here),
    "detail", "per_trace"}. published: trace -> torch_npu's reserved MiB (the reference check)."""
    out = []
    ap = _by(rows, "ascend_pool")
    ref = _by(rows, "torch_npu_policy")
    direct = _by(rows, "direct")

    def add(tid, passed, detail, per_trace=None):
        out.append({"id": tid, "target": TARGETS[tid], "passed": passed, "detail": detail,
                    "per_trace": per_trace or {}})

    # waste vs the reference
    both = [t for t in ap if t in ref]
    if both:
        per, reductions, fails = {}, [], []
        for t in both:
            w, wr = ap[t]["waste_bytes"], ref[t]["waste_bytes"]
            red = (1.0 - w / wr) if wr else None
            per[t] = {"ascend_pool_waste_bytes": w, "torch_npu_policy_waste_bytes": wr,
                      "reduction_pct": None if red is None else 100.0 * red, "passed": w <= wr}
            if red is not None:
                reductions.append(red)
            if w > wr:
                fails.append(t)
        add("waste_every_trace", not fails,
            ("at or below on all %d traces" % len(both)) if not fails else
            "above the reference on " + ", ".join(
                f"{t} ({_mib(ap[t]['waste_bytes'])} vs {_mib(ref[t]['waste_bytes'])} MiB)" for t in fails), per)
        if reductions:
            mean = statistics.fmean(reductions)
            tot_ap = sum(ap[t]["waste_bytes"] for t in both)
            tot_ref = sum(ref[t]["waste_bytes"] for t in both)
            add("waste_average", mean >= 0.5,
                f"mean per-trace reduction {100 * mean:.1f} % (total waste {_mib(tot_ap)} vs {_mib(tot_ref)} MiB, "
                f"{100 * (1 - tot_ap / tot_ref) if tot_ref else 0:.1f} % lower)", per)
        else:
            add("waste_average", None, "the reference wastes nothing on these traces")
    else:
        add("waste_every_trace", None, "needs ascend_pool and torch_npu_policy rows")
        add("waste_average", None, "needs ascend_pool and torch_npu_policy rows")

    # device calls
    if ap:
        per_s, per_o, fs, fo = {}, {}, [], []
        for t, r in ap.items():
            s, o = r["device_calls_steady_pct_of_allocs"], r["device_calls_pct_of_allocs"]
            per_s[t] = {"device_calls_steady": r["device_calls_steady"], "allocs_second_half": r["allocs_second_half"],
                        "pct": s, "passed": s is not None and s <= 1.0}
            per_o[t] = {"device_calls": r["device_calls"], "allocs": r["allocs"], "pct": o,
                        "passed": o is not None and o <= 3.0}
            if not per_s[t]["passed"]:
                fs.append(t)
            if not per_o[t]["passed"]:
                fo.append(t)
        worst_s = max(ap, key=lambda t: ap[t]["device_calls_steady_pct_of_allocs"] or 0)
        worst_o = max(ap, key=lambda t: ap[t]["device_calls_pct_of_allocs"] or 0)
        add("device_calls_steady", not fs,
            f"worst {worst_s} {_fmt(ap[worst_s]['device_calls_steady_pct_of_allocs'], '.3f')} %"
            + (f"; over 1 % on {', '.join(fs)}" if fs else ""), per_s)
        add("device_calls_overall", not fo,
            f"worst {worst_o} {_fmt(ap[worst_o]['device_calls_pct_of_allocs'], '.3f')} %"
            + (f"; over 3 % on {', '.join(fo)}" if fo else ""), per_o)
    else:
        add("device_calls_steady", None, "no ascend_pool rows")
        add("device_calls_overall", None, "no ascend_pool rows")

    # ops/s vs direct
    both = [t for t in ap if t in direct]
    if both:
        per, fails = {}, []
        for t in both:
            x = _ratio(ap[t]["ops_per_second"], direct[t]["ops_per_second"])
            per[t] = {"speedup": x, "passed": x is not None and x >= 10.0}
            if not per[t]["passed"]:
                fails.append(t)
        worst = min(both, key=lambda t: per[t]["speedup"] or 0)
        add("ops_vs_direct", not fails,
            f"lowest {per[worst]['speedup']:.1f}x on {worst}" + (f"; under 10x on {', '.join(fails)}" if fails else ""),
            per)
    else:
        add("ops_vs_direct", None, "needs ascend_pool and direct rows")

    # micro
    if micro and "figures" in micro:
        f = micro["figures"]
        c, py = f["c_pair"], f["py_pair"]
        add("c_pair_40ns", c["ns"] <= 40.0, f"{c['ns']:.1f} ns (median)")
        add("c_pair_3x_floor", c["vs_floor"] is not None and c["vs_floor"] <= 3.0,
            f"{c['ns']:.1f} ns vs floor {c['floor_ns']:.1f} ns = {c['vs_floor']:.2f}x")
        add("py_pair_120ns", py["ns"] <= 120.0,
            f"{py['ns']:.1f} ns (median; the no-op def call in the same loop: {py['floor_ns']:.1f} ns, "
            f"{py['vs_floor']:.2f}x)")
    else:
        for tid in ("c_pair_40ns", "c_pair_3x_floor", "py_pair_120ns"):
            add(tid, None, "microbenchmarks not run")

    # the reference reproduces torch_npu's published figures
    if published:
        per, fails = {}, []
        for t, r in ref.items():
            if t in published:
                target = published[t]
                dev = 100.0 * (r["peak_reserved_bytes"] / MiB - target) / target
                per[t] = {"reserved_mib": r["peak_reserved_bytes"] / MiB, "published_mib": target,
                          "deviation_pct": dev, "passed": abs(dev) <= 2.0}
                if abs(dev) > 2.0:
                    fails.append(t)
        if per:
            worst = max(per, key=lambda t: abs(per[t]["deviation_pct"]))
            add("reference_published", not fails,
                f"{len(per)} trace(s) with a published figure; largest deviation {per[worst]['deviation_pct']:+.2f} % "
                f"({worst})", per)
        else:
            add("reference_published", None, "no trace here has a published torch_npu figure")
    else:
        add("reference_published", None, "no published figures given")
    return out


def _verdict(p):
    return "PASS" if p is True else ("FAIL" if p is False else "n/a ")


def summary_lines(targets: list) -> list:
    return [f"{_verdict(t['passed'])}  {t['target']}: {t['detail']}" for t in targets]


def micro_markdown(micro: dict) -> list:
    cfg = micro["config"]
    pairs = cfg["pairs_per_run"]
    lines = [f"Median of {cfg['runs']} runs, interleaved; {cfg['size_bytes']}-byte blocks; each loop "
             f"{'about ' + format(cfg['target_ms_per_loop'], 'g') + ' ms' if cfg.get('target_ms_per_loop') else 'fixed'} "
             f"({pairs['c_pair']:,} pool pairs and {pairs['c_floor']:,} floor pairs per C run, {pairs['py_pair']:,} "
             f"pool pairs per Python run; each thread runs as many when contended); backend {cfg['backend']}; "
             f"device calls during the timed loops: {cfg['device_calls_during_timed_loops']}.", "",
             "| figure | ns | floor | floor ns | × floor |", "|---|---:|---|---:|---:|"]
    for name, e in micro["figures"].items():
        if "floor" not in e:  # tail_under_maintenance: percentiles, below
            continue
        fl = micro["floors"][e["floor"]]
        lines.append(f"| {e['description']} | {e['ns']:.1f} | {fl['description']} | {e['floor_ns']:.1f} | "
                     f"{_fmt(e['vs_floor'], '.2f')} |")
    tail = micro["figures"].get("tail_under_maintenance")
    if tail:
        lines += ["", f"Tail under maintenance ({tail['description']}; {tail['pairs']:,} pairs, "
                      f"{tail['maintenance_rounds']} maintenance rounds): p50 {tail['p50_ns']:.0f} ns, "
                      f"p99 {tail['p99_ns']:.0f} ns, p99.9 {tail['p999_ns']:.0f} ns; uncontended p50 "
                      f"{tail['baseline_p50_ns']:.0f} ns (p99.9 = {_fmt(tail['p999_vs_baseline_p50'], '.1f')}x)."]
    info = micro.get("info", {})
    if info:
        extra = "; ".join(f"{v['description']}: {v['ns']:.1f} ns" for v in info.values())
        lines += ["", f"Also measured: {extra}."]
    return lines


ROW_HEADER = ("| trace | allocator | loop | ops/s | ops/s × ap | peak live MiB | peak reserved MiB | reserved × ap "
              "| waste MiB | waste × ap | reserved / live | frag. at peak | device mallocs | device calls | calls % allocs "
              "| steady calls | steady % allocs |")
ROW_ALIGN = "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"


def row_markdown(r: dict) -> str:
    return (f"| {r['trace']} | {r['allocator']} | {r['loop']} | {_fmt(r['ops_per_second'], ',.0f')} "
            f"| {_fmt(r['ops_per_second_vs_ascend_pool'], '.3g')} | {_mib(r['peak_live_bytes'])} "
            f"| {_mib(r['peak_reserved_bytes'])} | {_fmt(r['peak_reserved_vs_ascend_pool'], '.3f')} "
            f"| {_mib(r['waste_bytes'])} | {_fmt(r['waste_vs_ascend_pool'], '.3f')} "
            f"| {_fmt(r.get('reserved_to_live_ratio'), '.3f')} | {_fmt(r.get('fragmentation_ratio'), '.3f')} "
            f"| {_fmt(r['device_mallocs'], ',')} "
            f"| {_fmt(r['device_calls'], ',')} | {_fmt(r['device_calls_pct_of_allocs'], '.3f')} "
            f"| {_fmt(r['device_calls_steady'], ',')} | {_fmt(r['device_calls_steady_pct_of_allocs'], '.3f')} |")


def to_markdown(result: dict) -> str:
    """The whole report: header, microbenchmarks, replay table, skipped peers, targets."""
    meta = result["meta"]
    lines = [f"# ascend_pool benchmark ({meta['backend']} backend)", "",
             f"- date: {meta['date']}",
             f"- command: `{meta['command']}`",
             f"- machine: {meta['machine']}",
             f"- traces: `{meta['traces_dir']}` ({len(meta['traces'])} traces)"]
    if meta.get("load_average_at_start") is not None:
        lines.append(f"- load average (1/5/15 min) at start {meta['load_average_at_start']}, "
                     f"at end {meta.get('load_average_at_end')}")
    if meta.get("sim_latency_us"):
        lat = meta["sim_latency_us"]
        lines.append(f"- simulated device latency during the replays: malloc {lat['malloc']} µs, free {lat['free']} µs")
    lines.append(f"- versions: {', '.join(f'{k} {v}' for k, v in meta.get('versions', {}).items())}")
    if result.get("micro"):
        lines += ["", "## Microbenchmarks", ""] + micro_markdown(result["micro"])
    lines += ["", "## Trace replays", "",
              "One row per (trace, allocator); `× ap` is the row's figure divided by ascend_pool's on the same "
              "trace. Waste = peak reserved − peak live (peak live = peak sum of requested bytes). "
              "Reserved / live = peak reserved / peak live; frag. at peak = the "
              "ascend_pool_fragmentation_ratio metric (1 − largest free block / cached free bytes) right "
              "after the allocation that first reaches peak reserved (`-` where a peer cannot tell). "
              "Steady = the second half of the trace's events.", "", ROW_HEADER, ROW_ALIGN]
    lines += [row_markdown(r) for r in result["rows"]]
    notes = ["`torch_npu_policy` is a re-implementation of torch_npu's caching policy (a pure-Python model "
             "on an address model, no device), not torch_npu itself: its memory figures are the policy's, its "
             "ops/s is the model's speed and is not comparable."]
    if any(r["loop"] == "Python" for r in result["rows"]):
        notes.append("Rows with loop `Python` are driven from a Python loop (one call per event), "
                     "rows with loop `C` from ascend_pool's C replay loop; compare ops/s within a loop kind "
                     "(`ascend_pool_pyloop` is ascend_pool in the Python loop).")
    lines += [""] + [f"- {n}" for n in notes]
    if result.get("variants"):
        lines += ["", "## Robustness: perturbed workloads", ""] + variants_markdown(result["variants"])
    if result.get("skipped"):
        lines += ["", "## Skipped", ""]
        lines += [f"- `{s['allocator']}`{' on ' + s['trace'] if s.get('trace') else ''}: {s['reason']}"
                  for s in result["skipped"]]
    if result.get("errors"):
        lines += ["", "## Errors", ""]
        lines += [f"- `{e['allocator']}` on {e['trace']}: {e['error']}" for e in result["errors"]]
    lines += ["", "## Targets", ""] + [f"- {s}" for s in summary_lines(result.get("targets", []))]
    return "\n".join(lines) + "\n"

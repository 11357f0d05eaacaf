#!/usr/bin/env python3
"""Mutation testing: does the suite catch plausible one-line bugs?

Each mutant below replaces one exact line (found by its text, not its number) in one file with a
compiling change of logic: a flipped comparison, a moved bound, a dropped update. For each, this
script copies the working tree to a scratch folder, applies the mutant, rebuilds in place
(`setup.py build_ext --inplace`: only the extension whose sources changed is recompiled, the
unmutated build is shared), runs the mutant's tests with `-x` and reports it:
  killed    the tests failed (or timed out): the bug is caught
  survived  the tests passed: the suite lets the bug through
  stale     the original line is not in the file (any more): update the list
  no-build  the mutated tree does not build: the mutant is invalid, fix it
Not in CI (minutes per mutant). Each run uses its own scratch copy and simulated node, so
--jobs N runs N at once.

  python scripts/mutants.py                  # every mutant, each with its listed tests
  python scripts/mutants.py --list           # the mutants, one a line
  python scripts/mutants.py -k free_tree     # mutants whose id contains a word
  python scripts/mutants.py --full           # the whole suite for each mutant (slow)
  python scripts/mutants.py --json out.json  # also write the results

Exit status 0 when at least --min-score (default 0.9) of the valid mutants were killed.
"""

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Test files run against each kind of mutant (a subset keeps a run in minutes; --full runs all).
CORE = ["tests/test_c_units.py", "tests/test_pool_boundaries.py", "tests/test_pool_model.py", "tests/test_golden_figures.py",
        "tests/test_pool_basic.py", "tests/test_pool_knobs.py", "tests/test_expandable.py", "tests/test_replay.py"]
STREAMS = ["tests/test_c_units.py", "tests/test_stream_order.py", "tests/test_pool_model.py", "tests/test_golden_figures.py",
           "tests/test_reliability_found_bugs.py", "tests/test_pool_basic.py"]
QUOTA = ["tests/test_quota_context.py", "tests/test_ledger_files.py", "tests/test_ledger_reclaim.py",
         "tests/test_quota_multiprocess.py", "tests/test_tenants_config.py", "tests/test_units.py"]
SHARING = ["tests/test_sharing.py", "tests/test_sharing_read_only.py", "tests/test_sharing_expandable.py"]
METRICS = ["tests/test_metrics_collector.py", "tests/test_service_statsfile.py", "tests/test_service_publisher.py"]
SIM = ["tests/test_sim_memory.py", "tests/test_sim_faults.py", "tests/test_backend_acl.py"]
STATS = ["tests/test_c_units.py", "tests/test_pool_basic.py", "tests/test_pool_stats_active.py", "tests/test_golden_figures.py"]


def M(id, file, original, replacement, why, tests):
    return {"id": id, "file": file, "original": original, "replacement": replacement, "why": why, "tests": tests}


# Text is matched within one line of the file (leading whitespace ignored); it must occur exactly once.
MUTANTS = [
    # --- the six of issue 21 -------------------------------------------------------------------
    M("free_tree_best_fit_skips_exact", "cython/core/free_tree.c",
      "if (n->size >= size) {", "if (n->size > size) {",
      "best fit skips a free block of exactly the requested size", CORE),
    M("page_fit_tie_highest_address", "cython/core/free_blocks.c",
      "(score == f->best_score && b->size == f->best->size && b->addr < f->best->addr)) {",
      "(score == f->best_score && b->size == f->best->size && b->addr > f->best->addr)) {",
      "expandable small pool: equal candidates go to the highest address instead of the lowest", CORE),
    M("units_gb_is_gib", "ascend_pool/units.py",
      '"g": 1024**3, "gb": 1000**3, "gib": 1024**3,', '"g": 1024**3, "gb": 1024**3, "gib": 1024**3,',
      'a "16GB" quota read as 16 GiB (7.4 % more)', QUOTA),
    M("small_split_needs_more_than_min_block", "cython/core/free_blocks.c",
      "if (b->seg->pool == AP_POOL_SMALL) return rest >= p->cfg.min_block;",
      "if (b->seg->pool == AP_POOL_SMALL) return rest > p->cfg.min_block;",
      "a small block is not split when exactly min_block (512) bytes would be left", CORE),
    M("exactly_1MiB_goes_large", "cython/core/pool.c",
      "return rsize <= p->cfg.small_size ? AP_POOL_SMALL : AP_POOL_LARGE;",
      "return rsize < p->cfg.small_size ? AP_POOL_SMALL : AP_POOL_LARGE;",
      "a request of exactly 1 MiB goes to the large pool", CORE),
    M("ledger_pending_bracket_never_opened", "cython/quota/ledger_reserve.h",
      "atomic_store(&s->pending, (int64_t)bytes); /* a death from here on is detectable */",
      "atomic_store(&s->pending, 0); /* a death from here on is detectable */",
      "a process killed mid-reserve leaves its grant uncounted in its slot", QUOTA),
    # --- core placement and policy --------------------------------------------------------------
    M("tree_ties_newest_first", "cython/core/free_tree.c",
      "return a->size < b->size || (a->size == b->size && a->order < b->order);",
      "return a->size < b->size || (a->size == b->size && a->order > b->order);",
      "equal-size free blocks ordered newest segment / highest offset first", CORE),
    M("own_stream_loses_ties", "cython/core/free_blocks.c",
      "if (any && (!best || any->size < best->size)) best = any;",
      "if (any && (!best || any->size <= best->size)) best = any;",
      "an any-stream block beats the stream's own block of equal size", CORE),
    M("pad_bytes_ignored", "cython/core/pool_internal.h",
      "return (size + p->cfg.pad_bytes + p->cfg.min_block - 1) & ~(p->cfg.min_block - 1);",
      "return (size + p->cfg.min_block - 1) & ~(p->cfg.min_block - 1);",
      "requests are not padded (the acl runtime's 32 bytes)", CORE),
    M("large_segment_min_ignored", "cython/core/segments.c",
      "return size < p->cfg.min_large_segment ? p->cfg.min_large_segment : size;",
      "return size > p->cfg.min_large_segment ? p->cfg.min_large_segment : size;",
      "every large segment capped at the minimum size (bound inverted)", CORE),
    M("release_smallest_free_segment_first", "cython/core/segments.c",
      "if (!pick || (oldest_first ? s->last_use < pick->last_use : s->size > pick->size)) pick = s;",
      "if (!pick || (oldest_first ? s->last_use < pick->last_use : s->size < pick->size)) pick = s;",
      "the under-peak policy releases the smallest free segment first instead of the largest", CORE),
    M("watermark_never_raised", "cython/core/segments.c",
      "if (ap_reserved(p) > p->reserved_watermark) p->reserved_watermark = ap_reserved(p);",
      "if (ap_reserved(p) > p->reserved_watermark) p->reserved_watermark = p->reserved_watermark;",
      "the reserved watermark is never raised: the under-peak policy releases at every growth", CORE),
    M("oversize_buffer_inverted", "cython/core/free_blocks.c",
      "return b->size < rsize + AP_LARGE_BUFFER;", "return b->size > rsize + AP_LARGE_BUFFER;",
      "max_split_size: a big request takes only blocks far larger than it", CORE + ["tests/test_torch_npu_policy.py"]),
    # --- stream order ---------------------------------------------------------------------------
    M("merged_block_drops_stream_tag", "cython/core/free_blocks.c",
      "if (prev->tag) tag = prev->tag;", "if (prev->tag) tag = tag;",
      "a free block merged into a lower neighbour loses the stricter stream tag", STREAMS),
    M("cache_ignores_stream", "cython/core/free_cache.h",
      "static inline uint64_t ap_cache_key(size_t rsize, int slot) { return (uint64_t)rsize << 16 | (uint16_t)slot; }",
      "static inline uint64_t ap_cache_key(size_t rsize, int slot) { return (uint64_t)rsize << 16 | (uint16_t)0; }",
      "a recently freed block is handed to another stream without ordering", STREAMS),
    M("pending_free_before_event_completes", "cython/core/stream_order.c",
      "if (p->backend->event_query(p->backend, ev, &complete) != 0 || !complete) return AP_E_BUSY;",
      "if (p->backend->event_query(p->backend, ev, &complete) != 0) return AP_E_BUSY;",
      "a record_stream block is reused before the other stream's work is done", STREAMS),
    # --- statistics -----------------------------------------------------------------------------
    M("stat_peak_all_never_raised", "cython/core/stats.h",
      "if (__builtin_expect(a->current > a->peak, 0)) a->peak = a->current;",
      "if (__builtin_expect(a->current > a->peak, 0)) a->peak = a->peak;",
      "the peaks of the all-pools counters (peak reserved, peak allocated) are never raised", STATS),
    # --- quotas ---------------------------------------------------------------------------------
    M("quota_refuses_exact_fit", "cython/quota/ledger_reserve.h",
      "if (bytes > quota || held > quota - bytes) { /* held + bytes > quota, without overflow */",
      "if (bytes > quota || held >= quota - bytes) { /* held + bytes > quota, without overflow */",
      "a reservation that fills the quota exactly is refused", QUOTA),
    M("quota_slot_never_booked", "cython/quota/ledger_reserve.h",
      "atomic_store(&s->held, atomic_load(&s->held) + bytes); /* only this process writes it */",
      "atomic_store(&s->held, atomic_load(&s->held) + 0); /* only this process writes it */",
      "a grant is booked on the tenant but not in the process's slot (its release is then clamped to 0)", QUOTA),
    M("quota_warn_ratio_allows_zero", "ascend_pool/tenants/quota_spec.py",
      "if not 0 < value <= 1:", "if not 0 <= value <= 1:",
      "warn = 0 accepted (a warning at every allocation)", QUOTA),
    # --- sharing --------------------------------------------------------------------------------
    M("share_read_only_dropped", "cython/core/share.pxi",
      "cdef unsigned flags = (AP_IPC_ANY_PROCESS if any_process else 0) | (AP_IPC_READ_ONLY if read_only else 0)",
      "cdef unsigned flags = (AP_IPC_ANY_PROCESS if any_process else 0) | (0 if read_only else 0)",
      "a read-only export maps read-write in the importers", SHARING),
    # --- metrics --------------------------------------------------------------------------------
    M("metrics_last_pool_wins", "ascend_pool/metrics/sample.py",
      "into[f] = into.get(f, 0) + v[f]", "into[f] = v[f]",
      "a (device, tenant) with two pools reports only the last one", METRICS),
    M("metrics_counter_reads_freed", "ascend_pool/metrics/sample.py",
      'v[f"{prefix}.{kind}"] = int(s[f"{stem}.{kind}_pool.allocated"])',
      'v[f"{prefix}.{kind}"] = int(s[f"{stem}.{kind}_pool.freed"])',
      "per-pool counters export the freed count instead of the allocated one", METRICS),
    # --- simulator ------------------------------------------------------------------------------
    M("sim_free_keeps_device_bytes", "cython/sim/memory.c",
      "atomic_fetch_sub(&d->held, a->size);", "atomic_fetch_sub(&d->held, 0);",
      "the simulated device never gets freed bytes back", SIM),
    M("sim_fail_after_bytes_off_by_one", "cython/sim/memory.c",
      "if (cap >= 0 && before + bytes > (uint64_t)cap) {", "if (cap >= 0 && before + bytes >= (uint64_t)cap) {",
      "fault injection fail_after_bytes refuses an allocation that reaches the cap exactly", SIM),
]


def tree_files(root):
    """Files of the working tree (tracked and untracked, not ignored), relative to root."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True,
                         check=True).stdout.decode()
    return [f for f in out.split("\0") if f and os.path.isfile(os.path.join(root, f))]


def copy_tree(src, dst, files=None):
    for f in files if files is not None else tree_files(src):
        os.makedirs(os.path.dirname(os.path.join(dst, f)), exist_ok=True)
        shutil.copy2(os.path.join(src, f), os.path.join(dst, f))


def build(tree, log):
    """In-place build of tree; True on success (output appended to log)."""
    with open(log, "a") as out:
        p = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree, stdout=out,
                           stderr=subprocess.STDOUT, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return p.returncode == 0


def apply(tree, m):
    """Applies mutant m inside tree: 'ok', 'stale' (line not found) or 'ambiguous'."""
    path = os.path.join(tree, m["file"])
    if not os.path.exists(path):
        return "stale"
    with open(path) as f:
        lines = f.read().split("\n")
    hits = [i for i, line in enumerate(lines) if m["original"] in line]
    if not hits:
        return "stale"
    if len(hits) > 1:
        return "ambiguous"
    i = hits[0]
    lines[i] = lines[i].replace(m["original"], m["replacement"])
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return "ok"


def run_one(m, base, work, args):
    t0 = time.time()
    tree = os.path.join(work, m["id"])
    shutil.copytree(base, tree, symlinks=True)  # the unmutated build comes along: only changes rebuild
    log = os.path.join(work, m["id"] + ".log")
    status = apply(tree, m)
    if status == "ok" and m["file"].endswith(".h"):
        # setuptools recompiles a source only when it is newer than its object, and knows nothing
        # of headers: drop the objects and the extension that include the mutated header.
        sim = m["file"].startswith("cython/sim/")
        for f in glob.glob(os.path.join(tree, "ascend_pool", *(["_sim", "**", "*.so"] if sim else ["_core*.so"])),
                           recursive=True):
            os.unlink(f)
        shutil.rmtree(os.path.join(tree, "build"), ignore_errors=True)
    result = {"id": m["id"], "file": m["file"], "why": m["why"], "log": log}
    if status != "ok":
        result["result"] = status
    elif not build(tree, log):
        result["result"] = "no-build"
    else:
        tests = [] if args.full else [t for t in m["tests"] if os.path.exists(os.path.join(tree, t))]
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ASCEND_SIM_", "ASCEND_POOL_"))}
        env.update(PYTHONPATH=tree, PYTHONDONTWRITEBYTECODE="1", CI="true")
        with open(log, "a") as out:
            out.write("\n$ " + " ".join(cmd) + "\n")
            out.flush()
            try:
                p = subprocess.run(cmd, cwd=tree, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=args.timeout)
                rc = p.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        # 0: all passed; 5: no tests collected (a wrong subset, not a kill)
        result["result"] = "survived" if rc == 0 else ("no-tests" if rc == 5 else "killed")
        result["pytest_rc"] = rc
    result["seconds"] = round(time.time() - t0, 1)
    if not args.keep:
        shutil.rmtree(tree, ignore_errors=True)
    print(f"{result['result']:9} {m['id']:40} {result['seconds']:7.1f}s  {m['file']}", flush=True)
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", action="append", default=[], help="only mutants whose id contains this (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--full", action="store_true", help="run the whole suite for each mutant")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per mutant's test run (timeout = killed)")
    ap.add_argument("--workdir", help="scratch folder (default: a new temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep each mutant's scratch tree")
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument("--min-score", type=float, default=0.9)
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.k or any(k in m["id"] for k in args.k)]
    if args.list:
        for m in chosen:
            print(f"{m['id']:40} {m['file']:36} {m['why']}")
        return 0
    work = args.workdir or tempfile.mkdtemp(prefix="ascend-mutants-")
    os.makedirs(work, exist_ok=True)
    base = os.path.join(work, "_base")
    print(f"scratch: {work}; building the unmutated tree once ...", flush=True)
    if os.path.exists(base):
        shutil.rmtree(base)
    copy_tree(ROOT, base)
    if not build(base, os.path.join(work, "_base.log")):
        print(f"the unmutated tree does not build: see {work}/_base.log", file=sys.stderr)
        return 2
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as ex:
        results = list(ex.map(lambda m: run_one(m, base, work, args), chosen))
    valid = [r for r in results if r["result"] in ("killed", "survived")]
    killed = sum(r["result"] == "killed" for r in valid)
    score = killed / len(valid) if valid else 0.0
    print(f"\n{killed} of {len(valid)} valid mutants killed ({score:.0%}); "
          f"{len(results) - len(valid)} not run (stale, ambiguous, no-build, no-tests)")
    for r in results:
        if r["result"] != "killed":
            print(f"  {r['result']}: {r['id']} ({r['file']}): {r['why']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"score": score, "killed": killed, "valid": len(valid), "results": results}, f, indent=1)
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0 if score >= args.min_score else 1


if __name__ == "__main__":
    sys.exit(main())

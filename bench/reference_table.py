#!/usr/bin/env python3
"""Print the torch_npu-policy reference table for every trace in a directory.

Replays each ``.npz`` trace through ``ascend_pool.bench.torch_npu_policy`` (a pure-Python
re-implementation of torch_npu's caching-allocator policy -- not torch_npu itself) and prints, per
trace: peak live MiB, the reference's peak reserved MiB, torch_npu's published figure where there is
one, the deviation, device mallocs and replay seconds.

    python bench/reference_table.py [DIR] [--json FILE] [--tolerance PCT] [--max-split-size-mb N]

DIR defaults to the shared traces (``../shared/traces``, i.e. /work/shared/traces here; see
``ascend_pool.traces.default_traces_dir``). Exits 1 if a trace with a published figure deviates by
more than ``--tolerance`` percent (default 2).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ascend_pool.bench.torch_npu_policy import (  # noqa: E402
    MiB, compare_with_published, format_table, replay)
from ascend_pool.traces import default_traces_dir, list_traces, load_trace  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory", nargs="?", type=Path, default=None,
                    help="trace directory (default: the shared traces, else the bundled ones)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON to this file")
    ap.add_argument("--tolerance", type=float, default=2.0, help="allowed deviation from published figures, %%")
    ap.add_argument("--max-split-size-mb", type=int, default=None, help="model max_split_size_mb (default unset)")
    args = ap.parse_args(argv)

    directory = args.directory or default_traces_dir()
    paths = list_traces(directory)
    if not paths:
        print(f"no .npz traces in {directory}", file=sys.stderr)
        return 2
    mss = args.max_split_size_mb * MiB if args.max_split_size_mb else None
    results = []
    for p in paths:
        results.append(replay(load_trace(p), max_split_size=mss))
    print(f"# traces: {Path(directory).resolve()}")
    print(format_table(results))

    failed = []
    for r in results:
        c = compare_with_published(r) if mss is None else None
        r["published"] = c
        if c is not None and abs(c["deviation_pct"]) > args.tolerance:
            failed.append(f"{r['trace']}: {c['reserved_mib']:.1f} MiB vs {c['target_mib']} MiB "
                          f"({c['deviation_pct']:+.2f} %)")
    if args.json:
        args.json.write_text(json.dumps({"directory": str(Path(directory).resolve()), "rows": results}, indent=1) + "\n")
    if failed:
        print(f"\nOUTSIDE {args.tolerance} % of torch_npu's published figures:", file=sys.stderr)
        for f in failed:
            print("  " + f, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

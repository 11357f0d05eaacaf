#!/usr/bin/env python3
"""Re-pins tests/golden/replay_figures.json: the exact replay figures (peak reserved and live
bytes, device mallocs and frees, device calls, steady-state calls) of every bundled trace in
classic and expandable mode, as tests/test_golden_figures.py checks them.

Run after a change that moves placement on purpose, against the installed build of the tree
(pip install . first), and commit the file with the change, saying why the figures moved:

  python scripts/pin_figures.py            # rewrite the file, print what changed
  python scripts/pin_figures.py --check    # only compare (exit 1 on a difference)
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import golden_figures  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare only; do not rewrite the file")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ascend-pin-") as shm:
        now = golden_figures.compute(shm)
    try:
        before = golden_figures.load()
    except FileNotFoundError:
        before = {}
    changed = 0
    for key in sorted(set(now) | set(before)):
        old, new = before.get(key, {}), now.get(key, {})
        for field in sorted(set(old) | set(new)):
            if old.get(field) != new.get(field):
                changed += 1
                print(f"{key:50} {field:22} {old.get(field)} -> {new.get(field)}")
    print(f"{changed} figure(s) differ from {os.path.relpath(golden_figures.GOLDEN)}")
    if args.check:
        return 1 if changed else 0
    with open(golden_figures.GOLDEN, "w") as f:
        json.dump({"about": "exact replay figures of the bundled traces; regenerate with "
                            "`python scripts/pin_figures.py` (see tests/golden_figures.py)",
                   "figures": now}, f, indent=1, sort_keys=True)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

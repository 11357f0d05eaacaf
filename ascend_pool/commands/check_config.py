"""`ascend-pool check-config FILE`: validates a tenants file.

Exit 0: the file is valid; prints what was understood (tenants, quotas, warn levels, devices) and
any overcommit warnings (to stderr). Exit 2: one line per mistake on stderr, each naming the file,
the line or key, and the problem; with --json, also {"path", "valid": false, "errors": [those
lines]} on stdout (a valid file's JSON has "path" and "valid": true too), so that a machine
reader always gets JSON.
"""

import json
import sys

from ..tenants.config import ConfigErrors, load
from ..tenants.quota_spec import MAX_QUOTA_BYTES
from ..units import parse_bytes
from . import option_checks as oc


def _cmd_check_config(args):
    device_bytes = None
    if args.device_bytes is not None:
        try:
            device_bytes = parse_bytes(args.device_bytes, "--device-bytes")
            if device_bytes <= 0:  # 0 (or "0.5") read as "no size given": no overcommit check ran
                raise ValueError(f"--device-bytes: a device holds at least one byte, got {args.device_bytes!r}")
            if device_bytes >= MAX_QUOTA_BYTES:  # its "25%" was a quota no ledger holds, said ok
                raise ValueError(f"--device-bytes: {args.device_bytes!r} is larger than any device (at most "
                                 f"{MAX_QUOTA_BYTES - 1} bytes)")
        except ValueError as e:
            print(f"ascend-pool check-config: {e}", file=sys.stderr)
            if args.json:
                print(json.dumps({"path": args.file, "valid": False, "errors": [str(e)]}, indent=2))
            return 2
    try:
        cfg = load(args.file)
    except ConfigErrors as e:
        for line in e.errors:
            print(line, file=sys.stderr)
        if args.json:
            print(json.dumps({"path": args.file, "valid": False, "errors": list(e.errors)}, indent=2))
        return 2
    warnings = cfg.overcommit_warnings(device_bytes)
    if args.json:
        out = cfg.as_dict()
        out.setdefault("valid", True)
        out["warnings"] = warnings
        print(json.dumps(out, indent=2))
    else:
        for line in cfg.describe(device_bytes):
            print(line)
        print(f"{args.file}: ok")
    for line in warnings:
        print(line, file=sys.stderr)
    return 0


def register(sub):
    p = sub.add_parser("check-config", help="validate a tenants file (TOML): exit 0 valid, 2 with one line per mistake")
    p.add_argument("file", type=oc.path, help="the tenants file (as $ASCEND_POOL_CONFIG names it)")
    p.add_argument("--device-bytes", default=None,
                   help="device memory size (e.g. 64GiB) to check byte quotas for overcommit and show what "
                        "percentages mean; percentages are always checked")
    p.add_argument("--json", action="store_true", help="print what was understood as one JSON object")
    p.set_defaults(func=_cmd_check_config)

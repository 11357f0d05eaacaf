"""`ascend-pool replay TRACE.npz [--backend sim] [--mode pool|direct] [--json]`.

TRACE may also name one of the traces shipped with the package (``resnet18_train``, ...)."""

import json

from ..config import parse_conf_string
from ..errors import ConfigError
from ..replay import replay
from ..traces import resolve_trace, shipped_traces_dir
from ..units import format_bytes
from . import option_checks as oc

REPLAY_KEYS = ("allocs", "frees", "seconds", "ops_per_second", "peak_live_bytes", "peak_reserved_bytes",
               "fragmentation_ratio", "reserved_to_live_ratio", "device_mallocs", "device_frees", "device_calls_steady",
               "final_allocated_bytes")


def _cmd_replay(args):
    oc.check(args, {"--device": oc.DEVICE})
    knobs = parse_conf_string(args.conf, "--conf") if args.conf else None
    if args.conf is not None and args.mode == "direct":
        # direct mode opens no pool: the knobs were ignored, bad ones (max_split_size_mb:nan) too
        raise ConfigError(f"--conf: --mode direct replays without a pool, which the knobs configure; drop --conf "
                          f"(got {args.conf!r})")
    r = replay(resolve_trace(args.trace), backend=args.backend, mode=args.mode, device=args.device, pool_knobs=knobs)
    if args.json:
        print(json.dumps({k: r[k] for k in REPLAY_KEYS + ("trace", "mode", "backend")}))
        return 0
    print(f"{r['trace']}: {r['allocs']} allocs, {r['frees']} frees in {r['seconds']:.3f} s "
          f"({r['ops_per_second']:,.0f} ops/s), mode {r['mode']} on {r['backend']}")
    print(f"  peak live {format_bytes(r['peak_live_bytes'])}, peak reserved {format_bytes(r['peak_reserved_bytes'])}"
          f" ({r['reserved_to_live_ratio']:.3f}x live; fragmentation at that peak {r['fragmentation_ratio']:.3f})")
    print(f"  device mallocs {r['device_mallocs']}, frees {r['device_frees']}, in the second half "
          f"{r['device_calls_steady']}; allocated at the end {r['final_allocated_bytes']}")
    return 0


def register(sub):
    shipped = shipped_traces_dir()
    names = ", ".join(sorted(p.name[:-4] for p in shipped.glob("*.npz")))
    p = sub.add_parser("replay", help="replay an allocation trace (.npz) and print its figures")
    p.add_argument("trace", type=oc.path, help=f"trace file NAME.npz (format: {shipped / 'README.md'}), a PyTorch memory "
                                 f"snapshot with history (NAME.pickle), or the name of a trace shipped with the "
                                 f"package ({names or 'none installed'})")
    p.add_argument("--backend", choices=("acl", "sim", "cuda"), default=None,
                   help="device backend (default: $ASCEND_POOL_BACKEND, else acl if present, else sim)")
    p.add_argument("--mode", choices=("pool", "direct"), default="pool",
                   help="pool: through the caching pool; direct: one device call per allocation and free")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--conf", default=None, help="allocator knobs, key:value,key:value (as $ASCEND_POOL_CONF)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_replay)

"""`ascend-pool bench [--traces DIR] [--backend sim|cuda|acl] [--json FILE] [--markdown FILE]`.

One process run: microbenchmarks of the cached path with their floors, then every trace of the
directory through ascend_pool, direct device calls, the torch_npu-policy re-implementation and,
on a CUDA GPU, PyTorch (caching and cudaMallocAsync), CuPy and RMM where importable. Prints the
table and the targets' verdicts; writes the JSON ({"rows": [...], "micro": {...}, ...}) and the
markdown when asked. Progress goes to stderr on a terminal (not with --json).
"""

import json
import math
import os
import shlex
import sys

from ..bench.run import SIM_FREE_LATENCY_US, SIM_MALLOC_LATENCY_US, run_bench
from ..bench.table import summary_lines, to_markdown
from ..backend import check_device, open_backend
from ..config import conf_source, effective_knobs, knobs_to_config, parse_conf_string
from ..errors import ConfigError
from . import option_checks as oc

LATENCY_US = oc.Range(0, 10_000_000, what="a number of microseconds")
COUNT_MAX = 10_000  # --micro-runs, --variants: 10,000 runs of the microbenchmarks take hours already
RANGES = {
    "--device": oc.DEVICE,
    "--malloc-latency-us": LATENCY_US,
    "--free-latency-us": LATENCY_US,
    # counts past COUNT_MAX ran for years (a typo's 70000000, or 2**70, was accepted and the bench
    # never ended): refused as the other options' out-of-range values are
    "--micro-runs": oc.Range(1, COUNT_MAX, what="a count"),
    "--micro-ms": oc.Range(0, 60_000.0, open_low=True, what="a finite number of milliseconds"),
    "--variants": oc.Range(0, COUNT_MAX, what="a count"),
}


def _clean(x):
    """JSON-safe copy: non-finite floats become None."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _csv(text):
    return [t.strip() for t in text.split(",") if t.strip()]


def _command_line(args):
    """The command that reproduces this run (from the parsed options, defaults left out)."""
    if sys.argv[1:2] == ["bench"]:
        return "ascend-pool " + shlex.join(sys.argv[1:])
    parts = ["ascend-pool", "bench"]
    for opt, val in (("--traces", args.traces), ("--backend", args.backend), ("--json", args.json),
                     ("--markdown", args.markdown), ("--allocators", args.allocators), ("--conf", args.conf)):
        if val is not None:
            parts += [opt, str(val)]
    for t in args.trace:
        parts += ["--trace", t]
    if args.device:
        parts += ["--device", str(args.device)]
    if args.micro_runs != 7:
        parts += ["--micro-runs", str(args.micro_runs)]
    if args.micro_ms != 20.0:
        parts += ["--micro-ms", format(args.micro_ms, "g")]
    if args.malloc_latency_us != SIM_MALLOC_LATENCY_US:
        parts += ["--malloc-latency-us", str(args.malloc_latency_us)]
    if args.free_latency_us != SIM_FREE_LATENCY_US:
        parts += ["--free-latency-us", str(args.free_latency_us)]
    if args.variants:
        parts += ["--variants", str(args.variants)]
    for flag in ("no_micro", "quick", "strict"):
        if getattr(args, flag):
            parts.append("--" + flag.replace("_", "-"))
    return shlex.join(parts)


def _check_up_front(args, knobs):
    """A bad --conf, $ASCEND_POOL_CONF or --device fails before any replay (one line, exit 2), not
    as an error row after the whole run: the backend must have the device, the knobs must parse
    for it."""
    backend = open_backend(args.backend)
    check_device(backend, args.device)
    total = backend.mem_info(args.device)[1]
    kind = "acl" if backend.kind == "acl" else "cuda"
    if knobs:
        knobs_to_config(effective_knobs(knobs, env={}), total, total, kind)
    # and with $ASCEND_POOL_CONF's, which every ascend_pool replay's pool reads too: a bad one
    # failed each ascend_pool row after the whole run (--no-micro), exit 1
    try:
        knobs_to_config(effective_knobs(knobs), total, total, kind)
    except ConfigError as e:  # named as the pools name it (Pool._open_with_settings)
        raise ConfigError("%s=%r: %s" % (*conf_source(), e)) from None


def _check_outputs(args):
    """--json and --markdown files that cannot be written fail before any replay (the OSError of
    opening them), not after the whole run with its results lost: the file is opened for
    appending (nothing it holds is touched) and removed again if this made it."""
    for path in (args.markdown, None if args.json == "-" else args.json):
        if path is None:
            continue
        existed = os.path.lexists(path)
        with open(path, "a"):
            pass
        if not existed:
            os.unlink(path)


def _allocators(text):
    """--allocators as a list (None: not given, every allocator); one that names none (`,`, "")
    is a ConfigError, not the default set run silently."""
    if text is None:
        return None
    names = _csv(text)
    if not names:
        raise ConfigError(f"--allocators: expected allocator names separated by commas, got {text!r}")
    return names


def _cmd_bench(args):
    oc.check(args, RANGES)
    allocators = _allocators(args.allocators)
    json_to_stdout = args.json == "-"
    if args.progress is None:
        progress = args.json is None and sys.stderr.isatty()
    else:
        progress = args.progress
    say = (lambda text: print(text, file=sys.stderr)) if json_to_stdout else print
    knobs = parse_conf_string(args.conf, "--conf") if args.conf else None
    _check_up_front(args, knobs)
    _check_outputs(args)
    micro_runs, target_ms = args.micro_runs, args.micro_ms
    if args.quick:
        micro_runs = min(micro_runs, 3)
        target_ms = min(target_ms, 5.0)
    command = _command_line(args)
    result = run_bench(
        args.traces, args.backend, args.device,
        traces=args.trace or None, allocators=allocators,
        micro=not args.no_micro, micro_runs=micro_runs, micro_target_ms=target_ms,
        sim_malloc_latency_us=args.malloc_latency_us, sim_free_latency_us=args.free_latency_us,
        pool_knobs=knobs, progress=progress, command=command,
        log=(lambda text: print(text, file=sys.stderr)) if progress else None, variants=args.variants)
    result = _clean(result)
    md = to_markdown(result)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(md)
    if args.json:
        text = json.dumps(result, indent=1) + "\n"
        if json_to_stdout:
            sys.stdout.write(text)
        else:
            with open(args.json, "w") as f:
                f.write(text)
    if not json_to_stdout:
        print(md, end="")
    else:
        for s in result["skipped"]:
            say(f"skipped {s['allocator']}{' on ' + s['trace'] if s.get('trace') else ''}: {s['reason']}")
        # the failures the exit status 1 stands for (the report's "Errors" lines): said nowhere
        # but inside the JSON before
        for e in result["errors"]:
            say(f"error: {e['allocator']} on {e['trace']}: {e['error']}")
        for e in (result.get("variants") or {}).get("errors", []):
            say(f"error on {e['workload']}: {e['error']}")
        for line in summary_lines(result["targets"]):
            say(line)
    failed = [t for t in result["targets"] if t["passed"] is False]
    # a variant replay that failed is an error as a trace's is (it exited 0 with them listed
    # in variants.errors alone)
    if result["errors"] or (result.get("variants") or {}).get("errors"):
        return 1
    return 1 if (args.strict and failed) else 0


def register(sub):
    p = sub.add_parser("bench", help="benchmark the pool against its peers and its floors (one run)",
                       description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--traces", default=None, metavar="DIR", type=oc.path,
                   help="trace directory (default: ../shared/traces when present, else the six full traces shipped in the package)")
    p.add_argument("--backend", choices=("sim", "cuda", "acl"), default=None,
                   help="device backend (default: $ASCEND_POOL_BACKEND, else acl if present, else sim)")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--json", default=None, metavar="FILE", type=oc.path, help="write the results as JSON ('-': to stdout, alone)")
    p.add_argument("--markdown", default=None, metavar="FILE", type=oc.path, help="write the report as markdown")
    p.add_argument("--trace", action="append", default=[], metavar="NAME", type=oc.name,
                   help="only this trace of the directory (repeatable)")
    p.add_argument("--allocators", default=None, metavar="A,B",
                   help="only these allocators (default: every one for the backend)")
    p.add_argument("--conf", default=None, help="ascend_pool knobs for its replays, key:value,... ($ASCEND_POOL_CONF style)")
    p.add_argument("--malloc-latency-us", type=int, default=SIM_MALLOC_LATENCY_US,
                   help=f"sim backend: simulated device malloc latency during replays, 0..10,000,000 us "
                        f"(default {SIM_MALLOC_LATENCY_US})")
    p.add_argument("--free-latency-us", type=int, default=SIM_FREE_LATENCY_US,
                   help=f"sim backend: simulated device free latency during replays, 0..10,000,000 us "
                        f"(default {SIM_FREE_LATENCY_US})")
    p.add_argument("--no-micro", action="store_true", help="skip the microbenchmarks")
    p.add_argument("--micro-runs", type=int, default=7, help="repetitions of each microbenchmark, 1 to 10,000 (median)")
    p.add_argument("--micro-ms", type=float, default=20.0,
                   help="length of each microbenchmark loop in ms, > 0 and <= 60,000 (pairs per loop "
                        "calibrated to it)")
    p.add_argument("--quick", action="store_true", help="fewer and shorter microbenchmark runs (3 runs of 5 ms)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="show progress on stderr (default: on a terminal, unless --json)")
    g.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--variants", type=int, nargs="?", const=20, default=0, metavar="N",
                   help="robustness harness: derive N perturbed workloads (0 to 10,000) from each trace (N = 20 "
                        "when given without a number) and replay them through ascend_pool and torch_npu_policy")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target fails")
    p.set_defaults(func=_cmd_bench)

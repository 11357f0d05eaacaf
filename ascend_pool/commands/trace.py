"""`ascend-pool trace convert SNAPSHOT.pickle OUT.npz [--device N]`: a PyTorch memory snapshot
(torch.cuda.memory._dump_snapshot, torch_npu's, or ascend_pool's dump_snapshot) as a trace."""

from ..snapshot_trace import convert
from ..traces import peak_live_bytes
from ..units import format_bytes
from . import option_checks as oc


def _cmd_convert(args):
    oc.check(args, {"--device": oc.DEVICE})
    trace = convert(args.snapshot, args.out, device=args.device)
    print(f"{args.snapshot} -> {args.out}: {trace.n_allocs} allocs, {trace.n_frees} frees, "
          f"{len(trace.streams)} stream(s), peak live {format_bytes(peak_live_bytes(trace))}")
    return 0


def register(sub):
    p = sub.add_parser("trace", help="convert a PyTorch memory snapshot into a replayable trace")
    tsub = p.add_subparsers(dest="trace_command", required=True)
    c = tsub.add_parser("convert", help="SNAPSHOT.pickle (device_traces) -> OUT.npz")
    c.add_argument("snapshot", help="a memory snapshot pickle recorded with history on")
    c.add_argument("out", help="the .npz trace to write (format in shared/traces/README.md)")
    c.add_argument("--device", type=int, default=None, help="the device whose trace to take (default: the one used)")
    c.set_defaults(func=_cmd_convert)

"""`ascend-pool trace convert SNAPSHOT.pickle OUT.npz [--device N]`: a PyTorch memory snapshot
(torch.cuda.memory._dump_snapshot, torch_npu's, or ascend_pool's dump_snapshot) as a trace;
`ascend-pool trace convert LOG.csv OUT.npz`: an RMM logging_resource_adaptor log as a trace."""

from .. import rmm_log_trace
from ..snapshot_trace import convert
from ..traces import output_npz_path, peak_live_bytes
from ..units import format_bytes
from . import option_checks as oc


def _cmd_convert(args):
    oc.check(args, {"--device": oc.DEVICE})
    # RMM writes its log to any file name: known by its header line, whatever the suffix
    if args.snapshot.endswith(rmm_log_trace.RMM_LOG_SUFFIXES) or rmm_log_trace.is_rmm_log(args.snapshot):
        if args.device is not None:
            raise ValueError(f"--device: an RMM log ({args.snapshot}) holds one device's events; drop --device")
        trace = rmm_log_trace.convert(args.snapshot, args.out)
    else:
        trace = convert(args.snapshot, args.out, device=args.device)
    # the file written: np.savez adds .npz to a name without it, so `trace convert S out` said
    # "-> out" where it wrote out.npz
    written = output_npz_path(args.out, "trace convert OUT")
    print(f"{args.snapshot} -> {written}: {trace.n_allocs} allocs, {trace.n_frees} frees, "
          f"{len(trace.streams)} stream(s), peak live {format_bytes(peak_live_bytes(trace))}")
    return 0


def register(sub):
    p = sub.add_parser("trace", help="convert a PyTorch memory snapshot or an RMM log into a replayable trace")
    tsub = p.add_subparsers(dest="trace_command", required=True)
    c = tsub.add_parser("convert", help="SNAPSHOT.pickle (device_traces) or RMM's LOG.csv -> OUT.npz")
    c.add_argument("snapshot", type=oc.path, help="a memory snapshot pickle recorded with history on, or the CSV log of RMM's "
                                    "logging_resource_adaptor")
    c.add_argument("out", type=oc.path, help="the .npz trace to write (format in shared/traces/README.md)")
    c.add_argument("--device", type=int, default=None, help="the device whose trace to take (default: the one used)")
    c.set_defaults(func=_cmd_convert)

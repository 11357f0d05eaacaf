"""`ascend-pool serve [--config FILE] [--host 127.0.0.1] [--port 9464] [--backend ...] [--replay [TRACE ...]]`

The node service: exports every ascend_pool process of the node (each publishes its figures to a
stats file, see ascend_pool.service) on http://HOST:PORT/metrics with a `pid` label plus node
totals. `--replay` also runs traces in a loop inside the service (the bundled ones when no file
is named; a directory names all its .npz traces), for each tenant of `--config` (without one,
the bundled demo tenants file, ascend_pool/service/demo_tenants.toml: two tenants, one tight
enough that the near-quota alert fires), so that one command shows the whole system working.
Every series carries `node` ($NODE_NAME, else the hostname); GET /healthz answers 200, or 503
with the reason when the stats directory (or, with --replay, a pool) cannot be read.
"""

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from .. import identity
from ..errors import ConfigError
from ..metrics.http import MetricsServer, check_address
from ..metrics.ledger import sweep_dead_processes
from ..metrics.node import BuildInfo, NodeLabelled, node_name
from ..service import paths
from ..service.node_collector import NodeCollector
from ..service.publisher import ensure_publisher, stop_publisher
from ..service.replay_loop import ReplayLoop
from ..service.scanner import StatsScanner
from ..service.serve_args import group_ids
from ..tenants import load_config
from ..tenants.ledger import ledger_group
from ..traces import bundled_traces_dir, list_traces
from . import option_checks as oc

log = logging.getLogger("ascend_pool.service")

RANGES = {
    "--device": oc.DEVICE,
    "--replay-pause": oc.Range(0, oc.DAY_S, what="a finite number of seconds"),
    "--allow-uid": oc.UID,
    # 0, negative or nan made the sweep thread spin at full CPU
    "--sweep-interval": oc.Range(0, oc.DAY_S, open_low=True, what="a finite number of seconds"),
}


def _trace_paths(names):
    if not names:
        return list_traces(bundled_traces_dir())
    out = []
    for n in names:
        p = Path(n)
        out.extend(list_traces(p) if p.is_dir() else [p])
    return out


def tenants_file(config, replaying):
    """The tenants file serve uses: --config, else $ASCEND_POOL_CONFIG (as --config's help says),
    else with --replay the bundled demo tenants, else None. It becomes $ASCEND_POOL_CONFIG of this
    process (the tenants code reads it there too): an explicit --config wins over the variable."""
    if config is None:
        config = os.environ.get("ASCEND_POOL_CONFIG") or None
    if config is None and replaying:
        config = DEMO_TENANTS  # the demo shows quotas and the near-quota alert too
        log.info("no --config: replaying for the demo tenants of %s", DEMO_TENANTS)
    if config:
        os.environ["ASCEND_POOL_CONFIG"] = str(config)
    return config


def _tenants(config_path, device):
    """[(name, quota, warn)] of the tenants file's tenants that apply on device, or None.
    Validation is the tenants package's own (one error line per mistake)."""
    if not config_path:
        return None
    cfg = load_config(str(config_path))
    return [(t.name, t.quota.text if t.quota is not None else None, t.warn)
            for t in cfg.tenants.values() if t.applies_to(device)] or None


DEMO_TENANTS = Path(__file__).resolve().parent.parent / "service" / "demo_tenants.toml"


def _health(stats_dir, loop):
    """The /healthz check: None, or why the service cannot do its job."""
    reason = paths.unreadable_reason(stats_dir)
    if reason is None and loop is not None:
        reason = loop.health()
    return reason


def _sweep_ledgers(stop, interval, uids=(), gids=(), collector=None):
    """Gives back the quota-ledger shares of dead processes every `interval` seconds, in this
    user's ledgers and those of the trusted uids and gids (the ledger also does it before refusing
    a request; this keeps the exported figures true meanwhile); and reads the stats files, so that
    exited processes' final counters are in the node counters even while no one scrapes (their
    files are removed by others once publisher.EXITED_KEEP_S old)."""
    while not stop.wait(interval):
        try:
            sweep_dead_processes(uids, gids)
        except Exception:
            log.exception("sweeping the quota ledgers failed")
        if collector is not None:
            try:
                collector.scan()
            except Exception:
                log.exception("reading the stats files failed")


def _cmd_serve(args):
    from prometheus_client import CollectorRegistry

    check_address(args.host, args.port, names=("--host", "--port"))
    oc.check(args, RANGES)
    if args.device is None:
        args.device = 0
    elif args.replay is None:
        # --device is the device of --replay (its help's word): without --replay the service opens
        # no device (it reads stats files and ledgers of every device), so the number was neither
        # used nor checked. Said, not refused: a command line that has it runs as it did.
        print(f"ascend-pool serve: --device {args.device} is ignored: it is the device --replay runs on, and there "
              "is no --replay (the service exports every device's processes)", file=sys.stderr, flush=True)
        args.device = 0
    gids = group_ids(args.allow_group)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s ascend-pool serve: %(levelname)s %(message)s")
    if args.stats_dir:
        os.environ[paths.ENV_DIR] = args.stats_dir  # this process publishes where it reads
    reason = paths.unreadable_reason(paths.stats_dir())
    if reason is not None:  # serving no pool metrics with only a warning hides the mistake
        raise ConfigError(f"{reason} (--stats-dir or ${paths.ENV_DIR})")
    args.config = tenants_file(args.config, args.replay is not None)
    tenants = _tenants(args.config, args.device)

    registry = CollectorRegistry(auto_describe=False)
    if ledger_group() is not None:
        gids.add(ledger_group())  # the service runs in the tenants' sharing group: it reads their directory
    scanner = StatsScanner(allowed_uids=set(args.allow_uid) | {identity.host_uid()}, allowed_gids=gids)
    node = node_name()
    collector = NodeCollector(scanner)
    registry.register(NodeLabelled(collector, node))
    loop = None
    if args.replay is not None:
        loop = ReplayLoop(_trace_paths(args.replay), backend=args.backend, device=args.device,
                          tenants=tenants, pause_s=args.replay_pause)
        loop.open_pools()
        registry.register(NodeLabelled(loop, node))
    backend = (lambda: loop.backend_name()) if loop is not None else (
        args.backend or os.environ.get("ASCEND_POOL_BACKEND") or "auto")
    registry.register(NodeLabelled(BuildInfo(backend), node))
    stats_base = paths.stats_dir()
    server = MetricsServer((args.host, args.port), registry, health=lambda: _health(stats_base, loop))
    stop = threading.Event()
    threading.Thread(target=_sweep_ledgers, args=(stop, args.sweep_interval, scanner.allowed_uids, scanner.allowed_gids,
                                                  collector),
                     name="ascend-pool-sweep",
                     daemon=True).start()
    if loop is not None:
        ensure_publisher()  # the replay's pools are published and read back like any other process's
        loop.start()
        log.info("replaying %s on %s device %d for %s", ", ".join(t.name for t in loop.traces),
                 args.backend or "the default backend", args.device,
                 ", ".join(n for n, _, _ in tenants) if tenants else "tenant default")
    def _terminate(signum, frame):
        # serve_forever() runs in this thread: shut it down from another one.
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, _terminate)
    print(f"ascend-pool serve: http://{args.host}:{server.port}/metrics (stats from {scanner.directory}, node {node})",
          flush=True)

    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        # The publisher first: it must not be reading a pool while the loop closes it. Its file
        # goes: the node counters that would read its final counts are this service's own.
        stop_publisher(remove=True)
        if loop is not None:
            loop.stop()
        server.server_close()
    return 0


def register(sub):
    p = sub.add_parser("serve", help="export every ascend_pool process of the node to Prometheus",
                       description=sys.modules[__name__].__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=lambda text: Path(oc.path(text)), default=None,
                   help="tenants TOML file (as $ASCEND_POOL_CONFIG); --replay runs for each of its tenants")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=9464, help="port to listen on, 0 to 65535 (default 9464; 0 picks a free one)")
    p.add_argument("--backend", choices=("acl", "sim", "cuda"), default=None,
                   help="device backend of --replay (default: $ASCEND_POOL_BACKEND, else acl if present, else sim)")
    p.add_argument("--replay", nargs="*", default=None, metavar="TRACE", type=oc.path,
                   help="replay traces (.npz files or directories) in a loop; with no file, the bundled traces")
    p.add_argument("--device", type=int, default=None,
                   help="device of --replay (default 0; without --replay ignored, and said so on stderr); one the "
                        "backend does not have is refused, exit 2")
    p.add_argument("--replay-pause", type=float, default=0.1, metavar="SECONDS",
                   help="seconds each replay holds at its peak of live memory, a quarter of that between replays "
                        "(0 to 86400, default 0.1)")
    p.add_argument("--stats-dir", default=None, type=oc.path,
                   help="directory of the processes' stats files (default $ASCEND_POOL_STATS_DIR, else /dev/shm)")
    p.add_argument("--allow-uid", type=int, action="append", default=[], metavar="UID",
                   help="also read the private directory of this uid (default: only this service's own uid); "
                        "anything else in the stats directory is never opened")
    p.add_argument("--allow-group", action="append", default=[], metavar="GROUP",
                   help="also read the shared directory of this group (name or gid; "
                        "$ASCEND_POOL_LEDGER_GROUP is always read)")
    p.add_argument("--sweep-interval", type=float, default=5.0, metavar="SECONDS",
                   help="how often dead processes' quota shares are given back and the stats files read (more than 0, at most 86400; default 5)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=_cmd_serve)

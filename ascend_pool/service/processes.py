"""The node's ascend_pool processes, from their stats files (what `ascend-pool ps` prints: this
user's, and those of the uids and groups a caller trusts), and torch's list_gpu_processes() over
them.

A pid is in its process's own pid namespace (two containers' workers may both be pid 1); the
instance is unique on the node. Processes that do not publish ($ASCEND_POOL_STATS off) have no
stats file and are not listed, except this process itself.
"""

import os

from .. import registry
from ..errors import ConfigError, PoolError
from ..identity import host_uid, instance, pids_here
from ..tenants.ledger import ledger_group
from . import paths
from .scanner import StatsScanner


def rows(directory=None, allow_uids=(), allow_gids=()):
    """[{"pid", "pid_here", "pidns", "instance", "uid", "device", "tenant", "held_bytes", "allocated_bytes"}],
    one per process and (device, tenant) it has an open pool of. pid: in the process's own pid
    namespace (pidns); pid_here: in this process's (identity.pids_here), None where this namespace
    does not hold it.
    directory: the stats directory (default paths.stats_dir()); ConfigError when it does not exist,
    is not a directory or cannot be read (an empty list would hide the mistake)."""
    reason = paths.unreadable_reason(directory or paths.stats_dir())
    if reason is not None:
        raise ConfigError(f"{reason} (--stats-dir or ${paths.ENV_DIR})")
    # a directory given is read itself too: --stats-dir may name the private directory the
    # files sit in (ascend_pool-u<uid>), not only the base one
    gids = set(allow_gids)
    try:
        group = ledger_group()  # this user's processes publish in the sharing group's directory
    except PoolError:           # a group that does not exist: no process can publish there either
        group = None
    if group is not None:
        gids.add(group)
    scanner = StatsScanner(directory or None, allowed_uids=set(allow_uids) | {host_uid()}, remove_stale=False,
                           allowed_gids=gids)
    out = []
    procs = scanner.scan()
    here = pids_here({p.path: (p.pid, p.pidns) for p in procs})
    for p in procs:
        for s in in_use(p.samples):
            v = s.values
            out.append({"pid": p.pid, "pid_here": here.get(p.path), "pidns": p.pidns, "instance": p.instance,
                        "uid": p.uid, "device": s.device,
                        "tenant": s.tenant, "held_bytes": v["reserved_bytes.small"] + v["reserved_bytes.large"],
                        "allocated_bytes": v["allocated_bytes.small"] + v["allocated_bytes.large"]})
    return sorted(out, key=lambda r: (r["device"], r["tenant"], r["pid"], r["instance"]))


def in_use(samples):
    """The samples of one process's (device, tenant) pairs that use the device: what `ps` lists
    and ascend_pool_node_processes counts (one rule for both: they disagreed by the base pool).
    A pair whose pools are all closed is left out (its counters only remain), and so is the
    default pool holding nothing beside the process's tenant contexts (the pool they were made
    from: no use of the device of its own); a context's pair stays (it is the tenant's process,
    holding or not), and a process with nothing else on a device keeps its one pair there. Per
    device: an empty pool on device 0 is the process's use of device 0 whatever it holds on device
    1 (before, its busy pool on device 1 hid it from device 0's listing and count)."""
    live = [s for s in samples if s.values["device_total_bytes"]]
    out = []
    for device in dict.fromkeys(s.device for s in live):
        here = [s for s in live if s.device == device]
        phantom = [s for s in here if s.tenant == "default"
                   and not s.values["reserved_bytes.small"] + s.values["reserved_bytes.large"]]
        out += [s for s in here if s not in phantom] or here[:1]
    return out


def _own_rows(device):
    """This process's bytes on the node's device `device`, from its open pools: (tenant, held,
    allocated) per tenant."""
    per = {}
    for pool in registry.live_pools():
        if getattr(pool, "node_device", pool.device) != device:
            continue
        try:
            st = pool.memory_stats()
        except Exception:  # closed meanwhile
            continue
        acc = per.setdefault(str(getattr(pool, "tenant", "default")), [0, 0])
        acc[0] += st["reserved_bytes.all.current"]
        acc[1] += st["allocated_bytes.all.current"]
    return [(t, held, used) for t, (held, used) in sorted(per.items()) if held]


def list_gpu_processes(device=0, kind="NPU", node_device=None):
    """torch.cuda.list_gpu_processes(device)'s text for ascend_pool's processes on `device` (an
    int, this process's number; node_device: the node's number of it, default the same, which
    the stats files use): a "NPU:<device>" line, then one line per process and tenant with the
    device memory it holds in MB (MiB, as torch prints), its tenant, instance and pid in this
    process's pid namespace ("pid here -, pid namespace N" where this one does not see into its
    namespace N), or
    "no processes are running". Read from
    this user's stats files (the processes that publish, see `ascend-pool ps`) and this process's
    own pools."""
    node_device = device if node_device is None else node_device
    try:
        table = [r for r in rows() if r["device"] == node_device]
    except ConfigError:  # no stats directory yet: nobody publishes
        table = []
    me = f"{instance():016x}"
    lines = [f"{kind}:{device}"]
    listed = [(r["pid"], r["instance"], r["held_bytes"], r["tenant"], r["pid_here"], r["pidns"]) for r in table
              if r["instance"] != me]
    listed += [(os.getpid(), me, held, tenant, os.getpid(), 0) for tenant, held, _ in _own_rows(node_device)]
    if not listed:
        lines.append("no processes are running")
    # torch's line, then what it lacks in parentheses: the tenant, the instance, since the pid is
    # in its process's own pid namespace (two containers' workers are both "process 1"), and the
    # pid in this process's namespace, which kill and top take here ("-" for a process of a
    # namespace this one does not see into, then that namespace, as `ascend-pool ps`'s PIDNS:
    # two containers' "process 1" lines said nothing else), as `ascend-pool ps`'s PID_HERE.
    for pid, inst, held, tenant, here, ns in sorted(listed, key=lambda r: r[:4]):
        where = f"{here}" if here is not None else f"-, pid namespace {ns or '-'}"
        lines.append(f"process {pid:>10d} uses {held / (1 << 20):>12.3f} MB {kind} memory "
                     f"(tenant {tenant}, instance {inst}, pid here {where})")
    return "\n".join(lines)

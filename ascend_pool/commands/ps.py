"""`ascend-pool ps [--json] [--stats-dir DIR] [--allow-uid UID ...] [--allow-group GROUP ...]`

The node's ascend_pool processes, from their stats files (the files the node service reads): one
row per process, device and tenant, with the process's pid (PID: in its own pid namespace, what it
sees as its pid: two containers' workers may both be pid 1), its `instance` (unique on the node),
the bytes it holds on the device (reserved) and has allocated, its pid in the pid namespace ps
runs in (PID_HERE: the host's pid when run on the host, what kill, top and npu-smi take there;
"-" for a process of a pid namespace ps does not see into, such as another container's), the
host uid it runs as (UID), and the pid namespace PID is in (PIDNS: its inode, which `lsns -t pid`
and `ls -l /proc/PID/ns/pid` show on the host; "-" where unknown).
"""

import argparse
import json
import sys

from ..service.processes import rows
from ..service.serve_args import group_ids
from ..units import format_bytes
from . import option_checks as oc


def _cmd_ps(args):
    oc.check(args, {"--allow-uid": oc.UID})
    table = rows(args.stats_dir, args.allow_uid, group_ids(args.allow_group))
    if args.json:
        print(json.dumps(table, indent=1))
        return 0
    # The tenant column is as wide as its longest name (up to 63 characters; another user's stats
    # file up to 64 bytes): cut at 20, tenants differing past that looked alike.
    names = [_cell(r["tenant"]) for r in table]
    w = max([20] + [len(n) for n in names])
    # PID_HERE, UID and PIDNS after the columns that were, which stay as they were. UID: --allow-uid
    # and --allow-group list several users' processes, which nothing else in the table tells apart.
    # PIDNS: where PID_HERE is "-" (ps in a container, the node service's pod), two containers'
    # workers were both PID 1 and nothing said which namespace each was in, nor how to find them.
    print(f"{'PID':>8} {'INSTANCE':16} {'DEVICE':>6} {'TENANT':{w}} {'HELD':>12} {'ALLOCATED':>12} {'PID_HERE':>8} "
          f"{'UID':>10} {'PIDNS':>10}")
    for r, name in zip(table, names):
        here = "-" if r["pid_here"] is None else r["pid_here"]
        print(f"{r['pid']:>8} {r['instance']:16} {r['device']:>6} {name:{w}} "
              f"{format_bytes(r['held_bytes']):>12} {format_bytes(r['allocated_bytes']):>12} {here:>8} {r['uid']:>10} "
              f"{r['pidns'] or '-':>10}")
    return 0


def _cell(tenant):
    """A tenant name as one table cell: as it is when printable without spaces (every name a
    context accepts), else quoted with escapes (a stats file of another user may hold any UTF-8:
    a newline would print a row of its own)."""
    return tenant if tenant.isprintable() and not any(c.isspace() for c in tenant) else ascii(tenant)


def register(sub):
    p = sub.add_parser("ps", help="list the node's ascend_pool processes (pid, instance, tenant, device, bytes, "
                                  "pid here, uid, pid namespace)",
                       description=sys.modules[__name__].__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="one JSON list of rows")
    p.add_argument("--stats-dir", default=None, type=oc.path,
                   help="the stats directory, which must exist (default $ASCEND_POOL_STATS_DIR, else /dev/shm)")
    p.add_argument("--allow-uid", type=int, action="append", default=[], metavar="UID",
                   help="also list processes of this uid (default: this user's only)")
    p.add_argument("--allow-group", action="append", default=[], metavar="GROUP",
                   help="also list processes sharing their files with this group (name or gid)")
    p.set_defaults(func=_cmd_ps)

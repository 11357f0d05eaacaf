"""One tenant name used by two users on one node, seen through the node service.

Quotas are per user (each user's quota ledger is its own), so "online" run by root and "online"
run by `nobody` are two tenants: the service's per-process series, node totals and ledger series
must keep them apart, and the near-quota alert must compare each with its own quota. Needs root
and runuser (tests/other_user.py; CI runs as root)."""
import os
import pwd
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from metrics_scrape import scrape, series, start_serve  # noqa: E402
from other_user import OTHER, two_users  # noqa: E402,F401

MiB = 1 << 20

HOLDER = """
import ascend_pool as ap
pool = ap.Pool(0)
ctx = pool.context("online", quota=int(sys.argv[1]) << 20)
held = [ctx.malloc(n << 20) for n in map(int, sys.argv[2:])]
print(ctx.memory_stats()["reserved_bytes.all.current"], flush=True)
sys.stdin.readline()
"""


def _holder(node, user, quota_mib, *sizes_mib, tenant="online"):
    import subprocess

    argv = node.argv(user, "print(os.getpid(), flush=True)\n" + HOLDER.replace('"online"', repr(tenant)))
    argv += [str(quota_mib), *map(str, sizes_mib)]
    p = subprocess.Popen(argv, env=node.env(ASCEND_POOL_STATS="1", ASCEND_POOL_STATS_INTERVAL="0.1"),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=node.root)
    pid = p.stdout.readline().strip()
    node.procs.append((p, int(pid) if pid.isdigit() else None))
    reserved = p.stdout.readline().strip()
    assert reserved.isdigit(), p.stderr.read() if p.poll() is not None else reserved
    return int(reserved)


def _by_uid(samples, name, **labels):
    return {dict(lab)["uid"]: v for lab, v in series(samples, name, **labels).items()}


def test_one_tenant_name_under_two_users_is_two_tenants_in_the_service(two_users, tmp_path):
    node = two_users
    other = str(pwd.getpwnam(OTHER).pw_uid)
    mine = _holder(node, None, 100, 60)            # root's "online": 60 of its 100 MiB
    theirs = _holder(node, OTHER, 300, 60, 60, 60)  # nobody's "online": 180 of its own 300 MiB
    env = node.env()
    proc, port = start_serve(env, tmp_path / "serve.log", "--allow-uid", other)
    node.procs.append((proc, None))
    want = {"0": mine, other: theirs}
    deadline = time.monotonic() + 20
    while True:
        s = scrape(port)
        got = (_by_uid(s, "ascend_pool_node_reserved_bytes", device=0, tenant="online"),
               _by_uid(s, "ascend_pool_ledger_held_bytes", device=0, tenant="online"))
        if got == (want, want) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert got == (want, want), got  # before: one node total (their sum), one ledger (root's)
    quotas = _by_uid(s, "ascend_pool_ledger_quota_bytes", device=0, tenant="online")
    assert quotas == {"0": 100 * MiB, other: 300 * MiB}, quotas
    assert _by_uid(s, "ascend_pool_node_processes", device=0, tenant="online") == {"0": 1, other: 1}
    # The per-process series carry the uid the alert groups by (grafana/alerts.yml): each user's
    # reserved bytes against that user's quota.
    per_uid = {}
    for lab, v in series(s, "ascend_pool_reserved_bytes", device=0, tenant="online").items():
        per_uid[dict(lab)["uid"]] = per_uid.get(dict(lab)["uid"], 0) + v
    assert per_uid == want, per_uid
    assert _by_uid(s, "ascend_pool_quota_bytes", device=0, tenant="online") == {"0": 100 * MiB, other: 300 * MiB}


def test_a_tenant_booked_in_two_users_ledgers_is_logged_once_and_counted(two_users, tmp_path):
    # A tenant whose containers run as two uids without one ASCEND_POOL_LEDGER_GROUP books in two
    # ledgers: its quota is granted in each (60 + 60 MiB under 100 MiB), which no process can see.
    # The node service trusting both users said nothing either.
    node = two_users
    other = str(pwd.getpwnam(OTHER).pw_uid)
    _holder(node, None, 100, 60)
    _holder(node, OTHER, 100, 60)
    _holder(node, None, 100, 10, tenant="solo")  # one user's ledger only: no split
    log = tmp_path / "serve.log"
    proc, port = start_serve(node.env(), log, "--allow-uid", other)
    node.procs.append((proc, None))
    deadline = time.monotonic() + 20
    while True:
        s = scrape(port)
        got = {dict(lab)["tenant"]: v for lab, v in series(s, "ascend_pool_tenant_ledgers", device=0).items()}
        if got == {"online": 2, "solo": 1} or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert got == {"online": 2, "solo": 1}, got
    scrape(port)
    said = [ln for ln in log.read_text().splitlines() if "quota ledgers" in ln]
    assert len(said) == 1, log.read_text()  # once, however many scrapes
    assert (f"tenant 'online' on sim device 0 has live processes in 2 quota ledgers (uid 0, uid {other})" in said[0]
            and "ASCEND_POOL_LEDGER_GROUP" in said[0]), said

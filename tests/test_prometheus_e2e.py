"""End to end with the real Prometheus (Debian's package; .ci/install_prometheus.sh installs it):
`ascend-pool serve --replay` on 127.0.0.1 with three tenants on a small simulated device,
Prometheus scraping it every second and loading grafana/alerts.yml. Every PromQL expression of
the Grafana dashboard (variables substituted) and every alert rule must return a non-empty
result, which for the alerts means the demo workload really drives a tenant near its quota, over
it, out of memory and into a fragmented cache. Also `promtool check metrics` on the exposition
and `promtool test rules` on the rules' unit tests."""

import json
import os
import pwd
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest

import ascend_pool as _ap

sys.path.insert(0, os.path.dirname(__file__))
from prometheus_harness import start_prometheus, stop_all  # noqa: E402
from other_user import OTHER, SKIP as NO_OTHER_USER, Node  # noqa: E402

# children import the same build as this process (installed package or in-place tree)
_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(_ap.__file__)))

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "grafana"
DASHBOARD = GRAFANA / "ascend_pool_dashboard.json"
ALERTS = GRAFANA / "alerts.yml"
# Waits until every expression has data; on a loaded 2-core machine the demo's replay cycle (which
# drives the quota alerts) can take longer than 20 s to reach a tenant's quota.
QUERY_DEADLINE_S = 60

# A small device and tight quotas, so the alerts have something to say: "online" fits the BERT
# trace but not the ResNet ones (near quota, over quota), "batch" fits none, "bulk" has no quota
# and runs the device out of memory next to the other two.
TENANTS = """
[tenants.online]
quota = "430MiB"
warn = 0.9
[tenants.batch]
quota = "256MiB"
[tenants.bulk]
"""
# The device is sized so that out-of-memory recurs every replay cycle, not only during warm-up:
# bulk's ResNet traces need ~818 MiB live and online keeps ~364 MiB cached after its BERT run
# (budgeted release keeps a steady cache), and 818 + 364 > 1024. At 1536 MiB the caches settle
# side by side after the first seconds, and a first scrape after that sees no increase in OOMs.
SIM_HBM = "1024MiB"

# A process of another user (runuser -u nobody) booking "online" in its own quota ledger beside
# the demo's (root's): the tenant is then booked in two users' ledgers, which the service trusting
# both (--allow-uid) counts in ascend_pool_tenant_ledgers and AscendPoolTenantQuotaSplitAcrossUsers
# reports. Without root and runuser that alert is left out of the required set (NO_OTHER_USER says why).
SPLIT_ALERT = "AscendPoolTenantQuotaSplitAcrossUsers"
OTHER_HOLDER = """
import ascend_pool as ap
ctx = ap.Pool(0).context("online", quota=100 << 20)
held = ctx.malloc(8 << 20)
print("held", flush=True)
sys.stdin.readline()
"""

VARIABLES = {"$__rate_interval": "15s", "${__rate_interval}": "15s", "$__interval": "5s", "$__range": "1m",
             "$node": ".*", "${node}": ".*",
             "$device": ".*", "${device}": ".*", "$tenant": ".*", "${tenant}": ".*"}


def need(tool):
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is not installed: run .ci/install_prometheus.sh (Debian's prometheus package)")
    return path


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def substitute(expr):
    for k in sorted(VARIABLES, key=len, reverse=True):
        expr = expr.replace(k, VARIABLES[k])
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def dashboard_expressions():
    """[(where, PromQL)] of the dashboard: every panel target, and the variables' label_values()
    queries as the PromQL Grafana runs for them."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for p in dash["panels"]:
        for t in p["targets"]:
            out.append((f"panel {p['title']!r} {t['refId']}", substitute(t["expr"])))
    for v in dash["templating"]["list"]:
        if v["type"] != "query":
            continue
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", q.strip())
        assert m, f"variable {v['name']}: unexpected query {q}"
        out.append((f"variable {v['name']}", f"count by ({m.group(2)}) ({substitute(m.group(1))})"))
    return out


def alert_expressions(port):
    """[(where, PromQL)] of grafana/alerts.yml as the Prometheus under test parsed it."""
    groups = api(port, "/api/v1/rules")["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    names = re.findall(r"^\s*- alert:\s*(\S+)", ALERTS.read_text(), re.M)
    assert sorted(r["name"] for r in rules) == sorted(names), "Prometheus did not load every rule"
    return [(f"alert {r['name']}", r["query"]) for r in rules]


def api(port, path, **params):
    url = f"http://127.0.0.1:{port}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    prometheus = need("prometheus")
    need("promtool")
    tmp = tmp_path_factory.mktemp("e2e")
    for d in ("stats", "ledger", "tsdb"):
        (tmp / d).mkdir()
    (tmp / "tenants.toml").write_text(TENANTS)
    env = dict(os.environ)
    env.update(ASCEND_POOL_STATS="1", ASCEND_POOL_STATS_DIR=str(tmp / "stats"), ASCEND_POOL_LEDGER_DIR=str(tmp / "ledger"),
               ASCEND_SIM_NODE=f"e2e{uuid.uuid4().hex[:10]}", ASCEND_SIM_HBM=SIM_HBM, ASCEND_POOL_BACKEND="sim",
               PYTHONPATH=os.pathsep.join(filter(None, [_PKG_PARENT, env.get("PYTHONPATH")])))
    env.pop("ASCEND_POOL_CONFIG", None)
    env.pop("ASCEND_POOL_TENANT", None)
    serve_args, node = [], None
    if NO_OTHER_USER is None:
        # ledgers, stats files and the simulated node in a 1777 directory the other user may write
        root = tempfile.mkdtemp(prefix="ap-e2e-")
        os.chmod(root, 0o755)  # the other user enters it to import the readable copy (Node)
        node = Node(root)
        env.update(ASCEND_POOL_STATS_DIR=node.shm, ASCEND_POOL_LEDGER_DIR=node.shm, ASCEND_SIM_SHM_DIR=node.shm)
        serve_args = ["--allow-uid", str(pwd.getpwnam(OTHER).pw_uid)]
    procs = []
    if node is not None:  # before the demo, which runs the device out of memory
        holder = subprocess.Popen(node.argv(OTHER, OTHER_HOLDER),
                                  env=dict(env, PYTHONPATH=node.site, PYTHONSAFEPATH="1", HOME=node.root,
                                           ASCEND_POOL_STATS_INTERVAL="0.5"),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  cwd=node.root)
        procs.append(holder)
        if holder.stdout.readline().strip() != "held":
            stop_all(procs)
            shutil.rmtree(node.root, ignore_errors=True)
            pytest.fail(f"{OTHER}'s holder did not start: {holder.stderr.read()}")
    serve_log = open(tmp / "serve.log", "w")
    serve = subprocess.Popen([sys.executable, "-m", "ascend_pool.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                              "--replay", "--config", str(tmp / "tenants.toml"), "--replay-pause", "0.2", *serve_args],
                             stdout=subprocess.PIPE, stderr=serve_log, text=True, env=env)
    procs.append(serve)
    prom_log = None
    try:
        line = serve.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line)
        assert m, f"serve did not start: {line}{(tmp / 'serve.log').read_text()}"
        serve_port = int(m.group(1))
        prom_port = free_port()
        prom, prom_log = start_prometheus(prometheus, tmp, prom_port, [f"127.0.0.1:{serve_port}"], ALERTS)
        procs.append(prom)
        yield {"serve_port": serve_port, "prom_port": prom_port, "tmp": tmp}
    finally:
        stop_all(procs)
        serve_log.close()
        if node is not None:
            shutil.rmtree(node.root, ignore_errors=True)
        if prom_log is not None:
            prom_log.close()


def test_every_dashboard_and_alert_expression_returns_data(stack):
    port = stack["prom_port"]
    exprs = dashboard_expressions() + alert_expressions(port)
    if NO_OTHER_USER is not None:  # no second user's ledger to split "online" across (the reason says why)
        print(f"{SPLIT_ALERT} not required: {NO_OTHER_USER}")
        exprs = [(w, e) for w, e in exprs if w != f"alert {SPLIT_ALERT}"]
    assert len(exprs) >= 20
    # the node counters the counter panels and alerts read first, counting the demo's OOMs
    exprs.append(("node counters", "sum by (node, device, tenant, uid) (ascend_pool_node_ooms_total) > 0"))
    pending = dict(exprs)
    last = {}
    deadline = time.monotonic() + QUERY_DEADLINE_S
    while pending and time.monotonic() < deadline:
        for where, expr in list(pending.items()):
            r = api(port, "/api/v1/query", query=expr)
            assert r["status"] == "success", f"{where}: {r}"
            last[where] = r["data"]["result"]
            if r["data"]["result"]:
                del pending[where]
        if pending:
            time.sleep(1)
    assert not pending, "empty results:\n" + "\n".join(f"  {w}: {e}" for w, e in pending.items())
    up = api(port, "/api/v1/query", query='up{job="ascend_pool"}')["data"]["result"]
    assert up and up[0]["value"][1] == "1"
    # Prometheus evaluated the rules itself without errors, and the demo made them fire.
    groups = api(port, "/api/v1/rules")["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == 5 and all(r["health"] == "ok" for r in rules), rules
    # Its own evaluations (every second) raise each alert too: pending (those with `for:`) or firing.
    # Each at some moment, not all at one: the demo's tenant is near its quota only in part of each
    # replay cycle, and a pending alert goes back to inactive when its condition lapses (a loaded
    # machine stretches the cycle: all four at one poll within 10 s failed once).
    want = {r["name"] for r in rules} - ({SPLIT_ALERT} if NO_OTHER_USER is not None else set())
    seen = set()
    deadline = time.monotonic() + 45
    while not want <= seen and time.monotonic() < deadline:
        seen |= {a["labels"]["alertname"] for a in api(port, "/api/v1/alerts")["data"]["alerts"]}
        time.sleep(0.5)
    assert want <= seen, f"alerts never raised by Prometheus: {sorted(want - seen)}"


def test_promtool_check_metrics_on_the_exposition(stack):
    body = urllib.request.urlopen(f"http://127.0.0.1:{stack['serve_port']}/metrics", timeout=10).read()
    assert b'ascend_pool_reserved_bytes{device="0"' in body
    r = subprocess.run([need("promtool"), "check", "metrics"], input=body, capture_output=True, timeout=30)
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()


def test_promtool_check_and_test_rules():
    promtool = need("promtool")
    r = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], cwd=GRAFANA, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout

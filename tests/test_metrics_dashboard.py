"""Structure of grafana/ascend_pool_dashboard.json (no Grafana server can run here; its queries are
run against a real Prometheus in test_prometheus_e2e.py): a templated data source and device/tenant
variables, no hard-coded UIDs, the panels the issue asks for, valid layout, and queries that only
name metrics the exporter exports."""

import json
import re
from pathlib import Path

import pytest

from ascend_pool.metrics.schema import DEVICE_FAMILIES, FAMILIES, FRAGMENTATION, QUOTA
from ascend_pool.service.node_counters import NODE_COUNTERS

DASHBOARD = Path(__file__).resolve().parent.parent / "grafana" / "ascend_pool_dashboard.json"
DS = {"type": "prometheus", "uid": "${datasource}"}


@pytest.fixture(scope="module")
def dash():
    return json.loads(DASHBOARD.read_text())


def _walk(node, path=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield path + "/" + k, k, v
            yield from _walk(v, path + "/" + k)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")


def test_variables_are_templated(dash):
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("node", "device", "tenant"):
        v = variables[name]
        assert v["type"] == "query" and v["datasource"] == DS
        assert v["multi"] and v["includeAll"] and v["allValue"] == ".*"
        assert "label_values(" in (v["query"]["query"] if isinstance(v["query"], dict) else v["query"])
    assert "$device" in json.dumps(variables["tenant"]["query"])  # tenants follow the device choice
    assert "$node" in json.dumps(variables["device"]["query"])  # devices follow the node choice


def test_no_hard_coded_uids(dash):
    assert dash.get("uid") is None and dash.get("id") is None
    for path, key, value in _walk(dash):
        if key == "uid" and path != "/uid":
            assert value == "${datasource}", f"hard-coded uid at {path}: {value!r}"
        if key == "datasource" and isinstance(value, (dict, str)):
            assert value in (DS, "prometheus") or path.endswith("templating/list[0]/datasource"), path
    assert "__inputs" not in dash


def test_required_panels_and_targets(dash):
    titles = [p["title"] for p in dash["panels"]]
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for want in ("Held vs used memory per tenant", "Quota use", "External fragmentation",
                 "Largest free block", "Device calls per second", "Failed requests per second", "Cache hit ratio"):
        assert any(t.startswith(want) for t in titles), want
    for metric in ("ascend_pool_reserved_bytes", "ascend_pool_allocated_bytes", "ascend_pool_quota_bytes",
                   "ascend_pool_fragmentation_ratio", "ascend_pool_largest_free_block_bytes",
                   "ascend_pool_device_mallocs_total", "ascend_pool_ooms_total", "ascend_pool_allocations_total"):
        assert metric in exprs, metric
    hit = next(p for p in dash["panels"] if p["title"] == "Cache hit ratio")["targets"][0]["expr"]
    assert hit.startswith("clamp_min(1 - ") and "device_mallocs_total" in hit and "allocations_total" in hit


def test_panels_are_well_formed(dash):
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in dash["panels"]:
        assert p["datasource"] == DS and p["type"] in ("timeseries", "bargauge", "stat", "gauge")
        assert p["fieldConfig"]["defaults"]["unit"]
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']!r} overlaps another"
                cells.add((x, y))
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs))
        for t in p["targets"]:
            assert t["datasource"] == DS and t["expr"].strip()
            assert t["expr"].count("(") == t["expr"].count(")")
            if "rate(" in t["expr"]:
                assert "[$__rate_interval]" in t["expr"]


def test_per_node_queries_keep_nodes_apart(dash):
    # One Prometheus scrapes every node: a per-tenant or per-device figure summed without `node`
    # adds two nodes' devices together. Only the cluster panel sums across nodes, on purpose.
    for p in dash["panels"]:
        if p["title"].startswith("Cluster:"):
            continue
        for t in p["targets"]:
            for by in re.findall(r"\b(?:by|on) \(([^)]*)\)", t["expr"]):
                assert "node" in [x.strip() for x in by.split(",")], (p["title"], t["expr"])


def test_queries_name_only_exported_metrics_and_filter_by_variables(dash):
    exported = {name + ("_total" if kind == "counter" else "") for name, kind, *_ in FAMILIES}
    exported |= {FRAGMENTATION[0], QUOTA[0]} | {name for name, *_ in DEVICE_FAMILIES}
    exported |= {name + "_total" for name, *_ in NODE_COUNTERS}  # the node service's
    for p in dash["panels"]:
        for t in p["targets"]:
            names = set(re.findall(r"\bascend_pool_[a-z_]+", t["expr"]))
            assert names and names <= exported, (p["title"], names - exported)
            for sel in re.findall(r"ascend_pool_[a-z_]+\{([^}]*)\}", t["expr"]):
                assert 'node=~"$node"' in sel and 'device=~"$device"' in sel, (p["title"], sel)
                if "device_free" not in t["expr"] and "device_total" not in t["expr"]:
                    assert 'tenant=~"$tenant"' in sel, (p["title"], sel)

"""The Kubernetes deployment (deploy/, a kustomize base) is what operators apply: it must render,
every core resource must validate against the Kubernetes API schema, the Prometheus Operator
resources must be wired to the Service, the alert rules must be the tested rules file's, and the
tenants ConfigMap must be a valid tenants file. No cluster and no Docker daemon are available here:
nothing is applied or built (deploy/README.md says so)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
CORE_KINDS = {"Namespace", "ConfigMap", "DaemonSet", "Service", "Deployment"}
K8S_VERSION = "1.30.0"  # the oldest Kubernetes still served by the cloud vendors this year


def _tool(name):
    """The path of a tool the deployment checks need: a failure naming it where it is missing (kubectl
    comes with this project's machine image; promtool from .ci/install_prometheus.sh)."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: kubectl renders the kustomize base, promtool checks the rules "
                    "(bash .ci/install_prometheus.sh installs promtool)")
    return path


@pytest.fixture(scope="module")
def rendered():
    """The base as kubectl renders it ({(kind, name): resource})."""
    r = subprocess.run([_tool("kubectl"), "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_the_base_renders_every_resource(rendered):
    kinds = {k for k, _ in rendered}
    assert kinds == CORE_KINDS | {"ServiceMonitor", "PrometheusRule"}
    assert all(r["metadata"].get("namespace") == "ascend-pool" for (k, _), r in rendered.items() if k != "Namespace")


def test_core_resources_validate_against_the_kubernetes_schema(rendered):
    import kubernetes_validate  # a test dependency (pyproject: test extras)
    for (kind, name), resource in rendered.items():
        if kind in CORE_KINDS:
            # Raises ValidationError naming the field on any unknown or malformed property.
            kubernetes_validate.validate(resource, K8S_VERSION, strict=True)


def test_a_broken_manifest_is_caught_by_the_validation(rendered):
    import kubernetes_validate  # a test dependency (pyproject: test extras)
    broken = yaml.safe_load(yaml.safe_dump(rendered[("DaemonSet", "ascend-pool-serve")]))
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["port"] = [9464]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def _container(rendered):
    return rendered[("DaemonSet", "ascend-pool-serve")]["spec"]["template"]["spec"]["containers"][0]


def test_daemonset_runs_the_node_service_as_an_operator_expects(rendered):
    ds = rendered[("DaemonSet", "ascend-pool-serve")]
    pod = ds["spec"]["template"]["spec"]
    c = _container(rendered)
    assert not pod.get("hostPID"), "identity rests on leases: the service needs no host pid namespace"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["args"][0] == "serve"
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["path"] == "/healthz"
    assert c["resources"]["requests"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["shared"]["hostPath"]["path"]
    # It reads the directory it is told to, where the tenant pods write.
    assert f"--stats-dir={mounts['shared']}" in c["args"]
    assert env["ASCEND_POOL_LEDGER_DIR"]["value"] == mounts["shared"]
    # It trusts the group the tenants share their ledgers and stats in, and runs in it.
    group = env["ASCEND_POOL_LEDGER_GROUP"]["value"]
    assert f"--allow-group={group}" in c["args"]
    assert str(pod["securityContext"]["runAsGroup"]) == group
    # The tenants file is mounted as a directory (no subPath), so ConfigMap updates reach it.
    assert "subPath" not in str(c["volumeMounts"])
    assert f"--config={mounts['tenants']}/tenants.toml" in c["args"]


def test_tenant_workload_shares_the_service_directory_and_group(rendered):
    ds_pod = rendered[("DaemonSet", "ascend-pool-serve")]["spec"]["template"]["spec"]
    pod = rendered[("Deployment", "example-online-worker")]["spec"]["template"]["spec"]
    w = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in w["env"]}
    shared = {v["name"]: v for v in pod["volumes"]}["shared"]["hostPath"]["path"]
    assert shared == {v["name"]: v for v in ds_pod["volumes"]}["shared"]["hostPath"]["path"]
    mount = {m["name"]: m["mountPath"] for m in w["volumeMounts"]}["shared"]
    assert env["ASCEND_POOL_STATS_DIR"] == env["ASCEND_POOL_LEDGER_DIR"] == mount
    group = int(env["ASCEND_POOL_LEDGER_GROUP"])
    assert group in pod["securityContext"]["supplementalGroups"]
    assert ds_pod["securityContext"]["runAsGroup"] == group
    assert env["ASCEND_POOL_TENANT"] and env["ASCEND_POOL_CONFIG_RELOAD"] == "watch"


def test_servicemonitor_scrapes_the_service_port(rendered):
    svc = rendered[("Service", "ascend-pool-serve")]
    sm = rendered[("ServiceMonitor", "ascend-pool-serve")]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    selector = sm["spec"]["selector"]["matchLabels"]
    assert selector.items() <= svc["metadata"]["labels"].items()
    ports = {p["name"] for p in svc["spec"]["ports"]}
    assert sm["spec"]["endpoints"] and all(e["port"] in ports for e in sm["spec"]["endpoints"])
    assert all(e.get("honorLabels") for e in sm["spec"]["endpoints"]), "the node label must survive the scrape"
    # The Service selects the DaemonSet's pods.
    pod_labels = rendered[("DaemonSet", "ascend-pool-serve")]["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()


def test_prometheusrule_carries_exactly_the_tested_rules(rendered):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_prometheusrule.py"), "--check"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rule = rendered[("PrometheusRule", "ascend-pool")]
    tested = yaml.safe_load((ROOT / "grafana" / "alerts.yml").read_text())["groups"]
    assert rule["spec"]["groups"] == tested


def test_prometheusrule_rules_pass_promtool(rendered, tmp_path):
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": rendered[("PrometheusRule", "ascend-pool")]["spec"]["groups"]}))
    r = subprocess.run([_tool("promtool"), "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_tenants_configmap_is_a_valid_tenants_file(rendered, tmp_path):
    text = rendered[("ConfigMap", "ascend-pool-tenants")]["data"]["tenants.toml"]
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    r = subprocess.run([sys.executable, "-m", "ascend_pool.cli", "check-config", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr

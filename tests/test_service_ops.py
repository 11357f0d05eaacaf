"""What an operator expects of the exporters (issue 20): every series carries `node`
($NODE_NAME, else the hostname), ascend_pool_build_info, each tenant's warn ratio exported,
GET /healthz (200, or 503 naming what cannot be read), `serve` refusing a missing stats directory,
and the bundled demo tenants of `serve --replay` without --config."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import ascend_pool as ap
from ascend_pool.metrics import PoolCollector

sys.path.insert(0, os.path.dirname(__file__))
from metrics_scrape import start_serve  # noqa: E402
from test_service_serve import env_for, metrics  # noqa: E402


def series(text):
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=15)


def healthz(port):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_in_process_series_carry_node_and_the_warn_ratio(monkeypatch):
    monkeypatch.setenv("NODE_NAME", "node-x")
    pool = ap.Pool(0, backend="sim")
    pool.tenant, pool.quota_bytes, pool.warn = "online", 256 << 20, 0.75
    try:
        pool.malloc(1 << 20)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(PoolCollector(pools=lambda: [pool]))
        got = series(generate_latest(registry).decode())
    finally:
        pool.close()
    assert got and all(labels.get("node") == "node-x" for _, labels, _ in got), got
    warn = [(lab, v) for n, lab, v in got if n == "ascend_pool_quota_warn_ratio"]
    assert warn == [({"node": "node-x", "device": "0", "tenant": "online"}, 0.75)]


def test_node_defaults_to_the_hostname(monkeypatch):
    monkeypatch.delenv("NODE_NAME", raising=False)
    from ascend_pool.metrics.node import node_name

    assert node_name() == socket.gethostname()


def test_in_process_server_answers_healthz_and_build_info():
    server = ap.metrics.start_http_server(0)
    try:
        assert healthz(server.port) == (200, "ok\n")
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read().decode()
    finally:
        server.close()
    (info,) = [lab for n, lab, v in series(body) if n == "ascend_pool_build_info" and v == 1]
    assert info["version"] == ap.__version__ and info["node"]


BUILD_INFO_ACROSS_A_CLOSE = r"""
import json, urllib.request
import ascend_pool as ap
server = ap.metrics.start_http_server(0)
def backends():
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read().decode()
    return [line.split('backend="')[1].split('"')[0] for line in body.splitlines()
            if line.startswith("ascend_pool_build_info{")]
pool = ap.Pool(0, backend="sim")
seen = [backends()]
pool.close()
seen.append(backends())
print(json.dumps(seen))
"""


def test_in_process_build_info_keeps_its_backend_when_the_pools_close(tmp_path):
    # The backend label named the backends of the pools open at the scrape: a process that
    # closes its pools between jobs flipped its build_info series between backend="sim" and
    # backend="none" (two series in turn, a count() of builds counting it twice).
    env = env_for(tmp_path)
    r = subprocess.run([sys.executable, "-c", BUILD_INFO_ACROSS_A_CLOSE], env=env, capture_output=True, text=True,
                       timeout=60, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [["sim"], ["sim"]], r.stdout


def test_serve_demo_tenants_node_build_info_and_healthz(tmp_path):
    env = env_for(tmp_path)
    env["NODE_NAME"] = "node-q"
    proc, port = start_serve(env, tmp_path / "serve.log", "--replay", "--replay-pause", "0.05")
    try:
        deadline = time.monotonic() + 20
        while True:
            m = metrics(port)
            quotas = {dict(lab)["tenant"]: v for (n, lab), v in m.items() if n == "ascend_pool_quota_bytes"}
            warns = {dict(lab)["tenant"]: v for (n, lab), v in m.items() if n == "ascend_pool_quota_warn_ratio"}
            if len(quotas) == 2 and len(warns) == 2:
                break
            assert time.monotonic() < deadline, f"demo tenants not seen: {quotas} {warns}"
            time.sleep(0.2)
        # The bundled demo tenants file: online is the tight one.
        assert quotas == {"online": 430 << 20, "batch": 2 << 30}
        assert warns == {"online": 0.8, "batch": 0.9}
        assert all(dict(lab).get("node") == "node-q" for (n, lab) in m), [k for k in m if dict(k[1]).get("node") != "node-q"]
        info = [dict(lab) for (n, lab), v in m.items() if n == "ascend_pool_build_info" and v == 1]
        assert len(info) == 1 and info[0]["version"] == ap.__version__ and info[0]["backend"] == "sim"
        assert healthz(port) == (200, "ok\n")
        # The stats directory disappears (an unmounted volume, a wiped /dev/shm): 503 naming it.
        stats = tmp_path / "stats"
        stats.rename(tmp_path / "stats.away")
        try:
            code, body = healthz(port)
            assert code == 503 and str(stats) in body, (code, body)
        finally:
            (tmp_path / "stats.away").rename(stats)
        assert healthz(port) == (200, "ok\n")
    finally:
        rc = stop(proc)
    assert rc == 0, (tmp_path / "serve.log").read_text()


def test_healthz_503_when_the_stats_directory_becomes_unreadable(tmp_path):
    """Made unreadable by its mode; as root (who reads any directory whatever its mode, e.g. in
    CI) by swapping it for a regular file, which cannot be listed either."""
    env = env_for(tmp_path)
    proc, port = start_serve(env, tmp_path / "serve.log")
    stats = tmp_path / "stats"
    moved = tmp_path / "stats.moved"
    try:
        assert healthz(port) == (200, "ok\n")
        if os.geteuid() == 0:
            stats.rename(moved)
            stats.write_text("")
            expected = "not a directory"
        else:
            stats.chmod(0)
            expected = "cannot read"
        code, body = healthz(port)
        assert code == 503 and str(stats) in body and expected in body, (code, body)
    finally:
        if moved.exists():
            stats.unlink()
            moved.rename(stats)
        else:
            stats.chmod(0o755)
        assert healthz(port) == (200, "ok\n")  # healthy again once the directory is back
        stop(proc)


def test_serve_refuses_a_missing_stats_directory(tmp_path):
    missing = tmp_path / "no" / "such"
    r = subprocess.run([sys.executable, "-m", "ascend_pool.cli", "serve", "--port", "0", "--stats-dir", str(missing)],
                       capture_output=True, text=True, env=env_for(tmp_path), timeout=30)
    assert r.returncode == 2, r.stdout + r.stderr
    assert str(missing) in r.stderr and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_serve_refuses_a_stats_path_that_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("")
    r = subprocess.run([sys.executable, "-m", "ascend_pool.cli", "serve", "--port", "0", "--stats-dir", str(f)],
                       capture_output=True, text=True, env=env_for(tmp_path), timeout=30)
    assert r.returncode == 2 and str(f) in r.stderr and "not a directory" in r.stderr, r.stderr

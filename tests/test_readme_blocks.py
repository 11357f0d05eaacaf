"""Every code block of the README works as written: the install and test commands are the ones CI
runs, every Python block runs, every tenants file is valid, and every `ascend-pool` command line
runs (a server until it answers, then it is stopped). Synopses are ```text blocks, not commands."""

import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```", README, re.S | re.M)


def blocks(lang):
    return [body for kind, body in BLOCKS if kind == lang]


def command_lines():
    """The `ascend-pool ...` lines of the README's bash blocks, comments removed."""
    out = []
    for body in blocks("bash"):
        for line in body.splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("ascend-pool "):
                out.append(line)
    return out


def test_readme_opens_with_install_test_and_main_job():
    lang, first = BLOCKS[0]
    lines = [ln.split("#", 1)[0].strip() for ln in first.splitlines() if ln.strip()]
    assert lang == "bash" and len(lines) == 3, first
    install, test, main_job = lines
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    # CI runs the same install (as `python3 -m pip ... --quiet`) and exactly the same test command.
    ci_install = [ln for ln in ci if "pip install" in ln]
    assert ci_install and all(shlex.split(install)[-1] == shlex.split(ln)[-1] for ln in ci_install), ci_install
    assert test in ci
    assert main_job.startswith("ascend-pool serve")


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_block_runs(index, sim_node, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(blocks("python")[index])
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=sim_node.env(ASCEND_POOL_BACKEND="sim"),
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("index", range(len(blocks("toml"))))
def test_toml_block_is_a_valid_tenants_file(index, tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(blocks("toml")[index])
    r = subprocess.run([sys.executable, "-m", "ascend_pool.cli", "check-config", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def _serve_until_ready(argv, env, cwd, timeout=60.0):
    """Starts a server command, waits for /metrics to answer with pool series, then stops it
    with SIGTERM (as an operator would). Returns the metrics text."""
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        deadline = time.monotonic() + timeout
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            m = re.search(r"(http://\S+/metrics)", line)
            url = m.group(1) if m else None
        assert url, f"{argv}: never said where it serves"
        body = ""
        while time.monotonic() < deadline and "ascend_pool_reserved_bytes{" not in body:
            try:
                body = urllib.request.urlopen(url, timeout=5).read().decode()
            except OSError:
                pass
            time.sleep(0.2)
        assert "ascend_pool_reserved_bytes{" in body, f"{url} served no pool figures"
        return body
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        assert rc == 0, f"{argv} exited {rc} on SIGTERM"


@pytest.mark.parametrize("line", command_lines())
def test_command_line_runs(line, sim_node, tmp_path):
    argv = shlex.split(line)
    env = sim_node.env(ASCEND_POOL_BACKEND="sim")
    if argv[1] == "serve":
        _serve_until_ready(argv, env, tmp_path)
        return
    r = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr

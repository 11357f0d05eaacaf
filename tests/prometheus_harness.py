"""A real Prometheus for the end-to-end tests (test_prometheus_e2e, test_prometheus_cluster):
started on a free loopback port with the shipped alert rules, scraping and evaluating every second,
and the processes of a fixture stopped the way an operator stops them (SIGTERM, then kill)."""

import signal
import subprocess
import time
import urllib.request


def start_prometheus(prometheus, tmp, port, targets, rules, honor_labels=False):
    """Starts `prometheus` (the binary's path) with its config and data in tmp, scraping the
    "host:port" strings of targets; returns (process, log file) once /-/ready answers (within 120 s:
    it replays an empty TSDB in about a second, many times that on a loaded machine)."""
    (tmp / "tsdb").mkdir(exist_ok=True)
    listed = ", ".join(f"'{t}'" for t in targets)
    (tmp / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files:\n  - {rules}\n"
        "scrape_configs:\n  - job_name: ascend_pool\n"
        + ("    honor_labels: true\n" if honor_labels else "")
        + f"    static_configs:\n      - targets: [{listed}]\n")
    log = open(tmp / "prometheus.log", "w")
    prom = subprocess.Popen([prometheus, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2).read()
            return prom, log
        except OSError:
            if prom.poll() is not None or time.monotonic() > deadline:
                prom.kill()
                prom.wait()
                log.close()
                raise AssertionError(f"prometheus not ready in 120 s: {(tmp / 'prometheus.log').read_text()}")
            time.sleep(0.2)


def stop_all(procs):
    """SIGTERM to every process (last started first), then waits; kills what does not stop in 10 s."""
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

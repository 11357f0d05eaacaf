"""The node service in tests: starting `ascend-pool serve`, and reading a running exporter's
/metrics (every sample by name and labels)."""

import re
import select
import subprocess
import sys
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families


def scrape(port):
    """{(name, frozenset(labels)): value} of http://127.0.0.1:port/metrics."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(body) for s in fam.samples}


def series(samples, name, **labels):
    """The samples of `name` whose labels include `labels`: {frozenset(labels): value}."""
    want = {k: str(v) for k, v in labels.items()}.items()
    return {lab: v for (n, lab), v in samples.items() if n == name and want <= lab}


def start_serve(env, log_path, *args, prefix=()):
    """Starts `ascend-pool serve` on a free port under `prefix` (a command it runs in, e.g.
    unshare's), its log in log_path; it prints its URL on stdout. Returns (process, port)."""
    with open(log_path, "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "ascend_pool.cli", "serve", "--port", "0", *args],
                                stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else ""
    m = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line)
    if not m:
        proc.kill()
        proc.wait()
        raise AssertionError(f"serve did not start: {line!r} {Path(log_path).read_text()}")
    return proc, int(m.group(1))

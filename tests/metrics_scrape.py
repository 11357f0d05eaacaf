"""Reading a running exporter's /metrics in tests: every sample by name and labels."""

import urllib.request

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

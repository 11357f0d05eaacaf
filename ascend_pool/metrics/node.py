"""The `node` label every exported series carries, and the build-info series.

One Prometheus scrapes the node service of every node: without a node label, two nodes' series
for the same (device, tenant, pid) would differ only by the scrape target, and sums by (device,
tenant) would add devices of different nodes. The node is $NODE_NAME (the DaemonSet sets it from
the downward API, spec.nodeName), else the hostname.
"""

import os
import socket

from ..version import __version__

ENV_NODE = "NODE_NAME"


def node_name():
    """This node's name: $NODE_NAME, else the hostname."""
    return os.environ.get(ENV_NODE) or socket.gethostname()


def with_node(families, node=None):
    """Yields the metric families with a `node` label (first) on every sample."""
    node = node or node_name()
    for fam in families:
        fam.samples = [s._replace(labels={"node": node, **s.labels}) for s in fam.samples]
        yield fam


class NodeLabelled:
    """Wraps a prometheus_client collector so that every series it yields carries `node`."""

    def __init__(self, collector, node=None):
        self._collector, self._node = collector, node

    def collect(self):
        return with_node(self._collector.collect(), self._node)

    def describe(self):
        return []


class BuildInfo:
    """ascend_pool_build_info{version,backend,python} 1: what is running, for dashboards and
    upgrades. backend: the backend name in use (a callable or a string)."""

    def __init__(self, backend):
        self._backend = backend

    def collect(self):
        import platform

        from prometheus_client.core import GaugeMetricFamily

        backend = self._backend() if callable(self._backend) else self._backend
        fam = GaugeMetricFamily("ascend_pool_build_info", "The ascend_pool build running here (always 1).",
                                labels=["version", "backend", "python"])
        fam.add_metric([str(__version__), str(backend or "none"), platform.python_version()], 1)
        yield fam

    def describe(self):
        return []

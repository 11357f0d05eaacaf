"""The node service: every process publishes its pools' figures to a small shared-memory stats
file; `ascend-pool serve` reads them all and exports them to Prometheus.

    publisher.ensure_publisher()   # started by the pool registry when a pool opens
    NodeCollector()                # the service's collector (pid label + node totals)

Files: layout (the binary format), statsfile (the owner's writer), reader (validation),
scanner (a whole directory), publisher (the background thread), node_collector, node_counters
(the node's counters, exited processes' final counts included), replay_loop
(the demo workload of `serve --replay`) and paths; process identity is ascend_pool.identity.
"""

from .publisher import ensure_publisher, stop_publisher
from .scanner import StatsScanner

__all__ = ["NodeCollector", "StatsScanner", "ensure_publisher", "stop_publisher"]


def __getattr__(name):
    # Lazy: every process publishes (publisher), only the service exports, and only it needs
    # prometheus_client (a third-party import kept out of every process's import).
    if name == "NodeCollector":
        from .node_collector import NodeCollector

        return NodeCollector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

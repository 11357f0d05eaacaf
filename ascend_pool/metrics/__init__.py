"""Prometheus metrics of ascend_pool, read from the pools' C counters at scrape time.

    import ascend_pool.metrics as m
    server = m.start_http_server(9464)            # http://127.0.0.1:9464/metrics, this process's pools
    registry.register(m.PoolCollector())          # or in an application's own prometheus_client registry

Names, labels and units: ascend_pool.metrics.schema. Node-wide export of every process:
`ascend-pool serve` (ascend_pool.service).
"""

from .collector import PoolCollector
from .http import MetricsServer, start_http_server

__all__ = ["PoolCollector", "MetricsServer", "start_http_server"]

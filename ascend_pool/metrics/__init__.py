"""Prometheus metrics of ascend_pool, read from the pools' C counters at scrape time.

    import ascend_pool.metrics as m
    server = m.start_http_server(9464)            # http://127.0.0.1:9464/metrics, this process's pools
    registry.register(m.PoolCollector())          # or in an application's own prometheus_client registry

Names, labels and units: ascend_pool.metrics.schema. Node-wide export of every process:
`ascend-pool serve` (ascend_pool.service).
"""

__all__ = ["PoolCollector", "MetricsServer", "start_http_server"]


def __getattr__(name):
    # Lazy: every process that opens a pool imports ascend_pool.metrics.sample (its stats publisher
    # reads pools through it); only exporters need prometheus_client and http.server.
    if name == "PoolCollector":
        from .collector import PoolCollector

        return PoolCollector
    if name in ("MetricsServer", "start_http_server"):
        from . import http

        return getattr(http, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

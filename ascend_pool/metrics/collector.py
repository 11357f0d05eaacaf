"""PoolCollector: the in-process prometheus_client collector over this process's pools.

    from prometheus_client import CollectorRegistry
    from ascend_pool.metrics import PoolCollector
    registry.register(PoolCollector())          # in an application that runs its own registry

Everything is read when Prometheus scrapes: the allocation path does no metrics work.
"""

from ..config import flag_argument
from ..errors import ConfigTypeError
from .families import device_families, tenant_families
from .ledger import ReclaimedTotals, ledger_families
from .node import with_node
from .sample import PoolAggregator


class PoolCollector:
    """Collects ascend_pool_* families from the live pools of this process (labels device, tenant,
    pool). pools: a callable returning the pools to read (default: every open pool, from
    ascend_pool.registry.live_pools). ledger: also export the node quota ledgers' state (off by
    default: it is the node's view, which `ascend-pool serve` exports; one process need not)."""

    def __init__(self, pools=None, ledger=False):
        # checked here, not at the first scrape (a 500 at each one, the cause in the log alone)
        if pools is not None and not callable(pools):
            raise ConfigTypeError(f"PoolCollector: pools must be None or a callable returning the pools to read "
                                  f"(e.g. lambda: [pool]), got {type(pools).__name__} {pools!r}")
        flag_argument("PoolCollector", "ledger", ledger)
        self._agg = PoolAggregator(pools) if pools is not None else PoolAggregator()
        self._ledger = ledger
        self._reclaimed = ReclaimedTotals()  # the reclaimed counter never falls while this collector lives

    def collect(self):
        """Every family, each series labelled with this node (metrics.node: $NODE_NAME, else the hostname)."""
        return with_node(self._collect())

    def _collect(self):
        samples = self._agg.samples()
        yield from tenant_families(samples)
        per_device = {}
        for s in samples:
            if s.values["device_total_bytes"]:  # a tenant with no live pool has no device reading
                per_device[s.device] = s.values
        yield from device_families(per_device)
        if self._ledger:
            yield from ledger_families(reclaimed_totals=self._reclaimed)

    def describe(self):
        # Returning nothing keeps registration from calling collect() (pools may not exist yet).
        return []

"""The node quota ledger's state as metrics (tenants' held bytes and quotas across processes).

The ledger belongs to the quotas work (ascend_pool.tenants). This module only reads it, and only
if it is there: it expects ``ascend_pool.tenants.ledger.snapshot()`` to return an iterable of
mappings with ``device`` (int), ``tenant`` (str), ``held_bytes`` (int), ``quota_bytes`` (int or
None) and optionally ``processes`` (int). Anything else (module missing, an error while reading)
exports nothing and logs once: the exporter must never fail a scrape over an optional part.
"""

import importlib
import logging

from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger(__name__)
_warned = set()


def _snapshot():
    try:
        mod = importlib.import_module("ascend_pool.tenants.ledger")
    except ImportError:
        return None
    fn = getattr(mod, "snapshot", None)
    return list(fn()) if callable(fn) else None


def ledger_families():
    """ascend_pool_ledger_{held,quota}_bytes and ascend_pool_ledger_processes, labels device and
    tenant; an empty list when no ledger is readable."""
    try:
        entries = _snapshot()
    except Exception as e:  # a ledger mid-update or of another version: skip this scrape
        if type(e) not in _warned:
            _warned.add(type(e))
            log.warning("cannot read the quota ledger: %s: %s", type(e).__name__, e)
        return []
    if not entries:
        return []
    held = GaugeMetricFamily("ascend_pool_ledger_held_bytes",
                             "Bytes the tenant holds on the device across the node's processes (quota ledger, bytes).",
                             labels=["device", "tenant"])
    quota = GaugeMetricFamily("ascend_pool_ledger_quota_bytes",
                              "The tenant's node-wide quota on the device, as the ledger enforces it (bytes).",
                              labels=["device", "tenant"])
    procs = GaugeMetricFamily("ascend_pool_ledger_processes",
                              "Live processes the ledger counts for the tenant on the device.",
                              labels=["device", "tenant"])
    for e in entries:
        try:
            lv = [str(int(e["device"])), str(e["tenant"])]
            held.add_metric(lv, int(e["held_bytes"]))
            if e.get("quota_bytes") is not None:
                quota.add_metric(lv, int(e["quota_bytes"]))
            if e.get("processes") is not None:
                procs.add_metric(lv, int(e["processes"]))
        except (KeyError, TypeError, ValueError) as err:
            log.debug("skipping ledger entry %r: %s", e, err)
    return [held, quota, procs]

"""The live pools of this process (default pools and tenant contexts), for metrics and tools.
Weak references: a pool that is dropped disappears from here by itself."""

import logging
import threading
import weakref

_lock = threading.Lock()
_pools = weakref.WeakSet()


def register(pool):
    """Adds a pool (called by Pool.__init__) and makes sure this process publishes its pools'
    counters for the node service (ascend_pool.service.publisher)."""
    with _lock:
        _pools.add(pool)
    try:
        from .service.publisher import ensure_publisher

        ensure_publisher()
    except Exception as e:  # publishing is best effort: a pool must open even where /dev/shm is not usable
        logging.getLogger("ascend_pool").warning("stats publisher not started: %s", e)


def live_pools():
    """Open pools of this process, as a list (device, tenant and memory_stats() on each)."""
    with _lock:
        return [p for p in list(_pools) if not p.closed]

"""The live pools of this process (default pools and tenant contexts), for metrics and tools.
Weak references: a pool that is dropped disappears from here by itself."""

import threading
import weakref

_lock = threading.Lock()
_pools = weakref.WeakSet()


def register(pool):
    """Adds a pool (called by Pool.__init__)."""
    with _lock:
        _pools.add(pool)


def live_pools():
    """Open pools of this process, as a list (device, tenant and memory_stats() on each)."""
    with _lock:
        return [p for p in list(_pools) if not p.closed]

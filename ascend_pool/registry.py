"""Which pools exist in this process: every open pool (Pool and tenant contexts) and the default
pool of each device. The one Python home of that question; the C ABI's mirror of it
(cython/capi/registry.h, core/current.h) is kept in step from here and from PoolBase.

Pinned host pools (one per device, never closed) are kept here too.

Live pools are weak references: a pool that is dropped disappears from here by itself, unless
blocks of it are still allocated: then it is an orphan (kept here, still open and registered, so
that frees find it) until they are freed (reap_orphans), as torch's MemPool outlives its tensors. Upper
layers that must know when a pool opens register a listener (on_register); the stats publisher
(ascend_pool/service/publisher.py) starts that way, on the process's first pool. Those that must
read a pool before it closes register on_close (the metrics' aggregator).
"""

import logging
import os
import threading
import weakref

from ._core import _set_default_pool

log = logging.getLogger("ascend_pool")
_lock = threading.RLock()  # re-entrant: a signal handler may call in while its thread holds it
_pools = weakref.WeakSet()
_defaults = {}     # device -> its default pool (ascend_pool.api creates them)
_host_pools = {}   # device -> the pinned host pool (ascend_pool.integrations.pinned creates them)
_listeners = []    # fn(pool), called after each register()
_closing = []      # weak references to bound methods m(pool), called before each pool closes
_orphans = []      # pools dropped with blocks still allocated (Pool.__del__), until those are freed
_reap_again = False  # set by a reap_orphans call while another thread reaps
_reaping = threading.Lock()  # one reap_orphans at a time; never taken by a finalizer
_reaper = None       # the thread ident holding _reaping (a signal handler on it must not wait for itself)
REAP_WAIT_S = 2.0    # reap_orphans(wait=True): the longest wait for another thread's reap (a pass only
                     # closes pools whose work is done; bounded all the same: a signal handler may
                     # interrupt its own thread's reap between the lock's acquire and _reaper's set)


def _after_fork_in_child():
    # Another thread may have held the lock at the fork: the child's copy would stay locked.
    global _lock, _reaping, _reaper
    _lock = threading.RLock()
    _reaping = threading.Lock()
    _reaper = None
    _orphans.clear()  # the parent's pools: a child never touches them


os.register_at_fork(after_in_child=_after_fork_in_child)


def register(pool):
    """Adds an open pool (Pool.__init__ calls it) and tells the listeners (outside the lock; a
    listener that fails is logged: a pool must open even where, e.g., /dev/shm is not usable)."""
    with _lock:
        _pools.add(pool)
        listeners = list(_listeners)
    for fn in listeners:
        try:
            fn(pool)
        except Exception as e:
            log.warning("pool registry listener %r failed: %s", fn, e)


def on_register(fn):
    """Calls fn(pool) for every pool opened from now on (idempotent per fn)."""
    with _lock:
        if fn not in _listeners:
            _listeners.append(fn)


def on_close(method):
    """Calls method(pool) (a bound method, held weakly: its object may go) before each pool's
    close (Pool.close(), or the dealloc of one dropped without it), while the pool can still be
    read: what a pool counted since it was last read would otherwise be lost with it (the metrics' pool aggregator folds its final counters in)."""
    with _lock:
        # the listeners of objects gone since (a collector made per scrape and dropped) go first:
        # pruned only at a pool's close, they piled up while the process's pools stayed open
        _closing[:] = [ref for ref in _closing if ref() is not None]
        _closing.append(weakref.WeakMethod(method))


def closing(pool):
    """Pool.close() calls it first (Pool.__del__ too, for a dealloc's close); a listener that
    fails is logged, the close goes on."""
    with _lock:
        _closing[:] = [ref for ref in _closing if ref() is not None]
        listeners = [ref() for ref in _closing]
    for fn in listeners:
        if fn is None:
            continue
        try:
            fn(pool)
        except Exception as e:
            log.warning("pool close listener %r failed: %s", fn, e)


def keep_orphan(pool):
    """Keeps a pool whose last reference went while blocks of it are still allocated (Pool.__del__
    resurrects it this way): still open, still among the live pools. No lock: a finalizer may run
    in a collection that starts while this thread holds it (list.append is atomic)."""
    _orphans.append(pool)


def forget_orphan(pool):
    """Undoes keep_orphan (Pool.__del__ found nothing to keep it for)."""
    try:
        _orphans.remove(pool)
    except ValueError:
        pass


def is_orphan(pool):
    """True when pool is kept only for blocks its dropped owner left allocated."""
    return any(o is pool for o in list(_orphans))


def reap_orphans(wait=False):
    """Closes the orphans whose blocks have all been freed and whose streams' work on them is done
    (their memory back to the device, their quota booking to the ledger), as a dropped pool
    closes: its streams are left alone. The others give back their idle cache. Never waits for a
    kernel: one still queued on a freed block keeps its orphan for a later call. Cheap when there is
    none; called when a pool opens, by the module-level frees and empty_cache, and every interval
    by the stats publisher's thread (ascend_pool/service/publisher.py). One thread at a
    time: a call while another thread reaps makes that thread pass once more (twice at most per
    call). wait (empty_cache): when another thread is reaping, wait for it and pass once more, so
    that the dropped pools freed by now are closed when this returns, as torch's empty_cache gives
    a deleted MemPool's memory back (the stats thread's tick would otherwise make the caller's
    call a no-op, its memory held until that thread's next pass). Returns how many were closed."""
    global _reap_again, _reaper
    if not _orphans:
        return 0
    _reap_again = True
    if not _reaping.acquire(blocking=False):
        if not wait or _reaper == threading.get_ident() or not _reaping.acquire(timeout=REAP_WAIT_S):
            return 0  # the holder passes again
    _reaper = threading.get_ident()
    done = 0
    try:
        for _ in range(2):  # bounded: threads reaping in a loop must not hold one thread here
            if not _reap_again:
                break
            _reap_again = False
            done += _reap_pass()
    finally:
        _reaper = None
        _reaping.release()
    return done


def _reap_pass():
    done = 0
    for pool in list(_orphans):
        try:
            free = pool.closed or (not pool._active_blocks() and not pool._work_queued())
            if not free:
                pool._release_idle()
        except Exception:  # closed by another thread meanwhile
            free = True
        if free:
            try:
                if not pool.closed:
                    pool._disown_streams()
                    pool.close()  # still among the live pools: the metrics read its final counters
            except Exception:  # said once; retried every tick it would stop every later reap
                log.warning("closing a dropped pool on device %s failed; it is forgotten", pool.device,
                            exc_info=True)
            forget_orphan(pool)
            done += 1
    return done


def live_pools():
    """Open pools of this process, as a list (device, tenant and memory_stats() on each)."""
    with _lock:
        refs = list(_pools.data)  # one C call: a signal handler cannot run in the middle of it
    pools = [p for p in (r() for r in refs) if p is not None]
    # orphans too: a collected cycle's weak references are gone before its finalizers run
    seen = {id(p) for p in pools}
    pools += [p for p in list(_orphans) if id(p) not in seen]
    return [p for p in pools if not p.closed]


def device_peers(pool):
    """The other open pools of pool's device and backend (tenant contexts, the default pool):
    the runtime's streams and blocks belong to the device, so one may answer for another."""
    return [p for p in live_pools() if p is not pool and p.device == pool.device and p.backend is pool.backend]


def default_pool(device):
    """The open default pool of device, or None."""
    pool = _defaults.get(device)
    return None if pool is None or pool.closed else pool


def set_default_pool(device, pool):
    """Makes pool the default of device, for Python and the C ABI (ascend_pool_malloc) alike."""
    _set_default_pool(pool)
    _defaults[device] = pool


def default_pools():
    """The open default pools, as a list."""
    return [p for p in list(_defaults.values()) if not p.closed]


def open_host_pool(device):
    """The process's pinned host pool of device if one was made, else None (none is made)."""
    return _host_pools.get(device)


def host_pool_devices():
    """The devices a pinned host pool was made for, in ascending order."""
    return sorted(_host_pools)


def host_pool(device, create):
    """The process's pinned host pool of device: create() makes it on first use; kept for the life
    of the process (arrays and in-flight copies may outlive every reference to it)."""
    pool = _host_pools.get(device)
    if pool is None:
        with _lock:
            pool = _host_pools.get(device)
            if pool is None:
                pool = _host_pools[device] = create()
    return pool

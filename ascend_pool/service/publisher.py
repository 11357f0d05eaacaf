"""Every process using ascend_pool publishes its pools' figures into its own stats file.

A daemon thread reads the live pools every ASCEND_POOL_STATS_INTERVAL seconds (default 0.25)
and writes one record per (device, tenant); at exit it writes the final counters, marks the file
exited and leaves it for the node service (see Publisher.stop). The
allocation path does nothing for this: the thread reads the same C counters a scrape would.
ASCEND_POOL_STATS=0 turns publishing off for a process.

Started on first use, in one place: the listener this module registers with the pool registry
(ascend_pool/registry.py) at import starts the publisher when the process's first pool opens; the
package (ascend_pool/__init__.py) imports this module, so every process that opens a pool
publishes. Pool() neither imports this module nor touches the stats directory: the listener only
starts the thread, which creates the file (and clears dead processes' files) itself, so a
framework's first C-ABI call does not wait for it. ensure_publisher() is cheap and idempotent;
call it to publish before any pool exists (it creates the file before it returns).
"""

import atexit
import logging
import math
import os
import sys
import threading

from .. import registry as _registry
from ..metrics.sample import PoolAggregator
from ..tenants import ledger as _ledger
from .layout import MAX_CAPACITY as MAX_RECORDS  # a file grows to what the process has, up to what readers accept
from .scanner import StatsScanner
from .statsfile import StatsFile

log = logging.getLogger("ascend_pool.service")

ENV_ENABLE = "ASCEND_POOL_STATS"
ENV_INTERVAL = "ASCEND_POOL_STATS_INTERVAL"
DEFAULT_INTERVAL_S = 0.25

_lock = threading.RLock()
_publisher = None
_reaper = None   # a Publisher whose stats file could not be made: its thread only reaps dropped pools
_failed = False  # could not create the file once: do not retry (and log) at every new pool
_pid = os.getpid()  # the process this module's state is of (a child forked from C keeps the parent's)


class Publisher:
    """Owns this process's StatsFile and the thread that fills it."""

    def __init__(self, directory=None, interval=None, background=False):
        """background: the thread creates the file (errors are logged there) instead of this call
        (errors raised)."""
        self.interval = interval if interval is not None else _interval_from_env()
        self.file = None
        self._directory = directory
        self._ready = threading.Event()  # set once the file exists, or its creation failed
        self._agg = PoolAggregator()
        # Held for a whole start or publish cycle (the thread and the exit hook both publish), and
        # across a fork: a child never inherits the thread's half-done work or its locks.
        self._write_lock = threading.RLock()
        self._stop = threading.Event()
        self.pid = os.getpid()  # the process whose thread and file these are
        self._overflow_logged = False
        self._damage_logged = False  # said once until a fresh file is made
        self._remake_logged = False  # a fresh file could not be made: said once until one is
        if not background:
            self._open_file()
        self._thread = threading.Thread(target=self._run, name="ascend-pool-stats", daemon=True)
        self._thread.start()

    def _open_file(self):
        try:
            self.file = StatsFile(self._directory, max_capacity=MAX_RECORDS)
            _remove_stale(self.file.directory)
        finally:
            self._ready.set()

    @property
    def path(self):
        """The stats file's path (waits up to 10 s for a background start); None if it failed."""
        self._ready.wait(10)
        return self.file.path if self.file is not None else None

    def publish_now(self):
        """Reads the pools and writes the file at once (also done every interval)."""
        self._ready.wait(10)
        with self._write_lock:
            if self.file is None or (self._stop.is_set() and self.file._map is None):
                return  # not created, or stopped: the file is gone on purpose
            samples = self._agg.samples()
            if not self.file.intact():
                # Truncated or removed by someone with our uid: start a fresh file rather than
                # write into a mapping that would fault; in the default place its private
                # directory is made again if it was removed with it (a cleanup of /dev/shm).
                if not self._damage_logged:
                    log.warning("stats file %s was damaged or removed; recreating it", self.file.path)
                    self._damage_logged = True
                self.file.abandon()
                try:
                    fresh = StatsFile(self._directory, max_capacity=MAX_RECORDS)
                except OSError as e:
                    # A full or read-only /dev/shm: one line, not a traceback per try (up to 3);
                    # tried again at each interval (a few system calls), so it comes back with room.
                    if not self._remake_logged:
                        self._remake_logged = True
                        log.warning("stats file %s cannot be made again: %s; the node service does not see pid %d "
                                    "until it can (tried every %g s)", self.file.path, e.strerror or e, os.getpid(),
                                    self.interval)
                    return
                self.file = fresh
                if self._remake_logged:
                    log.warning("stats file %s made again", fresh.path)
                self._damage_logged = self._remake_logged = False
            if self.file.publish(samples) and not self._overflow_logged:
                self._overflow_logged = True
                log.warning("stats file %s: this process has figures for %d (device, tenant) pairs, more than the "
                            "file's %d records; the least recently closed tenants' counters are left out first", self.file.path,
                            len(samples), self.file.capacity)

    def _run(self):
        global _reaper
        if self.file is None:  # a background start: create the file here
            try:
                with self._write_lock:
                    self._open_file()
            except Exception as e:
                _background_failed(self, e)
                _reaper = self  # stop_publisher() still ends the thread
                self._reap_only()
                return
        failures = 0
        while not self._stop.is_set():
            try:
                # Dropped pools whose last frees waited on a kernel: nothing else may call into
                # ascend_pool for a while, and their memory stays booked in the tenant's quota.
                _registry.reap_orphans()
            except Exception:  # never in the way of publishing
                log.debug("reaping dropped pools failed", exc_info=True)
            try:
                self.publish_now()
                _ledger.check_files()  # a cleanup of the ledger directory splits quotas: say so
                failures = 0
            except Exception:  # keep publishing: one bad read must not end the thread
                failures += 1
                if failures <= 3:  # a lasting problem is logged a few times, not 4 times a second
                    log.exception("publishing ascend_pool stats failed")
            self._stop.wait(self.interval)

    def _reap_only(self):
        # No stats file (a full or read-only directory): the thread still closes dropped pools
        # once their kernels are done, as it does beside publishing.
        while not self._stop.wait(self.interval):
            try:
                _registry.reap_orphans()
            except Exception:
                log.debug("reaping dropped pools failed", exc_info=True)

    def stop(self, remove=False):
        """Stops the thread and marks the file exited with the process's final counters, left for
        the node service: its last increments (up to an interval's) never reached the service
        when the file went with the process, so the node's counters lost them. The service folds
        them in and removes the file; where none runs, the next publisher's start removes it once
        EXITED_KEEP_S old. remove: remove it now (nobody is to read it)."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * self.interval + 1)
        with self._write_lock:
            if self.file is not None:
                final = None
                if not remove:
                    try:
                        final = self._agg.samples()
                    except Exception:  # exiting: mark it exited without them
                        log.debug("reading the pools at exit failed", exc_info=True)
                self.file.close(remove=remove, final=final)


# How long an exited process's file is left for the node service to read its final counters
# (it removes them at its scans, every --sweep-interval and scrape) before a publisher's start
# removes it: a node without a service keeps at most this much of them, 32 KiB each.
EXITED_KEEP_S = 60.0


def _remove_stale(directory):
    # Files of our uid's processes that exited or died (killed, crashed) would pile up on a node
    # where no service runs: each new publisher clears those EXITED_KEEP_S old, once, at start,
    # with the half-made files of writers killed while creating theirs (the scan removes both; the
    # node service's scans do too, at once, after reading their final counters).
    try:
        StatsScanner(directory, refusal_level=logging.DEBUG, keep_exited_s=EXITED_KEEP_S).scan()
    except Exception as e:
        log.debug("clearing stale stats files in %s: %s", directory, e)


MIN_INTERVAL_S, MAX_INTERVAL_S = 0.01, 3600.0  # below: a spinning thread; above: figures frozen


def _interval_from_env():
    """$ASCEND_POOL_STATS_INTERVAL in seconds, within [MIN_INTERVAL_S, MAX_INTERVAL_S]; anything
    else (not a number, NaN, <= 0, inf, out of range) is the default, with a warning."""
    text = os.environ.get(ENV_INTERVAL)
    if text is None:
        return DEFAULT_INTERVAL_S
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if MIN_INTERVAL_S <= v <= MAX_INTERVAL_S:
        return v
    log.warning("%s=%r is not a number of seconds from %s to %s; using %s", ENV_INTERVAL, text,
                MIN_INTERVAL_S, MAX_INTERVAL_S, DEFAULT_INTERVAL_S)
    return DEFAULT_INTERVAL_S


_ON, _OFF = ("", "1", "true", "yes", "on"), ("0", "false", "no", "off")
_told_value = None


def enabled():
    """$ASCEND_POOL_STATS: on by default; a value that is neither on nor off is said once in the
    log (publishing stays on: never fail an allocation over it)."""
    global _told_value
    value = os.environ.get(ENV_ENABLE, "1").strip().lower()
    if value not in _ON + _OFF and value != _told_value:
        _told_value = value
        log.warning("%s=%r is neither on (1, true, yes, on) nor off (0, false, no, off): publishing stays on",
                    ENV_ENABLE, os.environ.get(ENV_ENABLE))
    return value not in _OFF


def ensure_publisher(background=False):
    """Starts this process's publisher if it is not running (and publishing is enabled).
    Returns the Publisher or None. Never raises: a node without a writable stats directory
    still allocates, it just is not seen by the node service (logged once). background: the
    publisher's thread creates the file (the registry listener's way: nothing waits for it)."""
    global _publisher, _failed
    if _publisher is not None or _failed or not enabled():
        return _publisher
    with _lock:
        if _publisher is None and not _failed:
            try:
                _publisher = Publisher(background=background)
            except Exception as e:
                _failed = True
                _log_not_published(e)
            else:
                _stop_at_multiprocessing_exit()
    return _publisher


def _stop_at_multiprocessing_exit():
    # A multiprocessing worker started by fork or forkserver (a DataLoader's, a
    # ProcessPoolExecutor's) ends with os._exit after its target: atexit never runs, so its file
    # was never marked exited with the final counters (a short-lived worker's never even made), and
    # what it counted in its last interval (an OOM) never reached the node service. Its exit runs
    # multiprocessing's own finalizers (Process._bootstrap): stop there too (idempotent).
    mp_process = sys.modules.get("multiprocessing.process")
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_process is None or mp_util is None or mp_process.parent_process() is None:
        return  # not a multiprocessing child: atexit stops it
    try:
        mp_util.Finalize(None, stop_publisher, exitpriority=-1)  # after the program's own
    except Exception:  # an unusual multiprocessing: atexit still stops it where it runs
        log.debug("cannot stop the stats publisher at multiprocessing's exit", exc_info=True)


def _log_not_published(e):
    log.warning("ascend_pool stats not published (the node service will not see pid %d): %s", os.getpid(), e)


def _background_failed(publisher, e):
    global _publisher, _failed
    with _lock:
        _failed = True
        if _publisher is publisher:
            _publisher = None
    _log_not_published(e)


def current():
    """The running Publisher, or None."""
    return _publisher


def stop_publisher(remove=False):
    """Stops publishing (also run at exit): the file is left marked exited with the final
    counters (Publisher.stop), or removed."""
    global _publisher, _reaper
    p = _publisher
    if (p.pid if p is not None else _pid) != os.getpid():
        # A child forked from C (Python's fork handlers did not run): the thread, its locks (held
        # for ever here when the fork caught it mid-cycle: the child hung at exit) and the file
        # are the parent's. Forget them as a fork from Python does (before, the child's exit also
        # waited out the join of a thread that is not there). With no publisher, told by the module's
        # pid: _lock was taken, which a thread making the parent's publisher may have held at the fork.
        _after_fork_in_child()
        return
    with _lock:
        p, _publisher = _publisher, None
        reaper, _reaper = _reaper, None
    if p is not None:
        p.stop(remove=remove)
    if reaper is not None:
        reaper._stop.set()


_forking = None  # the Publisher whose cycle lock the fork in progress holds


def _before_fork():
    # Lets a start or publish cycle in flight finish (bounded) so that the fork does not copy the
    # thread mid-way (its locks, or the allocator's, would stay held in the child).
    global _forking
    p = _publisher
    _forking = p if p is not None and p._write_lock.acquire(timeout=5) else None


def _after_fork_in_parent():
    global _forking
    p, _forking = _forking, None
    if p is not None:
        p._write_lock.release()


def _after_fork_in_child():
    # The child has the parent's Publisher object but not its thread, and the file is the parent's:
    # forget it without touching it; the child publishes under its own pid when it opens a pool.
    global _publisher, _failed, _lock, _forking, _reaper, _pid
    p, _publisher, _failed, _lock, _forking, _reaper = _publisher, None, False, threading.RLock(), None, None
    _pid = os.getpid()
    if p is not None and p.file is not None:
        p.file.abandon()


def _on_pool_opened(pool):
    ensure_publisher(background=True)


_registry.on_register(_on_pool_opened)
atexit.register(stop_publisher)
os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)

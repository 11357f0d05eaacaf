"""Reloading the tenants file into live contexts: on demand, on SIGHUP, or when the file changes.

Reloading applies each tenant's new quota and warn ratio to this process's live contexts of that
tenant (Context.set_quota): no allocation is lost; a lower quota stops growth and trims cached
segments, never live blocks. A context whose tenant is no longer in the file, or no longer on its
device, keeps its quota (its processes go on under the limit they started with: dropping it would
let one tenant take the node), and each reload says so once per such context (a warning). A file with mistakes is not applied: the old quotas stay and every
mistake is logged (one line each) on the "ascend_pool.tenants" logger.

Both triggers are opt-in: watch_config() starts a thread that polls the file's mtime;
install_sighup_reload() (main thread only) reloads on SIGHUP. $ASCEND_POOL_CONFIG_RELOAD
("sighup", "watch", or "sighup,watch") turns them on for the process's default tenant pools.
"""

import logging
import numbers
import os
import signal
import threading

from ..errors import ConfigError, PoolError
from . import config as _config
from .context import live_contexts

log = logging.getLogger("ascend_pool.tenants")
RELOAD_ENV = "ASCEND_POOL_CONFIG_RELOAD"


def apply_config(cfg, orphans=None):
    """Applies cfg (a TenantsConfig) to this process's live contexts. Returns a list of
    (tenant, device, old quota bytes, new quota bytes) for the contexts it changed; the contexts
    cfg no longer names for their device (they keep their quota) are appended to orphans (a list)
    as (tenant, device, quota bytes)."""
    changed = []
    for ctx in live_contexts():
        t = cfg.tenants.get(ctx.tenant)
        led = ctx.ledger  # the file names the node's devices, as the ledgers do (None once closed)
        if t is None or not t.applies_to(led.device if led is not None else ctx.device):
            if orphans is not None:
                orphans.append((ctx.tenant, ctx.device, ctx.quota))
            continue
        try:
            old = ctx.quota
            ctx.set_quota(t.quota, warn=t.warn)
        except PoolError:
            if ctx.closed:  # closed by its thread meanwhile: nothing to apply, the others still are
                continue
            raise
        changed.append((ctx.tenant, ctx.device, old, ctx.quota))
    return changed


def reload_config(path=None):
    """Reads the tenants file (path, else $ASCEND_POOL_CONFIG) and applies it. Returns True when
    applied; False (old quotas kept, mistakes logged) when the file has mistakes or is missing."""
    try:
        cfg = _config.load(path)
    except ConfigError as e:
        for line in getattr(e, "errors", [str(e)]):
            log.error("tenants file not reloaded: %s", line)
        return False
    if cfg is None:
        log.error("tenants file not reloaded: no path given and %s is not set", _config.CONFIG_ENV)
        return False
    orphans = []
    for ctx_change in apply_config(cfg, orphans):
        tenant, device, old, new = ctx_change
        if old != new:
            log.info("tenant %r on device %d: quota %s -> %s bytes (from %s)", tenant, device, old, new, cfg.path)
    for tenant, device, quota in orphans:
        log.warning("tenant %r on device %d is not in %s for that device: its live context keeps its quota of "
                    "%s bytes until it closes", tenant, device, cfg.path, quota)
    return True


def _stat_key(path):
    try:
        st = os.stat(path)
        return (st.st_mtime_ns, st.st_size, st.st_ino)
    except OSError:
        return None


WATCH_INTERVAL_S = (0.01, 86400.0)


def _interval(value):
    """The watcher's poll interval in seconds, checked: 0, a negative or NaN one spun a core
    stat-ing the file, inf ended the thread with an OverflowError, "abc" was float()'s bare error."""
    lo, hi = WATCH_INTERVAL_S
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and lo <= value <= hi  # NaN fails it
    if not ok:
        raise ConfigError(f"watch_config: interval must be a number of seconds from {lo} to {hi:.0f}, got {value!r}")
    return float(value)


class ConfigWatcher:
    """A daemon thread that reloads the tenants file when its mtime, size or inode changes
    (checked every `interval` seconds). stop() ends it."""

    def __init__(self, path=None, interval=1.0):
        self.path = os.fspath(path) if path is not None else os.environ.get(_config.CONFIG_ENV)
        if not self.path:
            raise ConfigError(f"watch_config: no path given and {_config.CONFIG_ENV} is not set")
        self.interval = _interval(interval)
        self.reloads = 0
        self._seen = _stat_key(self.path)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ascend_pool-config-watch", daemon=True)
        self._thread.start()

    def check(self):
        """Reloads now if the file changed since the last look. Returns True when it reloaded."""
        key = _stat_key(self.path)
        if key is None or key == self._seen:
            return False
        self._seen = key
        if reload_config(self.path):
            self.reloads += 1
            return True
        return False

    def _run(self):
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception:  # a watcher must outlive any one bad reload
                log.exception("tenants file watcher: reload failed")

    def stop(self):
        self._stop.set()
        self._thread.join()


def watch_config(path=None, interval=1.0):
    """Starts a ConfigWatcher on path (else $ASCEND_POOL_CONFIG)."""
    return ConfigWatcher(path, interval)


class SighupReloader:
    """Reloads the tenants file on SIGHUP. The signal handler only wakes a thread: reading files
    and taking pool locks inside a handler could deadlock with the interrupted code."""

    def __init__(self, path=None):
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError("install_sighup_reload must be called from the main thread "
                              "(Python delivers signals there only)")
        self.path = path
        self.reloads = 0
        self._wake = threading.Event()
        self._done = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ascend_pool-config-sighup", daemon=True)
        self._thread.start()
        self._previous = signal.signal(signal.SIGHUP, self._handler)

    def _handler(self, signum, frame):
        self._wake.set()

    def _run(self):
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            try:
                if reload_config(self.path):
                    self.reloads += 1
            except Exception:
                log.exception("SIGHUP reload failed")
            self._done.set()

    def wait_reload(self, timeout=5.0):
        """Waits for the next reload triggered by SIGHUP to finish (for tests). True if it did."""
        ok = self._done.wait(timeout)
        self._done.clear()
        return ok

    def uninstall(self):
        """Restores the previous SIGHUP handler and ends the thread (main thread only)."""
        signal.signal(signal.SIGHUP, self._previous if self._previous is not None else signal.SIG_DFL)
        self._closed = True
        self._wake.set()
        self._thread.join()


def install_sighup_reload(path=None):
    """Reloads the tenants file (path, else $ASCEND_POOL_CONFIG at each reload) on SIGHUP.
    Main thread only (ConfigError otherwise). Returns a SighupReloader (uninstall() undoes it)."""
    return SighupReloader(path)


_env_started = False
_env_lock = threading.RLock()
_env_handles = []


def _after_fork_in_child():
    # a fork while another thread starts the triggers must not leave the child's copy locked
    global _env_lock
    _env_lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def start_from_env(path=None):
    """Turns on the reload triggers named in $ASCEND_POOL_CONFIG_RELOAD, once per process.
    SIGHUP is installed only when called from the main thread (else logged and skipped)."""
    global _env_started
    value = os.environ.get(RELOAD_ENV, "").strip().lower()
    if not value:
        return []
    items = [v.strip() for v in value.split(",")]
    for item in items:
        # refused at every call and before any trigger is on: checked in the loop below, the
        # first call raised once, with the triggers before it on, and every later call went on
        if item and item not in ("watch", "sighup"):
            raise ConfigError(f"{RELOAD_ENV}={value!r}: unknown trigger {item!r} (expected sighup, watch)")
    with _env_lock:
        if _env_started:
            return list(_env_handles)
        _env_started = True
        for item in items:
            if item == "watch":
                _env_handles.append(watch_config(path))
            elif item == "sighup":
                if threading.current_thread() is threading.main_thread():
                    _env_handles.append(install_sighup_reload(path))
                else:
                    log.warning("%s=sighup: not installed, the default pool was created outside the main thread",
                                RELOAD_ENV)
        return list(_env_handles)

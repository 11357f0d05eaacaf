"""Tenant contexts: a pool of one tenant on one device, with a soft quota shared node-wide.

    ctx = pool.context("online", quota="8GiB", warn=0.9)   # or Context("online", device=0, ...)
    ptr = ctx.malloc(1 << 20)          # QuotaExceededError past the quota; the tenant keeps working
    with ctx:                          # module-level ascend_pool.malloc and the C ABI use ctx
        ...
    ctx.set_quota("4GiB")              # applies at once; never frees live blocks

A context is a Pool of its own (its own segments, so one tenant's fragmentation never blocks
another's) on the same backend, device and knobs as the pool it came from. Every segment it takes
from the device is booked in the tenant's entry of the device's node-wide ledger first (a
compare-and-swap, see cython/quota/ledger_reserve.h), so the quota holds across all processes of
the tenant on the node. Over quota, the context releases its own cached segments and retries
before it refuses.

On the acl and sim backends a context shares the device's default runtime context
(aclrtContext): device memory on Ascend belongs to the device, not to an aclrtContext, so a
separate runtime context would add a context switch per call and change nothing the quota needs.
"""

import logging
import time
from collections import OrderedDict

from .. import registry as _registry
from .._core import attach_ledger, context_enter, context_exit, pool_trim_to
from ..errors import ConfigError, PoolError
from ..pool import Pool, set_context_factory
from ..units import format_bytes
from .config import check_operator_file
from .ledger import open_ledger
from .quota_spec import check_tenant_name, parse_quota, parse_warn

log = logging.getLogger("ascend_pool.tenants")
SEGMENT_BYTES = 2 << 20  # the smallest device allocation the pool makes (a small-pool segment, a page)
SWEEP_EVERY_S = 0.5      # a context's reads of the tenant's figures give back dead processes' shares this often
SWEEP_LOCK_MS = 20       # ... waiting this long at most for the ledger's lock (its holders keep it microseconds)
_KEEP = object()


def with_quota(out, state, warn_events):
    """out (memory_stats()) with a tenant context's quota figures, from its ledger state (a dict
    as Context._quota_state's; {}: none yet) and its warn event count: sorted by key, as torch's
    memory_stats."""
    out["quota_bytes"] = state.get("quota_bytes") or 0
    out["quota_held_bytes"] = state.get("held_bytes", 0)
    out["quota_context_bytes"] = state.get("slot_bytes", 0)
    out["quota_peak_bytes"] = state.get("peak_bytes", 0)
    out["quota_warn"] = state.get("warn") or 0.0
    out["quota_refusals"] = state.get("refusals", 0)
    out["quota_uncertain_bytes"] = state.get("uncertain_bytes", 0)
    out["quota_warn_events"] = warn_events
    return OrderedDict(sorted(out.items()))


class Context(Pool):
    """The pool of tenant `name` on one device, with a soft quota.

    Context(name, device=0, backend=None, quota=None, warn=None, **knobs). quota: int bytes, a size
    string ("8GiB", "512MiB") or a percentage of the device ("25%"); None joins the tenant on the
    node's current terms (no quota for a tenant nobody on the node has limited). warn: a ratio in
    (0, 1]; growth past warn * quota logs a warning once per crossing.

    Attributes: tenant (str), device (int), quota (bytes or None, node-wide, read live from the
    ledger), warn (ratio or None), held (bytes the tenant holds on the device node-wide).
    """

    def __init__(self, name, device=0, backend=None, quota=None, warn=None, **knobs):
        check_tenant_name(name)
        spec = parse_quota(quota) if quota is not None else None
        warn = parse_warn(warn)
        check_operator_file()
        # Whole before the pool registers (Pool.__init__), and closed on any exception after: a
        # Ctrl-C landing between the registration and these left a half-made context open, which
        # the close listeners were given when it was dropped ('Context' object has no attribute
        # 'warn_events').
        self.tenant = name
        self.quota_spec = spec
        self.warn_events = 0
        try:
            super().__init__(device, backend, **knobs)
            quota_bytes = spec.resolve(self.device_total_bytes) if spec is not None else None
            # The quota is a hook on the pool (cython/quota/quota.pxi): the pool's own close
            # path gives the booking back, as it does for every pool.
            attach_ledger(self, open_ledger(self.node_device, self.backend), name, quota_bytes, warn,
                          set_quota=spec is not None)
            # inside: a Ctrl-C here left the context open, its slot and booking held, for as long
            # as the interrupt's traceback was kept (an interactive session's last one)
            self._say_if_nothing_fits(quota_bytes)
        except BaseException:
            self.close()
            raise

    def _say_if_nothing_fits(self, quota_bytes):
        """A quota below one segment refuses every allocation: legal, but surely a mistake (a
        unit left out), so it is said in the log."""
        if quota_bytes is not None and quota_bytes < SEGMENT_BYTES:
            log.warning("tenant %r on device %d: quota %d bytes is below one %d-byte segment, the least the pool "
                        "takes from the device: every allocation will be refused (a unit left out?)",
                        self.tenant, self.device, quota_bytes, SEGMENT_BYTES)

    _under_device_fraction = False  # its quota and its own limit are its caps

    def _describe(self):
        return f"tenant context {self.tenant!r}"

    @property
    def ledger(self):
        """The node-wide ledger (ascend_pool._core.Ledger) the tenant's bookings are in."""
        return self.quota_hook.ledger if self.quota_hook is not None else None

    def _quota_state(self, fresh=False):
        """The tenant as the ledger sees it now (LedgerQuota.state), None once closed. fresh: the
        shares of processes that died (SIGKILL, OOM killer) are given back first, at most every
        SWEEP_EVERY_S: a killed process's booking counted as held until a refusal or the node
        service swept it, and a framework sizing itself from mem_get_info() saw it as used."""
        hook = self.quota_hook
        if hook is None:
            return None
        now = time.monotonic()
        if fresh and now - getattr(self, "_swept_at", -SWEEP_EVERY_S) >= SWEEP_EVERY_S:
            self._swept_at = now
            try:
                hook.ledger.sweep(lock_timeout_ms=SWEEP_LOCK_MS)
            except PoolError as e:  # a ledger held locked (a stopped process): the figures as they are
                log.debug("sweeping the ledger for %s failed: %s", self.tenant, e)
        return hook.state(self)

    def _trim_to(self, target):
        """Releases cached segments until reserved <= target bytes; returns the bytes released."""
        return pool_trim_to(self, target)

    @property
    def device_total_bytes(self):
        """The device's total memory in bytes (what "25%" is a percentage of)."""
        return self.backend.mem_info(self.device)[1]

    def mem_get_info(self):
        """(free, total) bytes as this tenant may use them on the device. With a quota: total is
        the quota (at most the device's total) and free what is left of it node-wide (the quota less what the tenant's
        processes hold, cached memory included, as torch counts the cache as used), at most the
        device's free bytes; what HAMi's limited cudaMemGetInfo reports, and what a framework
        that sizes itself from mem_get_info (a KV cache at a fraction of total) needs. Without a
        quota: the device's figures, as Pool.mem_get_info()."""
        if self.closed:  # its quota is no longer known: the device's figures would be a wrong answer
            raise PoolError(f"tenant context {self.tenant!r} is closed")
        free, total = super().mem_get_info()
        state = self._quota_state(fresh=True)
        quota = state["quota_bytes"] if state else None
        if quota is None:
            return free, total
        return min(free, max(0, quota - state["held_bytes"])), min(quota, total)

    # -- the quota -----------------------------------------------------------------------------

    @property
    def quota(self):
        """The tenant's quota on this device in bytes (node-wide; None: no quota)."""
        state = self._quota_state()
        return state["quota_bytes"] if state else None

    @property
    def warn(self):
        """The tenant's warn ratio (None: no warning)."""
        state = self._quota_state()
        return state["warn"] if state else None

    @property
    def held(self):
        """Bytes the tenant holds on this device, all its processes together (as booked: a killed
        process's share counts until a sweep, a refusal or mem_get_info() gives it back)."""
        state = self._quota_state()
        return state["held_bytes"] if state else 0

    def set_quota(self, quota, warn=_KEEP):
        """Changes the tenant's quota on this device, node-wide and at once: bytes, "8GiB", "25%",
        or None (no quota). warn: a new ratio, None to turn warnings off, or left out to keep it.
        A quota below what the tenant holds stops its growth and releases cached segments of this
        process's contexts of the tenant; live blocks are never freed."""
        spec = parse_quota(quota) if quota is not None else None
        warn = self.warn if warn is _KEEP else parse_warn(warn)
        quota_bytes = spec.resolve(self.device_total_bytes) if spec is not None else None
        hook = self.quota_hook
        if hook is None or self.closed:  # closed (by another thread, perhaps): a closed pool's error
            raise PoolError(f"tenant context {self.tenant!r} on device {self.device} is closed")
        hook.set_quota(self, quota_bytes, warn)
        self.quota_spec = spec
        self._say_if_nothing_fits(quota_bytes)
        trim_tenant(self.tenant, self.device, self.ledger)

    def _trim_over_quota(self):
        """Releases cached segments while the tenant is over its quota. Returns bytes released."""
        state = self._quota_state()
        if self.closed or not state or state["quota_bytes"] is None:
            return 0
        excess = state["held_bytes"] - state["quota_bytes"]
        if excess <= 0:
            return 0
        reserved = self._raw_stats()["reserved_bytes.all.current"]
        return self._trim_to(max(0, reserved - excess))

    def _quota_warn(self):
        # Called by malloc (outside the pool lock) when this context's growth crossed the level.
        self.warn_events += 1
        state = self._quota_state() or {}
        quota, held, warn = state.get("quota_bytes"), state.get("held_bytes", 0), state.get("warn")
        if quota is not None and warn is not None:
            log.warning("tenant %r on device %d holds %s node-wide, past its warn level %.0f%% of its quota %s",
                        self.tenant, self.device, format_bytes(held), warn * 100, format_bytes(quota))

    # -- stats ---------------------------------------------------------------------------------

    def memory_stats(self):
        """Pool.memory_stats() plus the quota (bytes; 0 means no quota): quota_bytes,
        quota_held_bytes (the tenant, node-wide), quota_context_bytes (booked by this context),
        quota_peak_bytes, quota_warn (ratio; 0.0: none), quota_refusals (node-wide),
        quota_uncertain_bytes (see the ledger notes), quota_warn_events (this context)."""
        return self._with_quota(super().memory_stats())

    def lifetime_stats(self, wait_ms=-1):
        """Pool.lifetime_stats() plus the quota figures of memory_stats()."""
        return self._with_quota(super().lifetime_stats(wait_ms))

    def _with_quota(self, out):
        return with_quota(out, self._quota_state() or {}, self.warn_events)

    def memory_summary(self, abbreviated=False):
        """Pool.memory_summary(abbreviated) with the tenant's quota line."""
        state = self._quota_state() or {}
        q = state.get("quota_bytes")
        line = (f"tenant {self.tenant}: quota {'none' if q is None else format_bytes(q)}, held "
                f"{format_bytes(state.get('held_bytes', 0))} node-wide ({format_bytes(state.get('slot_bytes', 0))} by "
                f"this context), peak {format_bytes(state.get('peak_bytes', 0))}, {state.get('refusals', 0)} refusals")
        return super().memory_summary(abbreviated) + "\n" + line

    # -- current context -------------------------------------------------------------------------

    # Makes this context current for the calling thread (module-level ascend_pool.malloc and the
    # C ABI on its device allocate from it), and undoes it; nests, asyncio tasks' blocks may exit
    # in any order. Compiled (cython/core/current.pxi): a Ctrl-C never lands between the push and
    # its record, which left the context current on the thread for good.
    __enter__ = context_enter
    __exit__ = context_exit

    def _check_open(self):
        if self.closed:
            raise PoolError(f"tenant context {self.tenant!r} on device {self.device} is closed")

    def __repr__(self):
        if self.closed:
            return f"<ascend_pool.Context {self.tenant!r} closed>"
        q = self.quota
        return (f"<ascend_pool.Context {self.tenant!r} device={self.device} backend={self.backend.name!r} "
                f"quota={'none' if q is None else format_bytes(q)} held={format_bytes(self.held)}>")




def make_context(pool, name, quota=None, warn=None):
    """A Context of tenant `name` on pool's backend and device, with pool's knobs (what
    Pool.context calls)."""
    if pool.closed:
        raise ConfigError(f"cannot create tenant context {name!r}: the pool is closed")
    ctx = Context(name, pool.device, pool.backend, quota=quota, warn=warn, **pool.knobs)
    # One allocator to its user: out of device memory, the context takes the pool's idle cache
    # (and the pool the context's) even when the pool keeps it from other pools (a MemPool).
    ctx._set_mempool(False, False, False, pool.serial)  # a context is no MemPool: keeps_idle, lends, no_split off
    return ctx


set_context_factory(make_context)


def live_contexts(tenant=None, device=None):
    """This process's open contexts (of one tenant and/or device when given); not one another
    thread is still opening (registered, its ledger not yet attached)."""
    return [p for p in _registry.live_pools() if isinstance(p, Context) and not p.closed and not _registry.is_orphan(p)
            and p.quota_hook is not None
            and (tenant is None or p.tenant == tenant) and (device is None or p.device == device)]


def trim_tenant(tenant, device, ledger=None):
    """Releases cached segments of this process's contexts of tenant on device while the tenant
    is over its quota (after a quota was lowered). Returns the bytes released."""
    released = 0
    for ctx in live_contexts(tenant, device):
        if ledger is None or ctx.ledger is ledger:
            try:
                released += ctx._trim_over_quota()
            except PoolError:
                if not ctx.closed:
                    raise
                # closed by another thread since the listing (a request ending): nothing to trim
    return released

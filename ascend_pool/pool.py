"""ascend_pool.Pool: the caching pool of one device, with PyTorch-style stats and snapshots."""

import itertools
import logging
import sys
import types
import warnings
from collections import OrderedDict

import numpy as np

from . import current as _current
from . import registry as _registry
from . import settings as _settings
from . import snapshot as _snapshot
from . import stats as _stats
from ._core import PoolBase, forked_from, unopened_raw_stats
from .backend import check_device, device_index, open_backend
from .config import _is_bool, allocator_settings, conf_source, flag_argument, effective_knobs, knobs_to_config, runtime_state
from .errors import ConfigError, ConfigTypeError, PoolError
from .snapshot_trace import NoAllocations, arrays_from_snapshot
from .traces import output_npz_path, trace_from_arrays
from .units import as_index

log = logging.getLogger("ascend_pool")

# Pool ids in torch's MempoolId_t form: (0, 0) is a device's default pool (ascend_pool.api sets
# it), every other pool of the process gets (0, n), n from 1 up, as torch's user MemPools.
_pool_numbers = itertools.count(1)
DEFAULT_POOL_ID = (0, 0)

# The layers above plug in here at their import (the facade imports them, so a user always has
# them; this layer cannot import them): tenants.context makes pool.context()'s Context, and
# ascend_pool.sharing serves pool.share_*, adds the shared_* stats and settles exports at close.
_context_factory = None
_sharing = None


def set_context_factory(fn):
    """Registers fn(pool, name, quota=None, warn=None) -> Context, what Pool.context calls."""
    global _context_factory
    _context_factory = fn


def set_sharing(share_malloc, share, share_free, pool_stats, before_close):
    """Registers the sharing calls (ascend_pool.sharing's functions of the same names; before_close
    runs first in Pool.close)."""
    global _sharing
    _sharing = types.SimpleNamespace(share_malloc=share_malloc, share=share, share_free=share_free,
                                     pool_stats=pool_stats, before_close=before_close)


def _plugin(hook, module):
    if hook is None:
        raise PoolError(f"{module} is not loaded: import ascend_pool (the package) rather than ascend_pool.pool alone")
    return hook


def _wait_ms(wait_ms):
    """wait_ms as the C int the lock wait takes: negative (any) waits forever; not an integer, or
    2**31 ms and more, is a ConfigError naming it (before: Cython's bare TypeError/OverflowError)."""
    n = as_index(wait_ms)
    if n is None:
        raise ConfigTypeError(f"wait_ms: expected an integer number of milliseconds, got {wait_ms!r}")
    if n >= 2**31:
        raise ConfigError(f"wait_ms: must be below 2**31 ms, or negative (wait forever), got {n}")
    return max(n, -1)


def unopened_stats():
    """memory_stats() of a pool of this process's knobs that was never opened, without opening
    one (a device reference; on an NPU a context): every key an empty open pool reports, each 0,
    but max_split_size (the knobs', as that pool's); device_free_bytes and device_total_bytes
    are 0 too, a device query (mem_get_info) being what opens a device. As torch's memory_stats
    reads a device its allocator never served: zeros, no context made."""
    knobs = effective_knobs(None)
    out = _stats.with_derived(unopened_raw_stats(allocator_settings(knobs)["max_split_size"]))
    if _sharing is not None:
        out.update(_sharing.pool_stats(object()))  # a pool no export or import is of: its zeros
    return OrderedDict(sorted(out.items()))


class Pool(PoolBase):
    """Caching allocator for one device.

    Pool(device=0, backend=None, **knobs): backend is "acl", "sim", "cuda" or None (chosen by
    $ASCEND_POOL_BACKEND, else acl where an NPU answers, else sim). Knobs (see ascend_pool.config)
    come from $ASCEND_POOL_CONF, overridden by keyword arguments.

    pool.malloc(nbytes, stream=None) -> int address; pool.free(ptr, stream=None);
    pool.record_stream(ptr, stream); pool.empty_cache(); pool.memory_stats();
    pool.memory_summary(); pool.snapshot(); pool.create_stream(); pool.synchronize(stream).

    torch's MemPool arguments (keyword only, bools): use_on_oom=True lets the device's default
    pool, when the device or the memory fraction refuses it, take a free block of this pool in
    place (the block stays this pool's: pool.free, ap.free and the C ABI's free give it back here),
    and another pool that runs out of memory this pool's idle cache (without it, a pool other than
    the default keeps its cached segments, as torch's MemPool keeps its free blocks); no_split=True
    gives each allocation its block whole (a fresh segment's every byte), never split.
    """

    def __init__(self, device=0, backend=None, *, use_on_oom=False, no_split=False, **knobs):
        for name, value in (("use_on_oom", use_on_oom), ("no_split", no_split)):
            if not _is_bool(value):  # torch's MemPool takes a bool
                raise ConfigTypeError(f"Pool: {name} must be True or False, got {value!r}")
        _registry.reap_orphans()  # pools dropped earlier whose blocks are free now: closed first
        be = backend if hasattr(backend, "device_count") else open_backend(backend)
        device = device_index(device)
        check_device(be, device)
        free_b, total_b = be.mem_info(device)
        self.__dict__.setdefault("tenant", "default")  # tenant contexts (pool.context) carry their own name
        # The node's number of the device (the same NPU has the same one in every container):
        # what quota ledgers, stats files, `ascend-pool ps` and the metrics' device label use.
        self.node_device = be.physical_device(device)
        self.serial = next(_pool_numbers)  # never reused in this process (metrics key pools by it)
        self.pool_id = (0, self.serial)
        # An ap.set_allocator_settings on another thread between the knobs' read and the
        # registration neither saw this pool nor reached it: opened again with the new settings,
        # the second time under the settings' lock (a settings loop cannot keep it out).
        if not self._open_with_settings(be, device, knobs, free_b, total_b):
            PoolBase.close(self)
            with _settings.lock:
                self._open_with_settings(be, device, knobs, free_b, total_b)
        self._use_on_oom = bool(use_on_oom)
        if self._under_device_fraction:
            self._join_device_cap()
            # family: its tenant contexts may take its idle cache (make_context)
            self._set_mempool(not use_on_oom, bool(use_on_oom), bool(no_split), self.serial)
        elif use_on_oom or no_split:
            PoolBase.close(self)
            raise ConfigError("use_on_oom and no_split are torch's MemPool arguments, for an ascend_pool.Pool: "
                              "a tenant context is no MemPool")

    # torch's memory fraction caps the device's allocator, MemPools included: a plain pool's
    # device memory counts under the fraction of its device's default pool (the cap's owner,
    # api._create_default). A tenant context keeps its own caps (quota, its own fraction).
    _under_device_fraction = True

    def _open_with_settings(self, be, device, knobs, free_b, total_b):
        seen = runtime_state()
        self.knobs = effective_knobs(knobs)
        kind = "acl" if be.kind == "acl" else "cuda"
        try:
            cfg = knobs_to_config(self.knobs, total_b, free_b, kind)
        except ConfigError as e:
            try:  # the variable's knobs alone: is the mistake there? Then say so, with its value
                knobs_to_config(effective_knobs(None), total_b, free_b, kind)
            except ConfigError:
                raise ConfigError("%s=%r: %s" % (*conf_source(), e)) from None
            raise
        self._open(be, device, cfg, self._describe())
        return _settings.register_opened(self, seen)

    def __del__(self, _registry=_registry, sys=sys, forked_from=forked_from):
        # (module globals bound at definition: at interpreter exit they may be None already)
        # The last reference is gone while blocks of the pool may still be allocated: a tensor a
        # framework made through the C ABI inside `with pool.context(...)`, a pointer the program
        # kept. Closing now would hand their memory out again under them; torch's MemPool outlives
        # its tensors. So the pool stays open and registered (frees through ap.free and the C ABI
        # find it) and is closed once they are freed (registry.reap_orphans).
        try:
            if self.closed or forked_from() or sys.is_finalizing():
                return
            # active: allocated, or freed after record_stream and still waited for (a kernel
            # queued on another stream may write it: the dealloc would wait, then give it back)
            # kept first, before any call that releases the GIL: a collected cycle's weak
            # references are gone already, and other threads must still find it meanwhile
            _registry.keep_orphan(self)
            if getattr(self, "_use_on_oom", False):
                self._stop_lending()  # no block lent between the count below and the close
            if self._raw_stats()["active.all.current"] or self._work_queued():
                self._release_idle()  # its idle cache: nothing allocates from an orphan again
                self._mark_orphan()   # and what its blocks leave idle later, once a quota needs it
            else:
                # The dealloc closes it without close(): its counters since the last scrape (a
                # per-request tenant context's allocations and quota refusals) go to the exported
                # totals now, while it is still readable and among the live pools (as an orphan).
                _registry.closing(self)
                _registry.forget_orphan(self)
                # Closed now, not by the dealloc: another finalizer of a collected cycle may
                # resurrect the pool, and no finalizer runs a second time, so the dealloc would
                # close it later under what it allocated since.
                self._close_as_dropped()
        except Exception:  # never raise from a finalizer; the dealloc then closes it as before
            _registry.forget_orphan(self)

    def _describe(self):
        """What the C ABI's messages call this pool."""
        return "pool"

    def _lending_peer(self, ptr):
        # torch's use_on_oom: the default pool's request the device refused took a free block of
        # a use_on_oom MemPool in place; the block is that pool's, freed there
        for _ in range(2):  # a lender closed meanwhile left its open pool to an orphan listed since
            closed = False
            for other in _registry.device_peers(self):
                if other.__dict__.get("_use_on_oom") and other is not self:
                    try:
                        info = other.block_info(ptr)
                    except PoolError:  # closed meanwhile
                        closed = True
                        continue
                    if info is not None and info[0] == ptr:
                        return other
            if not closed:
                break
        return None

    def _stream_used_elsewhere(self, handle):
        # A stream another open pool uses: one it adopted from this pool (a tenant context on the
        # default pool's stream), or a new stream the runtime gave the handle of ours after the
        # framework destroyed ours behind our back (another pool's create_stream, or a framework
        # stream registered there or used through the C ABI). Closing this pool destroyed it.
        for other in _registry.live_pools():
            if other is self or other.backend is not self.backend:
                continue
            try:
                if other._knows_stream(handle) or other._orders_on(handle):
                    return True
            except PoolError:  # closed meanwhile
                continue
        return False

    def _adopt_stream(self, stream):
        # A stream another open pool of this device and backend made or registered (its tenant
        # contexts', the default pool's) serves here too, as the C ABI lets it: the runtime's
        # streams belong to the device, not to a pool. Registered here on first use.
        if type(stream) is not int:
            return False
        if any(other._knows_stream(stream) for other in _registry.device_peers(self)):
            self.register_stream(stream)
            return True
        return False

    def _another_devices_stream(self, stream):
        # A peer device's stream that one of its open pools made or registered: record_stream
        # orders this block's reuse after it (an event of that device), as torch's record_stream.
        return any(other.device != self.device and other._knows_stream(stream) for other in _registry.live_pools())

    @property
    def id(self):
        """torch's MemPool.id: pool_id, the (0, n) memory_snapshot(mempool_id) and
        reserved_bytes_by_private_pools name this pool by ((0, 0) for a default pool)."""
        return self.pool_id

    def use_count(self):
        """torch's MemPool.use_count(): 1 for the pool object, plus 1 for each ap.use_mem_pool
        (or `with ctx:`) block of it in force on any thread."""
        return 1 + _current.uses(self)

    def context(self, name, quota=None, warn=None):
        """A tenant context on this pool's device: its own segments and a soft quota (bytes, "8GiB"
        or "25%" of the device). `with ctx:` makes it current for this thread."""
        return _plugin(_context_factory, "ascend_pool.tenants")(self, name, quota=quota, warn=warn)

    def memory_stats(self):
        """Counters in PyTorch's memory_stats() schema ("allocated_bytes.all.current", ...) plus
        fragmentation and stream-order figures and the shared_* figures of ascend_pool.sharing;
        exact at the moment of the call (bytes)."""
        out = _stats.minus_baseline(Pool.lifetime_stats(self), self.__dict__.get("_acc_base"))
        return OrderedDict(sorted(out.items()))  # torch's memory_stats: an OrderedDict sorted by key

    def counters(self):
        """The C pool's own counters as memory_stats() gives them (less reset_accumulated_stats'
        base; bytes and counts), without the derived figures and sharing's: cheap enough for a
        device-level read of every pool (api.device_stats)."""
        return _stats.minus_baseline(self._raw_stats(), self.__dict__.get("_acc_base"))

    def lifetime_stats(self, wait_ms=-1):
        """memory_stats() as if reset_accumulated_stats() had never been called: counters that
        only grow over the pool's life (what the metrics export; a Prometheus counter must never
        go down). A plain dict. wait_ms >= 0: TimeoutError past that wait for the pool's lock."""
        out = _stats.with_derived(self._raw_stats(_wait_ms(wait_ms)))
        if _sharing is not None:
            out.update(_sharing.pool_stats(self))
        return out

    # -- CuPy's MemoryPool names, so that code (and tests) written for cupy.cuda.MemoryPool port --

    def used_bytes(self):
        """Bytes allocated to callers (rounded block sizes), as cupy's MemoryPool.used_bytes()."""
        return self.memory_stats()["allocated_bytes.all.current"]

    def total_bytes(self):
        """Bytes held from the device, as cupy's MemoryPool.total_bytes()."""
        return self.memory_stats()["reserved_bytes.all.current"]

    def free_bytes(self):
        """Bytes held but not allocated (cached, or waiting for a stream before reuse), as cupy's
        MemoryPool.free_bytes()."""
        s = self.memory_stats()
        return s["reserved_bytes.all.current"] - s["allocated_bytes.all.current"]

    def free_all_blocks(self, stream=None):
        """Returns cached segments to the device, as cupy's MemoryPool.free_all_blocks(): with
        `stream` None every stream's (empty_cache()); else (a live stream of this pool or 0, else
        InvalidStreamError; or CuPy's Stream object, whose handle is its .ptr, as CuPy's takes:
        cupy.cuda.Stream.null is 0) only those that allocations on that stream created, after its
        work is done (empty_stream_cache)."""
        ptr = getattr(stream, "ptr", None) if stream is not None and not isinstance(stream, int) else None
        if isinstance(ptr, int) and not isinstance(ptr, bool):
            stream = ptr
        self._check_stream(stream)
        if stream is None:
            self.empty_cache()
        else:
            self.empty_stream_cache(stream)

    def free_all_free(self):
        """CuPy's deprecated MemoryPool.free_all_free(): free_all_blocks(), with a
        DeprecationWarning as CuPy's (code and CuPy's own tests still call it)."""
        warnings.warn("free_all_free is deprecated (as in CuPy); use free_all_blocks", DeprecationWarning, stacklevel=2)
        self.free_all_blocks()

    def reset_accumulated_stats(self):
        """Zeroes the accumulated counters, as torch.npu.reset_accumulated_memory_stats():
        every stat's allocated and freed, and num_alloc_retries, num_ooms, num_sync_all_streams,
        num_device_alloc/free ... (current and peak values stay)."""
        # One assignment, from the lifetime counters: memory_stats() on another thread (the GIL
        # is let go in the C stats call) sees the old baseline or the new one, never none, and
        # two resets at once cannot subtract one baseline from the other.
        self._acc_base = _stats.baseline(self.lifetime_stats())

    def mem_get_info(self):
        """(free, total) bytes of this pool's device, as torch.npu.mem_get_info(): the device's
        own figures (memory this pool caches counts as used). PoolError once the pool is closed,
        as its every other call (the device's figures were answered, a context's refused)."""
        if self.closed:
            raise PoolError("this pool is closed")
        return self.backend.mem_info(self.device)

    # -- sharing with other processes (ascend_pool.sharing) --------------------------------------

    def share_malloc(self, nbytes):
        """A block of nbytes in a segment of its own, for share(); returns its address (int)."""
        return _plugin(_sharing, "ascend_pool.sharing").share_malloc(self, nbytes)

    def share(self, ptr, read_only=False, pids=(), any_process=False):
        """Exports the share_malloc'ed block at ptr to other processes; returns a SharedHandle."""
        return _plugin(_sharing, "ascend_pool.sharing").share(self, ptr, read_only=read_only, pids=pids, any_process=any_process)

    def share_free(self, ptr):
        """Gives back a share_malloc'ed block: True if freed now, False if deferred until its
        importers close."""
        return _plugin(_sharing, "ascend_pool.sharing").share_free(self, ptr)

    def close(self):
        """Returns all device memory of this pool and closes it (shared blocks still imported by
        other processes are handed to ascend_pool.sharing, which frees them once they close).
        A use_on_oom pool's blocks it lent the default pool's requests stay valid until their
        callers free them (ap.free, the C ABI, the default pool's free), as torch's MemPool
        outlives them; the rest of its memory goes back now."""
        lent = 0
        if not self.closed and not forked_from() and self.__dict__.get("_use_on_oom"):
            try:
                lent = self._stop_lending()[0]  # no block lent from here on
            except PoolError:
                if not self.closed:
                    raise  # (closed by another thread meanwhile: this close has nothing to do)
        if not self.closed and not forked_from() and not lent:
            _registry.closing(self)  # its last counters, for the exported totals
        if _sharing is not None and not forked_from():  # in a forked child the exports are the parent's
            _sharing.before_close(self)
        if not self.closed and not forked_from() and not lent:
            self._say_live_blocks()  # after the shared blocks left its accounting
        if lent:
            self._close_keeping_lent()
        else:
            super().close()

    def _close_keeping_lent(self):
        # The callers of ap.malloc that got a lent block never allocated from this pool: its
        # memory handed out again under them, their free an InvalidPointerError. The C pool goes
        # on under another object, an orphan (registry.py) reaped once the lent blocks are freed
        # (its closing counters then), as a pool dropped with blocks allocated; this one closes.
        self._destroy_own_streams()
        heir = type(self).__new__(type(self))
        heir.__dict__.update(self.__dict__)
        if not self._hand_over(heir, _registry._orphans):  # (keep_orphan's list)
            return  # another thread's close() finished it
        try:
            heir._mark_orphan()   # lends nothing, and gives back what its blocks leave idle
            # what this pool's own user left allocated goes, as any close gives it back (said so)
            self._say_live_blocks(*heir._free_unlent())
            heir._release_idle()
        except PoolError:
            if not heir.closed:
                raise
            return  # its last lent block was freed meanwhile, and its reap closed it (said so)
        _registry.reap_orphans()  # a lent block freed meanwhile

    def _lent_freed(self, lender):
        # a lent block came back (PoolBase.free): a closed lender's orphan may have no block left
        if _registry.is_orphan(lender):
            _registry.reap_orphans()

    def _say_live_blocks(self, n=None, nbytes=None):
        """A close gives back the memory of blocks still allocated: any kernel or tensor that still
        uses one then reads memory the next pool or process gets (a torch MemPool stays alive
        while its blocks do). Legal (a framework may close after its last kernel without freeing
        each tensor), so said in the log, once, with what is lost."""
        if n is None:  # (given: what a close that keeps the blocks it lent gave back)
            try:
                st = self._raw_stats()  # the pool's own counters: no ledger or sharing read at close
            except PoolError:  # another thread's close of it finished meanwhile: nothing to say
                return
            n, nbytes = st["allocation.all.current"], st["allocated_bytes.all.current"]
        if n:
            log.warning("%s on device %d closed with %d block(s) still allocated (%d bytes): their memory goes back to the "
                        "device now, and whatever still uses them reads memory handed out again; free them (or "
                        "synchronize and drop the tensors) before close()", self._describe(), self.device, n,
                        nbytes)

    def memory_summary(self, abbreviated=False):
        """A readable table of the stats, like torch.cuda.memory_summary(); abbreviated: without
        the per-pool (small/large) rows."""
        abbreviated = flag_argument("memory_summary", "abbreviated", abbreviated)  # "no" was true
        return _stats.summary(self.memory_stats(), self.device, self.backend.name, abbreviated=abbreviated)

    def snapshot(self, include_traces=True):
        """The pool's segments, blocks and event history in PyTorch's snapshot schema (readable by
        `python -m torch.cuda._memory_viz`); only the latest event after record_memory_history("state"), as torch's.
        include_traces=False (torch's MemPool.snapshot): every device's trace empty, the segments alone."""
        include_traces = flag_argument("snapshot", "include_traces", include_traces)
        snap = self._snapshot()
        if not include_traces:
            snap["device_traces"] = [[] for _ in snap["device_traces"]]
        return snap

    def _snapshot(self):
        segments, history = self._raw_snapshot()
        frames = dict(self._stack_frames) if self._stack_frames is not None else None
        return _snapshot.build(self.device, segments, history, self.knobs, frames, entry_frames=self._entry_frames,
                               pool_id=self.pool_id)

    def allocation_traceback(self, ptr):
        """The frames (torch's [{"filename", "line", "name"}], innermost first) of the allocation of
        the live block starting at ptr, as torch's _allocation_traceback: None where no live block
        of this pool starts there (an address inside one is a view's: None, as torch's) or no
        frames were recorded for it (record_memory_history without stacks or context)."""
        # ptr checked first, whether frames were recorded or not: allocation_traceback("x") was
        # None before any record_memory_history() and an InvalidPointerError after it
        ctx = self._block_ctx(ptr)  # not a snapshot: that records one in the history at each call
        frames = self._stack_frames
        found = frames.get(ctx) if ctx and frames is not None else None
        return [dict(f) for f in found] if found else None

    def dump_trace(self, path):
        """Writes the recorded history (record_memory_history or the record_history knob) as a
        replayable trace NAME.npz (ascend_pool.traces format): allocations with their requested
        sizes and the frees of them, streams numbered in order of appearance. Returns the Trace.
        A pool that recorded no allocation is a PoolError that says how to record one (an empty
        trace replays nothing and would hide the mistake)."""
        _snapshot.output_path(path, "dump_trace")
        try:
            a = arrays_from_snapshot(self._snapshot(), self.device, "pool history")
        except NoAllocations:
            a = None
        if a is None or not len(a["op"]):
            raise PoolError(f"dump_trace({str(path)!r}): the pool recorded no allocation to write: turn its history "
                            "on first (pool.record_memory_history(True) or the record_history knob), then run the "
                            "work to record")
        trace = trace_from_arrays(a["op"], a["id"], a["size"], a["stream"], name="pool history")
        np.savez(output_npz_path(path, "dump_trace"), **a)
        return trace

    def dump_snapshot(self, path):
        """Writes snapshot() as the pickle torch.cuda._memory_viz reads (PyTorch's _dump_snapshot)."""
        _snapshot.dump(self.snapshot(), path)

    def __repr__(self):
        state = "closed" if self.closed else f"device={self.device}, backend={self.backend.name!r}"
        return f"<ascend_pool.Pool {state}>"

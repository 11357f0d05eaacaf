"""Module-level functions on a default pool per device (like torch.npu.memory's functions).

The current device is per thread (set_device); each device's default pool is created on first
use with the knobs of $ASCEND_POOL_CONF and the backend of $ASCEND_POOL_BACKEND.
"""

import numbers
from collections import OrderedDict
import os
import re
import threading
import warnings

from . import current as _current
from . import registry as _registry
from . import stats as _stats
from ._core import MemPoolUse, attach_out_of_memory_observer, capi_free, detach_out_of_memory_observer, set_default_pool_hook
from .backend import BACKEND_ENV, backend_opened, check_device, device_index, open_backend, torch_device_index
from .config import effective_knobs, flag_argument, history_settings, history_skip_mask, knobs_fraction
from .errors import (ConfigError, ConfigTypeError, InvalidDeviceError, InvalidPointerError, InvalidStreamError, PoolError,
                     StreamTypeError)
from .pool import DEFAULT_POOL_ID, Pool, unopened_stats
from .snapshot import build as _build_snapshot, dump as _dump_snapshot, merge as _merge_snapshots
from .snapshot import get_memory_metadata, set_memory_metadata  # torch's _set/_get_memory_metadata
from .tenants.config import operator_quota, process_tenant
from .tenants.context import Context, with_quota
from .tenants.default import default_tenant_pool
from .units import as_index

_lock = threading.RLock()  # held while a default pool is made (runtime calls: long); re-entrant: a
# signal handler (SIGTERM: empty_cache, a snapshot) may call in while its thread holds it
_local = threading.local()


def _after_fork_in_child():
    # A thread making a default pool at the fork leaves the child's copy locked for good: every
    # module-level call there would hang instead of raising BackendUnavailableError.
    global _lock
    _lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def set_device(device):
    """Makes device the current device of the calling thread for module-level calls: an int (a
    numpy integer too) or torch's forms with an index ("npu:1", "cuda:1", a torch.device), as
    torch.npu.set_device takes. A device the backend does not have raises InvalidDeviceError
    here, as torch's set_device does, not at the next call (the backend is opened for its device
    count)."""
    index = device_index(device)
    if index < 0:
        raise InvalidDeviceError(f"device must be a non-negative index, got {device!r}")
    check_device(open_backend(), index)
    _local.device = index


def current_device():
    """The calling thread's current device (default 0)."""
    return getattr(_local, "device", 0)


def explicit_device():
    """The calling thread's current device if it called set_device, else None."""
    return getattr(_local, "device", None)


def default_pool(device=None):
    """The pool module-level calls use for device (None: the current device; torch's forms too,
    torch_device_index): the thread's current context if one was made current, else the process
    default, created on first use."""
    device = torch_device_index(device)
    device = current_device() if device is None else device
    pool = _current.top(device)
    if pool is not None:
        return pool
    return process_default_pool(device)


def process_default_pool(device):
    """The process's default pool of device (an int), whatever context the thread has made
    current: created on first use."""
    pool = _registry.default_pool(device)
    if pool is None:  # a closed default is replaced, for Python and the C ABI alike
        with _lock:
            pool = _registry.default_pool(device)
            if pool is None:
                pool = _create_default(device)
                made = _registry.default_pool(device)
                if made is not None:  # a signal handler made one meanwhile, inside this thread's lock
                    pool.close()
                    return made
                _registry.set_default_pool(device, pool)
    return pool


def open_pool(device=None):
    """The pool module-level calls use for device if it is open already, else None: never
    creates one (and so never opens the runtime)."""
    device = torch_device_index(device)
    device = current_device() if device is None else device
    return _current.top(device) or _registry.default_pool(device)


def _create_default(device):
    # With $ASCEND_POOL_TENANT set, the default pool is that tenant's context (its quota from
    # $ASCEND_POOL_CONFIG), so module-level calls and the C ABI allocate under the quota.
    pool = default_tenant_pool(device) or Pool(device)
    pool.pool_id = DEFAULT_POOL_ID  # torch's default pool id: segments of other pools carry theirs
    if pool._under_device_fraction:
        pool._join_device_cap(owner=True)  # its memory fraction caps the device's MemPools too
    if _history is not None:
        pool.record_memory_history(**_history)
    return pool


def _default_pool_for_c_abi(device):
    """The C ABI's hook (capi/capi.pxi): (backend, the process's default pool of device), the pool
    None when the backend has no such device. The process's, not the calling thread's context or
    MemPool: the C ABI looks that up itself, and ascend_pool_init made no default from inside one."""
    backend = open_backend()
    if not 0 <= device < backend.device_count:
        return backend, None
    return backend, process_default_pool(device)


set_default_pool_hook(_default_pool_for_c_abi)


def malloc(nbytes, stream=None, device=None):
    """Allocates nbytes on the default pool of device; returns the address (int)."""
    return default_pool(device).malloc(nbytes, stream)


def free(ptr, stream=None, device=None):
    """Frees ptr (from malloc) on the default pool of device, or the thread's current context;
    a block another open pool of the device made (allocated under another context) is freed by
    that pool, as the C ABI's free finds its owner. With no device given, a block of another
    device is freed by its own pool (the current device changed since the allocation; HAMi
    charges such a free to the block's device too), and the current device's pool is not opened
    to look (a device reference, a context on a device the thread may never use).
    InvalidPointerError when no pool has it."""
    if device is None and open_pool() is None and _free_in_owner(ptr, stream):
        return
    pool = default_pool(device)
    try:
        pool.free(ptr, stream)
    except (InvalidPointerError, InvalidStreamError) as refused:
        if isinstance(refused, InvalidStreamError) and (device is not None or pool.block_info(ptr) is not None):
            raise  # its own block and a stream it cannot order on, or a device named by the caller
        # not its block (a stream of another device is refused before the block is looked up)
        others = list(_registry.device_peers(pool))
        if device is None:
            others += [p for p in _registry.live_pools() if p.device != pool.device]
        for other in others:
            try:
                if other.block_info(ptr) is None:
                    continue  # not its block
                other.free(ptr, stream)
                _registry.reap_orphans()  # perhaps a dropped pool's last block
                return
            except InvalidPointerError:
                continue  # freed by another thread meanwhile
            except PoolError:
                if not other.closed:
                    raise
                # closed by another thread since the listing: it held no live block of ours
        if stream is None and _free_through_c_abi(ptr, pool.device):
            return
        raise


def _free_in_owner(ptr, stream):
    """Frees ptr in the open pool that has its live block, True; False when none has it (the
    caller's usual path then says why, as it does for what is not an address)."""
    address = as_index(ptr)
    if address is None or not 0 < address < 1 << 64:
        return False
    for other in _registry.live_pools():
        try:
            if other.block_info(address) is None:
                continue
            other.free(address, stream)
        except InvalidPointerError:
            continue  # freed by another thread meanwhile
        except PoolError:
            if not other.closed:
                raise
            continue  # closed by another thread since the listing: it held no live block of ours
        _registry.reap_orphans()  # perhaps a dropped pool's last block
        return True
    return False


def _free_through_c_abi(ptr, device):
    """Frees ptr on its allocation stream through the C ABI's owner lookup (its registry holds
    every open pool, by address), True when a pool had it: a pool the cycle collector is keeping
    as an orphan (Pool.__del__) is out of the live pools for a moment, its weak references cleared
    first. Only for a free without a stream (the C ABI frees on the allocation stream where the
    given one cannot be used, which Pool.free refuses), and only on the way to an
    InvalidPointerError: a cost on the error path alone."""
    address = as_index(ptr)
    if address is None or not 0 < address < 1 << 64:  # not an address: the caller's error stands
        return False
    try:
        capi_free(address, 0, device, None)
    except PoolError:
        return False
    _registry.reap_orphans()
    return True


def record_stream(ptr, stream, device=None):
    """Marks ptr as used by stream (see Pool.record_stream), on the default pool of device or
    the thread's current context; with no device given, a block of another open pool (another
    device's: the current device changed since the allocation, as for free) is marked by that
    pool, and the current device's pool is not opened to look."""
    _marking_pool(ptr, device).record_stream(ptr, stream)


def erase_stream(ptr, stream, device=None):
    """Undoes record_stream(ptr, stream), as torch_npu.erase_stream (see Pool.erase_stream); the
    block's pool is found as record_stream finds it."""
    _marking_pool(ptr, device).erase_stream(ptr, stream)


def _marking_pool(ptr, device):
    """The pool record_stream / erase_stream ask about ptr: with no device, the thread's open
    pool where it holds ptr, else the open pool that does; else default_pool(device), which
    says why ptr is none of its blocks."""
    if device is None:
        mine = open_pool()
        owner = mine if mine is not None and _has_block(mine, ptr) else _owner_of(ptr)
        if owner is not None:
            return owner
    return default_pool(device)


def _has_block(pool, ptr):
    address = as_index(ptr)
    try:
        return address is not None and 0 < address < 1 << 64 and pool.block_info(address) is not None
    except PoolError:
        if not pool.closed:
            raise
        return False  # closed by another thread meanwhile: its blocks went with it


def _owner_of(ptr):
    """The open pool with a live block at ptr, or None."""
    return next((p for p in _registry.live_pools() if _has_block(p, ptr)), None)


def create_stream(device=None):
    """Creates a device stream on device (None: the current device) through its default pool;
    returns its handle (int), which any pool of that device may order frees on. Give it back
    with destroy_stream(handle, device)."""
    return default_pool(device).create_stream()


def destroy_stream(stream, device=None):
    """Waits for stream (from create_stream), returns the default pool's blocks cached for it to
    all streams, and destroys it (Pool.destroy_stream). With no device, the stream's own (the
    device create_stream(device) made it on), else the current device."""
    _stream_pool(stream, device).destroy_stream(stream)


def synchronize(stream=None, device=None):
    """Waits (bounded by sync_timeout_ms) for the work queued on stream, as pool.synchronize(stream);
    with no device, a stream from create_stream(device) is waited for on its own device.
    With no stream, as torch.npu.synchronize(device) / torch.cuda.synchronize(device): all work of
    device (None: the current device, which this leaves unchanged), every stream the process has
    there (aclrtSynchronizeDevice), then every open pool of the device settles the frees the wait
    completed, so the next request reuses their blocks. DeviceTimeoutError past the limit."""
    if stream is not None:
        _stream_pool(stream, device).synchronize(stream)
        return
    # Before 2026-12-06 the default stream only: a block freed behind a side stream's work
    # (record_stream) stayed pending after it, and the next request took new device memory.
    pool = default_pool(device)
    pool.synchronize_device()
    for peer in _registry.device_peers(pool):  # tenant contexts, ap.Pool()s: the device is done
        try:
            peer.synchronize_device(device_wait=False)
        except PoolError:
            if not peer.closed:
                raise  # closed by another thread meanwhile: nothing of its own left to settle


def _stream_pool(stream, device):
    """default_pool(device); with no device, the pool of the device the backend knows stream is
    on (one it created: create_stream(device=5) from a thread whose current device is another),
    as a torch stream carries its device: the current device's pool refused it ("not a live
    stream of this pool (device 0)"), after being opened to say so."""
    handle = as_index(stream) if device is None and stream is not None else None
    if handle:
        try:
            on = open_backend().stream_device(handle)
        except (PoolError, OverflowError, TypeError, ValueError):
            on = None  # not a handle the backend can look up: the current device's pool says why
        if on is not None and on != current_device():
            return default_pool(on)
    return default_pool(device)


def context(name, quota=None, warn=None, device=None):
    """A tenant context on device (None: the current device), as pool.context(name, quota, warn)
    on the process's default pool: its own segments and a soft quota (bytes, "8GiB" or "25%").
    Made from the process default even inside another context's `with`: contexts do not nest."""
    device = torch_device_index(device)
    return process_default_pool(current_device() if device is None else device).context(name, quota=quota, warn=warn)


def use_mem_pool(pool, device=None):
    """torch.cuda.use_mem_pool(pool, device=None): within the block, the calling thread's
    allocations on the pool's device come from pool (an ap.Pool or a tenant context), for
    module-level calls (ap.malloc, caching_allocator_alloc) and the C ABI alike (a framework's
    tensors), as `with ctx:` does for a context. Only this thread's, as torch's: a thread started
    inside allocates from its own current pool. Blocks nest (the innermost wins, with `with ctx:`
    too) and may be left in any order (asyncio tasks); the pool's use_count() counts each block
    in force. device: None, or the pool's own device (a Pool serves one device; another one is
    an InvalidDeviceError). A pool closed inside the block is refused from then on, as a closed
    context is (the C ABI returns NULL saying so), never replaced by the default unawares.
    The block's entry and exit are compiled (_core.MemPoolUse): a Ctrl-C never leaves the pool
    current on the thread after the block, as a generator's could (18 in 300)."""
    def check():  # at the block's entry, as torch's
        if not isinstance(pool, Pool):
            raise ConfigTypeError(f"use_mem_pool: pool must be an ascend_pool.Pool or tenant context, got {pool!r}")
        if pool.closed:
            raise PoolError(f"use_mem_pool: {pool!r} is closed")
        index = torch_device_index(device)
        if index is not None and index != pool.device:
            raise InvalidDeviceError(f"use_mem_pool: the pool serves device {pool.device}, not device {index}")
    return MemPoolUse(pool, check)


def share_malloc(nbytes, device=None):
    """A block of nbytes in a segment of its own on the default pool of device, for share();
    returns its address (int)."""
    return default_pool(device).share_malloc(nbytes)


def share(ptr, read_only=False, pids=(), any_process=False, device=None):
    """Exports the share_malloc'ed block at ptr (default pool of device) to other processes;
    returns a SharedHandle for ap.open_shared in the importer."""
    return default_pool(device).share(ptr, read_only=read_only, pids=pids, any_process=any_process)


def share_free(ptr, device=None):
    """Gives back a share_malloc'ed block of the default pool of device: True if freed now,
    False if deferred until its importers close."""
    return default_pool(device).share_free(ptr)


def dump_trace(path, device=None):
    """Writes the default pool's recorded history (record_memory_history) as a replayable trace
    (.npz); returns the Trace (Pool.dump_trace)."""
    return default_pool(device).dump_trace(path)


def empty_cache(device=None):
    """Returns the default pool's unused segments to the device (and closes the pools dropped
    earlier whose blocks have all been freed since). With no device, as torch.cuda.empty_cache():
    the current device's pool (the thread's current context, if any) and every other device's
    open default pool; a device's pool that was never opened is not made for it, the current
    device's included (no device reference, no context on it). Inside
    use_mem_pool, as torch's: the pool in use keeps its cache (the pool underneath is emptied);
    pool.empty_cache() empties it."""
    _registry.reap_orphans(wait=True)
    index = torch_device_index(device)
    index = current_device() if index is None else index
    if device is None:
        # the current device's pool too only if open: made to be emptied, it took a device
        # reference (a context on an NPU the process never used: every rank of a job on NPU 0)
        mine = _current.cache_owner(index) or _registry.default_pool(index)
    else:
        mine = _current.cache_owner(index) or process_default_pool(index)
    if mine is not None:
        mine.empty_cache()
    if device is not None:
        return
    for pool in _registry.default_pools():
        if pool is mine:
            continue
        try:
            pool.empty_cache()
        except PoolError:
            if not pool.closed:  # closed by another thread meanwhile: nothing cached is left
                raise


def _read_pool(device):
    """(index, pool) for the calls that only read figures (or reset them) on device (None: the
    current device; torch's forms): the thread's current context, else the open default pool;
    pool None where none was ever opened, which they answer without opening it (a device
    reference, a context on an NPU: a loop over 8 devices took one on every NPU from every rank),
    as torch's read its allocator's per-device figures and initialise no device. A device the
    backend does not have is still an InvalidDeviceError. Not a pool made current by
    use_mem_pool: torch's device figures are the same inside such a block (the MemPool is one of
    the device's private pools there too), where its own figures alone read 0 for the default's."""
    index = torch_device_index(device)
    index = current_device() if index is None else index
    pool = _current.cache_owner(index) or _registry.default_pool(index)
    if pool is None:
        index = device_index(index)
        _check_device_if_opened(index)
    return index, pool


def _check_device_if_opened(index):
    """check_device(backend, index) where the process has opened its backend; with none opened
    (no pool anywhere), the index is not checked rather than the runtime opened for it (aclInit):
    a launcher that read memory_allocated() before forking its workers (multiprocessing's default
    start method on Linux) got every worker refused the device ("forked ... after that process
    had opened the device runtime"), where torch's readers initialise no device and answer zeros
    for any index before it is."""
    if backend_opened():
        check_device(open_backend(), index)


def _unopened_stats(index):
    """memory_stats() of device index's default pool never opened: an empty pool's keys, zeros
    (Pool's unopened_stats), with a tenant context's quota keys when the default would be one:
    quota_bytes and quota_warn the operator's tenants file sets for the tenant on the device,
    which its context would open with (the ledger lets the file's quota win), where it is known
    without the device (bytes, not a percentage of a total not read); else 0, as no quota."""
    stats = unopened_stats()
    tenant = process_tenant()
    if tenant is None:
        return stats
    found = operator_quota(tenant, index, None)  # None for a percentage: the device's total is not read
    return with_quota(stats, {"quota_bytes": found[0], "warn": found[1]} if found else {}, 0)


def _unopened_peers(index):
    """The open pools of device index on the backend a default pool of it would use (none where
    no backend was opened: not opened to say so)."""
    if not backend_opened():
        return []
    backend = open_backend()
    return [p for p in _registry.live_pools() if p.device == index and p.backend is backend]


def memory_stats(device=None):
    """The default pool's counters in PyTorch's schema (bytes), with torch's
    reserved_bytes_by_private_pools: device_stats(default_pool(device)); for a device whose pool
    was never opened, an empty pool's figures (zeros; _read_pool), the pool not opened."""
    index, pool = _read_pool(device)
    if pool is not None:
        return device_stats(pool)
    return _with_private_pools(_unopened_stats(index), _unopened_peers(index))


def memory_stats_as_nested_dict(device=None):
    """torch.cuda.memory_stats_as_nested_dict(): memory_stats(device) as nested dicts, split at
    the dots of its keys (stats["allocated_bytes"]["all"]["current"], bytes), which is the form
    torch's memory_stats flattens: device_nested_stats(default_pool(device)); nothing opened to
    read it, as memory_stats."""
    index, pool = _read_pool(device)
    if pool is not None:
        return device_nested_stats(pool)
    return _nested_with_private_pools(_unopened_stats(index), _unopened_peers(index))


_POOL_STAT = re.compile(r"reserved_bytes\.((?:all|small_pool|large_pool)\.(?:current|peak|allocated|freed))$")


def _private_pools_reserved(peers):
    """{pool_id: {"all.current": bytes, ...}}: the reserved_bytes figures of each pool of peers
    (the other open pools of a device: torch's private pools: a MemPool's id is (0, n) as a
    Pool's), as torch 2.x's reserved_bytes_by_private_pools; the device's default pools ((0, 0))
    are not private."""
    out = {}
    for other in peers:
        if tuple(other.pool_id) == DEFAULT_POOL_ID:
            continue
        try:
            # The counters alone (Pool.counters): not memory_stats(), which builds each pool's
            # whole schema (a context's reads its ledger too), some 70 us a pool.
            counters = other.counters()
        except PoolError:
            if not other.closed:
                raise
            continue  # closed by another thread meanwhile: no longer a pool of the device
        out[tuple(other.pool_id)] = {m.group(1): v for k, v in counters.items() if (m := _POOL_STAT.match(k))}
    return out


def device_stats(pool):
    """pool.memory_stats() and, as torch 2.x's device-level memory_stats, the other open pools of
    its device as "reserved_bytes_by_private_pools.A_B.{all,small_pool,large_pool}.{current,peak,
    allocated,freed}" (pool id (A, B), its reserved_bytes figures; the figures above are pool's
    own, those pools' are not in them)."""
    return _with_private_pools(pool.memory_stats(), _registry.device_peers(pool))


def _with_private_pools(stats, peers):
    private = _private_pools_reserved(peers)
    for (a, b), figures in private.items():
        stats.update((f"reserved_bytes_by_private_pools.{a}_{b}.{k}", v) for k, v in figures.items())
    # sorted by key as torch's memory_stats (it sorts after flattening); appended, they came last
    return OrderedDict(sorted(stats.items())) if private else stats


def device_nested_stats(pool):
    """device_stats(pool) nested as torch's memory_stats_as_nested_dict: reserved_bytes_by_private_pools
    always there (empty without other pools), keyed by pool-id tuples as torch's (memory_stats
    flattens (0, 1) to "0_1")."""
    return _nested_with_private_pools(pool.memory_stats(), _registry.device_peers(pool))


def _nested_with_private_pools(stats, peers):
    nested = nested_stats(stats)
    nested["reserved_bytes_by_private_pools"] = {
        pid: nested_stats(figures) for pid, figures in _private_pools_reserved(peers).items()}
    return nested


def nested_stats(stats):
    """A memory_stats() dict as nested dicts, split at the dots of its keys."""
    nested = {}
    for key, value in stats.items():
        *path, leaf = key.split(".")
        node = nested
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def memory_summary(device=None, abbreviated=False):
    """A readable summary of the default pool's counters, with torch.cuda.memory_summary's
    arguments (abbreviated: without the per-pool rows); a pool never opened is not opened for it
    (its zeros, as memory_stats)."""
    index, pool = _read_pool(device)
    if pool is not None:
        return pool.memory_summary(abbreviated)
    abbreviated = flag_argument("memory_summary", "abbreviated", abbreviated)
    name = open_backend().name if backend_opened() else (os.environ.get(BACKEND_ENV) or "no runtime opened")
    return _stats.summary(_unopened_stats(index), index, name, abbreviated=abbreviated)


def reset_peak_stats(device=None):
    """Resets the default pool's peak counters (nothing to reset, and nothing opened, for a pool
    never opened)."""
    pool = _read_pool(device)[1]
    if pool is not None:
        pool.reset_peak_stats()


def snapshot(device=None):
    """The default pool's snapshot in PyTorch's schema; for a pool never opened, an empty one
    (no segments, no trace), the pool not opened."""
    index, pool = _read_pool(device)
    if pool is not None:
        return pool.snapshot()
    return _build_snapshot(index, [], [], effective_knobs(None))


def reset_accumulated_memory_stats(device=None):
    """Zeroes the default pool's accumulated counters (allocated/freed totals, event counts);
    nothing for a pool never opened, which is not opened for it."""
    pool = _read_pool(device)[1]
    if pool is not None:
        pool.reset_accumulated_stats()


def reset_accumulated_stats(device=None):
    """pool.reset_accumulated_stats() on the default pool of device: the same as
    reset_accumulated_memory_stats(device)."""
    reset_accumulated_memory_stats(device)


def mem_get_info(device=None):
    """(free, total) bytes of the device, as torch.npu.mem_get_info()."""
    return default_pool(device).mem_get_info()


_history = None  # the last record_memory_history() settings: applied to default pools made later


def _process_pools(device=None, create=True):
    """The pools the process-wide history and snapshot cover, as torch's cover every allocation
    of the process: each device's default pool, every open tenant context and every other open
    pool of the process (an ap.Pool the program built; device given: that device's), each once.
    create: make the current device's default pool when no device has one yet."""
    device = torch_device_index(device)
    if device is not None:
        pools = [default_pool(device)] if create else []
    else:
        pools = _registry.default_pools() or ([default_pool()] if create else [])
    pools += [p for p in _registry.live_pools() if device is None or p.device == device]  # contexts too
    return list({id(p): p for p in pools}.values())


def _on_each_open(pools, call):
    """[call(pool) for each pool], skipping the pools another thread closes meanwhile (a tenant
    context's `with` block ending while the process-wide history or snapshot runs)."""
    out = []
    for pool in pools:
        try:
            out.append(call(pool))
        except PoolError:
            if not pool.closed:
                raise
    return out


def _follow_history(pool):
    # A pool opened after record_memory_history() (a tenant context, a program's own ap.Pool)
    # records as the default pools do; a stopped history leaves a program's own pool as its knobs
    # made it (record_history), as it leaves every pool the program opened before.
    if _history is not None and (isinstance(pool, Context) or _history["enabled"] not in (None, False)):
        pool.record_memory_history(**_history)


_registry.on_register(_follow_history)


_history_warned = set()  # torch-only settings warned about once


def record_memory_history(enabled=True, stacks="python", max_entries=100_000, device=None, context="all",
                          clear_history=False, *, compile_context=False, global_record_annotations=False,
                          skip_actions=None):
    """torch.cuda.memory._record_memory_history for the process: turns the event history (and
    with stacks="python" the Python frames of each allocation and free) on or off at runtime on
    every open pool of the process (default pools, tenant contexts, pools the program built;
    device given: that device's only); pools made later follow it. max_entries (events kept per pool) above
    config.MAX_HISTORY_ENTRIES (2**20: a ring of 48 MiB of host memory, allocated up front) is
    clamped to it by each pool, so PyTorch's sys.maxsize works; enabled="state" keeps the latest
    event only, as torch's. context as torch's (with stacks="python"): None records no frames,
    "state" shows them on live blocks only, "alloc" on the trace's allocation entries too (and
    on a free's, its block's), "all" also the frames of each free and of empty_cache (Pool.
    record_memory_history); clear_history: the events recorded so far are dropped first;
    skip_actions, as torch's: action names ("free_requested", "segment_alloc", ...) left out of
    the trace; compile_context and global_record_annotations are torch's names for what no pool
    here sees (torch.compile frames, record_function annotations): accepted, with one warning
    when set. A bad argument raises ConfigError here, before any pool changes (the settings are
    kept for pools made later)."""
    global _history
    history_settings(enabled, stacks, max_entries, context)
    history_skip_mask(skip_actions)
    clear_history = flag_argument("record_memory_history", "clear_history", clear_history)
    for name, value in (("compile_context", compile_context), ("global_record_annotations", global_record_annotations)):
        if not isinstance(value, bool):
            raise ConfigTypeError(f"{name} must be True or False, got {value!r}")
        if value and name not in _history_warned:
            _history_warned.add(name)
            warnings.warn(f"record_memory_history({name}=True): ascend_pool sees no torch.compile frames or "
                          "record_function annotations; the trace is recorded without them", RuntimeWarning,
                          stacklevel=2)
    settings = dict(enabled=enabled, stacks=stacks, max_entries=max_entries, context=context,
                    skip_actions=None if skip_actions is None else list(skip_actions))
    # The settings pools opened from now on follow are stored before the open pools are listed:
    # a pool another thread opens meanwhile is then either listed here or, registering later,
    # follows them (_follow_history); stored after, it was in neither and recorded nothing.
    before = _history
    if device is None:
        _history = settings
    try:
        pools = _process_pools(device, create=device is not None)
        if clear_history and enabled not in (None, False):  # turning it off drops each ring
            _on_each_open(pools, lambda pool: pool.record_memory_history(None))
        _on_each_open(pools, lambda pool: pool.record_memory_history(**settings))
    except BaseException:
        if device is None and _history is settings:
            _history = before
        raise


def _process_snapshot(device=None):
    """The snapshot dump_snapshot writes: _process_pools(device)'s, merged; no pool is opened for
    it (torch's _snapshot initialises no device): with none open, an empty snapshot of the
    device (None: the current one), as an empty pool's."""
    pools = _process_pools(device, create=False)
    if not pools:
        index, pool = _read_pool(device)
        pools = [pool] if pool is not None else []  # opened by another thread meanwhile
        if not pools:
            return _merge_snapshots([_build_snapshot(index, [], [], effective_knobs(None))])
    return _merge_snapshots(_on_each_open(pools, lambda pool: pool.snapshot()))


def dump_snapshot(path="dump_snapshot.pickle", device=None):
    """Writes the process's snapshot (every device's default pool that was used, every tenant
    context and every other open pool, or one device's) as the pickle that `python -m torch.cuda._memory_viz` reads
    (PyTorch's _dump_snapshot); no pool is opened for it (_process_snapshot)."""
    _dump_snapshot(_process_snapshot(device), path)


def memory_snapshot(mempool_id=None, include_traces=True):
    """torch.cuda.memory_snapshot(): the segments (list of dicts, sizes in bytes) of the snapshot
    dump_snapshot() writes, every device's. mempool_id: None for every pool's, else a pool's id
    (Pool.pool_id, torch's MempoolId_t: (0, 0) the default pools, (0, n) another pool or tenant
    context) for the segments of that pool only, as torch's; include_traces: accepted, as torch's
    (the segments carry no trace): True or False, else ConfigTypeError. No pool is opened for it:
    none open, no segments."""
    flag_argument("memory_snapshot", "include_traces", include_traces)
    want = None if mempool_id is None else _pool_id(mempool_id)
    segments = _process_snapshot()["segments"]
    return segments if want is None else [s for s in segments if s["segment_pool_id"] == want]


def _pool_id(value):
    """A (int, int) pool id from a tuple or list of two ints, else ConfigError."""
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(
            isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value):
        return (int(value[0]), int(value[1]))
    raise ConfigError(f"memory_snapshot: mempool_id must be None or a pool id, two ints as Pool.pool_id "
                      f"((0, 0): the default pools), got {value!r}")


def _own_stats(device):
    # The default pool's own figures: the scalar getters need none of memory_stats()'s private
    # pools, whose reading made each call read every open pool of the device (O(pools): 7 ms
    # with 100 pools open, and a wait on any of their locks). A pool never opened: its zeros.
    index, pool = _read_pool(device)
    return pool.memory_stats() if pool is not None else _unopened_stats(index)


def memory_allocated(device=None):
    """Bytes currently allocated (rounded block sizes)."""
    return _own_stats(device)["allocated_bytes.all.current"]


def memory_reserved(device=None):
    """Bytes currently held from the device."""
    return _own_stats(device)["reserved_bytes.all.current"]


def max_memory_allocated(device=None):
    """Peak bytes allocated (rounded block sizes) on the default pool of device since it opened
    or since the last reset_peak_memory_stats(), as torch.cuda.max_memory_allocated()."""
    return _own_stats(device)["allocated_bytes.all.peak"]


def max_memory_reserved(device=None):
    """Peak bytes held from the device by the default pool of device since it opened or since
    the last reset_peak_memory_stats(), as torch.cuda.max_memory_reserved()."""
    return _own_stats(device)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device=None):
    """torch.cuda.reset_peak_memory_stats(): the same as reset_peak_stats(device)."""
    reset_peak_stats(device)


# torch.cuda's older names, which torch still answers with a FutureWarning: code written for
# them runs here too, warned the same way.
def memory_cached(device=None):
    """torch.cuda.memory_cached(): memory_reserved(device), with torch's FutureWarning."""
    warnings.warn("ascend_pool.memory_cached has been renamed to memory_reserved", FutureWarning, stacklevel=2)
    return memory_reserved(device)


def max_memory_cached(device=None):
    """torch.cuda.max_memory_cached(): max_memory_reserved(device), with torch's FutureWarning."""
    warnings.warn("ascend_pool.max_memory_cached has been renamed to max_memory_reserved", FutureWarning,
                  stacklevel=2)
    return max_memory_reserved(device)


def reset_max_memory_allocated(device=None):
    """torch.cuda.reset_max_memory_allocated(): reset_peak_memory_stats(device), which resets
    every peak, with torch's FutureWarning saying so."""
    warnings.warn("ascend_pool.reset_max_memory_allocated now calls reset_peak_memory_stats, which resets "
                  "/all/ peak memory stats", FutureWarning, stacklevel=2)
    reset_peak_memory_stats(device)


def reset_max_memory_cached(device=None):
    """torch.cuda.reset_max_memory_cached(): reset_peak_memory_stats(device), which resets every
    peak, with torch's FutureWarning saying so."""
    warnings.warn("ascend_pool.reset_max_memory_cached now calls reset_peak_memory_stats, which resets "
                  "/all/ peak memory stats", FutureWarning, stacklevel=2)
    reset_peak_memory_stats(device)


def caching_allocator_alloc(size, device=None, stream=None):
    """torch.cuda.caching_allocator_alloc(): allocates size bytes on the default pool of device
    (None: the current device), ordered on stream (an int stream handle; None: the default
    stream, or a framework's stream object whose npu_stream / cuda_stream is one, as torch takes
    a torch.cuda.Stream). Returns the address (int); give it back with caching_allocator_delete(ptr).
    As torch's, 0 bytes give the null address 0 (nothing allocated), which caching_allocator_delete
    takes back as a no-op; pool.malloc(0) refuses (InvalidSizeError)."""
    if stream is not None and not isinstance(stream, int):
        stream = next((h for h in (getattr(stream, "npu_stream", None), getattr(stream, "cuda_stream", None))
                       if isinstance(h, int) and not isinstance(h, bool)), stream)
    if stream is not None and (not isinstance(stream, int) or isinstance(stream, bool)):
        raise StreamTypeError(f"caching_allocator_alloc: stream must be None, an int stream handle or a "
                              f"stream object with an int npu_stream or cuda_stream, got {stream!r}")
    pool = default_pool(device)
    if as_index(size) == 0:
        return 0
    return pool.malloc(size, stream)


def caching_allocator_delete(ptr):
    """torch.cuda.caching_allocator_delete(): frees ptr (from caching_allocator_alloc or malloc)
    on the pool that made it, whatever the current device or context; InvalidPointerError when no
    open pool of this process holds a live block at ptr; 0 (the null address that a 0-byte
    caching_allocator_alloc returns) is a no-op, as torch's."""
    address = as_index(ptr)  # a numpy integer too, as pool.free and torch's raw_delete take it
    if address is None:
        raise InvalidPointerError(f"caching_allocator_delete: ptr must be an int address, got {ptr!r}")
    ptr = address
    if ptr == 0:
        return
    mine = _current.top(current_device()) or _registry.default_pool(current_device())
    for pool in ([mine] if mine is not None else []) + _registry.live_pools():
        try:
            if not pool.closed and pool.block_info(ptr) is not None:
                pool.free(ptr)
                _registry.reap_orphans()  # perhaps a dropped pool's last block
                return
        except PoolError:
            if not pool.closed:
                raise
            # closed by another thread meanwhile (its blocks went with it): not the owner
    if _free_through_c_abi(ptr, current_device()):
        return
    raise InvalidPointerError(f"caching_allocator_delete({ptr:#x}): not a live block of any open pool of this process")


def _allocation_traceback(data_ptr):
    """torch.cuda.memory._allocation_traceback(data_ptr): the frames of the allocation of the live
    block starting at data_ptr, innermost (the user's line) first, from whichever open pool of the
    process made it; None where no pool has a live block starting there (a view's address inside
    one included, as torch's) or its frames were not recorded (record_memory_history with
    stacks and context, before the allocation)."""
    ptr = as_index(data_ptr)
    if ptr is None or not 0 <= ptr < 1 << 64:  # checked here: with no pool recording, none would
        raise InvalidPointerError(f"_allocation_traceback: data_ptr must be an int address, got {data_ptr!r}")
    if ptr == 0:  # an empty tensor's null address: no allocation
        return None
    for pool in _registry.live_pools():
        try:
            # None from every pool but the one with a live block starting at ptr (with frames)
            found = pool.allocation_traceback(ptr) if not pool.closed else None
            if found is not None:
                return found
        except PoolError:
            if not pool.closed:
                raise  # closed by another thread meanwhile: its blocks went with it
    return None


def set_per_process_memory_fraction(fraction, device=None):
    """torch.cuda.set_per_process_memory_fraction(): caps the bytes the device's allocator
    holds at fraction (a number in [0, 1]) of the device's total memory: the default pool of device
    and every other plain Pool of it (torch's MemPools) together, as torch's caps its device
    allocator, MemPools included (the default pool's limit; inside use_mem_pool, set on the pool
    beneath). In a thread's `with ctx:` block, that tenant context's own bytes instead. Past the
    cap an allocation raises OutOfMemoryError. A cap below current use releases the default pool's
    cached segments only (live blocks stay). Same as ascend_pool_set_memory_fraction from C."""
    if not isinstance(fraction, float):  # torch refuses an int too (1 is not 1.0 there)
        raise ConfigTypeError(f"set_per_process_memory_fraction: Invalid type for fraction argument, "
                              f"must be `float`, got {type(fraction).__name__} {fraction!r}")
    if not 0 <= fraction <= 1:  # NaN too
        raise ConfigError(f"set_per_process_memory_fraction: Invalid fraction value: {fraction!r}. "
                          f"Allowed range: 0~1")
    pool = _fraction_owner(device)
    total = _device_total(pool)
    pool.set_limit(limit_bytes=int(fraction * total))  # 0.0: a cap of 0 bytes, as torch
    pool._memory_fraction = float(fraction)


def _fraction_owner(device):
    """The pool a memory fraction caps: the thread's `with ctx:` context, else the device's
    default pool; not a pool made current by use_mem_pool (torch's fraction caps the device's
    allocator, not the MemPool in use: set inside the block, it stays after it)."""
    index = torch_device_index(device)
    index = current_device() if index is None else index
    return _current.cache_owner(index) or process_default_pool(index)


def _device_total(pool):
    """The device's total bytes, the base of a memory fraction from every path (the C ABI's hook
    and the memory_fraction knob use it too): not a tenant context's mem_get_info(), which
    answers its quota as total (HAMi's view); a fraction of it gave two caps for one value."""
    return pool.backend.mem_info(pool.device)[1]


def get_per_process_memory_fraction(device=None):
    """torch.cuda.get_per_process_memory_fraction(): the fraction of the device's total memory
    the default pool of device may hold (set_per_process_memory_fraction or the memory_fraction
    knob); 1.0 without a cap. A default pool never opened is not opened to be read (one opened
    on reading took a device reference, a context on an NPU): it answers the cap it would open
    with, the knobs' fraction (a tenant's default context's too), else 1.0."""
    index = torch_device_index(device)
    index = current_device() if index is None else index
    if _current.cache_owner(index) is None and _registry.default_pool(index) is None:
        _check_device_if_opened(device_index(index))
        fraction = knobs_fraction(effective_knobs(None))
        return 1.0 if fraction is None else fraction
    pool = _fraction_owner(device)
    limit = pool._limit()  # whoever set it last: Python, the C ABI's hook, or the knobs
    if limit is None:
        return 1.0
    total = _device_total(pool)
    fraction = pool.__dict__.get("_memory_fraction")
    if fraction is not None and int(fraction * total) == limit:
        return fraction
    # set from a knob string or the C hook: the shortest decimal that gives this cap (0.3, not
    # 0.29999999981), as torch returns the fraction it was given
    for digits in range(1, 18):
        shortest = round(limit / total, digits)
        if int(shortest * total) == limit:
            return shortest
    return limit / total


_set_memory_metadata = set_memory_metadata  # torch.cuda.memory's private names, which code calls
_get_memory_metadata = get_memory_metadata

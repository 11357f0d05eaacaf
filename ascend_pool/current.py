"""The pool current on each thread, per device: `with ctx:` pushes a tenant context here (and
ap.use_mem_pool any pool), and module-level calls (ascend_pool.api) and the C ABI (core/current.h,
kept in step) allocate from it."""

import threading

from ._core import _restore_thread_current, _set_thread_current

_local = threading.local()


def _uses_of(pool):
    # One entry per push in force, any thread's: list.append/remove and dict.setdefault are each
    # one call under the GIL, so no lock (a module lock would be re-entered by a signal handler
    # entering a `with` while this thread counts; see ARCHITECTURE.md, Locks).
    return pool.__dict__.setdefault("_uses", [])


def uses(pool):
    """The pushes of pool still in force, on every thread (`with ctx:`, use_mem_pool)."""
    return len(pool.__dict__.get("_uses", ()))


def _stack(device):
    stacks = getattr(_local, "stacks", None)
    if stacks is None:
        stacks = _local.stacks = {}
    return stacks.setdefault(device, [])


def push(device, pool, mem_pool=False):
    """Makes pool current for device (int) on this thread; returns the entry for pop(). mem_pool:
    pushed by use_mem_pool (torch's MemPool, whose cache empty_cache keeps; see cache_owner)."""
    stack = _stack(device)
    entry = [pool, _set_thread_current(device, pool, mem_pool), mem_pool]  # [pool, what to restore when it goes, ...]
    stack.append(entry)
    _uses_of(pool).append(entry)
    return entry


def pop(device, entry):
    """Undoes the push(device, pool) that returned entry, in any order. Out of order (two asyncio
    tasks' `with ctx:` blocks interleaved on one thread, each exiting after the other entered)
    the push made after it inherits its restore token: the pool current on the thread is always
    the last push still in force, for Python and the C ABI alike, and once every push is undone
    the thread is back where it started (a plain LIFO pop restored the token of the wrong push:
    the C ABI then stayed on a tenant Python no longer saw, and on its closed pool for good)."""
    stack = _stack(device)
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is entry:
            break
    else:
        return  # not this thread's push: nothing of this thread's to undo
    del stack[i]
    _remove_use(entry)
    if i == len(stack):
        _restore_thread_current(device, entry[1])
    else:
        stack[i][1] = entry[1]


def pop_last_of(device, pool):
    """Undoes this thread's last push(device, pool) still in force, whichever entry it was
    (a `with ctx:` left from another asyncio task than the one that entered it)."""
    stack = _stack(device)
    for entry in reversed(stack):
        if entry[0] is pool:
            pop(device, entry)
            return


def _remove_use(entry):
    try:
        _uses_of(entry[0]).remove(entry)  # one call: an equal entry, if not this one, counts the same
    except ValueError:
        pass


def top(device):
    """The pool this thread made current for device, or None."""
    stack = getattr(_local, "stacks", {}).get(device)
    return stack[-1][0] if stack else None


def cache_owner(device):
    """The pool this thread made current for device with `with ctx:` (not use_mem_pool) still in
    force, the last one, or None: the one whose cache empty_cache() empties. torch's
    empty_cache() inside use_mem_pool keeps the MemPool's cache (release_cached_blocks with the
    default pool id skips private pools still in use) and empties the device's own."""
    for entry in reversed(getattr(_local, "stacks", {}).get(device, ())):
        if not entry[2]:
            return entry[0]
    return None

"""The pool current on each thread, per device: `with ctx:` pushes a tenant context here (and
ap.use_mem_pool any pool), and module-level calls (ascend_pool.api) and the C ABI (core/current.h,
kept in step) allocate from it."""

from ._core import _current_local as _local
from ._core import current_pop as pop
from ._core import current_pop_last_of as pop_last_of
from ._core import current_push as push

# push(device, pool, mem_pool=False) -> entry, pop(device, entry), pop_last_of(device, pool): in C
# (cython/core/current.pxi), so that a signal handler's exception never lands halfway through one.


def uses(pool):
    """The pushes of pool still in force, on every thread (`with ctx:`, use_mem_pool)."""
    return len(pool.__dict__.get("_uses", ()))


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

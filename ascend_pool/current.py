"""The pool current on each thread, per device: `with ctx:` pushes a tenant context here, and
module-level calls (ascend_pool.api) and the C ABI (core/current.h, kept in step) allocate from it."""

import threading

from ._core import _restore_thread_current, _set_thread_current

_local = threading.local()


def _stack(device):
    stacks = getattr(_local, "stacks", None)
    if stacks is None:
        stacks = _local.stacks = {}
    return stacks.setdefault(device, [])


def push(device, pool):
    """Makes pool current for device (int) on this thread; returns a token for pop()."""
    stack = _stack(device)
    token = _set_thread_current(device, pool)
    stack.append(pool)
    return token


def pop(device, token):
    """Undoes the matching push(device, pool)."""
    _stack(device).pop()
    _restore_thread_current(device, token)


def top(device):
    """The pool this thread made current for device, or None."""
    stack = getattr(_local, "stacks", {}).get(device)
    return stack[-1] if stack else None

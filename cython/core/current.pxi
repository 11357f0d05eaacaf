# The pool current on each thread, per device (`with ctx:` pushes a tenant context, use_mem_pool
# any pool; ascend_pool/current.py reads it, core/current.h keeps the C ABI in step). Pushes and
# pops, and the `with` blocks' __enter__ and __exit__ around them, are compiled: Python runs a
# signal handler only between bytecodes, so a Ctrl-C (KeyboardInterrupt) or a SIGTERM handled by
# sys.exit never lands between a push and its record, or halfway through a pop. In Python it
# did: 84 in 300 Ctrl-Cs of a `with ctx:` loop left the context current on the thread, its
# allocations and the C ABI's (a framework's tensors) charged to the tenant from then on.

import contextvars as _contextvars
import threading as _current_threading
import functools as _functools

_current_local = _current_threading.local()
# (context, push entry) of each `with ctx:` in force, per thread and per asyncio task
_contexts_entered = _contextvars.ContextVar("ascend_pool_contexts_entered", default=())


cdef list _current_stack(int device):
    stacks = getattr(_current_local, "stacks", None)
    if stacks is None:
        stacks = {}
        _current_local.stacks = stacks
    return stacks.setdefault(device, [])


cdef list _current_uses_of(pool):
    # One entry per push in force, any thread's (current.uses): list and dict calls, no lock
    return pool.__dict__.setdefault("_uses", [])


def current_push(int device, PoolBase pool, bint mem_pool=False):
    """Makes pool current for device on this thread; returns the entry for current_pop(). mem_pool:
    pushed by use_mem_pool (torch's MemPool, whose cache empty_cache keeps; see current.cache_owner)."""
    stack = _current_stack(device)
    entry = [pool, _set_thread_current(device, pool, mem_pool), mem_pool]  # [pool, what to restore, ...]
    stack.append(entry)
    _current_uses_of(pool).append(entry)
    return entry


def current_pop(int device, entry):
    """Undoes the current_push(device, pool) that returned entry, in any order. Out of order (two
    asyncio tasks' `with ctx:` blocks interleaved on one thread, each exiting after the other
    entered) the push made after it inherits its restore token: the pool current on the thread is
    always the last push still in force, for Python and the C ABI alike, and once every push is
    undone the thread is back where it started."""
    stack = _current_stack(device)
    cdef Py_ssize_t i
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is entry:
            break
    else:
        return  # not this thread's push: nothing of this thread's to undo
    del stack[i]
    try:
        _current_uses_of(entry[0]).remove(entry)  # an equal entry, if not this one, counts the same
    except ValueError:
        pass
    if i == len(stack):
        _restore_thread_current(device, entry[1])
    else:
        stack[i][1] = entry[1]


def current_pop_last_of(int device, pool):
    """Undoes this thread's last current_push(device, pool) still in force, whichever entry it was
    (a `with ctx:` left from another asyncio task than the one that entered it)."""
    for entry in reversed(_current_stack(device)):
        if entry[0] is pool:
            current_pop(device, entry)
            return


def context_enter(self):
    """A tenant context's __enter__: makes it current for the calling thread (module-level
    ascend_pool.malloc and the C ABI on its device allocate from it). Nests; blocks of asyncio
    tasks that interleave on one thread may exit in any order (the thread's current context is
    then the last one entered and not yet left)."""
    self._check_open()
    entry = current_push(self.device, self)
    _contexts_entered.set(_contexts_entered.get() + ((self, entry),))
    return self


def context_exit(self, *exc):
    """A tenant context's __exit__: undoes this task's (or thread's) last `with self:`, found in a
    context variable (each asyncio task has its own, so two tasks' exits never undo each other's
    entry); left from another task than the one that entered (an ExitStack closed at shutdown),
    this thread's last entry of this context."""
    entered = _contexts_entered.get()
    cdef Py_ssize_t k
    for k in range(len(entered) - 1, -1, -1):
        if entered[k][0] is self:
            _contexts_entered.set(entered[:k] + entered[k + 1:])
            current_pop(self.device, entered[k][1])
            return False
    current_pop_last_of(self.device, self)
    return False


cdef class MemPoolUse:
    """What ascend_pool.use_mem_pool returns: `with` makes pool current for the calling thread (a
    MemPool push). check() runs first, in __enter__, and may refuse (a closed pool, another device)."""
    cdef object pool, check
    cdef list entries

    def __init__(self, pool, check):
        self.pool = pool
        self.check = check
        self.entries = []

    def __enter__(self):
        self.check()
        self.entries.append(current_push(self.pool.device, self.pool, True))
        return self.pool

    def __exit__(self, *exc):
        if self.entries:
            current_pop(self.pool.device, self.entries.pop())
        return False

    def __call__(self, func):
        """As a decorator (torch's use_mem_pool is a contextlib context manager, which decorates):
        each call of func runs in a block of its own."""
        pool, check = self.pool, self.check

        @_functools.wraps(func)
        def in_pool(*args, **kwargs):
            with MemPoolUse(pool, check):
                return func(*args, **kwargs)
        return in_pool

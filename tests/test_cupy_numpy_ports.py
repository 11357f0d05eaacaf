"""CuPy's and numpy's own tests of their memory pools and handlers, ported to ascend_pool's CuPy
hook (ascend_pool.integrations.cupy), its Pool's CuPy names, its pinned host pool and its numpy
handler (ascend_pool.integrations.numpy). CuPy cannot run here (it needs a GPU): the hook is
driven through a stand-in with the slice of CuPy's interface it uses, whose OutOfMemoryError is
CuPy's (cupy/cuda/memory.pyx: the message, the attributes, the __reduce__)."""

import os
import pickle
import sys
import types

import pytest

import ascend_pool as ap

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401  (pytest fixture)

MiB = 1 << 20


class CupyOutOfMemoryError(MemoryError):
    """cupy.cuda.memory.OutOfMemoryError as CuPy defines it."""

    def __init__(self, size, total, limit=0):
        self._size, self._total, self._limit = size, total, limit
        cap = f", limit set to: {limit:,} bytes" if limit else ""
        super().__init__(f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} bytes{cap}).")

    def __reduce__(self):
        return (type(self), (self._size, self._total, self._limit))


class StandInCupy(types.ModuleType):
    """What the hook calls of CuPy: UnownedMemory, Memory, MemoryPointer, the current device and
    stream, set_allocator, and memory.OutOfMemoryError."""

    def __init__(self):
        super().__init__("cupy")

        class UnownedMemory:
            def __init__(self, ptr, size, owner, device_id=-1):
                self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id

        class Memory:
            def __init__(self, size):
                self.ptr, self.size = 0, size

        class MemoryPointer:
            def __init__(self, mem, offset):
                self.mem, self.ptr = mem, mem.ptr + offset

        self.stream = types.SimpleNamespace(ptr=0)
        self.cuda = types.SimpleNamespace(
            UnownedMemory=UnownedMemory, MemoryPointer=MemoryPointer,
            memory=types.SimpleNamespace(Memory=Memory, OutOfMemoryError=CupyOutOfMemoryError),
            runtime=types.SimpleNamespace(getDevice=lambda: 0), get_current_stream=lambda: self.stream,
            set_allocator=lambda fn: setattr(self, "allocator", fn))


@pytest.fixture
def cupy_hook(monkeypatch):
    """(the stand-in CuPy, the hook module) with no $CUPY_GPU_MEMORY_LIMIT."""
    monkeypatch.setitem(sys.modules, "cupy", StandInCupy())
    monkeypatch.delenv("CUPY_GPU_MEMORY_LIMIT", raising=False)
    from ascend_pool.integrations import cupy as ap_cupy
    monkeypatch.setattr(ap_cupy, "_limited_devices", {})
    return sys.modules["cupy"], ap_cupy


def _refusal(ap_cupy, nbytes, ctx=None):
    """The error the hook raises for nbytes (in the tenant context ctx when given)."""
    try:
        if ctx is None:
            ap_cupy.malloc(nbytes)
        else:
            with ctx:
                ap_cupy.malloc(nbytes)
    except MemoryError as e:
        return e
    raise AssertionError(f"{nbytes} bytes were served")


def test_a_plain_out_of_memory_and_a_quota_refusal_keep_their_own_classes_under_cupys(cupy_hook):
    # The hook raises CuPy's OutOfMemoryError that is also the pool's error; its class was made
    # once per CuPy class, from the first error's class: after a tenant's quota refusal every
    # later out-of-memory of the device was a QuotaExceededError too (and after a plain one, no
    # quota refusal was), so `except ap.QuotaExceededError` caught the wrong ones.
    fake, ap_cupy = cupy_hook
    pool = ap.default_pool(0)
    ctx = pool.context("cupy-port-quota", quota=8 * MiB)
    try:
        beyond = 4 * pool.mem_get_info()[1]
        for order in (("quota", "plain"), ("plain", "quota")):
            for kind in order:
                e = _refusal(ap_cupy, 16 * MiB, ctx) if kind == "quota" else _refusal(ap_cupy, beyond)
                assert isinstance(e, fake.cuda.memory.OutOfMemoryError) and isinstance(e, ap.OutOfMemoryError), kind
                assert isinstance(e, ap.QuotaExceededError) == (kind == "quota"), (order, kind, type(e).__mro__)
    finally:
        ctx.close()


def test_cupys_out_of_memory_error_pickles_with_its_message(cupy_hook):
    # CuPy's TestExceptionPicklable: e2 = pickle.loads(pickle.dumps(e1)) keeps args and str. The
    # hook's error went back to a multiprocessing or dask parent as CuPy's class rebuilt from
    # (size, total, limit): CuPy's first sentence only, the pool's cause (what was reserved,
    # cached, the device's free memory, the quota) lost on the way.
    fake, ap_cupy = cupy_hook
    pool = ap.default_pool(0)
    e1 = _refusal(ap_cupy, 4 * pool.mem_get_info()[1])
    assert "Tried to allocate" in str(e1)
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        e2 = pickle.loads(pickle.dumps(e1, protocol=protocol))
        assert type(e2) is fake.cuda.memory.OutOfMemoryError
        assert e2.args == e1.args and str(e2) == str(e1)
        assert (e2._size, e2._total, e2._limit) == (e1._size, e1._total, e1._limit)
    # CuPy's own error, pickled by its own __reduce__, is unchanged by the hook
    own = fake.cuda.memory.OutOfMemoryError(124, 1024, 1024)
    back = pickle.loads(pickle.dumps(own))
    assert back.args == own.args and str(back) == str(own)


def test_cupys_memory_limit_variable_caps_a_closed_default_pools_replacement(sim_node):
    # CuPy's pool reads $CUPY_GPU_MEMORY_LIMIT for each device's pool; the hook sets it on the
    # device's default pool at the device's first CuPy allocation, and remembered the device
    # only: once that pool was closed, the default made for the next allocation had no cap
    # (a 128 MiB request under a 64 MiB limit was served).
    out = sim_node.run_json("""
        from test_cupy_numpy_ports import StandInCupy
        sys.modules["cupy"] = StandInCupy()
        import ascend_pool as ap
        from ascend_pool.integrations import cupy as ap_cupy
        got = {}
        held = ap_cupy.malloc(1 << 20)
        got["first"] = ap.default_pool(0).get_limit()
        del held
        ap.default_pool(0).close()
        held = ap_cupy.malloc(1 << 20)
        got["replacement"] = ap.default_pool(0).get_limit()
        try:
            ap_cupy.malloc(128 << 20)
            got["over"] = "served"
        except MemoryError as e:
            got["over"] = type(e).__name__
        print(json.dumps(got))
    """, CUPY_GPU_MEMORY_LIMIT=str(64 * MiB))
    assert out == {"first": 64 * MiB, "replacement": 64 * MiB, "over": "CupyOutOfMemoryError"}, out

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


# -- CuPy's SingleDeviceMemoryPool tests on ascend_pool's Pool (CuPy's names) ---------------------

def test_cupys_set_limit_and_get_limit_tests():
    # CuPy's test_get_limit, test_set_limit_size, test_set_limit_fraction
    pool = ap.Pool(0, backend="sim")
    try:
        total = pool.mem_get_info()[1]
        assert pool.get_limit() == 0                      # no limit by default
        for size in (1024, 2**33, 0):
            pool.set_limit(size=size)
            assert pool.get_limit() == size
        with pytest.raises(ValueError):
            pool.set_limit(size=-1)
        pool.set_limit(fraction=0)
        assert pool.get_limit() == 0
        pool.set_limit(fraction=0.5)
        assert pool.get_limit() == total * 0.5
        pool.set_limit(fraction=1.0)
        assert pool.get_limit() == total
        for bad in (-1, 1.1):
            with pytest.raises(ValueError):
                pool.set_limit(fraction=bad)
        with pytest.raises(ValueError):
            pool.set_limit(size=1024, fraction=0.5)   # "size and fraction cannot be specified at one time"
        assert pool.get_limit() == total                  # a refused call changes nothing
    finally:
        pool.close()


def test_cupys_used_free_and_total_bytes_tests():
    # CuPy's test_used_bytes, test_free_bytes, test_total_bytes: used follows live blocks,
    # total what the pool holds (kept after frees), free the rest, and free_all_blocks gives
    # everything back; figures in the pool's rounded sizes
    pool = ap.Pool(0, backend="sim")
    try:
        unit = pool.round_size(1)
        p1 = pool.malloc(unit * 2)
        assert pool.used_bytes() == pool.round_size(unit * 2)
        p2 = pool.malloc(unit * 4)
        used = pool.round_size(unit * 2) + pool.round_size(unit * 4)
        assert pool.used_bytes() == used
        total = pool.total_bytes()
        pool.free(p2)
        assert pool.used_bytes() == pool.round_size(unit * 2) and pool.total_bytes() == total
        pool.free(p1)
        assert pool.used_bytes() == 0 and pool.free_bytes() == pool.total_bytes() == total
        p3 = pool.malloc(unit)
        assert pool.used_bytes() + pool.free_bytes() == pool.total_bytes() == total
        pool.free(p3)
        pool.free_all_blocks()
        assert (pool.used_bytes(), pool.free_bytes(), pool.total_bytes()) == (0, 0, 0)
    finally:
        pool.close()


def test_cupys_free_all_blocks_split_test():
    # CuPy's test_free_all_blocks_split: a segment with a live block is not given back; its free
    # part is served again from the cache afterwards
    pool = ap.Pool(0, backend="sim")
    try:
        unit = pool.round_size(1)
        pool.free(pool.malloc(unit * 4))
        head, tail = pool.malloc(unit * 2), pool.malloc(unit * 2)
        pool.free(tail)
        total = pool.total_bytes()
        pool.free_all_blocks()
        assert pool.total_bytes() == total
        again = pool.malloc(unit * 2)
        assert again == tail and pool.total_bytes() == total
        pool.free(again)
        pool.free(head)
    finally:
        pool.close()


# -- CuPy's TestAllocator through the hook ---------------------------------------------------------

@pytest.mark.parametrize("stream", ["null", "created"])
def test_cupys_reuse_between_thread_test(cupy_hook, stream):
    # CuPy's test_reuse_between_thread(_same_stream): a block freed in one thread is what another
    # thread allocating on the same stream gets next (the hook is per thread, its pool is not)
    import threading
    fake, ap_cupy = cupy_hook
    pool = ap.default_pool(0)
    handle = 0 if stream == "null" else pool.create_stream()
    fake.stream = types.SimpleNamespace(ptr=handle)
    got = []

    def job():
        mp = ap_cupy.malloc(128)
        got.append(mp.ptr)
        del mp

    try:
        job()
        t = threading.Thread(target=job)
        t.start()
        t.join()
        assert len(got) == 2 and got[0] == got[1], got
    finally:
        if handle:
            pool.destroy_stream(handle)


# -- numpy's test_mem_policy.py with ascend_pool's handler ----------------------------------------

@pytest.fixture
def np_handler():
    """(numpy, the handler module, numpy's get_handler_name/get_handler_version) with the handler
    installed in this test's context; numpy's default restored afterwards."""
    import numpy as np  # a base dependency
    import ascend_pool.integrations.numpy as ap_np
    multiarray = ap_np._numpy_module("multiarray")
    with ap_np.installed():
        yield np, ap_np, multiarray.get_handler_name, multiarray.get_handler_version
    assert multiarray.get_handler_name() == "default_allocator"


def test_numpys_set_policy_and_policy_propagation_tests(np_handler):
    # numpy's test_set_policy / test_policy_propagation / test_owner_is_base: the handler's name
    # and version (1, the PyDataMem_Handler layout) for the context and for arrays it made; a
    # view owns no data (None), its base does
    np, ap_np, get_handler_name, get_handler_version = np_handler
    a = np.arange(10.0)
    assert get_handler_name() == get_handler_name(a) == ap_np.HANDLER_NAME
    assert get_handler_version() == get_handler_version(a) == 1
    view = a[2:].reshape(2, 4)
    assert get_handler_name(view) is None and get_handler_version(view) is None
    assert view.base is a and get_handler_name(view.base) == ap_np.HANDLER_NAME


def test_numpys_context_locality_test(np_handler):
    # numpy's test_context_locality: asyncio tasks copy the context they are created in; one
    # task's uninstall() is its own, the creating context keeps the handler
    import asyncio
    np, ap_np, get_handler_name, _ = np_handler

    async def keeps():
        await asyncio.sleep(0)
        return get_handler_name(np.ones(64))

    async def drops():
        ap_np.uninstall()
        await asyncio.sleep(0)
        return get_handler_name(np.ones(64))

    async def main():
        return await asyncio.gather(keeps(), drops(), keeps())

    assert asyncio.run(main()) == [ap_np.HANDLER_NAME, "default_allocator", ap_np.HANDLER_NAME]
    assert get_handler_name(np.ones(64)) == ap_np.HANDLER_NAME


def test_numpy_empty_pickled_and_huge_arrays_under_the_handler(np_handler):
    # 0-byte arrays come from the pool too (numpy asks for at least 1 byte); a pickled array that
    # owns its data at loads has it from the handler current then (numpy keeps an aligned pickle's
    # bytes object as the data instead); a size no host can hold is numpy's MemoryError, a
    # resize to one leaves the array as it was, and nothing leaks either way
    np, ap_np, get_handler_name, _ = np_handler
    before = ap_np.stats()["allocated_bytes.all.current"]
    for empty in (np.empty(0), np.zeros((0, 5), np.uint8), np.ones((3, 0))):
        assert empty.nbytes == 0 and get_handler_name(empty) == ap_np.HANDLER_NAME
    small = np.arange(10.0)
    for protocol in range(5):
        b = pickle.loads(pickle.dumps(small, protocol=protocol))
        assert get_handler_name(b) == ap_np.HANDLER_NAME and (b == small).all(), protocol
    a = np.arange(1000.0)
    with pytest.raises(MemoryError):
        np.empty(2**62, np.uint8)
    with pytest.raises(MemoryError):
        np.zeros(2**50, np.uint8)
    with pytest.raises(MemoryError):
        a.resize(2**61, refcheck=False)
    assert a.shape == (1000,) and (a == np.arange(1000.0)).all()
    del empty, small, a, b
    assert ap_np.stats()["allocated_bytes.all.current"] == before
    assert ap_np.stats()["num_invalid_frees"] == 0


_NUMPY_SUITE = """
import json, sys
import numpy as np
import pytest
import ascend_pool.integrations.numpy as ap_np

class Handler:
    def pytest_configure(self, config):
        ap_np.install()  # pytest runs the tests in this (the main) context

rc = pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-W", "ignore", "-x",
                  "-k", sys.argv[2], sys.argv[1]], plugins=[Handler()])
s = ap_np.stats()
print(json.dumps({"rc": int(rc), "handler": ap_np._numpy_module("multiarray").get_handler_name(),
                  "allocs": s["num_allocs"], "invalid_frees": s["num_invalid_frees"]}))
"""


def test_numpys_new_policy_test_runs_numpys_array_tests_on_the_handler(tmp_path):
    # numpy's test_new_policy runs numpy's own test suite with the handler installed. Here a
    # slice of test_multiarray.py that creates, resizes, copies, pickles and reshapes arrays (the
    # whole file passes too, in minutes: 14,458 tests with test_regression.py)
    import json
    import subprocess

    import numpy as np  # a base dependency; its wheels ship its tests
    suite = os.path.join(os.path.dirname(np.__file__), "_core", "tests", "test_multiarray.py")
    assert os.path.exists(suite), f"numpy's tests are not installed with this numpy ({suite} is missing)"
    script = tmp_path / "suite.py"
    script.write_text(_NUMPY_SUITE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(ap.__file__))), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, str(script), suite, "Resize or Pickl or Creation or Zeros or Copy"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["rc"] == 0 and out["handler"] == "ascend_pool_pinned_host", p.stdout[-3000:] + p.stderr[-2000:]
    assert out["allocs"] > 10_000 and out["invalid_frees"] == 0, out


def test_a_size_past_the_c_abis_is_cupys_out_of_memory_as_every_size_past_the_device(cupy_hook):
    # CuPy's allocator takes a size_t; CuPy's own pool answers any size no device has with its
    # OutOfMemoryError (what its fallbacks catch). Through the hook a size from 2**63 on was
    # Cython's OverflowError ("Python int too large to convert to C ssize_t"), where 2**63-1 was
    # CuPy's out-of-memory.
    fake, ap_cupy = cupy_hook
    before = ap.memory_stats(0)["allocated_bytes.all.current"]
    for n in (1 << 60, (1 << 63) - 1, 1 << 63, (1 << 63) + 5, (1 << 64) - 1):
        e = _refusal(ap_cupy, n)
        assert isinstance(e, fake.cuda.memory.OutOfMemoryError) and isinstance(e, ap.OutOfMemoryError), (n, e)
        assert e._size == n and str(e).startswith(f"Out of memory allocating {n:,} bytes"), str(e)
        assert f"Tried to allocate more than 1EB memory ({n} bytes) on device 0" in str(e), str(e)
    assert ap.memory_stats(0)["allocated_bytes.all.current"] == before


# -- CuPy's PinnedMemoryPool tests on the pinned host pool -----------------------------------------

def test_cupys_pinned_memory_pool_tests_on_the_host_pool():
    # CuPy's test_pinned_memory.py TestSingleDeviceMemoryPool: test_alloc, test_free,
    # test_free_different_size, test_free_all_blocks(2), *_without_malloc. Differences by design
    # (docs/integrations.md): n_free_blocks also counts the unused rest of a slab, so it is not 0
    # after the first malloc; a pointer freed twice is refused (InvalidPointerError), where CuPy's
    # PinnedMemory.free() twice is a no-op on its object
    from ascend_pool._core import HostPool
    from ascend_pool.backend import open_backend
    hp = HostPool(open_backend("sim"), 0)
    try:
        assert (hp.n_free_blocks(), hp.used_bytes(), hp.total_bytes()) == (0, 0, 0)
        hp.free_all_blocks()                                  # without a malloc
        assert hp.n_free_blocks() == 0
        p1, p2, p3 = hp.malloc(1000), hp.malloc(1000), hp.malloc(2000)
        assert len({p1, p2, p3}) == 3
        assert hp.used_bytes() == 1024 + 1024 + 2048          # power-of-two classes
        hp.free(p1)
        assert hp.malloc(1000) == p1                          # test_free
        hp.free(p1)
        other = hp.malloc(2000)
        assert other != p1                                    # test_free_different_size
        with pytest.raises(ap.InvalidPointerError):
            hp.free(p1)                                       # freed above: a second free
        for p in (p2, p3, other):
            hp.free(p)
        assert hp.n_free_blocks() > 0 and hp.used_bytes() == 0
        hp.free_all_blocks()
        assert (hp.n_free_blocks(), hp.total_bytes()) == (0, 0)
    finally:
        hp.close()

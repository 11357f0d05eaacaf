"""numpy arrays under ascend_pool's NEP 49 handler: their data comes from the pinned host pool (the
handler's name and the pool's stats show it), survives resize (realloc without the old size), goes
back to the pool when the array dies, and the handler's scope is the calling context only."""

import os
import threading

import pytest

np = pytest.importorskip("numpy")

import ascend_pool.integrations.numpy as ap_np  # noqa: E402
from ascend_pool._core import NUMPY_HANDLER_NAME  # noqa: E402


def handler_name(*arr):
    """numpy's name for the handler that allocated arr (none given: the current handler)."""
    return ap_np._numpy_module("multiarray").get_handler_name(*arr)


@pytest.fixture
def handler():
    """The handler installed in this test's context; numpy's default restored afterwards."""
    with ap_np.installed() as pool:
        yield pool
    assert handler_name() == "default_allocator"


def allocated():
    return ap_np.stats()["allocated_bytes.all.current"]


def test_handler_name_is_ascend_pools():
    assert ap_np.HANDLER_NAME == NUMPY_HANDLER_NAME == "ascend_pool_pinned_host"


def test_arrays_come_from_the_pool_and_go_back(handler):
    assert ap_np.is_installed() and handler_name() == ap_np.HANDLER_NAME
    before, allocs = allocated(), ap_np.stats()["num_allocs"]
    a = np.arange(100_000, dtype=np.float64)  # 800 kB
    assert handler_name(a) == ap_np.HANDLER_NAME
    base, capacity, requested = handler.block_info(a.ctypes.data)
    assert base == a.ctypes.data and requested == a.nbytes and capacity >= a.nbytes
    assert allocated() - before == capacity
    assert ap_np.stats()["num_allocs"] > allocs
    assert ap_np.stats()["reserved_bytes.all.current"] >= allocated()
    del a
    assert allocated() == before


def test_zeros_are_zero_even_in_a_reused_buffer(handler):
    a = np.full(50_000, 7.0)
    address = a.ctypes.data
    del a
    z = np.zeros(50_000)  # numpy's calloc: the same class, most likely the same buffer
    assert z.ctypes.data == address and not z.any()


def test_resize_keeps_data_and_moves_between_classes(handler):
    before = allocated()
    a = np.arange(1000, dtype=np.int64)  # 8000 bytes: the 8 KiB class
    a.resize(1020, refcheck=False)  # same class: grown in place
    assert handler.block_info(a.ctypes.data)[2] == 1020 * 8
    a.resize(200_000, refcheck=False)  # 1.6 MB: moved to a bigger buffer, data copied
    assert handler_name(a) == ap_np.HANDLER_NAME
    assert (a[:1000] == np.arange(1000)).all() and not a[1020:].any()
    assert handler.block_info(a.ctypes.data)[1:] == (2 << 20, 200_000 * 8)
    assert allocated() - before == 2 << 20
    a.resize(10, refcheck=False)  # shrunk into a small class again
    assert (a == np.arange(10)).all()
    assert allocated() - before == 512
    del a
    assert allocated() == before


def test_arrays_free_into_the_pool_after_uninstall(handler):
    before = allocated()
    a = np.ones(4096)
    ap_np.uninstall()  # numpy's default handler for new arrays ...
    b = np.ones(4096)
    assert handler_name(b) == "default_allocator" and handler_name(a) == ap_np.HANDLER_NAME
    del a  # ... but a still frees through the handler that allocated it
    assert allocated() == before
    ap_np.install()


def test_scope_is_the_calling_context():
    seen = {}
    with ap_np.installed():
        t = threading.Thread(target=lambda: seen.update(other=handler_name(np.ones(10))))
        t.start()
        t.join()
        seen["here"] = handler_name(np.ones(10))
    assert seen == {"here": ap_np.HANDLER_NAME, "other": "default_allocator"}
    assert handler_name(np.ones(10)) == "default_allocator"


def test_many_arrays_of_many_sizes_balance(handler):
    before = dict(ap_np.stats())
    arrays = [np.full(n, n % 251, dtype=np.uint8) for n in range(0, 300_000, 997)]
    for n, a in zip(range(0, 300_000, 997), arrays):
        assert a.nbytes == n and (a == n % 251).all()
    del arrays, a
    after = ap_np.stats()
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert after["num_frees"] - before["num_frees"] == after["num_allocs"] - before["num_allocs"]
    assert after["num_invalid_frees"] == 0


def test_bad_arguments_are_typed_errors_and_the_handler_stays_usable():
    """uninstall() with something that is not a handler capsule used to surface as a SystemError
    (numpy refused it with its own exception set, then ours was raised over it); host_pool("0")
    as a TypeError from the extension. Both are typed errors naming the argument now."""
    import ascend_pool as ap
    from ascend_pool.integrations.pinned import host_pool

    for bad in ("default_allocator", 5, object()):
        with pytest.raises(ap.ConfigError, match="mem_handler"):
            ap_np.uninstall(bad)
    for bad in ("0", 1.0, True, 10 ** 6):
        with pytest.raises(ap.InvalidDeviceError):
            host_pool(bad)
    with ap_np.installed():
        a = np.ones(1000)
        assert handler_name(a) == NUMPY_HANDLER_NAME
    assert handler_name() == "default_allocator"


def test_an_array_past_the_hosts_ram_is_numpys_memory_error_and_nothing_is_held(handler):
    """Pinned memory is resident: an array of twice the host's RAM cannot be pinned, on a real
    CANN nor (since ASCEND_SIM_HOST_PINNED, default the host's RAM) on the simulator, which served
    np.empty(2**40) on a 23 GiB host before. numpy raises its MemoryError; the pool holds nothing
    for it and goes on serving."""
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    before = handler.memory_stats()["reserved_bytes.all.current"]
    with pytest.raises(MemoryError):
        np.empty(2 * ram, dtype=np.uint8)
    assert handler.memory_stats()["reserved_bytes.all.current"] <= before
    a = np.ones(1000)
    assert handler_name(a) == NUMPY_HANDLER_NAME and a.sum() == 1000


def test_a_forked_child_allocates_from_numpy_and_never_touches_the_parents_pool():
    # A DataLoader-style worker forked after install(): numpy's handler context variable came
    # along, every array of the child reached the parent's host pool (its runtime unusable there,
    # its lock perhaps held by a parent thread that did not survive the fork): np.ones(1024)
    # raised a bare MemoryError. The child's new arrays come from numpy's allocator; the parent's
    # arrays stay readable and are freed in the child without touching the pool.
    import json
    import os
    with ap_np.installed():
        parent = np.arange(1 << 16, dtype=np.float64)
        holder = [np.ones(4096)]
        assert handler_name(parent) == handler_name(holder[0]) == NUMPY_HANDLER_NAME
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, never return into pytest
            try:
                os.close(r)
                x = np.ones(1024)
                y = np.zeros((256, 1024))
                y.resize((512, 1024), refcheck=False)
                got = {"sum": float(x.sum() + y.sum() + parent[:4].sum()), "new": handler_name(x),
                       "current": handler_name()}
                holder.clear()  # a parent's array freed here
                got["freed"] = True
            except BaseException as e:
                got = {"err": f"{type(e).__name__}: {e}"}
            os.write(w, json.dumps(got).encode())
            os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            out = f.read()
        _, status = os.waitpid(pid, 0)
        got = json.loads(out)
        assert status == 0 and got == {"sum": 1030.0, "new": "default_allocator", "current": "default_allocator",
                                       "freed": True}, got
        assert handler_name() == NUMPY_HANDLER_NAME and parent.sum() == sum(range(1 << 16))  # the parent's unchanged

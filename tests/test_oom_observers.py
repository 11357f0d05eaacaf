"""Out-of-memory observers, as torch's torch._C._cuda_attach_out_of_memory_observer: a program
is told of every allocation that fails for want of memory, before the error reaches the caller,
with torch's four figures (device, requested bytes, allowed bytes, device free bytes), from the
Python API and from the C ABI that frameworks call, with no pool lock held (an observer may take
a snapshot, the common use). Sizes are bytes."""

import ctypes
import logging
import sys

import pytest

import ascend_pool as ap
from ascend_pool import _core

MiB = 1 << 20


@pytest.fixture
def seen():
    calls = []

    def observer(device, size, allowed, free):
        calls.append((device, size, allowed, free))

    ap.attach_out_of_memory_observer(observer)
    yield calls
    ap.detach_out_of_memory_observer(observer)


def test_a_failed_malloc_tells_each_observer_torchs_figures_before_the_error(pool, seen):
    pool.free(pool.malloc(MiB))
    assert seen == [], "successful allocations tell nobody"
    free_before, total = pool.mem_get_info()
    with pytest.raises(ap.OutOfMemoryError):
        pool.malloc(1 << 50)  # larger than the device
    free_after = pool.mem_get_info()[0]
    assert len(seen) == 1 and seen[0][:3] == (0, 1 << 50, total), seen
    # the device's free bytes at the failure: other pools of the process (an orphan the stats
    # publisher's thread closes meanwhile) may give memory back around it
    assert min(free_before, free_after) <= seen[0][3] <= max(free_before, free_after), (seen, free_before, free_after)
    pool.set_limit(64 * MiB)  # a cap: allowed is the cap, as torch passes its fraction's maximum
    with pytest.raises(ap.OutOfMemoryError):
        pool.malloc(100 * MiB)
    assert seen[-1][:3] == (0, 100 * MiB, 64 * MiB)
    pool.set_limit(None)
    pool.free(pool.malloc(MiB))
    assert len(seen) == 2


def test_an_observer_may_snapshot_the_pool_no_lock_is_held(pool):
    snaps = []
    observer = lambda device, size, allowed, free: snaps.append(pool.snapshot())  # noqa: E731
    ap.attach_out_of_memory_observer(observer)
    try:
        keep = pool.malloc(8 * MiB)
        # Never fits beside `keep`, whatever the process's other pools give back: capped at the
        # bytes held (fail_after_bytes), a request failed only while no other pool had idle
        # cache to release to it (the out-of-memory path takes peers' cache back) nor an orphan
        # closed by the stats publisher's thread meanwhile: in the suite it sometimes succeeded.
        with pytest.raises(ap.OutOfMemoryError):
            pool.malloc(pool.mem_get_info()[1] - 4 * MiB)
    finally:
        ap.detach_out_of_memory_observer(observer)
    assert len(snaps) == 1
    live = [b for s in snaps[0]["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert [b["address"] for b in live] == [keep]
    pool.free(keep)


def test_a_tenant_over_quota_tells_the_observers(pool, seen, tmp_path, monkeypatch):
    monkeypatch.setenv("ASCEND_POOL_LEDGER_DIR", str(tmp_path))
    ctx = pool.context("oom-observed", quota="16MiB")
    try:
        keep = ctx.malloc(4 * MiB)
        with pytest.raises(ap.QuotaExceededError):
            ctx.malloc(32 * MiB)
        # the tenant's limited device, as its mem_get_info and HAMi's cudaMemGetInfo answer: the
        # quota as allowed, what is left of it as free (it gave the device's 16 GiB and free bytes)
        assert seen and seen[-1] == (0, 32 * MiB, 16 * MiB, ctx.mem_get_info()[0])
        assert ctx.mem_get_info() == (16 * MiB - ctx.memory_stats()["reserved_bytes.all.current"], 16 * MiB)
        ctx.free(keep)
    finally:
        ctx.close()


def test_an_observer_that_raises_is_logged_and_the_allocation_error_still_raised(pool, seen, caplog):
    def broken(*figures):
        raise RuntimeError("observer bug")

    ap.attach_out_of_memory_observer(broken)
    try:
        with caplog.at_level(logging.ERROR, logger="ascend_pool"), pytest.raises(ap.OutOfMemoryError):
            pool.malloc(1 << 50)
    finally:
        ap.detach_out_of_memory_observer(broken)
    assert "observer bug" in caplog.text
    assert len(seen) == 1, "the other observers are told all the same"
    pool.free(pool.malloc(MiB))


def test_bad_observers_and_detaching_are_typed_errors(seen):
    with pytest.raises(ap.ConfigTypeError, match="callable") as e:
        ap.attach_out_of_memory_observer(42)
    assert isinstance(e.value, TypeError)
    with pytest.raises(ap.ConfigError, match="not an attached") as e:
        ap.detach_out_of_memory_observer(print)
    assert isinstance(e.value, ValueError)


def test_c_abi_allocations_tell_the_observers_and_keep_their_own_error(seen):
    """Through a real dlopen of the library (ctypes releases the GIL around the call, as a
    framework's thread holds none): the C ABI takes the GIL for the observers, and the error the
    caller reads afterwards is its own even when an observer's calls set another."""
    lib = ctypes.CDLL(ap.library_path())
    lib.ascend_pool_malloc.restype = ctypes.c_void_p
    lib.ascend_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ascend_pool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ascend_pool_last_error.restype = ctypes.c_char_p
    ap.default_pool(0)

    def noisy(*figures):  # a bad free of its own: sets the thread's last error to another code
        lib.ascend_pool_free(ctypes.c_void_p(0x1234), 0, 0, None)

    ap.attach_out_of_memory_observer(noisy)
    try:
        assert lib.ascend_pool_malloc(1 << 50, 0, None) is None
        code, message = lib.ascend_pool_last_error_code(), lib.ascend_pool_last_error().decode()
    finally:
        ap.detach_out_of_memory_observer(noisy)
    assert _core.CAPI_ERRORS[code] == "OOM" and "Tried to allocate" in message, (code, message)
    assert seen == [(0, 1 << 50, ap.default_pool(0).mem_get_info()[1], seen[0][3])]
    ptr = lib.ascend_pool_malloc(4096, 0, None)  # and the C ABI keeps serving
    assert ptr
    lib.ascend_pool_free(ptr, 4096, 0, None)


def _spin():
    for _ in range(10_000):  # a pending call or signal handler runs between these bytecodes
        pass


@pytest.mark.parametrize("how", ["KeyboardInterrupt", "SIGTERM handler's sys.exit"])
def test_a_signal_handlers_exception_inside_a_c_abi_observer_reaches_the_program(how, caplog):
    """Ctrl-C, or a scheduler's SIGTERM whose handler calls sys.exit, arriving while a framework's
    allocation (the C ABI, main thread) runs the observers (a snapshot dump takes seconds): the
    exception reaches the program once the C caller is back in Python, as the signal's own would;
    it was logged as 'out-of-memory observers failed' and dropped, the program went on."""
    import signal
    import threading

    lib = ctypes.CDLL(ap.library_path())
    lib.ascend_pool_malloc.restype = ctypes.c_void_p
    lib.ascend_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    ap.default_pool(0)
    if how == "KeyboardInterrupt":
        def observer(*figures):
            raise KeyboardInterrupt  # as Python's SIGINT handler raises it, inside the observer
        expected = KeyboardInterrupt
    else:
        def observer(*figures):
            # to the main thread itself: its C handler has run when this returns (a process-wide
            # kill may be taken by another thread, late on a loaded machine)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
            _spin()
        expected = SystemExit
    old = signal.signal(signal.SIGUSR1, lambda *a: sys.exit(143))
    ap.attach_out_of_memory_observer(observer)
    try:
        with caplog.at_level(logging.ERROR, logger="ascend_pool"), pytest.raises(expected):
            assert lib.ascend_pool_malloc(1 << 50, 0, None) is None
            _spin()
    finally:
        ap.detach_out_of_memory_observer(observer)
        signal.signal(signal.SIGUSR1, old)
    assert "observers failed" not in caplog.text
    lib.ascend_pool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    ptr = lib.ascend_pool_malloc(4096, 0, None)  # the C ABI keeps serving
    assert ptr
    _spin()  # nothing left pending
    lib.ascend_pool_free(ptr, 4096, 0, None)


def test_a_mempool_refused_by_the_devices_memory_fraction_tells_the_fraction_as_allowed(seen):
    # torch's fraction caps the device's allocator, MemPools included: what a MemPool may hold is
    # the fraction's bytes, not the device's total (which the observers were told)
    default = ap.default_pool(0)
    total = default.mem_get_info()[1]
    mine = ap.Pool(0)
    try:
        ap.set_per_process_memory_fraction(0.25, 0)
        with pytest.raises(ap.OutOfMemoryError):
            mine.malloc(total // 2)
        assert seen and seen[-1][:3] == (0, total // 2, int(0.25 * total)), seen
    finally:
        ap.set_per_process_memory_fraction(1.0, 0)
        default.set_limit()
        mine.close()

"""Device waits never happen under the pool mutex, and no method waits for the mutex while
holding the GIL (issue 15, point 3; the lock table is in cython/core/pool.h).

A hung simulated stream (sim.hang_stream) stands for long device work: every test here would
block until the stream is released if the pool waited for it under its mutex. Each blocking
attempt runs on a helper thread joined with a generous bound, and the stream is always released
at the end so that nothing stays blocked.
"""
import threading
import time

import pytest

import ascend_pool as ap
from ascend_pool import sim

MiB = 1 << 20
BOUND_S = 10.0  # far above the microseconds these calls take when nothing blocks them


def _finishes(fn):
    """Runs fn on a thread; True if it returned within BOUND_S."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(BOUND_S)
    if "error" in out:
        raise out["error"]
    return not t.is_alive()


def _stuck_call(fn):
    """Starts fn on a thread (it blocks on a hung stream) and returns the thread."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    time.sleep(0.2)  # let it reach its wait
    return t


@pytest.mark.parametrize("policy", ["budgeted", "under_peak"])
def test_a_trade_skips_a_busy_streams_segment_instead_of_waiting(policy):
    pool = ap.Pool(0, backend="sim", release_policy=policy)
    s = pool.create_stream()
    work = pool.malloc(MiB, stream=s)
    a = pool.malloc(8 * MiB, stream=s)
    pool.free(a, stream=s)                   # a free segment, tagged with the busy stream
    sim.hang_stream(s)
    try:
        # reserved would pass its peak: the policy looks for segments to release, finds only the
        # busy stream's one, and must skip it rather than wait for the stream
        assert _finishes(lambda: pool.free(pool.malloc(16 * MiB))), "malloc waited for another stream"
    finally:
        sim.release_stream(s)
    pool.free(work, stream=s)
    pool.synchronize(s)
    pool.destroy_stream(s)
    pool.close()


def test_synchronize_on_a_busy_stream_does_not_block_other_threads(pool):
    s = pool.create_stream()
    sim.hang_stream(s)
    waiter = _stuck_call(lambda: pool.synchronize(s))
    try:
        assert waiter.is_alive()
        assert _finishes(lambda: pool.free(pool.malloc(3 * MiB))), "malloc blocked by another thread's synchronize"
        assert _finishes(lambda: pool.memory_stats()), "stats blocked by another thread's synchronize"
    finally:
        sim.release_stream(s)
    waiter.join(BOUND_S)
    assert not waiter.is_alive()
    pool.destroy_stream(s)


def test_empty_cache_waiting_for_a_busy_stream_does_not_block_other_threads(pool):
    s = pool.create_stream()
    y = pool.malloc(MiB)
    x = pool.malloc(4 * MiB, stream=s)
    sim.hang_stream(s)
    pool.free(x, stream=s)                    # free on the busy stream
    pool.record_stream(y, s)
    pool.free(y)                              # pending on an event behind the hang
    waiter = _stuck_call(pool.empty_cache)
    try:
        assert waiter.is_alive()
        assert _finishes(lambda: pool.free(pool.malloc(5 * MiB))), "malloc blocked by another thread's empty_cache"
    finally:
        sim.release_stream(s)
    waiter.join(BOUND_S)
    assert not waiter.is_alive()
    pool.empty_cache()
    assert pool.memory_stats()["reserved_bytes.all.current"] == 0
    pool.destroy_stream(s)


@pytest.mark.parametrize("call", ["block_info", "reset_peak_stats", "segment_kind"])
def test_methods_waiting_for_the_mutex_release_the_gil(pool, call):
    ptr = pool.malloc(MiB)
    order = []
    holder = threading.Thread(target=lambda: (pool._hold_lock_for_test(1.0), order.append("released")))
    holder.start()
    time.sleep(0.2)                           # the mutex is held now
    args = () if call == "reset_peak_stats" else (ptr,)
    caller = threading.Thread(target=lambda: getattr(pool, call)(*args))
    caller.start()
    time.sleep(0.1)                           # the caller is blocked on the mutex now
    order.append("interpreter ran")           # only possible if the caller let go of the GIL
    holder.join()
    caller.join()
    assert order == ["interpreter ran", "released"]
    pool.free(ptr)

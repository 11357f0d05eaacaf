"""Waits on a hung stream are bounded by one sync_timeout_ms, however many frees wait on it, and
a free that could neither record an event nor finish its wait never hands the block out while
the stream may still use it (stress audit: N pending frees took N times the limit; the block was
reused after a timed-out wait, and the stream's work overwrote its new owner's data)."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

import ascend_pool as ap
from ascend_pool import sim

MiB = 1 << 20


@pytest.mark.parametrize("expandable", [False, True], ids=["classic", "expandable"])
def test_many_frees_pending_on_a_hung_stream_wait_one_limit(expandable):
    limit_ms, n = 1000, 8  # n limits would be 8 s: told apart from one however loaded the machine
    pool = ap.Pool(0, backend="sim", expandable_segments=expandable, sync_timeout_ms=limit_ms)
    s1, s2 = pool.create_stream(), pool.create_stream()
    sim.hang_stream(s1)
    try:
        blocks = [pool.malloc((i % 3 + 1) * MiB, stream=s1) for i in range(n)]
        for b in blocks:
            pool.record_stream(b, s2)
            pool.free(b, stream=s1)
        for call in (pool.empty_cache, lambda: pool.synchronize(s1), lambda: pool.destroy_stream(s1)):
            start = time.monotonic()
            with pytest.raises(ap.DeviceTimeoutError):
                call()
            # one limit (plus scheduling), not n of them (n * 1 s = 8 s before)
            assert time.monotonic() - start < 4 * limit_ms / 1000
        start = time.monotonic()
        pool.destroy_stream(s2)  # idle: the frees' events on it are done, s1's are not its own
        assert time.monotonic() - start < limit_ms / 1000
        pool._check_invariants()
    finally:
        sim.release_stream(s1)
    pool.synchronize(s1)
    pool.empty_cache()
    assert pool.memory_stats()["reserved_bytes.all.current"] == 0
    pool.close()


@pytest.mark.parametrize("expandable", [False, True], ids=["classic", "expandable"])
def test_close_with_many_frees_pending_on_a_hung_stream_waits_one_limit(expandable):
    """close() waits for the pending frees and the tagged streams within one sync_timeout_ms in
    all, as its docstring says: its blocking pass waited a full limit for each pending free (a
    program closing its pool behind a dead collective's stream waited n minutes, not one)."""
    limit_ms, n = 1000, 8  # n limits would be 8 s: told apart from one however loaded the machine
    pool = ap.Pool(0, backend="sim", expandable_segments=expandable, sync_timeout_ms=limit_ms)
    s1, s2 = pool.create_stream(), pool.create_stream()
    sim.hang_stream(s2)
    try:
        for i in range(n):
            b = pool.malloc((i % 3 + 1) * MiB, stream=s1)
            pool.record_stream(b, s2)
            pool.free(b, stream=s1)
        held = sim.stats(0)["bytes_held"]
        start = time.monotonic()
        pool.close()
        # one limit (plus scheduling), not n of them (8 s before)
        assert time.monotonic() - start < 4 * limit_ms / 1000
        assert sim.stats(0)["bytes_held"] < held  # its memory went back all the same
    finally:
        sim.release_stream(s2)


def test_a_free_without_events_never_reuses_a_block_a_stream_still_writes(tmp_path):
    # the device's events all in use (a limit of 2, held by two pending frees on a hung stream):
    # the free waits for the using stream instead, and that wait times out; the block must stay
    # pending until the stream is done, not be handed to the next malloc
    body = textwrap.dedent("""
        import time
        import ascend_pool as ap
        from ascend_pool import sim
        N = 1 << 20
        pool = ap.Pool(0, sync_timeout_ms=200)
        s_alloc, s_use, busy = pool.create_stream(), pool.create_stream(), pool.create_stream()
        sim.hang_stream(busy)
        for _ in range(2):
            x = pool.malloc(4096, stream=s_alloc)
            pool.record_stream(x, busy)
            pool.free(x, stream=s_alloc)
        b = pool.malloc(N, stream=s_alloc)
        sim.launch_fill(s_use, b, N, 0xAA, delay_s=0.8)  # a kernel still writing b
        pool.record_stream(b, s_use)
        pool.free(b, stream=s_alloc)
        c = pool.malloc(N, stream=s_alloc)
        sim.launch_fill(s_alloc, c, N, 0x11)
        pool.synchronize(s_alloc)
        deadline = time.monotonic() + 60
        while True:  # the kernel's 0.8 s, however long a loaded machine makes them
            try:
                pool.synchronize(s_use)
                break
            except ap.DeviceTimeoutError:
                assert time.monotonic() < deadline
        print("reused", c == b, "data", sim.read(c, 8).hex())
        sim.release_stream(busy)
        pool.synchronize(busy)
        pool.close()
        print("held", sim.stats(0)["bytes_held"])
    """)
    env = dict(os.environ, ASCEND_SIM_NODE=f"wait-bounds-{os.getpid()}", ASCEND_SIM_EVENT_LIMIT="2",
               ASCEND_POOL_STATS="0")
    out = subprocess.run([sys.executable, "-c", body], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "reused False data 1111111111111111" in out.stdout and "held 0" in out.stdout, out.stdout

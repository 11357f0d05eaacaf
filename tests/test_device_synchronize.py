"""ap.synchronize() with no stream is torch.npu.synchronize(device) / torch.cuda.synchronize():
all work of the device, every stream the process has there (aclrtSynchronizeDevice), and the
pools' frees that the wait completed are settled. Before 2026-12-06 it waited for the default
stream only, and a block freed behind a busy side stream stayed pending after it."""

import ctypes
import os
import subprocess
import sys
import textwrap
import time

import pytest

import ascend_pool as ap
from ascend_pool import sim

MiB = 1 << 20


@pytest.mark.parametrize("diverted", [False, True], ids=["default_pool", "user_mempool"])
def test_mempool_block_free_not_deferred_by_a_device_synchronize(diverted, block_freed_behind_a_stream):
    # torch_npu's test_mempool_block_free_not_deferred, literally: torch.npu.synchronize(), no
    # stream, the side stream's kernel still running at the free
    a, b, mallocs = block_freed_behind_a_stream(diverted, lambda s2: ap.synchronize(), delay_s=0.3)
    assert b == a
    assert mallocs == 0  # no new device allocation for it
    assert sim.read(a, 4) == b"\x01" * 4  # the kernel had run


def test_synchronize_waits_for_a_stream_no_pool_knows():
    # a framework's own stream (never named to a pool): torch.npu.synchronize() waits for it too
    backend = ap.default_pool(0).backend
    s = backend.stream_create(0)
    ptr = ap.malloc(MiB)
    try:
        sim.launch_fill(s, ptr, 4096, 0x3C, delay_s=0.3)
        ap.synchronize()
        assert sim.read(ptr, 4096) == b"\x3c" * 4096
    finally:
        backend.stream_sync(s)
        backend.stream_destroy(s)
        ap.free(ptr)


def test_synchronize_of_another_device_waits_there_and_keeps_the_current_device():
    assert ap.default_pool(0).backend.device_count >= 2, "the simulated node has several devices"
    acl = sim.attach()
    before = ap.current_device()
    ap.set_device(0)
    ctx_before = ctypes.c_void_p()
    try:
        s = ap.create_stream(device=1)
        ptr = ap.malloc(MiB, device=1)
        ap.record_stream(ptr, s)
        sim.launch_fill(s, ptr, MiB, 0x5A, delay_s=0.3)
        ap.free(ptr, device=1)
        acl.aclrtGetCurrentContext(ctypes.byref(ctx_before))
        ap.synchronize(device=1)
        ctx_after = ctypes.c_void_p()
        acl.aclrtGetCurrentContext(ctypes.byref(ctx_after))
        assert ap.current_device() == 0 and ctx_after.value == ctx_before.value
        assert sim.read(ptr, 4) == b"\x5a" * 4
        # the free settled on device 1: its next request of the size reuses the block
        again = ap.malloc(MiB, device=1)
        assert again == ptr
        ap.free(again, device=1)
        ap.destroy_stream(s)
    finally:
        ap.set_device(before)


def test_a_device_synchronize_past_the_limit_is_a_device_timeout(tmp_path):
    body = textwrap.dedent("""
        import time
        import ascend_pool as ap
        from ascend_pool import sim
        s = ap.create_stream()
        sim.hang_stream(s)
        sim.launch_fill(s, ap.malloc(1 << 20), 64, 1)
        start = time.monotonic()
        try:
            ap.synchronize()
            print("returned")
        except ap.DeviceTimeoutError as e:
            print("timeout", round(time.monotonic() - start, 1), str(e)[:60])
        sim.release_stream(s)
        ap.synchronize()
        print("after release ok")
    """)
    env = dict(os.environ, ASCEND_SIM_NODE=f"devsync-{os.getpid()}", ASCEND_POOL_CONF="sync_timeout_ms:400",
               ASCEND_POOL_STATS="0")
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", body], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "timeout" in out.stdout and "after release ok" in out.stdout, out.stdout
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("limit", ["60000", "-1"], ids=["bounded", "forever"])
def test_a_runtime_without_a_timed_device_wait_settles_the_pools_streams(tmp_path, limit):
    # an old CANN (the simulator's legacy build) lacks aclrtSynchronizeDeviceWithTimeout: a bounded
    # synchronize waits for every stream the pools know instead; -1 (no limit) takes
    # aclrtSynchronizeDevice, which it has
    body = textwrap.dedent("""
        import ascend_pool as ap
        from ascend_pool import sim
        sim.attach(sim.library_path(legacy=True))
        s = ap.create_stream()
        a = ap.malloc(1 << 20)
        ap.record_stream(a, s)
        sim.launch_fill(s, a, 1 << 20, 7, delay_s=0.3)
        ap.free(a)
        ap.synchronize()
        mallocs = sim.stats(0)["mallocs"]
        b = ap.malloc(1 << 20)
        print("reused", b == a, "new", sim.stats(0)["mallocs"] - mallocs, "data", sim.read(a, 2).hex())
    """)
    env = dict(os.environ, ASCEND_SIM_NODE=f"devsync-legacy-{os.getpid()}", ASCEND_POOL_BACKEND="acl",
               ASCEND_POOL_ACL_LIB=sim.library_path(legacy=True), ASCEND_POOL_CONF=f"sync_timeout_ms:{limit}",
               ASCEND_POOL_STATS="0")
    out = subprocess.run([sys.executable, "-c", body], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "reused True new 0 data 0707" in out.stdout, out.stdout


def test_a_bounded_synchronize_without_a_device_wait_settles_the_frees_of_more_than_64_streams(tmp_path):
    # the legacy build has no aclrtSynchronizeDeviceWithTimeout: a bounded synchronize waits for
    # every stream the pools know, in rounds of 64 (ap_wait_unlocked's batch); one round only left
    # the free behind the 80th stream's longer kernel pending after it
    body = textwrap.dedent("""
        import ascend_pool as ap
        from ascend_pool import sim
        sim.attach(sim.library_path(legacy=True))
        streams = [ap.create_stream() for _ in range(80)]
        ptrs = [ap.malloc(1 << 20) for _ in streams]
        for s, a in zip(streams, ptrs):
            ap.record_stream(a, s)
            sim.launch_fill(s, a, 4096, 7, delay_s=1.0 if s is streams[-1] else 0.05)
            ap.free(a)
        ap.synchronize()
        print("pending", ap.memory_stats()["pending_free_blocks"], "data", sim.read(ptrs[-1], 2).hex())
        for s in streams:
            ap.destroy_stream(s)
    """)
    env = dict(os.environ, ASCEND_SIM_NODE=f"devsync-80-{os.getpid()}", ASCEND_POOL_BACKEND="acl",
               ASCEND_POOL_ACL_LIB=sim.library_path(legacy=True), ASCEND_POOL_CONF="sync_timeout_ms:60000",
               ASCEND_POOL_STATS="0")
    out = subprocess.run([sys.executable, "-c", body], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pending 0 data 0707" in out.stdout, out.stdout

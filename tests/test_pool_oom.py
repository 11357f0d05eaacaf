"""The out-of-memory path: trim the cache, wait, retry; only then a typed error. The pool keeps
serving afterwards."""

import re

import pytest

import ascend_pool as ap
from ascend_pool import sim

MiB = 1 << 20


@pytest.fixture(autouse=True)
def no_faults(clean_faults):
    yield


def test_failed_device_malloc_is_retried_after_releasing_the_cache(pool):
    pool.free(pool.malloc(20 * MiB))          # 20 MiB cached, too small for what follows
    sim.set_faults(fail_malloc_nth=1)         # the next device malloc fails once
    ptr = pool.malloc(30 * MiB)
    st = pool.memory_stats()
    assert st["num_alloc_retries"] == 1
    assert st["num_ooms"] == 0
    assert st["num_device_free"] == 1         # the cached 20 MiB went back first
    assert st["reserved_bytes.all.current"] == 32 * MiB
    pool.free(ptr)


@pytest.mark.parametrize("request_mib, fits", [(25, True), (100, False)], ids=["served", "refused"])
def test_taking_back_the_peers_cache_is_still_one_retry(pool, peers_idle_released, request_mib, fits):
    # torch counts one retry per allocation that freed the cache and tried again; a pool that
    # also takes back its peers' idle cache tries a third time and counted two.
    peer = ap.Pool(0, backend="sim", use_on_oom=True)  # a MemPool without it keeps its cache, as torch's
    try:
        peer.free(peer.malloc(20 * MiB))  # idle in the peer
        sim.set_faults(fail_after_bytes=sim.stats(0)["bytes_held"] + 10 * MiB)
        if fits:
            pool.free(pool.malloc(request_mib * MiB))
        else:
            with pytest.raises(ap.OutOfMemoryError):
                pool.malloc(request_mib * MiB)
        st = pool.memory_stats()
        assert (st["num_alloc_retries"], st["num_ooms"]) == (1, 0 if fits else 1)
        assert peer.memory_stats()["reserved_bytes.all.current"] == 0, "the peer gave its idle cache back"
    finally:
        peer.close()


def test_out_of_memory_error_explains_the_pool_and_device(pool):
    keep = pool.malloc(64 * MiB)
    held = sim.stats(0)["bytes_held"]
    sim.set_faults(fail_after_bytes=held + 10 * MiB)
    with pytest.raises(ap.OutOfMemoryError) as info:
        pool.malloc(100 * MiB)
    msg = str(info.value)
    for part in ("out of memory", "Tried to allocate 100.00 MiB (104857600 bytes)", "device 0", "reserved", "allocated",
                 "cached free", "largest free block", "external fragmentation", "free of"):
        assert part in msg, part
    st = pool.memory_stats()
    assert st["num_ooms"] == 1
    assert st["num_alloc_retries"] == 1
    assert st["num_sync_all_streams"] == 1
    # keeps serving: a request that fits still works, and after the fault is gone so do big ones
    small = pool.malloc(4 * MiB)
    sim.reset_faults()
    big = pool.malloc(100 * MiB)
    for p in (keep, small, big):
        pool.free(p)
    assert pool.memory_stats()["allocation.all.current"] == 0


def test_memory_fraction_limit_is_an_out_of_memory_error():
    total = sim.stats(0)["total_bytes"]
    p = ap.Pool(0, backend="sim", memory_fraction=0.001)   # ~64 MiB of a 64 GiB device
    try:
        a = p.malloc(int(total * 0.0005))
        with pytest.raises(ap.OutOfMemoryError, match="limit"):
            p.malloc(int(total * 0.0008))
        p.free(a)
        b = p.malloc(int(total * 0.0008))    # fits once the first is freed (cache trimmed)
        p.free(b)
    finally:
        p.close()


@pytest.mark.parametrize("expandable", [False, True], ids=["classic", "expandable"])
def test_refusals_by_the_cap_count_as_torchs_num_oom_rejections(expandable):
    # torch >= 2.13's memory_stats key: allocations refused by the memory-fraction cap before any
    # device call (throw_on_cudamalloc_oom / throw_on_npumalloc_oom, which this pool always does);
    # each is an OOM too. A device that is itself full is no rejection. The key was missing.
    p = ap.Pool(0, backend="sim", expandable_segments=expandable)
    try:
        assert p.memory_stats()["num_oom_rejections"] == 0
        p.set_limit(8 * MiB)
        keep = p.malloc(4 * MiB)
        for size in (16 * MiB, 6 * MiB):
            with pytest.raises(ap.OutOfMemoryError, match="limit"):
                p.malloc(size)
        with pytest.raises(ap.OutOfMemoryError):
            p.share_malloc(16 * MiB)
        st = p.memory_stats()
        assert (st["num_oom_rejections"], st["num_ooms"]) == (3, 3)
        p.set_limit(None)
        sim.set_faults(fail_after_bytes=sim.stats(0)["bytes_held"] + 10 * MiB)  # the device is full: no rejection
        with pytest.raises(ap.OutOfMemoryError):
            p.malloc(64 * MiB)
        sim.reset_faults()
        st = p.memory_stats()
        assert (st["num_oom_rejections"], st["num_ooms"]) == (3, 4)
        p.reset_accumulated_stats()
        assert p.memory_stats()["num_oom_rejections"] == 0
        p.free(keep)
    finally:
        p.close()


def test_device_exhaustion_across_pools_on_one_device():
    total = sim.stats(1)["total_bytes"]
    a, b = ap.Pool(1, backend="sim"), ap.Pool(1, backend="sim")
    try:
        big = a.malloc(total // 2 + 4 * MiB)
        with pytest.raises(ap.OutOfMemoryError):
            b.malloc(total // 2)
        a.free(big)
        a.empty_cache()
        b.free(b.malloc(total // 2))
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("kind", ["larger than the device", "device exhausted", "pool limit"])
def test_out_of_memory_messages_use_pytorchs_words(pool, kind):
    # Users (and PyTorch's own tests) match "out of memory" and "Tried to allocate".
    if kind == "pool limit":
        pool.set_limit(64 * MiB)
    elif kind == "device exhausted":
        sim.set_faults(fail_after_bytes=sim.stats(0)["bytes_held"] + 10 * MiB)
    # PyTorch's size format (c10::format_size), as its test_out_of_memory matches "800000000.00 GiB"
    size, words = (2**50, "1048576.00 GiB") if kind == "larger than the device" else (100 * MiB, "100.00 MiB")
    with pytest.raises(ap.OutOfMemoryError, match=rf"out of memory: Tried to allocate {words} \({size} bytes\)") as e:
        pool.malloc(size)
    # torch's torch.OutOfMemoryError is a RuntimeError (its tests assertRaises(RuntimeError)),
    # CuPy's a MemoryError: ours is both
    assert isinstance(e.value, RuntimeError) and isinstance(e.value, MemoryError)
    pool.set_limit(None)
    pool.free(pool.malloc(MiB))  # and the pool keeps serving


def test_a_request_beyond_the_device_names_its_total_capacity_and_torchs_1eb_words(pool):
    # torch: "Tried to allocate more than 1EB memory" from 2**60 bytes on (test_cuda's
    # test_out_of_memory allocates 8e18 bytes); below that the size, then the device's "total capacity"
    total = pool.memory_stats()["device_total_bytes"]
    with pytest.raises(ap.OutOfMemoryError, match=r"Tried to allocate more than 1EB memory \(8000000000000000000 bytes\) "
                                                  r"on device 0, which has a total capacity of"):
        pool.malloc(8 * 10**18)
    cap = f"{total / 2**30:.2f} GiB ({total} bytes)"
    with pytest.raises(ap.OutOfMemoryError, match=rf"Tried to allocate 1024\.00 GiB \(1099511627776 bytes\) on device 0, "
                                                  rf"which has a total capacity of {re.escape(cap)}: larger than the device"):
        pool.malloc(1 << 40)
    pool.free(pool.malloc(MiB))


@pytest.mark.parametrize("size,words", [(512, "512 bytes"), (1024, "1024 bytes"), (1536, r"1\.50 KiB \(1536 bytes\)"),
                                        (3 * MiB // 2, r"1\.50 MiB \(1572864 bytes\)")])
def test_out_of_memory_sizes_are_written_as_pytorchs(pool, size, words):
    # c10::format_size: bytes up to 1 KiB, then KiB up to 1 MiB, MiB up to 1 GiB, two decimals
    sim.set_faults(fail_after_bytes=sim.stats(0)["bytes_held"])  # no segment can be had
    with pytest.raises(ap.OutOfMemoryError, match=f"Tried to allocate {words} on device 0"):
        pool.malloc(size)


def test_out_of_memory_message_keeps_the_runtimes_cause_whole(pool):
    sim.set_faults(fail_after_bytes=sim.stats(0)["bytes_held"] + 10 * MiB)
    with pytest.raises(ap.OutOfMemoryError) as info:
        pool.malloc(2**35)  # 32 GiB: every figure in the message has 11 digits
    cause = str(info.value).split("Cause: ", 1)[1]
    # the simulator's reason, to its last words (it was cut at 319 characters of the whole message)
    assert "device malloc of" in cause and "fail_after_bytes=" in cause and cause.endswith("(aclError 207001)"), cause


@pytest.mark.parametrize("expandable", [False, True], ids=["classic", "expandable"])
def test_a_reserve_the_device_cannot_hold_is_an_out_of_memory_error(expandable):
    # Another process took the memory between the free-bytes check and the reserve's allocation
    # (here: the device refuses the next malloc): an OutOfMemoryError as any allocation's, naming
    # the reserve (it was the runtime's DeviceError 207001); nothing is left allocated.
    held = sim.stats(0)["bytes_held"]
    sim.set_faults(fail_malloc_nth=1)
    with pytest.raises(ap.OutOfMemoryError, match="reserve of 67108864 bytes on device 0"):
        ap.Pool(0, backend="sim", reserve="64MiB", expandable_segments=expandable)
    assert sim.stats(0)["bytes_held"] == held


_OWN_LIMIT_REFUSAL = """
import ascend_pool as ap
MiB = 1 << 20
default = ap.default_pool(0)
default.free(default.malloc(20 * MiB))
idle = default.total_bytes()
mp = ap.Pool(0, memory_fraction=3 * MiB / ap.mem_get_info(0)[1])
a = mp.malloc(MiB + MiB // 2)
try:
    mp.malloc(900 * 1024)
except ap.OutOfMemoryError:
    print("refused", default.total_bytes() == idle)
"""


def test_a_refusal_by_a_pools_own_limit_leaves_the_other_pools_cache():
    """Only a refusal by the device's memory fraction lets the other pools' idle cache make room: a
    MemPool (expandable, its own 3 MiB limit) whose 900 KiB request fit its limit but whose 2 MiB
    page did not was counted the fraction's (the request was compared, not the growth), and the
    default pool's idle 20 MiB went back to the device for a request refused anyway, with no
    fraction set at all (repros/own_limit_refusal_takes_peers_cache.py). A fresh process: the
    default pool takes the variable's knobs."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(ap.__file__))),
               ASCEND_POOL_CONF="expandable_segments:True,release_policy:never")
    proc = subprocess.run([sys.executable, "-c", _OWN_LIMIT_REFUSAL], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["refused", "True"]

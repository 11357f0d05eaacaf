"""The pinned host pool behind the numpy handler and staging copies: power-of-two classes, slabs
for small buffers, reuse without runtime calls, realloc, and event-guarded reuse of buffers that
queued device work still uses."""

import bisect
import ctypes
import threading

import numpy as np
import pytest

import ascend_pool as ap
from ascend_pool import sim
from ascend_pool._core import HostPool


@pytest.fixture
def hp():
    pool = HostPool(ap.default_pool(0).backend, 0)
    yield pool
    pool.close()


def test_classes_are_powers_of_two_from_512_bytes(hp):
    assert [hp.class_size(n) for n in (1, 512, 513, 4096, 4097, 1 << 20, (1 << 20) + 1)] == [
        512, 512, 1024, 4096, 8192, 1 << 20, 2 << 20]
    assert hp.class_size(0) == 0 and hp.class_size(1 << 41) == 0


def test_class_size_of_what_is_no_byte_count_is_an_invalid_size_error(hp):
    """class_size took a C size_t: -1 was a bare OverflowError, "x" or 1.5 a bare TypeError, and a
    size past 2**64 an OverflowError where no class holds it (0, as for 2**41). malloc's words now."""
    import numpy as np
    for bad, words in ((-1, "size must be positive, got -1 bytes"), ("x", "got str 'x'"), (1.5, "got float 1.5"),
                       (True, "got bool True")):
        with pytest.raises(ap.InvalidSizeError, match=words):
            hp.class_size(bad)
    assert hp.class_size(2**63) == hp.class_size(2**70) == hp.class_size(np.uint64(0)) == 0
    assert hp.class_size(np.int64(4097)) == 8192


def test_small_buffers_share_slabs_and_are_reused(hp):
    ptrs = [hp.malloc(100) for _ in range(64)]
    st = hp.memory_stats()
    assert st["num_host_alloc"] == 1 and st["reserved_bytes.all.current"] == 64 * 512  # one slab
    assert len(set(ptrs)) == 64 and all(b - a == 512 for a, b in zip(sorted(ptrs), sorted(ptrs)[1:]))
    extra = hp.malloc(1)
    assert hp.memory_stats()["num_host_alloc"] == 2  # the 65th opens a second slab
    hp.free(ptrs[10])
    assert hp.malloc(300) == ptrs[10]  # reused at once, no runtime call
    assert hp.memory_stats()["num_host_alloc"] == 2
    for p in ptrs + [extra]:
        hp.free(p)
    st = hp.memory_stats()
    assert st["allocated_bytes.all.current"] == st["requested_bytes.all.current"] == 0
    assert st["cached_free_bytes"] == st["reserved_bytes.all.current"] == 2 * 64 * 512
    hp.empty_cache()
    st = hp.memory_stats()
    assert st["reserved_bytes.all.current"] == st["segment.all.current"] == 0 and st["num_host_free"] == 2


def test_big_buffers_are_runtime_allocations_of_their_own(hp):
    p = hp.malloc(3 << 20)
    assert hp.block_info(p) == (p, 4 << 20, 3 << 20)
    ctypes.memset(p, 0xEE, 3 << 20)
    hp.free(p)
    q = hp.malloc(4 << 20)
    assert q == p and hp.memory_stats()["num_host_alloc"] == 1
    hp.free(q)
    hp.empty_cache()
    assert hp.memory_stats()["reserved_bytes.all.current"] == 0


def test_realloc_in_place_within_a_class_else_moved_with_data(hp):
    p = hp.malloc(1000)
    ctypes.memmove(p, bytes(range(256)) * 4, 1000)
    assert hp.realloc(p, 1024) == p
    q = hp.realloc(p, 100_000)
    assert q != p and ctypes.string_at(q, 1000) == (bytes(range(256)) * 4)[:1000]
    assert hp.block_info(p) is None and hp.block_info(q) == (q, 128 << 10, 100_000)
    r = hp.realloc(q, 10)
    assert ctypes.string_at(r, 10) == bytes(range(10))
    hp.free(r)
    assert hp.memory_stats()["allocation.all.current"] == 0


def test_unknown_and_double_frees_are_refused(hp):
    p = hp.malloc(100)
    with pytest.raises(ap.InvalidPointerError):
        hp.free(p + 8)
    hp.free(p)
    with pytest.raises(ap.InvalidPointerError, match="freed twice"):
        hp.free(p)
    with pytest.raises(ap.InvalidSizeError):
        hp.malloc(0)
    assert hp.memory_stats()["num_invalid_frees"] == 2


def test_a_buffer_used_by_queued_work_waits_for_it(hp):
    pool = ap.default_pool(0)
    stream = pool.create_stream()
    dev = pool.malloc(1 << 16)
    try:
        buf = hp.malloc(1 << 16)
        sim.launch_fill(stream, dev, 1 << 16, 0x42, delay_s=0.3)  # stands for a copy from buf
        hp.record_stream(buf, stream)
        hp.free(buf)
        st = hp.memory_stats()
        assert st["pending_free_blocks"] == 1 and st["pending_free_bytes"] == 1 << 16
        other = hp.malloc(1 << 16)
        assert other != buf  # the stream may still be reading buf
        pool.synchronize(stream)
        again = hp.malloc(1 << 16)
        assert again == buf  # its event completed: reusable
        assert hp.memory_stats()["pending_free_blocks"] == 0 and hp.memory_stats()["events_created"] == 1
        hp.free(other)
        hp.free(again)
        # A second round reuses the cached event.
        b2 = hp.malloc(1 << 16)
        hp.record_stream(b2, stream)
        hp.free(b2)
        hp.empty_cache()  # waits for parked buffers first
        st = hp.memory_stats()
        assert st["events_created"] == 1 and st["pending_free_blocks"] == 0
        assert st["reserved_bytes.all.current"] == 0
    finally:
        pool.free(dev)
        pool.destroy_stream(stream)


def test_a_buffer_used_by_more_streams_than_it_holds_at_first_waits_for_each(hp):
    # torch's host allocator keeps a buffer's streams in a set with no limit; the 9th was refused
    # with InvalidStreamError, and a caller that went on freed the buffer under that stream's copy.
    pool = ap.default_pool(0)
    streams = [pool.create_stream() for _ in range(20)]
    dev = pool.malloc(1 << 16)
    try:
        buf = hp.malloc(1 << 16)
        for s in streams:
            hp.record_stream(buf, s)
        hp.record_stream(buf, streams[9])  # already marked: no second use
        sim.hang_stream(streams[9])       # the 10th stream's copy still runs
        sim.launch_fill(streams[9], dev, 1 << 16, 0x42)
        hp.free(buf)
        assert hp.memory_stats()["pending_free_blocks"] == 1
        other = hp.malloc(1 << 16)
        assert other != buf, "reused while the 10th stream that used it still runs"
        sim.release_stream(streams[9])
        for s in streams:
            pool.synchronize(s)
        again = hp.malloc(1 << 16)
        assert again == buf  # every event completed: reusable
        hp.record_stream(again, streams[0])  # its uses, grown, serve the next round
        hp.free(again)
        hp.free(other)
        hp.empty_cache()
        assert hp.memory_stats()["pending_free_blocks"] == 0
    finally:
        sim.release_stream(streams[9])
        for s in streams:
            pool.synchronize(s)
            pool.destroy_stream(s)
        pool.free(dev)


def test_threads_share_a_pool_without_overlap(hp):
    live, guard, errors = [], threading.Lock(), []

    def worker(seed):
        import random

        rnd = random.Random(seed)
        held = []
        for _ in range(500):
            if held and rnd.random() < 0.5:
                p, n = held.pop()
                with guard:
                    live.remove((p, p + n))
                hp.free(p)
            else:
                n = rnd.choice([8, 600, 5000, 70_000, 1 << 20])
                p = hp.malloc(n)
                with guard:
                    i = bisect.bisect(live, (p, p + n))
                    if (i and live[i - 1][1] > p) or (i < len(live) and live[i][0] < p + n):
                        errors.append(hex(p))
                    live.insert(i, (p, p + n))
                held.append((p, n))
        for p, n in held:
            with guard:
                live.remove((p, p + n))
            hp.free(p)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert hp.memory_stats()["allocated_bytes.all.current"] == 0


# Each in a child process on its own simulated node: device references are counted per process.
import os  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401  (pytest fixture)


def test_a_host_pool_holds_a_device_reference_for_its_life(sim_node):
    """CANN releases a device (its default context, streams and events) at its last
    aclrtResetDevice, and asks that events go first. A host pool used with no device pool open
    held no reference: each of its runtime calls set the device up and tore it down again, under
    its pinned memory and its events (device_refs 0 while it held both)."""
    sim_node.run("""
        from ascend_pool._core import Backend, HostPool
        b = Backend("sim")
        hp = HostPool(b, 0)
        p = hp.malloc(4096)
        hp.record_stream(p, None)
        hp.free(p)                                     # parked behind an event
        assert sim.stats(0)["device_refs"] == 1, sim.stats(0)["device_refs"]
        hp.close()
        assert sim.stats(0)["device_refs"] == 0
    """)


def test_a_buffer_marked_with_another_devices_default_stream_waits_for_that_stream(sim_node):
    """record_stream(ptr, None, device=1) is device 1's default stream. The host pool never named
    the device to the backend, so its record ran on the default stream of the device the thread
    used last (0 here): refused, and the fallback waited for device 0's stream: the buffer was
    handed out again while device 1's default stream still ran."""
    sim_node.run("""
        import ascend_pool as ap
        from ascend_pool._core import HostPool
        pool0 = ap.default_pool(0)
        x = pool0.malloc(1 << 20)                       # this thread's last device: 0
        ready, done = threading.Event(), threading.Event()
        def dev1():                                     # device 1's default stream, busy
            ok("aclrtSetDevice", 1); sim.hang_stream(None); ready.set(); done.wait()
            sim.release_stream(None); ok("aclrtSynchronizeStream", None)
        t = threading.Thread(target=dev1, daemon=True); t.start(); ready.wait()
        hp = HostPool(pool0.backend, 1)
        p = hp.malloc(4096)
        hp.record_stream(p, None)
        hp.free(p)
        assert hp.memory_stats()["pending_free_blocks"] == 1
        assert hp.malloc(4096) != p                     # not reused while the stream runs
        done.set(); t.join()
        hp.empty_cache()
        assert hp.memory_stats()["pending_free_blocks"] == 0
        hp.close()
    """)


def test_cupys_pinned_memory_pool_tests_port_to_the_host_pool(hp):
    # CuPy's test_pinned_memory.py TestSingleDeviceMemoryPool on PinnedMemoryPool's names:
    # n_free_blocks() counts the buffers cached ready for reuse (the unused rest of a slab too),
    # free_all_blocks() gives them back; used/total/free_bytes as CuPy's MemoryPool's
    assert hp.n_free_blocks() == 0                       # test_n_free_blocks_without_malloc
    hp.free_all_blocks()                                 # test_free_all_blocks_without_malloc
    assert (hp.n_free_blocks(), hp.used_bytes(), hp.total_bytes(), hp.free_bytes()) == (0, 0, 0, 0)
    p1, p2, p3 = hp.malloc(1000), hp.malloc(1000), hp.malloc(2000)
    assert len({p1, p2, p3}) == 3                        # test_alloc
    slabs = 64 * 1024 + 64 * 2048                        # a slab of the 1 KiB class, one of the 2 KiB
    assert hp.n_free_blocks() == 2 * 64 - 3
    assert (hp.used_bytes(), hp.total_bytes(), hp.free_bytes()) == (4096, slabs, slabs - 4096)
    hp.free(p1)
    assert hp.n_free_blocks() == 2 * 64 - 2              # test_free_all_blocks2: one more free block
    assert hp.malloc(1000) == p1                         # test_free: reused
    hp.free(p1)
    p4 = hp.malloc(2000)
    assert p4 != p1                                      # test_free_different_size
    big = hp.malloc(3 << 20)
    hp.free(big)
    assert hp.n_free_blocks() == 2 * 64 - 3 + 1          # the freed big buffer is cached too
    hp.free_all_blocks()                                 # it goes back; slabs with a buffer in use stay
    assert (hp.n_free_blocks(), hp.total_bytes()) == (2 * 64 - 3, slabs)
    for p in (p2, p3, p4):
        hp.free(p)
    assert hp.n_free_blocks() == 2 * 64
    hp.free_all_blocks()
    assert (hp.n_free_blocks(), hp.used_bytes(), hp.total_bytes(), hp.free_bytes()) == (0, 0, 0, 0)


def test_a_parked_buffer_is_not_a_free_block_until_its_work_is_done(hp):
    pool = ap.default_pool(0)
    stream = pool.create_stream()
    dev = pool.malloc(1 << 16)
    try:
        buf = hp.malloc(3 << 20)                         # a buffer of its own: no slab neighbours
        sim.launch_fill(stream, dev, 1 << 16, 0x42, delay_s=0.3)
        hp.record_stream(buf, stream)
        hp.free(buf)
        assert hp.n_free_blocks() == 0 and hp.free_bytes() == 4 << 20  # held, not reusable yet
        hp.free_all_blocks()                             # waits for the work, then gives it back
        assert (hp.n_free_blocks(), hp.total_bytes()) == (0, 0)
    finally:
        pool.free(dev)
        pool.destroy_stream(stream)


def test_torchs_host_memory_stats_port_to_the_host_pool():
    # torch_npu's test_host_memory_stats (torch's test_cuda.py one too) on the pinned pool, in
    # torch's schema: allocations / allocated_bytes are the runtime allocations the pool holds
    # (here a slab serves many buffers), active_requests / active_bytes the buffers not yet
    # reusable; the accumulated figures and call counts start again at reset_accumulated
    from ascend_pool.integrations import pinned

    hp = HostPool(ap.default_pool(0).backend, 0)
    try:
        keys = {f"{name}.{m}" for name in ("allocations", "allocated_bytes", "active_requests", "active_bytes")
                for m in ("current", "peak", "allocated", "freed")}
        keys |= {f"{name}.{m}" for name in ("host_alloc_time", "host_free_time")
                 for m in ("total", "max", "min", "count", "avg")} | {"num_host_alloc", "num_host_free"}
        st = hp.host_memory_stats()
        assert set(st) == keys and list(st) == sorted(st) and set(st.values()) == {0}
        t1 = hp.malloc(10 * 1024 * 4)                    # class 64 KiB, in a slab
        slab = hp.memory_stats()["reserved_bytes.all.current"]
        st = hp.host_memory_stats()
        for name, value in (("allocations", 1), ("allocated_bytes", slab), ("active_requests", 1), ("active_bytes", 64 << 10)):
            assert (st[f"{name}.current"], st[f"{name}.peak"], st[f"{name}.allocated"], st[f"{name}.freed"]) == \
                (value, value, value, 0), name
        assert st["num_host_alloc"] == st["host_alloc_time.count"] == 1 and st["num_host_free"] == 0
        assert st["host_alloc_time.max"] >= st["host_alloc_time.min"] >= 0 and st["host_free_time.count"] == 0
        t2 = hp.malloc(3 << 20)                          # a runtime allocation of its own (4 MiB class)
        st = hp.host_memory_stats()
        assert (st["allocations.current"], st["allocated_bytes.current"]) == (2, slab + (4 << 20))
        assert (st["active_requests.current"], st["active_bytes.current"]) == (2, (64 << 10) + (4 << 20))
        hp.empty_cache()                                 # both in use: nothing changes
        assert hp.host_memory_stats() == st
        hp.free(t2)
        hp.empty_cache()
        st = hp.host_memory_stats()
        assert (st["allocations.current"], st["allocations.peak"], st["allocations.freed"]) == (1, 2, 1)
        assert (st["active_requests.current"], st["active_requests.freed"], st["active_bytes.freed"]) == (1, 1, 4 << 20)
        assert st["num_host_free"] == st["host_free_time.count"] == 1
        hp.reset_peak_stats()
        hp.reset_accumulated_stats()
        st = hp.host_memory_stats()
        assert (st["allocations.current"], st["allocations.peak"], st["allocations.allocated"]) == (1, 1, 0)
        assert (st["active_bytes.current"], st["active_bytes.peak"], st["active_bytes.freed"]) == (64 << 10, 64 << 10, 0)
        assert st["num_host_alloc"] == st["host_alloc_time.count"] == st["host_alloc_time.total"] == 0
        hp.free(t1)
        assert hp.host_memory_stats()["active_requests.current"] == 0
    finally:
        hp.close()
    # torch's module-level names, on the pinned pool of a device
    hp = pinned.host_pool(0)
    buf = hp.malloc(1000)
    try:
        assert pinned.host_memory_stats()["active_requests.current"] >= 1
        nested = pinned.host_memory_stats_as_nested_dict()
        assert nested["active_requests"]["current"] == pinned.host_memory_stats()["active_requests.current"]
        assert nested["num_host_alloc"] == pinned.host_memory_stats()["num_host_alloc"]
    finally:
        hp.free(buf)
    pinned.host_empty_cache()
    pinned.reset_accumulated_host_memory_stats()
    pinned.reset_peak_host_memory_stats()
    st = pinned.host_memory_stats()
    assert st["num_host_alloc"] == 0 and st["active_requests.peak"] == st["active_requests.current"]


def test_host_memory_stats_count_a_parked_buffer_active_until_its_work_is_done(hp):
    # torch: active_requests "decrements when the block becomes reusable after stream deps finish"
    pool = ap.default_pool(0)
    stream = pool.create_stream()
    dev = pool.malloc(1 << 16)
    try:
        buf = hp.malloc(1 << 16)
        sim.launch_fill(stream, dev, 1 << 16, 0x42, delay_s=0.3)
        hp.record_stream(buf, stream)
        hp.free(buf)
        st = hp.host_memory_stats()
        assert (st["active_requests.current"], st["active_requests.freed"]) == (1, 0)
        pool.synchronize(stream)
        hp.free(hp.malloc(512))                          # a call that sees the work done
        st = hp.host_memory_stats()
        assert (st["active_requests.current"], st["active_requests.allocated"], st["active_requests.freed"]) == (0, 2, 2)
    finally:
        pool.free(dev)
        pool.destroy_stream(stream)


@pytest.mark.parametrize("stream, device, error, words", [
    ("x", None, ap.StreamTypeError, "stream must be None, 0 (the default stream) or an int stream handle, got 'x'"),
    (1.5, None, ap.StreamTypeError, "got 1.5"),
    (-1, None, ap.InvalidStreamError, "positive int that fits a pointer, got -1"),
    (2**64, None, ap.InvalidStreamError, "positive int that fits a pointer, got 18446744073709551616"),
    (None, 99, ap.InvalidDeviceError, "device 99 does not exist: the sim backend has"),
    (None, -1, ap.InvalidDeviceError, "device -1 does not exist"),
    (None, 2**40, ap.InvalidDeviceError, "device 1099511627776 does not exist"),
    (None, "npu:0", ap.InvalidDeviceError, "device must be an integer index, got 'npu:0'"),
    (None, True, ap.InvalidDeviceError, "device must be an integer index, got True"),
])
def test_record_stream_arguments_that_name_no_stream_or_device_are_typed_errors(hp, stream, device, error, words):
    """hp.record_stream(buf, stream, device) took the stream and the device as C conversions: a
    bare TypeError or OverflowError, and a device past the count (or negative) was accepted, its
    record then failing at the free. Named now, as the device pools' arguments are; the buffer is
    left unmarked (reused at once after its free) and the pool serves on."""
    buf = hp.malloc(4096)
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        hp.record_stream(buf, stream, device=device)
    hp.free(buf)
    assert hp.memory_stats()["pending_free_blocks"] == 0
    assert hp.malloc(4096) == buf
    hp.record_stream(buf, np.int64(0), device=np.int64(0))  # numpy integers are indexes, as everywhere
    hp.free(buf)


def test_a_buffer_marked_with_a_stream_destroyed_since_is_reusable_not_lost(hp):
    """A framework marks a staging buffer with its copy's stream, then destroys that stream (its
    work has run) before the buffer's free: the runtime refuses an event on the handle (107000), and
    the stream has no work left to wait for, as the device pools take it. The host pool kept the
    buffer out of use for the process's life and raised DeviceError from free(): a pinned slab
    lost per such stream, which empty_cache() could never give back."""
    pool = ap.default_pool(0)
    for _ in range(3):  # one slab lost per round before
        s = pool.create_stream()
        buf = hp.malloc(1 << 20)
        hp.record_stream(buf, s)
        pool.destroy_stream(s)
        hp.free(buf)
        st = hp.memory_stats()
        assert st["allocated_bytes.all.current"] == 0 and st["pending_free_blocks"] == 0
    hp.empty_cache()
    assert hp.memory_stats()["reserved_bytes.all.current"] == 0, "every slab goes back"
    # a live stream is still waited for: the buffer parks until its work has run
    s = pool.create_stream()
    buf = hp.malloc(1 << 20)
    sim.hang_stream(s)
    hp.record_stream(buf, s)
    hp.free(buf)
    assert hp.memory_stats()["pending_free_blocks"] == 1
    sim.release_stream(s)
    pool.synchronize(s)
    hp.empty_cache()
    assert hp.memory_stats()["pending_free_blocks"] == 0
    pool.destroy_stream(s)


def test_a_host_pool_made_for_a_device_that_is_no_index_is_an_invalid_device_error():
    """HostPool(backend, device) took the device as a C int: 'x' or None a bare TypeError, 2**40 an
    OverflowError, True device 1 (host_pool() checks its device; the class did not). Named now, as
    host_pool()'s, and a numpy integer is an index."""
    backend = ap.default_pool(0).backend
    for bad in ("x", None, 1.5, True, np.array([1, 2])):
        with pytest.raises(ap.InvalidDeviceError, match="device must be an integer index"):
            HostPool(backend, bad)
    for bad in (2**40, -(2**40), -1, backend.device_count):
        with pytest.raises(ap.InvalidDeviceError, match=f"device {bad} does not exist"):
            HostPool(backend, bad)
    hp = HostPool(backend, np.int64(0))
    assert hp.device == 0
    hp.close()


def test_a_pinning_refused_by_the_runtime_quotes_its_whole_cause(hp):
    """The host pool's out-of-memory message quotes the runtime's aclGetRecentErrMsg as the device
    pools do (AP_RUNTIME_MSG): it cut it at 199 bytes, so the simulator's cause lost its end, the
    knob that bounds pinned memory ('... (ASCEND'), and a real CANN's longer ones more."""
    import os
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with pytest.raises(ap.OutOfMemoryError) as e:
        hp.malloc(2 * ram)
    msg = str(e.value)
    pinned = hp.class_size(2 * ram)  # the power-of-two class is what is pinned
    assert f"aclrtMallocHost: cannot pin {pinned} bytes: more than the host's" in msg, msg
    assert "pinnable bytes (ASCEND_SIM_HOST_PINNED) (aclError 207001) (the host pool holds 0 bytes" in msg, msg
    assert hp.malloc(4096)  # still serving


def test_a_pinning_refused_for_lack_of_host_memory_does_not_say_the_device_is_out_of_memory(hp):
    """207001 answers a refused aclrtMallocHost as well as a refused aclrtMalloc: the code's gloss
    read '(out of device memory)' under 'pinning N bytes of host memory failed', sending the
    reader to the device's HBM (empty_cache, memory_summary) while it was host RAM that ran out."""
    import os
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with pytest.raises(ap.OutOfMemoryError) as e:
        hp.malloc(2 * ram)
    msg = str(e.value)
    assert "out of device memory" not in msg, msg
    assert "ACL_ERROR_RT_MEMORY_ALLOCATION (out of memory: device or pinned host)" in msg, msg


def test_a_host_pool_collected_in_a_garbage_cycle_keeps_its_backend_until_it_is_destroyed(sim_node):
    """A host pool of a Backend object only it holds, reachable only from a reference cycle,
    collected with a buffer handed out. The collector's clearing of the host pool (Cython's
    tp_clear) dropped its Backend first, freed, and the pool's destruction then gave the buffer back
    through it: the process crashed (SIGSEGV; MALLOC_PERTURB_ makes the freed memory garbage at
    once, as reuse would), as a device pool did before b4c091c."""
    out = sim_node.run("""
        import gc
        from ascend_pool._core import Backend, HostPool

        hp = HostPool(Backend("sim"), 0)
        buf = hp.malloc(4096)
        cycle = [hp]
        cycle.append(cycle)
        del hp, cycle
        gc.collect()
        print("collected", flush=True)
    """, PYTHONMALLOC="malloc", MALLOC_PERTURB_="204")
    assert "collected" in out

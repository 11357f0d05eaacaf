"""Memory history as PyTorch users drive it (issue 18 point 8): record_memory_history turned on
and off at runtime, Python frames in the trace and on live blocks, dump_snapshot read by
torch.cuda._memory_viz; and mem_get_info / reset_accumulated_stats."""

import ctypes
import os
import pickle
import subprocess
import sys

import numpy
import pytest

import ascend_pool as ap


def _trace(pool):
    return pool.snapshot()["device_traces"][pool.device]


def _alloc_in_named_function(pool, n):
    return pool.malloc(n)


def _free_in_named_function(pool, ptr):
    pool.free(ptr)


def test_history_turns_on_and_off_at_runtime_with_python_frames(pool):
    pool.free(pool.malloc(4096))
    assert _trace(pool) == [], "no history until asked for"
    pool.record_memory_history(enabled=True, stacks="python", max_entries=1000)
    keep = _alloc_in_named_function(pool, 4096)
    gone = _alloc_in_named_function(pool, 3 << 20)  # a new (large) segment
    _free_in_named_function(pool, gone)
    snap = pool.snapshot()
    trace = snap["device_traces"][0]
    allocs = [e for e in trace if e["action"] == "alloc"]
    assert [e["size"] for e in allocs] == [4096, 3 << 20]
    for e in allocs:
        assert e["frames"][0]["name"] == "_alloc_in_named_function"
        assert e["frames"][0]["filename"] == __file__
        assert any(f["name"] == "test_history_turns_on_and_off_at_runtime_with_python_frames" for f in e["frames"])
    frees = [e for e in trace if e["action"] == "free_requested"]
    assert frees[0]["frames"][0]["name"] == "_free_in_named_function"
    live = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert len(live) == 1 and live[0]["address"] == keep
    assert live[0]["frames"][0]["name"] == "_alloc_in_named_function", "a live block carries its allocation's stack"
    segs = [e for e in trace if e["action"] == "segment_alloc"]
    assert segs and all(e["frames"][0]["name"] == "_alloc_in_named_function" for e in segs)

    pool.record_memory_history(enabled=None)
    pool.free(keep)
    assert _trace(pool) == [], "history off: the trace is dropped and nothing more recorded"
    pool._check_invariants()


@pytest.mark.parametrize("expandable", [False, True])
def test_segments_carry_the_frames_of_the_allocation_that_created_them_as_torchs(expandable):
    # torch keeps a segment's creation context on its head block (the snapshot's segment
    # "frames"); an allocation that splits that block off leaves the context with the rest, so
    # from then on the segment shows none: a segment one allocation filled keeps its frames, a
    # small one (split at once) never has any (torch's test_memory_plots_free_stack: with
    # context "state" the allocating function shows nowhere once its block is freed)
    pool = ap.Pool(0, backend="sim", expandable_segments=expandable)
    try:
        pool.record_memory_history(enabled="all", stacks="python", context="all")
        whole = _alloc_in_named_function(pool, (30 << 20) - 32)  # 30 MiB with the sim's 32-byte pad
        small = _alloc_in_named_function(pool, 4096)

        def seg_of(addr):
            return next(s for s in pool.snapshot()["segments"] if s["address"] <= addr < s["address"] + s["total_size"])
        assert all("frames" in s for s in pool.snapshot()["segments"])
        seg = seg_of(whole)
        assert seg["total_size"] == 30 << 20 and seg["frames"][0]["name"] == "_alloc_in_named_function"
        assert any(f["name"] == "test_segments_carry_the_frames_of_the_allocation_that_created_them_as_torchs"
                   for f in seg["frames"])
        assert seg_of(small)["frames"] == [], "split at its creation: torch's shows none"
        pool.free(whole)  # cached whole: the segment keeps its frames
        assert seg_of(whole)["frames"][0]["name"] == "_alloc_in_named_function"
        part = pool.malloc(25 << 20)  # splits the segment's head block: the frames go
        assert seg_of(part)["address"] == seg["address"] and seg_of(part)["frames"] == []
        pool.free(part)
        pool.free(small)
    finally:
        pool.close()


def test_history_without_stacks_records_events_without_frames(pool):
    pool.record_memory_history(enabled=True, stacks=None, max_entries=10)
    for _ in range(20):
        pool.free(pool.malloc(1000))
    trace = _trace(pool)
    assert len(trace) == 10, "max_entries bounds the ring"
    assert all(e["frames"] == [] for e in trace)


def test_max_entries_takes_a_numpy_integer_as_torchs_int_argument(pool):
    # torch's max_entries is an int that pybind11 takes through __index__ (numpy's too); ours
    # refused numpy.int64 with ConfigError, pool by pool and for the process
    import numpy
    pool.record_memory_history(enabled=True, stacks=None, max_entries=numpy.int64(3))
    for _ in range(4):
        pool.free(pool.malloc(512))
    assert len(pool.snapshot()["device_traces"][0]) == 3
    ap.record_memory_history(True, stacks=None, max_entries=numpy.uint32(5))
    ap.record_memory_history(None)
    for bad in (True, numpy.float64(3.0), numpy.int64(-1)):
        with pytest.raises(ap.ConfigError, match="max_entries"):
            pool.record_memory_history(enabled=True, max_entries=bad)


@pytest.mark.parametrize("bad", [dict(max_entries=-1), dict(max_entries="many"), dict(stacks="cpp")])
def test_bad_history_settings_are_config_errors(pool, bad):
    with pytest.raises(ap.ConfigError):
        pool.record_memory_history(enabled=True, **bad)
    pool.free(pool.malloc(512))  # the pool keeps serving


@pytest.mark.parametrize("zero", [0, numpy.int64(0)])
def test_max_entries_0_keeps_the_latest_event_as_torchs(pool, zero):
    # torch's and torch_npu's recordHistory clamp max_entries with std::max(size_t(1), n): code
    # calling _record_memory_history(max_entries=0) there records a ring of one entry; it was a
    # ConfigError here (through torch_npu's patched _record_memory_history too)
    pool.record_memory_history(enabled="all", max_entries=zero)
    pool.free(pool.malloc(512))
    trace = pool.snapshot()["device_traces"][0]
    assert [e["action"] for e in trace] == ["free_completed"]
    ap.record_memory_history(enabled="all", max_entries=zero)
    try:
        ap.free(ap.malloc(512))
        assert len(ap.snapshot()["device_traces"][0]) == 1
    finally:
        ap.record_memory_history(None)
    pool.record_memory_history(None)


@pytest.mark.parametrize("bad", [dict(skip_actions=["free"]), dict(skip_actions="oom"), dict(skip_actions=3)])
def test_bad_skip_actions_are_config_errors(pool, bad):
    with pytest.raises(ap.ConfigError, match="skip_actions"):
        pool.record_memory_history(enabled=True, **bad)
    with pytest.raises(ap.ConfigError, match="skip_actions"):
        ap.record_memory_history(enabled=True, **bad)
    pool.free(pool.malloc(512))  # the pool keeps serving


def test_skip_actions_leave_those_actions_out_of_the_trace_as_torchs(pool):
    # torch's _record_memory_history(skip_actions=[...]): skipped actions take no room in the ring
    skip = ["free_requested", "free_completed", "segment_alloc", "segment_free"]
    pool.record_memory_history(enabled=True, max_entries=4, skip_actions=skip)
    for n in (512, 3 << 20, 4096, 1000):
        pool.free(pool.malloc(n))
    trace = _trace(pool)
    assert [(e["action"], e["size"]) for e in trace] == [("alloc", n) for n in (512, 3 << 20, 4096, 1000)]
    pool.record_memory_history(enabled=True, max_entries=4)  # same ring: the skip list is lifted
    pool.free(pool.malloc(700))
    assert [e["action"] for e in _trace(pool)][-2:] == ["free_requested", "free_completed"]


def test_module_history_takes_torchs_keyword_arguments(tmp_path):
    with pytest.warns(RuntimeWarning, match="compile_context"):
        ap.record_memory_history(enabled=True, max_entries=100, skip_actions=["alloc"], compile_context=True,
                                 global_record_annotations=False)
    try:
        pool = ap.default_pool(0)
        pool.free(pool.malloc(5000))
        actions = {e["action"] for e in ap.snapshot(0)["device_traces"][0]}
        assert "free_requested" in actions and "alloc" not in actions
        later = ap.Pool(0, backend="sim")  # pools made later follow the settings, skip list included
        try:
            later.free(later.malloc(5000))
            assert {e["action"] for e in _trace(later)} >= {"free_requested"}
            assert "alloc" not in {e["action"] for e in _trace(later)}
        finally:
            later.close()
        with pytest.raises(ap.ConfigTypeError, match="global_record_annotations"):
            ap.record_memory_history(enabled=True, global_record_annotations="yes")
    finally:
        ap.record_memory_history(enabled=None)


def test_state_history_keeps_the_latest_event_and_the_live_blocks_frames(pool):
    """torch's _record_memory_history("state") keeps a trace ring of one entry (its
    test_memory_snapshot reads the segment_free an empty_cache leaves last), and the live blocks'
    frames; "all" afterwards records every event again."""
    pool.record_memory_history("state", stacks="python", max_entries=1000)
    keep = _alloc_in_named_function(pool, 4096)
    gone = _alloc_in_named_function(pool, 3 << 20)
    snap = pool.snapshot()
    assert [e["action"] for e in snap["device_traces"][pool.device]] == ["alloc"]
    live = [b for s in snap["segments"] for b in s["blocks"] if b["address"] == keep]
    assert live[0]["state"] == "active_allocated"
    assert live[0]["frames"][0]["name"] == "_alloc_in_named_function"
    _free_in_named_function(pool, gone)
    pool.empty_cache()
    assert [e["action"] for e in _trace(pool)] == ["segment_free"]
    pool.record_memory_history("all", stacks="python", max_entries=1000)
    _free_in_named_function(pool, keep)
    assert [e["action"] for e in _trace(pool)][-2:] == ["free_requested", "free_completed"]


def _thealloc(pool, n):
    return pool.malloc(n)


def _thefree(pool, ptr):
    pool.free(ptr)


def _the_empty_cache(pool):
    pool.empty_cache()


@pytest.mark.parametrize("context", ["alloc", "all", "state"])
def test_history_context_says_where_frames_show_as_torchs(pool, context):
    """torch's test_memory_plots_free_stack and _free_segment_stack: frees' frames show only with
    context "all", allocations' with "alloc" and "all" (trace entries; "state": live blocks only),
    and the segment_free an empty_cache makes carries its caller's frames with "all"."""
    import json
    pool.record_memory_history("all", stacks="python", context=context)
    _thefree(pool, _thealloc(pool, 3 << 20))
    text = json.dumps(pool.snapshot())
    assert ("_thefree" in text) == (context == "all")
    assert ("_thealloc" in text) == (context != "state")
    if context == "alloc":  # a free's entries carry its block's allocation frames, as torch's
        frees = [e for e in _trace(pool) if e["action"] == "free_requested"]
        assert frees[-1]["frames"][0]["name"] == "_thealloc"
    pool.record_memory_history("all", stacks="python", context=context, max_entries=1000)
    _the_empty_cache(pool)
    assert ("_the_empty_cache" in json.dumps(pool.snapshot())) == (context == "all")
    pool.record_memory_history("state", stacks="python", context=context)
    held = _thealloc(pool, 4096)
    blocks = [b for s in pool.snapshot()["segments"] for b in s["blocks"] if b["address"] == held]
    assert blocks[0]["frames"][0]["name"] == "_thealloc", "every context keeps a live block's frames"
    pool.free(held)


def test_oom_trace_entries_carry_device_free_as_torchs(pool, tmp_path):
    """torch's oom trace entry has device_free (the device's free bytes) where others have addr;
    _memory_viz's trace reads it."""
    pool.record_memory_history("all", stacks="python", max_entries=100)
    pool.set_limit(8 << 20)
    for n in (64 << 20, 1 << 62):  # over the pool's limit; larger than the device
        with pytest.raises(ap.OutOfMemoryError):
            pool.malloc(n)
    ooms = [e for e in _trace(pool) if e["action"] == "oom"]
    assert [e["size"] for e in ooms] == [64 << 20, 1 << 62]
    free_now = pool.mem_get_info()[0]
    assert all("addr" not in e and 0 < e["device_free"] <= pool.mem_get_info()[1] for e in ooms)
    assert ooms[0]["device_free"] >= free_now - (64 << 20)
    pool.set_limit(None)
    from torch.cuda import _memory_viz as viz  # torch is a test dependency (pyproject: test extras)
    text = viz.trace(pool.snapshot())  # read each oom entry's device_free (KeyError without it)
    assert text.count("raise OutOfMemoryError") == 2


def _allocate_the_weights(pool, n):
    return pool.malloc(n)


@pytest.mark.parametrize("enabled", ["state", "all"])
def test_a_live_block_keeps_its_frames_after_the_ring_has_wrapped(pool, enabled):
    """torch keeps each live block's allocation context with the block: a model's weights,
    allocated once at start, still name their allocation site after millions of later events.
    Ours read the frames from the event ring, so a block older than max_entries events showed
    none."""
    pool.record_memory_history(enabled, stacks="python", max_entries=64)
    weights = _allocate_the_weights(pool, 3 << 20)
    for _ in range(200):  # many more events than the ring holds, from another call site
        _free_in_named_function(pool, _alloc_in_named_function(pool, 4096))
    snap = pool.snapshot()
    live = [b for s in snap["segments"] for b in s["blocks"] if b["address"] == weights]
    assert live[0]["state"] == "active_allocated"
    assert live[0]["frames"] and live[0]["frames"][0]["name"] == "_allocate_the_weights"
    freed = [b for s in snap["segments"] for b in s["blocks"] if b["state"] != "active_allocated"]
    assert all(b["frames"] == [] for b in freed), "a free block carries no frames"
    # As torch's, the block keeps its allocation's frames once recording stops, and a block
    # allocated while nothing records shows none, whichever block struct it reuses.
    pool.record_memory_history(None)
    unrecorded = [_alloc_in_named_function(pool, 4096) for _ in range(3)]
    for _ in range(2):
        blocks = {b["address"]: b for s in pool.snapshot()["segments"] for b in s["blocks"]}
        assert blocks[weights]["frames"][0]["name"] == "_allocate_the_weights"
        assert all(blocks[p]["frames"] == [] for p in unrecorded)
        pool.record_memory_history(enabled, stacks="python", max_entries=64)  # and again once back on
    for p in unrecorded:
        pool.free(p)
    pool.free(weights)


def test_module_level_history_and_dump_snapshot_read_by_memory_viz(tmp_path):
    ap.record_memory_history(enabled=True, stacks="python", max_entries=1000)
    try:
        ptrs = [_alloc_in_named_function(ap.default_pool(0), n) for n in (4096, 3 << 20, 1000)]
        _free_in_named_function(ap.default_pool(0), ptrs.pop())
        path = tmp_path / "snap.pickle"
        ap.dump_snapshot(str(path))
        snap = pickle.loads(path.read_bytes())
        allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
        assert [e["size"] for e in allocs][-3:] == [4096, 3 << 20, 1000]
        assert all(e["frames"] and e["frames"][0]["name"] == "_alloc_in_named_function" for e in allocs[-3:])
        for command in ("stats", "trace"):
            out = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", command, str(path)],
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
            assert out.stdout.strip()
        html = tmp_path / "plot.html"
        out = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(path), "-o",
                              str(html)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "add_local_files" in html.read_text()
        for p in ptrs:
            ap.free(p, device=0)
    finally:
        ap.record_memory_history(enabled=None)
    assert ap.snapshot(0)["device_traces"][0] == []


def test_mem_get_info_follows_the_device(pool):
    free0, total = pool.mem_get_info()
    assert (free0, total) == pool.backend.mem_info(0)
    ptr = pool.malloc(64 << 20)
    free1, total1 = pool.mem_get_info()
    assert total1 == total and free1 <= free0 - (64 << 20)
    pool.free(ptr)
    assert ap.mem_get_info(0)[1] == total


def test_reset_accumulated_stats_zeroes_totals_but_keeps_current_and_peak(pool):
    keep = pool.malloc(4096)
    pool.free(pool.malloc(8192))
    with pytest.raises(ap.OutOfMemoryError):
        pool.malloc(pool.memory_stats()["device_total_bytes"] + 1)
    st = pool.memory_stats()
    assert st["allocation.all.allocated"] == 2 and st["num_ooms"] == 1 and st["num_device_alloc"] >= 1
    pool.reset_accumulated_stats()
    st = pool.memory_stats()
    for key in ("allocation.all.allocated", "allocation.all.freed", "allocated_bytes.all.allocated",
                "allocated_bytes.all.freed", "num_ooms", "num_device_alloc", "num_sync_all_streams"):
        assert st[key] == 0, key
    assert st["allocation.all.current"] == 1 and st["allocation.all.peak"] == 2
    pool.free(pool.malloc(4096))
    st = pool.memory_stats()
    assert st["allocation.all.allocated"] == 1 and st["allocation.all.freed"] == 1
    pool.free(keep)


def _module_alloc_here(n):
    return ap.malloc(n, device=0)


def test_frames_start_at_the_users_line_not_inside_ascend_pool():
    # ap.malloc and the framework hooks are Python wrappers: frames[0] is still the caller's line
    # (PyTorch's test_memory_snapshot checks frames[0]["filename"]).
    ap.record_memory_history(enabled=True, stacks="python", max_entries=1000)
    try:
        ptr = _module_alloc_here(5000)
        block = next(b for s in ap.snapshot(0)["segments"] for b in s["blocks"] if b["address"] == ptr)
        assert block["frames"][0]["filename"] == __file__
        assert block["frames"][0]["name"] == "_module_alloc_here"
        ap.free(ptr, device=0)
    finally:
        ap.record_memory_history(enabled=None)


def _c_abi_alloc_here(lib, n):
    return lib.ascend_pool_malloc(n, 0, None)


def test_c_abi_allocations_record_the_python_frames_of_the_thread_that_holds_the_gil():
    # A framework's tensors come through the C ABI from a Python op, GIL held (ctypes.PyDLL calls
    # the same way); a call with the GIL released (ctypes.CDLL) records none and never waits for it.
    held = ctypes.PyDLL(ap.library_path())
    released = ctypes.CDLL(ap.library_path())
    for lib in (held, released):
        lib.ascend_pool_malloc.restype = ctypes.c_void_p
        lib.ascend_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.ascend_pool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    ap.default_pool(0)
    ap.record_memory_history(enabled=True, stacks="python", max_entries=1000)
    try:
        with_gil = _c_abi_alloc_here(held, 311 * 411 * 4)
        without = _c_abi_alloc_here(released, 5000)
        blocks = {b["address"]: b for s in ap.snapshot(0)["segments"] for b in s["blocks"]}
        frames = blocks[with_gil]["frames"]
        assert frames[0]["filename"] == __file__ and frames[0]["name"] == "_c_abi_alloc_here"
        assert blocks[without]["frames"] == []
        held.ascend_pool_free(with_gil, 0, 0, None)
        frees = [e for e in ap.snapshot(0)["device_traces"][0] if e["action"] == "free_requested"]
        assert frees[-1]["frames"][0]["name"] == \
            "test_c_abi_allocations_record_the_python_frames_of_the_thread_that_holds_the_gil"
        released.ascend_pool_free(without, 0, 0, None)
    finally:
        ap.record_memory_history(enabled=None)
    with_gil = _c_abi_alloc_here(held, 4096)  # history off: nothing recorded, nothing in the way
    assert ap.snapshot(0)["device_traces"][0] == []
    held.ascend_pool_free(with_gil, 0, 0, None)


def test_a_c_abi_allocation_with_the_gil_leaves_no_frames_for_the_threads_next_call():
    """A C ABI call made with the GIL held (a framework op) files its Python frames for that call;
    they must not reach the thread's next allocation once frames are off (they did: the C ABI set
    the thread's frames id and never cleared it)."""
    lib = ctypes.PyDLL(ap.library_path())  # keeps the GIL, as torch's allocator called from an op
    lib.ascend_pool_malloc.restype = ctypes.c_void_p
    lib.ascend_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ascend_pool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    pool = ap.default_pool(0)
    ap.record_memory_history(True, stacks="python")
    try:
        a = _c_abi_alloc_in_named_function(lib)
        ap.record_memory_history(True, stacks=None)  # history on, frames off
        b = pool.malloc(3 << 20)
        c = lib.ascend_pool_malloc(1 << 20, 0, None)
        snap = pool.snapshot()
        frames = {blk["address"]: [f["name"] for f in blk["frames"]] for s in snap["segments"] for blk in s["blocks"]}
        assert "_c_abi_alloc_in_named_function" in frames[a]
        assert frames[b] == [] and frames[c] == [], "frames of an earlier C ABI call on this thread"
        pool.free(b)
        for ptr in (a, c):
            lib.ascend_pool_free(ptr, 0, 0, None)
    finally:
        ap.record_memory_history(enabled=None)


def _c_abi_alloc_in_named_function(lib):
    return lib.ascend_pool_malloc(1 << 20, 0, None)


def test_record_memory_history_racing_close_leaves_no_stack_registration():
    """record_memory_history inside its pool call when another thread closes the pool: it must
    not register the closed pool for the C ABI's frames (it did, under key 0, and the C ABI's
    count of pools recording stacks never went back to 0: every C ABI call with the GIL then ran
    the Python hook)."""
    import threading
    import time

    from ascend_pool import _core

    base = ap.default_pool(0)
    closed = []
    for i in range(50):
        ctx = base.context(f"history-close-race-{i}")
        closed.append(ctx)
        stop = threading.Event()

        def toggle():
            k = 0
            while not stop.is_set():
                k += 1
                try:
                    ctx.record_memory_history(True, stacks="python", max_entries=1000 + k % 2)
                except ap.PoolError:
                    return

        t = threading.Thread(target=toggle)
        t.start()
        time.sleep(0.001)
        ctx.close()
        stop.set()
        t.join(30)
        assert 0 not in _core._stack_pools, f"round {i}: a closed pool registered for the C ABI's frames"
    registered = [ref() for ref in _core._stack_pools.values()]
    assert not any(r is c for r in registered for c in closed), "a closed context still registered for frames"


def test_a_file_descriptor_is_not_a_snapshot_path(pool):
    """open() takes an int as a file descriptor: dump_snapshot(1) used to write the pickle to
    stdout and close it. A path must be a file name; an int is refused and the descriptor stays
    open and untouched."""
    r, w = os.pipe()
    try:
        for call in (lambda: ap.dump_snapshot(w), lambda: pool.dump_snapshot(w), lambda: pool.dump_trace(w),
                     lambda: pool.dump_snapshot("")):
            with pytest.raises(ap.ConfigError, match="path must be a file name"):
                call()
        os.fstat(w)  # still open
        os.set_blocking(r, False)
        with pytest.raises(BlockingIOError):
            os.read(r, 1)  # and nothing was written to it
    finally:
        os.close(r)
        os.close(w)


def test_node_pid_refuses_what_is_not_a_backend():
    with pytest.raises(ap.ConfigError, match="unknown backend"):
        ap.node_pid(-1)
    assert ap.node_pid("sim") == ap.node_pid()


def test_a_new_max_entries_while_recording_keeps_the_trace():
    # torch_npu's _record_memory_history with another max_entries while recording (a profiler
    # window opened twice) only resizes torch's ring; ours swapped in an empty one, and the events
    # recorded so far were lost. Lowered, it keeps the most recent; turned off, it drops them.
    pool = ap.Pool(0, backend="sim")
    try:
        def trace():
            return [(e["action"], e["addr"], e["size"]) for e in pool.snapshot()["device_traces"][0]
                    if e["action"] != "snapshot"]  # each snapshot files one: not what is compared

        pool.record_memory_history(True, stacks=None, max_entries=1000)
        ptrs = [pool.malloc((i + 1) * 4096) for i in range(5)]
        before = trace()
        assert len(before) >= 5
        pool.record_memory_history(True, stacks=None, max_entries=5000)
        assert trace() == before
        for p in ptrs:
            pool.free(p)
        assert trace()[:len(before)] == before and len(trace()) == len(before) + 10
        raw = [(e["action"], e["addr"]) for e in pool.snapshot()["device_traces"][0]]  # (files its own last)
        pool.record_memory_history(True, stacks=None, max_entries=4)
        kept = [(e["action"], e["addr"]) for e in pool.snapshot()["device_traces"][0]]
        assert kept[:3] == raw[-3:] and len(kept) == 4
        pool.record_memory_history(None)
        pool.record_memory_history(True, stacks=None, max_entries=1000)
        assert trace() == []
    finally:
        pool.close()


def test_a_pool_opened_while_record_memory_history_runs_records_too():
    """The process-wide call stored the settings that later pools follow only after it had gone
    through the open pools (each with the GIL let go): a pool another thread opened meanwhile was
    in neither and never recorded (the audit's repros/r02; about half of such pools before)."""
    import threading
    import time

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    old = [ap.Pool(0, backend="sim") for _ in range(30)]  # a longer list: a wider window
    opened, done = [], threading.Event()

    def opener():
        while not done.is_set():
            opened.append(ap.Pool(0, backend="sim"))

    t = threading.Thread(target=opener)
    try:
        t.start()
        time.sleep(0.005)
        ap.record_memory_history(True, stacks=None, max_entries=100)
        done.set()
        t.join()
        missed = 0
        for pool in opened:
            pool.free(pool.malloc(4096))
            missed += not _trace(pool)
        assert opened and missed == 0, f"{missed} of {len(opened)} pools opened during the call record nothing"
    finally:
        done.set()
        t.join()
        sys.setswitchinterval(switch)
        ap.record_memory_history(None)
        for pool in old + opened:
            pool.close()


def test_set_memory_metadata_tags_every_pools_later_entries_as_torchs(pool):
    # torch.cuda.memory._set_memory_metadata(s): trace entries recorded afterwards carry s as
    # user_metadata ("" clears it), whichever pool or path (the C ABI too) records them
    lib = ctypes.CDLL(ap.library_path())  # a framework's tensors, GIL released
    lib.ascend_pool_malloc.restype = ctypes.c_void_p
    lib.ascend_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ascend_pool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    assert ap._get_memory_metadata() == ""
    pool.record_memory_history(enabled="all", stacks=None)
    ap.record_memory_history(enabled="all", stacks=None, device=0)
    try:
        before = pool.malloc(4096)
        ap._set_memory_metadata("step=1 phase=forward")
        assert ap._get_memory_metadata() == ap.get_memory_metadata() == "step=1 phase=forward"
        tagged = pool.malloc(3 << 20)                     # a new segment: its segment_alloc is tagged too
        through_c = lib.ascend_pool_malloc(5000, 0, None)
        pool.free(before)
        ap.set_memory_metadata("")
        pool.free(tagged)
        lib.ascend_pool_free(through_c, 5000, 0, None)
        seen = [(e["action"], None if e["action"].startswith("segment") else e["size"], e["user_metadata"])
                for e in _trace(pool)]
        assert seen == [("segment_alloc", None, ""), ("alloc", 4096, ""),
                        ("segment_alloc", None, "step=1 phase=forward"), ("alloc", 3 << 20, "step=1 phase=forward"),
                        ("free_requested", 4096, "step=1 phase=forward"), ("free_completed", 4096, "step=1 phase=forward"),
                        ("free_requested", 3 << 20, ""), ("free_completed", 3 << 20, "")]
        default = [(e["action"], e["size"], e["user_metadata"]) for e in _trace(ap.default_pool(0))]
        assert ("alloc", 5000, "step=1 phase=forward") in default and ("free_requested", 5000, "") in default
        with pytest.raises(ap.ConfigTypeError):
            ap._set_memory_metadata(b"bytes")
        assert ap._get_memory_metadata() == ""
    finally:
        ap.set_memory_metadata("")
        ap.record_memory_history(enabled=None, device=0)


def test_metadata_strings_no_entry_names_any_more_are_not_kept_for_the_process_life(pool):
    # Code tagging every step (torch's use: _set_memory_metadata(f"step {i}")) filed each string
    # for good, history recorded or not: a million steps kept a million strings. Those no
    # history ring names (nor the current one) go once many have piled up; those entries name stay.
    import sys
    snapshot = sys.modules["ascend_pool.snapshot"]  # (ascend_pool.snapshot is the function)
    n = 12_288
    pool.record_memory_history(enabled="all", stacks=None, max_entries=8)
    try:
        ap.set_memory_metadata("kept: an entry names it")
        pool.free(pool.malloc(4096))
        ap.set_memory_metadata("")
        for i in range(n):
            ap.set_memory_metadata(f"step {i}")
        assert len(snapshot._meta_texts) <= 8192, len(snapshot._meta_texts)  # 12,290 filed before
        assert ap.get_memory_metadata() == f"step {n - 1}"
        assert [e["user_metadata"] for e in _trace(pool)][-2:] == ["kept: an entry names it"] * 2
        ap.set_memory_metadata("step 5")  # dropped earlier: filed again, entries tagged as before
        pool.free(pool.malloc(4096))
        assert [e["user_metadata"] for e in _trace(pool)][-2:] == ["step 5"] * 2
    finally:
        ap.set_memory_metadata("")
        pool.record_memory_history(enabled=None)

"""Ports of PyTorch's and torch_npu's own allocator tests (test/test_cuda.py, test/npu/*.py) that
failed on ascend_pool: each test names the one it ports. Sizes in bytes."""
import pytest

import ascend_pool as ap

MiB = 1 << 20
PAD = 32  # acl/sim pad each request by 32 bytes (torch_npu's): 40 MiB - PAD asks for 40 MiB


def test_max_split_expandable():
    # test_cuda.py TestCudaMallocAsync.test_max_split_expandable: expandable segments with
    # max_split_size_mb:40 under a 120 MiB cap; three 40 MiB tensors fit, a fourth is out of
    # memory, and once they are freed 120 MiB fits again. Then (what torch's test leaves out) the
    # 120 MiB block is freed and three 40 MiB tensors fit once more: each request of max_split_size
    # takes 40 MiB of the segment's free tail, not all of it (torch splits every expandable block).
    pool = ap.Pool(0, backend="sim", expandable_segments=True, max_split_size_mb=40)
    try:
        pool.set_limit(limit_bytes=120 * MiB)
        a, b, c = (pool.malloc(40 * MiB - PAD) for _ in range(3))
        try:
            pool.malloc(40 * MiB - PAD)
            raise AssertionError("a fourth 40 MiB block fitted under a 120 MiB cap")
        except ap.OutOfMemoryError:
            pass
        for ptr in (a, b, c):
            pool.free(ptr)
        big = pool.malloc(120 * MiB - PAD)
        pool.free(big)
        again = [pool.malloc(40 * MiB - PAD) for _ in range(3)]
        assert [pool.block_info(ptr)[1] for ptr in again] == [40 * MiB] * 3
        assert pool.memory_stats()["allocated_bytes.all.current"] == 120 * MiB
        for ptr in again:
            pool.free(ptr)
        pool._check_invariants()
    finally:
        pool.close()


# NPUPluggableAllocator.h as the torch_npu versions whose record_stream hook is a C signature
# declare it (comments included), and as the others do (a C++ NPUStream).
PLUGGABLE_ACL_STREAM = """
struct NPUPluggableAllocator
    : public c10_npu::NPUCachingAllocator::NPUAllocator {
    void set_base_alloc_fn(std::function<void*(void*, size_t*)> base_alloc_fn);
    void set_record_stream_fn(
        std::function<void(void* ptr, aclrtStream stream)> record_stream_fn);
    void set_erase_stream_fn(
        std::function<void(void* ptr, aclrtStream stream)> erase_stream_fn);
};
"""
PLUGGABLE_NPU_STREAM = """
    // set_record_stream_fn(std::function<void(void* ptr, aclrtStream stream)>) in another version
    void set_record_stream_fn(
        std::function<void(void* ptr, c10_npu::NPUStream stream)> record_stream_fn);
"""


def _installed_record_stream_hook(monkeypatch, tmp_path, header, got=None):
    """install() over a stand-in torch_npu whose installed headers declare the pluggable allocator
    as `header` does; returns the address handed to set_record_stream_fn (None: not set), and
    puts every set_*_fn call's address in `got` when given."""
    import os
    import sys
    import types

    from ascend_pool import config
    from ascend_pool.integrations import torch_npu as ap_npu

    got = {} if got is None else got

    class Allocator:
        def __getattr__(self, setter):
            if setter.startswith("set_") and setter.endswith("_fn") and "stats" not in setter and "peak" not in setter:
                return lambda fn: got.__setitem__(setter, fn)
            raise AttributeError(setter)

    class Pluggable:
        def __init__(self, *args):
            self._allocator = Allocator()

        def allocator(self):
            return self._allocator

    npu_dir = tmp_path / "torch_npu"
    (npu_dir / "include" / "torch_npu" / "csrc" / "npu").mkdir(parents=True)
    (npu_dir / "include" / "torch_npu" / "csrc" / "npu" / "NPUPluggableAllocator.h").write_text(header)
    torch_npu = types.ModuleType("torch_npu")
    torch_npu.__file__ = os.path.join(str(npu_dir), "__init__.py")
    memory = types.SimpleNamespace(NPUPluggableAllocator=Pluggable, change_current_allocator=lambda a: None)
    for name, mod in (("torch_npu", torch_npu), ("torch_npu.npu", types.ModuleType("torch_npu.npu")),
                      ("torch_npu.npu.memory", memory)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(ap_npu, "use_backend", lambda *a, **k: None)  # no ACL runtime here
    monkeypatch.setattr(config, "_framework_vars", list(config._framework_vars))  # install() adds torch_npu's
    ap_npu.install(patch_stats=False)
    return got.get("set_record_stream_fn")


def test_record_stream_through_torch_npus_pluggable_hook(monkeypatch, tmp_path):
    # torch_npu test_npu.py TestNpu.test_record_stream, through the pluggable allocator's hook as
    # torch_npu calls it (record_stream_fn_(ptr.get(), stream)): tmp, allocated on `stream` and
    # read by a kernel on the current stream after record_stream, is not handed out again on
    # `stream` until that kernel is done ("allocation reused to soon"). The hook was never set:
    # tensor.record_stream() did nothing and tmp2 got tmp's block under the kernel.
    import ctypes

    from ascend_pool import sim

    hook = _installed_record_stream_hook(monkeypatch, tmp_path, PLUGGABLE_ACL_STREAM)
    lib = ctypes.CDLL(ap.library_path())
    assert hook == ctypes.cast(lib.ascend_pool_record_stream, ctypes.c_void_p).value
    record_stream_fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(hook)
    lib.ascend_pool_malloc.restype = ctypes.c_void_p
    lib.ascend_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ascend_pool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    stream, current = ap.create_stream(device=0), ap.create_stream(device=0)
    result = lib.ascend_pool_malloc(16, 0, current)
    tmp = lib.ascend_pool_malloc(16, 0, stream)
    sim.launch_fill(current, tmp, 16, 7, delay_s=0.5)  # result.copy_(tmp), delayed
    record_stream_fn(tmp, current)
    lib.ascend_pool_free(tmp, 16, 0, stream)
    tmp2 = lib.ascend_pool_malloc(16, 0, stream)
    assert tmp2 != tmp, "allocation reused to soon"
    ap.synchronize(current, device=0)
    for ptr, s in ((tmp2, stream), (result, current)):
        lib.ascend_pool_free(ptr, 16, 0, s)


def test_a_torch_npu_whose_record_stream_hook_takes_an_npu_stream_is_not_given_a_c_function(monkeypatch, tmp_path):
    # a C function called with a C++ NPUStream object is undefined behaviour: left unset there
    assert _installed_record_stream_hook(monkeypatch, tmp_path, PLUGGABLE_NPU_STREAM) is None


def test_max_split_size_stat_is_minus_1_after_a_setting_resets_it():
    # test_cuda.py test_allocator_settings resets max_split_size_mb with each
    # _set_allocator_settings call that leaves it out; memory_stats()["max_split_size"] then reads
    # -1 again, as before it was set (torch: SIZE_MAX as int64). It read 18446744073709551615.
    from ascend_pool import config

    saved = config._runtime  # the process's runtime settings, which pools opened later take
    pool = ap.Pool(0, backend="sim")
    try:
        assert ap.memory_stats(0)["max_split_size"] == pool.memory_stats()["max_split_size"] == -1
        ap.set_allocator_settings("max_split_size_mb:40")
        assert ap.memory_stats(0)["max_split_size"] == pool.memory_stats()["max_split_size"] == 40 * MiB
        ap.set_allocator_settings("garbage_collection_threshold:0.5")
        assert ap.memory_stats(0)["max_split_size"] == pool.memory_stats()["max_split_size"] == -1
        assert ap.memory_stats_as_nested_dict(0)["max_split_size"] == -1
        assert pool.snapshot()["allocator_settings"]["max_split_size"] == -1
        ap.set_allocator_settings("max_split_size_mb:40")  # accepted again: the open pools agree
        assert pool.memory_stats()["max_split_size"] == 40 * MiB
    finally:
        ap.set_allocator_settings("")
        config._runtime = saved
        pool.close()


def _installed_stream_hooks(monkeypatch, tmp_path, header):
    """install() over the stand-in torch_npu (see _installed_record_stream_hook): every set_*_fn
    it called, by name, with the address it handed over."""
    got = {}
    _installed_record_stream_hook(monkeypatch, tmp_path, header, got)
    return got


def test_erase_stream_lets_the_block_be_reused_without_waiting_for_that_stream():
    # torch_npu test_npu.py TestNpu.test_erase_stream: tensor1, allocated on stream2, is marked
    # with stream1 (record_stream) and the mark taken back (torch_npu.erase_stream) before its
    # free: tensor2 on stream2 gets its block at once. Here stream1 is still busy (torch_npu's
    # test leaves it idle, where a block waits for nothing either way): erase_stream is how a
    # program says that work does not touch the block (communication overlap), and the block
    # waited for it all the same (there was no erase_stream).
    import time

    from ascend_pool import sim

    for knobs in ({}, dict(expandable_segments=True), dict(stream_reuse="tied")):
        pool = ap.Pool(0, backend="sim", **knobs)
        try:
            stream1, stream2 = pool.create_stream(), pool.create_stream()
            busy = pool.malloc(16, stream=stream1)
            sim.launch_fill(stream1, busy, 16, 1, delay_s=0.6)  # stream1's own work, long
            start, kept = time.monotonic(), []
            for size in (4 * 1000 * 1000, 1000, 30 * MiB):
                tensor1 = pool.malloc(size, stream=stream2)
                pool.record_stream(tensor1, stream1)
                pool.erase_stream(tensor1, stream1)
                pool.erase_stream(tensor1, stream1)  # not marked (any more): nothing to undo
                pool.erase_stream(tensor1, stream2)  # its own stream: the same
                pool.free(tensor1, stream=stream2)
                tensor2 = pool.malloc(size, stream=stream2)
                assert tensor2 == tensor1, (knobs, size)
                # marked (record_stream alone): not reused under stream1's work
                pool.record_stream(tensor2, stream1)
                pool.free(tensor2, stream=stream2)
                kept.append(pool.malloc(size, stream=stream2))
                assert kept[-1] != tensor1, (knobs, size)
            assert time.monotonic() - start < 0.5, knobs  # stream1's 0.6 s: no wait for it
            pool.synchronize(stream1)
            for ptr in kept:
                pool.free(ptr, stream=stream2)
            pool.free(busy, stream=stream1)
            pool._check_invariants()
        finally:
            pool.close()


def test_erase_stream_through_torch_npus_pluggable_hook_and_the_module_function(monkeypatch, tmp_path):
    # The same through the hook torch_npu calls for torch_npu.erase_stream (erase_stream_fn_(ptr,
    # stream), set with set_erase_stream_fn where NPUPluggableAllocator.h declares it with an
    # aclrtStream, as record_stream's), and through ap.erase_stream. The hook was never set: with
    # record_stream's set, erase_stream did nothing and the block waited for the other stream.
    import ctypes

    from ascend_pool import sim

    hooks = _installed_stream_hooks(monkeypatch, tmp_path, PLUGGABLE_ACL_STREAM)
    lib = ctypes.CDLL(ap.library_path())
    assert hooks.get("set_erase_stream_fn") == ctypes.cast(lib.ascend_pool_erase_stream, ctypes.c_void_p).value
    hook = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
    record_stream_fn, erase_stream_fn = hook(hooks["set_record_stream_fn"]), hook(hooks["set_erase_stream_fn"])
    lib.ascend_pool_malloc.restype = ctypes.c_void_p
    lib.ascend_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ascend_pool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ascend_pool_last_error_code.restype = ctypes.c_int
    stream1, stream2 = ap.create_stream(device=0), ap.create_stream(device=0)
    busy = lib.ascend_pool_malloc(16, 0, stream1)
    n = 1000 * 1000 * 4
    for erase in (lambda p: erase_stream_fn(p, stream1), lambda p: ap.erase_stream(p, stream1)):
        sim.launch_fill(stream1, busy, 16, 1, delay_s=0.5)
        tensor1 = lib.ascend_pool_malloc(n, 0, stream2)
        record_stream_fn(tensor1, stream1)
        lib.ascend_pool_clear_last_error()
        erase(tensor1)
        assert lib.ascend_pool_last_error_code() == 0
        lib.ascend_pool_free(tensor1, n, 0, stream2)
        tensor2 = lib.ascend_pool_malloc(n, 0, stream2)
        assert tensor2 == tensor1
        lib.ascend_pool_free(tensor2, n, 0, stream2)
        ap.synchronize(stream1)
    erase_stream_fn(tensor1 + 512, stream1)  # not a live block: the error set, nothing changed
    assert lib.ascend_pool_last_error_code() != 0
    lib.ascend_pool_free(busy, 16, 0, stream1)
    # a torch_npu whose hook takes a C++ NPUStream is not given a C function for it either
    assert "set_erase_stream_fn" not in _installed_stream_hooks(
        monkeypatch, tmp_path / "npu_stream", PLUGGABLE_NPU_STREAM.replace("record", "erase"))


def _module_stats_generator(device, n=35):
    """torch_npu test_npu_multinpu.py's _test_memory_stats_generator on the module functions
    (ap.memory_allocated(device) & co., ap.malloc(n, device=device)): yields between steps."""
    import math
    import random

    m0 = ap.memory_allocated(device)
    last = dict(m=m0, max_m=ap.max_memory_allocated(device), r=ap.memory_reserved(device),
                max_r=ap.max_memory_reserved(device))

    def alloc(*shape):  # torch.npu.FloatTensor(*shape); an empty one holds no memory
        nbytes = 4 * math.prod(shape)
        return ap.malloc(nbytes, device=device) if nbytes else None

    def free(ptr):
        if ptr is not None:
            ap.free(ptr, device=device)

    def assert_change(comp=1, empty_cache=False, reset_peak=False):
        m, max_m = ap.memory_allocated(device), ap.max_memory_allocated(device)
        assert (m > last["m"]) if comp > 0 else (m < last["m"]) if comp < 0 else (m == last["m"]), (device, comp)
        assert m <= max_m and max_m >= last["max_m"]
        r, max_r = ap.memory_reserved(device), ap.max_memory_reserved(device)
        assert r <= max_r and max_r >= last["max_r"]
        last.update(m=m, max_m=max_m, r=r, max_r=max_r)
        if empty_cache:
            ap.empty_cache(device)
            r, max_r = ap.memory_reserved(device), ap.max_memory_reserved(device)
            assert r <= last["r"] and max_r == last["max_r"]
            last["r"] = r
        if reset_peak:
            ap.reset_peak_memory_stats(device)
            assert ap.memory_allocated(device) == ap.max_memory_allocated(device) == last["m"]
            assert ap.memory_reserved(device) == ap.max_memory_reserved(device) == last["r"]
            last.update(max_m=last["m"], max_r=last["r"])

    for kw in ({}, dict(reset_peak=True), dict(empty_cache=True), dict(reset_peak=True), {}):
        assert_change(0, **kw)
    yield
    tensors1 = [alloc(1), alloc(10, 20), alloc(200, 300, 2000)]
    m1 = ap.memory_allocated(device)
    assert_change(1)
    yield
    tensors2 = []
    for i in range(1, n // 2 + 1):  # small ones
        tensors2.append(alloc(i, i * 4))
        assert_change(1)
        yield
    for i in range(5, n // 2 + 5):  # large ones
        tensors2.append(alloc(i, i * 7, i * 9, i * 11))
        assert_change(1, reset_peak=(i % 2 == 0))
        yield
    tensors2.append(alloc(0, 0, 0))
    assert_change(0)
    yield
    random.Random(device).shuffle(tensors2)
    assert_change(0, reset_peak=True)
    yield
    for i in range(n // 2):
        ptr = tensors2.pop(i)
        free(ptr)
        assert_change(-1 if ptr else 0)
        yield
    for i in range(2, 2 * n // 3 + 2):
        tensors2.append(alloc(i, i * 3, i * 8))
        assert_change(1)
        yield
    for ptr in tensors2:
        free(ptr)
    assert_change(-1, reset_peak=True)
    assert_change(0)
    assert ap.memory_allocated(device) == m1
    yield
    for ptr in tensors1:
        free(ptr)
    assert_change(-1, reset_peak=True)
    assert ap.memory_allocated(device) == m0
    assert_change(0, empty_cache=True)
    assert_change(0, reset_peak=True)


def _check_memory_stat_consistency():
    # torch_npu's _check_memory_stat_consistency: ap.memory_snapshot()'s segments, per device,
    # make each device's current figures (the requested bytes of its active blocks included)
    import collections

    expected = collections.defaultdict(lambda: collections.defaultdict(int))
    for seg in ap.memory_snapshot():
        e, kind, expandable = expected[seg["device"]], seg["segment_type"] + "_pool", seg["is_expandable"]
        for k in ("all", kind):
            e[f"segment.{k}.current"] += not expandable
            for key, field in (("allocated_bytes", "allocated_size"), ("reserved_bytes", "total_size"),
                               ("active_bytes", "active_size"), ("requested_bytes", "requested_size")):
                e[f"{key}.{k}.current"] += seg[field]
        split = len(seg["blocks"]) > 1
        active_requested = 0
        for b in seg["blocks"]:
            active = b["state"].startswith("active_")
            active_requested += b["requested_size"] if active else 0
            for k in ("all", kind):
                e[f"allocation.{k}.current"] += b["state"] == "active_allocated"
                e[f"active.{k}.current"] += active
                if b["state"] == "inactive" and split and not expandable:
                    e[f"inactive_split.{k}.current"] += 1
                    e[f"inactive_split_bytes.{k}.current"] += b["size"]
        assert active_requested == seg["requested_size"]
    for device, e in expected.items():
        st = ap.memory_stats(device)
        assert {k: st[k] for k in e} == dict(e), device


def test_memory_stats_multigpu_on_the_module_functions():
    # torch_npu test_npu_multinpu.py test_memory_stats (with the consistency check after each
    # step) and test_memory_stats_multigpu: two devices' generators interlaced, then in a
    # semi-random order; each device's figures move only with its own allocations
    import random

    ap.empty_cache()
    for _ in _module_stats_generator(0):
        _check_memory_stat_consistency()

    def advance(gen, end):
        if not end:
            try:
                next(gen)
            except StopIteration:
                end = True
        return end

    rng = random.Random(0)
    for order in ("interlaced", "semi-random"):
        ap.empty_cache()
        gen0, gen1 = _module_stats_generator(0), _module_stats_generator(1)
        end0 = end1 = False
        while not (end0 and end1):
            end0 = advance(gen0, end0)
            for _ in range(1 if order == "interlaced" else rng.randrange(3) if not end0 else 10**6):
                end1 = advance(gen1, end1)
                if end1:
                    break
        _check_memory_stat_consistency()


def test_erase_stream_of_a_stream_the_pool_does_not_know_changes_nothing():
    # docs/bad_input.md: a stream ptr is not marked with changes nothing, silently, as
    # torch_npu's erase_stream and the C hook; from Python one this pool did not know (destroyed
    # since its record_stream, or a handle never registered) was an InvalidStreamError.
    pool = ap.Pool(0, backend="sim")
    try:
        s = pool.create_stream()
        ptr = pool.malloc(MiB)
        pool.record_stream(ptr, s)
        pool.destroy_stream(s)
        pool.erase_stream(ptr, s)
        pool.erase_stream(ptr, 0xDEAD000)
        ap.erase_stream(ptr, 0xDEAD000)  # the module function finds ptr's pool and does the same
        with pytest.raises(ap.StreamTypeError):
            pool.erase_stream(ptr, "s")
        with pytest.raises(ap.InvalidPointerError):
            pool.erase_stream(ptr + 512, 0xDEAD000)
        pool.free(ptr)
        pool._check_invariants()
    finally:
        pool.close()

"""ap.set_allocator_settings (torch.cuda.memory._set_allocator_settings, and torch_npu's once
installed): the knobs torch re-reads on each call change every open pool at runtime, as torch's
process-wide config; a knob fixed for a pool's life is refused naming it, nothing changed. The
tests of torch's test_cuda.py (test_allocator_settings, test_roundup_power2_divisions_0/_1) ported."""

import threading

import pytest

import ascend_pool as ap
from ascend_pool import config

MiB = 1 << 20
KEY = "active_bytes.all.allocated"


@pytest.fixture(autouse=True)
def restore_settings():
    saved = config._runtime
    yield
    ap.set_allocator_settings("")  # the default pools back to no max_split, gc or roundup
    config._runtime = saved


def power2_div(size, div_factor):  # torch's test helper
    pow2 = 1
    while pow2 < size:
        pow2 = pow2 * 2
    if pow2 == size:
        return pow2
    step = pow2 / 2 / div_factor
    ret = pow2 / 2
    while ret < size:
        ret = ret + step
    return ret


def roundup_512(size):
    return 512 if size < 512 else 512 * ((size + 512 - 1) // 512)


def _alloc(nbytes, keep):
    # torch's tensor of nbytes: the pool adds pad_bytes (torch_npu's 32 on acl and the simulator)
    # before rounding, so ask for that much less to get torch's figures exactly
    keep.append(ap.malloc(nbytes - ap.default_pool(0).config["pad_bytes"], device=0))


def test_torchs_allocator_settings_test():
    keep = []
    nbytes = 4 * 21 * MiB
    nbytes_big = 4 * 100 * MiB
    try:
        ap.empty_cache()
        start_mem = ap.memory_stats(0)[KEY]
        ap.set_allocator_settings("")
        _alloc(nbytes, keep)
        reg_mem = ap.memory_stats(0)[KEY]
        start_requested = ap.memory_stats(0)["requested_bytes.all.allocated"]
        ap.set_allocator_settings("roundup_power2_divisions:4")
        _alloc(nbytes, keep)
        pow2_div4_mem = ap.memory_stats(0)[KEY]
        assert reg_mem - start_mem == roundup_512(nbytes)
        assert pow2_div4_mem - reg_mem == power2_div(nbytes, 4)
        pad = ap.default_pool(0).config["pad_bytes"]
        assert ap.memory_stats(0)["requested_bytes.all.allocated"] - start_requested == nbytes - pad

        ap.set_allocator_settings("garbage_collection_threshold:0.5")
        ap.set_allocator_settings("garbage_collection_threshold:0.5,max_split_size_mb:70")
        # should have reset the power2 divisions now
        ap.empty_cache()
        start_mem = ap.memory_stats(0)[KEY]
        _alloc(nbytes, keep)
        assert ap.memory_stats(0)[KEY] - start_mem == roundup_512(nbytes)
        settings = ap.default_pool(0).snapshot()["allocator_settings"]
        assert settings["max_split_size"] == 70 * MiB and settings["garbage_collection_threshold"] == 0.5

        # roundup_power2_divisions knob array syntax
        ap.empty_cache()
        ap.set_allocator_settings(
            "garbage_collection_threshold:0.5,roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]")
        start_mem = ap.memory_stats(0)[KEY]
        _alloc(nbytes, keep)
        assert ap.memory_stats(0)[KEY] - start_mem == power2_div(nbytes, 8)
        ap.empty_cache()
        start_mem = ap.memory_stats(0)[KEY]
        _alloc(nbytes_big, keep)
        assert ap.memory_stats(0)[KEY] - start_mem == power2_div(nbytes_big, 2)
        assert ap.default_pool(0).snapshot()["allocator_settings"]["max_split_size"] == -1, "reset when not given"

        for bad in ("foo:1,bar:2", "garbage_collection_threshold:1.2", "max_split_size_mb:2"):
            with pytest.raises(ap.ConfigError):  # a ValueError, as torch's
                ap.set_allocator_settings(bad)
        ap.default_pool(0)._check_invariants()
    finally:
        for ptr in keep:
            ap.free(ptr, device=0)


def test_torchs_roundup_power2_divisions_0_and_1():
    keep = []
    try:
        ap.empty_cache()
        nbytes = 4 * 67 * MiB  # 268 MB, in the [256, 512) interval
        start_mem = ap.memory_stats(0)[KEY]
        ap.set_allocator_settings("roundup_power2_divisions:[128:1,256:0,512:4]")
        _alloc(nbytes, keep)
        assert ap.memory_stats(0)[KEY] - start_mem == roundup_512(nbytes), "divisions 0: no rounding"
        nbytes = 4 * 130 * MiB  # 520 MB, in [512, 1024)
        start_mem = ap.memory_stats(0)[KEY]
        _alloc(nbytes, keep)
        assert ap.memory_stats(0)[KEY] - start_mem == power2_div(nbytes, 4)

        nbytes = 4 * 21 * 125 * 125
        ap.set_allocator_settings("")
        start_mem = ap.memory_stats(0)[KEY]
        _alloc(nbytes, keep)
        reg_mem = ap.memory_stats(0)[KEY]
        ap.set_allocator_settings("roundup_power2_divisions:1")
        _alloc(nbytes, keep)
        assert reg_mem - start_mem == roundup_512(nbytes)
        assert ap.memory_stats(0)[KEY] - reg_mem == roundup_512(nbytes)
    finally:
        for ptr in keep:
            ap.free(ptr, device=0)


def test_a_knob_fixed_for_a_pools_life_is_refused_naming_it_and_nothing_changes():
    pool = ap.Pool(0, max_split_size_mb=100)
    grown = ap.Pool(0, expandable_segments=True)
    try:
        with pytest.raises(ap.ConfigError, match="expandable_segments:True cannot change at runtime"):
            ap.set_allocator_settings("max_split_size_mb:200,expandable_segments:True")
        assert pool.snapshot()["allocator_settings"]["max_split_size"] == 100 * MiB, "nothing changed"
        with pytest.raises(ap.ConfigError, match="page_size"):
            ap.set_allocator_settings("page_size:1g")
        grown.close()
        # vLLM's toggle around graph capture: the value every open pool has is no change
        ap.set_allocator_settings("expandable_segments:False,max_split_size_mb:200")
        assert pool.snapshot()["allocator_settings"]["max_split_size"] == 200 * MiB
        later = ap.Pool(0)
        kwargs = ap.Pool(0, max_split_size_mb=300)
        try:  # pools made later take the settings; a keyword argument still wins
            assert later.snapshot()["allocator_settings"]["max_split_size"] == 200 * MiB
            assert kwargs.snapshot()["allocator_settings"]["max_split_size"] == 300 * MiB
        finally:
            later.close()
            kwargs.close()
        with pytest.raises(ap.ConfigTypeError):
            ap.set_allocator_settings(None)
    finally:
        pool.close()
        grown.close()


def test_a_runtime_max_split_size_recounts_the_oversize_figures():
    pool = ap.Pool(0)
    try:
        ptrs = [pool.malloc(n * MiB) for n in (30, 64, 100)]
        assert pool.memory_stats()["oversize_allocations.current"] == 0
        ap.set_allocator_settings("max_split_size_mb:50")
        s = pool.memory_stats()
        assert s["oversize_allocations.current"] == 2 and s["oversize_segments.current"] == 2
        pool._check_invariants()  # a free takes off what the new bound says: counted in now
        pool.free(ptrs.pop())
        ap.set_allocator_settings("")
        pool._check_invariants()
        for p in ptrs:
            pool.free(p)
        s = pool.memory_stats()
        assert s["oversize_allocations.current"] == 0 and s["oversize_allocations.allocated"] >= 2
        pool._check_invariants()
    finally:
        pool.close()


def test_settings_changing_while_threads_allocate_keep_the_pool_consistent():
    pool = ap.Pool(0)
    stop = threading.Event()
    errors = []

    def work():
        try:
            with ap.use_mem_pool(pool):
                while not stop.is_set():
                    ptrs = [ap.malloc(n) for n in (3 * MiB + 5, 70 * MiB, 1000)]
                    for p in ptrs:
                        ap.free(p)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for i in range(200):
            ap.set_allocator_settings("roundup_power2_divisions:4,max_split_size_mb:64" if i % 2 else "")
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    pool._check_invariants()
    pool.close()


@pytest.mark.parametrize("setting, field, want", [("max_split_size_mb:64", "max_split_size", 64 * MiB),
                                                  ("garbage_collection_threshold:0.5", "gc_threshold", 0.5)])
def test_settings_made_while_another_thread_opens_a_pool_reach_that_pool(monkeypatch, setting, field, want):
    # The call landed between the opening pool's read of the knobs and its registration: it saw no
    # such pool and the pool opened with the old settings (a lifelong knob too, which the call
    # would have refused had it seen the pool: expandable_segments in a process with no pool
    # open). torch's settings reach its allocator at once.
    from ascend_pool import pool as pool_mod
    opened = pool_mod.PoolBase._open

    def open_after_a_settings_call(self, *args, **kwargs):
        monkeypatch.delattr(pool_mod.Pool, "_open")  # once
        t = threading.Thread(target=ap.set_allocator_settings, args=(setting,))
        t.start()
        t.join()
        return opened(self, *args, **kwargs)

    monkeypatch.setattr(pool_mod.Pool, "_open", open_after_a_settings_call, raising=False)
    pool = ap.Pool(0)
    try:
        assert pool.config.get(field) == want, pool.config
        assert pool.knobs == dict([setting.split(":")]), pool.knobs
    finally:
        pool.close()

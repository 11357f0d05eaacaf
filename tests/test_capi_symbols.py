"""The C ABI as frameworks load it: ctypes.CDLL(ascend_pool.library_path()) and lookup by name
(dlsym), called from several threads at once, and PyTorch's own CUDAPluggableAllocator
constructor resolving our names."""

import bisect
import ctypes
import os
import re
import threading

import pytest

import ascend_pool as ap
from ascend_pool.capi import SYMBOLS, header_path

MALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)


@pytest.fixture(scope="module")
def lib():
    """The library exactly as torch opens it, with argtypes for the calls used here."""
    lib = ctypes.CDLL(ap.library_path())
    lib.ascend_pool_malloc.restype = ctypes.c_void_p
    lib.ascend_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ascend_pool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ascend_pool_last_error.restype = ctypes.c_char_p
    ap.default_pool(0)  # the default pool exists; its stats are the reference below
    return lib


def address(lib, name):
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def test_library_path_is_the_extension_and_exports_every_symbol(lib):
    import ascend_pool._core as core

    assert os.path.samefile(ap.library_path(), core.__file__)
    for name in SYMBOLS:
        assert address(lib, name), name
    # A plain dlopen of the same file (RTLD_LOCAL, as torch does) resolves the same functions.
    again = ctypes.CDLL(ap.library_path(), mode=os.RTLD_LOCAL | os.RTLD_NOW)
    assert all(address(again, n) == address(lib, n) for n in SYMBOLS)


def test_the_pools_own_functions_are_not_exported(lib):
    """Only the C ABI (and the module's init) is exported: a framework's process loads many
    libraries, and an exported internal name (ap_pool_malloc, ap_block_new ...) could be
    interposed by, or collide with, another library's symbol of the same name."""
    for internal in ("ap_pool_malloc", "ap_pool_free", "ap_block_new", "ap_free_insert", "ap_history_tls_ctx"):
        with pytest.raises(AttributeError):
            getattr(lib, internal)
    assert address(lib, "PyInit__core") and address(lib, "ascend_pool_malloc")


def test_header_declares_exactly_the_exported_symbols():
    with open(header_path()) as f:
        text = f.read()
    declared = set(re.findall(r"\b(ascend_pool_\w+)\s*\(", text))
    assert declared == set(SYMBOLS)
    assert "void *ascend_pool_malloc(ssize_t size, int device, void *stream);" in text
    assert "void ascend_pool_free(void *ptr, ssize_t size, int device, void *stream);" in text


def test_malloc_free_round_trip_updates_the_default_pool(lib):
    stats0 = ap.memory_stats(0)
    p = lib.ascend_pool_malloc(1 << 20, 0, None)
    assert p and p % 64 == 0
    assert ap.memory_stats(0)["allocated_bytes.all.current"] >= stats0["allocated_bytes.all.current"] + (1 << 20)
    lib.ascend_pool_free(p, 1 << 20, 0, None)
    assert ap.memory_stats(0)["allocated_bytes.all.current"] == stats0["allocated_bytes.all.current"]


def test_several_threads_at_once_never_get_overlapping_blocks(lib):
    """ctypes releases the GIL around each call: the C calls really run concurrently."""
    live = []  # sorted (start, end) of every block some thread holds
    guard = threading.Lock()
    errors = []
    base = ap.memory_stats(0)["allocated_bytes.all.current"]

    def claim(p, n):
        with guard:
            i = bisect.bisect(live, (p, p + n))
            if (i and live[i - 1][1] > p) or (i < len(live) and live[i][0] < p + n):
                errors.append(f"overlap at {p:#x}")
            live.insert(i, (p, p + n))

    def release(p, n):
        with guard:
            live.remove((p, p + n))

    def worker(seed):
        import random

        rnd = random.Random(seed)
        held = []
        for _ in range(400):
            if held and rnd.random() < 0.5:
                p, n = held.pop(rnd.randrange(len(held)))
                release(p, n)
                lib.ascend_pool_free(p, n, 0, None)
            else:
                n = rnd.choice([1, 100, 4096, 70_000, 1 << 20, 3 << 20])
                p = lib.ascend_pool_malloc(n, 0, None)
                if not p:
                    errors.append(lib.ascend_pool_last_error())
                    continue
                ctypes.memset(p, seed, min(n, 64))  # simulated device memory is host-visible
                claim(p, n)
                held.append((p, n))
        for p, n in held:
            assert ctypes.string_at(p, min(n, 64)) == bytes([seed]) * min(n, 64)
            release(p, n)
            lib.ascend_pool_free(p, n, 0, None)

    failures = []

    def guarded(seed):  # an assert failing in a thread is only a warning: hand it to the test
        try:
            worker(seed)
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=guarded, args=(i + 1,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    assert not errors, errors[:5]
    assert not live
    assert ap.memory_stats(0)["allocated_bytes.all.current"] == base


def test_torch_cuda_pluggable_allocator_resolves_our_symbols(lib, monkeypatch):
    """PyTorch's own constructor dlopens library_path() and dlsyms the names. On a CPU build the
    step after that (torch._C._cuda_customAllocator) does not exist: stand in for it to capture
    the two addresses torch resolved, then call them with the signatures torch uses."""
    torch = pytest.importorskip("torch")
    from torch.cuda.memory import CUDAPluggableAllocator

    captured = {}

    class FakeAllocator:
        def set_init_fn(self, fn):
            captured["init"] = fn

    def custom_allocator(alloc_fn, free_fn):
        captured["alloc"], captured["free"] = alloc_fn, free_fn
        return FakeAllocator()

    if not hasattr(torch._C, "_cuda_customAllocator"):
        # Unpatched, the real constructor gets through dlopen/dlsym and stops at the CUDA-only step.
        with pytest.raises(AttributeError, match="_cuda_customAllocator"):
            CUDAPluggableAllocator(ap.library_path(), "ascend_pool_malloc", "ascend_pool_free")
    monkeypatch.setattr(torch._C, "_cuda_customAllocator", custom_allocator, raising=False)
    alloc = CUDAPluggableAllocator(ap.library_path(), "ascend_pool_malloc", "ascend_pool_free")
    assert captured["alloc"] == address(lib, "ascend_pool_malloc")
    assert captured["free"] == address(lib, "ascend_pool_free")
    # torch calls alloc_fn(size_t size, int device, cudaStream_t) and free_fn(ptr, size, device, stream).
    malloc_fn, free_fn = MALLOC(captured["alloc"]), FREE(captured["free"])
    before = ap.memory_stats(0)["allocated_bytes.all.current"]
    p = malloc_fn(4096, 0, None)
    assert p and ap.memory_stats(0)["allocated_bytes.all.current"] > before
    free_fn(p, 4096, 0, None)
    assert ap.memory_stats(0)["allocated_bytes.all.current"] == before
    # Names that are not exported fail at dlsym, inside torch's constructor.
    with pytest.raises(AttributeError, match="undefined symbol"):
        CUDAPluggableAllocator(ap.library_path(), "ascend_pool_nosuch", "ascend_pool_free")
    # The integration wires the optional hooks the allocator object offers (here only init).
    from ascend_pool.integrations import torch_cuda

    alloc, hooks = torch_cuda.build_allocator(torch.cuda.memory)
    assert hooks == ["ascend_pool_init"] and captured["init"] == address(lib, "ascend_pool_init")

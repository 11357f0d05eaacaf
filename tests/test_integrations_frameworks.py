"""The framework integrations: clear failures where a framework is missing, and the wiring each
install() does, checked against stand-ins with the frameworks' own interfaces where the real
framework cannot run here (torch_npu needs an NPU, CuPy and CUDA PyTorch a GPU)."""

import ctypes
import importlib.util
import os
import pickle
import shutil
import subprocess
import sys
import types

import pytest

import ascend_pool as ap
from ascend_pool.errors import ConfigError
from ascend_pool.integrations import FrameworkMissingError, _common


def address(name):
    return ctypes.cast(getattr(ctypes.CDLL(ap.library_path()), name), ctypes.c_void_p).value


def absent(module):
    return importlib.util.find_spec(module) is None


@pytest.mark.skipif(not absent("cupy"), reason="CuPy is installed here")
def test_cupy_missing_fails_clearly():
    from ascend_pool.integrations import cupy as ap_cupy

    with pytest.raises(FrameworkMissingError, match=r"needs 'cupy'.*pip install cupy") as e:
        ap_cupy.install()
    assert isinstance(e.value, ImportError)
    assert isinstance(e.value, ap.PoolError)   # CONTRACT.md: the base of the package's errors


@pytest.mark.skipif(not absent("torch_npu"), reason="torch_npu is installed here")
def test_torch_npu_missing_fails_clearly():
    from ascend_pool.integrations import torch_npu as ap_npu

    with pytest.raises(FrameworkMissingError, match=r"needs 'torch(_npu)?'.*torch-npu"):
        ap_npu.install()


def test_torch_cuda_without_cuda_fails_clearly():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip(reason="a CUDA device is usable here: see bench/gpu_integrations_check.py")
    from ascend_pool.integrations import torch_cuda as ap_cuda

    with pytest.raises(FrameworkMissingError, match="without CUDA|no CUDA device"):
        ap_cuda.install()


class FakePluggable:
    """torch_npu.npu.memory.NPUPluggableAllocator as torch_npu writes it: dlopen + dlsym by
    name through ctypes, and an allocator object with the hook setters."""

    def __init__(self, path, alloc_fn_name, free_fn_name):
        lib = ctypes.CDLL(path)
        self.alloc_fn = ctypes.cast(getattr(lib, alloc_fn_name), ctypes.c_void_p).value
        self.free_fn = ctypes.cast(getattr(lib, free_fn_name), ctypes.c_void_p).value
        self.hooks = {}
        hooks = self.hooks

        class Allocator:
            def __getattr__(self, setter):
                if setter in ("set_init_fn", "set_reset_fn", "set_memory_fraction_fn", "set_base_alloc_fn",
                              "set_record_stream_fn"):
                    return lambda fn: hooks.__setitem__(setter, fn)
                raise AttributeError(setter)

        self._allocator = Allocator()

    def allocator(self):
        return self._allocator


@pytest.fixture
def fake_torch_npu(monkeypatch):
    memory = types.SimpleNamespace(NPUPluggableAllocator=FakePluggable, changed=[])
    memory.change_current_allocator = memory.changed.append
    for name, mod in (("torch_npu", types.ModuleType("torch_npu")), ("torch_npu.npu", types.ModuleType("torch_npu.npu")),
                      ("torch_npu.npu.memory", memory)):
        monkeypatch.setitem(sys.modules, name, mod)
    if absent("torch"):
        monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    return memory


def test_torch_npu_allocator_gets_our_symbols_and_hooks(fake_torch_npu):
    from ascend_pool.integrations import torch_npu as ap_npu

    alloc, hooks = ap_npu.build_allocator(fake_torch_npu)
    path, alloc_name, free_name = _common.torch_alloc_functions()  # the C ABI's pair without a C++ build
    lib = ctypes.CDLL(path)
    assert (alloc.alloc_fn, alloc.free_fn) == tuple(ctypes.cast(getattr(lib, n), ctypes.c_void_p).value
                                                    for n in (alloc_name, free_name))
    assert hooks == ["ascend_pool_init", "ascend_pool_reset", "ascend_pool_set_memory_fraction",
                     "ascend_pool_base_alloc"]
    assert alloc.hooks == {"set_init_fn": address("ascend_pool_init"), "set_reset_fn": address("ascend_pool_reset"),
                           "set_memory_fraction_fn": address("ascend_pool_set_memory_fraction"),
                           "set_base_alloc_fn": address("ascend_pool_base_alloc")}


def test_torch_npu_install_refuses_a_non_acl_backend(fake_torch_npu):
    from ascend_pool.integrations import torch_npu as ap_npu

    with pytest.raises(ConfigError, match=r"torch_npu needs the acl backend, but \$ASCEND_POOL_BACKEND='sim'"):
        ap_npu.install()
    assert fake_torch_npu.changed == []  # nothing swapped


# torch's Python bindings (HANDLE_TH_ERRORS, torch/csrc/Exceptions.h) as they turn a C++ exception
# from the allocator into a Python one: c10::OutOfMemoryError by type (torch.OutOfMemoryError,
# with what_without_backtrace()), any other std::exception as RuntimeError.
TORCH_OOM_CALLER = r"""
#include <c10/util/Exception.h>
#include <dlfcn.h>
#include <cstdio>
#include <functional>
extern "C" int alloc_like_torch(const char *path, const char *alloc_name, size_t size, char *out, size_t len) {
    void *lib = dlopen(path, RTLD_LAZY);
    if (!lib) { snprintf(out, len, "dlopen: %s", dlerror()); return -1; }
    std::function<void *(size_t, int, void *)> alloc_fn =
        reinterpret_cast<void *(*)(size_t, int, void *)>(dlsym(lib, alloc_name));
    try {
        snprintf(out, len, "%p", alloc_fn(size, 0, nullptr));
        return 1;
    } catch (const c10::OutOfMemoryError &e) {
        snprintf(out, len, "%s", e.what_without_backtrace());
        return 3;
    } catch (const std::exception &e) {
        snprintf(out, len, "%s", e.what());
        return 2;
    }
}
"""


@pytest.mark.skipif(shutil.which("g++") is None or absent("torch"), reason="needs g++ and torch's C++ headers")
def test_torchs_alloc_function_throws_torchs_out_of_memory_error_when_memory_runs_out(tmp_path):
    # torch's and torch_npu's own allocators throw c10::OutOfMemoryError, which Python sees as
    # torch.OutOfMemoryError and programs catch to back off (a smaller batch); ours threw
    # std::runtime_error for every refusal, a plain RuntimeError that `except torch.OutOfMemoryError`
    # let through. The device, the memory fraction and a tenant's quota are out-of-memory errors,
    # as ap.OutOfMemoryError's; another refusal stays a runtime_error.
    import torch  # loads torch's libc10, as torch has when it calls its allocator

    include, libdir = (os.path.join(os.path.dirname(torch.__file__), d) for d in ("include", "lib"))
    if not os.path.exists(os.path.join(include, "c10", "util", "Exception.h")):
        pytest.skip(reason="this torch ships no C++ headers")
    src, lib = tmp_path / "oom_caller.cpp", tmp_path / "liboomcaller.so"
    src.write_text(TORCH_OOM_CALLER)
    subprocess.run(["g++", "-shared", "-fPIC", "-std=c++17", f"-I{include}", "-o", str(lib), str(src),
                    f"-L{libdir}", "-lc10", f"-Wl,-rpath,{libdir}", "-ldl"], check=True)
    caller = ctypes.CDLL(str(lib))
    caller.alloc_like_torch.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
                                        ctypes.c_size_t]
    path, alloc_name, _ = _common.torch_alloc_functions()

    def alloc(size):
        out = ctypes.create_string_buffer(2048)
        return caller.alloc_like_torch(path.encode(), alloc_name.encode(), size, out, 2048), out.value.decode()

    pool = ap.default_pool(0)
    rc, why = alloc(4 * pool.mem_get_info()[1])
    assert rc == 3 and why.startswith("ascend_pool: ") and "out of memory: Tried to allocate" in why, (rc, why)
    for huge in ((1 << 63) + 5, (1 << 64) - 1):  # past the C ABI's ssize_t: torch's out-of-memory too
        rc, why = alloc(huge)
        assert rc == 3 and f"Tried to allocate more than 1EB memory ({huge} bytes)" in why, (rc, why)
    ctx = pool.context("torch-oom", quota="64MiB")
    try:
        ap.set_per_process_memory_fraction(0.001, 0)
        rc, why = alloc(256 << 20)
        assert rc == 3 and "limit" in why, (rc, why)
        ap.set_per_process_memory_fraction(1.0, 0)
        with ctx:
            rc, why = alloc(256 << 20)
        assert rc == 3 and "quota" in why, (rc, why)
    finally:
        ap.set_per_process_memory_fraction(1.0, 0)
        pool.set_limit(None)
        ctx.close()


class CupyOutOfMemoryError(MemoryError):  # CuPy's (memory.pyx): its fallbacks catch this class
    def __init__(self, size, total, limit=0):
        self._size, self._total, self._limit = size, total, limit
        super().__init__(f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} bytes).")


# torch_npu's NPUPluggableAllocator and torch's CUDAPluggableAllocator as they call their alloc
# function: dlopen of the path given, dlsym by name, a std::function, no NULL check; the caller
# (at::empty, then Python's binding) turns a C++ exception into RuntimeError.
TORCH_CALLER = r"""
#include <dlfcn.h>
#include <cstdio>
#include <functional>
#include <stdexcept>
extern "C" int alloc_like_torch(const char *path, const char *alloc_name, const char *free_name, size_t size,
                                char *out, size_t len) {
    void *lib = dlopen(path, RTLD_LAZY);
    if (!lib) { snprintf(out, len, "dlopen: %s", dlerror()); return -1; }
    std::function<void *(size_t, int, void *)> alloc_fn =
        reinterpret_cast<void *(*)(size_t, int, void *)>(dlsym(lib, alloc_name));
    std::function<void(void *, size_t, int, void *)> free_fn =
        reinterpret_cast<void (*)(void *, size_t, int, void *)>(dlsym(lib, free_name));
    try {
        void *p = alloc_fn(size, 0, nullptr);
        snprintf(out, len, "%p", p);
        if (p) free_fn(p, size, 0, nullptr);
        return p ? 1 : 0;
    } catch (const std::exception &e) {
        snprintf(out, len, "%s", e.what());
        return 2;
    }
}
"""


def test_torchs_alloc_function_throws_when_the_pool_cannot_allocate(tmp_path):
    # Neither torch_npu nor torch checks a NULL from its alloc function: the C ABI's NULL on out
    # of memory became a tensor at address 0 (peer11 1). The pair the integrations hand torch
    # throws instead, with the pool's message, which torch raises as RuntimeError.
    if shutil.which("g++") is None:  # the package was built without one too: torch gets the C ABI's pair
        assert _common.torch_alloc_functions() == (ap.library_path(), "ascend_pool_malloc", "ascend_pool_free")
        assert not os.path.exists(_common.TORCH_ALLOC_LIB)
        return
    src, lib = tmp_path / "caller.cpp", tmp_path / "libcaller.so"
    src.write_text(TORCH_CALLER)
    subprocess.run(["g++", "-shared", "-fPIC", "-std=c++17", "-o", str(lib), str(src), "-ldl"], check=True)
    caller = ctypes.CDLL(str(lib))
    caller.alloc_like_torch.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]

    def alloc(path, alloc_name, free_name, size):
        out = ctypes.create_string_buffer(2048)
        rc = caller.alloc_like_torch(path.encode(), alloc_name.encode(), free_name.encode(), size, out, 2048)
        return rc, out.value.decode()

    path, alloc_name, free_name = _common.torch_alloc_functions()
    assert path == _common.TORCH_ALLOC_LIB
    pool = ap.default_pool(0)
    before = pool.memory_stats()["allocation.all.current"]
    assert alloc(path, alloc_name, free_name, 1 << 20)[0] == 1, "served, and freed through the pair"
    assert pool.memory_stats()["allocation.all.current"] == before
    too_big = 4 * pool.mem_get_info()[1]
    rc, why = alloc(path, alloc_name, free_name, too_big)
    assert rc == 2 and "out of memory" in why and "Tried to allocate" in why, (rc, why)
    for huge in ((1 << 63) + 5, (1 << 64) - 1):  # torch's size_t, past SSIZE_MAX: named as asked, not wrapped
        rc, why = alloc(path, alloc_name, free_name, huge)
        assert rc == 2 and f"out of memory: Tried to allocate more than 1EB memory ({huge} bytes)" in why, (rc, why)
    # the C ABI's own function, for C callers: NULL and the last error, no exception
    assert alloc(ap.library_path(), "ascend_pool_malloc", "ascend_pool_free", too_big) == (0, "(nil)")


def test_torchs_alloc_function_counts_and_tells_a_size_past_ssize_max_as_every_out_of_memory(tmp_path):
    # torch's size_t from 2**63 on (past the C ABI's ssize_t) was refused by the hook itself: the
    # same out-of-memory error, but num_ooms did not count it, the OOM observers (torch's oom
    # trace, attach_out_of_memory_observer) were not told and the last error was not set, where
    # 2**63-1 and every Python path for these sizes do all three.
    if shutil.which("g++") is None:
        pytest.skip(reason="no g++: the package has no torch alloc library to test either")
    src, lib = tmp_path / "caller.cpp", tmp_path / "libcaller.so"
    src.write_text(TORCH_CALLER)
    subprocess.run(["g++", "-shared", "-fPIC", "-std=c++17", "-o", str(lib), str(src), "-ldl"], check=True)
    caller = ctypes.CDLL(str(lib))
    caller.alloc_like_torch.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
    path, alloc_name, free_name = _common.torch_alloc_functions()
    core = ctypes.CDLL(ap.library_path())
    core.ascend_pool_last_error_code.restype = ctypes.c_int
    pool = ap.default_pool(0)
    seen = []
    observer = lambda device, size, *figures: seen.append((device, size))  # noqa: E731
    ap.attach_out_of_memory_observer(observer)
    try:
        for huge in ((1 << 63) - 1, 1 << 63, (1 << 63) + 5, (1 << 64) - 1):
            core.ascend_pool_clear_last_error()
            before, told = pool.memory_stats()["num_ooms"], len(seen)
            out = ctypes.create_string_buffer(2048)
            rc = caller.alloc_like_torch(path.encode(), alloc_name.encode(), free_name.encode(), huge, out, 2048)
            assert rc == 2 and f"Tried to allocate more than 1EB memory ({huge} bytes)" in out.value.decode()
            assert pool.memory_stats()["num_ooms"] - before == 1, huge
            assert seen[told:] == [(0, huge)], huge
            assert core.ascend_pool_last_error_code() == 1, huge  # ASCEND_POOL_E_OOM
    finally:
        ap.detach_out_of_memory_observer(observer)


class FakeCupy(types.ModuleType):
    """The slice of CuPy's interface the allocator hook uses."""

    def __init__(self):
        super().__init__("cupy")

        class UnownedMemory:
            def __init__(self, ptr, size, owner, device_id):
                self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id

        class Memory:
            def __init__(self, size):
                self.ptr, self.size = 0, size

        class MemoryPointer:
            def __init__(self, mem, offset):
                self.mem, self.ptr = mem, mem.ptr + offset

        stream = types.SimpleNamespace(ptr=0)
        self.cuda = types.SimpleNamespace(
            UnownedMemory=UnownedMemory, MemoryPointer=MemoryPointer,
            memory=types.SimpleNamespace(Memory=Memory, OutOfMemoryError=CupyOutOfMemoryError),
            runtime=types.SimpleNamespace(getDevice=lambda: 0), get_current_stream=lambda: stream,
            set_allocator=lambda fn: setattr(self, "allocator", fn))


def test_cupy_memory_returns_to_the_pool_when_cupy_drops_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", FakeCupy())
    from ascend_pool.integrations import cupy as ap_cupy

    before = ap.memory_stats(0)["allocated_bytes.all.current"]
    mp = ap_cupy.malloc(1 << 20)
    assert mp.ptr and mp.mem.size == 1 << 20 and mp.mem.device_id == 0
    assert ap.default_pool(0).block_info(mp.ptr)[0] == mp.ptr
    assert ap.memory_stats(0)["allocated_bytes.all.current"] >= before + (1 << 20)
    del mp  # CuPy lets go of the memory: the owner frees the block
    assert ap.memory_stats(0)["allocated_bytes.all.current"] == before
    empty = ap_cupy.malloc(0)
    assert empty.ptr == 0 and empty.mem.size == 0


def test_cupy_limit_string_parses_as_cupys_with_both_keys(monkeypatch):
    # CuPy's test_parse_limit_string: its dict always has "size" and "fraction", the one not
    # given None (a port read param["fraction"] after a size and got KeyError); with no
    # argument the variable is read, as CuPy's _parse_limit_string(limit=None)
    from ascend_pool.integrations import cupy as ap_cupy

    for text, size, fraction in (("0", 0, None), ("1073741824", 1073741824, None), ("0%", None, 0.0),
                                 ("40%", None, 0.4), ("70.5%", None, 0.705), ("100%", None, 1.0)):
        param = ap_cupy.parse_limit(text)
        assert param["size"] == size and param["fraction"] == fraction, text
    monkeypatch.setenv("CUPY_GPU_MEMORY_LIMIT", "25%")
    assert ap_cupy.parse_limit() == {"size": None, "fraction": 0.25}
    pool = ap.Pool(0, backend="sim")
    try:
        pool.set_limit(**ap_cupy.parse_limit("1048576"))
        assert pool.get_limit() == 1 << 20
        pool.set_limit(**ap_cupy.parse_limit("50%"))
        assert pool.get_limit() == pool.mem_get_info()[1] // 2
    finally:
        pool.close()


def test_cupy_hook_keeps_cupys_memory_limit_variable_and_out_of_memory_class(monkeypatch):
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    from ascend_pool.integrations import cupy as ap_cupy

    assert ap_cupy.parse_limit("") is None and ap_cupy.parse_limit("1048576") == {"size": 1 << 20, "fraction": None}
    assert ap_cupy.parse_limit("50%") == {"size": None, "fraction": 0.5}
    # a count no limit holds (2**64-1 and past) is refused here too, not at the first allocation
    # with pool.set_limit's words, naming no variable (before)
    for bad in ("1GB", "-5", "150%", str(2**64 - 1), "9" * 30):
        with pytest.raises(ConfigError, match="CUPY_GPU_MEMORY_LIMIT"):
            ap_cupy.parse_limit(bad)
    assert ap_cupy.parse_limit(str(2**64 - 2)) == {"size": 2**64 - 2, "fraction": None}
    monkeypatch.setattr(ap_cupy, "_limited_devices", {})
    monkeypatch.setenv("CUPY_GPU_MEMORY_LIMIT", str(64 << 20))
    pool = ap.default_pool(0)
    ctx = pool.context("cupy-first-use")
    try:
        with ctx:  # the device's first CuPy allocation reads the variable: for the device's pool
            ap_cupy.malloc(1 << 20)
        assert pool.get_limit() == 64 << 20 and ctx.get_limit() == 0, "CuPy's limit is the device pool's"
        held = ap_cupy.malloc(1 << 20)
        with pytest.raises(fake.cuda.memory.OutOfMemoryError, match=r"^Out of memory allocating 134,217,728 bytes") as e:
            ap_cupy.malloc(128 << 20)
        assert isinstance(e.value, ap.OutOfMemoryError), "still ascend_pool's, for except ap.OutOfMemoryError"
        assert e.value._size == 128 << 20 and e.value._limit == 64 << 20
        assert e.value._total == pool.memory_stats()["reserved_bytes.all.current"]
        assert "limit set to: 67,108,864 bytes" in str(e.value) and "Tried to allocate" in str(e.value)
        # a worker's out-of-memory goes back to its parent pickled (multiprocessing, dask), as CuPy's
        back = pickle.loads(pickle.dumps(e.value))
        assert type(back) is fake.cuda.memory.OutOfMemoryError
        assert (back._size, back._total, back._limit) == (e.value._size, e.value._total, 64 << 20)
        del held
        assert ap_cupy.malloc(32 << 20).ptr, "the pool keeps serving under the cap"
    finally:
        pool.set_limit(None)
        ctx.close()


def test_cupy_memory_outliving_its_stream_returns_to_the_pool_quietly(monkeypatch, caplog):
    # CuPy lets an array outlive the stream it was allocated on; the hook's free then cannot
    # order on that stream, and the C ABI frees the block on its allocation stream
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    from ascend_pool.integrations import cupy as ap_cupy

    pool = ap.default_pool(0)
    stream = pool.create_stream()
    fake.cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=stream)
    before = pool.memory_stats()["allocated_bytes.all.current"]
    mp = ap_cupy.malloc(1 << 20)
    pool.destroy_stream(stream)
    with caplog.at_level("WARNING", logger="ascend_pool.integrations.cupy"):
        del mp
    assert pool.memory_stats()["allocated_bytes.all.current"] == before
    assert not [r for r in caplog.records if "could not return" in r.getMessage()]
    pool._check_invariants()


def test_cupy_per_thread_default_stream_is_refused_not_shared(monkeypatch):
    # cudaStreamPerThread (0x2) is one handle for a different stream in each thread: treated as one
    # stream, a block freed in one thread would be reused at once in another, racing on the GPU
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    from ascend_pool.integrations import cupy as ap_cupy

    fake.cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=0x2)
    before = ap.memory_stats(0)["allocated_bytes.all.current"]
    with pytest.raises(ap.InvalidStreamError, match="cudaStreamPerThread"):
        ap_cupy.malloc(1 << 20)
    assert ap.memory_stats(0)["allocated_bytes.all.current"] == before
    fake.cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=0x1)  # cudaStreamLegacy: the default
    mp = ap_cupy.malloc(1 << 20)
    assert ap.default_pool(0).block_info(mp.ptr)[0] == mp.ptr
    del mp
    assert ap.memory_stats(0)["allocated_bytes.all.current"] == before


def test_cupy_install_needs_the_cuda_backend(monkeypatch):
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    from ascend_pool.integrations import cupy as ap_cupy

    with pytest.raises(ConfigError, match="CuPy needs the cuda backend"):
        ap_cupy.install()
    assert not hasattr(fake, "allocator")


@pytest.fixture
def cupy_hook_capped(monkeypatch):
    """(fake CuPy, the hook module, device 0's default pool) with $CUPY_GPU_MEMORY_LIMIT at
    64 MiB, read at the device's next CuPy allocation; the cap is lifted afterwards."""
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    from ascend_pool.integrations import cupy as ap_cupy

    monkeypatch.setattr(ap_cupy, "_limited_devices", {})
    monkeypatch.setenv("CUPY_GPU_MEMORY_LIMIT", str(64 << 20))
    pool = ap.default_pool(0)
    yield fake, ap_cupy, pool
    pool.set_limit(None)


def test_cupy_hook_collects_garbage_and_retries_before_out_of_memory(cupy_hook_capped):
    # CuPy's own pool (SingleDeviceMemoryPool._try_malloc) frees its cache, then runs
    # gc.collect() and tries again before it raises: an array kept only by a reference cycle
    # must not make an allocation fail. Under a 64 MiB cap, a 40 MiB block held by a garbage
    # cycle and a 40 MiB request.
    import gc

    _, ap_cupy, pool = cupy_hook_capped
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        a, b = types.SimpleNamespace(), types.SimpleNamespace()
        a.other, b.other = b, a
        a.mem = ap_cupy.malloc(40 << 20)
        del a, b                                  # garbage that only the cycle collector frees
        mp = ap_cupy.malloc(40 << 20)
        assert pool.block_info(mp.ptr) is not None
        del mp
    finally:
        if was_enabled:
            gc.enable()
        gc.collect()


def test_cupy_hook_counts_one_out_of_memory_when_there_is_no_garbage_to_collect(cupy_hook_capped):
    # The retry after gc.collect() is made only when the collection gave a CuPy block back: a
    # request that fails with none to collect is one out-of-memory in the pool's figures (and
    # one observer call), not two.
    fake, ap_cupy, pool = cupy_hook_capped
    calls = []
    observer = lambda *a: calls.append(a)  # noqa: E731
    ap.attach_out_of_memory_observer(observer)
    try:
        ap_cupy.malloc(1 << 20)                   # the device's first CuPy allocation sets the cap
        before = pool.memory_stats()["num_ooms"]
        with pytest.raises(fake.cuda.memory.OutOfMemoryError):
            ap_cupy.malloc(128 << 20)
        assert pool.memory_stats()["num_ooms"] - before == 1 and len(calls) == 1
    finally:
        ap.detach_out_of_memory_observer(observer)

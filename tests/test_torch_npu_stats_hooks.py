"""Newer torch_npu's stats hooks (set_get_device_stats_fn, set_reset_peak_status_fn), tested up to
the edge: no torch_npu build runs here. tests/c/torch_npu_device_stats.cpp declares DeviceStats as
torch_npu's header does and calls the hook as torch_npu's Module.cpp binds it (std::function over
the address handed to the setter); the allocator object whose setters install() calls is a stand-in
(only for that call), and the torch_npu headers the layout is read from are written here as
torch_npu v2.7.1 declares them. torch's own c10 header is the installed torch's."""

import ctypes
import os
import shutil
import subprocess
import sys
import types

import pytest

import ascend_pool as ap
from ascend_pool import config
from ascend_pool.integrations import _common, torch_npu_stats

HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to build the C++ caller and the library"),
    pytest.mark.skipif(not os.path.exists(_common.TORCH_ALLOC_LIB),
                       reason="libascend_pool_torch.so was not built (no C++ compiler at build time)"),
]

# DeviceStats as torch_npu's own NPUCachingAllocator.h declares it (v2.7.1), comments and all.
NPU_HEADER = """
namespace c10_npu { namespace NPUCachingAllocator {
struct Stat {
  int64_t current = 0;
  int64_t peak = 0;
  int64_t allocated = 0;
  int64_t freed = 0;
};
enum struct StatType : uint64_t { AGGREGATE = 0, SMALL_POOL = 1, LARGE_POOL = 2, NUM_TYPES = 3 };
typedef std::array<Stat, static_cast<size_t>(StatType::NUM_TYPES)> StatArray;
// Struct containing memory allocator summary statistics for a device.
struct DeviceStats {
  // COUNT: allocations requested by client code
  StatArray allocation;
  StatArray segment;
  StatArray active;
  StatArray inactive_split;  /* unallocated but can't be released via npuFree */
  StatArray allocated_bytes;
  StatArray reserved_bytes;
  StatArray active_bytes;
  StatArray inactive_split_bytes;
  StatArray requested_bytes;
  int64_t num_alloc_retries = 0;
  int64_t num_ooms = 0;
  Stat oversize_allocations;
  Stat oversize_segments;
  int64_t max_split_size = 0;
};
struct BlockInfo { int64_t size = 0; };
}}
"""


def fake_torch_npu_dir(tmp_path, header):
    inc = tmp_path / "torch_npu" / "include" / "torch_npu" / "csrc" / "core" / "npu"
    inc.mkdir(parents=True)
    (inc / "NPUCachingAllocator.h").write_text(header)
    return str(tmp_path / "torch_npu")


class Setters:
    """The allocator object of newer torch_npu's NPUPluggableAllocator as far as the setters go:
    each takes the hook's address (torch_npu's binding: uint64_t)."""

    def __init__(self):
        self.got = {}

    def set_get_device_stats_fn(self, addr):
        self.got["set_get_device_stats_fn"] = addr

    def set_reset_peak_status_fn(self, addr):
        self.got["set_reset_peak_status_fn"] = addr


@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("caller") / "libnpu_caller.so")
    subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", os.path.join(HERE, "c", "torch_npu_device_stats.cpp"),
                    "-o", out], check=True)
    lib = ctypes.CDLL(out)
    lib.read_device_stats.argtypes = [ctypes.c_uint64, ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.c_char_p,
                                      ctypes.c_size_t]
    lib.reset_peak.argtypes = [ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    return lib


def registered(tmp_path, header=NPU_HEADER):
    from ascend_pool.integrations import torch_npu as ap_npu

    setters = Setters()
    torch_dir = os.path.dirname(sys.modules["torch"].__file__) if "torch" in sys.modules else ""
    done = torch_npu_stats.register_stats_hooks(setters, _common.TORCH_ALLOC_LIB, fake_torch_npu_dir(tmp_path, header),
                                                torch_dir, *ap_npu._stats_hook_functions())
    return setters, done


def test_the_device_stats_hook_gives_torch_npu_the_figures_of_memory_stats(tmp_path, caller):
    setters, done = registered(tmp_path)
    assert done == ["set_get_device_stats_fn", "set_reset_peak_status_fn"]
    assert setters.got["set_get_device_stats_fn"] == ctypes.cast(
        ctypes.CDLL(_common.TORCH_ALLOC_LIB).ascend_pool_torch_device_stats_952, ctypes.c_void_p).value

    lib = ctypes.CDLL(ap.library_path())
    lib.ascend_pool_malloc.restype = ctypes.c_void_p
    lib.ascend_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.ascend_pool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    sizes = (512, 3 << 20, 40 << 20, 1000)
    ptrs = [lib.ascend_pool_malloc(n, 0, None) for n in sizes]
    assert all(ptrs)
    lib.ascend_pool_free(ptrs[1], sizes[1], 0, None)  # freed and peak above current
    try:
        figures = (ctypes.c_int64 * 119)()
        why = ctypes.create_string_buffer(256)
        rc = caller.read_device_stats(setters.got["set_get_device_stats_fn"], 0, figures, why, 256)
        assert rc == 0, why.value
        stats = ap.memory_stats(0)
        keys = torch_npu_stats.stats_keys(torch_npu_stats._fields(NPU_HEADER))
        assert len(keys) == 119 and keys[0] == "allocation.all.current" and keys[-1] == "max_split_size"
        assert {k: figures[i] for i, k in enumerate(keys)} == {k: stats[k] for k in keys}
        assert stats["allocation.all.current"] == 3 and stats["allocated_bytes.all.peak"] > stats[
            "allocated_bytes.all.current"]

        rc = caller.reset_peak(setters.got["set_reset_peak_status_fn"], 0, why, 256)
        assert rc == 0, why.value
        after = ap.memory_stats(0)
        assert after["allocated_bytes.all.peak"] == after["allocated_bytes.all.current"]
    finally:
        for p, n in zip(ptrs, sizes):
            if p != ptrs[1]:
                lib.ascend_pool_free(p, n, 0, None)


def test_a_failing_stats_read_is_a_cpp_exception_for_the_caller(tmp_path, caller, caplog):
    from ascend_pool.integrations import torch_npu as ap_npu

    setters = Setters()
    torch_npu_stats.register_stats_hooks(setters, _common.TORCH_ALLOC_LIB, fake_torch_npu_dir(tmp_path, NPU_HEADER), "",
                                         lambda device: 1 // 0, ap_npu._stats_hook_functions()[1])
    try:
        figures = (ctypes.c_int64 * 119)()
        why = ctypes.create_string_buffer(256)
        assert caller.read_device_stats(setters.got["set_get_device_stats_fn"], 0, figures, why, 256) == -1
        assert b"memory_stats(0) failed" in why.value
        assert "ZeroDivisionError" in caplog.text
    finally:
        registered(tmp_path / "again")  # the library bound to the real functions again


@pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit])
def test_a_signal_handlers_exception_inside_the_stats_hooks_reaches_the_program(tmp_path, caller, caplog, raised):
    """Ctrl-C, or a SIGTERM whose handler calls sys.exit, arriving while torch.npu.memory_stats()
    (a training loop's logging, main thread) runs the hook: the C++ caller gets its error and the
    exception reaches the program once back in Python. It was logged as 'memory_stats(0) failed'
    and dropped: a loop that catches the RuntimeError went on, a SIGTERM'd rank until SIGKILL."""
    from ascend_pool.integrations import torch_npu as ap_npu

    def interrupted(device):
        raise raised  # as Python's signal handler raises it, inside the hook's Python code

    setters = Setters()
    torch_npu_stats.register_stats_hooks(setters, _common.TORCH_ALLOC_LIB, fake_torch_npu_dir(tmp_path, NPU_HEADER), "",
                                         interrupted, interrupted)
    try:
        figures = (ctypes.c_int64 * 119)()
        why = ctypes.create_string_buffer(256)
        for call in (lambda: caller.read_device_stats(setters.got["set_get_device_stats_fn"], 0, figures, why, 256),
                     lambda: caller.reset_peak(setters.got["set_reset_peak_status_fn"], 0, why, 256)):
            rc = None
            with pytest.raises(raised):
                rc = call()
                for _ in range(10_000):  # the pending exception is raised between these bytecodes
                    pass
            assert rc in (None, -1)
        assert "failed" not in caplog.text
    finally:
        registered(tmp_path / "again")  # the library bound to the real functions again


def test_a_device_stats_with_another_member_registers_only_the_reset_hook(tmp_path):
    header = NPU_HEADER.replace("int64_t max_split_size = 0;", "int64_t max_split_size = 0;\n  std::vector<int> x;")
    setters, done = registered(tmp_path, header)
    assert done == ["set_reset_peak_status_fn"]
    fields, why = torch_npu_stats.device_stats_fields(fake_torch_npu_dir(tmp_path / "b", header), "")
    assert fields is None and "member other than int64_t" in why


def test_torch_2_13s_device_stats_with_its_hash_map_is_not_transcribed(tmp_path):
    torch = pytest.importorskip("torch")
    torch_dir = os.path.dirname(torch.__file__)
    c10_h = os.path.join(torch_dir, "include", "c10", "core", "CachingDeviceAllocator.h")
    if not os.path.exists(c10_h) or "reserved_bytes_by_private_pools" not in open(c10_h).read():
        pytest.skip(reason="this torch's DeviceStats has no hash map of private pools")
    npu_dir = fake_torch_npu_dir(tmp_path, "namespace c10_npu { using c10::CachingDeviceAllocator::DeviceStats; }")
    fields, why = torch_npu_stats.device_stats_fields(npu_dir, torch_dir)
    assert fields is None and c10_h in why


def test_an_older_torch_npu_without_the_setters_keeps_the_python_patching_only(tmp_path):
    assert torch_npu_stats.register_stats_hooks(types.SimpleNamespace(set_init_fn=print), _common.TORCH_ALLOC_LIB,
                                                fake_torch_npu_dir(tmp_path, NPU_HEADER), "", print, print) == []


def test_install_registers_the_hooks_on_an_allocator_that_has_the_setters(monkeypatch, tmp_path):
    """install() with a stand-in torch_npu module object (only the registration is checked: the
    allocator object has the setters, as newer torch_npu's)."""
    from ascend_pool.integrations import torch_npu as ap_npu

    setters = Setters()
    lib = ctypes.CDLL(_common.TORCH_ALLOC_LIB)

    class Pluggable:
        def __init__(self, *args):
            pass

        def allocator(self):
            return setters

    memory = types.SimpleNamespace(NPUPluggableAllocator=Pluggable, change_current_allocator=lambda a: None)
    npu_dir = fake_torch_npu_dir(tmp_path, NPU_HEADER)
    torch_npu = types.ModuleType("torch_npu")
    torch_npu.__file__ = os.path.join(npu_dir, "__init__.py")
    for name, mod in (("torch_npu", torch_npu), ("torch_npu.npu", types.ModuleType("torch_npu.npu")),
                      ("torch_npu.npu.memory", memory)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(ap_npu, "use_backend", lambda *a, **k: None)  # no ACL runtime here
    monkeypatch.setattr(config, "_framework_vars", list(config._framework_vars))  # install() adds torch_npu's
    ap_npu.install(patch_stats=False)
    assert setters.got == {
        "set_get_device_stats_fn": ctypes.cast(lib.ascend_pool_torch_device_stats_952, ctypes.c_void_p).value,
        "set_reset_peak_status_fn": ctypes.cast(lib.ascend_pool_torch_reset_peak_stats, ctypes.c_void_p).value}


EXIT_CHILD = r'''
import ctypes, os, pathlib, sys, tempfile, time
import ascend_pool as ap
import test_torch_npu_stats_hooks as t
ap.malloc(1 << 20)
setters, done = t.registered(pathlib.Path(tempfile.mkdtemp()))
lib = ctypes.CDLL(sys.argv[1])
lib.start_stats_readers.argtypes = [ctypes.c_uint64, ctypes.c_int, ctypes.c_int]
lib.start_stats_readers(setters.got["set_get_device_stats_fn"], 0, 8)
time.sleep(0.2)
'''


def test_cpp_threads_reading_the_stats_hook_while_python_exits_do_not_abort_it(tmp_path):
    """C++ threads (noexcept frames, as torch_npu's) calling the stats hook for ever while the
    interpreter exits: one that had passed the exit flag and waited for the GIL was ended by
    Python's finalization (pthread_exit in take_gil) and the process aborted in std::terminate
    (8 runs in 10 before)."""
    so = str(tmp_path / "libnpu_caller.so")
    subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-pthread",
                    os.path.join(HERE, "c", "torch_npu_device_stats.cpp"), "-o", so], check=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(ap.__file__)), HERE]))
    for _ in range(5):
        r = subprocess.run([sys.executable, "-c", EXIT_CHILD, so], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]

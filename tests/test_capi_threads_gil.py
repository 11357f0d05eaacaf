"""The C ABI from C threads, compiled during the test with gcc:

- tests/c/capi_threads.c, a program that embeds Python, imports ascend_pool, dlopen()s
  library_path() and runs malloc/free loops on several pthreads (first with the GIL free, a
  pthread creating a device's default pool; then with its main thread holding the GIL);
- tests/c/capi_hammer.c, the same workload loaded into this process with ctypes.PyDLL, which keeps
  the GIL held for the whole call: the pthreads must progress without it;
- tests/c/exit_threads.cpp (g++), C++ threads whose calls take the GIL while the interpreter exits.

Both check that no two live blocks overlap and that every byte is returned.
"""

import ctypes
import os
import shutil
import subprocess
import sys
import time

import pytest

import ascend_pool as ap

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "c"))
from build import compile_c, gcc  # noqa: E402

pytestmark = pytest.mark.skipif(gcc() is None, reason="gcc is needed to build the C test programs")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("capi_c")
    return {
        "program": compile_c("capi_threads.c", str(out / "capi_threads"), embed=True),
        "hammer": compile_c("capi_hammer.c", str(out / "libcapi_hammer.so"), shared=True),
    }


def test_c_program_with_pthreads_and_embedded_python(built):
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(ap.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([built["program"], sys.executable, "8", "20000"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok threads=8 allocs=160000"), proc.stdout


def test_pthreads_allocate_while_this_thread_holds_the_gil(built):
    ap.default_pool(0)  # the hot path only: the pool exists before the workers start
    before = ap.memory_stats(0)["allocated_bytes.all.current"]
    abi = ctypes.CDLL(ap.library_path())
    hammer = ctypes.PyDLL(built["hammer"]).capi_hammer  # PyDLL: the GIL stays held during the call
    hammer.restype = ctypes.c_int
    hammer.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.POINTER(ctypes.c_long), ctypes.c_char_p, ctypes.c_size_t]
    allocs, why = ctypes.c_long(), ctypes.create_string_buffer(256)
    rc = hammer(ctypes.cast(abi.ascend_pool_malloc, ctypes.c_void_p), ctypes.cast(abi.ascend_pool_free, ctypes.c_void_p),
                0, 8, 20000, 20, ctypes.byref(allocs), why, len(why))
    assert rc == 0, why.value.decode()
    assert allocs.value == 8 * 20000
    assert ap.memory_stats(0)["allocated_bytes.all.current"] == before


_EXITING = r'''
import atexit, ctypes, sys, time
helper = ctypes.PyDLL(sys.argv[1])
atexit.register(helper.hold_gil, 200)  # registered first, called last: the GIL held up to finalization
import ascend_pool as ap
abi = ctypes.CDLL(ap.library_path())
ap.default_pool(0)
ap.attach_out_of_memory_observer(lambda *figures: None)
helper.start_threads(ctypes.cast(abi.ascend_pool_malloc, ctypes.c_void_p), 0, ctypes.c_ssize_t(1 << 50), 8)
time.sleep(0.05)
'''


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to build the C++ framework threads")
def test_framework_threads_taking_the_gil_while_the_interpreter_exits_never_abort_it(tmp_path):
    # Python ends a thread that waits for the GIL once finalization started with pthread_exit,
    # a forced unwind that a noexcept C++ frame turns into std::terminate: C++ threads whose C
    # ABI calls take the GIL (an out-of-memory observer; a device's first allocation) aborted the
    # process at exit (SIGABRT in 3 to 5 of 8 runs).
    helper = str(tmp_path / "libexit_threads.so")
    subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-pthread", os.path.join(os.path.dirname(__file__), "c",
                    "exit_threads.cpp"), "-o", helper], check=True)
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(ap.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    for _ in range(8):
        proc = subprocess.run([sys.executable, "-c", _EXITING, helper], env=env, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, f"exit status {proc.returncode}: {proc.stderr[-600:]}"


_FORKING_OBSERVER = r'''
import ctypes, os, sys
import ascend_pool as ap
abi = ctypes.CDLL(ap.library_path())
abi.ascend_pool_malloc.restype = ctypes.c_void_p
abi.ascend_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
ap.default_pool(0)
pid = []
ap.attach_out_of_memory_observer(lambda *figures: pid or pid.append(os.fork()))
abi.ascend_pool_malloc(1 << 50, 0, None)
if pid[0] == 0:
    sys.exit(0)  # the child exits through Python (atexit: apc_python_close)
print(os.waitpid(pid[0], 0)[1])
'''


def test_a_child_forked_by_an_observer_exits_at_once():
    # The observer runs inside a C ABI call counted as taking the GIL; the child, forked there,
    # returns through the call's end: counted from 0 after the fork, it was left at -1, and its
    # exit waited 10 s for a call on its way that did not exist.
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(ap.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _FORKING_OBSERVER], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-600:]
    assert proc.stdout.split() == ["0"]
    assert time.monotonic() - start < 8, "the forked child's exit waited for a GIL call it never had"

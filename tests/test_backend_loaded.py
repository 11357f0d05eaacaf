"""One runtime per process (issue 17): when the process already loaded the runtime library (torch_npu
its libascendcl.so, torch its wheel's libcudart.so.12), the backend uses that copy instead of
dlopen()ing a second one from its own search path. Each case runs in a fresh process, since what
is loaded before ascend_pool is the point.
"""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import ascend_pool
from ascend_pool.backend import sim_library_path

PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(ascend_pool.__file__)))


def run_child(code, **env):
    full = {k: v for k, v in os.environ.items() if k != "ASCEND_POOL_ACL_LIB"}
    full["PYTHONPATH"] = PKG_PARENT
    full.update(env)
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_sim_loaded_from_another_path_is_the_one_used(tmp_path):
    copy = tmp_path / "framework" / "lib64" / "libascendcl.so"
    copy.parent.mkdir(parents=True)
    shutil.copy(sim_library_path(), copy)
    out = run_child(f"""
        import ctypes, os
        fw = ctypes.CDLL({str(copy)!r})          # the framework's runtime, loaded first
        assert fw.aclInit(None) == 0
        import ascend_pool as ap
        from ascend_pool import sim
        pool = ap.Pool(0, backend="sim")
        assert os.path.samefile(pool.backend.path, {str(copy)!r}), pool.backend.path
        sim.attach({str(copy)!r})                 # the framework's copy holds the pool's memory
        p = pool.malloc(1 << 20)
        assert sim.stats(0)["bytes_held"] >= 1 << 20
        pool.free(p)
        pool.close()
        # the bundled file was never loaded: no second runtime in the process
        maps = open("/proc/self/maps").read()
        assert {sim_library_path()!r} not in maps
        print("ok")
    """)
    assert out.strip() == "ok"


def test_explicit_path_is_loaded_as_given(tmp_path):
    # A path the caller names is not second-guessed (the legacy build here, beside the bundled one).
    out = run_child(f"""
        import ctypes, os
        ctypes.CDLL({sim_library_path()!r})
        from ascend_pool._core import Backend
        b = Backend("sim", {sim_library_path(legacy=True)!r})
        assert os.path.samefile(b.path, {sim_library_path(legacy=True)!r}) and not b.has_malloc_align32
        print("ok")
    """)
    assert out.strip() == "ok"


STAND_IN = r"""
/* A stand-in for libcudart: the few symbols the cuda backend resolves, on host memory. */
#include <stdlib.h>
#include <string.h>
static __thread int cur;
int cudaGetDeviceCount(int *n) { *n = 2; return 0; }
int cudaSetDevice(int d) { if (d < 0 || d > 1) return 101; cur = d; return 0; }
int cudaGetDevice(int *d) { *d = cur; return 0; }
int cudaMalloc(void **p, size_t n) { *p = malloc(n); return *p ? 0 : 2; }
int cudaFree(void *p) { free(p); return 0; }
int cudaMemGetInfo(size_t *f, size_t *t) { *f = (size_t)1 << 30; *t = (size_t)2 << 30; return 0; }
int cudaEventCreateWithFlags(void **e, unsigned f) { (void)f; *e = malloc(1); return 0; }
int cudaEventRecord(void *e, void *s) { (void)e; (void)s; return 0; }
int cudaEventQuery(void *e) { (void)e; return 0; }
int cudaEventSynchronize(void *e) { (void)e; return 0; }
int cudaEventDestroy(void *e) { free(e); return 0; }
int cudaStreamWaitEvent(void *s, void *e, unsigned f) { (void)s; (void)e; (void)f; return 0; }
int cudaStreamCreate(void **s) { *s = malloc(1); return 0; }
int cudaStreamQuery(void *s) { (void)s; return 0; }
int cudaStreamSynchronize(void *s) { (void)s; return 0; }
int cudaStreamDestroy(void *s) { free(s); return 0; }
const char *cudaGetErrorString(int c) { (void)c; return "stand-in error"; }
int standin_current(void) { return cur; }
"""


@pytest.mark.skipif(not shutil.which("cc"), reason="no C compiler to build the libcudart stand-in")
def test_cuda_uses_the_libcudart_already_loaded(tmp_path):
    src = tmp_path / "cudart.c"
    src.write_text(STAND_IN)
    lib = tmp_path / "torch" / "lib" / "libcudart.so.12"
    lib.parent.mkdir(parents=True)
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(lib), str(src)], check=True)
    out = run_child(f"""
        import ctypes, os
        rt = ctypes.CDLL({str(lib)!r})          # what `import torch` does with its wheel's runtime
        from ascend_pool._core import Backend
        b = Backend("cuda")
        assert os.path.samefile(b.path, {str(lib)!r}), b.path
        assert b.device_count == 2
        assert rt.cudaSetDevice(1) == 0         # the framework's device
        p = b.malloc(0, 4096)
        assert rt.standin_current() == 1, "the backend left the thread on device 0"
        b.free(0, p)
        print("ok")
    """)
    assert out.strip() == "ok"

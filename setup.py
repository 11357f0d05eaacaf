"""Builds the pool extension (Cython + C) and the simulated NPU (a plain C shared library).

The simulator is built as its own `libascendcl.so` so that the acl backend loads it exactly as it
loads the real runtime: dlopen() by path, dlsym() by name. A second build of the same sources,
`_sim/legacy/libascendcl.so`, lacks the newer ACL symbols to exercise the backend's fallbacks.
"""
import glob
import os
import shutil

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
SANITIZE = os.environ.get("ASCEND_POOL_SANITIZE", "")  # e.g. "address" for the ASan build
C_FLAGS = ["-O3", "-g", "-std=gnu11", "-D_GNU_SOURCE", "-Wall", "-Wno-unused-function"]
SAN_FLAGS = [f"-fsanitize={SANITIZE}", "-fno-omit-frame-pointer", "-DASCEND_POOL_SANITIZE=1"] if SANITIZE else []
if SANITIZE == "thread":  # ThreadSanitizer (scripts/tsan.sh): -O1 keeps its stacks and accesses exact
    SAN_FLAGS += ["-O1", "-DASCEND_POOL_TSAN=1"]  # the simulator's device memory uninstrumented (sim_internal.h)
C_FLAGS += SAN_FLAGS
LINK_FLAGS = [f"-fsanitize={SANITIZE}"] if SANITIZE else []

# Plain shared objects (no Python module init): their file names are exactly these.
PLAIN_LIBS = {
    "ascend_pool._sim.libascendcl": "ascend_pool/_sim/libascendcl.so",
    "ascend_pool._sim.legacy.libascendcl": "ascend_pool/_sim/legacy/libascendcl.so",
    "ascend_pool.libascend_pool_torch": "ascend_pool/libascend_pool_torch.so",
}
# The alloc function torch's pluggable allocators load, throwing on failure (torch_alloc.cpp):
# built where a C++ compiler is; without it the integrations hand torch the C ABI's own.
HAVE_CXX = bool(shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++"))


class BuildExt(build_ext):
    def get_ext_filename(self, fullname):
        if fullname in PLAIN_LIBS:
            return PLAIN_LIBS[fullname]
        return super().get_ext_filename(fullname)

    def get_ext_fullpath(self, ext_name):
        if ext_name in PLAIN_LIBS:
            return os.path.join(self.build_lib, PLAIN_LIBS[ext_name])
        return super().get_ext_fullpath(ext_name)


def rel(pattern):
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, pattern)))


# Headers as dependencies: setuptools rebuilds an extension only when one of these is newer than
# it, so without them an edit to a header alone (an inline hot path, a struct) left the old build.
SIM_HEADERS = rel("cython/sim/*.h") + rel("cython/common/*.h")  # common/: shared with the pool (host_ids.h)
CORE_HEADERS = [h for h in rel("cython/*/*.h") if h not in rel("cython/sim/*.h")] + rel("ascend_pool/include/*.h")

sim_sources = rel("cython/sim/*.c")
sim_ext = [
    Extension(
        name,
        sources=sim_sources,
        include_dirs=["cython/sim"],
        depends=SIM_HEADERS,
        extra_compile_args=C_FLAGS + ["-fvisibility=hidden"] + (["-DASCEND_SIM_LEGACY=1"] if "legacy" in name else []),
        extra_link_args=LINK_FLAGS,
        libraries=["pthread", "rt"],
    )
    for name in PLAIN_LIBS
    if "_sim" in name and sim_sources  # absent only in a tree that is mid-edit
]
torch_ext = [
    Extension(
        "ascend_pool.libascend_pool_torch",
        sources=["cython/capi/torch_alloc.cpp", "cython/capi/torch_stats.cpp"],
        language="c++",
        extra_compile_args=["-O2", "-g", "-std=c++17", "-Wall", "-fvisibility=hidden"] + SAN_FLAGS,
        extra_link_args=LINK_FLAGS,
    )
] if HAVE_CXX else []

core_ext = Extension(
    "ascend_pool._core",
    sources=["cython/_core.pyx"] + rel("cython/core/*.c") + rel("cython/backend/*.c") + rel("cython/host/*.c"),
    include_dirs=["cython", "cython/core", "cython/backend", "ascend_pool/include"],
    depends=CORE_HEADERS,
    # Only the C ABI (APC_EXPORT) and the module's init are exported: the pool's own functions
    # are then called directly, not through the PLT as interposable symbols would be.
    extra_compile_args=C_FLAGS + ["-fvisibility=hidden"],
    extra_link_args=LINK_FLAGS,
    libraries=["dl", "pthread", "rt"],
)

setup(
    ext_modules=sim_ext
    + torch_ext
    + cythonize(
        [core_ext],
        compiler_directives={"language_level": 3, "boundscheck": False, "wraparound": False},
        include_path=["cython"],
    ),
    cmdclass={"build_ext": BuildExt},
)

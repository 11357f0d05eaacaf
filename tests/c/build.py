"""Compiles the C test sources of this directory with gcc, for the C ABI tests.

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "c")); from build import compile_c

Programs embed Python, so they link libpython with the flags of the running interpreter (shared
libpython with an rpath; a static one with -export-dynamic so that extension modules resolve
against the program).
"""
import os
import shutil
import subprocess
import sys
import sysconfig

HERE = os.path.dirname(os.path.abspath(__file__))
CFLAGS = ["-O2", "-g", "-Wall", "-pthread"]


def gcc():
    """The gcc on PATH, or None."""
    return shutil.which("gcc")


def python_embed_flags():
    """(compile flags, link flags) to embed the running Python."""
    cv = sysconfig.get_config_var
    cflags = [f"-I{sysconfig.get_paths()['include']}", f"-I{sysconfig.get_paths()['platinclude']}"]
    libs = (cv("LIBS") or "").split() + (cv("SYSLIBS") or "").split()
    if cv("Py_ENABLE_SHARED"):
        libdir = cv("LIBDIR")
        ldflags = [f"-L{libdir}", f"-Wl,-rpath,{libdir}", f"-lpython{cv('LDVERSION')}"]
    else:
        ldflags = [os.path.join(cv("LIBPL"), cv("LIBRARY"))] + (cv("LINKFORSHARED") or "").split()
    return cflags, ldflags + libs + ["-ldl", "-lm"]


def compile_c(source, out, shared=False, embed=False):
    """Compiles tests/c/<source> into `out`; returns out. Raises with gcc's output on failure."""
    cmd = [gcc(), *CFLAGS, os.path.join(HERE, source), "-o", out]
    if shared:
        cmd[1:1] = ["-shared", "-fPIC"]
    if embed:
        cflags, ldflags = python_embed_flags()
        cmd[1:1] = cflags
        cmd += ldflags
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")
    return out


if __name__ == "__main__":  # manual use: python tests/c/build.py OUTDIR
    outdir = sys.argv[1]
    print(compile_c("capi_threads.c", os.path.join(outdir, "capi_threads"), embed=True))
    print(compile_c("capi_hammer.c", os.path.join(outdir, "libcapi_hammer.so"), shared=True))

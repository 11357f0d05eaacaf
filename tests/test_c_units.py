"""C unit tests of the core's data structures (tests/c/test_*.c), built and run from pytest.

Each tests/c/test_<structure>.c is a program of its own: it names the core sources it links on a
`core:` line of its opening comment (none for a header of its own, as the backend's
stream_notes.h), is compiled with the system C compiler into a temporary
folder with every warning an error, the invariant asserts on (ASCEND_POOL_SANITIZE=1) and, where
the compiler has them, AddressSanitizer, LeakSanitizer and UBSan, and must exit 0. The same file
also holds the layering rule of the C core: nothing in cython/core/ includes a header from
outside it, but the backend interface it is given.
"""

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "cython" / "core"
C_TESTS = sorted((ROOT / "tests" / "c").glob("test_*.c"))
CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
BASE_FLAGS = ["-std=gnu11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Werror", "-O1", "-g", "-DASCEND_POOL_SANITIZE=1",
              f"-I{CORE}", f"-I{ROOT / 'cython' / 'backend'}", f"-I{ROOT / 'tests' / 'c'}"]
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer"]
# The backend's vtable: the one header from outside core/ that the core may include (the pool
# calls the device only through it; cython/backend/ implements it, below the core).
CORE_MAY_INCLUDE = {"backend.h"}


def _env():
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)  # scripts/asan.sh preloads libasan into Python: not into cc or the tests
    env["ASAN_OPTIONS"] = "detect_leaks=1:abort_on_error=0"
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    return env


def _sources(test):
    m = re.search(r"^ \* core:(.*?)(?: \*/)?$", test.read_text(), re.M)  # none for a header's test
    assert m, f"{test.name}: the opening comment must name the core sources it links (' * core: a.c b.c')"
    return [CORE / name for name in m.group(1).split()]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Compiles every C test once (two at a time); returns {name: (binary or None, compiler output)}."""
    if not CC:
        pytest.fail("no C compiler (cc) on this machine: the extension needs one too (README: prerequisites)")
    out = tmp_path_factory.mktemp("c_units")
    probe = subprocess.run([CC, *SANITIZE_FLAGS, "-x", "c", "-", "-o", str(out / "probe")], input="int main(void){return 0;}",
                           capture_output=True, text=True, env=_env())
    flags = BASE_FLAGS + (SANITIZE_FLAGS if probe.returncode == 0 else [])

    def build(test):
        exe = out / test.stem
        r = subprocess.run([CC, *flags, "-o", str(exe), str(test), *map(str, _sources(test)), "-lpthread"],
                           capture_output=True, text=True, env=_env())
        return test.stem, (exe if r.returncode == 0 else None, r.stdout + r.stderr)

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(build, C_TESTS))


def test_every_core_structure_has_a_c_test():
    names = {t.stem for t in C_TESTS}
    assert {"test_free_tree", "test_free_blocks", "test_ptr_map", "test_stats", "test_free_cache",
            "test_block_arena", "test_history"} <= names, names


@pytest.mark.parametrize("test", C_TESTS, ids=lambda t: t.stem)
def test_c_unit(built, test):
    exe, log = built[test.stem]
    assert exe is not None, f"{test.name} does not compile:\n{log}"
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == 0, f"{test.name} failed (exit {r.returncode}):\n{r.stdout}{r.stderr}"
    assert f"{test.stem}: ok" in r.stdout


BREAK = ROOT / "tests" / "c" / "break_invariant.c"


@pytest.fixture(scope="module")
def break_builds(tmp_path_factory):
    """break_invariant.c built checked (ASCEND_POOL_SANITIZE=1) and as a release build: {checked: path}."""
    if not CC:
        pytest.fail("no C compiler (cc) on this machine: the extension needs one too (README: prerequisites)")
    out = tmp_path_factory.mktemp("c_break")
    exes = {}
    for checked in (True, False):
        exes[checked] = out / f"break_{int(checked)}"
        flags = BASE_FLAGS if checked else [f for f in BASE_FLAGS if f != "-DASCEND_POOL_SANITIZE=1"]
        build = subprocess.run([CC, *flags, "-o", str(exes[checked]), str(BREAK), *map(str, _sources(BREAK)),
                                "-lpthread"], capture_output=True, text=True, env=_env())
        assert build.returncode == 0, build.stderr
    return exes


@pytest.mark.parametrize("invariant", ["map_put_twice", "stat_below_zero", "tree_remove_absent", "recycle_twice"])
def test_broken_invariant_stops_a_checked_build_only(break_builds, invariant):
    """AP_ASSERT is on in debug and ASan builds (ASCEND_POOL_SANITIZE=1) and names the place; in a
    release build it is compiled out (the hot path pays nothing)."""
    r = subprocess.run([str(break_builds[True]), invariant], capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode != 0 and "ascend_pool: invariant failed at" in r.stderr, (r.returncode, r.stderr)
    r = subprocess.run([str(break_builds[False]), invariant], capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == 0 and "not stopped" in r.stdout, (r.returncode, r.stderr)


INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def test_core_includes_nothing_from_outside_core():
    """The core is the bottom layer: the host pool, the C ABI and the quota code sit above it and
    include it, never the other way round."""
    bad = []
    for f in sorted(CORE.iterdir()):
        if f.suffix not in (".c", ".h"):
            continue
        for name in INCLUDE.findall(f.read_text()):
            if name in CORE_MAY_INCLUDE:
                continue
            if "/" in name or not (CORE / name).is_file():
                bad.append(f"{f.name}: #include \"{name}\"")
    assert not bad, "cython/core/ reaches outside itself:\n" + "\n".join(bad)

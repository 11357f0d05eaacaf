"""Constructors only construct (issue 22): Pool() opens its C pool and registers it, nothing more;
the stats publisher starts in one place (its registry listener, on the first pool) and does its
file work on its own thread; the C ABI's first call reaches Python through one hook and a short
path of files."""

import os
import subprocess
import sys

import ascend_pool as ap

_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(ap.__file__)))


def _run(code, tmp_path, **env):
    e = dict(os.environ, ASCEND_POOL_BACKEND="sim", ASCEND_POOL_STATS_DIR=str(tmp_path),
             PYTHONPATH=os.pathsep.join(filter(None, [_PKG_PARENT, os.environ.get("PYTHONPATH")])), **env)
    e.pop("ASCEND_POOL_TENANT", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=e, cwd="/")
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


_THREADS = """
import threading
import ascend_pool as ap
before = {t.name for t in threading.enumerate()}
p = ap.Pool(0, backend="sim")
q = ap.Pool(0, backend="sim")
print(",".join(sorted({t.name for t in threading.enumerate()} - before)) or "-")
"""


def test_pool_starts_no_thread_when_publishing_is_off(tmp_path):
    assert _run(_THREADS, tmp_path, ASCEND_POOL_STATS="0") == ["-"]
    assert os.listdir(tmp_path) == []  # and writes nothing


def test_the_publisher_starts_once_on_the_first_pool(tmp_path):
    assert _run(_THREADS, tmp_path, ASCEND_POOL_STATS="1") == ["ascend-pool-stats"]


_CLIMB = """
import ctypes, sys
import ascend_pool as ap
files = set()
def prof(frame, event, arg):
    f = frame.f_code.co_filename
    if event == "call" and "ascend_pool" in f:
        files.add(f.replace("\\\\", "/").rsplit("ascend_pool/", 1)[-1])
lib = ctypes.CDLL(ap.library_path())
lib.ascend_pool_malloc.restype = ctypes.c_void_p
lib.ascend_pool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
sys.setprofile(prof)
ptr = lib.ascend_pool_malloc(1 << 20, 0, None)
sys.setprofile(None)
assert ptr, "the first C-ABI allocation failed"
print(" ".join(sorted(files)))
"""


def test_the_first_c_abi_call_takes_a_short_path(tmp_path):
    # The device has no pool yet: the C ABI calls its one hook (ascend_pool.api), which makes the
    # default pool. The publisher is only started (its thread does the file work), and nothing of
    # the node service, metrics exporters or sharing runs on the caller's thread.
    files = _run(_CLIMB, tmp_path, ASCEND_POOL_STATS="1")
    assert "api.py" in files and "pool.py" in files
    assert not [f for f in files if f.startswith(("service/", "sharing")) and f != "service/publisher.py"], files
    assert len(files) <= 13, files  # settings.py: a pool registers under the runtime settings' lock

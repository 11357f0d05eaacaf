"""Runs test code as another local user of the same simulated node (tests/test_sim_node_users.py,
tests/test_sharing_users.py): root plus `nobody`, through runuser, sharing one 1777 directory as
/dev/shm is shared. Needs root and runuser (CI runs as root); tests skip otherwise.

The installed packages may live where `nobody` cannot read (root's pyenv under /root), so the
children import a copy of them made readable to every user (readable_site, which
tests/test_containers.py uses too)."""
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid

import pytest

OTHER = "nobody"
TESTS = os.path.dirname(os.path.abspath(__file__))
SKIP = ("runuser is not installed" if shutil.which("runuser") is None else
        None if os.geteuid() == 0 else "running tests as another uid needs root")
PRELUDE = "import json, os, sys, threading, time\nimport ctypes as C\nfrom sim_child import *\n"


def readable_site(root):
    """A copy, readable by every user, of the installed packages a worker needs (ascend_pool and
    what it imports, and sim_child.py): the installed ones may live under a home directory other
    users cannot enter (root's pyenv: /root is 0700), as on CI."""
    site = os.path.join(root, "site")
    os.mkdir(site)
    for name in ("ascend_pool", "numpy", "prometheus_client"):
        src = os.path.dirname(importlib.util.find_spec(name).origin)
        shutil.copytree(src, os.path.join(site, name), ignore=shutil.ignore_patterns("tests", "__pycache__"))
        libs = src + ".libs"  # a manylinux wheel's bundled shared libraries (numpy.libs)
        if os.path.isdir(libs):
            shutil.copytree(libs, os.path.join(site, os.path.basename(libs)))
    shutil.copy(os.path.join(TESTS, "sim_child.py"), site)
    for dirpath, dirnames, filenames in os.walk(site):
        os.chmod(dirpath, 0o755)
        for f in filenames:
            os.chmod(os.path.join(dirpath, f), 0o755)
    return site


class Node:
    """A simulated node (2 devices x 1 GiB) whose records live in `shm`, a 1777 directory."""

    def __init__(self, root):
        self.root = root
        self.shm = os.path.join(root, "shm")
        os.mkdir(self.shm)
        os.chmod(self.shm, 0o1777)
        self.name = "u" + uuid.uuid4().hex[:12]
        self.site = readable_site(root)
        self.exe = None
        for exe in (sys.executable, f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"):
            r = subprocess.run(self._argv(OTHER, exe, "import ascend_pool._core"), env=self.env(),
                               capture_output=True, text=True)
            if r.returncode == 0:
                self.exe = exe
                break
        assert self.exe, f"no Python that {OTHER} may run imports {self.site}"

    def env(self, **overrides):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ASCEND_SIM_", "ASCEND_POOL_"))}
        env.update(PYTHONPATH=self.site, PYTHONSAFEPATH="1", HOME=self.root, ASCEND_POOL_BACKEND="sim",
                   ASCEND_SIM_NODE=self.name, ASCEND_SIM_SHM_DIR=self.shm, ASCEND_SIM_DEVICES="2",
                   ASCEND_SIM_HBM="1GiB", ASCEND_POOL_LEDGER_DIR=self.shm, ASCEND_POOL_STATS_DIR=self.shm)
        env.update({k: str(v) for k, v in overrides.items()})
        return env

    @staticmethod
    def _argv(user, exe, code):
        argv = [exe, "-c", code]
        return argv if user is None else ["runuser", "-u", user, "--"] + argv

    def argv(self, user, code, prelude=True):
        """user None: this user (root); else that user through runuser."""
        code = (PRELUDE if prelude else "") + textwrap.dedent(code)
        return self._argv(user, sys.executable if user is None else self.exe, code)

    def run(self, user, code, prelude=True, timeout=60, **env):
        p = subprocess.run(self.argv(user, code, prelude), env=self.env(**env), capture_output=True, text=True,
                           timeout=timeout, cwd=self.root)
        if p.returncode != 0:
            pytest.fail(f"{user or 'root'}'s child exited {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n"
                        f"{p.stderr}", pytrace=False)
        return p.stdout

    def spawn(self, user, code, **env):
        """A child that prints its pid, then runs code; returns (Popen, pid, its first line after)."""
        p = subprocess.Popen(self.argv(user, "print(os.getpid(), flush=True)\n" + textwrap.dedent(code)),
                             env=self.env(**env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=self.root)
        pid = p.stdout.readline().strip()
        self.procs.append((p, int(pid) if pid.isdigit() else None))
        line = p.stdout.readline().strip()
        assert pid.isdigit() and line, (pid, line, p.stderr.read() if p.poll() is not None else "")
        return p, int(pid), line


@pytest.fixture
def two_users():
    if SKIP:
        pytest.skip(reason=SKIP)
    root = tempfile.mkdtemp(prefix="ap-users-")
    os.chmod(root, 0o755)
    node = Node(root)
    procs = []
    node.procs = procs
    try:
        yield node
    finally:
        for p, pid in procs:
            if pid is not None:
                try:
                    os.kill(pid, 9)  # the child itself (runuser may outlive it, or it runuser)
                except ProcessLookupError:
                    pass
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=10)
        shutil.rmtree(root, ignore_errors=True)

"""Fixtures for the simulator tests (tests/test_sim_*.py).

The simulator reads its environment at aclInit and shares device capacity between the processes
of a simulated node, so behavioural tests run their code in child processes, each test on its
own node (a unique ASCEND_SIM_NODE whose records live in the test's own ASCEND_SIM_SHM_DIR),
never touching the default node that other runs on this machine may use.

Import with:  sys.path.insert(0, os.path.dirname(__file__)); from sim_fixtures import sim_node
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid

import pytest

import ascend_pool

TESTS = os.path.dirname(os.path.abspath(__file__))
# Where the imported ascend_pool lives (site-packages after `pip install .`, the tree for an
# in-place build): children must import the same build.
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(ascend_pool.__file__)))
PRELUDE = "import json, os, sys, threading, time\nimport ctypes as C\nfrom sim_child import *\n"


def _can_unshare():
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"unshare --pid --fork --mount-proc fails here: {r.stderr.strip()}"


# Workers in pid namespaces of their own (a container's first process is pid 1 there): needs
# unshare and root, which CI has; the reason says what is missing elsewhere.
UNSHARE_MISSING = _can_unshare()
needs_unshare = pytest.mark.skipif(UNSHARE_MISSING is not None, reason=str(UNSHARE_MISSING))
NS = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]


class SimNode:
    """One isolated simulated node: environment for children, and ways to run them."""

    def __init__(self, shm_dir):
        self.shm_dir = str(shm_dir)
        self.name = "t" + uuid.uuid4().hex[:12]

    def env(self, **overrides):
        """Child environment: 2 devices x 1 GiB on this node; overrides set (None unsets)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("ASCEND_SIM_")}
        env["PYTHONPATH"] = os.pathsep.join([PKG_PARENT, TESTS])
        env.update(ASCEND_SIM_NODE=self.name, ASCEND_SIM_SHM_DIR=self.shm_dir,
                   ASCEND_SIM_DEVICES="2", ASCEND_SIM_HBM="1GiB")
        for k, v in overrides.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = str(v)
        return env

    def record_path(self, dev=0):
        return os.path.join(self.shm_dir, f"ascendsim-{os.geteuid()}-{self.name}-dev{dev}")

    def spawn(self, code, **env):
        """Starts a child running PRELUDE + code with pipes on stdin/stdout/stderr."""
        return subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
                                env=self.env(**env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def run(self, code, timeout=30, expect_rc=0, **env):
        """Runs PRELUDE + code in a child; fails the test (showing its output) unless it exits
        with expect_rc. Returns the child's stdout."""
        p = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
                           env=self.env(**env), capture_output=True, text=True, timeout=timeout)
        if p.returncode != expect_rc:
            pytest.fail(f"child exited {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}",
                        pytrace=False)
        return p.stdout

    def run_json(self, code, **kw):
        """Like run(); returns the JSON object the child printed last."""
        out = self.run(code, **kw)
        return json.loads(out.strip().splitlines()[-1])

    def cleanup(self):
        for f in os.listdir(self.shm_dir):
            if f.startswith(f"ascendsim-{os.geteuid()}-{self.name}"):  # also nodes named name+suffix
                os.unlink(os.path.join(self.shm_dir, f))


@pytest.fixture
def sim_node(tmp_path):
    node = SimNode(tmp_path)
    yield node
    node.cleanup()

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
import tempfile
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


# ---- children of several local uids on one node (tests/test_second_uid.py, test_shared_dirs_users.py)

def as_uid(uid, groups):
    """The prefix that runs a command as `uid` (None: this user, root) in `groups`: setpriv with
    numeric ids (no passwd entry needed) and no inherited capabilities. Needs root and setpriv."""
    if uid is None:
        return []
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", f"--groups={','.join(map(str, groups))}",
            "--inh-caps=-all"]


def uid_world(prefix, uid, groups):
    """For a module fixture (yield from it): (root, site, exe), a 0755 directory, a copy of the
    packages every user may read (other_user.readable_site) and a Python that `uid` may run with
    it; the directory goes at the end. Not being able to import the build as `uid` where uids can
    be run at all is a broken setup, not a reason to skip."""
    from other_user import readable_site

    root = tempfile.mkdtemp(prefix=prefix)
    os.chmod(root, 0o755)
    try:
        site = readable_site(root)
        exe = None
        for cand in (sys.executable, f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"):
            r = subprocess.run(as_uid(uid, groups) + [cand, "-c", "import ascend_pool._core"], capture_output=True,
                               text=True, env=dict(os.environ, PYTHONPATH=site, PYTHONSAFEPATH="1"), cwd="/")
            if r.returncode == 0:
                exe = cand
                break
        assert exe is not None, f"no Python that uid {uid} may run imports {site}"
        yield root, site, exe
    finally:
        shutil.rmtree(root, ignore_errors=True)


class UidNode:
    """One simulated node (1 device x 1 GiB) in a uid_world, whose children run as local uids
    (start, run), each in a pid namespace of its own with ns=True (NS: both are pid 1 there, as
    containers' first processes). Ledgers, stats files and share records live in `shm` (mode
    shm_mode, 1777 as /dev/shm); the simulator's records there too, or in a 1777 directory of
    their own, `sim`, with sim_dir=True. env: more variables for every child."""

    def __init__(self, world, name_prefix, shm_mode=0o1777, sim_dir=False, **env):
        self.root, self.site, self.exe = world
        self.shm = tempfile.mkdtemp(prefix="shm-", dir=self.root)
        os.chmod(self.shm, shm_mode)
        self.sim = self.shm
        if sim_dir:
            self.sim = tempfile.mkdtemp(prefix="sim-", dir=self.root)
            os.chmod(self.sim, 0o1777)
        self.name = name_prefix + uuid.uuid4().hex[:10]
        self.extra = {k: str(v) for k, v in env.items()}
        self.procs = []

    def env(self, **extra):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ASCEND_SIM_", "ASCEND_POOL_"))}
        env.update(PYTHONPATH=self.site, PYTHONSAFEPATH="1", HOME=self.root, ASCEND_POOL_BACKEND="sim",
                   ASCEND_SIM_NODE=self.name, ASCEND_SIM_SHM_DIR=self.sim, ASCEND_SIM_DEVICES="1",
                   ASCEND_SIM_HBM="1GiB", ASCEND_POOL_LEDGER_DIR=self.shm, ASCEND_POOL_STATS_DIR=self.shm)
        env.update(self.extra)
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def start(self, uid, groups, code, ns=False, **env):
        """A child running `code` as uid (None: root) in groups, pipes on stdin/stdout/stderr."""
        argv = (NS if ns else []) + as_uid(uid, groups) + [self.exe, "-c", textwrap.dedent(code)]
        p = subprocess.Popen(argv, env=self.env(**env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd="/")
        self.procs.append(p)
        return p

    def run(self, uid, groups, code, **env):
        """start, then its stdout once it exited 0 (fails the test otherwise)."""
        p = self.start(uid, groups, code, **env)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, f"uid {uid}'s child exited {p.returncode}\n{out}\n{err}"
        return out

    def names(self, prefix):
        """Entries of shm starting with prefix (or with '.' and prefix: temporaries)."""
        return sorted(n for n in os.listdir(self.shm) if n.startswith(prefix) or n.startswith("." + prefix))

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=10)

"""Backend selection (ascend_pool.backend.open_backend) and the error hierarchy.

Anything that depends on the environment at first use runs in a fresh interpreter, so the
per-process cache and the log-once rule are observed from a clean start.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import ascend_pool
from ascend_pool import errors
from ascend_pool.backend import open_backend, sim_library_path

# The subprocesses import the same ascend_pool as this process.
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(ascend_pool.__file__)))


def run_py(code, **env):
    """Runs `code` in a fresh interpreter with `env` added (None removes a variable); returns
    (returncode, stdout, stderr)."""
    full = dict(os.environ)
    full["PYTHONPATH"] = PKG_PARENT + os.pathsep + full.get("PYTHONPATH", "")
    for k, v in env.items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full,
                       capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout, p.stderr


AUTO_SCRIPT = """
    import json, logging
    records = []
    class H(logging.Handler):
        def emit(self, r): records.append(r.getMessage())
    lg = logging.getLogger("ascend_pool"); lg.addHandler(H()); lg.setLevel(logging.INFO)
    from ascend_pool.backend import open_backend
    a = open_backend(); b = open_backend(); c = open_backend("sim")
    print(json.dumps({"name": a.name, "kind": a.kind, "path": a.path, "same": a is b and a is c,
                      "devices": a.device_count, "logs": records}))
"""


def test_auto_picks_sim_and_logs_once():
    # No NPU runtime here: the default search fails, so the simulator is chosen, said once.
    rc, out, err = run_py(AUTO_SCRIPT, ASCEND_POOL_BACKEND=None, ASCEND_POOL_ACL_LIB=None)
    assert rc == 0, err
    got = json.loads(out)
    assert got["name"] == "sim" and got["kind"] == "acl"
    assert os.path.samefile(got["path"], sim_library_path())
    assert got["same"] is True
    assert got["devices"] >= 1
    assert len(got["logs"]) == 1, got["logs"]
    assert "sim" in got["logs"][0] and "simulated NPU" in got["logs"][0]


def test_auto_prefers_acl_when_a_runtime_with_devices_loads():
    # Pointing the acl search at a library that loads and reports devices makes auto pick acl.
    rc, out, err = run_py(AUTO_SCRIPT, ASCEND_POOL_BACKEND=None, ASCEND_POOL_ACL_LIB=sim_library_path())
    assert rc == 0, err
    got = json.loads(out)
    assert got["name"] == "acl" and got["same"] is False  # open_backend("sim") is its own entry
    assert len(got["logs"]) == 1 and "acl" in got["logs"][0]


def test_auto_with_a_broken_acl_lib_warns_and_uses_sim():
    rc, out, err = run_py(AUTO_SCRIPT,
                          ASCEND_POOL_BACKEND=None, ASCEND_POOL_ACL_LIB="/broken/libascendcl.so")
    assert rc == 0, err
    got = json.loads(out)
    assert got["name"] == "sim"
    assert len(got["logs"]) == 2 and "/broken/libascendcl.so" in got["logs"][0]


def test_env_selects_sim():
    rc, out, err = run_py("""
        from ascend_pool.backend import open_backend
        b = open_backend(); print(b.name, b.kind)
    """, ASCEND_POOL_BACKEND="sim")
    assert rc == 0, err
    assert out.split() == ["sim", "acl"]


def test_env_bogus_is_config_error():
    rc, out, err = run_py("""
        from ascend_pool.backend import open_backend
        from ascend_pool.errors import ConfigError
        try:
            open_backend()
        except ConfigError as e:
            print("ConfigError:", e)
    """, ASCEND_POOL_BACKEND="bogus")
    assert rc == 0, err
    assert out.startswith("ConfigError:")
    assert "ASCEND_POOL_BACKEND" in out and "bogus" in out


def test_explicit_acl_does_not_fall_back():
    # An explicit choice that cannot be honoured is an error, never a silent switch to sim.
    rc, out, err = run_py("""
        from ascend_pool.backend import open_backend
        from ascend_pool.errors import BackendUnavailableError
        try:
            open_backend("acl")
        except BackendUnavailableError as e:
            print(e.code, str(e).splitlines()[0])
    """, ASCEND_POOL_BACKEND=None, ASCEND_POOL_ACL_LIB="/nonexistent/libascendcl.so")
    assert rc == 0, err
    code, msg = out.split(" ", 1)
    assert int(code) == 990001 and "libascendcl.so" in msg


def test_unknown_name_argument_is_config_error():
    with pytest.raises(errors.ConfigError, match="nvidia"):
        open_backend("nvidia")


def test_cached_per_name_and_path():
    a = open_backend("sim")
    assert open_backend("sim") is a
    assert open_backend("sim", sim_library_path()) is not a  # another key, another object
    assert open_backend("sim", sim_library_path()).path == a.path


def test_sim_library_paths():
    assert sim_library_path().endswith(os.path.join("ascend_pool", "_sim", "libascendcl.so"))
    assert sim_library_path(legacy=True).endswith(os.path.join("_sim", "legacy", "libascendcl.so"))
    assert os.path.exists(sim_library_path()) and os.path.exists(sim_library_path(legacy=True))


def test_error_hierarchy():
    e = errors.DeviceError(207001, "out of memory")
    assert (e.code, e.message, str(e)) == (207001, "out of memory", "out of memory")
    assert isinstance(e, errors.PoolError) and isinstance(e, RuntimeError)
    assert issubclass(errors.BackendUnavailableError, errors.DeviceError)
    assert issubclass(errors.DeviceTimeoutError, TimeoutError)
    assert issubclass(errors.QuotaExceededError, errors.OutOfMemoryError)
    assert issubclass(errors.OutOfMemoryError, MemoryError)
    for cls in (errors.InvalidSizeError, errors.InvalidPointerError, errors.InvalidStreamError,
                errors.InvalidDeviceError, errors.ConfigError):
        assert issubclass(cls, ValueError) and issubclass(cls, errors.PoolError)
    import pickle
    t = pickle.loads(pickle.dumps(errors.DeviceTimeoutError(507047, "late")))
    assert type(t) is errors.DeviceTimeoutError and (t.code, t.message) == (507047, "late")

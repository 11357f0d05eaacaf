"""`ascend-pool --version` names the installed version, and the package says the same."""

import subprocess
import sys
from importlib.metadata import metadata, version

import ascend_pool as ap


def test_version_flag_prints_the_installed_version():
    r = subprocess.run([sys.executable, "-m", "ascend_pool.cli", "--version"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"ascend-pool {version('ascend_pool')}"
    assert ap.__version__ == version("ascend_pool")  # pyproject.toml and the package agree


def test_package_metadata_has_license_and_readme():
    meta = metadata("ascend_pool")
    assert meta["License-Expression"] == "Apache-2.0"
    assert "ascend-pool serve --replay" in meta["Description"]  # the README is the long description

"""Fixtures for the quota and tenant tests (test_quota_context, test_tenants_reload,
test_ledger_reclaim): each test gets its own ledger directory, and a base pool that never
releases segments on its own, so that the bytes a tenant holds are exactly what it allocated.

Import with:  sys.path.insert(0, os.path.dirname(__file__))
              from quota_fixtures import MiB, base, large, ledger_dir
"""
import pytest

import ascend_pool as ap

MiB = 1 << 20


@pytest.fixture(autouse=True)
def ledger_dir(tmp_path, monkeypatch):
    """Every test gets its own ledger directory (so its own ledger files); children inherit it."""
    monkeypatch.setenv("ASCEND_POOL_LEDGER_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def base():
    p = ap.Pool(0, backend="sim", release_policy="never")
    yield p
    p.close()


def large(nbytes_mib):
    """A request that takes exactly a segment of nbytes_mib MiB (the pool pads by 32 bytes and
    rounds large segments to 2 MiB pages)."""
    return nbytes_mib * MiB - 1024

"""Sharing when the share records' directory is full (another user filled /dev/shm): a typed
SharingError naming the record, the block still the caller's, the pool serving on. Before,
pool.share() raised a bare OSError (ENOSPC) that callers catching ap.PoolError did not expect.

Needs root for `unshare -m` and mount, as CI has (tests/test_full_shm.py's skip says what is
missing elsewhere).
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401
from test_full_shm import MOUNT_MISSING, run_with_full_dir  # noqa: E402

pytestmark = pytest.mark.skipif(MOUNT_MISSING is not None, reason=str(MOUNT_MISSING))


def test_sharing_into_a_full_record_directory_is_a_typed_error_and_the_block_stays_usable(sim_node, tmp_path):
    rc, out, err = run_with_full_dir(sim_node, tmp_path, """
        import ascend_pool as ap
        from ascend_pool import sharing, sim
        p = ap.Pool(0)
        ptr = p.share_malloc(2 << 20)
        try:
            p.share(ptr, any_process=True)
            print("SHARED")
        except sharing.SharingError as e:
            print("TYPED", e)
        sim.launch_fill(None, ptr, 4096, 0x5A)          # the block is the caller's, unshared
        p.synchronize()
        assert sim.read(ptr, 16) == b"\\x5a" * 16
        assert p.share_free(ptr) is True
        q = p.malloc(1 << 20)                          # the pool serves on
        p.free(q)
        p.close()
        print("POOL-OK")
    """, "ASCEND_POOL_LEDGER_DIR")
    assert rc == 0 and "POOL-OK" in out, (rc, out, err[-800:])
    assert "TYPED" in out and "share record" in out and "No space left" in out, out

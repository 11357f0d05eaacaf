"""Read-only sharing: an exporter that shares read-only gets importers that may read but not write.

The simulator enforces it (importers map the block PROT_READ; its write entry point refuses with
ACL_ERROR_RT_NO_PERMISSION 207006, naming the key); CANN and CUDA cannot, which the backend and
SharedBlock say (has_ipc_read_only, read_only_enforced). Processes are driven through
tests/ipc_harness.py, as in test_sharing.py and test_sim_ipc.py.
"""
import base64
import os
import pickle
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from ipc_harness import Peer, pool_prelude  # noqa: E402
from sim_fixtures import sim_node  # noqa: E402,F401

import ascend_pool as ap  # noqa: E402
from ascend_pool import sharing, sim  # noqa: E402

MiB = 1 << 20
POOL = pool_prelude()
# The simulator's read-only export bit (ascendsim.h), for the raw ACL-level test.
RAW = "init(0)\nRO = lib.ascendsim_ipc_export_flag_read_only\nRO.restype = C.c_uint64\n"


def load_key(b64):
    return pickle.loads(base64.b64decode(b64)).key


def test_read_only_importer_cannot_write_but_sees_the_exporters_writes(sim_node):
    with Peer(sim_node, POOL) as ex, Peer(sim_node, POOL) as ro, Peer(sim_node, POOL) as rw:
        h = ex("""
            ptr = pool.share_malloc(4 * MiB)
            sim.launch_fill(None, ptr, 4 * MiB, 0x11); pool.synchronize()
            out = [dump(pool.share(ptr, read_only=True, any_process=True))]
            wptr = pool.share_malloc(2 * MiB)           # a read-write share beside it
            out.append(dump(pool.share(wptr, any_process=True)))
        """)
        got = ro(f"""
            blk = ap.open_shared(load({h[0]!r}), pool=pool)
            out = {{"flags": [blk.read_only, blk.read_only_enforced], "before": sim.read(blk.ptr, 16).hex()}}
            try:
                sim.launch_fill(None, blk.ptr, MiB, 0xEE)
            except sim.SimError as e:
                out["fill"] = [e.code, str(e)]
            pool.synchronize()
        """)
        assert got["flags"] == [True, True] and got["before"] == "11" * 16, got
        assert got["fill"][0] == 207006, got                              # ACL_ERROR_RT_NO_PERMISSION
        assert "read-only" in got["fill"][1] and load_key(h[0]) in got["fill"][1], got
        # the refused write changed nothing; the exporter still writes, and the importer reads it
        assert ex("out = sim.read(ptr, 4 * MiB) == bytes([0x11]) * (4 * MiB)")
        ex("sim.launch_fill(None, ptr + MiB, MiB, 0x22); pool.synchronize()")
        assert ro("out = sim.read(blk.ptr + MiB, MiB) == bytes([0x22]) * MiB "
                  "and sim.read(blk.ptr, MiB) == bytes([0x11]) * MiB")
        # a read-write share stays writable by its importers
        assert rw(f"""
            wblk = ap.open_shared(load({h[1]!r}), pool=pool)
            sim.launch_fill(None, wblk.ptr, 2 * MiB, 0x33); pool.synchronize()
            out = [wblk.read_only, wblk.read_only_enforced]
        """) == [False, False]
        assert ex("out = sim.read(wptr, 2 * MiB) == bytes([0x33]) * (2 * MiB)")
        ro("blk.close()")
        rw("wblk.close()")
        assert ex("out = [pool.share_free(ptr), pool.share_free(wptr)]") == [True, True]


def test_the_mode_of_a_shared_block_cannot_change(pool):
    ptr = pool.share_malloc(2 * MiB)
    h = pool.share(ptr, read_only=True, any_process=True)
    assert pool.share(ptr, read_only=True) is h
    with pytest.raises(sharing.SharingError, match="already shared read-only"):
        pool.share(ptr)
    assert pool.share_free(ptr) is True


def test_backend_says_where_read_only_is_enforced(pool):
    assert pool.backend.has_ipc_read_only is True        # the simulator's extension
    ptr = pool.share_malloc(2 * MiB)
    h = pool.share(ptr, read_only=True, any_process=True)
    with ap.open_shared(h, pool=pool) as blk:            # the exporter may import its own key
        assert blk.read_only and blk.read_only_enforced
        with pytest.raises(sim.SimError) as e:
            sim.launch_fill(None, blk.ptr, 64, 1)
        assert e.value.code == 207006
        sim.launch_fill(None, ptr, 64, 7)             # the exporter's own view stays writable
        pool.synchronize()
        assert sim.read(blk.ptr, 64) == bytes([7]) * 64
    assert pool.share_free(ptr) is True


def test_sim_read_only_export_flag_at_the_acl_level(sim_node):
    """The raw calls: the extension bit is accepted with either CANN flag, importers' fills are
    refused, reads work; other unknown bits stay a parameter error."""
    with Peer(sim_node, RAW) as ex, Peer(sim_node, RAW) as im:
        key = ex("""
            ptr = malloc(2 * MiB)
            assert fill(ptr, 2 * MiB, 0x42) == 0
            rc, _ = export(ptr, 2 * MiB, 4)                 # 4: no such flag
            assert rc == 107000, rc
            rc, key = export(ptr, 2 * MiB, RO() | 1)
            assert rc == 0, (rc, errmsg())
            out = key
        """)
        got = im(f"""
            rc, p = imp({key!r})
            assert rc == 0, (rc, errmsg())
            out = [fill(p, 4096, 0x99), errmsg(), same(p, 2 * MiB, 0x42)]
        """)
        assert got[0] == 207006 and "read-only" in got[1] and got[2], got
        ex("assert fill(ptr, 2 * MiB, 0x43) == 0")
        assert im("out = same(p, 2 * MiB, 0x43)")
        im(f"assert close({key!r}) == 0")
        ex(f"assert close({key!r}) == 0 and free(ptr) == 0")

"""Sharing in a pool with expandable segments (expandable_segments:true): a block that lives in a
virtual-memory segment cannot be exported (the runtime's IPC keys take aclrtMalloc memory only),
and pool.share refuses it saying so; pool.share_malloc still gives a dedicated aclrtMalloc segment
that shares, imports and frees as in any pool.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from ipc_harness import Peer, pool_prelude  # noqa: E402
from sim_fixtures import sim_node  # noqa: E402,F401

import ascend_pool as ap  # noqa: E402
from ascend_pool import sharing  # noqa: E402
from ascend_pool.errors import DeviceError  # noqa: E402

MiB = 1 << 20


@pytest.fixture
def xpool():
    p = ap.Pool(0, backend="sim", expandable_segments=True)
    yield p
    p.close()


def test_share_of_a_block_in_an_expandable_segment_is_refused(xpool):
    ptr = xpool.malloc(4 * MiB)
    assert xpool.segment_kind(ptr) == "expandable"
    with pytest.raises(sharing.NotShareableError) as e:
        xpool.share(ptr)
    msg = str(e.value)
    assert "expandable segment" in msg and "virtual memory" in msg and "pool.share_malloc" in msg, msg
    assert isinstance(e.value, ap.InvalidPointerError) and isinstance(e.value, sharing.SharingError)
    # why: the runtime itself cannot export VMM memory with an IPC key (the simulator says so too)
    with pytest.raises(DeviceError) as e:
        xpool.backend.ipc_export(0, ptr - ptr % (2 * MiB), 2 * MiB)
    assert e.value.code == 107000 and "virtual memory" in str(e.value)
    xpool.free(ptr)                                        # the block is untouched and still the caller's


def test_share_malloc_in_an_expandable_pool_gives_a_dedicated_segment(sim_node):
    prelude = pool_prelude(expandable_segments=True)
    with Peer(sim_node, prelude) as ex, Peer(sim_node, prelude) as im:
        h = ex("""
            small = pool.malloc(3 * MiB)                       # an expandable segment beside it
            ptr = pool.share_malloc(5 * MiB)
            assert pool.segment_kind(small) == "expandable" and pool.segment_kind(ptr) == "device"
            assert ptr % (2 * MiB) == 0 and pool.block_info(ptr) == (ptr, 6 * MiB, 5 * MiB)
            sim.launch_fill(None, ptr, 5 * MiB, 0x3C); pool.synchronize()
            st = pool.memory_stats()
            assert st["shared_allocated_bytes"] == 6 * MiB, st
            assert st["reserved_bytes.all.current"] == 6 * MiB + 4 * MiB, st   # 3 MiB: 2 chunks of 2 MiB
            out = dump(pool.share(ptr, any_process=True))
        """)
        assert im(f"""
            blk = ap.open_shared(load({h!r}), pool=pool)
            out = sim.read(blk.ptr, 5 * MiB) == bytes([0x3C]) * (5 * MiB)
        """)
        # trimming the expandable pool never touches the shared segment
        assert ex("pool.free(small); pool.empty_cache(); out = pool.memory_stats()['reserved_bytes.all.current']") \
            == 6 * MiB
        im("blk.close()")
        assert ex("out = [pool.share_free(ptr), pool.memory_stats()['reserved_bytes.all.current']]") == [True, 0]

"""Sharing pool blocks between processes (ascend_pool.sharing, Pool.share, open_shared) on the
simulated NPU: every importer is a separate process of one simulated node.

The processes are driven step by step through tests/ipc_harness.py; handles travel between them
pickled, as they would through a pipe or a queue.
"""
import multiprocessing
import os
import pickle
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from ipc_harness import Peer, pool_prelude  # noqa: E402
from sim_fixtures import sim_node  # noqa: E402,F401

import ascend_pool as ap  # noqa: E402
from ascend_pool import sharing  # noqa: E402

MiB = 1 << 20
POOL = pool_prelude()


def wait_for(peer, code, timeout=30.0):  # generous: a loaded machine
    """Runs `code` (setting out) in peer until out is truthy; fails after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = peer(code)
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_exporter_writes_are_seen_by_two_importers_and_memory_counts_once(sim_node):
    with Peer(sim_node, POOL) as ex, Peer(sim_node, POOL) as a, Peer(sim_node, POOL) as b:
        start = ex("out = node_used()")
        h = ex("""
            ptr = pool.share_malloc(5 * MiB)            # 3 pages of 2 MiB
            sim.launch_fill(None, ptr, 5 * MiB, 0x5A)
            pool.synchronize()
            h = pool.share(ptr, read_only=True, pids=[%d, %d])
            out = dump(h)
        """ % (a.node_pid, b.node_pid))
        handle = pickle.loads(__import__("base64").b64decode(h))
        assert (handle.size, handle.nbytes, handle.device, handle.read_only) == (5 * MiB, 6 * MiB, 0, True)
        for peer in (a, b):
            got = peer(f"""
                blk = ap.open_shared(load({h!r}), pool=pool)
                st = pool.memory_stats()
                out = [sim.read(blk.ptr, 5 * MiB) == b"\\x5a" * (5 * MiB), blk.read_only,
                       st["reserved_bytes.all.current"], st["shared_imported_bytes"], st["shared_imported_blocks"]]
            """)
            assert got == [True, True, 0, 6 * MiB, 1], got
        ex("sim.launch_fill(None, ptr, 5 * MiB, 0x77); pool.synchronize()")   # the exporter writes
        for peer in (a, b):
            assert peer("out = sim.read(blk.ptr, 5 * MiB) == b'\\x77' * (5 * MiB)")
        st = ex("out = pool.memory_stats()")
        assert st["reserved_bytes.all.current"] == 6 * MiB and st["shared_exported_bytes"] == 6 * MiB, st
        assert st["allocated_bytes.all.current"] == 6 * MiB and st["shared_exported_blocks"] == 1, st
        assert ex("out = node_used()") == start + 6 * MiB             # one copy, however many importers
        view = [v for v in ex("out = sharing.shares()") if v["key"] == handle.key]
        assert len(view) == 1 and sorted(view[0]["importers"]) == sorted([a.pid, b.pid]), view
        assert view[0]["exporter_pid"] == ex.pid and view[0]["tenant"] == "default" and view[0]["read_only"], view
        a("blk.close()")
        b("blk.close()")
        assert ex("out = pool.share_free(ptr)") is True
        assert ex("out = [node_used(), pool.memory_stats()['reserved_bytes.all.current']]") == [start, 0]
        assert ex("out = sharing.shares()") == []


def test_a_pid_the_exporter_did_not_allow_gets_the_runtimes_code(sim_node):
    with Peer(sim_node, POOL) as ex, Peer(sim_node, POOL) as im:
        h = ex("ptr = pool.share_malloc(2 * MiB); h = pool.share(ptr); out = dump(h)")
        got = im(f"""
            try:
                ap.open_shared(load({h!r}), pool=pool)
                out = "imported"
            except DeviceError as e:
                out = [e.code, str(e)]
        """)
        assert got[0] == 207006 and "may not import" in got[1], got
        # and the message says what makes it importable, with the id the runtime checks
        assert f"pids=[{im.node_pid}]" in got[1] and "any_process=True" in got[1], got
        ex(f"sharing.allow(h, [{im.pid}])")  # its getpid(): not what the runtime checks
        assert im(f"""
            try:
                ap.open_shared(load({h!r}), pool=pool)
                out = 0
            except DeviceError as e:
                out = e.code
        """) == 207006
        ex(f"sharing.allow(h, [{im.node_pid}])")
        assert im(f"blk = ap.open_shared(load({h!r}), pool=pool); out = blk.size") == 2 * MiB
        im("blk.close()")
        assert ex("out = pool.share_free(ptr)") is True


@pytest.mark.parametrize("free_first", [False, True], ids=["freed-after-the-kill", "release-waiting"])
def test_a_killed_importer_does_not_leak_the_block(sim_node, free_first):
    """Freed after the importer was killed: at once. Freed while it lived (deferred), then killed:
    the background collector frees it."""
    with Peer(sim_node, POOL) as ex:
        start = ex("out = node_used()")
        h = ex("ptr = pool.share_malloc(8 * MiB); h = pool.share(ptr, any_process=True); out = dump(h)")
        victim = Peer(sim_node, POOL)
        victim(f"blk = ap.open_shared(load({h!r}), pool=pool)")
        if free_first:
            assert ex("out = pool.share_free(ptr)") is False         # deferred: the importer is alive
        victim.kill()
        victim.close()
        if free_first:
            assert wait_for(ex, f"out = node_used() == {start} and pool.memory_stats()['shared_deferred_bytes'] == 0")
        else:
            assert ex("out = pool.share_free(ptr)") is True            # the dead importer does not count
        assert ex("out = [node_used(), pool.memory_stats()['reserved_bytes.all.current']]") == [start, 0]
        assert ex("out = sharing.shares()") == []


def test_a_killed_exporter_leaves_importers_a_clear_error(sim_node):
    with Peer(sim_node, POOL) as im:
        ex = Peer(sim_node, POOL)
        h = ex("""
            ptr = pool.share_malloc(2 * MiB)
            sim.launch_fill(None, ptr, 2 * MiB, 9); pool.synchronize()
            out = dump(pool.share(ptr, any_process=True))
        """)
        im(f"blk = ap.open_shared(load({h!r}), pool=pool); assert sim.read(blk.ptr, 16) == bytes([9]) * 16")
        ex.kill()
        ex.close()
        got = im(f"""
            out = {{"alive": blk.exporter_alive}}
            try:
                sim.read(blk.ptr, 16)
            except sim.SimError as e:
                out["read"] = [e.code, str(e)]
            try:
                sim.launch_fill(None, blk.ptr, 16, 1)
            except sim.SimError as e:
                out["fill"] = e.code
            try:
                ap.open_shared(load({h!r}), pool=pool)
            except sharing.SharingError as e:
                out["reopen"] = str(e)
            blk.close()
            out["shares"] = sharing.shares()
        """)
        assert got["alive"] is False, got
        assert got["read"][0] == 507022 and "has exited" in got["read"][1], got
        assert got["fill"] == 507022, got
        assert "exited" in got["reopen"], got
        assert got["shares"] == [], got                                  # the last one out removed it
    assert [f for f in os.listdir(sim_node.shm_dir) if "-ipc-" in f] == []


def test_quota_counts_the_shared_block_once(sim_node):
    q = POOL + """
from ascend_pool.tenants import Context
"""
    with Peer(sim_node, q) as ex, Peer(sim_node, q) as same_tenant, Peer(sim_node, q) as other:
        h = ex("""
            ctx = Context("svc", device=0, backend="sim", quota="48MiB")
            ptr = ctx.share_malloc(30 * MiB)
            h = ctx.share(ptr, any_process=True)
            st = ctx.memory_stats()
            assert st["reserved_bytes.all.current"] == 30 * MiB and st["quota_held_bytes"] == 30 * MiB, st
            assert st["shared_exported_bytes"] == 30 * MiB, st
            try:
                ctx.share_malloc(20 * MiB)           # 30 + 20 > 48: refused, as any growth would be
                raise AssertionError("not refused")
            except ap.QuotaExceededError:
                pass
            out = dump(h)
        """)
        for peer, tenant, quota in ((same_tenant, "svc", None), (other, "small", '"8MiB"')):
            got = peer(f"""
                ctx = Context({tenant!r}, device=0, backend="sim", quota={quota})
                blk = ap.open_shared(load({h!r}), pool=ctx)   # 30 MiB, into a context with 8 MiB of quota
                p2 = ctx.malloc(4 * MiB)                       # its own memory still fits its quota
                st = ctx.memory_stats()
                out = [st["reserved_bytes.all.current"], st["shared_imported_bytes"], st["quota_held_bytes"],
                       st["quota_context_bytes"]]
                ctx.free(p2)
            """)
            reserved, imported, held, mine = got
            # the importer's context books its own segment only (4 MiB rounded up to whole pages)
            assert imported == 30 * MiB and reserved == mine and 4 * MiB <= mine <= 8 * MiB, got
            # the tenant's node-wide total: the exporter's 30 MiB counted once (same tenant), not at all (other)
            assert held == mine + (30 * MiB if tenant == "svc" else 0), got
        same_tenant("blk.close(); ctx.close()")
        other("blk.close(); ctx.close()")
        assert ex("out = [ctx.share_free(ptr), ctx.memory_stats()['quota_held_bytes']]") == [True, 0]
        ex("ctx.close()")


def test_release_is_deferred_until_importers_close(sim_node):
    with Peer(sim_node, POOL) as ex, Peer(sim_node, POOL) as im:
        start = ex("out = node_used()")
        h = ex("ptr = pool.share_malloc(4 * MiB); out = dump(pool.share(ptr, any_process=True))")
        im(f"blk = ap.open_shared(load({h!r}), pool=pool)")
        got = ex("""
            out = [pool.share_free(ptr), pool.memory_stats()["shared_deferred_bytes"]]
            try:
                pool.share_free(ptr)
            except ap.InvalidPointerError:
                out.append("no longer the caller's")
        """)
        assert got == [False, 4 * MiB, "no longer the caller's"], got
        # the importer's block stays fully usable while the release waits
        assert im("sim.launch_fill(None, blk.ptr, 4 * MiB, 3); pool.synchronize(); "
                  "out = sim.read(blk.ptr, 4 * MiB) == bytes([3]) * (4 * MiB)")
        im("blk.close()")
        assert wait_for(ex, "out = node_used() == %d and pool.memory_stats()['shared_deferred_bytes'] == 0" % start)


def test_closing_the_exporting_pool_while_imported_detaches_the_block(sim_node):
    with Peer(sim_node, POOL) as ex, Peer(sim_node, POOL) as im:
        start = ex("out = node_used()")
        h = ex("""
            ptr = pool.share_malloc(2 * MiB)
            sim.launch_fill(None, ptr, 2 * MiB, 4); pool.synchronize()
            out = dump(pool.share(ptr, any_process=True))
        """)
        im(f"blk = ap.open_shared(load({h!r}), pool=pool)")
        ex("pool.close()")
        assert im("out = sim.read(blk.ptr, 2 * MiB) == bytes([4]) * (2 * MiB)")   # still valid
        assert ex("out = node_used()") == start + 2 * MiB
        im("blk.close()")
        assert wait_for(ex, f"out = node_used() == {start}")


def test_only_share_malloc_blocks_can_be_shared(pool):
    ptr = pool.malloc(4 * MiB)
    with pytest.raises(ap.InvalidPointerError, match="share_malloc"):
        pool.share(ptr)
    pool.free(ptr)
    before = pool.memory_stats()
    sp = pool.share_malloc(1)
    assert sp % (2 * MiB) == 0
    st = pool.memory_stats()
    for k in ("reserved_bytes.all.current", "allocated_bytes.all.current", "segment.all.current"):
        assert st[k] - before[k] == (1 if k.startswith("segment") else 2 * MiB), k
    assert st["shared_allocated_bytes"] == 2 * MiB and st["num_device_alloc"] == before["num_device_alloc"] + 1
    assert pool.block_info(sp) == (sp, 2 * MiB, 1)
    seg = [s for s in pool.snapshot()["segments"] if s["address"] == sp]
    assert len(seg) == 1 and seg[0]["blocks"][0]["state"] == "active_allocated"
    with pytest.raises(ap.InvalidPointerError, match="is a shared block .*share_free"):
        pool.free(sp)                                  # pool.free never takes a shared block (it said "double free?")
    with pytest.raises(ap.InvalidSizeError):
        pool.share_malloc(0)
    kept = pool.malloc(2 * MiB)  # from the cached 4 MiB segment: reserved stays
    pool.share(sp, any_process=True)
    pool._check_invariants()  # a live shared block is consistent (the checker failed on one before)
    pool.free(kept)
    assert pool.share_free(sp) is True
    pool._check_invariants()
    st = pool.memory_stats()
    assert st["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]
    assert st["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]


def test_bad_pids_are_refused_before_anything_is_exported(pool):
    """pids reach the runtime as int32 ids: a float, a string, a bool or a wider int used to be cut
    to one silently (or raise a bare TypeError / ValueError after the key was made). Each is a
    ConfigError naming it, the block stays unshared, and a good list still works."""
    from ascend_pool import sharing

    sp = pool.share_malloc(4096)
    for bad in (-1, "12", [1.5], [True], [2 ** 40], ["12"], [0]):
        with pytest.raises(ap.ConfigError, match="pids|process id"):
            pool.share(sp, pids=bad)
    assert pool.memory_stats()["shared_exported_blocks"] == 0
    handle = pool.share(sp, pids=[ap.node_pid()])
    with pytest.raises(TypeError, match="SharedHandle") as e:
        sharing.allow(None, [ap.node_pid()])
    assert isinstance(e.value, ap.PoolError)   # CONTRACT.md: the base of the package's errors
    with pytest.raises(ap.ConfigError, match="process id"):
        sharing.allow(handle, [-3])
    sharing.allow(handle, [ap.node_pid()])
    assert pool.share_free(sp) is True


def test_open_shared_of_something_not_a_handle_is_a_typed_error(pool):
    """open_shared(h) with `h` not what Pool.share() returned (a key string, None, a dict) is a
    NotAHandleError: an ap.PoolError (CONTRACT.md: the base of the package's errors) and a
    TypeError, naming what it got. Before: a bare TypeError."""
    for bad in ("simipc-1-2-3", None, {"key": "x"}):
        with pytest.raises(sharing.NotAHandleError, match="needs a SharedHandle") as e:
            ap.open_shared(bad)
        assert isinstance(e.value, ap.PoolError) and isinstance(e.value, TypeError)
    pool.free(pool.malloc(100))


def test_handle_pickles_and_names_what_importers_need(pool):
    ptr = pool.share_malloc(3 * MiB)
    h = pool.share(ptr, any_process=True)
    assert pool.share(ptr) is h                        # sharing twice: the same handle
    h2 = pickle.loads(pickle.dumps(h))
    assert h2 == h and isinstance(h2, ap.SharedHandle)
    assert (h.device, h.size, h.nbytes, h.exporter_pid, h.backend) == (0, 3 * MiB, 4 * MiB, os.getpid(), "sim")
    assert len(h.key) <= 64
    assert pool.share_free(ptr) is True
    with pytest.raises(sharing.SharingError, match="no longer shared"):
        ap.open_shared(h, pool=pool)


def test_spawned_workers_verify_the_weights(pool):
    """The README flow with multiprocessing's spawn: the parent loads a pattern once, spawned
    workers open the handle and check it; their pools reserve nothing."""
    from ascend_pool import sim

    sys.path.insert(0, os.path.dirname(__file__))
    import sharing_workers

    ptr = pool.share_malloc(16 * MiB)
    # A stream of the pool's device: the default stream (None) is this thread's current device's,
    # which earlier tests in this process may have left on another device.
    s = pool.create_stream()
    sim.launch_fill(s, ptr, 16 * MiB, 0xA5)
    pool.synchronize(s)
    pool.destroy_stream(s)
    h = pool.share(ptr, read_only=True, any_process=True)
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=sharing_workers.verify_pattern, args=(h, 0xA5, q)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert all(r[1] is True and r[2] == 0 and r[3] == 16 * MiB for r in results), results
    assert pool.share_free(ptr) is True


def test_node_service_shows_who_shares_what(pool):
    from ascend_pool.service.node_collector import NodeCollector

    ptr = pool.share_malloc(3 * MiB)
    pool.share(ptr, any_process=True)
    try:
        families = {f.name: f for f in NodeCollector(ledger=False)._shares()}
        mine = [s for s in families["ascend_pool_shared_bytes"].samples
                if s.labels["exporter_pid"] == str(os.getpid())]
        assert [(s.labels["device"], s.labels["state"], s.value) for s in mine] == [("0", "open", 4 * MiB)]
        importers = [s for s in families["ascend_pool_shared_importers"].samples
                     if s.labels["exporter_pid"] == str(os.getpid())]
        assert [s.value for s in importers] == [0]
    finally:
        assert pool.share_free(ptr) is True
    families = {f.name: f for f in NodeCollector(ledger=False)._shares()}
    assert not [s for s in families["ascend_pool_shared_bytes"].samples if s.labels["exporter_pid"] == str(os.getpid())]


def test_node_service_adds_up_one_exporters_blocks_in_one_series(pool):
    # two shared blocks of one process, one tenant and device: one sample per label set, their
    # sum (Prometheus keeps only one of two samples with the same labels)
    from ascend_pool.service.node_collector import NodeCollector

    ptrs = [pool.share_malloc(n) for n in (2 * MiB, 4 * MiB)]
    for p in ptrs:
        pool.share(p, any_process=True)
    try:
        families = {f.name: f for f in NodeCollector(ledger=False)._shares()}
        for name in ("ascend_pool_shared_bytes", "ascend_pool_shared_importers"):
            mine = [s for s in families[name].samples if s.labels["exporter_pid"] == str(os.getpid())]
            assert len(mine) == 1, (name, mine)
        mine = [s for s in families["ascend_pool_shared_bytes"].samples if s.labels["exporter_pid"] == str(os.getpid())]
        assert mine[0].value == 6 * MiB
    finally:
        for p in ptrs:
            assert pool.share_free(p) is True


def test_a_process_exiting_with_a_block_still_shared_exits_quietly(tmp_path):
    # the shared segment dropped the last reference to its pool at interpreter teardown, and the
    # pool's close raised there ("Error in sys.excepthook"), skipping the rest of the close
    import subprocess
    body = ("import ascend_pool as ap\n"
            "pool = ap.Pool(0)\n"
            "ptr = pool.share_malloc(1 << 20)\n"
            "pool.share(ptr, any_process=True)\n"
            "print('shared')\n")
    env = dict(os.environ, ASCEND_SIM_NODE=f"share-exit-{os.getpid()}", ASCEND_POOL_STATS="0")
    out = subprocess.run([sys.executable, "-c", body], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout == "shared\n", out.stderr
    assert "Error in sys.excepthook" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr


def test_a_block_given_back_takes_no_new_importer(sim_node):
    # after share_free returned False (an importer remains), new importers could still open the
    # key and keep the block alive for ever
    with Peer(sim_node, POOL) as ex, Peer(sim_node, POOL) as first, Peer(sim_node, POOL) as late:
        h = ex("ptr = pool.share_malloc(2 * MiB); out = dump(pool.share(ptr, any_process=True))")
        first(f"blk = ap.open_shared(load({h!r}), pool=pool)")
        assert ex("out = pool.share_free(ptr)") is False
        assert late(f"""
            try:
                ap.open_shared(load({h!r}), pool=pool)
                out = "opened"
            except sharing.SharingError as e:
                out = str(e)
        """).endswith("is being released by its exporter (pid " + str(ex("out = os.getpid()")) + ")")
        first("blk.close()")
        assert wait_for(ex, "out = pool.memory_stats()['shared_deferred_bytes'] == 0")


def test_an_edited_handle_is_refused(pool):
    # open_shared trusted the handle's fields: an edited device mapped the key into another
    # device's pool, an edited size reported a TiB imported
    import dataclasses
    ptr = pool.share_malloc(2 * MiB)
    h = pool.share(ptr, any_process=True)
    try:
        for change in (dict(size=1 << 40), dict(nbytes=1 << 40), dict(read_only=not h.read_only)):
            with pytest.raises(sharing.SharingError, match="does not match its share record"):
                ap.open_shared(dataclasses.replace(h, **change), pool=pool)
        if pool.backend.device_count > 1:
            with pytest.raises(sharing.SharingError, match="does not match its share record: the node's device 1"):
                ap.open_shared(dataclasses.replace(h, node_device=1))
        for key in ("a\0b", "k" * 5000, "../x", ""):  # a forged key: bare ValueError / OSError before
            with pytest.raises(sharing.SharingError, match="not a key Pool.share"):
                ap.open_shared(dataclasses.replace(h, key=key), pool=pool)
        blk = ap.open_shared(h, pool=pool)  # the true handle still opens
        assert blk.size == 2 * MiB
        blk.close()
    finally:
        assert pool.share_free(ptr) is True


def test_a_record_held_by_a_stopped_peer_is_an_error_not_a_hang(pool, monkeypatch):
    # A peer stopped inside its update of a share record (SIGSTOP, a paused container) keeps the
    # record's flock for as long as it stays stopped: a listing (the node service's scrape)
    # leaves such records out after half a second for all of them together, the exporter's
    # share_free raises SharingError after its bound instead of waiting for ever, and works once
    # the peer lets go.
    import fcntl
    import threading

    ptrs = [pool.share_malloc(2 * MiB) for _ in range(6)]
    handles = [pool.share(p, any_process=True) for p in ptrs]
    names = os.listdir(sharing._record_dir())
    peers = []  # other open file descriptions: their flocks exclude ours
    for h in handles:
        fd = os.open(os.path.join(sharing._record_dir(), next(n for n in names if n.endswith(h.key))), os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        peers.append(fd)
    try:
        done = []
        # 2 s for the whole listing (0.5 s shipped): one wait per held record would be 12 s, which
        # a bound of 8 s tells apart however loaded the machine
        monkeypatch.setattr(sharing, "_LIST_LOCK_WAIT_S", 2.0)
        lister = threading.Thread(target=lambda: done.append(sharing.shares()))
        t0 = time.monotonic()
        lister.start()
        lister.join(30)
        assert done and time.monotonic() - t0 < 8, f"shares() waited {time.monotonic() - t0:.1f} s on held records"
        assert not {h.key for h in handles} & {s["key"] for s in done[0]}
        monkeypatch.setattr(sharing._Record, "lock_wait_s", 0.3)
        with pytest.raises(sharing.SharingError, match="stayed locked by another process"):
            pool.share_free(ptrs[0])
    finally:
        for fd in peers:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
    assert {h.key for h in handles} <= {s["key"] for s in sharing.shares()}
    assert all(pool.share_free(p) is True for p in ptrs)


def test_a_worker_that_numbers_the_devices_otherwise_opens_the_block_on_the_same_npu(sim_node):
    # Each process numbers the node's devices after its ASCEND_RT_VISIBLE_DEVICES (a container
    # sees its own subset). The handle carried the exporter's number: a worker seeing only NPU 1
    # (its device 0) was told device 1 does not exist, and one seeing "1,0" imported onto its
    # device 1, the node's NPU 0. It carries the node's number; each importer maps the block on
    # its own device of that number, or is told it does not see it.
    nodes = {"ASCEND_SIM_DEVICES": "2"}
    with Peer(sim_node, POOL, ASCEND_RT_VISIBLE_DEVICES="0,1", **nodes) as ex:
        h = ex("""
            p1 = ap.Pool(1, backend="sim")
            ptr = p1.share_malloc(4 * MiB)
            s1 = p1.create_stream()                   # device 1's (the NULL stream is the thread's device's)
            sim.launch_fill(s1, ptr, 4 * MiB, 0x5A)
            p1.synchronize(s1)
            h = p1.share(ptr, any_process=True)
            out = dump(h)
        """)
        handle = pickle.loads(__import__("base64").b64decode(h))
        assert (handle.device, handle.node_device) == (1, 1)
        for visible, local in (("1", 0), ("1,0", 0), ("0,1", 1)):
            with Peer(sim_node, "import base64, pickle\nimport ascend_pool as ap\n",
                      ASCEND_RT_VISIBLE_DEVICES=visible, **nodes) as im:
                got = im(f"""
                    h = pickle.loads(base64.b64decode({h!r}))
                    with ap.open_shared(h) as blk:
                        be = ap.Pool(blk.device, backend="sim").backend
                        out = [h.local_device(), blk.device, be.physical_device(blk.device),
                               sim.read(blk.ptr, 4 * MiB) == b"\\x5a" * (4 * MiB)]
                """)
                assert got == [local, local, 1, True], (visible, got)
        with Peer(sim_node, "import base64, pickle\nimport ascend_pool as ap\n",
                  ASCEND_RT_VISIBLE_DEVICES="0", **nodes) as blind:
            got = blind(f"""
                try:
                    ap.open_shared(pickle.loads(base64.b64decode({h!r})))
                    out = "opened"
                except ap.InvalidDeviceError as e:
                    out = str(e)
            """)
            assert "node's device 1, which this process does not see" in got, got
        view = [v for v in ex("out = sharing.shares()") if v["key"] == handle.key]
        assert view[0]["device"] == 1, view                            # the node's number
        assert ex("out = p1.share_free(ptr)") is True


def test_sharing_works_where_the_ipc_flags_are_reserved(sim_node):
    """CANN 8.2.RC1's (and 8.3.RC1alpha001's) pages call the flags of aclrtIpcMemGetExportKey and
    aclrtIpcMemImportByKey reserved, "fixed to 0"; the simulator's cann8.2 profile refuses any other
    (107000). The pool imports on the exporter's own device with flag 0: before, every import passed
    ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS, and such a runtime refused each one. A share for
    any process needs the export flag, which that runtime does not have: the runtime's code says so."""
    env = {"ASCEND_SIM_PROFILE": "cann8.2"}
    with Peer(sim_node, POOL, **env) as ex, Peer(sim_node, POOL, **env) as im:
        h = ex("""
            ptr = pool.share_malloc(2 * MiB)
            sim.launch_fill(None, ptr, 2 * MiB, 0x3C)
            pool.synchronize()
            out = dump(pool.share(ptr, pids=[%d]))
        """ % im.node_pid)
        assert im(f"""
            blk = ap.open_shared(load({h!r}), pool=pool)
            out = sim.read(blk.ptr, 2 * MiB) == b"\\x3c" * (2 * MiB)
            blk.close()
        """) is True
        got = ex("""
            q = pool.share_malloc(2 * MiB)
            try:
                pool.share(q, any_process=True)
                out = "shared"
            except DeviceError as e:
                out = [e.code, str(e)]
            pool.share_free(q)
        """)
        assert got[0] == 107000 and "reserved" in got[1], got
        assert ex("out = pool.share_free(ptr)") is True


def test_only_an_import_on_another_device_asks_for_peer_access(sim_node):
    """Backend.ipc_import(device, key, exporter_device): ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS
    only when the devices differ (the simulator refuses a cross-device import without it, 507899,
    and under cann8.2 any import with it, 107000)."""
    code = """
        from ascend_pool._core import Backend
        b = Backend("sim")
        p = b.malloc(0, 2 * MiB)
        key = b.ipc_export(0, p, 2 * MiB)
        b.ipc_set_pids(0, key, [b.node_pid()])
        res = {}
        for dev, exporter in ((0, None), (0, 0), (1, 0), (1, None)):
            try:
                q, _ = b.ipc_import(dev, key, exporter)
                b.ipc_close(dev, key)
                res[f"{dev},{exporter}"] = 0
            except DeviceError as e:
                res[f"{dev},{exporter}"] = e.code
        b.ipc_close(0, key)
        b.free(0, p)
        out = res
    """
    with Peer(sim_node, POOL) as cur, Peer(sim_node, POOL, ASCEND_SIM_PROFILE="cann8.2") as old:
        assert cur(code) == {"0,None": 0, "0,0": 0, "1,0": 0, "1,None": 507899}
        assert old(code) == {"0,None": 0, "0,0": 0, "1,0": 107000, "1,None": 507899}


def test_another_builds_share_record_is_removed_once_nobody_holds_it(pool, caplog):
    # A rolling upgrade: another ascend_pool build's record (another version) in the records'
    # directory. While its exporter (or an importer) runs, it holds a lock on the record: left
    # alone. Once nobody does, the exporter is gone with its memory: removed at the next listing
    # (before: every listing failed to read it and skipped it, and it stayed for good). This
    # build's records are listed as before.
    import fcntl
    import glob
    import struct

    from ascend_pool import sharing
    ptr = pool.share_malloc(MiB)
    pool.share(ptr, any_process=True)
    try:
        mine = [p for p in glob.glob(os.path.join(sharing._record_dir(), "ascend_pool-share-*")) if ".tmp." not in p]
        assert len(mine) == 1
        other = mine[0][:-4] + ("0000" if not mine[0].endswith("0000") else "1111")
        with open(mine[0], "rb") as f:
            data = bytearray(f.read())
        struct.pack_into("<I", data, 8, sharing._VERSION - 1)
        fd = os.open(other, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, bytes(data))
        # its exporter, alive: its life lock on the record
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("@hhqqi4x", fcntl.F_RDLCK, os.SEEK_SET, 99, 1, 0))
        listed = sharing.shares()
        assert [s["exporter_pid"] for s in listed] == [os.getpid()] and os.path.exists(other)
        os.close(fd)  # its exporter dies
        with caplog.at_level("INFO", logger="ascend_pool"):
            listed = sharing.shares()
        assert [s["exporter_pid"] for s in listed] == [os.getpid()]
        assert not os.path.exists(other) and os.path.exists(mine[0])
        assert any(f"removed share record {other} of version {sharing._VERSION - 1}" in r.getMessage()
                   for r in caplog.records)
    finally:
        assert pool.share_free(ptr) is True


@pytest.mark.parametrize("first_closed", ["older", "newer"])
def test_a_block_opened_twice_in_one_process_stays_mapped_until_its_own_close(sim_node, first_closed):
    """open_shared of one handle twice in a process (two tensors over the same weights): CANN maps
    each import at an address of its own and aclrtIpcMemClose(key) closes the oldest import of
    the key. Closing either block leaves the other readable and writable, and the exporter's
    release waits for the last close (before: closing the newer block closed the older block's
    import, whose reads then failed with 107000 while it was open)."""
    with Peer(sim_node, POOL) as ex, Peer(sim_node, POOL) as im:
        start = ex("out = node_used()")
        h = ex("""
            ptr = pool.share_malloc(4 * MiB)
            sim.launch_fill(None, ptr, 4 * MiB, 0x5A); pool.synchronize()
            out = dump(pool.share(ptr, any_process=True))
        """)
        im(f"""
            blocks = [ap.open_shared(load({h!r}), pool=pool), ap.open_shared(load({h!r}), pool=pool)]
            first, keep = (blocks[0], blocks[1]) if {first_closed!r} == "older" else (blocks[1], blocks[0])
            first.close()
        """)
        assert im("""
            sim.launch_fill(None, keep.ptr, 4 * MiB, 0x33); pool.synchronize()
            out = sim.read(keep.ptr, 4 * MiB) == bytes([0x33]) * (4 * MiB)
        """)
        assert ex("out = [pool.share_free(ptr), sim.read(ptr, 16) == bytes([0x33]) * 16]") == [False, True]
        im("keep.close()")
        assert wait_for(ex, "out = node_used() == %d and pool.memory_stats()['shared_deferred_bytes'] == 0" % start)

"""The simulator's IPC calls (cython/sim/ipc.c): aclrtIpcMemGetExportKey, aclrtIpcMemSetImportPid,
aclrtIpcMemImportByKey and aclrtIpcMemClose, for real between processes of one simulated node.

Every test runs its processes on a node of its own (sim_fixtures.sim_node); tests/ipc_harness.py
drives them step by step. Codes are those listed in cython/sim/acl_api.h.
"""
import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from ipc_harness import Peer  # noqa: E402
from sim_fixtures import sim_node  # noqa: E402,F401

MiB = 1 << 20
INIT = "init(0)\n"


def ipc_files(node):
    return sorted(f for f in os.listdir(node.shm_dir) if "-ipc-" in f)


def test_export_import_in_two_processes_sees_the_exporters_writes(sim_node):
    """Data written before the export survives it; a write by the exporter after a stream sync is
    seen by two importers; an importer's write is seen by the exporter; capacity counts once."""
    with Peer(sim_node, INIT) as ex, Peer(sim_node, INIT) as a, Peer(sim_node, INIT) as b:
        key = ex("""
            ptr = malloc(8 * MiB)
            assert fill(ptr, 8 * MiB, 0x5A) == 0          # written before the export
            rc, key = export(ptr, 8 * MiB, 1)             # 1: no pid validation
            assert rc == 0, (rc, errmsg())
            assert len(key) <= 64 and key.isascii()
            out = key
        """)
        used_before = ex("out = sim.stats(0)['node_bytes_used']")
        for peer in (a, b):
            got = peer(f"""
                rc, p = imp({key!r})
                assert rc == 0, (rc, errmsg())
                assert p % (2 * MiB) == 0
                out = [same(p, 8 * MiB, 0x5A), ipc_stats(0)]
            """)
            assert got[0], "importer does not see the data written before the export"
            st = got[1]
            assert st["bytes_held"] == 0 and st["ipc_imports"] == 1 and st["ipc_imported_bytes"] == 8 * MiB, st
            assert st["node_bytes_used"] == used_before, "an import added to the node's usage"
        ex("assert fill(ptr, 8 * MiB, 0x77) == 0")       # launch_fill + stream sync
        for peer in (a, b):
            assert peer("out = same(p, 8 * MiB, 0x77)")
        a("assert fill(p + MiB, MiB, 0x11) == 0")        # an importer writes one MiB
        assert ex("out = same(ptr + MiB, MiB, 0x11) and same(ptr, MiB, 0x77)")
        st = ex("out = ipc_stats(0)")
        assert st["ipc_exports"] == 1 and st["ipc_exported_bytes"] == 8 * MiB, st
        a(f"assert close({key!r}) == 0")
        b(f"assert close({key!r}) == 0")
        ex(f"assert close({key!r}) == 0 and free(ptr) == 0 and sim.stats(0)['node_bytes_used'] == 0")
    assert ipc_files(sim_node) == []


def test_import_needs_an_allowed_pid(sim_node):
    with Peer(sim_node, INIT) as ex, Peer(sim_node, INIT) as imp, Peer(sim_node, INIT) as other:
        key = ex("""
            ptr = malloc(4 * MiB)
            rc, key = export(ptr, 4 * MiB)                 # default: pids are checked
            assert rc == 0, errmsg()
            out = key
        """)
        got = imp(f"rc, p = imp({key!r}); out = [rc, errmsg()]")
        assert got[0] == 207006, got                     # ACL_ERROR_RT_NO_PERMISSION
        assert "may not import" in got[1] and "aclrtIpcMemSetImportPid" in got[1]
        ex(f"assert set_pids(key, [{imp.pid}]) == 0, errmsg()")  # its getpid(): not its node-level id
        assert imp(f"out = imp({key!r})[0]") == 207006
        ex(f"assert set_pids(key, [{imp.node_pid}]) == 0, errmsg()")
        assert imp(f"rc, p = imp({key!r}); out = rc") == 0
        assert other(f"out = imp({key!r})[0]") == 207006  # still refused: not listed
        assert ex(f"out = imp(key)[0]") == 0              # the exporter itself may import
        ex("assert close(key) == 0")                      # ... and closes that import
        imp(f"assert close({key!r}) == 0")
        ex("assert close(key) == 0 and free(ptr) == 0")


def test_unknown_and_malformed_keys(sim_node):
    with Peer(sim_node, INIT) as p:
        got = p("""
            out = {}
            out["unknown"] = [imp("simipc-1-1-0000000000000000")[0], errmsg()]
            out["malformed"] = imp("../etc/passwd")[0]
            out["too_long"] = imp("k" * 65)[0]
            out["close_unknown"] = close("simipc-1-1-0000000000000000")
            out["set_pids_unknown"] = set_pids("simipc-1-1-0000000000000000", [os.getpid()])
        """)
    assert got["unknown"][0] == 107000 and "no memory is exported with key" in got["unknown"][1]
    assert got["malformed"] == got["too_long"] == got["close_unknown"] == got["set_pids_unknown"] == 107000


def test_a_symbolic_link_at_a_record_name_is_refused_by_name(sim_node):
    """A link planted where a key's record would be (O_NOFOLLOW: ELOOP) is refused with 207006, and
    the message names the record's path (read before the import's bookkeeping is freed: it was read
    after, a use-after-free that ASan reports)."""
    key = "simipc-1-1-0000000000000000"
    path = os.path.join(sim_node.shm_dir, f"ascendsim-{os.geteuid()}-{sim_node.name}-ipc-{key}")
    os.symlink("/dev/null", path)
    with Peer(sim_node, INIT) as p:
        got = p(f"out = [imp({key!r})[0], errmsg()]")
    assert got[0] == 207006
    assert f"cannot open the record of key '{key}' ({path})" in got[1]


def test_argument_codes(sim_node):
    with Peer(sim_node) as p:
        got = p("""
            out = {}
            out["uninit_export"] = export(1 << 30, 2 * MiB)[0]
            out["uninit_import"] = imp("k")[0]
            out["uninit_close"] = close("k")
            ok("aclInit", None)
            out["no_device_export"] = export(1 << 30, 2 * MiB)[0]
            out["no_device_import"] = imp("k")[0]
            ok("aclrtSetDevice", 0)
            ptr = malloc(4 * MiB)
            small = malloc(64 << 10)
            out["null_ptr"] = export(None, 2 * MiB)[0]
            out["size0"] = export(ptr, 0)[0]
            out["short_len"] = export(ptr, 2 * MiB, 0, 64)[0]
            out["flags"] = export(ptr, 2 * MiB, 2)[0]
            out["unaligned_ptr"] = export(ptr + 4096, 2 * MiB)[0]
            out["unaligned_size"] = export(ptr, MiB)[0]
            out["small_alloc"] = export(small, 2 * MiB)[0]
            out["outside"] = export(ptr + 4 * MiB, 2 * MiB)[0]
            out["not_allocated"] = export(1 << 44, 2 * MiB)[0]
            rc, key = export(ptr + 2 * MiB, 2 * MiB)       # the second page of the allocation
            out["interior"] = rc
            out["overlap"] = export(ptr, 4 * MiB)[0]
            rc2, key2 = export(ptr, 2 * MiB)               # the first page: no overlap
            out["neighbour"] = rc2
            out["pids_null_key"] = set_pids(None, [1])
            out["pids_zero"] = set_pids(key, [0])
            out["pids_none"] = set_pids(key, [])
            out["pids_ok"] = set_pids(key, [os.getpid(), 1])
            out["import_flags"] = imp(key, 2)[0]
            out["import_null"] = imp(None)[0]
            out["close_null"] = close(None)
            out["free_closes"] = free(ptr)                 # no importer: its keys close with it
            out["key_gone"] = imp(key)[0]
            out["key2_gone"] = close(key2)
        """)
    assert got["uninit_export"] == got["uninit_import"] == got["uninit_close"] == 100001
    assert got["no_device_export"] == got["no_device_import"] == 107002
    for k in ("null_ptr", "size0", "short_len", "pids_null_key", "pids_none", "import_null", "close_null"):
        assert got[k] == 100000, (k, got)
    for k in ("flags", "outside", "not_allocated", "overlap", "pids_zero", "import_flags", "key_gone",
              "key2_gone"):
        assert got[k] == 107000, (k, got)
    # a 64 KiB allocation is page aligned (4 KiB) but not on a 2 MiB boundary in general
    assert got["small_alloc"] in (107008, 107000), got
    assert got["unaligned_ptr"] == got["unaligned_size"] == 107008, got
    assert got["interior"] == got["neighbour"] == got["pids_ok"] == got["free_closes"] == 0, got
    assert ipc_files(sim_node) == []


def test_close_order_is_enforced(sim_node):
    """The exporter can neither close the key nor free the memory while a live process imports it
    (507022, naming the importer); once the importer closed, both work."""
    with Peer(sim_node, INIT) as ex, Peer(sim_node, INIT) as im:
        key = ex("ptr = malloc(4 * MiB); rc, key = export(ptr, 4 * MiB, 1); out = key")
        im(f"assert imp({key!r})[0] == 0")
        got = ex("out = [close(key), errmsg(), free(ptr), errmsg()]")
        assert got[0] == 507022 and "still imported" in got[1] and str(im.pid) in got[1], got
        assert got[2] == 507022 and "still imported" in got[3], got
        assert im(f"out = imp({key!r})[0]") == 0             # a second import: the same mapping
        im(f"assert close({key!r}) == 0")
        assert ex("out = close(key)") == 507022             # one import is still open
        im(f"assert close({key!r}) == 0")
        assert im(f"out = close({key!r})") == 107000        # nothing left to close
        ex("assert close(key) == 0, errmsg(); assert free(ptr) == 0")
        assert im(f"out = imp({key!r})[0]") == 107000       # closed: the key is unknown now
    assert ipc_files(sim_node) == []


def test_killed_importer_does_not_leak_the_block(sim_node):
    with Peer(sim_node, INIT) as ex:
        start = ex("out = sim.stats(0)['node_bytes_used']")
        key = ex("ptr = malloc(16 * MiB); rc, key = export(ptr, 16 * MiB, 1); out = key")
        victim = Peer(sim_node, INIT)
        victim(f"rc, p = imp({key!r}); assert rc == 0 and fill(p, 16 * MiB, 3) == 0")
        assert ex("out = free(ptr)") == 507022                 # alive: refused
        victim.kill()
        victim.close()
        assert ex("out = [free(ptr), errmsg()]")[0] == 0       # dead: the exporter frees
        assert ex("out = sim.stats(0)['node_bytes_used']") == start
    assert ipc_files(sim_node) == []


def test_killed_exporter_gives_importers_a_clear_error(sim_node):
    with Peer(sim_node, INIT) as im:
        ex = Peer(sim_node, INIT)
        key = ex("ptr = malloc(4 * MiB); assert fill(ptr, 4 * MiB, 9) == 0; out = export(ptr, 4 * MiB, 1)[1]")
        im(f"rc, p = imp({key!r}); assert rc == 0 and same(p, 4 * MiB, 9)")
        ex.kill()
        ex.close()
        got = im(f"""
            rc, data = read(p, 4096)
            out = {{"read": [rc, errmsg()], "fill": lib.ascendsim_launch_fill(None, p, 4096, 1, 0),
                   "again": imp({key!r})[0], "node": sim.stats(0)["node_bytes_used"]}}
            out["raw_ok"] = C.string_at(p, 16) == bytes([9]) * 16  # the mapping itself stays valid
            out["close"] = close({key!r})
        """)
        assert got["read"][0] == 507022 and "has exited" in got["read"][1], got
        assert got["fill"] == got["again"] == 507022, got
        assert got["node"] == 0, "the dead exporter's bytes were not reclaimed"
        assert got["raw_ok"] and got["close"] == 0, got
    assert ipc_files(sim_node) == []                          # the last importer removed the file


def test_exporter_finalize_closes_its_keys(sim_node):
    with Peer(sim_node, INIT) as ex, Peer(sim_node, INIT) as im:
        key = ex("ptr = malloc(2 * MiB); out = export(ptr, 2 * MiB, 1)[1]")
        im(f"rc, p = imp({key!r}); assert rc == 0")
        ex("ok('aclFinalize')")
        got = im("rc, _ = read(p, 64); out = [rc, errmsg()]")
        assert got[0] == 507022 and "closed" in got[1], got
        im(f"assert close({key!r}) == 0")
    assert ipc_files(sim_node) == []


def test_forked_child_imports_like_any_process(sim_node):
    """A fork of the exporter has no runtime: it initialises and imports by key, once listed."""
    with Peer(sim_node, INIT) as ex:
        got = ex("""
            ptr = malloc(4 * MiB)
            assert fill(ptr, 4 * MiB, 0x42) == 0
            rc, key = export(ptr, 4 * MiB)
            r, w = os.pipe()
            go_r, go_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r); os.close(go_w)
                ok("aclInit", None); ok("aclrtSetDevice", 0)
                first = imp(key)[0]                       # not listed yet
                os.write(w, (str(first).ljust(8) + str(bare_tgid()).ljust(12)).encode())
                os.read(go_r, 1)
                rc, p = imp(key)
                good = rc == 0 and same(p, 4 * MiB, 0x42) and close(key) == 0
                os.write(w, b"ok" if good else str(rc).encode())
                os._exit(0)
            os.close(w); os.close(go_r)
            msg = os.read(r, 20).decode()
            first, child_id = msg[:8].strip(), int(msg[8:])
            assert child_id != pid                        # a node-level id, never a getpid() value
            assert set_pids(key, [child_id]) == 0
            os.write(go_w, b"g")
            second = os.read(r, 16).decode()
            os.waitpid(pid, 0)
            out = [first, second, close(key), free(ptr)]
        """)
        assert got == ["207006", "ok", 0, 0], got


IPC_SYMBOLS = ["aclrtIpcMemGetExportKey", "aclrtIpcMemSetImportPid", "aclrtIpcMemImportByKey", "aclrtIpcMemClose"]


@pytest.mark.parametrize("legacy", [False, True], ids=["sim", "sim-legacy"])
def test_backend_ipc_entries_through_the_acl_loading_code(legacy):
    """The acl backend resolves the four calls as optional symbols (recorded on first use) and
    passes the runtime's codes through."""
    from ascend_pool._core import Backend
    from ascend_pool.backend import sim_library_path
    from ascend_pool.errors import DeviceError

    b = Backend("sim", sim_library_path(legacy))
    assert b.has_ipc
    assert not set(IPC_SYMBOLS) & set(b.resolved_symbols)
    ptr = b.malloc(0, 4 * MiB)
    with pytest.raises(DeviceError) as e:
        b.ipc_export(0, ptr + 4096, 2 * MiB)
    assert e.value.code == 107008 and "ACL_ERROR_RT_ADDR_UNALIGNED" in str(e.value)
    assert b.resolved_symbols[-4:] == IPC_SYMBOLS
    key = b.ipc_export(0, ptr, 4 * MiB)
    b.ipc_set_pids(0, key, [os.getpid()])
    p2, size = b.ipc_import(0, key)                   # the exporter may import its own key
    assert size == 0 and p2 != ptr and p2 % (2 * MiB) == 0
    with pytest.raises(DeviceError) as e:
        b.free(0, ptr)
    assert e.value.code == 507022 and "still imported" in str(e.value)
    b.ipc_close(0, key)                               # the import ...
    b.ipc_close(0, key)                               # ... then the export
    with pytest.raises(DeviceError) as e:
        b.ipc_close(0, key)
    assert e.value.code == 107000
    b.free(0, ptr)
    assert b.resolved_symbols.count("aclrtIpcMemClose") == 1


def test_peers_whose_lease_files_a_cleanup_removed_stay_alive_to_each_other(sim_node):
    """A cleanup of ASCEND_SIM_SHM_DIR removed every lease file of a live exporter and its live
    importer: a new import of the key was refused ("has exited"), and the exporter took its
    importer for dead and freed the memory under it. Their life locks on the record
    (proc.c: sim_proc_life_hold) say they live; a killed exporter's forked child keeps nothing."""
    with Peer(sim_node, INIT) as ex, Peer(sim_node, INIT) as im, Peer(sim_node, INIT) as late:
        key = ex("ptr = malloc(4 * MiB); assert fill(ptr, 4 * MiB, 9) == 0; out = export(ptr, 4 * MiB, 1)[1]")
        im(f"rc, p = imp({key!r}); assert rc == 0 and same(p, 4 * MiB, 9)")
        late("pass")
        for name in os.listdir(sim_node.shm_dir):
            if name.startswith(("ascendsim-lease-", "ascendsim-alive-")):
                os.unlink(os.path.join(sim_node.shm_dir, name))
        got = late(f"rc, q = imp({key!r}); out = [rc, errmsg() if rc else same(q, 4 * MiB, 9)]")
        assert got == [0, True], got                            # was 507022, "has exited"
        assert ex("out = free(ptr)") == 507022                  # imported: refused (was freed)
        assert im("out = same(p, 4 * MiB, 9)")
        child = ex("""
            import time
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # past fork's child handlers (which drop the life locks) once it runs Python
                os.write(w, b"1")
                time.sleep(600)
                os._exit(0)
            assert os.read(r, 1) == b"1"
            out = pid
        """)
        try:
            ex.kill()
            got = im("rc, data = read(p, 4096); out = [rc, errmsg()]")
            assert got[0] == 507022 and "has exited" in got[1], got
        finally:
            os.kill(child, signal.SIGKILL)
        im(f"assert close({key!r}) == 0")
        late(f"assert close({key!r}) == 0")
    assert ipc_files(sim_node) == []                            # the last importer removed the file


def test_an_import_on_another_device_needs_peer_access(sim_node):
    """CANN's aclrtIpcMemImportByKey page: ACL_RT_IPC_MEM_IMPORT_FLAG_DEFAULT leaves data exchange
    between the two devices off (aclrtDeviceEnablePeerAccess, not simulated, would turn it on);
    ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS turns it on. The driver refuses the handle
    (507899). On the exporter's own device the default flag imports."""
    with Peer(sim_node, INIT) as ex, Peer(sim_node, "init(1)\n") as other, Peer(sim_node, INIT) as same:
        key = ex("ptr = malloc(4 * MiB)\nrc, out = export(ptr, 4 * MiB, 1)\nassert rc == 0, (rc, errmsg())")
        rc, msg = other(f"rc, p = imp({key!r}, 0)\nout = [rc, errmsg()]")
        assert rc == 507899 and "ENABLE_PEER_ACCESS" in msg, (rc, msg)
        assert other(f"rc, p = imp({key!r}, 1)\nout = [rc, close({key!r})]") == [0, 0]
        assert same(f"rc, p = imp({key!r}, 0)\nout = [rc, close({key!r})]") == [0, 0]
        ex(f"assert close({key!r}) == 0 and free(ptr) == 0")


def test_a_key_imported_twice_maps_twice_and_each_close_takes_the_oldest_import(sim_node):
    """CANN's driver maps each aclrtIpcMemImportByKey anew (svm_ipc_open_handle: a new address), and
    aclrtIpcMemClose(key) closes the process's oldest import of the key (IpcCloseMemoryByName: its
    vaList's front), whichever the caller meant. The exporter's close waits for both. Before
    2026-12-06 the second import returned the first one's address, counted."""
    with Peer(sim_node, INIT) as ex, Peer(sim_node, INIT) as im:
        key = ex("""
            ptr = malloc(4 * MiB)
            assert fill(ptr, 4 * MiB, 0x5A) == 0
            rc, key = export(ptr, 4 * MiB, 1)
            assert rc == 0, (rc, errmsg())
            out = key
        """)
        got = im(f"""
            rc1, p1 = imp({key!r})
            rc2, p2 = imp({key!r})
            out = [rc1, rc2, p1 != p2, same(p1, 4 * MiB, 0x5A), same(p2, 4 * MiB, 0x5A), ipc_stats(0)["ipc_imports"]]
        """)
        assert got == [0, 0, True, True, True, 2], got
        got = im(f"""
            out = [close({key!r}), read(p1, 64)[0], same(p2, 4 * MiB, 0x5A)]   # the oldest goes: p1
        """)
        assert got == [0, 107000, True], got
        assert ex(f"out = close({key!r})") != 0                               # p2 still imports it
        assert im(f"out = [close({key!r}), read(p2, 64)[0], close({key!r})]") == [0, 107000, 107000]
        ex(f"assert close({key!r}) == 0 and free(ptr) == 0")
    assert ipc_files(sim_node) == []

"""Virtual memory of the simulated NPU, through ctypes on the library itself: reservations are
inaccessible address space that costs no capacity, physical handles are capacity, and mapping one
into a reservation makes device memory that reads and fills see; the real runtime's constraints
and codes apply, and a touch of unmapped memory faults. Each test runs in a child process on its
own simulated node (see sim_fixtures)."""
import os
import signal
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401  (pytest fixture)

MiB, GiB = 1 << 20, 1 << 30

# ctypes for the VMM calls, and small helpers, for the children (after sim_fixtures' PRELUDE).
VMM = """
class Location(C.Structure):
    _fields_ = [("id", C.c_uint32), ("type", C.c_int)]

class Prop(C.Structure):
    _fields_ = [("handleType", C.c_int), ("allocationType", C.c_int), ("memAttr", C.c_int),
                ("location", Location), ("reserve", C.c_uint64)]

assert C.sizeof(Prop) == 32 and Prop.location.offset == 12 and Prop.reserve.offset == 24
VP, SZ = C.c_void_p, C.c_size_t
for name, args in {
    "aclrtMemGetAllocationGranularity": [C.POINTER(Prop), C.c_int, C.POINTER(SZ)],
    "aclrtReserveMemAddress": [C.POINTER(VP), SZ, SZ, VP, C.c_uint64],
    "aclrtReleaseMemAddress": [VP],
    "aclrtMallocPhysical": [C.POINTER(VP), SZ, C.POINTER(Prop), C.c_uint64],
    "aclrtFreePhysical": [VP],
    "aclrtMapMem": [VP, SZ, SZ, VP, C.c_uint64],
    "aclrtUnmapMem": [VP],
}.items():
    f = getattr(lib, name)
    f.argtypes, f.restype = args, C.c_int
MiB, GiB = 1 << 20, 1 << 30
HBM_HUGE, HBM_HUGE1G, DEVICE = 4, 10, 1

def prop(dev=0, attr=HBM_HUGE, **kw):
    p = Prop(0, 0, attr, Location(dev, DEVICE), 0)
    for k, v in kw.items():
        setattr(p, k, v)
    return p

def granularity(p=None, option=0):
    g = SZ()
    ok("aclrtMemGetAllocationGranularity", C.byref(p or prop()), option, C.byref(g))
    return g.value

def reserve(size, flags=1):  # 1: huge pages, what HBM_HUGE handles need (CANN 8.0)
    va = VP()
    ok("aclrtReserveMemAddress", C.byref(va), size, 0, None, flags)
    return va.value

def physical(size, dev=0, attr=HBM_HUGE):
    h = VP()
    ok("aclrtMallocPhysical", C.byref(h), size, C.byref(prop(dev, attr)), 0)
    return h.value

def map_(va, size, h):
    ok("aclrtMapMem", va, size, 0, h, 0)

def refused(want, call, *args, says=None):
    rc = code(call, *args)
    msg = errmsg()
    assert rc == want, (call, rc, want, msg)
    assert msg and call in msg, (call, msg)
    if says:
        assert says in msg, (call, msg)

def read_code(ptr, n):
    buf = C.create_string_buffer(max(n, 1))
    return lib.ascendsim_read(ptr, buf, n)
"""


def vmm(code):
    """Child code: the VMM helpers, then `code` (dedented)."""
    return VMM + textwrap.dedent(code)


def test_round_trip_data_and_stats(sim_node):
    """Reserve, map two handles side by side, fill across the seam, read back; unmap, remap one
    handle elsewhere (its data kept), free, release: counters and capacity come back to zero."""
    sim_node.run(vmm("""
        init()
        assert granularity() == granularity(option=1) == 2 * MiB
        assert granularity(prop(attr=HBM_HUGE1G)) == GiB
        f0, total = meminfo()
        va = reserve(16 * MiB)
        assert va % (2 * MiB) == 0
        assert meminfo()[0] == f0                       # address space costs no capacity
        a, b = physical(2 * MiB), physical(4 * MiB)
        assert f0 - meminfo()[0] == 6 * MiB
        map_(va, 2 * MiB, a)
        map_(va + 2 * MiB, 4 * MiB, b)
        # device memory now: a fill across the two handles, then reads of both and of the seam
        s = stream()
        sim.launch_fill(s, va + MiB, 3 * MiB, 0x5A)
        ok("aclrtSynchronizeStream", s)
        assert sim.read(va + MiB - 2, 4) == b"\\0\\0\\x5a\\x5a"
        assert sim.read(va + 2 * MiB - 2, 4) == b"\\x5a" * 4
        assert sim.read(va + 4 * MiB - 1, 2) == b"\\x5a\\0"
        C.memset(va + 5 * MiB, 0x11, 16)                 # written through the mapping itself
        assert sim.read(va + 5 * MiB, 16) == b"\\x11" * 16
        st = sim.stats(0)
        assert (st["phys_mallocs"], st["maps"], st["phys_bytes"], st["mapped_bytes"]) == \\
            (2, 2, 6 * MiB, 6 * MiB), st
        assert st["bytes_held"] == st["node_bytes_used"] == 6 * MiB, st
        # a fill queued behind the unmap is dropped, not written to inaccessible memory
        sim.hang_stream(s)
        sim.launch_fill(s, va + 2 * MiB, 64, 0x77)
        ok("aclrtUnmapMem", va + 2 * MiB)
        sim.release_stream(s)
        ok("aclrtSynchronizeStream", s)
        assert sim.stats(0)["dropped_fills"] == 1
        assert read_code(va + 2 * MiB, 1) == 107000      # unmapped: refused, never touched
        assert read_code(va + MiB, 2 * MiB) == 107000    # a range running into it too
        assert sim.read(va, 4) == b"\\0" * 4              # the other mapping is untouched
        # the handle keeps its data: map it again elsewhere in the reservation
        map_(va + 8 * MiB, 4 * MiB, b)
        assert sim.read(va + 8 * MiB, 2 * MiB) == b"\\x5a" * (2 * MiB)
        assert sim.read(va + 11 * MiB, 16) == b"\\x11" * 16
        ok("aclrtUnmapMem", va + 8 * MiB)
        # a handle mapped at two places: one memory, busy until the last mapping goes
        map_(va + 12 * MiB, 2 * MiB, a)
        C.memset(va + 100, 0x3C, 4)
        assert sim.read(va + 12 * MiB + 100, 4) == b"\x3c" * 4
        ok("aclrtUnmapMem", va)
        refused(107000, "aclrtFreePhysical", a, says="still mapped")
        ok("aclrtUnmapMem", va + 12 * MiB)
        ok("aclrtFreePhysical", a)
        ok("aclrtFreePhysical", b)
        ok("aclrtReleaseMemAddress", va)
        st = sim.stats(0)
        assert (st["phys_mallocs"], st["phys_frees"], st["maps"], st["unmaps"]) == (2, 2, 4, 4), st
        assert st["phys_bytes"] == st["mapped_bytes"] == st["bytes_held"] == 0, st
        assert meminfo() == (f0, total)
        # the old fields keep their places: new ones are appended
        names = lib.ascendsim_stats_fields().decode().split(",")
        assert names[:10] == ["mallocs", "frees", "bytes_held", "node_bytes_used", "total_bytes",
                              "live_events", "events_created", "live_streams", "dropped_fills",
                              "poisoned_bytes"], names
        assert names[10:16] == ["phys_mallocs", "phys_frees", "phys_bytes", "maps", "unmaps",
                                "mapped_bytes"], names
        assert names[16:] == ["device_refs", "event_queries"], names
    """))


def test_capacity_counts_physical_memory_not_reservations(sim_node):
    sim_node.run(vmm("""
        init()
        f0, total = meminfo()
        assert total == 64 * GiB
        big = reserve(1 << 40)                           # 1 TiB of address space on a 64 GiB device
        assert meminfo()[0] == f0
        h = physical(2 * MiB)
        assert f0 - meminfo()[0] == 2 * MiB              # exactly the physical size
        odd = physical(3 * MiB)                          # rounded up to the 2 MiB granularity
        assert f0 - meminfo()[0] == 6 * MiB
        assert sim.stats(0)["phys_bytes"] == 6 * MiB
        # 60 GiB more fit (sparse: no host memory is touched), then 4 GiB do not
        hs = [physical(15 * GiB) for _ in range(4)]
        assert meminfo()[0] == 4 * GiB - 6 * MiB
        refused(207001, "aclrtMallocPhysical", C.byref(VP()), 4 * GiB, C.byref(prop()), 0,
                says="out of device memory")
        refused(207001, "aclrtMalloc", C.byref(VP()), 4 * GiB, 0)   # one capacity for both kinds
        last = physical(4 * GiB - 6 * MiB)               # what is left fits exactly
        assert meminfo()[0] == 0
        ok("aclrtFreePhysical", last)
        refused(207001, "aclrtMallocPhysical", C.byref(VP()), 128 * GiB, C.byref(prop()), 0)
        # a big physical handle maps and works at the far end of the big reservation
        map_(big + (1 << 40) - 16 * GiB, 15 * GiB, hs[0])
        sim.launch_fill(None, big + (1 << 40) - 2 * GiB, 8, 0x33)
        ok("aclrtSynchronizeStream", None)
        assert sim.read(big + (1 << 40) - 2 * GiB, 8) == b"\\x33" * 8
        ok("aclrtUnmapMem", big + (1 << 40) - 16 * GiB)
        for x in hs + [h, odd]:
            ok("aclrtFreePhysical", x)
        assert meminfo() == (f0, total)
        ok("aclrtReleaseMemAddress", big)
    """), ASCEND_SIM_HBM="64GiB")


def test_physical_memory_is_node_wide(sim_node):
    """A second process on the node sees the first one's physical memory in aclrtGetMemInfo."""
    p = sim_node.spawn(vmm("""
        init()
        h = physical(256 * MiB)
        print("held", flush=True)
        sys.stdin.readline()
        ok("aclrtFreePhysical", h)
    """))
    try:
        assert p.stdout.readline().strip() == "held", p.stderr.read()
        sim_node.run("""
            init()
            f, t = meminfo()
            assert t - f == 256 << 20, (f, t)
        """)
    finally:
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.wait(timeout=30) == 0, p.stderr.read()


def test_constraints_give_the_runtimes_codes(sim_node):
    """Every misuse is refused with CANN's code and a message naming the call; the process and
    what it holds stay intact."""
    sim_node.run(vmm("""
        for call, args in [("aclrtReserveMemAddress", (C.byref(VP()), 2 * MiB, 0, None, 0)),
                           ("aclrtMallocPhysical", (C.byref(VP()), 2 * MiB, C.byref(prop()), 0)),
                           ("aclrtMemGetAllocationGranularity", (C.byref(prop()), 0, C.byref(SZ()))),
                           ("aclrtMapMem", (1 << 30, 2 * MiB, 0, 1, 0)), ("aclrtUnmapMem", (1 << 30,)),
                           ("aclrtFreePhysical", (1,)), ("aclrtReleaseMemAddress", (1 << 30,))]:
            refused(100001, call, *args)                 # before aclInit
        init()
        va = reserve(16 * MiB)
        # aclrtReserveMemAddress
        refused(100000, "aclrtReserveMemAddress", None, 2 * MiB, 0, None, 0)
        refused(100000, "aclrtReserveMemAddress", C.byref(VP()), 0, 0, None, 0)
        refused(100000, "aclrtReserveMemAddress", C.byref(VP()), 2 * MiB, 0, None, 2)
        refused(107000, "aclrtReserveMemAddress", C.byref(VP()), 2 * MiB, 4096, None, 0, says="alignment")
        refused(107000, "aclrtReserveMemAddress", C.byref(VP()), 2 * MiB, 0, va, 0, says="expectPtr")
        refused(107000, "aclrtReserveMemAddress", C.byref(VP()), 3 * MiB, 0, None, 0, says="multiple")
        assert reserve(GiB, flags=1) % GiB == 0          # flags 1 (the page flag) is accepted
        # aclrtMallocPhysical and its properties
        H = C.byref(VP())
        refused(100000, "aclrtMallocPhysical", None, 2 * MiB, C.byref(prop()), 0)
        refused(100000, "aclrtMallocPhysical", H, 2 * MiB, None, 0)
        refused(100000, "aclrtMallocPhysical", H, 0, C.byref(prop()), 0)
        refused(100000, "aclrtMallocPhysical", H, 2 * MiB, C.byref(prop()), 1)
        refused(100000, "aclrtMallocPhysical", H, 2 * MiB, C.byref(prop(handleType=1)), 0)
        refused(100000, "aclrtMallocPhysical", H, 2 * MiB, C.byref(prop(allocationType=1)), 0)
        refused(100000, "aclrtMallocPhysical", H, 2 * MiB, C.byref(prop(location=Location(0, 2))), 0)
        for attr in (0, 1, 2, 8, 9, 11, 18, -1):        # DDR on a device, plain HBM, HBM P2P, junk
            refused(100000, "aclrtMallocPhysical", H, 2 * MiB, C.byref(prop(attr=attr)), 0)
        refused(207000, "aclrtMallocPhysical", H, 2 * MiB, C.byref(prop(location=Location(0, 0))), 0)
        refused(107001, "aclrtMallocPhysical", H, 2 * MiB, C.byref(prop(dev=2)), 0)
        refused(107001, "aclrtMemGetAllocationGranularity", C.byref(prop(dev=7)), 0, C.byref(SZ()))
        refused(100000, "aclrtMemGetAllocationGranularity", C.byref(prop()), 2, C.byref(SZ()))
        refused(100000, "aclrtMemGetAllocationGranularity", None, 0, C.byref(SZ()))
        for attr in (5, 12, 13, 15, 16):                 # the other device attributes: 2 MiB pages
            assert granularity(prop(attr=attr)) == 2 * MiB, attr
        for attr in (14, 17):
            assert granularity(prop(attr=attr)) == GiB, attr
        # aclrtMapMem
        h2, h4, h3 = physical(2 * MiB), physical(4 * MiB), physical(3 * MiB)
        refused(100000, "aclrtMapMem", None, 2 * MiB, 0, h2, 0)
        refused(100000, "aclrtMapMem", va, 2 * MiB, 0, None, 0)
        refused(100000, "aclrtMapMem", va, 0, 0, h2, 0)
        refused(100000, "aclrtMapMem", va, 2 * MiB, 0, h2, 1)
        refused(107000, "aclrtMapMem", va, 2 * MiB, 2 * MiB, h4, 0, says="offset")
        refused(107000, "aclrtMapMem", va, 2 * MiB, 0, h4, 0, says="size of the physical")
        refused(107000, "aclrtMapMem", va, 3 * MiB, 0, h3, 0, says="multiple")   # unaligned handle
        refused(107000, "aclrtMapMem", va, 4 * MiB, 0, h3, 0)
        refused(107000, "aclrtMapMem", va + 4096, 2 * MiB, 0, h2, 0, says="aligned")
        refused(107000, "aclrtMapMem", va + 14 * MiB, 4 * MiB, 0, h4, 0, says="not inside one reservation")
        p = malloc(4 * MiB)
        refused(107000, "aclrtMapMem", p, 2 * MiB, 0, h2, 0)   # aclrtMalloc memory is no reservation
        refused(107000, "aclrtMapMem", va, 2 * MiB, 0, 0x5EED0000000FFF04, 0, says="not a live physical")
        refused(107000, "aclrtMapMem", va, 2 * MiB, 0, 12345, 0)
        map_(va + 2 * MiB, 4 * MiB, h4)
        refused(107000, "aclrtMapMem", va + 2 * MiB, 2 * MiB, 0, h2, 0, says="overlaps")
        refused(107000, "aclrtMapMem", va + 4 * MiB, 2 * MiB, 0, h2, 0, says="overlaps")
        refused(107000, "aclrtMapMem", va, 4 * MiB, 0, h4, 0, says="overlaps")
        other = physical(2 * MiB, dev=1)
        refused(107000, "aclrtMapMem", va, 2 * MiB, 0, other, 0, says="two devices")
        # aclrtUnmapMem
        refused(100000, "aclrtUnmapMem", None)
        refused(107000, "aclrtUnmapMem", va + 4 * MiB, says="pass its start")
        refused(107000, "aclrtUnmapMem", va, says="nothing is mapped")
        refused(107000, "aclrtUnmapMem", p, says="not in any reservation")
        # aclrtFreePhysical and aclrtReleaseMemAddress while busy, and with bad arguments
        refused(107000, "aclrtFreePhysical", h4, says="still mapped")
        refused(107000, "aclrtReleaseMemAddress", va, says="mapping")
        refused(107000, "aclrtReleaseMemAddress", va + 2 * MiB, says="pass its base")
        refused(107000, "aclrtReleaseMemAddress", p)
        refused(100000, "aclrtFreePhysical", None)
        refused(100000, "aclrtReleaseMemAddress", None)
        refused(107000, "aclrtFreePhysical", 0x5EED0000000FFF04)
        refused(207002, "aclrtFree", va + 2 * MiB)       # mapped memory is not aclrtMalloc's
        # all of that changed nothing: the mapping still works, and everything unwinds
        sim.launch_fill(None, va + 2 * MiB, 4 * MiB, 0x42)
        ok("aclrtSynchronizeStream", None)
        assert sim.read(va + 6 * MiB - 1, 1) == b"\\x42"
        ok("aclrtUnmapMem", va + 2 * MiB)
        refused(107000, "aclrtUnmapMem", va + 2 * MiB)    # twice
        for h in (h2, h4, h3, other):
            ok("aclrtFreePhysical", h)
        refused(107000, "aclrtFreePhysical", h2)          # twice
        ok("aclrtReleaseMemAddress", va)
        refused(107000, "aclrtReleaseMemAddress", va)     # twice
        free(p)
        assert used() == 0 and sim.stats(0)["bytes_held"] == 0
    """))


def test_fault_injection_applies_to_physical_memory(sim_node):
    sim_node.run(vmm("""
        init()
        sim.set_faults(fail_malloc_nth=2)
        a = physical(2 * MiB)
        refused(207001, "aclrtMallocPhysical", C.byref(VP()), 2 * MiB, C.byref(prop()), 0,
                says="fail_malloc_nth")
        b = physical(2 * MiB)                            # fired once, then disarmed
        # one count for aclrtMalloc and aclrtMallocPhysical alike
        sim.set_faults(fail_malloc_nth=2)
        p = malloc(1024)
        refused(207001, "aclrtMallocPhysical", C.byref(VP()), 2 * MiB, C.byref(prop()), 0)
        # fail_after_bytes counts physical bytes (rounded) with aclrtMalloc's
        held = sim.stats(0)["bytes_held"]
        assert held == 4 * MiB + 1056, held
        sim.set_faults(fail_after_bytes=held + 4 * MiB)
        c = physical(3 * MiB)                            # 4 MiB after rounding: exactly fits
        refused(207001, "aclrtMallocPhysical", C.byref(VP()), 2 * MiB, C.byref(prop()), 0,
                says="fail_after_bytes")
        sim.reset_faults()
        for h in (a, b, c):
            ok("aclrtFreePhysical", h)
        free(p)
        assert used() == 0
    """), ASCEND_SIM_HBM="1GiB")


@pytest.mark.parametrize("where", ["unmapped", "never_mapped"])
def test_touching_unmapped_memory_kills_the_process(sim_node, where):
    """The simulator's own accessors refuse unmapped memory (107000); a plain load from it is a
    segmentation fault, as a use of unmapped device memory should be."""
    p = sim_node.run(vmm(f"""
        init()
        va = reserve(8 * MiB)
        h = physical(2 * MiB)
        map_(va, 2 * MiB, h)
        C.memset(va, 0x2B, 2 * MiB)
        assert sim.read(va + 4096, 4) == b"\\x2b" * 4
        target = va + 4 * MiB if "{where}" == "never_mapped" else va
        if "{where}" == "unmapped":
            ok("aclrtUnmapMem", va)
        assert read_code(target, 4) == 107000
        rc = lib.ascendsim_launch_fill(None, target, 4, 1, 0)
        assert rc == 107000, rc
        print("refused", flush=True)
        C.string_at(target, 1)                           # must not return
        print("survived", flush=True)
    """), expect_rc=-signal.SIGSEGV)
    assert "refused" in p and "survived" not in p, p


def test_mapped_memory_is_not_inherited_by_a_forked_child(sim_node):
    """A forked child has no runtime; the parent's mapped device memory is not there for it."""
    sim_node.run(vmm("""
        init()
        va = reserve(4 * MiB)
        h = physical(2 * MiB)
        map_(va, 2 * MiB, h)
        C.memset(va, 0x61, 64)
        pid = os.fork()
        if pid == 0:
            C.string_at(va, 1)                           # SIGSEGV
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == 11, status
        assert sim.read(va, 2) == b"aa"                  # the parent's memory is intact
    """))


def test_threads_map_and_unmap_while_streams_fill(sim_node):
    """Concurrent maps, unmaps, frees and fills in one reservation: no crash, no lost update."""
    out = sim_node.run_json(vmm("""
        init()
        va = reserve(64 * MiB)
        errors = []
        s = stream()

        def worker(i):
            try:
                ok("aclrtSetDevice", 0)
                base = va + i * 8 * MiB
                for k in range(25):
                    h = physical(2 * MiB)
                    map_(base, 2 * MiB, h)
                    sim.launch_fill(s, base, 4096, (i * 25 + k) & 0xFF)
                    C.memset(base + 8192, i, 16)
                    assert sim.read(base + 8192, 16) == bytes([i]) * 16
                    ok("aclrtUnmapMem", base)             # the fill may be dropped or done
                    ok("aclrtFreePhysical", h)
            except BaseException as e:                    # noqa: BLE001
                errors.append(repr(e))

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for t in ts: t.start()
        for t in ts: t.join()
        ok("aclrtSynchronizeStream", s)
        ok("aclrtReleaseMemAddress", va)
        st = sim.stats(0)
        print(json.dumps({"errors": errors, "st": st, "used": used()}))
    """))
    assert out["errors"] == [], out["errors"]
    st = out["st"]
    assert st["phys_mallocs"] == st["phys_frees"] == st["maps"] == st["unmaps"] == 150, st
    assert st["mapped_bytes"] == st["phys_bytes"] == st["bytes_held"] == out["used"] == 0, st


def test_finalize_gives_everything_back(sim_node):
    sim_node.run(vmm("""
        init()
        va = reserve(8 * MiB)
        hs = [physical(2 * MiB) for _ in range(3)]
        map_(va, 2 * MiB, hs[0])
        map_(va + 2 * MiB, 2 * MiB, hs[1])              # hs[2] allocated, never mapped
        assert used() == 6 * MiB
        ok("aclFinalize")
        init()
        assert used() == 0
        st = sim.stats(0)
        assert st["phys_bytes"] == st["mapped_bytes"] == st["phys_mallocs"] == 0, st
        assert read_code(va, 1) == 107000                # the old range is gone
        refused(107000, "aclrtFreePhysical", hs[2])      # and so are the old handles
        # and it all works again
        va = reserve(4 * MiB)
        h = physical(2 * MiB)
        map_(va, 2 * MiB, h)
        C.memset(va, 7, 8)
        assert sim.read(va, 8) == b"\\x07" * 8
    """))

"""Device and host memory of the simulated NPU: the real runtime's rounding, alignment, capacity,
error codes, and an aclrtGetMemInfo that tells the truth. Each test runs in a child process on
its own simulated node (see sim_fixtures)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401  (pytest fixture)


def test_rounding_and_alignment_match_the_real_runtime(sim_node):
    sim_node.run("""
        init()
        f0, total = meminfo()
        assert total == 1 << 30 and f0 == total, (f0, total)
        # aclrtMalloc: round up to 32, plus 32 bytes; aclrtMallocAlign32: round up to 32 only; above
        # 1 MiB (HUGE_FIRST's huge pages) the device takes whole 2 MiB pages (ACL_HBM_MEM_HUGE's
        # granularity): aclrtMalloc(2 MiB) takes two of them (before 2026-12-05, 2 MiB + 32 bytes)
        for n, want_plain, want_a32 in [(100, 160, 128), (1, 64, 32), (32, 64, 32), (33, 96, 64),
                                        (4096, 4128, 4096), (3 << 20, 4 << 20, 4 << 20),
                                        (2 << 20, 4 << 20, 2 << 20)]:
            before = meminfo()[0]
            p = malloc(n)
            assert before - meminfo()[0] == want_plain, (n, before - meminfo()[0])
            q = malloc(n, align32=True)
            assert before - meminfo()[0] == want_plain + want_a32, n
            assert p % 64 == 0 and q % 64 == 0, (hex(p), hex(q))
            assert sim.stats(0)["bytes_held"] == f0 - meminfo()[0]
            free(p); free(q)
            assert meminfo()[0] == before
        # every policy 0..7 works; HBM attributes agree; the device has no DDR
        ps = [malloc(1000, policy=pol) for pol in range(8)]
        assert meminfo(1) == meminfo(4) == meminfo(10)
        assert meminfo(0) == (0, 0)
        for p in ps: free(p)
        assert meminfo() == (f0, total)
        st = sim.stats(0)
        assert st["mallocs"] == st["frees"] == 22 and st["bytes_held"] == 0, st
    """)


def test_memory_is_real_and_big_reservations_cost_nothing(sim_node):
    """A 48 GiB allocation on a 64 GiB device succeeds without touching host memory (NORESERVE),
    and its bytes can be filled and read back where touched."""
    sim_node.run("""
        init()
        p = malloc(48 << 30)
        s = stream()
        sim.launch_fill(s, p + (40 << 30), 8, 0x5A)
        ok("aclrtSynchronizeStream", s)
        assert sim.read(p + (40 << 30) - 4, 12) == b"\\0" * 4 + b"\\x5a" * 8
        rss_kb = int([l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1])
        assert rss_kb < 1 << 20, rss_kb   # far below 48 GiB: only touched pages are resident
        free(p)
    """, ASCEND_SIM_HBM="64GiB")


def test_capacity_exhaustion_returns_207001_and_meminfo_stays_true(sim_node):
    sim_node.run("""
        init()
        f0, total = meminfo()
        blocks = []
        while True:
            p = C.c_void_p()
            rc = code("aclrtMallocAlign32", C.byref(p), 256 << 10, 0)
            if rc:
                break
            blocks.append(p.value)
        assert rc == 207001, rc
        msg = errmsg()
        assert "aclrtMallocAlign32" in msg and "out of device memory" in msg, msg
        assert len(blocks) == 4 and meminfo() == (0, total), (len(blocks), meminfo())
        # a smaller request does not fit either; a freed block's room is reusable exactly
        assert code("aclrtMalloc", C.byref(C.c_void_p()), 1, 0) == 207001
        free(blocks.pop())
        assert meminfo()[0] == 256 << 10
        blocks.append(malloc(256 << 10, align32=True))
        for p in blocks: free(p)
        assert meminfo() == (f0, total)
        # a single request above the HBM size fails the same way
        assert code("aclrtMalloc", C.byref(C.c_void_p()), 2 << 20, 0) == 207001
    """, ASCEND_SIM_HBM="1MiB")


def test_bad_arguments_get_the_runtime_codes_and_the_process_survives(sim_node):
    sim_node.run("""
        p = C.c_void_p()
        # before aclInit
        assert code("aclrtMalloc", C.byref(p), 64, 0) == 100001
        assert "aclInit" in errmsg()
        assert code("aclrtFree", 0x1000) == 100001
        init()
        assert code("aclInit", None) == 100002
        assert code("aclrtMalloc", C.byref(p), 0, 0) == 100000 and "size is 0" in errmsg()
        assert code("aclrtMalloc", None, 64, 0) == 100000
        assert code("aclrtMalloc", C.byref(p), 64, 8) == 100000 and "policy" in errmsg()
        # acl_rt.h: a page policy may carry a memory type and the read-only flag; GE and HCCL pass
        # ACL_MEM_TYPE_HIGH_BAND_WIDTH (0x1000) alone. Before, the simulator refused them (100000).
        for policy in (0x1000, 0x100, 0x1000 | 2, 0x100000 | 1):
            q = C.c_void_p()
            ok("aclrtMalloc", C.byref(q), 4096, policy)
            ok("aclrtFree", q)
        assert code("aclrtMalloc", C.byref(p), 64, 0x2000) == 100000
        assert code("aclrtMalloc", C.byref(p), 64, -1) == 100000
        assert code("aclrtMallocAlign32", C.byref(p), 0, 0) == 100000
        assert code("aclrtFree", None) == 100000
        # unknown pointers, double and interior frees: 207002, nothing dereferenced
        assert code("aclrtFree", 0x1234) == 207002 and "aclrtFree" in errmsg()
        buf = C.create_string_buffer(64)
        assert code("aclrtFree", C.addressof(buf)) == 207002
        a = malloc(1000)
        b = malloc(1000)   # 1056 bytes reserved
        assert code("aclrtFree", a + 64) == 207002
        free(a)
        assert code("aclrtFree", a) == 207002
        assert errmsg() is not None and errmsg() is None   # reading the message clears it
        # reads and fills are checked against live allocations: 107000, never a segfault
        assert sim.read(b + 1000, 56) == bytes(56)
        for ptr, n in [(0x10, 4), (a, 4), (b + 1050, 64), (b - 8, 16), (C.addressof(buf), 8)]:
            try:
                sim.read(ptr, n)
            except sim.SimError as e:
                assert e.code == 107000 and "not inside one live device allocation" in str(e)
            else:
                raise AssertionError(f"read({ptr:#x}, {n}) succeeded")
            try:
                sim.launch_fill(None, ptr, n, 1)
            except sim.SimError as e:
                assert e.code == 107000
            else:
                raise AssertionError("launch_fill succeeded")
        free(b)
        # device ids
        assert code("aclrtSetDevice", 2) == 107001 and "out of range" in errmsg()
        assert code("aclrtSetDevice", -1) == 107001
        assert code("aclrtResetDevice", 99) == 107001
        assert code("aclrtCreateContext", C.byref(p), 2) == 107001
        try:
            sim.stats(5)
        except sim.SimError as e:
            assert e.code == 200002
        # a thread without a current device
        res = []
        t = threading.Thread(target=lambda: res.append(code("aclrtMalloc", C.byref(C.c_void_p()), 64, 0)))
        t.start(); t.join()
        assert res == [107002], res
        assert used() == 0
        print("alive")
    """)


def test_host_memory_is_page_aligned_and_tracked(sim_node):
    sim_node.run("""
        init()
        h = C.c_void_p()
        ok("aclrtMallocHost", C.byref(h), 10000)
        assert h.value % os.sysconf("SC_PAGE_SIZE") == 0
        C.memset(h.value, 0x11, 10000)   # really writable host memory
        assert C.string_at(h.value + 9990, 10) == b"\\x11" * 10
        assert used() == 0                # host memory is not device memory
        assert code("aclrtMallocHost", C.byref(h), 0) == 100000
        assert code("aclrtMallocHost", None, 8) == 100000
        ok("aclrtFreeHost", h)
        assert code("aclrtFreeHost", h) == 207002
        assert code("aclrtFreeHost", 0x4000) == 207002
        assert code("aclrtFreeHost", None) == 100000
        d = malloc(64)
        assert code("aclrtFreeHost", d) == 207002   # device memory is not host memory
        free(d)
    """)


def test_pinned_host_memory_is_bounded_by_the_hosts_ram_or_its_budget(sim_node):
    """aclrtMallocHost pins (lock-page) memory: the real call fails past the host's RAM, where the
    simulator's NORESERVE mapping served any size (1 TiB on a 23 GiB host). Each allocation takes
    whole pages of this process's budget, ASCEND_SIM_HOST_PINNED (default: physical memory), and
    answers 207001 past it; a free gives its pages back."""
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if ram < 2**40:
        sim_node.run("""
            init()
            h = C.c_void_p()
            assert code("aclrtMallocHost", C.byref(h), 2**40) == 207001, "1 TiB pinned"
            assert "ASCEND_SIM_HOST_PINNED" in errmsg()
            ok("aclrtMallocHost", C.byref(h), 1 << 20)    # a small one still works
            ok("aclrtFreeHost", h)
        """)
    page = os.sysconf("SC_PAGE_SIZE")
    sim_node.run(f"""
        init()
        page = {page}
        a, b, c = C.c_void_p(), C.c_void_p(), C.c_void_p()
        ok("aclrtMallocHost", C.byref(a), 10 * page)
        ok("aclrtMallocHost", C.byref(b), 5 * page - 100)
        # 15 of 16 pages pinned (whole pages): a page more fits, a page and a byte does not
        assert code("aclrtMallocHost", C.byref(c), page + 1) == 207001
        assert "ASCEND_SIM_HOST_PINNED" in errmsg()
        ok("aclrtMallocHost", C.byref(c), 1)               # a byte takes a page
        assert code("aclrtMallocHost", C.byref(C.c_void_p()), 1) == 207001
        ok("aclrtFreeHost", a)
        ok("aclrtMallocHost", C.byref(a), 10 * page)       # the free gave its pages back
        assert code("aclrtMallocHost", C.byref(C.c_void_p()), 1) == 207001
        assert used() == 0                                 # none of it is device memory
        ok("aclFinalize")                                  # gives back everything pinned
        init()
        ok("aclrtMallocHost", C.byref(a), 16 * page)
    """, ASCEND_SIM_HOST_PINNED=str(16 * page))


def test_host_memory_needs_a_current_context_to_allocate_not_to_free(sim_node):
    """CANN's HostMalloc checks the thread's context (107002 without one), HostFree does not
    (hicann/runtime ApiImpl::HostMalloc / HostFree): a backend that pins memory from a thread
    without a device must set one first."""
    sim_node.run("""
        ok("aclInit", None)
        h = C.c_void_p()
        assert code("aclrtMallocHost", C.byref(h), 4096) == 107002 and "no current device" in errmsg()
        ok("aclrtSetDevice", 0)
        ok("aclrtMallocHost", C.byref(h), 4096)
        out = []
        t = threading.Thread(target=lambda: out.append(code("aclrtFreeHost", h)))  # no device there
        t.start(); t.join()
        assert out == [0]
    """)


def test_poison_fills_freed_memory(sim_node):
    sim_node.run("""
        init()
        a = malloc(100)
        free(a)
        assert sim.stats(0)["poisoned_bytes"] == 0
        sim.set_poison(True)
        b = malloc(100)
        free(b)
        assert sim.stats(0)["poisoned_bytes"] == 160
        sim.set_poison(False)
        free(malloc(100))
        assert sim.stats(0)["poisoned_bytes"] == 160
    """)


def test_finalize_releases_everything_and_init_works_again(sim_node):
    sim_node.run("""
        init()
        p = malloc(1 << 20); s = stream(); e = event()
        sim.launch_fill(s, p, 1 << 20, 3, delay_s=0.05)
        ok("aclrtRecordEvent", e, s)
        sim.hang_stream(s)           # aclFinalize must not wedge on a hung stream
        ok("aclFinalize")
        assert code("aclFinalize") == 100037
        assert code("aclrtGetMemInfo", 1, C.byref(C.c_size_t()), C.byref(C.c_size_t())) == 100001
        sim.configure(devices=3, hbm="2MiB")
        os.environ["ASCEND_SIM_NODE"] += "-again"   # a node whose devices have 2 MiB
        init(2)
        n = C.c_uint32(); ok("aclrtGetDeviceCount", C.byref(n))
        assert n.value == 3 and meminfo() == (2 << 20, 2 << 20)
        assert code("aclrtQueryEvent", e, C.byref(C.c_int())) == 107000   # old handles are gone
        try:
            sim.configure(devices=1)
        except sim.SimError as e:
            assert e.code == 100002
        else:
            raise AssertionError("configure after aclInit succeeded")
    """)

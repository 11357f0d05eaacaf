"""The simulated devices are shared by the processes of a node, as real ones are: capacity is
accounted node-wide in shared records that only their owner writes, a dead process's bytes come
back, a record of this user that is malformed or writable by others is refused with a clear message,
and a name someone else holds is skipped for the next one."""
import json
import os
import signal
import struct
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import NS, PRELUDE, needs_unshare, sim_node  # noqa: E402,F401  (sim_node: pytest fixture)

SLOTS, SLOT_SIZE = 256, 40  # node.c: struct node_slot {int32 pid; u32; u64 lease; u64 pidns; u64 start; u64 bytes}

HOLDER = """
    init()
    p = malloc(int(sys.argv[1]) if len(sys.argv) > 1 else {n}, align32=True)
    print("ready", flush=True)
    sys.stdin.readline()          # hold the memory until told to go
"""


def start_holder(node, nbytes, **env):
    proc = node.spawn(HOLDER.format(n=nbytes), **env)
    line = proc.stdout.readline()
    assert line.strip() == "ready", (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc


def test_a_second_process_sees_the_first_and_shares_the_capacity(sim_node):
    a = start_holder(sim_node, 600 << 10, ASCEND_SIM_HBM="1MiB")
    try:
        sim_node.run("""
            init()
            f, t = meminfo()
            assert t - f == 600 << 10, (f, t)              # A's allocation, seen from B
            assert sim.stats(0)["node_bytes_used"] == 600 << 10
            assert sim.stats(0)["bytes_held"] == 0          # ...and it is not B's
            p = C.c_void_p()
            assert code("aclrtMallocAlign32", C.byref(p), 500 << 10, 0) == 207001
            q = malloc(424 << 10, align32=True)             # exactly what is left
            assert meminfo()[0] == 0
            assert code("aclrtMallocAlign32", C.byref(p), 32, 0) == 207001
            free(q)
            ok("aclrtSetDevice", 1)
            assert meminfo() == (1 << 20, 1 << 20)          # other devices are untouched
        """, ASCEND_SIM_HBM="1MiB")
    finally:
        a.communicate("go\n", timeout=10)
    assert a.returncode == 0
    sim_node.run("""
        init()
        assert meminfo() == (1 << 20, 1 << 20)              # A exited: its bytes are back
    """, ASCEND_SIM_HBM="1MiB")


def test_a_killed_process_bytes_return(sim_node):
    a = start_holder(sim_node, 700 << 10, ASCEND_SIM_HBM="1MiB")
    sim_node.run("""
        init()
        assert used() == 700 << 10
    """, ASCEND_SIM_HBM="1MiB")
    a.send_signal(signal.SIGKILL)   # not reaped yet: a zombie holds no memory either
    try:
        sim_node.run("""
            init()
            deadline = time.monotonic() + 30  # generous: a loaded machine
            while used() and time.monotonic() < deadline:   # the kill lands asynchronously
                time.sleep(0.01)
            assert meminfo() == (1 << 20, 1 << 20)
            free(malloc(1 << 20, align32=True))              # the whole device is usable again
        """, ASCEND_SIM_HBM="1MiB")
    finally:
        a.wait(10)
        a.stdin.close(); a.stdout.close(); a.stderr.close()


def test_a_process_whose_main_thread_exited_still_holds_its_bytes(sim_node):
    # Its leader shows as a zombie ('Z') while its other threads run on: the simulator counted
    # its 700 KiB free and granted the whole 1 MiB device to another process.
    a = sim_node.spawn("""
        init()
        p = malloc(700 << 10, align32=True)
        threading.Thread(target=time.sleep, args=(60,)).start()
        print("ready", flush=True)
        C.CDLL(None).pthread_exit(None)
    """, ASCEND_SIM_HBM="1MiB")
    try:
        assert a.stdout.readline().strip() == "ready", a.stderr.read()
        deadline = time.monotonic() + 30  # generous: a loaded machine
        while open(f"/proc/{a.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.005)
        sim_node.run("""
            init()
            assert used() == 700 << 10, used()
        """, ASCEND_SIM_HBM="1MiB")
    finally:
        a.kill()
        a.wait(10)
        a.stdin.close(); a.stdout.close(); a.stderr.close()


@pytest.mark.parametrize("field, offset, held_after", [("lease", 8, 0), ("start time", 24, 300 << 10)])
def test_a_slot_whose_owner_is_gone_is_reclaimed(sim_node, field, offset, held_after):
    """A slot names its process by lease (never by pid alone): a lease nobody holds is a dead
    process. A start time other than the one the owner wrote is not: the kernel shifts it by the
    reader's time namespace (a CRIU-restored container), and a pid cannot be reused while its
    lease is held (before 2026-12-03 it was taken for a reused pid: a live owner's bytes given
    away)."""
    a = start_holder(sim_node, 300 << 10, ASCEND_SIM_HBM="1MiB")
    try:
        path = sim_node.record_path(0)
        with open(path, "r+b") as f:
            data = bytearray(f.read())
            base = len(data) - SLOTS * SLOT_SIZE
            for i in range(SLOTS):
                off = base + i * SLOT_SIZE
                pid, _, lease, pidns, start, nbytes = struct.unpack_from("<iIQQQQ", data, off)
                if pid == a.pid:
                    assert nbytes == 300 << 10 and lease and pidns == os.stat("/proc/self/ns/pid").st_ino
                    struct.pack_into("<Q", data, off + offset, struct.unpack_from("<Q", data, off + offset)[0] + 12345)
                    break
            else:
                pytest.fail("the holder's slot is not in the record")
            f.seek(0)
            f.write(data)
        sim_node.run(f"""
            init()
            assert used() == {held_after}, used()
        """, ASCEND_SIM_HBM="1MiB")
    finally:
        a.kill()
        a.communicate(timeout=10)


def test_processes_racing_for_a_device_never_exceed_it(sim_node):
    worker = """
        init()
        print("ready", flush=True)
        sys.stdin.readline()                       # start together
        held, ok_n, fail_n, over = [], 0, 0, 0
        for i in range(1500):
            if len(held) < 6 and i % 7 != 6:
                p = C.c_void_p()
                rc = code("aclrtMallocAlign32", C.byref(p), 64 << 10, 0)
                if rc == 0:
                    held.append(p.value); ok_n += 1
                else:
                    assert rc == 207001, rc
                    fail_n += 1
                st = sim.stats(0)
                if st["node_bytes_used"] > st["total_bytes"]:
                    over += 1
            else:
                while held:
                    free(held.pop())
        for p in held: free(p)
        print(json.dumps([ok_n, fail_n, over]))
    """
    procs = [sim_node.spawn(worker, ASCEND_SIM_HBM="1MiB") for _ in range(4)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(over == 0 for _, _, over in results), results
    assert sum(s for s, _, _ in results) > 0
    assert sum(f for _, f, _ in results) > 0, "no contention: the test proves nothing"
    sim_node.run("""
        init()
        assert used() == 0
    """, ASCEND_SIM_HBM="1MiB")


def refused(node, expect_code, *needles, **env):
    node.run(f"""
        rc = code("aclInit", None)
        msg = errmsg()
        assert rc == {expect_code}, (rc, msg)
        for needle in {list(needles)!r}:
            assert needle in msg, (needle, msg)
        print(msg)
    """, **env)


def test_malformed_or_unsafe_records_are_refused_with_a_clear_message(sim_node):
    path = sim_node.record_path(0)
    sim_node.run("init()")                      # a valid record...
    size = os.path.getsize(path)
    good = open(path, "rb").read()

    os.chmod(path, 0o664)                       # ...others may write it: refused
    refused(sim_node, 207006, path, "permissions 664")
    os.chmod(path, 0o644)

    refused(sim_node, 100003, path, "ASCEND_SIM_HBM", ASCEND_SIM_HBM="2GiB")  # other HBM

    with open(path, "wb") as f:                 # right size, garbage inside
        f.write(os.urandom(size))
    refused(sim_node, 100003, path, "malformed")

    with open(path, "wb") as f:                 # truncated
        f.write(good[:100])
    refused(sim_node, 100003, path, f"expected {size}")

    with open(path, "wb") as f:                 # valid header, impossible slot contents
        f.write(good[:-8] + struct.pack("<Q", 1 << 62))
    refused(sim_node, 100003, path, "impossible")

    # A name held by something that is not a regular file of this user is skipped, never used.
    os.unlink(path)
    second = path + ".1"
    os.symlink("/dev/null", path)               # a symbolic link planted at the name
    sim_node.run("init(); free(malloc(64))")
    assert os.path.islink(path) and os.stat(second).st_size == size
    os.unlink(path)
    os.unlink(second)

    os.mkdir(path)
    sim_node.run("init(); free(malloc(64))")
    assert os.path.isdir(path) and os.stat(second).st_size == size
    os.rmdir(path)
    os.unlink(second)

    sim_node.run("""
        init()                                  # with the bad file gone, a fresh one is made
        free(malloc(64))
    """)
    st = os.stat(path)
    assert st.st_mode & 0o777 == 0o644 and st.st_uid == os.geteuid()


def test_records_live_in_dev_shm_by_default_named_by_uid_and_node(sim_node):
    paths = [f"/dev/shm/ascendsim-{os.geteuid()}-{sim_node.name}-dev{d}" for d in (0, 1)]
    try:
        sim_node.run("""
            init()
            free(malloc(64))
        """, ASCEND_SIM_SHM_DIR=None)
        for p in paths:
            st = os.stat(p)
            assert st.st_mode & 0o777 == 0o644   # its owner writes it, every user of the node reads it
        assert not os.path.exists(sim_node.record_path(0))   # not in the test's directory
    finally:
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)


def test_a_forked_child_starts_without_a_runtime_and_gets_its_own_share(sim_node):
    sim_node.run("""
        init()
        p = malloc(100 << 10, align32=True)
        sim.launch_fill(None, p, 16, 0x42)
        ok("aclrtSynchronizeStream", None)
        pid = os.fork()
        if pid == 0:
            rc = 1
            try:
                assert code("aclrtMalloc", C.byref(C.c_void_p()), 64, 0) == 100001
                init()                                   # a fresh runtime, its own node slot
                assert used() == 100 << 10               # the parent's bytes, seen node-wide
                q = malloc(200 << 10, align32=True)
                assert sim.stats(0)["bytes_held"] == 200 << 10
                rc = 0
            finally:
                os._exit(rc)                             # exits holding q: reclaimed as dead
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert used() == 100 << 10                       # the child's share came back
        assert sim.read(p, 16) == b"\\x42" * 16           # the parent's runtime is intact
        assert sim.stats(0)["bytes_held"] == 100 << 10
        free(p)
    """)


def _in_pid_namespace(node, code):
    """Starts PRELUDE + code as pid 1 of a pid namespace of its own (as a container's first
    process), on the node; stdin/stdout piped."""
    import subprocess
    import textwrap
    return subprocess.Popen(NS + [sys.executable, "-c", PRELUDE + textwrap.dedent(code)], env=node.env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@needs_unshare
def test_the_record_lock_names_its_holder_by_lease_across_pid_namespaces(sim_node):
    """A record's lock names its holder by lease id, not by thread id: containers' first processes
    are all pid 1, and with a robust pthread mutex a waiter of pid 1 killed in one namespace made
    the kernel declare the live pid-1 holder of another namespace dead, so a third process entered
    the critical section beside it (and a helper's fuzzing once saw a SIGSEGV). Here: the lock is
    made to name a live holder that is pid 1 of its own namespace; a waiter that is pid 1 of
    another namespace is killed while it waits; a process attaching to the device must still wait,
    until the holder lets go. A lock naming a lease nobody holds (a holder that died inside) is
    taken over and counted in the record's recoveries."""
    holder = _in_pid_namespace(sim_node, HOLDER.format(n=1 << 20))
    attach = None
    try:
        assert holder.stdout.readline().strip() == "ready", holder.stderr.read()
        path = sim_node.record_path(0)

        def record():
            with open(path, "rb") as f:
                data = f.read()
            base = len(data) - SLOTS * SLOT_SIZE  # the lock word and the recoveries counter precede the slots
            slots = [struct.unpack_from("<iIQQQQ", data, base + i * SLOT_SIZE) for i in range(SLOTS)]
            return base, struct.unpack_from("<QQ", data, base - 16), slots

        def set_lock_owner(lease):
            with open(path, "r+b") as f:
                f.seek(record()[0] - 16)
                f.write(struct.pack("<Q", lease))

        base, (owner, recoveries), slots = record()
        lease = next(s[2] for s in slots if s[0] == 1)  # the holder: pid 1 of its namespace
        assert owner == 0
        set_lock_owner(lease)
        waiter = _in_pid_namespace(sim_node, "init()\nprint('attached', flush=True)")
        time.sleep(0.5)                       # waiting for the lock (pid 1 of another namespace)
        waiter.kill()                         # unshare --kill-child takes its pid 1 with it
        waiter.communicate(timeout=10)
        attach = sim_node.spawn("init()\nprint('attached', flush=True)\nsys.stdin.readline()")
        time.sleep(1.0)
        assert attach.poll() is None and record()[1][0] == lease, "entered while a live holder held the lock"
        set_lock_owner(0)                     # the holder lets go
        assert attach.stdout.readline().strip() == "attached", attach.stderr.read()
        attach.stdin.write("\n")
        attach.stdin.flush()
        attach.communicate(timeout=10)
        set_lock_owner(lease + 12345)         # a holder that died inside: its lease is held by nobody
        t0 = time.monotonic()
        sim_node.run("init()\nassert used() == 1 << 20")
        # taken over at once, not after the lock's 10 s timeout (NODE_LOCK_TIMEOUT_S): the child's
        # start is the rest, which a loaded machine can make seconds
        assert time.monotonic() - t0 < 8
        assert record()[1] == (0, recoveries + 1)
    finally:
        for p in (holder, attach):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate(timeout=10)


def test_a_record_an_older_simulator_left_is_replaced_once_nobody_uses_it(sim_node):
    """Records outlive processes (/dev/shm until a reboot): after an upgrade that changed their
    layout, the user's node must not stay refused until someone removes files by hand. A record
    of an earlier version is replaced when none of its slots belongs to a live process, and still
    refused (naming the file) while one does."""
    a = start_holder(sim_node, 1 << 20)
    try:
        path = sim_node.record_path(0)
        with open(path, "r+b") as f:  # as an earlier version wrote it (the slots keep their layout)
            f.seek(8)
            f.write(struct.pack("<I", 2))
        out = sim_node.run("""
            print(code("aclInit", None), errmsg())
        """)
        assert out.startswith("100003") and "unsupported version" in out and path in out, out
    finally:
        a.kill()
        a.communicate(timeout=10)
    sim_node.run("""
        init()
        assert used() == 0               # the dead holder's bytes went with the old record
        p = malloc(4096)
        assert used() > 0
    """)
    with open(path, "rb") as f:
        assert struct.unpack_from("<I", f.read(12), 8)[0] >= 3


def test_visible_devices_renumber_a_processs_devices_and_share_the_nodes(sim_node):
    # A container given the node's NPU 1 (ASCEND_RT_VISIBLE_DEVICES=1, the runtime's own
    # variable) sees one device, its device 0, and allocates from NPU 1's capacity, which every
    # process of the node shares; aclrtGetPhyDevIdByLogicDevId names the NPU behind it.
    a = start_holder(sim_node, 600 << 10, ASCEND_SIM_HBM="1MiB", ASCEND_RT_VISIBLE_DEVICES="1")
    try:
        out = sim_node.run_json("""
            init(1)
            on_npu1 = used()
            ok("aclrtSetDevice", 0)
            print(json.dumps({"npu1": on_npu1, "npu0": used()}))
        """, ASCEND_SIM_HBM="1MiB")
        assert out == {"npu1": 600 << 10, "npu0": 0}
        out = sim_node.run_json("""
            init()
            n, phys, back = C.c_uint32(), C.c_int32(-1), C.c_int32(-1)
            ok("aclrtGetDeviceCount", C.byref(n))
            ok("aclrtGetPhyDevIdByLogicDevId", 1, C.byref(phys))
            ok("aclrtGetLogicDevIdByPhyDevId", 0, C.byref(back))
            print(json.dumps({"count": n.value, "phys": phys.value, "back": back.value,
                              "hidden": code("aclrtGetLogicDevIdByPhyDevId", 1, C.byref(back))}))
        """, ASCEND_SIM_HBM="1MiB", ASCEND_SIM_DEVICES="3", ASCEND_RT_VISIBLE_DEVICES="2,0")
        assert out == {"count": 2, "phys": 0, "back": 1, "hidden": 107001}
        bad = sim_node.run_json("""
            print(json.dumps({"rc": lib.aclInit(None), "msg": errmsg()}))
        """, ASCEND_SIM_HBM="1MiB", ASCEND_RT_VISIBLE_DEVICES="0,7")
        assert bad["rc"] == 100000 and "ASCEND_RT_VISIBLE_DEVICES='0,7'" in bad["msg"], bad
    finally:
        a.stdin.close()
        a.wait(10)
        a.stdout.close(); a.stderr.close()


def test_a_process_initialised_again_keeps_its_device_memory_when_a_cleanup_removed_its_leases(sim_node):
    """aclInit, aclFinalize, aclInit: the second attach took its life lock (node.c) on a new
    descriptor of the same record while the first one's still held the same byte, which an
    open-file lock of another descriptor refuses even within a process, then closed the first:
    no life lock at all. Once a cleanup removed its lease files, another process was granted the
    live process's 600 MiB of the 1 GiB device."""
    holder = sim_node.spawn("""
        init()
        ok("aclFinalize")
        init()
        p = malloc(600 << 20, align32=True)
        print("ready", flush=True)
        sys.stdin.readline()
    """)
    try:
        assert holder.stdout.readline().strip() == "ready", holder.stderr.read()
        leases = [n for n in os.listdir(sim_node.shm_dir) if n.startswith(("ascendsim-lease-", "ascendsim-alive-"))]
        assert len(leases) == 2, leases
        for n in leases:
            os.unlink(os.path.join(sim_node.shm_dir, n))
        out = sim_node.run("""
            init()
            p = C.c_void_p()
            print(code("aclrtMallocAlign32", C.byref(p), 600 << 20, 0))
        """)
        assert out.split()[-1] == "207001", "another process was granted the live holder's memory"
    finally:
        holder.stdin.close()
        holder.wait(10)
        holder.stdout.close(); holder.stderr.close()

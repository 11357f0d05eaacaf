"""A simulated node shared by two users, as a real one is (cython/sim/node.c, foreign.c): a user
squatting the names of another's node records cannot stop it from using the devices, device
capacity is accounted across users (each sees and is bounded by the other's allocations, a dead
process's bytes stop counting), and another user's record can never crash, hang or be trusted
beyond what that user could claim by allocating. Runs a second uid through runuser (root only)."""
import os
import signal
import struct
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from other_user import OTHER, two_users  # noqa: E402,F401  (pytest fixture)
from sim_fixtures import NS, needs_unshare  # noqa: E402

MiB = 1 << 20
SLOTS, SLOT_SIZE = 256, 40  # node.c: struct node_slot {int32 pid; u32; u64 lease; u64 pidns; u64 start; u64 bytes}

HOLD = """
init()
p = malloc({n}, align32=True)
print("holding", flush=True)
sys.stdin.readline()
"""


def used_by(node, user):
    """Device 0's bytes in use, as a fresh process of `user` sees them (aclrtGetMemInfo)."""
    return int(node.run(user, "init(); f, t = meminfo(); print(t - f)").split()[-1])


def test_names_another_user_squats_are_skipped_and_the_owner_still_finds_its_record(two_users):
    node, uid = two_users, os.geteuid()
    base = os.path.join(node.shm, f"ascendsim-{uid}-{node.name}-dev")
    node.run(OTHER, f"""
        import os
        for d in (0, 1):                       # every name root's processes would take first
            open("{base}%d" % d, "w").close()
            os.symlink("/etc/passwd", "{base}%d.1" % d)
            os.mkdir("{base}%d.2" % d)
    """, prelude=False)
    holder, _, line = node.spawn(None, HOLD.format(n=300 * MiB))
    assert line == "holding"
    assert os.stat(base + "0.3").st_uid == uid            # the first name nobody had taken
    assert used_by(node, None) == 300 * MiB                 # a second process finds the same record
    node.run(OTHER, f"""
        import os, shutil
        for d in (0, 1):                       # the squatter gives the names back...
            os.unlink("{base}%d" % d); os.unlink("{base}%d.1" % d); os.rmdir("{base}%d.2" % d)
    """, prelude=False)
    assert used_by(node, None) == 300 * MiB                 # ...later processes still find it
    assert not os.path.exists(base + "0")
    holder.communicate("go\n", timeout=30)
    assert holder.returncode == 0


def test_two_users_share_the_device_capacity(two_users):
    node = two_users
    root_holder, _, line = node.spawn(None, HOLD.format(n=600 * MiB))
    assert line == "holding"
    out = node.run(OTHER, """
        init()
        f, t = meminfo()
        assert t - f == 600 << 20, (f, t)                  # root's allocation, seen by nobody
        p = C.c_void_p()
        rc = code("aclrtMallocAlign32", C.byref(p), 500 << 20, 0)
        assert rc == 207001, rc                            # 600 + 500 MiB > 1 GiB, whoever holds it
        assert "all processes of every user" in errmsg(), errmsg()
        q = malloc(424 << 20, align32=True)                # exactly what is left
        assert meminfo()[0] == 0
        free(q)
        print("ok")
    """)
    assert out.split()[-1] == "ok"
    other_holder, other_pid, line = node.spawn(OTHER, HOLD.format(n=400 * MiB))
    assert line == "holding"
    assert used_by(node, None) == 1000 * MiB                # and root sees nobody's
    node.run(None, """
        init()
        p = C.c_void_p()
        assert code("aclrtMallocAlign32", C.byref(p), 100 << 20, 0) == 207001
    """)
    os.kill(other_pid, signal.SIGKILL)                      # a dead process's bytes stop counting
    other_holder.wait(timeout=10)
    deadline = time.monotonic() + 10
    while used_by(node, None) != 600 * MiB:
        assert time.monotonic() < deadline, "a killed user's bytes still count"
        time.sleep(0.1)
    node.run(None, "init(); malloc(400 << 20, align32=True)")
    root_holder.communicate("go\n", timeout=30)


HOLD_EXPANDABLE = """
import ascend_pool as ap
pool = ap.Pool(0, expandable_segments=True)
p = pool.malloc(600 << 20)
print("holding", pool.memory_stats()["reserved_bytes.all.current"], flush=True)
sys.stdin.readline()
"""


def test_expandable_pools_of_two_users_share_the_device_capacity(two_users):
    """Expandable segments take physical memory chunk by chunk (aclrtMallocPhysical): each chunk
    counts against the node's capacity across users like an aclrtMalloc, a growth the device
    refuses halfway is rolled back whole, and a killed user's chunks stop counting."""
    node = two_users
    holder, holder_pid, line = node.spawn(None, HOLD_EXPANDABLE)
    assert line == f"holding {602 * MiB}"                   # 600 MiB + padding, in 2 MiB pages
    out = node.run(OTHER, """
        import ascend_pool as ap
        from ascend_pool.errors import OutOfMemoryError
        pool = ap.Pool(0, expandable_segments=True)
        try:
            pool.malloc(500 << 20)                         # 602 + 502 MiB > 1 GiB
            raise SystemExit("granted past the node's capacity")
        except OutOfMemoryError as e:
            assert "aclrtMallocPhysical" in str(e) and "every user" in str(e), str(e)
        st = pool.memory_stats()
        assert st["reserved_bytes.all.current"] == 0 and st["num_ooms"] == 1, st  # chunks mapped before the refusal went back
        assert meminfo()[1] - meminfo()[0] == 602 << 20    # only root's bytes in use
        q = pool.malloc(400 << 20)                         # what is left still serves
        pool.free(q)
        pool.close()
        print("ok")
    """)
    assert out.split()[-1] == "ok"
    assert used_by(node, None) == 602 * MiB
    os.kill(holder_pid, signal.SIGKILL)
    holder.wait(timeout=10)
    deadline = time.monotonic() + 10
    while used_by(node, None) != 0:
        assert time.monotonic() < deadline, "a killed process's chunks still count"
        time.sleep(0.1)
    out = node.run(OTHER, """
        import ascend_pool as ap
        pool = ap.Pool(0, expandable_segments=True)
        pool.malloc(900 << 20)
        pool.close()
        print("ok")
    """)
    assert out.split()[-1] == "ok"


def _plant(path, uid, claim, lease=0x1234, mode=0o644, good=None):
    """Writes a record of device 0 claiming `claim` bytes in slot 0 under lease id `lease`, owned by uid."""
    data = bytearray(good)
    off = len(data) - SLOTS * SLOT_SIZE
    struct.pack_into("<IIQQQQ", data, off, 4242, 1, lease, 0, 0, claim)
    struct.pack_into("<I", data, 16, uid)                   # owner_uid
    with open(path, "wb") as f:
        f.write(data)
    os.chown(path, uid, uid)
    os.chmod(path, mode)


def _live_lease(shm, uid, lease):
    """A public lease of uid's process `lease`, held (LOCK_EX) by this test process."""
    import fcntl

    path = os.path.join(shm, f"ascendsim-alive-{uid}-{lease:016x}")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    os.fchown(fd, uid, uid)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_another_users_record_is_read_with_suspicion(two_users):
    import pwd

    node, other = two_users, pwd.getpwnam(OTHER).pw_uid
    node.run(OTHER, "init()")                               # nobody's genuine records
    theirs = os.path.join(node.shm, f"ascendsim-{other}-{node.name}-dev0")
    good = open(theirs, "rb").read()
    # The whole device claimed under a lease nobody holds: skipped before any refusal.
    _plant(theirs, other, 1 << 30, lease=0x1234, good=good)
    assert used_by(node, None) == 0
    node.run(None, "init(); malloc(900 << 20, align32=True)")
    # A live process's claim counts, as its allocation would...
    live = 0xA11CE
    fd = _live_lease(node.shm, other, live)
    _plant(theirs, other, 512 * MiB, lease=live, good=good)
    assert used_by(node, None) == 512 * MiB
    # ...but not from files that are not nobody's own, are writable by others, or are named for another uid,
    for path, uid, mode in ((theirs, other, 0o666), (theirs, 0, 0o644),
                            (os.path.join(node.shm, f"ascendsim-4242-{node.name}-dev0"), other, 0o644)):
        _plant(path, uid, 512 * MiB, lease=live, mode=mode, good=good)
        assert used_by(node, None) == 0, (path, uid, oct(mode))
        if "4242" in path:
            os.unlink(path)
    # ...nor under a lease file of another owner.
    _plant(theirs, other, 512 * MiB, lease=live, good=good)
    os.fchown(fd, 0, 0)
    assert used_by(node, None) == 0
    os.fchown(fd, other, other)
    assert used_by(node, None) == 512 * MiB
    # A record truncated (or grown) under a process that reads it: counts 0, never a SIGBUS.
    out = node.run(None, f"""
        init()
        p = malloc(1 << 20)
        os.truncate({theirs!r}, 100)
        q = malloc(600 << 20, align32=True)
        os.truncate({theirs!r}, {len(good) * 2})
        r = malloc(1 << 20)
        print(meminfo()[1] - meminfo()[0])
    """)
    assert int(out.split()[-1]) > 600 * MiB
    # Impossible values: every slot claiming 2**63 bytes clamps to the device, never wraps to free.
    data = bytearray(good)
    struct.pack_into("<I", data, 16, other)
    off = len(data) - SLOTS * SLOT_SIZE
    for i in range(SLOTS):
        struct.pack_into("<IIQQQQ", data, off + i * SLOT_SIZE, 4242, 1, live, 0, 0, 1 << 63)
    with open(theirs, "wb") as f:
        f.write(data)
    os.chown(theirs, other, other)
    node.run(None, """
        init()
        assert meminfo()[0] == 0               # full, as a live user holding it all would make it
        p = C.c_void_p()
        assert code("aclrtMallocAlign32", C.byref(p), 4096, 0) == 207001
    """)
    os.close(fd)                               # that process "dies": the device is free again
    node.run(None, "init(); assert meminfo()[0] == meminfo()[1]")


@needs_unshare
def test_another_user_cannot_keep_a_dead_process_alive_by_squatting_its_lease(two_users):
    """A process proves it lives by a lock on its private lease file in the shared 1777
    directory. Once a dead process's lease file is gone, another user may create that name and
    lock it: a lease counts only when it is this user's own file, so the dead process's bytes
    are still reclaimed (before: pinned for as long as the squatter held the lock, device
    memory lost to every later process of its user in another pid namespace)."""
    import subprocess
    from other_user import PRELUDE
    node, uid = two_users, os.geteuid()
    holder = subprocess.Popen(NS + [sys.executable, "-c", PRELUDE + HOLD.format(n=300 * MiB)], env=node.env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=node.root)
    assert holder.stdout.readline().strip() == "holding", holder.stderr.read()
    with open(os.path.join(node.shm, f"ascendsim-{uid}-{node.name}-dev0"), "rb") as f:
        data = f.read()
    base = len(data) - SLOTS * SLOT_SIZE
    lease = next(struct.unpack_from("<iIQ", data, base + i * SLOT_SIZE)[2] for i in range(SLOTS)
                 if struct.unpack_from("<i", data, base + i * SLOT_SIZE)[0] == 1)  # pid 1 of its namespace
    holder.kill()
    holder.communicate(timeout=10)
    name = os.path.join(node.shm, f"ascendsim-lease-{uid}-{lease:016x}")
    os.unlink(name)  # as a liveness check that found it dead does
    squatter, _, line = node.spawn(OTHER, f"""
        import fcntl
        fd = os.open("{name}", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("squatting", flush=True)
        sys.stdin.readline()
    """)
    assert line == "squatting" and os.stat(name).st_uid != uid
    assert used_by(node, None) == 0, "the dead holder's bytes are pinned by another user's file"
    squatter.communicate("go\n", timeout=30)


CLEANED_HOLDER = """
init()
p = malloc(600 << 20, align32=True)
if os.fork() == 0:             # a forked child (a data loader) must not keep a killed holder alive
    time.sleep(600)
    os._exit(0)
print("holding", flush=True)
sys.stdin.readline()
os.kill(os.getpid(), 9)
"""
# pid 1 of the holder's namespace, which outlives it: the namespace (and the forked child) lives on
STAY = "import subprocess, sys, time; subprocess.call(sys.argv[1:]); time.sleep(600)"


@needs_unshare
def test_a_process_whose_lease_files_a_cleanup_removed_keeps_its_device_memory(two_users):
    """A cleanup of /dev/shm removed the lease files of a live process holding 600 MiB of a 1 GiB
    device (in a pid namespace of its own): its user's next process reclaimed its slot and was
    given the same 600 MiB, another user's skipped it. Its life lock on its node record
    (proc.c: sim_proc_life_hold) says it lives; once it is killed (its forked child alive), its
    bytes come back."""
    import subprocess
    from other_user import PRELUDE
    node, uid = two_users, os.geteuid()
    holder = subprocess.Popen(NS + [sys.executable, "-c", STAY, sys.executable, "-c", PRELUDE + CLEANED_HOLDER],
                              env=node.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=node.root)
    node.procs.append((holder, None))
    assert holder.stdout.readline().strip() == "holding", holder.stderr.read()
    leases = [n for n in os.listdir(node.shm) if n.startswith((f"ascendsim-lease-{uid}-", f"ascendsim-alive-{uid}-"))]
    assert len(leases) == 2, leases
    for n in leases:
        os.unlink(os.path.join(node.shm, n))
    refused = """
        init()
        p = C.c_void_p()
        assert code("aclrtMallocAlign32", C.byref(p), 600 << 20, 0) == 207001
        print("refused")
    """
    assert node.run(None, refused).split()[-1] == "refused"    # its user's: was granted
    assert node.run(OTHER, refused).split()[-1] == "refused"   # another user's: was granted
    assert used_by(node, None) == used_by(node, OTHER) == 600 * MiB
    holder.stdin.write("die\n")
    holder.stdin.flush()
    deadline = time.monotonic() + 10
    while used_by(node, None) != 0 or used_by(node, OTHER) != 0:
        assert time.monotonic() < deadline, "a killed holder's bytes still count (its forked child holds its lock?)"
        time.sleep(0.1)
    assert holder.poll() is None  # the namespace, and the child with it, still lives

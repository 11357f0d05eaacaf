"""A full /dev/shm (a small tmpfs filled to the last byte, in a mount namespace of the child's
own): files that ascend_pool maps (the stats file, the quota ledger, the simulator's node
record) were sized with ftruncate, which reserves no page, then written through the mapping: the
kernel could not give the page and killed the process with SIGBUS, at start or later, when
another user filled /dev/shm. Every page is taken when the file is made now: a full directory is
an error the caller sees (a warning for the stats, a typed error otherwise), never a crash.

Needs root for `unshare -m` and mount, as CI has; the skip reason says what is missing elsewhere.
"""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401


def _can_mount():
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    r = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                       capture_output=True, text=True)
    return None if r.returncode == 0 else f"cannot mount a tmpfs in a mount namespace here: {r.stderr.strip()}"


MOUNT_MISSING = _can_mount()
pytestmark = pytest.mark.skipif(MOUNT_MISSING is not None, reason=str(MOUNT_MISSING))


def run_with_full_dir(sim_node, tmp_path, code, *variables):
    """Runs code in a child whose directories named by `variables` are one 64 KiB tmpfs, full.
    Returns (returncode, stdout, stderr); a SIGBUS is returncode -7 (or 135 through sh)."""
    full = tmp_path / "full"
    full.mkdir()
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(code))
    dirs = {"ASCEND_POOL_STATS_DIR": tmp_path, "ASCEND_POOL_LEDGER_DIR": tmp_path}
    dirs.update({v: full for v in variables})
    env = sim_node.env(ASCEND_POOL_BACKEND="sim", ASCEND_POOL_STATS_INTERVAL="0.1", **dirs)
    sh = (f"mount -t tmpfs -o size=64k,mode=1777 tmpfs {full} && "
          f"(dd if=/dev/zero of={full}/fill bs=4k count=100 2>/dev/null; true) && "
          f"cd / && exec {sys.executable} {script}")
    r = subprocess.run(["unshare", "-m", "sh", "-c", sh], env=env, capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout, r.stderr


def test_a_full_stats_directory_leaves_the_pool_working_with_a_warning(sim_node, tmp_path):
    rc, out, err = run_with_full_dir(sim_node, tmp_path, """
        import logging, time
        logging.basicConfig(level=logging.WARNING)
        import ascend_pool as ap
        p = ap.Pool(0)
        x = p.malloc(1 << 20)
        time.sleep(0.5)                       # the publisher thread makes its file meanwhile
        p.free(x)
        p.close()
        print("POOL-OK", flush=True)
    """, "ASCEND_POOL_STATS_DIR")
    assert rc == 0 and "POOL-OK" in out, (rc, err[-500:])
    assert "stats not published" in err and "No space left on device" in err, err[-500:]


def test_stats_keep_publishing_safely_after_another_user_fills_the_directory(sim_node, tmp_path):
    # The file was made while there was room; pages of records written later were not taken
    # yet: more than 16 (device, tenant) pairs reached one, and the publisher thread's write
    # killed the process.
    rc, out, err = run_with_full_dir(sim_node, tmp_path, """
        import os, time
        full = os.environ["ASCEND_POOL_STATS_DIR"]
        os.unlink(os.path.join(full, "fill"))   # room at start
        import ascend_pool as ap
        p = ap.Pool(0)
        time.sleep(0.4)                          # the stats file is made
        fd = os.open(os.path.join(full, "someone-elses"), os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, bytes(4096)):
                pass
        except OSError:
            pass                                 # full again
        os.close(fd)
        ctxs = [p.context(f"t{i}") for i in range(20)]
        ptrs = [c.malloc(1 << 20) for c in ctxs]
        time.sleep(0.6)                          # several publishes
        for c, x in zip(ctxs, ptrs):
            c.free(x)
            c.close()
        p.close()
        print("ALIVE", flush=True)
    """, "ASCEND_POOL_STATS_DIR")
    assert rc == 0 and "ALIVE" in out, (rc, err[-500:])


def test_a_full_ledger_directory_is_a_typed_error_for_a_quota_context(sim_node, tmp_path):
    rc, out, err = run_with_full_dir(sim_node, tmp_path, """
        import ascend_pool as ap
        p = ap.Pool(0)
        try:
            p.context("online", quota="64MiB")
            print("OPENED", flush=True)
        except ap.errors.LedgerError as e:
            print("LEDGER-ERROR", e, flush=True)
        x = p.malloc(1 << 20)                   # the pool itself keeps serving
        p.free(x)
        p.close()
    """, "ASCEND_POOL_LEDGER_DIR")
    assert rc == 0 and "LEDGER-ERROR" in out and "No space left on device" in out, (rc, out, err[-500:])


def test_a_full_simulator_directory_is_a_typed_error_at_start(sim_node, tmp_path):
    rc, out, err = run_with_full_dir(sim_node, tmp_path, """
        import ascend_pool as ap
        try:
            ap.Pool(0)
            print("OPENED", flush=True)
        except ap.errors.BackendUnavailableError as e:
            print("BACKEND-ERROR", e, flush=True)
    """, "ASCEND_SIM_SHM_DIR")
    assert rc == 0 and "BACKEND-ERROR" in out and "No space left on device" in out, (rc, out, err[-500:])


def run_with_small_dir(sim_node, tmp_path, code, size):
    """Runs code in a child whose ASCEND_SIM_SHM_DIR is a tmpfs of `size` (mount's size=), empty:
    room for the simulator's records, not for what the code shares. (returncode, stdout, stderr)."""
    small = tmp_path / "small"
    small.mkdir()
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(code))
    env = sim_node.env(ASCEND_POOL_BACKEND="sim", ASCEND_POOL_STATS="0", ASCEND_POOL_STATS_DIR=tmp_path,
                       ASCEND_POOL_LEDGER_DIR=tmp_path, ASCEND_SIM_SHM_DIR=small)
    sh = f"mount -t tmpfs -o size={size},mode=1777 tmpfs {small} && cd / && exec {sys.executable} {script}"
    r = subprocess.run(["unshare", "-m", "sh", "-c", sh], env=env, capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout, r.stderr


def test_sharing_a_block_larger_than_the_simulators_directory_is_a_typed_error(sim_node, tmp_path):
    # The export file was sized with ftruncate and only its header's pages taken; the data stayed
    # sparse and was mapped over the block: a Docker container's 64 MiB /dev/shm and a larger
    # model's weights (share, then load, as docs/sharing.md says) killed the process with SIGBUS
    # at the first write. Every page is taken at export now, or the export is refused.
    rc, out, err = run_with_small_dir(sim_node, tmp_path, """
        import os
        import ascend_pool as ap
        from ascend_pool import sim
        MiB = 1 << 20
        shm = os.environ["ASCEND_SIM_SHM_DIR"]
        pool = ap.Pool(0)
        ptr = pool.share_malloc(16 * MiB)         # the directory holds 8 MiB
        sim.launch_fill(None, ptr, MiB, 0x3C)     # its first MiB written; the rest untouched
        pool.synchronize()
        before = sorted(os.listdir(shm))
        try:
            pool.share(ptr, any_process=True)
            print("SHARED", flush=True)
        except ap.errors.DeviceError as e:
            print("REFUSED", e.code, e, flush=True)
        print("LEFT", sorted(set(os.listdir(shm)) - set(before)), flush=True)
        print("INTACT", sim.read(ptr, 2 * MiB) == bytes([0x3C]) * MiB + bytes(MiB), flush=True)
        sim.launch_fill(None, ptr, 16 * MiB, 0x5A)  # the block is still the caller's, and works
        pool.synchronize()
        print("WRITABLE", sim.read(ptr + 8 * MiB, 4096) == bytes([0x5A]) * 4096, flush=True)
        pool.share_free(ptr)
        x = pool.share_malloc(2 * MiB)            # a block that fits is still shared
        h = pool.share(x, any_process=True)
        sim.launch_fill(None, x, 2 * MiB, 0x11)
        pool.synchronize()
        print("SMALL-SHARED", h.key, flush=True)
        pool.share_free(x)
    """, "8m")
    assert rc == 0, (rc, out, err[-800:])            # before: -7 (SIGBUS) after "SHARED"
    assert "REFUSED 207001" in out and "ASCEND_SIM_SHM_DIR" in out and "No space left on device" in out, (out, err[-800:])
    assert str(tmp_path / "small") in out, out
    assert "LEFT []" in out and "INTACT True" in out and "WRITABLE True" in out and "SMALL-SHARED" in out, (out, err[-800:])


def test_a_process_that_cannot_make_its_lease_takes_no_device_memory(sim_node, tmp_path):
    # A process proves it lives by its lease file in ASCEND_SIM_SHM_DIR. When the file could not be
    # made (the directory out of inodes: another user filled it with empty files), the process
    # still took a slot in the node record and allocated; the next process took it for dead (no
    # lease file), reclaimed its slot and was granted the same memory: 1.4 GiB handed out on a
    # 1 GiB device. Now its aclInit fails (BackendUnavailableError naming the lease file), and a
    # process started once there is room again works.
    small = tmp_path / "small"
    small.mkdir()
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(r'''
        import os, subprocess, sys
        shm = os.environ["ASCEND_SIM_SHM_DIR"]
        first = """if 1:
            import sys
            import ascend_pool as ap
            p = ap.Pool(0)
            print("up", flush=True)
            sys.stdin.readline()
            try:
                x = p.malloc(700 << 20); print("P1 granted", flush=True)
            except ap.OutOfMemoryError:
                print("P1 refused", flush=True)
            sys.stdin.readline()
        """
        later = """if 1:
            import sys
            import ascend_pool as ap
            try:
                p = ap.Pool(0)
            except ap.errors.BackendUnavailableError as e:
                print("REFUSED", e, flush=True); raise SystemExit(0)
            x = p.malloc(%d << 20)
            print("GRANTED", flush=True)
            sys.stdin.readline()                 # holds it while P1 allocates
        """
        p1 = subprocess.Popen([sys.executable, "-c", first], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p1.stdout.readline().strip() == "up"
        junk = []
        while True:                              # another user takes every inode left
            try:
                path = os.path.join(shm, f"junk{len(junk)}")
                open(path, "w").close()
                junk.append(path)
            except OSError:
                break
        p2 = subprocess.Popen([sys.executable, "-c", later % 700], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
        print("P2:", p2.stdout.readline().strip(), flush=True)
        p1.stdin.write("go\n"); p1.stdin.flush()
        print(p1.stdout.readline().strip(), flush=True)  # P2 still alive
        print("P2 stderr:", p2.communicate("x\n", timeout=60)[1].strip()[-300:], flush=True)
        for path in junk:
            os.unlink(path)
        r = subprocess.run([sys.executable, "-c", later % 100], capture_output=True, text=True, timeout=60)
        print("P3:", r.stdout.strip() or r.stderr.strip()[-300:], flush=True)
        p1.stdin.write("x\n"); p1.stdin.flush(); p1.wait()
        print("LEFT", sorted(n for n in os.listdir(shm) if ".tmp" in n), flush=True)
    '''))
    env = sim_node.env(ASCEND_POOL_BACKEND="sim", ASCEND_POOL_STATS="0", ASCEND_POOL_STATS_DIR=tmp_path,
                       ASCEND_POOL_LEDGER_DIR=tmp_path, ASCEND_SIM_SHM_DIR=small, ASCEND_SIM_DEVICES="1")
    sh = (f"mount -t tmpfs -o size=8m,nr_inodes=64,mode=1777 tmpfs {small} && "
          f"cd / && exec {sys.executable} {script}")
    r = subprocess.run(["unshare", "-m", "sh", "-c", sh], env=env, capture_output=True, text=True, timeout=180)
    out = r.stdout
    assert r.returncode == 0, (r.returncode, out, r.stderr[-800:])
    # before: "P2: GRANTED" then "P1 granted", both alive: 1.4 GiB out of a 1 GiB device
    assert "P2: REFUSED" in out and "207005" in out and "ascendsim-lease-" in out, out
    assert "No space left on device" in out and str(small) in out, out
    assert "P1 granted" in out, out                                   # P2 held nothing
    assert "P3: GRANTED" in out and "LEFT []" in out, out

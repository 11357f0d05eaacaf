"""Worker functions for tests/test_sharing.py that run in processes started by multiprocessing
(spawn or fork): importable by reference, so they live in a module rather than in the test."""
import os


def verify_pattern(handle, value, results):
    """Opens the shared block, checks every byte is `value` (reading the device memory through the
    simulator), reports (pid, ok, reserved bytes of its own pool, shared_imported_bytes)."""
    import ascend_pool as ap
    from ascend_pool import sim

    pool = ap.Pool(handle.device, backend="sim")
    try:
        with ap.open_shared(handle, pool=pool) as block:
            data = sim.read(block.ptr, block.size)
            st = pool.memory_stats()
            results.put((os.getpid(), data == bytes([value]) * block.size,
                         st["reserved_bytes.all.current"], st["shared_imported_bytes"]))
    except Exception as e:  # reported, not lost in the child's stderr
        results.put((os.getpid(), repr(e), None, None))
    finally:
        pool.close()


def open_and_report(handle, results):
    """Opens the shared block on this process's default pool; reports (pid, None) or
    (pid, "ExceptionClass: message") - e.g. what a forked worker is told."""
    import ascend_pool as ap

    try:
        with ap.open_shared(handle):
            results.put((os.getpid(), None))
    except Exception as e:
        results.put((os.getpid(), f"{type(e).__name__}: {e}"))

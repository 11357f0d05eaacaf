"""Counters read on one thread while another resets them (found with scripts/tsan.sh's stress
drivers; repros/ in the audit clone): a reader sees the counters before or after the reset, never
a mix, and never the pool's lifetime figures once they were reset."""
import threading
import time

import ascend_pool as ap


def test_memory_stats_never_shows_the_lifetime_counters_while_another_thread_resets_them():
    pool = ap.Pool(0, backend="sim")
    try:
        for _ in range(500):
            pool.free(pool.malloc(4096))
        pool.reset_accumulated_stats()
        stop = time.monotonic() + 0.5
        seen = []

        def resetter():
            while time.monotonic() < stop:
                pool.reset_accumulated_stats()

        def reader():
            while time.monotonic() < stop:
                v = pool.memory_stats()["allocation.all.allocated"]
                if v:
                    seen.append(v)

        threads = [threading.Thread(target=resetter), threading.Thread(target=resetter),
                   threading.Thread(target=reader)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # before the fix: 500 (the baseline was None between its two assignments) in most reads
        assert seen == [], f"{len(seen)} reads saw allocation.all.allocated={seen[0]} after the reset"
        assert pool.memory_stats()["allocation.all.allocated"] == 0
        assert pool.lifetime_stats()["allocation.all.allocated"] == 500
    finally:
        pool.close()

"""Cost of a reap of dropped pools, on the simulator: N pools dropped while each still holds a
block (torch's MemPool deleted before its tensors; a tenant context dropped with its outputs
alive) stay open as orphans, and every module-level free, pool open and empty_cache asks each of
them whether it can be closed (registry.reap_orphans). The question read the pool's whole stats
(memory_stats' dict and a device free-memory query, 16 us a pool): with 1,000 orphans each such
call paid 32 ms. It now reads the active-block count alone (PoolBase._active_blocks). Prints, for
each N, the time of one module-level empty_cache (its reap included) and of the old question
asked of every orphan, and their ratio, measured in this run.

    python bench/reap_orphans.py [--orphans 10,100,1000]
"""

import argparse
import gc
import json
import os
import time


def best_of(fn, runs=5):
    best = None
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        took = time.perf_counter() - t0
        best = took if best is None else min(best, took)
    return best


def main():
    ap_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap_.add_argument("--orphans", default="10,100,1000", help="comma-separated counts of dropped pools")
    a = ap_.parse_args()
    os.environ.setdefault("ASCEND_POOL_BACKEND", "sim")
    os.environ["ASCEND_POOL_STATS"] = "0"  # no publisher thread reaping meanwhile
    import ascend_pool as ap
    from ascend_pool import registry

    ap.free(ap.malloc(512))  # the default pool exists before the orphans
    for n in (int(v) for v in a.orphans.split(",")):
        blocks = []
        for _ in range(n):
            q = ap.Pool(0, backend="sim")
            blocks.append(q.malloc(512))
            del q
        gc.collect()
        orphans = [p for p in registry._orphans if not p.closed]

        def old_question():
            for p in orphans:
                not p.closed and not p._raw_stats()["active.all.current"] and not p._work_queued()

        now = best_of(ap.empty_cache)
        old = best_of(old_question)
        print(json.dumps({"orphans": len(orphans), "empty_cache_ms": round(now * 1e3, 3),
                          "old_question_ms": round(old * 1e3, 3), "old_over_now": round(old / now, 1)}))
        for ptr in blocks:
            ap.free(ptr)
        registry.reap_orphans()


if __name__ == "__main__":
    main()

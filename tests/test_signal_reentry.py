"""A signal handler that calls into ascend_pool while its thread is inside ascend_pool.

Frameworks handle SIGTERM (preemption, torchelastic, Slurm requeue) with a Python handler that
empties the cache, closes pools or dumps a snapshot. Python runs the handler in the main thread
between two bytecodes of whatever that thread was doing: inside the pool registry's lock (a
module-level free lists the device's pools), the default-pool lock, the metrics aggregator's
lock (a pool closing), the backend's, the ledger's (a context opening) and the others the
package's calls take. With plain locks the handler waited for its own thread for ever (frame15:
6-8 hangs in 20-30 SIGTERMs at random moments). torch's wrappers hold no Python lock, and its
allocator's mutex is recursive. Each case here delivers the signal while the lock is held, so
the handler runs inside it every time.
"""
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401


def test_a_signal_handler_calling_into_the_pool_inside_its_locks_returns(sim_node):
    try:
        out = sim_node.run_json("""
            import os, signal
            import ascend_pool as ap
            from ascend_pool import api, backend, identity, private_dir, registry
            from ascend_pool.metrics.sample import PoolAggregator
            from ascend_pool.service import publisher
            from ascend_pool.tenants import ledger

            agg = PoolAggregator()                   # reads the live pools, folds closing ones in
            ran = []

            def on_term(signum, frame):              # what a framework's SIGTERM handler does
                q = ap.Pool(0)                       # the backend's lock
                q.free(q.malloc(1 << 20))
                ctx = q.context("on-term", quota="8MiB")   # the ledger's, identity's, private dir's
                ctx.free(ctx.malloc(1 << 20))
                ctx.close()
                q.close()                            # close listeners: the aggregator's lock
                ap.empty_cache()                     # the default pool: the registry's and api's locks
                ap.memory_snapshot()
                ran.append(len(registry.live_pools()))

            signal.signal(signal.SIGTERM, on_term)
            ap.free(ap.malloc(1 << 20))              # the default pool exists
            agg.samples()
            locks = (registry._lock, api._lock, agg._lock, backend._lock, ledger._lock, identity._lock,
                     private_dir._lock, publisher._lock)
            for lock in locks:
                with lock:
                    os.kill(os.getpid(), signal.SIGTERM)
                    for _ in range(1000):            # the handler runs between these bytecodes
                        pass
            print(json.dumps({"ran": len(ran), "locks": len(locks)}))
        """, timeout=20)
    except subprocess.TimeoutExpired:
        raise AssertionError("the handler waited for its own thread's lock (deadlock)") from None
    assert out["ran"] == out["locks"], out

"""Every public call with junk arguments (ground rule: a bad size, pointer, stream, device,
config or request gets a typed exception that names it, and the pool stays consistent).

One child process (its own simulated node: some of these calls change process-wide settings)
calls the module functions, a pool's, a tenant context's and the pinned host pool's methods, the
sharing, numpy-handler and pinned-pool calls and the simulator's control calls with every combination of their first one or two
positional arguments drawn from None, "x", -1, 1.5, True, object(), 2**70, b"x" and 0. Only
ascend_pool's own errors may come out (PoolError and its subclasses; the simulator's control calls
also ValueError or SimError), apart from the TypeErrors listed below that name what the call
needs; afterwards the pool's invariants hold and it still serves. Found before it existed:
dump_snapshot(1) wrote to stdout and closed it, numpy's uninstall raised SystemError, the invariant
checker failed on a live shared block, set_device(99) was accepted."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401  (pytest fixture)

CHILD = r"""
import inspect, itertools, os, tempfile
import ascend_pool as ap
from ascend_pool import sim, sharing
from ascend_pool.integrations import numpy as ap_numpy, pinned
os.chdir(tempfile.mkdtemp())               # a call that takes "x" as a file name writes here
JUNK = [None, "x", -1, 1.5, True, object(), 2 ** 70, b"x", 0]
pool = ap.Pool(0)
ctx = pool.context("junk", quota="64MiB")
hp = pinned.host_pool(0)
kept = pool.malloc(4096)
shared = pool.share_malloc(4096)
handle = pool.share(shared, any_process=True)
MODULE = ["malloc", "free", "empty_cache", "memory_stats", "memory_summary", "snapshot", "reset_peak_memory_stats",
          "reset_peak_stats", "max_memory_allocated", "memory_allocated", "memory_reserved", "max_memory_reserved",
          "mem_get_info", "caching_allocator_alloc", "caching_allocator_delete", "record_stream", "erase_stream",
          "set_per_process_memory_fraction", "get_per_process_memory_fraction", "reset_accumulated_memory_stats",
          "dump_snapshot", "default_pool", "open_shared", "node_pid", "set_device", "record_memory_history",
          "attach_out_of_memory_observer", "detach_out_of_memory_observer"]
POOL = ["malloc", "free", "record_stream", "erase_stream", "block_info", "segment_kind", "round_size", "set_limit", "synchronize",
        "register_stream", "destroy_stream", "context", "share", "share_free", "share_malloc", "dump_trace",
        "dump_snapshot", "free_all_blocks", "record_memory_history"]
targets = [("ap", n, getattr(ap, n)) for n in MODULE] + [("pool", n, getattr(pool, n)) for n in POOL]
targets += [("ctx", n, getattr(ctx, n)) for n in ("malloc", "free", "set_quota")]
targets += [("hostpool", n, getattr(hp, n)) for n in ("malloc", "free", "record_stream", "block_info")]
targets += [("sharing", "allow", sharing.allow), ("numpy", "uninstall", ap_numpy.uninstall),
            ("pinned", "host_pool", pinned.host_pool)]
targets += [("sim", n, getattr(sim, n)) for n in ("stats", "read", "launch_fill", "hang_stream", "release_stream")]
ALLOWED = {("ap", "open_shared", "TypeError"), ("sharing", "allow", "TypeError")}
odd, calls = {}, 0
for owner, name, f in targets:
    try:
        sig = inspect.signature(f)
        n = len([p for p in sig.parameters.values() if p.default is inspect.Parameter.empty
                 and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])
    except (ValueError, TypeError):
        n = 1
    pad = [1] * max(0, n - 2)                # further required arguments: a plain valid-looking 1
    for args in itertools.product(JUNK, repeat=min(max(n, 1), 2)):
        calls += 1
        try:
            out = f(*args, *pad)
            if owner in ("ap", "pool", "ctx") and name in ("malloc", "caching_allocator_alloc") and isinstance(out, int):
                (ctx if owner == "ctx" else pool if owner == "pool" else ap).free(out)
        except ap.PoolError:
            pass
        except (ValueError, sim.SimError) if owner == "sim" else ():
            pass
        except Exception as e:
            key = (owner, name, type(e).__name__)
            if key not in ALLOWED:
                odd.setdefault("%s.%s %s" % key, "%r -> %s" % (args, str(e)[:120]))
    # undo what a call may have set, so that the next target meets a working pool
    ap.set_device(0)
    sim.reset_faults()
    ap.record_memory_history(None)
    ap.set_per_process_memory_fraction(1.0)
    pool.set_limit(None)
    ctx.set_quota("64MiB")
pool._check_invariants()
ctx._check_invariants()
pool.free(pool.malloc(1 << 20))            # still serving
pool.free(kept)
pool.share_free(shared)
print(json.dumps({"odd": odd, "calls": calls}))
"""


def test_junk_arguments_to_every_public_call_are_typed_errors(sim_node):
    out = sim_node.run_json(CHILD, timeout=120)
    assert out["calls"] > 800, out["calls"]  # 936 when written
    assert out["odd"] == {}, "\n".join(f"{k}: {v}" for k, v in out["odd"].items())

"""A framework's process under stress (seeded op mix): threads on 4 simulated devices allocate
through the Python API, a tenant context and the C ABI (switching devices with aclrtSetDevice),
fill every block through a stream, free across streams, and create and destroy shared streams
while other threads have blocks and frees pending on them, the runtime giving a destroyed
stream's handle to the next stream (ASCEND_SIM_REUSE_STREAM_HANDLES=1). At a barrier every few
dozen ops, with all threads stopped: each pool's allocated and reserved figures equal its
snapshot's live blocks and segments, its live blocks are exactly the blocks the threads hold, none
overlap, and the invariant checker passes; a block handed out twice shows as a wrong pattern. At
the end allocated, reserved, pending frees, the node's device bytes and live events are back to
where they started. A watchdog turns a deadlock into a failure with every thread's stack.
scripts/asan.sh runs it too."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401

CHILD = r"""
import faulthandler, random
import ascend_pool as ap
from ascend_pool import sim

NDEV, OPS = 4, 40
pools = [ap.Pool(d, expandable_segments=EXPANDABLE) for d in range(NDEV)]
for p in pools:
    p.synchronize()
for d in range(NDEV):
    ap.default_pool(d).synchronize()              # the C ABI's pools: their default streams exist
start = {d: (sim.stats(d)["node_bytes_used"], sim.stats(d)["live_events"]) for d in range(NDEV)}
abi = capi()                                      # sim_child's: the C ABI as a framework loads it
slock = threading.Lock()
shared = {d: [pools[d].create_stream() for _ in range(2)] for d in range(NDEV)}
errors, counts, owned, progress = [], {}, {}, [time.monotonic()]
tls = threading.local()

def bump(k):
    counts[k] = counts.get(k, 0) + 1
    progress[0] = time.monotonic()

def watchdog():
    while True:
        time.sleep(1)
        if time.monotonic() - progress[0] > 30:
            sys.stderr.write("no progress for 30 s\n")
            faulthandler.dump_traceback(all_threads=True)
            os._exit(3)
threading.Thread(target=watchdog, daemon=True).start()

def switch_device(d):                             # one reference at a time, as a framework thread
    if getattr(tls, "dev", None) != d:
        if getattr(tls, "dev", None) is not None:
            lib.aclrtResetDevice(tls.dev)
        assert lib.aclrtSetDevice(d) == 0
        tls.dev = d

def pick_stream(rnd, d):
    with slock:
        return rnd.choice(shared[d] + [None, None])

def fill(s, p, n, value, rnd, d):
    # the block's pattern, written by its stream (None: device d's default stream); False when
    # s was destroyed by another thread meanwhile
    if s is None:
        switch_device(d)
    try:
        sim.launch_fill(s, p, n, value, delay_s=rnd.choice([0, 0, 0, 0.0003]))
        return True
    except sim.SimError:
        return False

def free_block(b, rnd):
    kind, d, p, n, s, value, pool = b
    if rnd.random() < 0.4:
        try:
            if s is None:
                switch_device(d)
            pool.synchronize(s)
        except ap.InvalidStreamError:
            pass                                  # destroyed meanwhile: its destroy drained it
        got = sim.read(p, n)
        if got != bytes([value]) * n:
            errors.append(f"{kind} block {p:#x}+{n} on device {d} overwritten: {got[0]} != {value}")
        bump("verified")
    if kind == "capi":
        abi.ascend_pool_free(p, n, d, s if s and rnd.random() < 0.5 else None)
        bump("free_capi")
        return
    try:
        pool.free(p, stream=s if rnd.random() < 0.5 else None)
    except ap.InvalidStreamError:
        pool.free(p)                              # its stream was destroyed meanwhile
    bump("free")

def step(k, rnd, mine, ctx):
    r, d = rnd.random(), rnd.randrange(NDEV)
    if r < 0.30 or not mine:
        s = pick_stream(rnd, d)
        n = rnd.choice([512, 3000, 64 << 10, 1 << 20, 3 << 20])
        try:
            p = pools[d].malloc(n, stream=s)
        except ap.InvalidStreamError:
            return                                # destroyed between the pick and the malloc
        value = rnd.randrange(1, 256)
        if fill(s, p, n, value, rnd, d):
            mine.append(("py", d, p, n, s, value, pools[d]))
            bump("malloc")
        else:
            pools[d].free(p)
    elif r < 0.40:
        switch_device(d)
        s = pick_stream(rnd, d)
        n = rnd.choice([512, 4096, 2 << 20])
        p = abi.ascend_pool_malloc(n, d, s)
        if not p:
            err = abi.ascend_pool_last_error() or b""
            if b"stream" not in err:
                errors.append(f"C ABI malloc({n}, {d}, {s}): {err}")
            return
        value = rnd.randrange(1, 256)
        if fill(s, p, n, value, rnd, d):
            mine.append(("capi", d, p, n, s, value, ap.default_pool(d)))
            bump("malloc_capi")
        else:
            abi.ascend_pool_free(p, n, d, None)
    elif r < 0.45:
        cd = k % NDEV                             # the thread's tenant context, current for it
        s, n = pick_stream(rnd, cd), rnd.choice([512, 70000])
        try:
            with ctx:
                p = ap.malloc(n, stream=s, device=cd) if rnd.random() < 0.5 else ctx.malloc(n, stream=s)
        except ap.InvalidStreamError:
            return
        value = rnd.randrange(1, 256)
        if fill(s, p, n, value, rnd, cd):
            mine.append(("ctx", cd, p, n, s, value, ctx))
            bump("ctx_malloc")
        else:
            ctx.free(p)
    elif r < 0.75:
        free_block(mine.pop(rnd.randrange(len(mine))), rnd)
    elif r < 0.80:
        kind, bd, p, n, s, value, pool = mine[rnd.randrange(len(mine))]
        o = pick_stream(rnd, bd)
        if kind == "py" and fill(o, p, n, value, rnd, bd):  # used on another stream too
            try:
                pool.record_stream(p, o)
                bump("record")
            except ap.InvalidStreamError:
                pass
    elif r < 0.86:
        with slock:
            lst = shared[d]
            victim = lst.pop(rnd.randrange(len(lst))) if len(lst) > 1 and rnd.random() < 0.5 else None
        if victim is not None:                    # others may hold blocks and frees on it
            pools[d].destroy_stream(victim)
            bump("destroy_stream")
        else:
            h = pools[d].create_stream()          # perhaps a destroyed stream's handle again
            with slock:
                shared[d].append(h)
            bump("create_stream")
    elif r < 0.90:
        pools[d].empty_cache()
        bump("empty")
    elif r < 0.95:
        pools[d]._check_invariants()
    else:
        try:
            pools[d].synchronize(pick_stream(rnd, d))
        except ap.InvalidStreamError:
            pass

def check_quiescent(i):
    held, every = {}, {id(p): p for p in pools}
    for d in range(NDEV):
        every[id(ap.default_pool(d))] = ap.default_pool(d)
    for lst in owned.values():
        for b in lst:
            held.setdefault(id(b[6]), {})[b[2]] = b[3]
            every[id(b[6])] = b[6]
    for key, pool in every.items():
        pool._check_invariants()
        st = pool.memory_stats()
        segs = pool.snapshot(include_traces=False)["segments"]
        live = [b for sg in segs for b in sg["blocks"] if b["state"] == "active_allocated"]
        where = f"round {i}, device {pool.device} {type(pool).__name__}"
        if sum(b["size"] for b in live) != st["allocated_bytes.all.current"]:
            errors.append(f"{where}: allocated {st['allocated_bytes.all.current']} != its live blocks' sum")
        if sum(sg["total_size"] for sg in segs) != st["reserved_bytes.all.current"]:
            errors.append(f"{where}: reserved {st['reserved_bytes.all.current']} != its segments' sum")
        if {b["address"] for b in live} != set(held.get(key, {})):
            errors.append(f"{where}: {len(live)} live blocks, the threads hold {len(held.get(key, {}))}")
        spans = sorted((b["address"], b["address"] + b["size"]) for b in live)
        if any(b0 < a1 for (a0, a1), (b0, b1) in zip(spans, spans[1:])):
            errors.append(f"{where}: live blocks overlap")

def worker(k, barrier):
    rnd = random.Random(SEED * 1000 + k)
    mine = owned.setdefault(k, [])
    ctx = pools[k % NDEV].context(f"tenant{k % 3}")
    try:
        for i in range(ROUNDS):
            for _ in range(OPS):
                step(k, rnd, mine, ctx)
            barrier.wait(timeout=60)
            if k == 0:
                check_quiescent(i)
            barrier.wait(timeout=60)
        while mine:
            free_block(mine.pop(), rnd)
        ctx.close()
    except threading.BrokenBarrierError:
        pass
    except BaseException as e:
        import traceback
        errors.append(f"thread {k}: {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
        barrier.abort()
    finally:
        if getattr(tls, "dev", None) is not None:
            lib.aclrtResetDevice(tls.dev)

barrier = threading.Barrier(THREADS)
threads = [threading.Thread(target=worker, args=(k, barrier)) for k in range(THREADS)]
for t in threads:
    t.start()
for t in threads:
    t.join()
end = {}
for d in range(NDEV):
    for s in shared[d]:
        pools[d].destroy_stream(s)
    pools[d].empty_cache()
    pools[d]._check_invariants()
    st = pools[d].memory_stats()
    end[d] = {"allocated": st["allocated_bytes.all.current"], "reserved": st["reserved_bytes.all.current"],
              "pending": st["pending_free_blocks"]}
    pools[d].close()
ap.empty_cache()                                  # the C ABI's blocks came from the default pools
for d in range(NDEV):
    end[d].update(default_allocated=ap.memory_allocated(d), default_reserved=ap.memory_reserved(d),
                  node_bytes=sim.stats(d)["node_bytes_used"] - start[d][0],
                  live_events=sim.stats(d)["live_events"] - start[d][1])
print(json.dumps({"errors": errors, "counts": counts, "end": end}))
"""


@pytest.mark.parametrize("seed,expandable", [(1, False), (2, True)], ids=["classic", "expandable"])
def test_threads_devices_and_reused_stream_handles_keep_every_figure_exact(sim_node, seed, expandable):
    out = sim_node.run_json(f"SEED, THREADS, ROUNDS, EXPANDABLE = {seed}, 6, 8, {expandable}\n" + CHILD, timeout=120,
                            ASCEND_SIM_DEVICES="4", ASCEND_SIM_REUSE_STREAM_HANDLES="1")
    assert out["errors"] == [], "\n".join(out["errors"][:10])
    c = out["counts"]
    assert c["malloc"] > 200 and c["malloc_capi"] > 50 and c["ctx_malloc"] > 30 and c["verified"] > 100, c
    assert c["destroy_stream"] > 10 and c["create_stream"] > 10 and c["record"] > 10, c
    zero = {"allocated": 0, "reserved": 0, "pending": 0, "default_allocated": 0, "default_reserved": 0,
            "node_bytes": 0, "live_events": 0}
    assert out["end"] == {str(d): zero for d in range(4)}, out["end"]

"""Many threads on two simulated devices at once (issue 15): random malloc, free, record_stream,
empty_cache, synchronize and snapshot on shared pools, with streams created and destroyed while
the others run, and the invariant checker called throughout. Each thread owns its blocks and
fills them on a stream; a block handed to two owners at once shows up as a wrong byte pattern.
At the end allocated, reserved, pending lists, live events and the node's device bytes are back
to where they started. Runs in a child (its own simulated node), a few seconds."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401

CHILD = """
import random
import ascend_pool as ap
from ascend_pool import sim

DURATION = 2.5
pools = [ap.Pool(d, backend="sim", expandable_segments=EXPANDABLE) for d in (0, 1)]
for d in (0, 1):                      # the default streams exist from here on
    pools[d].synchronize()
start = {d: (sim.stats(d)["node_bytes_used"], sim.stats(d)["live_events"]) for d in (0, 1)}
shared = {d: [pools[d].create_stream() for _ in range(3)] for d in (0, 1)}
errors, counts = [], {"malloc": 0, "free": 0, "record": 0, "empty": 0, "sync": 0, "snap": 0,
                      "check": 0, "streams": 0, "verified": 0}
count_lock = threading.Lock()

def bump(key):
    with count_lock:
        counts[key] += 1

def worker(k):
    rnd = random.Random(k)
    d = k % 2
    pool = pools[d]
    own = []                          # (ptr, size, stream, value)
    mine = None                       # a private stream, created and destroyed during the run
    deadline = time.monotonic() + DURATION
    acl = sim.attach()
    # Fills on the default stream (None) go to this thread's device: the thread picks its
    # device itself, as a framework's does (the pool never changes a caller's device).
    assert acl.aclrtSetDevice(d) == 0
    try:
        while time.monotonic() < deadline:
            r = rnd.random()
            streams = shared[d] + ([mine] if mine else []) + [None]
            if r < 0.35 or not own:
                s = rnd.choice(streams)
                n = rnd.choice([512, 3000, 64 << 10, 1 << 20, 3 << 20])
                p = pool.malloc(n, stream=s)
                value = rnd.randrange(1, 256)
                sim.launch_fill(s, p, n, value, delay_s=rnd.choice([0, 0, 0.0005]))
                own.append((p, n, s, value))
                bump("malloc")
            elif r < 0.62:
                p, n, s, value = own.pop(rnd.randrange(len(own)))
                if rnd.random() < 0.3:
                    pool.synchronize(s)
                    assert sim.read(p, n) == bytes([value]) * n, f"block {p:#x} was overwritten"
                    bump("verified")
                if rnd.random() < 0.3:
                    other = rnd.choice(streams)
                    sim.launch_fill(other, p, n, value, delay_s=rnd.choice([0, 0.0005]))
                    pool.record_stream(p, other)
                    bump("record")
                pool.free(p, stream=rnd.choice([None, s]))
                bump("free")
            elif r < 0.70:
                pool.synchronize(rnd.choice(streams))
                bump("sync")
            elif r < 0.75:
                pool.empty_cache()
                bump("empty")
            elif r < 0.80:
                pool.snapshot()
                pool.memory_stats()
                bump("snap")
            elif r < 0.90:
                pool._check_invariants()
                bump("check")
            elif mine is None:
                mine = pool.create_stream()
                bump("streams")
            else:
                # retire the private stream: blocks still allocated on it are freed later
                # (stream None: the stream they were allocated on, destroyed by then)
                own = [(p, n, (None if s == mine else s), v) for p, n, s, v in own]
                pool.destroy_stream(mine)
                mine = None
        for p, n, s, value in own:
            pool.free(p)
        if mine is not None:
            pool.destroy_stream(mine)
    except BaseException as e:
        errors.append(f"thread {k}: {type(e).__name__}: {e}")
    finally:
        acl.aclrtResetDevice(d)

threads = [threading.Thread(target=worker, args=(k,)) for k in range(10)]
for t in threads:
    t.start()
for t in threads:
    t.join()
end = {}
for d in (0, 1):
    pool = pools[d]
    for s in shared[d]:
        pool.destroy_stream(s)
    pool.empty_cache()
    pool._check_invariants()
    st = pool.memory_stats()
    end[d] = {"allocated": st["allocated_bytes.all.current"], "reserved": st["reserved_bytes.all.current"],
              "pending": st["pending_free_blocks"], "node_bytes": sim.stats(d)["node_bytes_used"] - start[d][0]}
    pool.close()
    end[d]["live_events"] = sim.stats(d)["live_events"] - start[d][1]
print(json.dumps({"errors": errors, "counts": counts, "end": end}))
"""


@pytest.mark.parametrize("expandable", [False, True], ids=["classic", "expandable"])
def test_threads_on_two_devices_leave_everything_as_they_found_it(sim_node, expandable):
    out = sim_node.run_json(f"EXPANDABLE = {expandable}\n" + CHILD, timeout=120)
    print(out["counts"])
    assert out["errors"] == [], out["errors"]
    c = out["counts"]
    assert c["malloc"] > 200 and c["free"] > 100 and c["check"] > 10 and c["streams"] > 2, c
    assert c["record"] > 10 and c["sync"] > 10 and c["empty"] > 2 and c["verified"] > 10, c
    for d, e in out["end"].items():
        assert e == {"allocated": 0, "reserved": 0, "pending": 0, "node_bytes": 0, "live_events": 0}, (d, e)


FRAMES_CHILD = """
import random
import ascend_pool as ap

held = C.PyDLL(ap.library_path())    # calls with the GIL held, as a framework's Python op does
released = C.CDLL(ap.library_path())  # and with it released
for lib in (held, released):
    lib.ascend_pool_malloc.restype = C.c_void_p
    lib.ascend_pool_malloc.argtypes = [C.c_ssize_t, C.c_int, C.c_void_p]
    lib.ascend_pool_free.argtypes = [C.c_void_p, C.c_ssize_t, C.c_int, C.c_void_p]
pools = [ap.default_pool(d) for d in (0, 1)]
stop = time.monotonic() + 2.5
errors, counts = [], {"c_abi": 0, "contexts": 0, "toggles": 0}

def c_abi(lib, d, k):
    rnd = random.Random(k)
    try:
        while time.monotonic() < stop:
            ptrs = [lib.ascend_pool_malloc(rnd.choice([512, 4096, 3 << 20]), d, None) for _ in range(10)]
            if not all(ptrs):
                errors.append("malloc failed: " + (held.ascend_pool_last_error() or b"").decode())
            for p in ptrs:
                lib.ascend_pool_free(p, 0, d, None)
            counts["c_abi"] += 1
    except Exception as e:
        errors.append(repr(e))

def contexts():                       # tenant contexts opened and closed meanwhile
    try:
        i = 0
        while time.monotonic() < stop:
            c = pools[0].context(f"stress-{i % 3}")
            with c:
                for p in [held.ascend_pool_malloc(4096, 0, None) for _ in range(5)]:
                    held.ascend_pool_free(p, 0, 0, None)
            c.close()
            i += 1
            counts["contexts"] += 1
    except Exception as e:
        errors.append(repr(e))

held.ascend_pool_last_error.restype = C.c_char_p
threads = [threading.Thread(target=c_abi, args=(lib, d, 2 * d + j)) for j, lib in enumerate((held, released))
           for d in (0, 1)] + [threading.Thread(target=contexts)]
for t in threads:
    t.start()
while time.monotonic() < stop:    # the process-wide history, on and off, with a snapshot between
    try:
        ap.record_memory_history(True, stacks="python", max_entries=5000)
        time.sleep(0.02)
        ap.memory_snapshot()
        ap.record_memory_history(None)
        counts["toggles"] += 1
    except Exception as e:
        errors.append(repr(e))
        break
for t in threads:
    t.join()
end = {}
for d in (0, 1):
    pools[d]._check_invariants()
    end[d] = pools[d].memory_stats()["allocated_bytes.all.current"]
print(json.dumps({"errors": errors, "counts": counts, "end": end}))
"""


def test_c_abi_frames_while_history_toggles_and_contexts_come_and_go(sim_node):
    out = sim_node.run_json(FRAMES_CHILD, timeout=120)
    assert out["errors"] == [], out["errors"]
    c = out["counts"]
    assert c["c_abi"] > 20 and c["contexts"] > 5 and c["toggles"] > 5, c
    assert out["end"] == {"0": 0, "1": 0}, out["end"]

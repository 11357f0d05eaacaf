"""Cost of a call on a stream against the streams the process holds, on the simulator.

Every call on a stream (an event record at a free marked with record_stream, a wait, a query)
asks the acl backend whether it created that stream. The notes were scanned under the backend's
one lock, so the call cost time linear in the streams of every device of the process: with 30,000
streams held on 16 devices a step (malloc, record_stream on a second stream, free) took 28 us
instead of 0.8. The notes are now found through a hash index (cython/backend/stream_notes.h).
Prints, for each count of streams held (spread over the devices), the time of one step and its
ratio to the step with none held, all measured in this run.

    python bench/stream_notes.py [--held 0,1000,4000,16000,30000] [--steps 5000] [--devices 16]
"""

import argparse
import json
import os
import time


def main():
    ap_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap_.add_argument("--held", default="0,1000,4000,16000,30000", help="comma-separated counts of streams held")
    ap_.add_argument("--steps", type=int, default=5000)
    ap_.add_argument("--devices", type=int, default=16)
    a = ap_.parse_args()
    os.environ["ASCEND_SIM_DEVICES"] = str(a.devices)  # before the simulator's aclInit
    import ascend_pool as ap

    pools = [ap.Pool(d, backend="sim") for d in range(a.devices)]
    p = pools[0]
    compute, comm = p.create_stream(), p.create_stream()

    def step_us():
        best = None
        for _ in range(3):  # the best of three: another process on the machine only slows one
            t0 = time.perf_counter()
            for _ in range(a.steps):
                x = p.malloc(512, stream=compute)
                p.record_stream(x, comm)
                p.free(x)
            took = (time.perf_counter() - t0) / a.steps * 1e6
            best = took if best is None else min(best, took)
        return best

    held, base = [], None
    step_us(), step_us()  # warm: the first steps grow the pool and fill its caches
    for n in (int(v) for v in a.held.split(",")):
        while len(held) < n:
            q = pools[len(held) % a.devices]
            held.append((q, q.create_stream()))
        us = step_us()
        base = us if base is None else base
        print(json.dumps({"streams_held": n, "step_us": round(us, 3), "ratio_to_first": round(us / base, 2)}))
    p.synchronize(comm)
    p.empty_cache()
    for q, s in held:
        q.destroy_stream(s)
    for s in (compute, comm):
        p.destroy_stream(s)
    for q in pools:
        q.close()


if __name__ == "__main__":
    main()

"""Allocation cost with many frees pending behind a busy stream (record_stream on a communication
stream that runs behind: FSDP/DDP buckets, a pipeline's send stream), on the simulator.

N blocks are marked with record_stream on a stream held busy (sim.hang_stream) and freed: each
waits on the pending list for that stream's event. Then each step allocates on the compute
stream, marks the block with the busy stream and frees it, as a framework's step does. Prints,
for each N, the time of one step and the event queries it made (the simulator's count).
Before stream_order.c's gates each allocation asked every pending free's event (N queries a
step: 0.7 ms at N = 10,000); now one per busy stream, as PyTorch's process_events.

    python bench/pending_frees.py [--pending 1000,10000] [--steps 500] [--expandable]
"""

import argparse
import json
import time

import ascend_pool as ap
from ascend_pool import sim


def run(pending, steps, expandable):
    p = ap.Pool(0, backend="sim", **({"expandable_segments": True} if expandable else {}))
    compute, comm = p.create_stream(), p.create_stream()
    sim.hang_stream(comm)
    try:
        def step():
            x = p.malloc(4096, stream=compute)
            p.record_stream(x, comm)
            p.free(x)

        for _ in range(pending):
            step()
        q0, t0 = sim.stats(0)["event_queries"], time.perf_counter()
        for _ in range(steps):
            step()
        took = (time.perf_counter() - t0) / steps
        queries = (sim.stats(0)["event_queries"] - q0) / steps
    finally:
        sim.release_stream(comm)
    p.synchronize(comm)
    p.empty_cache()
    for s in (compute, comm):
        p.destroy_stream(s)
    p.close()
    return {"pending": pending, "step_us": round(took * 1e6, 2), "event_queries_per_step": queries}


def main():
    ap_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap_.add_argument("--pending", default="1000,10000", help="comma-separated counts of pending frees")
    ap_.add_argument("--steps", type=int, default=500)
    ap_.add_argument("--expandable", action="store_true", help="expandable segments")
    a = ap_.parse_args()
    for n in (int(v) for v in a.pending.split(",")):
        print(json.dumps(run(n, a.steps, a.expandable)))


if __name__ == "__main__":
    main()

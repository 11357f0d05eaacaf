"""Two streams ping-ponging buffers (a producer stream and a consumer stream, the copy/compute
overlap of a data pipeline), on the simulator's asynchronous streams.

Each step the producer allocates a buffer on stream P and fills it (device work of --produce-ms),
the consumer stream C is ordered after it with an event and uses it (--consume-ms), and the
buffer is released:
  ascend_pool (stream_reuse=borrow): pool.free(buf, stream=C) — freed in C's order; P's next
      allocation reuses it at once by waiting on C's event on the device (no host wait);
  tied baseline (stream_reuse=tied, PyTorch's policy): pool.record_stream(buf, C); pool.free(buf)
      — the block returns to P only once C's event has completed, polled by the host.
The host enqueues ahead of the device, as a framework does; with --sync-every N it waits for
the device every N steps, as a training loop does once an iteration (reading the loss). Prints
peak reserved bytes, events created and wall time for both, measured in one run. The borrow
path's events: on a runtime with aclrtCreateEventExWithFlag (every simulator profile but the
default `strict`: ASCEND_SIM_PROFILE=cann8.3) one event serves every borrow; otherwise CANN's
reset of an event a stream waited on runs in that stream's order, so an event is reused only once
the borrowing stream got there (docs/cann-rules-events.md): the events in use are the borrows the
host is ahead by, not one per step.

    python bench/stream_pingpong.py [--steps 200] [--size-mib 8] [--produce-ms 0.5] [--consume-ms 1] [--sync-every 0]
"""

import argparse
import json
import time

import ascend_pool as ap
from ascend_pool import sim


def run(mode, steps, size, produce_s, consume_s, sync_every=0):
    pool = ap.Pool(0, backend="sim", stream_reuse=mode)
    be = pool.backend
    p, c = pool.create_stream(), pool.create_stream()
    t0 = time.perf_counter()
    for step in range(steps):
        if sync_every and step and step % sync_every == 0:
            pool.synchronize(c)
        buf = pool.malloc(size, stream=p)
        sim.launch_fill(p, buf, 4096, 1, delay_s=produce_s)
        # the consumer starts after the producer; CANN reuses an event only after aclrtResetEvent
        # (docs/cann-rules-events.md), so this (framework-side) event is one per step
        ready = be.event_create(0)
        be.event_record(ready, p)
        be.stream_wait_event(c, ready)
        be.event_destroy(ready)                  # allowed before it completes
        sim.launch_fill(c, buf, 4096, 2, delay_s=consume_s)
        if mode == "borrow":
            pool.free(buf, stream=c)
        else:
            pool.record_stream(buf, c)
            pool.free(buf)
    pool.synchronize(p)
    pool.synchronize(c)
    seconds = time.perf_counter() - t0
    st = pool.memory_stats()
    pool.destroy_stream(p)
    pool.destroy_stream(c)
    pool.close()
    return {"policy": "ascend_pool (borrow)" if mode == "borrow" else "tied to stream (PyTorch policy)",
            "peak_reserved_bytes": st["reserved_bytes.all.peak"], "events_created": st["events_created"],
            "device_mallocs": st["num_device_alloc"], "seconds": seconds}


def main(argv=None):
    ap_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap_.add_argument("--steps", type=int, default=200)
    ap_.add_argument("--size-mib", type=float, default=8)
    ap_.add_argument("--produce-ms", type=float, default=0.5)
    ap_.add_argument("--consume-ms", type=float, default=1.0)
    ap_.add_argument("--sync-every", type=int, default=0, help="wait for the device every N steps (0: never)")
    ap_.add_argument("--json", action="store_true")
    a = ap_.parse_args(argv)
    size = int(a.size_mib * 2**20)
    rows = [run(m, a.steps, size, a.produce_ms / 1e3, a.consume_ms / 1e3, a.sync_every) for m in ("borrow", "tied")]
    if a.json:
        print(json.dumps(rows))
        return rows
    print(f"{a.steps} steps of {a.size_mib} MiB buffers, produce {a.produce_ms} ms, consume {a.consume_ms} ms")
    print(f"{'policy':34s}{'peak reserved MiB':>18s}{'events created':>16s}{'device mallocs':>16s}{'seconds':>9s}")
    for r in rows:
        print(f"{r['policy']:34s}{r['peak_reserved_bytes'] / 2**20:18.1f}{r['events_created']:16d}"
              f"{r['device_mallocs']:16d}{r['seconds']:9.3f}")
    print(f"memory held, tied / borrow: {rows[1]['peak_reserved_bytes'] / rows[0]['peak_reserved_bytes']:.1f}x")
    return rows


if __name__ == "__main__":
    main()

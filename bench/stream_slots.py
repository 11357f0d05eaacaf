"""What a pool's stream lookup costs with many live streams: a cached malloc+free pair on stream i
of K live streams, taking the streams in turn (each call a miss of the pool's one-entry lookup
cache, as threads with a stream each interleave on one device's pool), against K = 1.

    python bench/stream_slots.py [--pairs 200000] [--streams 1,8,64,256,1023] [--json]

Prints ns per pair (Python's pool.malloc/pool.free) for each K and the ratio to the first K, under
stream_reuse="tied" (each stream keeps its block: a cache hit after the lookup) and "borrow" (the
default: one free block in one segment moves from stream to stream, a borrow per pair, whose pass
over the slots is linear too)."""
import argparse
import json
import time

import ascend_pool as ap


def run(k, pairs, reuse="borrow"):
    pool = ap.Pool(0, backend="sim", stream_reuse=reuse)
    try:
        streams = [pool.create_stream() for _ in range(k)]
        for s in streams:                        # warm: one cached block per stream
            pool.free(pool.malloc(4096, stream=s), stream=s)
        malloc, free = pool.malloc, pool.free
        order = [streams[i % k] for i in range(pairs)]
        t = time.perf_counter()
        for s in order:
            free(malloc(4096, stream=s), stream=s)
        ns = (time.perf_counter() - t) / pairs * 1e9
        st = pool.memory_stats()
        return {"streams": k, "reuse": reuse, "ns_per_pair": round(ns, 1), "segments": st["segment.all.current"],
                "borrows_per_pair": round(st["stream_migrations"] / (pairs + k), 2)}
    finally:
        pool.close()


def main():
    ap_ = argparse.ArgumentParser()
    ap_.add_argument("--pairs", type=int, default=200000)
    ap_.add_argument("--streams", default="1,8,64,256,1023")
    ap_.add_argument("--json", action="store_true")
    a = ap_.parse_args()
    rows = []
    for reuse in ("tied", "borrow"):
        part = [run(int(k), a.pairs, reuse) for k in a.streams.split(",")]
        for r in part:
            r["ratio"] = round(r["ns_per_pair"] / part[0]["ns_per_pair"], 2)
        rows += part
    if a.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(f"{r['reuse']:6s} {r['streams']:5d} streams: {r['ns_per_pair']:8.1f} ns/pair  x{r['ratio']}"
                  f"  ({r['borrows_per_pair']} borrows/pair, {r['segments']} segments)")


if __name__ == "__main__":
    main()

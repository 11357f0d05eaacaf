"""empty_cache of a pool whose stream holds many free small blocks, on the simulator: N 512-byte
blocks allocated on the default stream and every other one freed (no segment wholly free), then
one empty_cache, which hands the stream's free blocks to every stream (free_blocks.c
ap_free_retag_slot, also run when a stream is found idle or its blocks are borrowed). Prints, for
each N, the time of the empty_cache, per free block, and the per-block ratio to the first N, all
measured in this run. Before free_tree.c's ap_tree_take_all the blocks left their tree one by
one, root first, and went back in the reverse order, each rotated up to the root: 100,000 free
blocks took 0.18 s and 1,000,000 took 11 s (23 s on a busier run) under the pool's lock (1.8 and
11 us a block, ratio 6.2); now 0.075 and 0.086 us a block (ratio 1.15), on a loaded 2-core
machine.

    python bench/empty_cache_blocks.py [--blocks 100000,1000000]
"""

import argparse
import json
import time

import ascend_pool as ap


def run(n):
    p = ap.Pool(0, backend="sim")
    held = [p.malloc(512) for _ in range(2 * n)]
    for x in held[::2]:
        p.free(x)
    t0 = time.perf_counter()
    p.empty_cache()
    took = time.perf_counter() - t0
    for x in held[1::2]:
        p.free(x)
    p.close()
    return {"free_blocks": n, "empty_cache_ms": round(took * 1e3, 1), "per_block_us": round(took / n * 1e6, 3)}


def main():
    ap_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap_.add_argument("--blocks", default="100000,1000000", help="comma-separated counts of free blocks")
    a = ap_.parse_args()
    first = None
    for n in (int(v) for v in a.blocks.split(",")):
        r = run(n)
        first = first or r["per_block_us"]
        r["per_block_ratio_to_first"] = round(r["per_block_us"] / first, 2)
        print(json.dumps(r))


if __name__ == "__main__":
    main()

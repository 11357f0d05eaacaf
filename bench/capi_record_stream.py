"""What the C ABI's ascend_pool_record_stream costs with many open pools: the same call on a block
of the default pool of device 0, with that pool alone, then with 128 more plain pools over 8
simulated devices (the call is not told the device; it asks the threads' current pools first).

    python bench/capi_record_stream.py [--calls 20000] [--runs 5]

Prints ns per call (min of the runs) with 1 and 129 pools and their ratio; a malloc+free pair of
the C ABI beside it, whose cost the pool count must not change either."""
import argparse
import ctypes as C
import os
import time

os.environ.setdefault("ASCEND_SIM_DEVICES", "8")
import ascend_pool as ap  # noqa: E402


def main():
    ap_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap_.add_argument("--calls", type=int, default=20000)
    ap_.add_argument("--runs", type=int, default=5)
    args = ap_.parse_args()
    lib = C.CDLL(ap.library_path())
    lib.ascend_pool_malloc.restype = C.c_void_p
    lib.ascend_pool_malloc.argtypes = [C.c_ssize_t, C.c_int, C.c_void_p]
    lib.ascend_pool_free.argtypes = [C.c_void_p, C.c_ssize_t, C.c_int, C.c_void_p]
    lib.ascend_pool_record_stream.argtypes = [C.c_void_p, C.c_void_p]
    lib.ascend_pool_init(0)
    stream = ap.default_pool(0).create_stream()

    def once():
        p = lib.ascend_pool_malloc(4096, 0, None)
        t = time.perf_counter()
        for _ in range(args.calls):
            lib.ascend_pool_record_stream(p, stream)
        record = (time.perf_counter() - t) / args.calls * 1e9
        lib.ascend_pool_free(p, 4096, 0, None)
        t = time.perf_counter()
        for _ in range(args.calls):
            lib.ascend_pool_free(lib.ascend_pool_malloc(4096, 0, None), 4096, 0, None)
        return record, (time.perf_counter() - t) / args.calls * 1e9

    def best():
        runs = [once() for _ in range(args.runs)]
        return min(r[0] for r in runs), min(r[1] for r in runs)

    one = best()
    pools = [ap.Pool(d, backend="sim") for d in range(8) for _ in range(16)]
    many = best()
    print(f"record_stream: {one[0]:.0f} ns with 1 pool, {many[0]:.0f} ns with {len(pools) + 1} pools "
          f"({many[0] / one[0]:.2f}x); malloc+free pair: {one[1]:.0f} / {many[1]:.0f} ns")
    for p in pools:
        p.close()


if __name__ == "__main__":
    main()

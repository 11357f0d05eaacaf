"""A reference model of the classic pool's documented placement policy, run side by side with the
real pool: every malloc must return the address the model predicts (relative to its segment's
base), and after every step the whole layout (each segment's blocks: offset, size, allocated or
not) must be the model's.

The policy modelled (cython/core: pool.c, free_blocks.c, free_tree.c, free_cache.h, segments.c):
  - a request of n bytes occupies round(n) = (n + pad + 511) rounded down to 512 (pad 32 for acl);
    round(n) <= 1 MiB is a small-pool request, else large;
  - a freed small block goes to the recent-free cache (64 bins by hashed size, 4 deep, oldest
    evicted into the free lists), unmerged; a malloc of exactly that size on the same stream takes
    the newest such block back;
  - otherwise best fit: the smallest free block of the request's pool that fits, ties to the
    oldest segment then the lowest offset; the stream's own blocks (freed on it) against blocks
    any stream may use (fresh or synchronized): the any-stream block wins only if smaller;
  - if none fits, the cache is coalesced into the free lists and best fit is tried again, then a
    new segment: 2 MiB for the small pool, the request rounded up to 2 MiB for the large pool;
  - a block is split when the rest is at least 512 bytes (min_block / large_split_min);
  - freed blocks merge with free address neighbours at once (large) or when the cache is
    coalesced (small); a merged block is the stream's if any part was;
  - synchronize() makes every free block usable by any stream; empty_cache() coalesces and
    returns every wholly free segment; release_policy=never releases nothing else.
"""

import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import ascend_pool as ap

KiB, MiB = 1 << 10, 1 << 20
PAD, MIN_BLOCK, SMALL_SIZE, SMALL_SEGMENT, PAGE = 32, 512, 1 * MiB, 2 * MiB, 2 * MiB
CACHE_BINS, CACHE_DEPTH = 64, 4
STREAM = 1  # the stream slot of the default stream (slot 0: blocks any stream may use)


def round_request(n):
    return (n + PAD + MIN_BLOCK - 1) & ~(MIN_BLOCK - 1)


def cache_bin(rsize):
    return (((rsize >> 9) * 0x9E3779B97F4A7C15) & (2**64 - 1)) >> 58 & (CACHE_BINS - 1)


class Block:
    __slots__ = ("seg", "offset", "size", "state", "tag")

    def __init__(self, seg, offset, size, state="free", tag=0):
        self.seg, self.offset, self.size, self.state, self.tag = seg, offset, size, state, tag


class Segment:
    def __init__(self, seq, small, size):
        self.seq, self.small, self.size = seq, small, size
        self.blocks = [Block(self, 0, size)]  # address order


class Model:
    """The policy above, in plain Python (lists, linear scans): slow, obviously right."""

    def __init__(self):
        self.segments = []
        self.seq = 0
        self.cache = [[] for _ in range(CACHE_BINS)]  # oldest first

    # free blocks -------------------------------------------------------------------------------
    def insert_free(self, b, tag):
        """b (already out of every list) becomes free with tag; merges with free neighbours."""
        blocks = b.seg.blocks
        b.state, b.tag = "free", tag
        i = blocks.index(b)
        if i + 1 < len(blocks) and blocks[i + 1].state == "free":
            nxt = blocks.pop(i + 1)
            b.size += nxt.size
            b.tag = b.tag or nxt.tag
        if i > 0 and blocks[i - 1].state == "free":
            prev = blocks[i - 1]
            prev.size += b.size
            prev.tag = prev.tag or b.tag
            blocks.pop(i)

    def best_fit(self, small, rsize):
        def best(tag):
            fits = [b for s in self.segments if s.small == small for b in s.blocks
                    if b.state == "free" and b.tag == tag and b.size >= rsize]
            return min(fits, key=lambda b: (b.size, b.seg.seq, b.offset), default=None)

        own, anyb = best(STREAM), best(0)
        return anyb if anyb and (not own or anyb.size < own.size) else own

    def flush(self):
        for bin_ in self.cache:
            while bin_:
                self.insert_free(bin_.pop(), STREAM)

    # the pool's operations ---------------------------------------------------------------------
    def malloc(self, n):
        """(segment seq, offset, block size, new segment?) of the block a malloc of n returns."""
        rsize = round_request(n)
        small = rsize <= SMALL_SIZE
        for b in reversed(self.cache[cache_bin(rsize)]):
            if b.size == rsize:
                self.cache[cache_bin(rsize)].remove(b)
                b.state = "alloc"
                return b, False
        b = self.best_fit(small, rsize)
        if b is None:
            self.flush()
            b = self.best_fit(small, rsize)
        fresh = b is None
        if fresh:
            size = SMALL_SEGMENT if small else max(PAGE, -(-rsize // PAGE) * PAGE)
            self.seq += 1
            seg = Segment(self.seq, small, size)
            self.segments.append(seg)
            b = seg.blocks[0]
        tag, b.state = b.tag, "alloc"  # before the split: the rest must not merge back into it
        if b.size - rsize >= MIN_BLOCK:
            blocks = b.seg.blocks
            rest = Block(b.seg, b.offset + rsize, b.size - rsize, "split", tag)
            blocks.insert(blocks.index(b) + 1, rest)
            b.size = rsize
            self.insert_free(rest, tag)
        b.tag = STREAM
        return b, fresh

    def free(self, b):
        if b.seg.small:
            bin_ = self.cache[cache_bin(b.size)]
            if len(bin_) == CACHE_DEPTH:
                self.insert_free(bin_.pop(0), STREAM)
            b.state, b.tag = "cached", STREAM
            bin_.append(b)
        else:
            self.insert_free(b, STREAM)

    def synchronize(self):
        self.flush()
        for s in self.segments:
            for b in s.blocks:
                if b.state == "free":
                    b.tag = 0

    def empty_cache(self):
        self.synchronize()
        self.segments = [s for s in self.segments if not (len(s.blocks) == 1 and s.blocks[0].state == "free")]

    def layout(self):
        return {s.seq: [(b.offset, b.size, b.state == "alloc") for b in s.blocks] for s in self.segments}


class SideBySide:
    """The real pool and the model, driven together; every step is compared."""

    def __init__(self, pool):
        self.pool, self.model = pool, Model()
        self.base = {}   # model segment seq -> real segment base address
        self.live = {}   # real ptr -> model block

    def malloc(self, n):
        ptr = self.pool.malloc(n)
        b, fresh = self.model.malloc(n)
        if fresh:
            assert b.offset == 0
            assert ptr not in self.base.values(), "the model made a new segment, the pool reused one"
            self.base[b.seg.seq] = ptr
        want = self.base.get(b.seg.seq, 0) + b.offset
        assert ptr == want, (f"malloc({n}): pool gave {ptr:#x}, model expects segment {b.seg.seq} "
                             f"+ {b.offset:#x} = {want:#x}")
        assert self.pool.block_info(ptr)[1] == b.size, f"malloc({n}): block size"
        self.live[ptr] = b

    def free(self, ptr):
        self.pool.free(ptr)
        self.model.free(self.live.pop(ptr))

    def synchronize(self):
        self.pool.synchronize()
        self.model.synchronize()

    def empty_cache(self):
        self.pool.empty_cache()
        self.model.empty_cache()
        kept = {s.seq for s in self.model.segments}
        self.base = {seq: base for seq, base in self.base.items() if seq in kept}  # released: reusable

    def check_layout(self):
        real = {}
        by_base = {v: k for k, v in self.base.items()}
        for seg in self.pool.snapshot()["segments"]:
            assert seg["address"] in by_base, f"the pool holds a segment at {seg['address']:#x} the model does not"
            real[by_base[seg["address"]]] = [(b["address"] - seg["address"], b["size"],
                                              b["state"] == "active_allocated") for b in seg["blocks"]]
        assert real == self.model.layout()

    def close(self):
        for ptr in list(self.live):
            self.free(ptr)
        self.empty_cache()
        self.check_layout()
        assert self.pool.memory_stats()["reserved_bytes.all.current"] == 0


@pytest.fixture
def never_pool():
    p = ap.Pool(0, backend="sim", release_policy="never")
    yield p
    p.close()


# sizes that meet the policy's edges: exact fits, 512-byte rests, the 1 MiB boundary, 2 MiB pages
EDGES = [1, 480, 481, 992, 4096 - PAD, 4096, 65536, MiB - PAD - 512, MiB - PAD, MiB - PAD + 1, 2 * MiB - PAD,
         2 * MiB, 3 * MiB, 4 * MiB - PAD, 4 * MiB - PAD - 512, 6 * MiB]
sizes = st.one_of(st.sampled_from(EDGES), st.integers(1, 8 * KiB), st.integers(1, 3 * MiB), st.integers(1, 12 * MiB))
ops = st.lists(st.tuples(st.sampled_from(["malloc"] * 6 + ["free"] * 5 + ["sync", "empty"]), sizes,
                         st.integers(0, 1 << 30)), min_size=1, max_size=80)


def drive(pool, sequence):
    run = SideBySide(pool)
    for op, size, pick in sequence:
        if op == "malloc" or not run.live:
            run.malloc(size)
        elif op == "free":
            run.free(sorted(run.live)[pick % len(run.live)])
        elif op == "sync":
            run.synchronize()
        else:
            run.empty_cache()
        run.check_layout()
    run.close()


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_pool_places_every_block_where_the_model_does(never_pool, sequence):
    drive(never_pool, sequence)


@pytest.mark.parametrize("seed", range(6))
def test_long_seeded_runs_match_the_model(never_pool, seed):
    """Longer runs than the property test's, many small blocks: the cache fills and evicts."""
    rnd = random.Random(seed)
    seq = [(rnd.choice(["malloc", "malloc", "free", "free"] + (["sync"] if seed % 2 else [])),
            rnd.choice([rnd.choice(EDGES), rnd.randint(1, 4 * KiB), rnd.randint(1, 2 * MiB)]),
            rnd.getrandbits(30)) for _ in range(1000)]
    drive(never_pool, seq)


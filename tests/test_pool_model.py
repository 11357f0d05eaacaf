"""A reference model of the classic pool's documented placement policy, run side by side with the
real pool: every malloc must return the address the model predicts (relative to its segment's
base), and after every step the whole layout (each segment's blocks: offset, size, allocated or
not) must be the model's.

The policy modelled (cython/core: pool.c, free_blocks.c, free_tree.c, segments.c). It has no
recent-free cache: the pool's cache must be invisible (free_cache.h), so the pool places every
block where merging every free at once places it:
  - a request of n bytes occupies round(n) = (n + pad + 511) rounded down to 512 (pad 32 for acl);
    round(n) <= 1 MiB is a small-pool request, else large;
  - best fit: the smallest free block of the request's pool that fits, ties to the oldest segment
    then the lowest offset; the stream's own blocks (freed on it) against blocks any stream may
    use (fresh or synchronized): the any-stream block wins only if smaller;
  - if none fits, a new segment: 2 MiB for the small pool; for the large pool 20 MiB below 10 MiB
    (torch_npu's), else the request rounded up to 2 MiB;
  - a block is split when the rest is at least 512 bytes (min_block / large_split_min);
  - a freed block merges with its free address neighbours at once, lower neighbour first, when
    their streams allow (the same stream, or one of them usable by any stream); a merged block is
    the stream's if any part was;
  - a block freed on stream S (the allocating one by default) is S's; another stream T with no
    fit of its own is ordered after S and takes S's best fit if one block is enough, else all of
    S's free blocks (stream_reuse=borrow);
  - synchronize(S) makes S's free blocks usable by any stream; empty_cache() does that for every
    stream and returns every wholly free segment; release_policy=never releases nothing else.
"""

import contextlib
import random

import pytest
from hypothesis import given, settings, strategies as st

import ascend_pool as ap

KiB, MiB = 1 << 10, 1 << 20
PAD, MIN_BLOCK, SMALL_SIZE, SMALL_SEGMENT, PAGE = 32, 512, 1 * MiB, 2 * MiB, 2 * MiB
MID_MAX, MID_SEGMENT = 10 * MiB, 20 * MiB  # torch_npu's kMinLargeAlloc and kLargeBuffer
STREAM = 1  # the stream slot of the default stream (slot 0: blocks any stream may use)


def round_request(n):
    return (n + PAD + MIN_BLOCK - 1) & ~(MIN_BLOCK - 1)


class Block:
    __slots__ = ("seg", "offset", "size", "state", "tag")

    def __init__(self, seg, offset, size, state="free", tag=0):
        self.seg, self.offset, self.size, self.state, self.tag = seg, offset, size, state, tag


class Segment:
    def __init__(self, seq, small, size):
        self.seq, self.small, self.size = seq, small, size
        self.blocks = [Block(self, 0, size)]  # address order


class Model:
    """The policy above, in plain Python (lists, linear scans): slow, obviously right.

    Streams are slots numbered in order of first use (1, 2, ...); a free block's tag is the slot
    whose queued work may still touch it, 0 when none."""

    def __init__(self):
        self.segments = []
        self.seq = 0
        self.slots = {}  # stream key -> slot

    def slot_of(self, key):
        return self.slots.setdefault(key, len(self.slots) + 1)

    # free blocks -------------------------------------------------------------------------------
    @staticmethod
    def mergeable(n, tag):
        return n.state == "free" and (n.tag == tag or n.tag == 0 or tag == 0)

    def insert_free(self, b, tag):
        """b (out of every list) becomes free with tag; merges with its lower free neighbour,
        then its upper one, when their tags allow (equal, or either 0); the stricter tag wins."""
        blocks = b.seg.blocks
        i = blocks.index(b)
        if i > 0 and self.mergeable(blocks[i - 1], tag):
            prev = blocks[i - 1]
            tag = prev.tag or tag
            prev.size += b.size
            blocks.pop(i)
            b, i = prev, i - 1
        if i + 1 < len(blocks) and self.mergeable(blocks[i + 1], tag):
            nxt = blocks.pop(i + 1)
            tag = nxt.tag or tag
            b.size += nxt.size
        b.state, b.tag = "free", tag

    def free_blocks(self, small, tag):
        return [b for s in self.segments if s.small == small for b in s.blocks if b.state == "free" and b.tag == tag]

    def best_of(self, small, tag, rsize):
        fits = [b for b in self.free_blocks(small, tag) if b.size >= rsize]
        return min(fits, key=lambda b: (b.size, b.seg.seq, b.offset), default=None)

    def best_fit(self, slot, small, rsize):
        own, anyb = self.best_of(small, slot, rsize), self.best_of(small, 0, rsize)
        return anyb if anyb and (not own or anyb.size < own.size) else own

    def retag(self, frm, to):
        """Every free block of slot frm becomes to's (or any stream's when to is 0)."""
        for small in (True, False):
            moving = self.free_blocks(small, frm)
            for b in moving:
                b.state = "moving"
            for b in moving:
                self.insert_free(b, to)

    def borrow(self, to, small, rsize):
        """A stream with no fit is ordered after the others (an event wait) and takes their free
        blocks: the best fit when one is enough, else all of them. Returns blocks moved."""
        moved = 0
        for s in range(1, len(self.slots) + 1):
            theirs = self.free_blocks(small, s)
            if s == to or not theirs or sum(b.size for b in theirs + self.free_blocks(small, to) +
                                            self.free_blocks(small, 0)) < rsize:
                continue
            fit = self.best_of(small, s, rsize)
            if fit:
                fit.state = "moving"
                self.insert_free(fit, to)
                moved += 1
            else:
                moved += len(theirs)
                self.retag(s, to)
        return moved

    # the pool's operations ---------------------------------------------------------------------
    def malloc(self, n, key=None):
        """(block, new segment?) of the block a malloc of n bytes on stream key returns."""
        slot = self.slot_of(key)
        rsize = round_request(n)
        small = rsize <= SMALL_SIZE
        b = self.best_fit(slot, small, rsize)
        if b is None and self.borrow(slot, small, rsize):
            b = self.best_fit(slot, small, rsize)
        fresh = b is None
        if fresh:
            size = SMALL_SEGMENT if small else MID_SEGMENT if rsize < MID_MAX else -(-rsize // PAGE) * PAGE
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
        b.tag = slot
        return b, fresh

    def free(self, b, key=None, on_alloc_stream=True):
        self.insert_free(b, self.slot_of(key) if not on_alloc_stream else b.tag)

    def synchronize(self, key=None):
        self.retag(self.slot_of(key), 0)

    def empty_cache(self):
        for s in range(1, len(self.slots) + 1):
            self.retag(s, 0)
        self.segments = [s for s in self.segments if not (len(s.blocks) == 1 and s.blocks[0].state == "free")]

    def layout(self):
        """Each segment's blocks: (offset, size, allocated?)."""
        return {s.seq: [(b.offset, b.size, b.state == "alloc") for b in s.blocks] for s in self.segments}


class SideBySide:
    """The real pool and the model, driven together; every step is compared."""

    def __init__(self, pool, n_streams=1):
        self.pool, self.model = pool, Model()
        self.streams = [None] + [pool.create_stream() for _ in range(n_streams - 1)]
        self.base = {}   # model segment seq -> real segment base address
        self.live = {}   # real ptr -> model block

    def malloc(self, n, stream=None):
        ptr = self.pool.malloc(n, stream)
        b, fresh = self.model.malloc(n, stream)
        if fresh:
            assert b.offset == 0
            assert ptr not in self.base.values(), f"malloc({n}): the model made a new segment, the pool reused one"
            self.base[b.seg.seq] = ptr
        want = self.base.get(b.seg.seq, 0) + b.offset
        assert ptr == want, (f"malloc({n}): pool gave {ptr:#x}, model expects segment {b.seg.seq} "
                             f"+ {b.offset:#x} = {want:#x}")
        assert self.pool.block_info(ptr)[1] == b.size, f"malloc({n}): block size"
        self.live[ptr] = b

    def free(self, ptr, stream=None, on_alloc_stream=True):
        self.pool.free(ptr, None if on_alloc_stream else (stream or self.default_handle()))
        self.model.free(self.live.pop(ptr), stream, on_alloc_stream)

    def default_handle(self):
        raise AssertionError("an explicit free on the default stream is not modelled")

    def synchronize(self, stream=None):
        self.pool.synchronize(stream)
        self.model.synchronize(stream)

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
        for h in self.streams[1:]:
            self.pool.destroy_stream(h)


@contextlib.contextmanager
def fresh_never_pool():
    p = ap.Pool(0, backend="sim", release_policy="never")
    try:
        yield p
    finally:
        p.close()


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


@settings(max_examples=150)
@given(ops)
def test_pool_places_every_block_where_the_model_does(sequence):
    with fresh_never_pool() as pool:  # not a fixture: one pool per example, as the model starts empty
        drive(pool, sequence)


@pytest.mark.parametrize("seed", range(6))
def test_long_seeded_runs_match_the_model(never_pool, seed):
    """Longer runs than the property test's, many small blocks: the cache fills and evicts."""
    rnd = random.Random(seed)
    seq = [(rnd.choice(["malloc", "malloc", "free", "free"] + (["sync"] if seed % 2 else [])),
            rnd.choice([rnd.choice(EDGES), rnd.randint(1, 4 * KiB), rnd.randint(1, 2 * MiB)]),
            rnd.getrandbits(30)) for _ in range(1000)]
    drive(never_pool, seq)



def drive_streams(pool, sequence):
    """Three streams (the default one and two created): mallocs on any, frees on the allocating
    stream or ordered on another one, synchronize of any, empty_cache."""
    run = SideBySide(pool, n_streams=3)
    for op, size, pick, k in sequence:
        stream = run.streams[k % 3]
        if op == "malloc" or not run.live:
            run.malloc(size, stream)
        elif op == "free":
            ptr = sorted(run.live)[pick % len(run.live)]
            other = run.streams[1 + pick % 2]
            if k % 2:
                run.free(ptr)                                     # on the stream it was allocated on
            else:
                run.free(ptr, other, on_alloc_stream=False)       # ordered on another stream
        elif op == "sync":
            run.synchronize(stream)
        else:
            run.empty_cache()
        run.check_layout()
    run.close()


stream_ops = st.lists(st.tuples(st.sampled_from(["malloc"] * 6 + ["free"] * 5 + ["sync", "empty"]), sizes,
                                st.integers(0, 1 << 30), st.integers(0, 5)), min_size=1, max_size=80)


@settings(max_examples=150)
@given(stream_ops)
def test_stream_ordered_reuse_matches_the_model(sequence):
    with fresh_never_pool() as pool:
        drive_streams(pool, sequence)


@pytest.mark.parametrize("seed", range(3))
def test_recurring_small_sizes_on_three_streams_match_the_model(never_pool, seed):
    """A few small sizes over and over, as a training step or a decode loop asks them: most frees
    leave isolated blocks that the recent-free cache serves again, and every one of those hits
    must be the block merge-at-free would give."""
    rnd = random.Random(200 + seed)
    seq = [(rnd.choice(["malloc", "malloc", "free", "free"] + (["sync"] if seed % 2 else [])),
            rnd.choice([480, 4000, 4000, 8000, 30000]), rnd.getrandbits(30), rnd.randrange(6))
           for _ in range(2000)]
    drive_streams(never_pool, seq)


@pytest.mark.parametrize("seed", range(4))
def test_long_seeded_runs_on_three_streams_match_the_model(never_pool, seed):
    rnd = random.Random(100 + seed)
    seq = [(rnd.choice(["malloc", "malloc", "free", "free"] + (["sync"] if seed % 2 else [])),
            rnd.choice([rnd.choice(EDGES), rnd.randint(1, 4 * KiB), rnd.randint(1, 2 * MiB)]),
            rnd.getrandbits(30), rnd.randrange(6)) for _ in range(1000)]
    drive_streams(never_pool, seq)

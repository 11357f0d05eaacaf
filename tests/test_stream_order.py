"""Stream-ordered frees on the simulator's real asynchronous streams: a block freed on one stream
is never touched by another stream's work before the first stream's queued work is done. Every
test runs on the classic pool and with expandable segments (virtual memory)."""

import random
import time

import numpy as np
import pytest

import ascend_pool as ap
from ascend_pool import sim

N = 64 << 10  # bytes per buffer


@pytest.fixture(params=[False, True], ids=["classic", "expandable"])
def knobs(request):
    return {"expandable_segments": True} if request.param else {}


@pytest.fixture
def pool(knobs):
    p = ap.Pool(0, backend="sim", **knobs)
    yield p
    p.close()


def filled_with(ptr, value, n=N):
    data = sim.read(ptr, n)
    return data == bytes([value]) * n


@pytest.fixture
def streams(pool):
    a, b, c = pool.create_stream(), pool.create_stream(), pool.create_stream()
    yield a, b, c
    for s in (a, b, c):
        pool.destroy_stream(s)


def test_free_on_a_then_malloc_on_b_waits_for_a(pool, streams):
    a, b, _ = streams
    n = 4 << 20  # a large block: its segment has no free room left for B, so B must reuse A's
    ptr = pool.malloc(n, stream=a)
    sim.launch_fill(a, ptr, n, 0xAA, delay_s=0.2)     # A still writes for 0.2 s
    pool.free(ptr, stream=a)
    other = pool.malloc(n, stream=b)                   # reuses ptr, ordered after A's fill
    assert other == ptr
    sim.launch_fill(b, other, n, 0xBB)
    pool.synchronize(a)
    pool.synchronize(b)
    assert filled_with(other, 0xBB, n), "stream B's data was overwritten by A's earlier work"
    st = pool.memory_stats()
    assert st["num_device_alloc"] == 1, "the block cached for A must serve B (never stranded)"
    assert st["stream_migrations"] >= 1
    pool.free(other, stream=b)


def test_record_stream_holds_the_block_until_the_other_stream_is_done(pool, streams):
    a, b, _ = streams
    ptr = pool.malloc(N, stream=a)
    sim.launch_fill(b, ptr, N, 0xBB, delay_s=0.2)     # B uses A's block
    pool.record_stream(ptr, b)
    pool.free(ptr)                                     # ordered on A, but B still writes
    st = pool.memory_stats()
    assert st["pending_free_bytes"] == pool.round_size(N)
    assert any(blk["state"] == "active_pending_free" for seg in pool.snapshot()["segments"] for blk in seg["blocks"])
    again = pool.malloc(N, stream=a)
    sim.launch_fill(a, again, N, 0xAA)
    pool.synchronize(a)
    pool.synchronize(b)
    assert filled_with(again, 0xAA), "a block marked with record_stream was reused too early"
    pool.free(again)
    pool.synchronize(a)
    assert pool.memory_stats()["pending_free_bytes"] == 0


def test_record_stream_with_another_devices_stream_holds_the_block(knobs):
    # torch's record_stream takes a peer device's stream (a P2P copy reading the block). It was
    # refused (InvalidStreamError; the C ABI's void hook only set code 5, so torch never knew),
    # and the block served the next request while the peer's kernel still wrote it.
    p0 = ap.Pool(0, backend="sim", **knobs)
    p1 = ap.Pool(1, backend="sim")
    try:
        own, peer = p0.create_stream(), p1.create_stream()
        ptr = p0.malloc(N, stream=own)
        sim.launch_fill(peer, ptr, N, 0xBB, delay_s=0.3)   # the peer still writes for 0.3 s
        p0.record_stream(ptr, np.uint64(peer))   # a handle kept in numpy, as plain ints are taken
        p0.free(ptr, stream=own)
        assert p0.memory_stats()["pending_free_bytes"] == p0.round_size(N)
        again = p0.malloc(N, stream=own)
        sim.launch_fill(own, again, N, 0xAA)
        p0.synchronize(own)
        p1.synchronize(peer)
        assert filled_with(again, 0xAA), "the peer device's work overwrote the reused block"
        p0.free(again, stream=own)
        p1.synchronize(peer)
        p0.empty_cache()
        assert p0.memory_stats()["pending_free_bytes"] == 0
        p0._check_invariants()
    finally:
        p0.close()
        p1.close()


def _marked_past_inline_waits_for_a_held_stream(pool, streams_pool, own, users, held):
    """Marks a block of pool with every stream of users (more than its uses hold inline), holds
    users[held] with a fill queued, frees the block: it must not be reused before that stream is
    done, and once all are, it is reusable with its uses back inline."""
    try:
        ptr = pool.malloc(N, stream=own)
        for s in users:
            pool.record_stream(ptr, s)
        pool.record_stream(ptr, users[held])                       # already marked: no second use
        pool._check_invariants()
        sim.hang_stream(users[held])                               # its work still runs
        sim.launch_fill(users[held], ptr, N, 0xBB)
        pool.free(ptr, stream=own)
        pool._check_invariants()
        again = pool.malloc(N, stream=own)
        assert again != ptr, f"reused while stream {held + 1} of {len(users)} that used it still runs"
        sim.release_stream(users[held])
        streams_pool.synchronize(users[held])
        assert filled_with(ptr, 0xBB)
        pool.free(again, stream=own)
        pool.synchronize(own)
        for s in users:
            streams_pool.synchronize(s)
        back = pool.malloc(N, stream=own)
        assert back == ptr
        for s in users[:3]:
            pool.record_stream(back, s)
        pool._check_invariants()
        pool.free(back, stream=own)
        pool.empty_cache()
        assert pool.memory_stats()["pending_free_bytes"] == 0
    finally:
        sim.release_stream(users[held])
        for s in users:
            streams_pool.synchronize(s)


def test_a_block_used_by_more_streams_of_other_devices_than_it_holds_inline_waits_for_each(knobs):
    # Past 8 streams of other devices (held inline) record_stream refused with InvalidStreamError,
    # and the C ABI's void hook dropped the use: the block went to the next request while the
    # 10th peer stream still wrote it. They now grow, twice here (past 8 and past 16).
    p0 = ap.Pool(0, backend="sim", **knobs)
    p1 = ap.Pool(1, backend="sim")
    own = p0.create_stream()
    peers = [p1.create_stream() for _ in range(20)]
    try:
        _marked_past_inline_waits_for_a_held_stream(p0, p1, own, peers, 9)
    finally:
        p0.synchronize(own)
        p0.close()
        p1.close()


def test_same_stream_reuse_is_immediate(pool, streams):
    a, _, _ = streams
    ptr = pool.malloc(N, stream=a)
    # (the pool asks the runtime once about a stream it has not seen: that may take an event)
    created = pool.memory_stats()["events_created"]
    sim.launch_fill(a, ptr, N, 0xAA, delay_s=1.0)
    pool.free(ptr, stream=a)
    again = pool.malloc(N, stream=a)
    # no wait for A's queued fill: it has not run yet (a bound of 0.1 s on the two calls failed
    # when a loaded machine put the thread off for that long)
    assert not filled_with(again, 0xAA)
    assert again == ptr
    assert pool.memory_stats()["events_created"] == created, "same-stream reuse needs no event"
    pool.free(again, stream=a)
    pool.synchronize(a)


def test_blocks_of_a_destroyed_stream_return_to_all(pool):
    s = pool.create_stream()
    ptrs = [pool.malloc(N, stream=s) for _ in range(8)]
    for p in ptrs:
        pool.free(p, stream=s)
    pool.destroy_stream(s)
    before = pool.memory_stats()["num_device_alloc"]
    again = [pool.malloc(N) for _ in range(8)]         # default stream, no new device memory
    assert pool.memory_stats()["num_device_alloc"] == before
    assert pool.memory_stats()["stream_migrations"] == 0   # they were already safe for all
    for p in again:
        pool.free(p)


def test_events_are_pooled(pool, streams):
    a, b, _ = streams
    for i in range(300):
        ptr = pool.malloc(N, stream=a if i % 2 else b)
        pool.record_stream(ptr, b if i % 2 else a)
        pool.free(ptr)
    pool.synchronize(a)
    pool.synchronize(b)
    first = pool.memory_stats()["events_created"]
    for i in range(300):
        ptr = pool.malloc(N, stream=a if i % 2 else b)
        pool.record_stream(ptr, b if i % 2 else a)
        pool.free(ptr)
    pool.synchronize(a)
    pool.synchronize(b)
    assert pool.memory_stats()["events_created"] == first, "steady state must not create events"
    assert first < 50


def test_out_of_memory_waits_for_pending_frees(clean_faults, knobs):
    total = sim.stats(2)["total_bytes"]
    pool = ap.Pool(2, backend="sim", **knobs)
    a, b = pool.create_stream(), pool.create_stream()
    try:
        big = pool.malloc(int(total * 0.6), stream=a)
        sim.launch_fill(b, big, 4096, 1, delay_s=0.2)
        pool.record_stream(big, b)
        pool.free(big)                                  # pending until B is done
        again = pool.malloc(int(total * 0.6), stream=a)  # only fits once the pending free completes
        st = pool.memory_stats()
        assert st["num_sync_all_streams"] >= 1 or st["pending_free_bytes"] == 0
        pool.free(again)
    finally:
        pool.destroy_stream(a)
        pool.destroy_stream(b)
        pool.close()


def test_hung_stream_gives_a_timeout_error_and_others_keep_working(knobs):
    pool = ap.Pool(0, backend="sim", sync_timeout_ms=200, **knobs)
    hung, fine = pool.create_stream(), pool.create_stream()
    try:
        sim.hang_stream(hung)
        t0 = time.monotonic()
        with pytest.raises(ap.DeviceTimeoutError, match="stream") as info:
            pool.synchronize(hung)
        # the stream never finishes: a limit ignored, or read in seconds, fails this; 10 s for load
        assert time.monotonic() - t0 < 10.0
        assert info.value.code in (507046, 507047)
        ptr = pool.malloc(N, stream=fine)
        sim.launch_fill(fine, ptr, N, 7)
        pool.synchronize(fine)
        assert filled_with(ptr, 7)
        pool.free(ptr, stream=fine)
    finally:
        sim.release_stream(hung)
        pool.synchronize(hung)
        pool.destroy_stream(hung)
        pool.destroy_stream(fine)
        pool.close()


def test_randomized_streams_never_corrupt(pool):
    rng = random.Random(1234)
    streams = [pool.create_stream() for _ in range(4)]
    live = {}  # ptr -> (stream, value, nbytes): each live buffer must hold what its writer wrote
    fills = 0
    try:
        for step in range(400):
            if live and rng.random() < 0.45:
                ptr = rng.choice(list(live))
                s, value, n = live.pop(ptr)
                other = rng.choice(streams)
                if other != s and rng.random() < 0.3:   # another stream still uses it when freed
                    sim.launch_fill(other, ptr, n, (value + 1) % 256, delay_s=rng.random() * 0.002)
                    pool.record_stream(ptr, other)
                    fills += 1
                pool.free(ptr, stream=s if rng.random() < 0.5 else None)
            else:
                s = rng.choice(streams)
                n = rng.choice((N, N // 2, 3 * N))
                ptr = pool.malloc(n, stream=s)
                value = step % 251
                sim.launch_fill(s, ptr, n, value, delay_s=rng.random() * 0.002)
                fills += 1
                live[ptr] = (s, value, n)
        for s in streams:
            pool.synchronize(s)
        assert fills > 200
        for ptr, (s, value, n) in live.items():
            assert filled_with(ptr, value, n), "a live buffer was overwritten by another stream"
    finally:
        for ptr in live:
            pool.free(ptr)
        for s in streams:
            pool.destroy_stream(s)


def test_a_block_used_by_many_streams_waits_for_the_last_one(pool):
    # torch's record_stream has no limit; ours refused a 9th stream (the C ABI dropped it
    # silently, and the block was reused while that stream still wrote it)
    alloc = pool.create_stream()
    users = [pool.create_stream() for _ in range(12)]
    try:
        ptr = pool.malloc(N, stream=alloc)
        for s in users:
            pool.record_stream(ptr, s)
        sim.launch_fill(users[-1], ptr, N, 0xBB, delay_s=0.2)  # the 12th stream still writes
        pool.free(ptr, stream=alloc)
        again = pool.malloc(N, stream=alloc)
        sim.launch_fill(alloc, again, N, 0xAA)
        pool.synchronize(alloc)
        pool.synchronize(users[-1])
        assert filled_with(again, 0xAA), "reused before the last stream that used it was done"
        pool.free(again)
    finally:
        for s in users + [alloc]:
            pool.synchronize(s)
            pool.destroy_stream(s)


def test_a_block_used_by_more_streams_than_it_holds_inline_waits_for_the_last_one(pool):
    # Past 64 streams (the uses held inline) record_stream refused with InvalidStreamError, and
    # the C ABI's void hook dropped the use: the block went to the next request while the 70th
    # stream still wrote it. The uses now grow, twice here (past 64 and past 128).
    alloc = pool.create_stream()
    users = [pool.create_stream() for _ in range(130)]
    try:
        _marked_past_inline_waits_for_a_held_stream(pool, pool, alloc, users, 69)
    finally:
        for s in users + [alloc]:
            pool.synchronize(s)
            pool.destroy_stream(s)


def test_pending_frees_behind_busy_streams_are_asked_once_per_stream_not_once_each(pool):
    # Every allocation asked the runtime about every pending free's events: with K frees marked
    # with record_stream behind a busy stream (a communication stream), each malloc made K event
    # queries (10,000 pending: 0.7 ms a malloc on the simulator). Now a stream's oldest event not
    # complete stands for its later ones, as PyTorch's process_events: one query per busy stream.
    # Counted, not timed. Frees behind another stream that finishes still complete at once.
    alloc, busy, quick = pool.create_stream(), pool.create_stream(), pool.create_stream()
    K, M, size = 200, 40, pool.round_size(4096)
    sim.hang_stream(busy)
    sim.hang_stream(quick)
    try:
        behind_busy = [pool.malloc(4096, stream=alloc) for _ in range(K)]
        behind_quick = [pool.malloc(4096, stream=alloc) for _ in range(K)]
        for x in behind_busy:
            pool.record_stream(x, busy)
        for x in behind_quick:
            pool.record_stream(x, quick)
        for x in behind_busy + behind_quick:
            pool.free(x)
        before = sim.stats(0)["event_queries"]
        for i in range(M):
            y = pool.malloc(4096, stream=alloc)
            pool.record_stream(y, busy if i % 2 else quick)  # frees keep joining the pending list
            pool.free(y)
        asked = sim.stats(0)["event_queries"] - before
        assert pool.memory_stats()["pending_free_bytes"] == (2 * K + M) * size
        assert asked <= 4 * M, f"{asked} event queries for {M} allocations with {2 * K} frees pending"
        pool._check_invariants()
        sim.release_stream(quick)
        pool.synchronize(quick)
        pool.free(pool.malloc(4096, stream=alloc))  # one pass: what waited for `quick` only completes
        assert pool.memory_stats()["pending_free_bytes"] == (K + M // 2) * size
        pool._check_invariants()
    finally:
        sim.release_stream(busy)
        sim.release_stream(quick)
    pool.synchronize(busy)
    pool.free(pool.malloc(4096, stream=alloc))
    assert pool.memory_stats()["pending_free_bytes"] == 0
    pool._check_invariants()
    for s in (alloc, busy, quick):
        pool.destroy_stream(s)


def test_empty_cache_waits_for_every_pending_free_behind_running_streams(pool):
    # empty_cache waited for the pending frees' events 64 at a time, four rounds: with more frees
    # than that behind streams whose work was still running, it returned with the rest pending
    # and their segments kept (PyTorch's empty_cache waits for every event). Each stream's latest
    # event now stands for its earlier ones.
    alloc = pool.create_stream()
    users = [pool.create_stream() for _ in range(6)]
    ptrs = [pool.malloc(4096, stream=alloc) for _ in range(600)]
    for i, x in enumerate(ptrs):
        u = users[i % len(users)]
        sim.launch_fill(u, x, 4096, 0x11, delay_s=0.001)  # each user stream works ~0.1 s in all
        pool.record_stream(x, u)
        pool.free(x)
    pool.empty_cache()
    st = pool.memory_stats()
    assert st["pending_free_bytes"] == 0 and st["reserved_bytes.all.current"] == 0, st
    pool._check_invariants()
    for s in users + [alloc]:
        pool.synchronize(s)
        pool.destroy_stream(s)


def test_each_pass_completes_exactly_the_pending_frees_whose_streams_are_done(pool):
    # The pending frees are asked one event per busy stream (its oldest not complete stands for
    # its later ones): a seeded walk of record_stream on random streams, held (hang_stream) and
    # let go at random, checks after every step that a pass completes exactly the frees whose
    # every stream has run its work, no fewer (a gate standing for another stream's events) and
    # no more (a free reused under running work).
    rng = random.Random(2312)
    alloc = pool.create_stream()
    users = [pool.create_stream() for _ in range(4)]
    size = pool.round_size(4096)
    held = {}     # user stream -> the number of its current hold (absent: running freely)
    holds = 0
    pending = []  # (ptr, {stream: the hold it was freed under})
    try:
        for _ in range(300):
            op = rng.random()
            if op < 0.15:
                s = rng.choice(users)
                if s in held:
                    sim.release_stream(s)
                    del held[s]
                    pool.synchronize(s)  # its queued work done, as seen from here
                else:
                    holds += 1
                    held[s] = holds
                    sim.hang_stream(s)
            else:
                x = pool.malloc(4096, stream=alloc)
                marks = rng.sample(users, rng.randint(1, 3))
                for s in marks:
                    pool.record_stream(x, s)
                pool.free(x)
                pending.append((x, {s: held.get(s) for s in marks}))
            pool.free(pool.malloc(4096, stream=alloc))  # a pass over the pending frees
            pending = [(x, m) for x, m in pending if any(h is not None and held.get(s) == h for s, h in m.items())]
            assert pool.memory_stats()["pending_free_bytes"] == len(pending) * size
        pool._check_invariants()
    finally:
        for s in held:
            sim.release_stream(s)
    for s in users + [alloc]:
        pool.synchronize(s)
        pool.destroy_stream(s)
    pool.empty_cache()
    assert pool.memory_stats()["pending_free_bytes"] == 0


def test_destroying_an_idle_stream_waits_for_no_other_streams_pending_frees(knobs):
    # destroy_stream(s) waits for s and for the pending frees recorded on it; a free behind
    # another, busy stream (record_stream on a communication stream) is that stream's: it held
    # the destroy for sync_timeout_ms, then failed it with DeviceTimeoutError (the stream kept).
    pool = ap.Pool(0, backend="sim", sync_timeout_ms=3000, **knobs)
    busy, s = pool.create_stream(), pool.create_stream()
    sim.hang_stream(busy)
    try:
        x = pool.malloc(4096)
        pool.record_stream(x, busy)
        pool.free(x)
        y = pool.malloc(4096)
        pool.record_stream(y, s)
        sim.launch_fill(s, y, 4096, 5, delay_s=0.3)
        pool.free(y)  # pending on s: settled by its destroy
        start = time.monotonic()
        pool.destroy_stream(s)
        assert time.monotonic() - start < 2.5
        assert filled_with(y, 5, 4096)  # s's work ran before its free completed
        assert pool.memory_stats()["pending_free_bytes"] == pool.round_size(4096)  # x: still behind busy
    finally:
        sim.release_stream(busy)
    pool.synchronize(busy)
    pool.destroy_stream(busy)
    pool.empty_cache()
    assert pool.memory_stats()["pending_free_bytes"] == 0
    pool.close()

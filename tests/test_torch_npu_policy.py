"""Tests of the torch_npu caching-policy re-implementation (ascend_pool.bench.torch_npu_policy).

The rules under test are those of torch_npu's NPUCachingAllocator (PyTorch's CUDACachingAllocator
constants, plus torch_npu's 32-byte pad); the model is a re-implementation, not torch_npu itself.
"""
import random

import numpy as np
import pytest

from ascend_pool.bench.torch_npu_policy import (
    ALLOCATOR_NAME, LABEL, TORCH_NPU_PUBLISHED_MIB, PolicyOutOfMemory, TorchNpuPolicy,
    allocation_size, compare_with_published, format_table, replay, round_size)
from ascend_pool.traces import bundled_traces_dir, load_trace, peak_live_bytes, trace_from_arrays

KiB = 1024
MiB = 1024 * KiB


# ---------------------------------------------------------------------------------------------
# the size rules
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("request_bytes, rounded", [
    (1, 512), (100, 512), (480, 512),  # 480 + 32 = 512
    (481, 1024),  # 481 + 32 = 513 -> next multiple of 512
    (512, 1024), (992, 1024), (993, 1536),
    (1 * MiB - 32, 1 * MiB), (1 * MiB - 31, 1 * MiB + 512), (5 * MiB, 5 * MiB + 512),
])
def test_round_size(request_bytes, rounded):
    assert round_size(request_bytes) == rounded


def test_round_size_without_pad_is_pytorchs():
    assert round_size(512, pad=0) == 512 and round_size(513, pad=0) == 1024 and round_size(1, pad=0) == 512


@pytest.mark.parametrize("rounded, segment", [
    (512, 2 * MiB), (1 * MiB, 2 * MiB),  # small pool
    (1 * MiB + 512, 20 * MiB), (10 * MiB - 512, 20 * MiB),  # 1-10 MiB: 20 MiB segments
    (10 * MiB, 10 * MiB), (10 * MiB + 512, 12 * MiB), (15 * MiB + 512, 16 * MiB),  # >= 10 MiB: 2 MiB multiples
])
def test_allocation_size(rounded, segment):
    assert allocation_size(rounded) == segment


# ---------------------------------------------------------------------------------------------
# placement rules on tiny hand-made sequences
# ---------------------------------------------------------------------------------------------

def test_100_bytes_make_one_small_segment_and_a_512_byte_block():
    pol = TorchNpuPolicy()
    a = pol.malloc(100)
    assert pol.device_mallocs == 1 and pol.reserved_bytes == 2 * MiB
    assert pol.block_size(a) == 512 and pol.allocated_bytes == 512
    (seg,) = pol.segments()
    assert seg["segment_type"] == "small" and seg["total_size"] == 2 * MiB and seg["address"] == a
    # the remainder is split off and cached in the small pool
    assert pol.free_blocks(small=True) == [(2 * MiB - 512, a + 512)]
    pol.check()


def test_5_mib_makes_a_20_mib_segment_and_is_split():
    pol = TorchNpuPolicy()
    a = pol.malloc(5 * MiB)
    assert pol.reserved_bytes == 20 * MiB and pol.n_segments == 1
    assert pol.segments()[0]["segment_type"] == "large"
    assert pol.block_size(a) == 5 * MiB + 512
    assert pol.free_blocks(small=False) == [(15 * MiB - 512, a + 5 * MiB + 512)]
    pol.check()


def test_15_mib_makes_a_16_mib_segment_not_split():
    pol = TorchNpuPolicy()
    a = pol.malloc(15 * MiB)
    # 15 MiB + 32 -> 15 MiB + 512 -> segment rounded to 2 MiB: 16 MiB; the remainder
    # (1 MiB - 512) is not > 1 MiB, so the whole segment is the block
    assert pol.reserved_bytes == 16 * MiB and pol.n_segments == 1
    assert pol.block_size(a) == 16 * MiB and pol.allocated_bytes == 16 * MiB
    assert pol.free_blocks() == []
    pol.check()


def test_large_split_needs_remainder_over_1_mib():
    pol = TorchNpuPolicy()
    a = pol.malloc(19 * MiB - 32)  # rounds to exactly 19 MiB; 20 MiB segment; remainder exactly 1 MiB
    assert pol.block_size(a) == 20 * MiB and pol.free_blocks() == []
    b = pol.malloc(19 * MiB - 512 - 32)  # rounds to 19 MiB - 512; remainder 1 MiB + 512 > 1 MiB: split
    assert pol.block_size(b) == 19 * MiB - 512
    assert pol.free_blocks() == [(1 * MiB + 512, b + 19 * MiB - 512)]
    pol.check()


def test_small_best_fit_and_split_down_to_512():
    pol = TorchNpuPolicy()
    a = pol.malloc(900)  # 900 + 32 -> a 1024-byte block at the segment's start
    b = pol.malloc(900)  # the next 1024 bytes
    pol.free(a)  # a cannot merge: b is allocated after it
    assert pol.free_blocks() == [(1024, a), (2 * MiB - 2048, b + 1024)]
    c = pol.malloc(100)  # best fit: the 1024-byte hole, split (remainder 512 >= 512)
    assert c == a and pol.block_size(c) == 512
    assert pol.free_blocks() == [(512, a + 512), (2 * MiB - 2048, b + 1024)]
    d = pol.malloc(200)  # exactly the 512-byte remainder: no split
    assert d == a + 512 and pol.block_size(d) == 512
    assert pol.n_segments == 1
    pol.check()


def test_best_fit_prefers_smaller_then_lower_address():
    pol = TorchNpuPolicy()
    blocks = [pol.malloc(4000) for _ in range(8)]  # 4096-byte blocks, adjacent, in one segment
    pol.free(blocks[5])
    pol.free(blocks[3])  # two equal 4096 holes
    assert pol.malloc(4000) == blocks[3]  # equal sizes: the lower address wins
    pol.free(blocks[0])
    pol.free(blocks[1])  # an 8192 hole at the lowest address
    assert pol.malloc(4000) == blocks[5]  # the smallest fitting hole wins over a lower address
    assert pol.malloc(6000) == blocks[0]  # 6144 goes into the 8192 hole, split (2048 >= 512)
    assert pol.free_blocks()[0] == (2048, blocks[0] + 6144)
    pol.check()


def test_free_merges_with_both_neighbours():
    pol = TorchNpuPolicy()
    a, b, c = pol.malloc(900), pol.malloc(3000), pol.malloc(5000)  # 1024, 3072, 5120-byte blocks
    pol.free(a)
    pol.free(c)  # merges with the segment's free tail
    assert pol.free_blocks() == [(1024, a), (2 * MiB - 1024 - 3072, b + 3072)]
    pol.free(b)  # merges with a (before) and the tail (after): one block, the whole segment
    assert pol.free_blocks() == [(2 * MiB, a)]
    assert pol.allocated_bytes == 0 and pol.reserved_bytes == 2 * MiB
    pol.check()


def test_blocks_never_merge_across_segments():
    pol = TorchNpuPolicy()
    a = pol.malloc(12 * MiB)  # 12 MiB + 512 -> a 14 MiB segment, split (remainder 2 MiB - 512)
    b = pol.malloc(12 * MiB)
    assert pol.n_segments == 2
    pol.free(a)
    pol.free(b)
    sizes = sorted(s for s, _ in pol.free_blocks())
    assert sizes == [14 * MiB, 14 * MiB]  # two free blocks, one per segment, never merged
    pol.check()


def test_two_streams_never_share_a_block():
    pol = TorchNpuPolicy()
    a = pol.malloc(100, stream=0)
    pol.free(a)
    b = pol.malloc(100, stream=1)  # stream 0's free segment is not used
    assert pol.n_segments == 2 and pol.reserved_bytes == 4 * MiB
    segs = {s["stream"]: s for s in pol.segments()}
    assert segs[1]["address"] <= b < segs[1]["address"] + segs[1]["total_size"]
    assert not (segs[0]["address"] <= b < segs[0]["address"] + segs[0]["total_size"])
    # the large pool too
    x = pol.malloc(5 * MiB, stream=1)
    pol.free(x)
    y = pol.malloc(5 * MiB, stream=0)
    assert y != x and pol.n_segments == 4
    # and each stream does reuse its own
    assert pol.malloc(5 * MiB, stream=1) == x and pol.malloc(100, stream=0) == a
    assert pol.n_segments == 4
    pol.check()


def test_small_and_large_pools_are_separate():
    pol = TorchNpuPolicy()
    big = pol.malloc(5 * MiB)
    pol.free(big)  # a free 20 MiB large-pool segment
    pol.malloc(100)  # a small request never takes a large-pool block
    assert pol.n_segments == 2 and pol.reserved_bytes == 22 * MiB


def test_repeated_alloc_free_loop_makes_one_device_malloc():
    pol = TorchNpuPolicy()
    for _ in range(1000):
        pol.free(pol.malloc(3 * MiB))
    assert pol.device_mallocs == 1 and pol.device_frees == 0
    # the same through a trace replay
    n = 500
    op = np.tile([1, 0], n)
    ids = np.repeat(np.arange(n), 2)
    tr = trace_from_arrays(op, ids, np.full(2 * n, 3 * MiB), np.zeros(2 * n, dtype=np.int32), name="loop")
    r = replay(tr)
    assert r["device_mallocs"] == 1 and r["device_calls_steady"] == 0
    assert r["peak_reserved_bytes"] == 20 * MiB and r["final_allocated_bytes"] == 0
    assert r["allocs"] == r["frees"] == n


def test_max_split_size_rules():
    pol = TorchNpuPolicy(max_split_size=100 * MiB)
    a = pol.malloc(150 * MiB)  # an oversize segment (150 MiB + 512 -> 152 MiB)
    assert pol.block_size(a) == 152 * MiB
    pol.free(a)
    b = pol.malloc(50 * MiB)  # below max_split_size: never takes an oversize block
    assert b != a and pol.n_segments == 2
    c = pol.malloc(160 * MiB)  # 152 MiB block too small: new segment
    assert pol.n_segments == 3
    pol.free(c)  # free oversize blocks: 152 MiB and 162 MiB
    d = pol.malloc(140 * MiB)  # 152 < 140 MiB + 512 + 20 MiB: takes it, unsplit
    assert d == a and pol.block_size(d) == 152 * MiB
    e = pol.malloc(120 * MiB)  # best fit 162 MiB >= 120 MiB + 512 + 20 MiB: refused -> new segment
    assert e != c and pol.n_segments == 4
    pol.check()
    with pytest.raises(ValueError):
        TorchNpuPolicy(max_split_size=20 * MiB)


def test_max_split_size_boundary_of_the_20_mib_allowance():
    pol = TorchNpuPolicy(max_split_size=100 * MiB)
    a = pol.malloc(150 * MiB)  # 152 MiB oversize segment
    pol.free(a)
    b = pol.malloc(132 * MiB - 32)  # rounds to exactly 132 MiB: 152 >= 132 + 20 -> refused
    assert b != a and pol.n_segments == 2
    c = pol.malloc(132 * MiB - 31)  # rounds to 132 MiB + 512: 152 < 152 MiB + 512 -> takes it
    assert c == a and pol.block_size(c) == 152 * MiB
    pol.check()


def test_oom_path_frees_cached_segments_then_raises():
    pol = TorchNpuPolicy(device_bytes=100 * MiB)
    a = pol.malloc(60 * MiB)  # 62 MiB segment
    pol.free(a)
    b = pol.malloc(70 * MiB)  # 62 + 72 > 100: the cached 62 MiB segment is freed, then retry
    assert pol.device_frees == 1 and pol.num_alloc_retries == 1 and pol.reserved_bytes == 72 * MiB
    with pytest.raises(PolicyOutOfMemory):
        pol.malloc(50 * MiB)  # 72 + 52 > 100 and nothing cached to free
    assert pol.num_ooms == 1
    pol.check()
    pol.free(b)  # still serving after an OOM
    assert pol.malloc(50 * MiB) == b
    pol.check()


def test_free_of_unknown_address():
    pol = TorchNpuPolicy()
    a = pol.malloc(100)
    with pytest.raises(ValueError, match="not an allocated block"):
        pol.free(a + 512)
    pol.free(a)
    with pytest.raises(ValueError):
        pol.free(a)


# ---------------------------------------------------------------------------------------------
# differential test against a naive model of the same rules (linear scans, block lists)
# ---------------------------------------------------------------------------------------------

class NaiveModel:
    """Same rules, written the slow obvious way: segments hold address-ordered block lists."""

    def __init__(self, mss=None):
        self.segs = []  # [base, size, stream, small, blocks=[[addr, size, allocated]]]
        self.next = 1 << 32
        self.reserved = 0
        self.mss = mss

    def malloc(self, n, stream):
        size = max(512, -(-(n + 32) // 512) * 512)
        small = size <= MiB
        cands = [(b[1], b[0], seg, i) for seg in self.segs if seg[2] == stream and seg[3] == small
                 for i, b in enumerate(seg[4]) if not b[2] and b[1] >= size]
        pick = min(cands, key=lambda c: (c[0], c[1])) if cands else None
        if pick and self.mss is not None:
            if (size < self.mss and pick[0] >= self.mss) or (size >= self.mss and pick[0] >= size + 20 * MiB):
                pick = None
        if pick is None:
            segsize = 2 * MiB if small else (20 * MiB if size < 10 * MiB else -(-size // (2 * MiB)) * 2 * MiB)
            seg = [self.next, segsize, stream, small, [[self.next, segsize, False]]]
            self.next += segsize + 2 * MiB
            self.segs.append(seg)
            self.reserved += segsize
            pick = (segsize, seg[0], seg, 0)
        bsize, addr, seg, i = pick
        rem = bsize - size
        if (small and rem >= 512) or (not small and rem > MiB and (self.mss is None or size < self.mss)):
            seg[4][i:i + 1] = [[addr, size, True], [addr + size, rem, False]]
        else:
            seg[4][i][2] = True
        return addr

    def free(self, addr):
        for seg in self.segs:
            for i, b in enumerate(seg[4]):
                if b[0] == addr and b[2]:
                    b[2] = False
                    bl = seg[4]
                    if i + 1 < len(bl) and not bl[i + 1][2]:
                        b[1] += bl[i + 1][1]
                        del bl[i + 1]
                    if i > 0 and not bl[i - 1][2]:
                        bl[i - 1][1] += b[1]
                        del bl[i]
                    return
        raise AssertionError("free of unknown block")


@pytest.mark.parametrize("seed, mss", [(1, None), (2, None), (3, 40 * MiB)])
def test_matches_naive_model_on_random_sequences(seed, mss):
    rng = random.Random(seed)
    pol, ref = TorchNpuPolicy(max_split_size=mss), NaiveModel(mss)
    live = []
    sizes = [1, 100, 700, 4000, 70_000, 600_000, MiB - 32, 3 * MiB, 9 * MiB, 11 * MiB, 45 * MiB]
    for step in range(1500):
        if live and rng.random() < 0.48:
            addr = live.pop(rng.randrange(len(live)))
            pol.free(addr)
            ref.free(addr)
        else:
            n = rng.choice(sizes) + rng.randrange(0, 3000)
            s = rng.choice((0, 0, 0, 1))
            addr = pol.malloc(n, s)
            assert addr == ref.malloc(n, s), f"step {step}: placement differs"
            live.append(addr)
        assert pol.reserved_bytes == ref.reserved
        if step % 100 == 0:
            pol.check()
    pol.check()


# ---------------------------------------------------------------------------------------------
# bundled traces: a figure computed by hand, and the published figures
# ---------------------------------------------------------------------------------------------

def test_resnet_model_upload_matches_hand_computation():
    """The first 122 events of resnet18_train are the model upload: ResNet-18's parameters and
    batch-norm buffers, allocated in order and never freed. Worked out by hand from the rules (not by
    running this code), with rounded = 512 * ceil((bytes + 32) / 512):

    small pool (rounded <= 1 MiB):
      conv1 37632 -> 37888; layer1 4 x 147456 -> 4 x 147968; layer2 294912 -> 295424,
      3 x 589824 -> 3 x 590336, downsample 32768 -> 33280; layer3 downsample 131072 -> 131584;
      layer4 downsample 524288 -> 524800; fc bias 4000 -> 4096; 20 batch norms, each 4 tensors of
      C floats + an 8-byte counter (-> 512): C=64: 4 x 512 + 512 = 2560 (x5); C=128: 4 x 1024 + 512
      = 4608 (x5); C=256: 4 x 1536 + 512 = 6656 (x5); C=512: 4 x 2560 + 512 = 10752 (x5).
      Total 3,512,832 B. Filling the first 2 MiB segment in order reaches 1,575,424 B before
      layer2's fourth 590336 conv, which does not fit the 521,728 left -> second segment. From then
      on best fit sends every batch-norm tensor to the smaller hole (segment 1), the 590336 conv and
      layer4's 524800 downsample (too big for segment 1's hole) to segment 2. Two small segments.
    large pool:
      layer3 1179648 -> 1180160 (< 10 MiB: a 20 MiB segment, split), then 3 x 2359296 -> 2359808
      and layer4's 4718592 -> 4719104 from the same segment's remainder (left: 7,992,832);
      layer4's 3 x 9437184 -> 9437696 (< 10 MiB) do not fit there: a 20 MiB segment for the first,
      whose 11,533,824 remainder takes the second (left 2,096,128 > 1 MiB, so it was split); a third
      20 MiB segment for the third; fc weight 2048000 -> 2048512 best-fits the 2,096,128 hole, whose
      47,616 remainder is <= 1 MiB, so the block is the whole 2,096,128. Three large segments.
    reserved = 2 x 2 MiB + 3 x 20 MiB = 64 MiB; allocated (rounded) = 3,512,832 + 1,180,160
      + 3 x 2,359,808 + 4,719,104 + 3 x 9,437,696 + 2,096,128 = 46,900,736 B.
    """
    tr = load_trace(bundled_traces_dir() / "resnet18_train_prefix.npz")
    assert tr.meta["phases"][1] == {"name": "train0_b32", "first_event_index": 122}
    pol = TorchNpuPolicy()
    for i in range(122):
        assert tr.op[i] == 1
        pol.malloc(int(tr.size[i]), int(tr.stream[i]))
    assert pol.reserved_bytes == 64 * MiB
    segs = pol.segments()
    assert sorted((s["segment_type"], s["total_size"]) for s in segs) == \
        [("large", 20 * MiB)] * 3 + [("small", 2 * MiB)] * 2
    assert pol.allocated_bytes == 46_900_736
    # the holes left, as worked out above (segment 1: 521,728 - 5 x 4608 - 5 x 6656 - 131,584 - 5 x 10752
    # - 4096 = 289,792; segment 2: 2 MiB - 2 x 590,336 - 524,800 = 391,680)
    assert [s for s, _ in pol.free_blocks(small=True)] == [289_792, 391_680]
    assert [s for s, _ in pol.free_blocks(small=False)] == [7_992_832, 11_533_824]


def test_bundled_resnet_prefix_reproduces_published_figure():
    """The bundled prefix runs through two evaluation passes, where torch_npu's policy reaches its
    peak for the whole resnet18_train trace: the published 1508 MiB must come out (within 2 %)."""
    tr = load_trace(bundled_traces_dir() / "resnet18_train_prefix.npz")
    r = replay(tr)
    target = TORCH_NPU_PUBLISHED_MIB["resnet18_train"][0]
    assert abs(r["peak_reserved_bytes"] / MiB - target) <= 0.02 * target
    assert r["peak_reserved_bytes"] == 1508 * MiB  # in fact exact
    assert r["peak_live_bytes"] == peak_live_bytes(tr) == 838_364_808  # 799.5 MiB, as published (800)
    assert r["final_allocated_bytes"] == 0 and r["device_frees"] == 0
    assert r["waste_bytes"] == r["peak_reserved_bytes"] - r["peak_live_bytes"]
    assert r["reserved_to_live_ratio"] == pytest.approx(r["peak_reserved_bytes"] / r["peak_live_bytes"])
    assert 0.0 <= r["fragmentation_ratio"] <= 1.0
    assert r["allocator"] == ALLOCATOR_NAME and "re-implementation" in r["label"]


def test_bundled_two_stream_prefix_reproduces_published_figure():
    p = bundled_traces_dir() / "resnet18_train_prefetch_2stream_prefix.npz"
    if not p.exists():
        pytest.skip(reason="two-stream prefix not bundled")
    tr = load_trace(p)
    assert tr.streams == [0, 1]
    r = replay(tr)
    target = TORCH_NPU_PUBLISHED_MIB["resnet18_train_prefetch_2stream"][0]
    assert abs(r["peak_reserved_bytes"] / MiB - target) <= 0.02 * target
    assert r["final_allocated_bytes"] == 0


def test_bundled_bert_prefix_replays_cleanly():
    tr = load_trace(bundled_traces_dir() / "bert_serving_varlen_prefix.npz")
    pol = TorchNpuPolicy()
    ptr = {}
    for o, s, n, st in zip(tr.op.tolist(), tr.slot.tolist(), tr.size.tolist(), tr.stream.tolist()):
        if o:
            ptr[s] = pol.malloc(n, st)
        else:
            pol.free(ptr.pop(s))
    pol.check()
    assert pol.allocated_bytes == 0 and not ptr
    r = replay(tr)
    assert r["peak_reserved_bytes"] == pol.peak_reserved_bytes
    assert r["peak_live_bytes"] <= r["peak_allocated_bytes"] <= r["peak_reserved_bytes"]
    assert r["events"] == tr.n_events and r["ops_per_second"] > 0
    assert r["device_calls_steady"] <= r["device_mallocs"]


def test_compare_and_table():
    r = {"trace": "resnet18_train", "peak_reserved_bytes": int(1508 * MiB * 1.01), "peak_live_bytes": 800 * MiB,
         "device_mallocs": 44, "seconds": 0.1, "max_split_size": None}
    c = compare_with_published(r)
    assert c["target_mib"] == 1508 and c["deviation_pct"] == pytest.approx(1.0, abs=0.01)
    assert compare_with_published(dict(r, trace="other")) is None
    text = format_table([r])
    assert "resnet18_train" in text and "1508" in text and LABEL in text


def test_fragmentation_ratio_is_the_metrics_formula_at_the_peak_of_reserved():
    """The model's fragmentation_ratio has the metric's meaning (1 - largest free block / cached free
    bytes), read right after the allocation that first reaches peak reserved. Three 3 MiB blocks
    share one 20 MiB segment; the middle one is freed (a 3 MiB hole beside the 11 MiB tail); a 15 MiB
    request fits neither and gets a 16 MiB segment of its own: at that peak (36 MiB) the cache holds
    3 + 11 MiB, the largest 11, so 1 - 11/14."""
    from ascend_pool.traces import trace_from_arrays

    op = [1, 1, 1, 0, 1, 0, 0, 0]
    ids = [1, 2, 3, 2, 4, 1, 3, 4]
    size = [3 * MiB, 3 * MiB, 3 * MiB, 3 * MiB, 15 * MiB, 3 * MiB, 3 * MiB, 15 * MiB]
    tr = trace_from_arrays(np.array(op, np.int8), np.array(ids), np.array(size), name="hole")
    r = replay(tr, pad=0)
    assert r["peak_reserved_bytes"] == 36 * MiB
    assert r["fragmentation_ratio"] == pytest.approx(1 - 11 / 14)
    assert r["reserved_to_live_ratio"] == pytest.approx(36 / 21)

"""A re-implementation of torch_npu's caching-allocator *policy*, for reference figures in benchmarks.

This is NOT PyTorch and NOT torch_npu: it is an independent, pure-Python model of the placement rules
that torch_npu's ``NPUCachingAllocator`` (a port of PyTorch's ``CUDACachingAllocator``) applies in its
classic, non-expandable-segment mode, replayed on an address model with no device behind it. It
exists so that ascend_pool's replays can be compared with "what torch_npu would have reserved" on the
same trace. Everywhere it reports itself as ``torch_npu_policy`` (a re-implementation).

The rules modelled (constants as published in torch_npu's ``NPUCachingAllocator.cpp``, which carries
PyTorch's values):

* rounding: ``size = 512 * ceil((request + 32) / 512)`` -- torch_npu pads every request by 32 bytes
  (``aclrtMallocAlign32``) before PyTorch's 512-byte rounding; minimum 512 (``pad=0`` gives PyTorch's
  CUDA rounding without ``roundup_power2_divisions``);
* pools: rounded sizes <= 1 MiB use the *small* pool, the rest the *large* pool;
* segment size on a miss: small -> 2 MiB; large < 10 MiB -> 20 MiB; large >= 10 MiB -> rounded up to
  a multiple of 2 MiB;
* best fit: the free block with the smallest (stream, size, address) not below (stream, size) in the
  request's pool; a block on another stream never serves the request (so a block only serves the
  stream that created its segment);
* split: the block is cut (allocation at the low address, remainder free after it) when the
  remainder is >= 512 B in the small pool, or > 1 MiB in the large pool and the request is below
  ``max_split_size``;
* free: the block merges with its free address neighbours in the same segment (no ``record_stream``
  events in a trace, so nothing is deferred);
* ``max_split_size`` (default unlimited, like ``max_split_size_mb`` unset): a request below it never
  takes a cached block of size >= it; a request at or above it takes a cached block only if the block
  is smaller than request + 20 MiB; such requests are never split;
* segments are returned to the device only on the OOM path, which a trace on the default 64 GiB
  model device never reaches: when a new segment would exceed ``device_bytes``, first (with
  ``max_split_size`` set) free the oversize cached segments of the request's stream and pool -- the
  smallest one large enough, else the largest ones until they cover the request -- and retry; then
  free every wholly free cached segment (all streams, both pools) and retry; then raise
  :class:`PolicyOutOfMemory`. The garbage-collection threshold, ``per_process_memory_fraction``,
  ``roundup_power2_divisions``, ``expandable_segments`` and ``record_stream`` events are not
  modelled (the published reference figures are for the classic mode without them).

Address model: segments are laid out at increasing addresses with a 2 MiB gap between them, so that
two blocks are address neighbours only if they lie in the same segment.
"""
from __future__ import annotations

import time
from bisect import bisect_left, insort
from typing import Optional

import numpy as np

from ..traces import default_traces_dir, list_traces, load_trace

__all__ = [
    "ALLOCATOR_NAME",
    "LABEL",
    "TorchNpuPolicy",
    "PolicyOutOfMemory",
    "round_size",
    "allocation_size",
    "replay",
    "TORCH_NPU_PUBLISHED_MIB",
    "compare_with_published",
    "format_table",
]

ALLOCATOR_NAME = "torch_npu_policy"
LABEL = "torch_npu caching policy (re-implementation, not torch_npu itself)"

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

K_MIN_BLOCK_SIZE = 512  # every block is a multiple of this
K_SMALL_SIZE = 1 * MiB  # largest "small" request
K_SMALL_BUFFER = 2 * MiB  # small segments
K_LARGE_BUFFER = 20 * MiB  # segments for 1-10 MiB requests
K_MIN_LARGE_ALLOC = 10 * MiB  # from here on, segments are the request rounded to 2 MiB
K_ROUND_LARGE = 2 * MiB
NPU_PAD = 32  # torch_npu's per-request padding

_SHIFT = 44  # free-list keys are (size << _SHIFT) | address
_MASK = (1 << _SHIFT) - 1
_BASE_ADDR = 1 << 32
_SEGMENT_GAP = 2 * MiB

#: torch_npu's reserved MiB (and peak live MiB) on the shared traces, as published in the project's
#: pool-core issue; the reference must reproduce the reserved figures within 2 %.
TORCH_NPU_PUBLISHED_MIB = {
    "bert_serving_varlen": (800, 251),
    "gpt2_train_varlen_amp": (5018, 4466),
    "llama_generate_serving": (238, 172),
    "resnet18_train": (1508, 800),
    "resnet18_train_prefetch_2stream": (1174, 818),
    "synthetic_frag": (24046, 6144),
}


class PolicyOutOfMemory(MemoryError):
    """The model's device is full (the real allocator's free-and-retry path is not modelled)."""


def round_size(nbytes: int, pad: int = NPU_PAD) -> int:
    """torch_npu's block size for a request: 512 * ceil((nbytes + 32) / 512), at least 512."""
    n = nbytes + pad
    if n < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return -(-n // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def allocation_size(rounded: int) -> int:
    """Segment size the policy asks the device for when no cached block fits a rounded request."""
    if rounded <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if rounded < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-rounded // K_ROUND_LARGE) * K_ROUND_LARGE


class TorchNpuPolicy:
    """The policy's state: segments, free blocks (per stream and pool) and allocated blocks.

    ``malloc(nbytes, stream)`` returns a model address; ``free(addr)`` returns it; ``empty_cache()``
    returns wholly free segments. Figures: ``reserved_bytes`` (sum of segments), ``allocated_bytes``
    (sum of allocated block sizes, i.e. rounded), their peaks, ``requested_bytes`` and its peak,
    ``device_mallocs``, ``device_frees``, ``num_alloc_retries``, ``num_ooms``.
    """

    def __init__(self, *, max_split_size: Optional[int] = None, pad: int = NPU_PAD,
                 device_bytes: int = 64 * GiB):
        if max_split_size is not None and max_split_size <= K_LARGE_BUFFER:
            raise ValueError(f"max_split_size must be > {K_LARGE_BUFFER} bytes (20 MiB), got {max_split_size}")
        if pad < 0:
            raise ValueError(f"pad must be >= 0, got {pad}")
        self.max_split_size = max_split_size
        self.pad = pad
        self.device_bytes = device_bytes
        # (stream, is_small) -> sorted list of (size << _SHIFT | addr) of free blocks
        self._pools: dict = {}
        self._free_start: dict = {}  # addr -> size of a free block
        self._free_end: dict = {}  # addr + size -> addr of a free block
        self._alloc: dict = {}  # addr -> (block size, requested bytes, pool list)
        self._segments: dict = {}  # base -> (size, stream, is_small), in creation order
        self._next_addr = _BASE_ADDR
        self.reserved_bytes = 0
        self.peak_reserved_bytes = 0
        self.allocated_bytes = 0
        self.peak_allocated_bytes = 0
        self.requested_bytes = 0
        self.peak_requested_bytes = 0
        self.device_mallocs = 0
        self.device_frees = 0
        self.allocs = 0
        self.frees = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0

    # -- the two operations -------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: int = 0) -> int:
        if nbytes <= 0:
            raise ValueError(f"allocation size must be > 0, got {nbytes}")
        n = nbytes + self.pad
        size = K_MIN_BLOCK_SIZE if n < K_MIN_BLOCK_SIZE else -(-n // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE
        small = size <= K_SMALL_SIZE
        key = (stream, small)
        lst = self._pools.get(key)
        if lst is None:
            lst = self._pools[key] = []
        i = bisect_left(lst, size << _SHIFT)
        mss = self.max_split_size
        found = i < len(lst)
        if found:
            k = lst[i]
            bsize = k >> _SHIFT
            if mss is not None:
                if size < mss and bsize >= mss:
                    found = False
                elif size >= mss and bsize >= size + K_LARGE_BUFFER:
                    found = False
        if found:
            addr = k & _MASK
            del lst[i]
            del self._free_start[addr]
            del self._free_end[addr + bsize]
        else:
            bsize = allocation_size(size)
            addr = self._device_malloc(bsize, stream, small)
            if addr is None:  # the OOM path: free cached segments, then retry
                if mss is not None and self._release_available_cached_blocks(size, stream, small):
                    addr = self._device_malloc(bsize, stream, small)
                if addr is None:
                    self._release_cached_blocks()
                    self.num_alloc_retries += 1
                    addr = self._device_malloc(bsize, stream, small)
                if addr is None:
                    self.num_ooms += 1
                    raise PolicyOutOfMemory(
                        f"{LABEL}: out of memory: tried to allocate a {bsize}-byte segment for a {nbytes}-byte "
                        f"request; {self.reserved_bytes} of {self.device_bytes} bytes reserved, "
                        f"{self.allocated_bytes} allocated")
        rem = bsize - size
        if small:
            split = rem >= K_MIN_BLOCK_SIZE
        else:
            split = rem > K_SMALL_SIZE and (mss is None or size < mss)
        if split:
            raddr = addr + size
            insort(lst, (rem << _SHIFT) | raddr)
            self._free_start[raddr] = rem
            self._free_end[raddr + rem] = raddr
            bsize = size
        self._alloc[addr] = (bsize, nbytes, lst)
        self.allocated_bytes += bsize
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes
        self.requested_bytes += nbytes
        if self.requested_bytes > self.peak_requested_bytes:
            self.peak_requested_bytes = self.requested_bytes
        self.allocs += 1
        return addr

    # -- device calls and the OOM path ---------------------------------------------------------
    def _device_malloc(self, bsize: int, stream: int, small: bool) -> Optional[int]:
        """A new segment (the model's aclrtMalloc); None when the model device is full."""
        if self.reserved_bytes + bsize > self.device_bytes:
            return None
        addr = self._next_addr
        self._next_addr = addr + bsize + _SEGMENT_GAP
        if self._next_addr > _MASK:
            raise PolicyOutOfMemory(f"{LABEL}: model address space exhausted")
        self._segments[addr] = (bsize, stream, small)
        self.device_mallocs += 1
        self.reserved_bytes += bsize
        if self.reserved_bytes > self.peak_reserved_bytes:
            self.peak_reserved_bytes = self.reserved_bytes
        return addr

    def _release_segment(self, addr: int) -> None:
        """Return a wholly free segment to the device (the model's aclrtFree)."""
        bsize, stream, small = self._segments.pop(addr)
        lst = self._pools[(stream, small)]
        del lst[bisect_left(lst, (bsize << _SHIFT) | addr)]
        del self._free_start[addr]
        del self._free_end[addr + bsize]
        self.reserved_bytes -= bsize
        self.device_frees += 1

    def _is_whole_segment(self, addr: int, bsize: int) -> bool:
        seg = self._segments.get(addr)
        return seg is not None and seg[0] == bsize

    def _release_available_cached_blocks(self, size: int, stream: int, small: bool) -> bool:
        """PyTorch's first OOM step with max_split_size set: free oversize cached segments of the
        request's stream and pool -- the smallest one that is large enough, else the largest ones
        until their total covers the request."""
        mss = self.max_split_size
        lst = self._pools.get((stream, small), [])
        want = max(size, mss)
        i = bisect_left(lst, want << _SHIFT)
        if i < len(lst):
            k = lst[i]
            a, b = k & _MASK, k >> _SHIFT
            if self._is_whole_segment(a, b):
                self._release_segment(a)
                return True
            return False
        released = 0
        for k in reversed(list(lst)):
            b = k >> _SHIFT
            if released >= want or b < mss:
                break
            a = k & _MASK
            if self._is_whole_segment(a, b):
                self._release_segment(a)
                released += b
        return released >= want

    def _release_cached_blocks(self) -> None:
        """PyTorch's last OOM step: free every cached segment that is wholly free (all streams, both pools)."""
        for addr, (bsize, _stream, _small) in list(self._segments.items()):
            if self._free_start.get(addr) == bsize:
                self._release_segment(addr)

    def empty_cache(self) -> None:
        """Return every wholly free segment to the device, like ``torch_npu.npu.empty_cache()``."""
        self._release_cached_blocks()

    def free(self, addr: int) -> None:
        try:
            bsize, nbytes, lst = self._alloc.pop(addr)
        except KeyError:
            raise ValueError(f"{LABEL}: free of {addr:#x}, which is not an allocated block") from None
        self.allocated_bytes -= bsize
        self.requested_bytes -= nbytes
        self.frees += 1
        fs = self._free_start
        fe = self._free_end
        end = addr + bsize
        nsize = fs.pop(end, None)
        if nsize is not None:  # merge with the free block after it
            del fe[end + nsize]
            del lst[bisect_left(lst, (nsize << _SHIFT) | end)]
            bsize += nsize
        paddr = fe.pop(addr, None)
        if paddr is not None:  # merge with the free block before it
            psize = fs.pop(paddr)
            del lst[bisect_left(lst, (psize << _SHIFT) | paddr)]
            addr = paddr
            bsize += psize
        insort(lst, (bsize << _SHIFT) | addr)
        fs[addr] = bsize
        fe[addr + bsize] = addr

    # -- introspection (tests, reports) -------------------------------------------------------
    @property
    def n_segments(self) -> int:
        return len(self._segments)

    def block_size(self, addr: int) -> int:
        """Size of the allocated block at ``addr`` (KeyError if none)."""
        return self._alloc[addr][0]

    def free_blocks(self, stream: Optional[int] = None, small: Optional[bool] = None) -> list:
        """Free blocks as sorted (size, addr) pairs, optionally for one stream and/or pool."""
        out = []
        for (s, sm), lst in self._pools.items():
            if (stream is None or s == stream) and (small is None or sm == small):
                out.extend((k >> _SHIFT, k & _MASK) for k in lst)
        return sorted(out)

    def segments(self) -> list:
        """Every segment with its blocks in address order (a snapshot-like view)."""
        out = []
        for base in sorted(self._segments):
            size, stream, small = self._segments[base]
            blocks = []
            a, end = base, base + size
            while a < end:
                if a in self._free_start:
                    bs = self._free_start[a]
                    blocks.append({"address": a, "size": bs, "allocated": False})
                else:
                    bs, req, _ = self._alloc[a]
                    blocks.append({"address": a, "size": bs, "requested_size": req, "allocated": True})
                a += bs
            if a != end:
                raise AssertionError(f"segment at {base:#x}: blocks end at {a:#x}, segment at {end:#x}")
            out.append({"address": base, "total_size": size, "stream": stream,
                        "segment_type": "small" if small else "large", "blocks": blocks})
        return out

    def external_fragmentation(self) -> float:
        """1 - largest cached free block / cached free bytes (0 when nothing is cached): the
        ascend_pool_fragmentation_ratio metric's formula on the model's cache."""
        cached = self.reserved_bytes - self.allocated_bytes
        if cached <= 0 or not self._free_start:
            return 0.0
        return 1.0 - max(self._free_start.values()) / cached

    def check(self) -> None:
        """Assert the model's invariants (blocks tile segments, counters agree, no adjacent free blocks)."""
        segs = self.segments()
        assert sum(s["total_size"] for s in segs) == self.reserved_bytes
        alloc = sum(b["size"] for s in segs for b in s["blocks"] if b["allocated"])
        assert alloc == self.allocated_bytes, (alloc, self.allocated_bytes)
        for s in segs:
            prev_free = False
            for b in s["blocks"]:
                assert not (prev_free and not b["allocated"]), "two adjacent free blocks were not merged"
                prev_free = not b["allocated"]
        n_free = sum(len(lst) for lst in self._pools.values())
        assert n_free == len(self._free_start) == len(self._free_end)


def replay(trace, *, max_split_size: Optional[int] = None, pad: int = NPU_PAD,
           device_bytes: int = 64 * GiB) -> dict:
    """Replay a :class:`ascend_pool.traces.Trace` through the policy; return the figures as a dict.

    Keys: ``trace, allocator, label, events, allocs, frees, seconds, ops_per_second,
    peak_live_bytes, peak_allocated_bytes, peak_reserved_bytes, waste_bytes, fragmentation_ratio,
    device_mallocs, device_frees, device_calls, device_calls_steady, final_allocated_bytes,
    final_requested_bytes, segments_small, segments_large, max_split_size``.
    ``device_calls_steady`` counts device calls (segment mallocs + frees) made during the second half
    of the events; ``fragmentation_ratio`` is the ascend_pool_fragmentation_ratio metric's formula
    (1 - largest free block / cached free bytes, 0..1) right after the allocation that first
    reaches peak reserved; ``reserved_to_live_ratio`` is ``peak_reserved_bytes / peak_live_bytes``
    (None for a trace with nothing live).
    """
    pol = TorchNpuPolicy(max_split_size=max_split_size, pad=pad, device_bytes=device_bytes)
    ops = trace.op.tolist()
    slots = trace.slot.tolist()
    sizes = trace.size.tolist()
    streams = trace.stream.tolist()
    n = len(ops)
    half = n // 2
    ptr = [0] * int(trace.n_slots)
    malloc = pol.malloc
    free = pol.free
    t0 = time.perf_counter()
    high, frag = 0, 0.0
    for i in range(half):
        if ops[i]:
            ptr[slots[i]] = malloc(sizes[i], streams[i])
            if pol.reserved_bytes > high:  # a new high of reserved: read the fragmentation there
                high, frag = pol.reserved_bytes, pol.external_fragmentation()
        else:
            free(ptr[slots[i]])
    steady_start = pol.device_mallocs + pol.device_frees
    for i in range(half, n):
        if ops[i]:
            ptr[slots[i]] = malloc(sizes[i], streams[i])
            if pol.reserved_bytes > high:
                high, frag = pol.reserved_bytes, pol.external_fragmentation()
        else:
            free(ptr[slots[i]])
    seconds = time.perf_counter() - t0
    live = np.where(trace.op == 1, trace.size, -trace.size).cumsum() if n else np.zeros(1, np.int64)
    peak_live = max(0, int(live.max()))
    small = sum(1 for s in pol._segments.values() if s[2])
    return {
        "trace": trace.name,
        "allocator": ALLOCATOR_NAME,
        "label": LABEL,
        "events": n,
        "allocs": pol.allocs,
        "frees": pol.frees,
        "seconds": seconds,
        "ops_per_second": (n / seconds) if seconds > 0 else float("inf"),
        "peak_live_bytes": peak_live,
        "peak_allocated_bytes": pol.peak_allocated_bytes,
        "peak_reserved_bytes": pol.peak_reserved_bytes,
        "waste_bytes": pol.peak_reserved_bytes - peak_live,
        "fragmentation_ratio": frag,
        "reserved_to_live_ratio": (pol.peak_reserved_bytes / peak_live) if peak_live else None,
        "device_mallocs": pol.device_mallocs,
        "device_frees": pol.device_frees,
        "device_calls": pol.device_mallocs + pol.device_frees,
        "device_calls_steady": pol.device_mallocs + pol.device_frees - steady_start,
        "final_allocated_bytes": pol.allocated_bytes,
        "final_requested_bytes": pol.requested_bytes,
        "segments_small": small,
        "segments_large": pol.n_segments - small,
        "max_split_size": max_split_size,
    }


def compare_with_published(result: dict) -> Optional[dict]:
    """Deviation of a replay's peak reserved from torch_npu's published figure (None if unpublished)."""
    ref = TORCH_NPU_PUBLISHED_MIB.get(result["trace"])
    if ref is None:
        return None
    mine = result["peak_reserved_bytes"] / MiB
    return {"target_mib": ref[0], "target_live_mib": ref[1], "reserved_mib": mine,
            "deviation_pct": 100.0 * (mine - ref[0]) / ref[0]}


def format_table(results: list) -> str:
    """A fixed-width table of replay results against torch_npu's published figures."""
    w = max([34] + [len(r["trace"]) for r in results])
    lines = [f"# {LABEL}",
             f"{'trace':{w}} {'live MiB':>9} {'reserved MiB':>13} {'target MiB':>11} {'dev %':>7} "
             f"{'mallocs':>8} {'seconds':>8}"]
    for r in results:
        c = compare_with_published(r) if r.get("max_split_size") is None else None
        tgt = f"{c['target_mib']:>11}" if c else f"{'-':>11}"
        dev = f"{c['deviation_pct']:>+7.2f}" if c else f"{'-':>7}"
        lines.append(f"{r['trace']:{w}} {r['peak_live_bytes'] / MiB:>9.1f} {r['peak_reserved_bytes'] / MiB:>13.1f} "
                     f"{tgt} {dev} {r['device_mallocs']:>8} {r['seconds']:>8.2f}")
    return "\n".join(lines)


def _main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=f"Replay traces through the {LABEL}.")
    ap.add_argument("traces", nargs="*", help="trace .npz files (default: every trace in the default directory)")
    ap.add_argument("--max-split-size-mb", type=int, default=None)
    args = ap.parse_args(argv)
    paths = args.traces or list_traces(default_traces_dir())
    mss = args.max_split_size_mb * MiB if args.max_split_size_mb else None
    print(format_table([replay(load_trace(p), max_split_size=mss) for p in paths]))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())

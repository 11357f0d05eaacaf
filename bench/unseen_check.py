#!/usr/bin/env python3
"""Replay figures on workload families that no trace (shared, variants/, the harness's
perturbations) was derived from.

Issue 19's harness (`ascend-pool bench --variants`, bench/placement_check.py) perturbs six traces;
a policy chosen on them can still fail on shapes they never had. This generates workloads of the
families below, each from a seed (numpy's default_rng([20261206, crc32(family), seed]): the same
seed gives the same events on any machine), writes each to DIR/FAMILY_sSEED_HASH.npz (the trace
format `ascend-pool replay` reads; HASH is a crc of its arrays, so the reference cache can never
serve another generator's figures), replays each through ascend_pool (classic segments, the
pool's release policy, "budgeted"; --expandable: expandable segments) and the torch_npu_policy
model, two processes at a time (placement_check's worker), and prints per workload and per family
the distribution of the robustness harness (ascend_pool.bench.robustness.summarize): waste
reduction against torch_npu_policy (1 - ascend_pool's waste / the model's, waste = peak reserved
- peak live), workloads where ascend_pool reserves more than the model, and workloads missing a
device-call target (second half of the events > 1 % of its allocations, or whole trace > 3 %).

The trace format holds allocations and frees only: a free is on its allocation's stream (no
record_stream, no cross-stream free event) and there is no empty_cache event. Where a family's
model program does either, the trace says what the allocator sees of it (see the families).

  python bench/unseen_check.py                      # classic, 20 seeds per family
  python bench/unseen_check.py --expandable --save /tmp/unseen_exp.json
  python bench/unseen_check.py --family kv_serving --seeds 20 --explain 3
  ascend-pool replay --json DIR/kv_serving_s3_*.npz  # one workload's full figures
"""
import argparse
import json
import math
import multiprocessing
import os
import sys
import time
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # placement_check and call_sources sit beside this file (also under -P)
    sys.path.insert(0, HERE)

import placement_check  # noqa: E402  the replay worker and its per-process simulated node
from ascend_pool.bench.robustness import STEADY_TARGET_PCT, WHOLE_TARGET_PCT, summarize  # noqa: E402
from ascend_pool.traces import load_trace, peak_live_bytes, trace_from_arrays  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
BASE_SEED = 20261206
#: raised whenever a generator's output changes, so that stale reference figures are never read
GENERATOR_VERSION = 1
#: events a family aims at per workload (a few exceed it by one step); keeps a default run short
EVENT_BUDGET = 60000


class _Events:
    """An event list under construction: alloc() gives an id, free(id) frees it."""

    def __init__(self):
        self.op, self.id, self.size, self.stream = [], [], [], []
        self.live = {}  # id -> (size, stream), in allocation order
        self.next = 0
        self.notes = {}

    def alloc(self, size, stream=0):
        size = max(1, int(size))
        i = self.next
        self.next += 1
        self.live[i] = (size, stream)
        self.op.append(1)
        self.id.append(i)
        self.size.append(size)
        self.stream.append(stream)
        return i

    def free(self, i):
        size, stream = self.live.pop(i)
        self.op.append(0)
        self.id.append(i)
        self.size.append(size)
        self.stream.append(stream)

    def __len__(self):
        return len(self.op)

    def trace(self, name, meta):
        for i in reversed(list(self.live)):  # what the program still holds at its end, latest first
            self.free(i)
        return trace_from_arrays(np.array(self.op, np.int8), np.array(self.id, np.int64),
                                 np.array(self.size, np.int64), np.array(self.stream, np.int32),
                                 name=name, meta=meta)


def _logu(rng, lo, hi):
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _ilogu(rng, lo, hi):
    return int(round(_logu(rng, lo, hi)))


# -------------------------------------------------------------------------------------------
# The families. Each takes a numpy Generator and returns (events, parameters drawn).
# -------------------------------------------------------------------------------------------

def _rmm_random(rng, dist):
    n = _ilogu(rng, 2000, 15000)
    max_size = int(rng.choice([1, 4, 16, 64, 256, 1024])) * MiB
    max_usage = int(_logu(rng, max(1 * GiB, 4 * max_size), 12 * GiB))
    if dist == "uniform":
        draw = lambda: int(rng.integers(1, max_size + 1))  # noqa: E731
    elif dist == "normal":
        draw = lambda: int(min(max_size, max(1, rng.normal(max_size / 2, max_size / 6))))  # noqa: E731
    else:  # geometric: many small, a long tail up to max_size
        p = 8.0 / max_size
        draw = lambda: int(min(max_size, rng.geometric(p)))  # noqa: E731
    ev, live, count, total = _Events(), [], 0, 0
    for _ in range(2 * n):  # RMM's loop: 2 N steps, allocate with 73 % chance while under max_usage
        size = draw()
        if live and not (rng.integers(0, 100) < 73 and count < n and total + size < max_usage):
            k = int(rng.integers(0, len(live)))
            live[k], live[-1] = live[-1], live[k]  # RMM's remove_at: swap with the back, pop
            i = live.pop()
            total -= ev.live[i][0]
            ev.free(i)
            continue
        if not live or count < n:
            live.append(ev.alloc(size))
            total += size
            count += 1
    return ev, {"allocations": n, "max_size_mib": max_size // MiB, "max_usage_mib": max_usage // MiB}


def fam_rmm_uniform(rng):
    return _rmm_random(rng, "uniform")


def fam_rmm_normal(rng):
    return _rmm_random(rng, "normal")


def fam_rmm_geometric(rng):
    return _rmm_random(rng, "geometric")


def fam_torch_fuzz(rng):
    steps = _ilogu(rng, 4000, 20000)
    hi = int(rng.uniform(20, 100) * MiB)
    lo = int(rng.choice([1, 512 * KiB, 2 * MiB]))
    cap = int(_logu(rng, 512 * MiB, 4 * GiB))
    ev, live, total, empty = _Events(), [], 0, 0
    for _ in range(steps):
        while total >= cap:
            i = live.pop(int(rng.integers(0, len(live))))
            total -= ev.live[i][0]
            ev.free(i)
        x = rng.uniform(0, 2.1 if live else 1.1)  # alloc 1, free 1 (when any), empty_cache 0.1
        if x < 1.0:
            size = int(rng.integers(lo, hi))
            live.append(ev.alloc(size))
            total += size
        elif x < 1.1:
            empty += 1  # no empty_cache event in the format: both allocators keep their cache
        else:
            i = live.pop(int(rng.integers(0, len(live))))
            total -= ev.live[i][0]
            ev.free(i)
    ev.notes["empty_cache_calls_not_replayed"] = empty
    return ev, {"steps": steps, "size_lo": lo, "size_hi_mib": round(hi / MiB, 1), "cap_mib": cap // MiB}


def fam_kv_serving(rng):
    layers = int(rng.integers(2, 33))
    kv_dim = int(rng.choice([256, 512, 1024, 2048]))
    tok = 4 * kv_dim  # K and V, fp16, per token per layer
    max_batch = int(rng.integers(4, 33))
    gran = int(rng.choice([1, 16, 256]))  # the cache is reallocated each `gran` tokens (torch.cat: 1)
    vocab = int(rng.choice([32000, 50257, 128256, 152064]))
    hidden = kv_dim * int(rng.choice([1, 2, 4, 8]))
    prompt_hi = _ilogu(rng, 128, 4096)
    out_hi = _ilogu(rng, 32, 512)
    cycles = int(rng.integers(1, 4))
    if layers * max_batch > 128:  # at most 128 caches growing at once: a run long enough to rise and fall
        max_batch = max(4, 128 // layers)
    ev, reqs, step = _Events(), [], 0
    budget = 2 * EVENT_BUDGET
    # events per step at the mean load (0.575 of max_batch): the growths, the admissions and the
    # ends of requests (mean output of a log-uniform [4, out_hi]), h and logits
    mean_out = (out_hi - 4) / math.log(out_hi / 4)
    b = 0.575 * max_batch
    per_step = 2 * layers * b / gran + b / mean_out * (3 * layers + 2) + 4
    steps = max(100, int(budget / per_step))

    def cached(n):
        return tok * gran * -(-n // gran)

    while step < steps and len(ev) < 2 * budget:
        # the load rises and falls `cycles` times: the batch target, and the prompts with it
        phase = math.sin(math.pi * cycles * step / steps) ** 2
        target = max(1, int(round(max_batch * (0.15 + 0.85 * phase))))
        while len(reqs) < target:  # admit: prefill builds the prompt's cache and a prefill scratch
            p = _ilogu(rng, 8, max(9, int(8 + (prompt_hi - 8) * (0.2 + 0.8 * phase))))
            o = _ilogu(rng, 4, out_hi)
            scratch = ev.alloc(p * hidden * 2 * 4)
            kv = [ev.alloc(cached(p)) for _ in range(layers)]
            ev.free(scratch)
            reqs.append({"len": p, "left": o, "kv": kv})
        b = len(reqs)
        h = ev.alloc(b * hidden * 2)
        for r in reqs:  # one decode step: each layer's cache grows by a token
            r["len"] += 1
            r["left"] -= 1
            if (r["len"] - 1) % gran == 0:
                for li in range(layers):
                    new = ev.alloc(cached(r["len"]))
                    ev.free(r["kv"][li])
                    r["kv"][li] = new
        logits = ev.alloc(b * vocab * 4)
        ev.free(h)
        ev.free(logits)
        for r in [r for r in reqs if r["left"] <= 0]:  # finished: its caches go
            for i in r["kv"]:
                ev.free(i)
            reqs.remove(r)
        step += 1
    return ev, {"layers": layers, "kv_bytes_per_token_layer": tok, "max_batch": max_batch, "growth_tokens": gran,
                "vocab": vocab, "prompt_max": prompt_hi, "output_max": out_hi, "load_cycles": cycles, "steps": step}


def fam_dp_multistream(rng):
    n_layers = int(rng.integers(8, 49))
    comm = int(rng.integers(1, 4))  # comm streams 1..comm
    prefetch = comm + 1 if rng.uniform() < 0.5 else None
    layer_bytes = [int(_logu(rng, 1 * MiB, 48 * MiB)) for _ in range(n_layers)]
    act_ratio = _logu(rng, 0.2, 4.0)
    bucket = int(rng.choice([1, 5, 25, 100])) * MiB  # DDP's bucket_cap_mb (25 by default)
    adam = rng.uniform() < 0.7
    batch_in = int(_logu(rng, 1 * MiB, 256 * MiB))
    ev = _Events()
    weights = [ev.alloc(s) for s in layer_bytes]  # model.to(device)
    states = []
    per_step = 4 * n_layers + 2 * (n_layers * 2) + 8
    steps = max(4, min(60, EVENT_BUDGET // (2 * per_step)))
    next_in = ev.alloc(batch_in, prefetch or 0) if prefetch else None
    for step in range(steps):
        jitter = rng.uniform(0.7, 1.0) if step % 7 == 6 else 1.0  # a short batch now and then
        inp = next_in if prefetch else ev.alloc(batch_in * jitter)
        if prefetch:  # the next batch is copied in on its stream while this one computes
            next_in = ev.alloc(batch_in * (rng.uniform(0.7, 1.0) if (step + 1) % 7 == 6 else 1.0), prefetch)
        acts = []
        for li, s in enumerate(layer_bytes):  # forward: a saved output per layer, a scratch freed at once
            acts.append(ev.alloc(s * act_ratio * jitter))
            t = ev.alloc(s * act_ratio * jitter * 0.5)
            ev.free(t)
        grads, pending, filled, k = [], [], 0, 0
        for li in reversed(range(n_layers)):  # backward: grads on stream 0, buckets on the comm streams
            g = ev.alloc(layer_bytes[li])
            t = ev.alloc(layer_bytes[li] * act_ratio * jitter)
            ev.free(acts[li])
            ev.free(t)
            grads.append(g)
            filled += layer_bytes[li]
            if filled >= bucket or li == 0:
                # the bucket's allreduce buffer, on the next comm stream; freed once the compute stream
                # has read the result back (two buckets later): the free is on its own (comm) stream
                pending.append(ev.alloc(filled, 1 + k % comm))
                k += 1
                filled = 0
                while len(pending) > 2:
                    ev.free(pending.pop(0))
        while pending:
            ev.free(pending.pop(0))
        if inp is not None:
            ev.free(inp)
        if adam and not states:
            states = [ev.alloc(s) for s in layer_bytes for _ in range(2)]  # exp_avg, exp_avg_sq at step 1
        for li, s in enumerate(layer_bytes):  # optimizer: a foreach temporary per layer
            t = ev.alloc(s)
            ev.free(t)
        for g in grads:  # zero_grad(set_to_none=True)
            ev.free(g)
    return ev, {"layers": n_layers, "comm_streams": comm, "prefetch_stream": prefetch,
                "params_mib": sum(layer_bytes) // MiB, "act_ratio": round(act_ratio, 2),
                "bucket_mib": bucket // MiB, "adam": adam, "input_mib": batch_in // MiB, "steps": steps}


def fam_tiny_huge(rng):
    burst_hi = _ilogu(rng, 50, 2000)
    rounds = max(10, min(300, (EVENT_BUDGET // 2) // burst_hi))
    keep = rng.uniform(0.0, 0.2)
    p_huge = rng.uniform(0.2, 0.8)
    max_huge = int(rng.integers(1, 4))
    ev, huge, kept = _Events(), [], []
    for _ in range(rounds):
        b = int(rng.integers(max(1, burst_hi // 4), burst_hi + 1))
        at = int(rng.integers(0, b)) if rng.uniform() < p_huge else -1
        burst = []
        for j in range(b):
            if j == at:  # a huge one, in the middle of the burst
                huge.append(ev.alloc(int(rng.uniform(1, 4) * GiB) + int(rng.integers(1, MiB))))
                if len(huge) > max_huge:
                    ev.free(huge.pop(0))
            burst.append(ev.alloc(int(rng.integers(1, 1024))))
            if rng.uniform() < 0.5 and len(burst) > 4:  # frees interleaved with the burst
                ev.free(burst.pop(int(rng.integers(0, len(burst)))))
        for i in burst:
            if rng.uniform() < keep:
                kept.append(i)
            else:
                ev.free(i)
        while len(kept) > 4 * burst_hi:  # the kept ones live a few rounds
            ev.free(kept.pop(0))
    return ev, {"rounds": rounds, "burst_max": burst_hi, "keep": round(keep, 3), "p_huge": round(p_huge, 2),
                "huge_live_max": max_huge}


def fam_ratchet(rng):
    n_tmp = int(rng.integers(5, 41))
    tmp_sizes = [int(_logu(rng, 4 * KiB, 64 * MiB)) for _ in range(n_tmp)]
    iters = max(50, min(1500, EVENT_BUDGET // (2 * n_tmp + 4)))
    q = rng.uniform(0.3, 1.0)
    leak_hi = int(_logu(rng, 16 * KiB, 8 * MiB))
    grow = rng.uniform() < 0.4  # a history tensor re-concatenated every `every` iterations
    every = int(rng.integers(5, 50))
    ev, hist, hist_size = _Events(), None, 0
    for it in range(iters):
        live = []
        for s in tmp_sizes:  # the iteration's own temporaries: a stack that unwinds at the end
            live.append(ev.alloc(s * rng.uniform(0.9, 1.1)))
            if len(live) > 3 and rng.uniform() < 0.4:
                ev.free(live.pop(int(rng.integers(0, len(live) - 1))))
        if rng.uniform() < q:
            if grow:  # the history's growth per iteration at most 1 MiB: it stays under 1.5 GiB
                s = int(rng.integers(512, min(leak_hi, MiB) + 1))
                hist_size += s
                if it % every == 0:
                    new = ev.alloc(hist_size)
                    if hist is not None:
                        ev.free(hist)
                    hist = new
            else:
                ev.alloc(int(rng.integers(512, leak_hi + 1)))  # kept to the end (a list of losses that still hold the graph's tensors)
        for i in reversed(live):
            ev.free(i)
    return ev, {"iterations": iters, "temporaries": n_tmp, "leak_p": round(q, 2), "leak_max": leak_hi,
                "growing_history": grow, "realloc_every": every}


def fam_two_phase(rng):
    kind = str(rng.choice(["small_large", "adjacent_bands"]))
    n_a, n_b = int(rng.integers(3, 13)), int(rng.integers(3, 13))
    if kind == "small_large":
        a = [int(_logu(rng, 4 * KiB, 2 * MiB)) for _ in range(n_a)]
        b = [int(_logu(rng, 4 * MiB, 256 * MiB)) for _ in range(n_b)]
        if rng.uniform() < 0.5:
            a, b = b, a
    else:  # two bands of one octave each, side by side: [x, 2x) and [2x, 4x)
        x = _logu(rng, 256 * KiB, 64 * MiB)
        a = [int(rng.uniform(x, 2 * x)) for _ in range(n_a)]
        b = [int(rng.uniform(2 * x, 4 * x)) for _ in range(n_b)]
    scale = _logu(rng, 0.25, 4.0)  # the second phase's sizes times this: its peak above or below the first's
    b = [max(1, int(s * scale)) if kind == "small_large" else s for s in b]
    periods = int(rng.integers(4, 21))
    per_iter = n_a + n_b  # events of one iteration, averaged over the two phases
    reps = max(3, min(200, EVENT_BUDGET // (periods * per_iter)))
    ev = _Events()
    persistent = [ev.alloc(s) for s in a[:2] + b[:2]]
    for p in range(periods):
        sizes = a if p % 2 == 0 else b
        for _ in range(reps):
            live = []
            for s in sizes:
                live.append(ev.alloc(s))
                if len(live) > 2 and rng.uniform() < 0.3:
                    ev.free(live.pop(0))
            for i in live:
                ev.free(i)
    for i in persistent:
        ev.free(i)
    return ev, {"kind": kind, "sizes_a": len(a), "sizes_b": len(b), "scale_b": round(scale, 2), "periods": periods,
                "reps": reps}


#: name -> (generator, the family's description and ranges, for --help)
FAMILIES = {
    "rmm_uniform": (fam_rmm_uniform,
                    "RMM's random_allocations benchmark: N in [2000, 15000] (log-uniform) allocations over 2N "
                    "steps; each step allocates with 73 % chance while under max_usage, else frees a random "
                    "live one; sizes uniform in [1, max_size], max_size one of 1/4/16/64/256/1024 MiB, "
                    "max_usage log-uniform in [max(1 GiB, 4 max_size), 12 GiB]"),
    "rmm_normal": (fam_rmm_normal, "the same, sizes normal (mean max_size/2, sd max_size/6) clipped to [1, max_size]"),
    "rmm_geometric": (fam_rmm_geometric, "the same, sizes geometric (mean max_size/8, capped at max_size)"),
    "torch_fuzz": (fam_torch_fuzz,
                   "torch test_cuda's caching-allocator fuzz: 4000-20000 steps, each (after freeing random live "
                   "ones while live >= cap, cap log-uniform 0.5-4 GiB) an allocation (weight 1) of a size "
                   "uniform in [lo, hi), lo one of 1 B/512 KiB/2 MiB, hi 20-100 MiB, a free of a random live one "
                   "(weight 1) or an empty_cache (weight 0.1: no event in the format, counted in the meta)"),
    "kv_serving": (fam_kv_serving,
                   "KV-cache serving (Hugging Face generate without a static cache, continuous batching): 2-32 "
                   "layers, K+V 1-8 KiB per token per layer, batch up to 4-32 requests (layers x batch <= 128) whose count and prompt "
                   "lengths rise and fall 1-3 times; prompts 8 to 128-4096 tokens, outputs 4 to 32-512; each "
                   "layer's cache reallocated every 1, 16 or 256 tokens (a new size each time), logits of a "
                   "32k-152k vocabulary per step"),
    "dp_multistream": (fam_dp_multistream,
                       "data-parallel training: 8-48 layers of 1-48 MiB parameters, activations 0.2-4x, grads "
                       "on stream 0, DDP buckets (1/5/25/100 MiB) on 1-3 comm streams round robin, each freed "
                       "two buckets later (in torch a record_stream; the format's free is on the comm stream), "
                       "half with a prefetch stream copying the next batch (1-256 MiB), Adam state (70 %) "
                       "made at step 1, a short batch every 7th step"),
    "tiny_huge": (fam_tiny_huge,
                  "bursts of up to 50-2000 tiny allocations (1-1023 B), half freed inside the burst, 0-20 % kept "
                  "a few rounds, with a huge one (1-4 GiB) inside 20-80 % of bursts, 1-3 huge ones live at most"),
    "ratchet": (fam_ratchet,
                "leak-like: an iteration of 5-40 temporaries (4 KiB-64 MiB, +-10 % per iteration) plus, with "
                "30-100 % chance, one kept allocation (512 B-8 MiB) never freed, or (40 %) a history tensor "
                "reallocated at its new size every 5-50 iterations: live bytes creep upward"),
    "two_phase": (fam_two_phase,
                  "two phases with disjoint size sets alternating 4-20 times, each repeating its iteration: "
                  "3-12 small (4 KiB-2 MiB) against 3-12 large (4-256 MiB, times 0.25-4), or two adjacent "
                  "one-octave bands ([x, 2x) and [2x, 4x), x 256 KiB-64 MiB)"),
}


def generate(family, seed):
    """The Trace of family's workload `seed` (deterministic: same family and seed, same events)."""
    fn = FAMILIES[family][0]
    rng = np.random.default_rng([BASE_SEED, zlib.crc32(family.encode()), seed])
    ev, params = fn(rng)
    meta = {"family": family, "seed": seed, "generator": f"bench/unseen_check.py v{GENERATOR_VERSION}",
            "params": params, **ev.notes}
    return ev.trace(f"{family}_s{seed}", meta)


def _digest(tr):
    h = zlib.crc32(tr.op.tobytes())
    for a in (tr.slot, tr.size, tr.stream):
        h = zlib.crc32(a.tobytes(), h)
    return f"{h:08x}"


def write(tr, folder):
    """Writes tr as folder/NAME_HASH.npz (+ .json sidecar); returns the path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{tr.name}_{_digest(tr)}.npz")
    if not os.path.exists(path):
        tmp = path + f".{os.getpid()}.tmp.npz"
        np.savez(tmp, op=tr.op, id=tr.slot.astype(np.int64), size=tr.size, stream=tr.stream)
        with open(path[:-4] + ".json", "w") as f:
            json.dump({**tr.meta, "events": tr.n_events, "allocs": tr.n_allocs,
                       "peak_live_bytes": peak_live_bytes(tr)}, f, indent=1)
        os.replace(tmp, path)
    return path


def _gen_job(job):
    family, seed, folder = job
    tr = generate(family, seed)
    return family, seed, write(tr, folder), tr.n_events, tr.n_allocs, peak_live_bytes(tr)


def _replay_job(job):
    path, knobs, cache = job
    key = os.path.basename(path)[:-4] + ":-1"
    mine = os.path.join(cache, key + ".calls.json")
    if not os.path.exists(mine):  # the model's calls too (placement_check's cache keeps its memory only)
        from ascend_pool.bench import torch_npu_policy
        from ascend_pool.bench.peers import second_half_allocs

        tr = load_trace(path)
        r = torch_npu_policy.replay(tr)
        half = second_half_allocs(tr)
        ref = {"peak_reserved_bytes": r["peak_reserved_bytes"],
               "waste_bytes": r["peak_reserved_bytes"] - peak_live_bytes(tr)}
        with open(os.path.join(cache, key + ".json"), "w") as f:  # what placement_check._one reads
            json.dump(ref, f)
        with open(mine, "w") as f:
            json.dump({**ref, "steady_pct": 100.0 * r["device_calls_steady"] / half if half else None,
                       "whole_pct": 100.0 * r["device_calls"] / tr.n_allocs if tr.n_allocs else None}, f)
    row = placement_check._one((path, -1, knobs, cache))
    with open(mine) as f:
        ref = json.load(f)
    row["reference_peak_mib"] = ref["peak_reserved_bytes"] / MiB
    row["reference_steady_pct"], row["reference_whole_pct"] = ref["steady_pct"], ref["whole_pct"]
    # a miss the model does not make: the policy's own calls, not the workload's growth
    row["policy_miss"] = (_misses(row["steady_pct"], row["whole_pct"])
                          and not _misses(ref["steady_pct"], ref["whole_pct"]))
    return row


def _misses(steady, whole):
    return (steady or 0) > STEADY_TARGET_PCT or (whole or 0) > WHOLE_TARGET_PCT


def explain(path, knobs):
    """replay --json's figures for one workload and its device calls by kind and half."""
    from ascend_pool.backend import open_backend
    from ascend_pool.bench import torch_npu_policy
    from ascend_pool.replay import replay
    from call_sources import call_sources

    tr = load_trace(path)
    r = replay(tr, backend=open_backend("sim"), pool_knobs=knobs)
    ref = torch_npu_policy.replay(tr)
    s = r["pool_stats"]
    c = call_sources(tr, knobs)
    # the same placement without trades: tells a peak the releases raised from one placement made
    never = replay(tr, backend=open_backend("sim"), pool_knobs={**knobs, "release_policy": "never"})
    return {"path": path, "events": tr.n_events, "allocs": tr.n_allocs, "peak_live_mib": r["peak_live_bytes"] / MiB,
            "peak_reserved_mib": r["peak_reserved_bytes"] / MiB, "never_reserved_mib": never["peak_reserved_bytes"] / MiB,
            "reference_reserved_mib": ref["peak_reserved_bytes"] / MiB,
            "fragmentation_at_peak": r["fragmentation_ratio"], "reference_fragmentation": ref["fragmentation_ratio"],
            "device_mallocs": r["device_mallocs"], "device_frees": r["device_frees"],
            "maps": s["num_device_map"], "unmaps": s["num_device_unmap"], "device_calls_steady": r["device_calls_steady"],
            "reference_device_calls": ref["device_calls"], "sources": c}


def _print_explain(e):
    c = e["sources"]
    print(f"  {os.path.basename(e['path'])}: {e['events']:,} events; peak live {e['peak_live_mib']:.1f} MiB, "
          f"reserved {e['peak_reserved_mib']:.1f} (release_policy never {e['never_reserved_mib']:.1f}, torch_npu_policy "
          f"{e['reference_reserved_mib']:.1f}); frag. at peak "
          f"{e['fragmentation_at_peak']:.3f} ({e['reference_fragmentation']:.3f}); device mallocs {e['device_mallocs']} "
          f"frees {e['device_frees']} maps {e['maps']} unmaps {e['unmaps']} (reference {e['reference_device_calls']} "
          f"calls); first half: peak {c['peak'][0]} refill {c['refill'][0]} release {c['release'][0]}; second half: "
          f"peak {c['peak'][1]} refill {c['refill'][1]} release {c['release'][1]} of {c['second_half_allocs']} allocs",
          flush=True)


def _fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def main(argv=None):
    epilog = "families (ranges per seed):\n" + "\n".join(
        f"  {name}: {desc}" for name, (_, desc) in FAMILIES.items())
    ap = argparse.ArgumentParser(description=__doc__, epilog=epilog,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", action="append", choices=list(FAMILIES),
                    help="only this family (repeatable; default: all)")
    ap.add_argument("--seeds", type=int, default=20, help="workloads per family (1-1000, default 20)")
    ap.add_argument("--first", type=int, default=0, help="first seed (default 0)")
    ap.add_argument("--expandable", action="store_true", help="expandable segments")
    ap.add_argument("--policy", choices=["budgeted", "under_peak", "never"], help="release_policy (default: the pool's)")
    ap.add_argument("--dir", default=os.path.join(os.path.expanduser("~"), ".cache", "ascend_pool_unseen"),
                    help="folder the workloads are written to (NAME_HASH.npz; default ~/.cache/ascend_pool_unseen)")
    ap.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "ascend_pool_reference"),
                    help="folder for the reference model's figures (placement_check's)")
    ap.add_argument("--jobs", type=int, default=2, help="processes (default 2)")
    ap.add_argument("--explain", type=int, default=0, metavar="K",
                    help="replay again the K workloads most above torch_npu_policy's peak and the K with the "
                         "highest device-call rates where the model meets the targets, and print why "
                         "(peak live / reserved / reference, device calls by kind and half)")
    ap.add_argument("--save", help="write this run's figures here (JSON)")
    ap.add_argument("--generate-only", action="store_true", help="write the workloads, replay nothing")
    a = ap.parse_args(argv)
    if not 1 <= a.seeds <= 1000:
        ap.error(f"--seeds must be 1-1000, got {a.seeds}")
    if not 0 <= a.first <= 10 ** 6:
        ap.error(f"--first must be 0-1000000, got {a.first}")
    if not 1 <= a.jobs <= 64:
        ap.error(f"--jobs must be 1-64, got {a.jobs}")
    families = a.family or list(FAMILIES)
    knobs = {"expandable_segments": True} if a.expandable else {}
    if a.policy:
        knobs["release_policy"] = a.policy
    os.makedirs(a.cache, exist_ok=True)
    t0 = time.time()
    jobs = [(f, s, a.dir) for f in families for s in range(a.first, a.first + a.seeds)]
    with multiprocessing.Pool(a.jobs, initializer=placement_check._init) as pool:
        made = pool.map(_gen_job, jobs, chunksize=1)
        t_gen = time.time() - t0
        if a.generate_only:
            for f, s, p, n, al, live in made:
                print(f"{p}  {n:,} events, {al:,} allocs, peak live {live / MiB:,.1f} MiB")
            return 0
        rows = pool.map(_replay_job, [(p, knobs, a.cache) for _, _, p, _, _, _ in made], chunksize=1)
    for (f, s, p, n, al, live), r in zip(made, rows):
        r.update(family=f, seed=s, path=p, events=n, allocs=al, peak_live_mib=live / MiB)
        print(f"{f + '_s' + str(s):22} {n:7,} ev  live {live / MiB:9,.1f}  ap {r['peak_mib']:7,} MiB  ref "
              f"{r['reference_peak_mib']:9,.1f} MiB  {r['calls']:5} calls {r['steady']:4} steady "
              f"({_fmt(r['steady_pct'], '.2f')} %, whole {_fmt(r['whole_pct'], '.2f')} %; ref "
              f"{_fmt(r['reference_steady_pct'], '.2f')} %, {_fmt(r['reference_whole_pct'], '.2f')} %)  "
              f"{_fmt(r['waste_reduction_pct'], '6.1f')} %{'  RESERVES MORE' if r['reserves_more'] else ''}")
    mode = "expandable segments" if a.expandable else "classic segments"
    print(f"\n{mode}{', release_policy ' + a.policy if a.policy else ''}; per family:")
    per = {}
    for f in families:
        mine = [r for r in rows if r["family"] == f]
        o = summarize(mine)
        o["policy_misses"] = sum(r["policy_miss"] for r in mine)
        per[f] = o
        print(f"  {f:15} {o['workloads']:3} workloads: reduction mean {_fmt(o['mean'])} %, min {_fmt(o['min'])} %; "
              f"reserve more: {o['reserves_more']}; worst steady {_fmt(o['worst_steady_pct'], '.2f')} %, whole "
              f"{_fmt(o['worst_whole_pct'], '.2f')} %; miss a call target: {o['misses_call_target']} "
              f"({o['policy_misses']} where torch_npu_policy meets it)")
    o = summarize(rows)
    o["policy_misses"] = sum(r["policy_miss"] for r in rows)
    print(f"{o['workloads']} workloads: waste reduction mean {_fmt(o['mean'], '.2f')} %, min {_fmt(o['min'])} % "
          f"({o.get('worst_reduction_workload', '-')}); reserve more than torch_npu_policy: {o['reserves_more']}; "
          f"miss a call target (steady > 1 % or whole > 3 %): {o['misses_call_target']} (worst steady "
          f"{_fmt(o['worst_steady_pct'], '.2f')} % {o.get('worst_steady_workload', '-')}), "
          f"{o['policy_misses']} where torch_npu_policy meets it; "
          f"{time.time() - t0:.0f} s ({t_gen:.0f} s generating)", flush=True)
    explained = []
    if a.explain:
        # the most MiB above the model, then the highest call rates where the model meets the target
        above = sorted((r for r in rows if r["reserves_more"]), key=lambda r: r["reference_peak_mib"] - r["peak_mib"])
        calls = sorted((r for r in rows if r["policy_miss"]),
                       key=lambda r: -max((r["steady_pct"] or 0) / STEADY_TARGET_PCT, (r["whole_pct"] or 0) / WHOLE_TARGET_PCT))
        picks = []
        for r in above[:a.explain] + calls[:a.explain]:
            if r["path"] not in picks:
                picks.append(r["path"])
        print("\nwhy (replay figures; device calls by kind and half, bench/call_sources.py; the peak without "
              "trades, release_policy never):")
        for p in picks:
            e = explain(p, knobs)
            explained.append(e)
            _print_explain(e)
    if a.save:
        with open(a.save, "w") as f:
            json.dump({"knobs": knobs, "families": families, "seeds": [a.first, a.first + a.seeds],
                       "generator_version": GENERATOR_VERSION, "overall": o, "per_family": per, "rows": rows,
                       "explained": explained}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

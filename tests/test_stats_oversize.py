"""PyTorch's oversize figures in memory_stats(): allocations and segments of max_split_size or more
(never split), and max_split_size itself, which torch.cuda.memory_summary() reads."""
import pytest

import ascend_pool as ap

MiB = 2**20


def oversize(pool):
    s = pool.memory_stats()
    return {k: s[k] for k in s if k.startswith("oversize_")}, s["max_split_size"]


@pytest.mark.parametrize("expandable", [False, True])
def test_oversize_allocations_and_segments_follow_max_split_size(expandable):
    pool = ap.Pool(0, backend="sim", max_split_size_mb=32, expandable_segments=expandable)
    try:
        big, small = pool.malloc(40 * MiB), pool.malloc(4 * MiB)
        figs, mss = oversize(pool)
        assert mss == 32 * MiB
        assert figs["oversize_allocations.current"] == 1 and figs["oversize_allocations.allocated"] == 1
        assert figs["oversize_segments.current"] >= 1
        pool.free(big)
        pool._check_invariants()  # the counters agree with a recount of blocks and segments
        figs, _ = oversize(pool)
        assert (figs["oversize_allocations.current"], figs["oversize_allocations.peak"],
                figs["oversize_allocations.freed"]) == (0, 1, 1)
        pool.free(small)
        pool.empty_cache()
        pool._check_invariants()
        figs, _ = oversize(pool)
        assert figs["oversize_segments.current"] == 0
        assert figs["oversize_segments.freed"] == figs["oversize_segments.allocated"] >= 1
        pool.reset_peak_stats()
        pool.reset_accumulated_stats()
        figs, _ = oversize(pool)
        assert all(v == 0 for v in figs.values()), figs
    finally:
        pool.close()


def test_without_max_split_size_nothing_is_oversize():
    pool = ap.Pool(0, backend="sim")
    try:
        pool.free(pool.malloc(200 * MiB))
        figs, mss = oversize(pool)
        assert mss == -1  # torch reports its unset (SIZE_MAX) limit as -1
        assert set(figs) == {f"oversize_{w}.{k}" for w in ("allocations", "segments")
                             for k in ("current", "peak", "allocated", "freed")}
        assert all(v == 0 for v in figs.values()), figs
    finally:
        pool.close()


def test_torch_memory_summary_reads_our_stats(monkeypatch):
    memory = pytest.importorskip("torch.cuda.memory")
    pool = ap.Pool(0, backend="sim", max_split_size_mb=32)
    try:
        keep = pool.malloc(40 * MiB)
        monkeypatch.setattr(memory, "memory_stats", lambda device=None: pool.memory_stats())
        text = memory.memory_summary(device=0)
        assert "Oversize allocations" in text and "Oversize GPU segments" in text
        row = next(line for line in text.splitlines() if "Oversize allocations" in line)
        assert row.split("|")[2].strip() == "1"  # current
        pool.free(keep)
    finally:
        pool.close()


@pytest.mark.parametrize("abbreviated", [False, True])
def test_our_memory_summary_shows_the_oversize_rows_as_torchs(abbreviated):
    # torch.cuda.memory_summary ends with "Oversize allocations" and "Oversize GPU segments"
    # (abbreviated too); ours had neither, so the figures were in memory_stats() alone
    pool = ap.Pool(0, backend="sim", max_split_size_mb=32)
    try:
        keep = pool.malloc(40 * MiB)
        text = pool.memory_summary(abbreviated=abbreviated)
        for title, key in (("Oversize allocations", "oversize_allocations"), ("Oversize segments", "oversize_segments")):
            row = next(line for line in text.splitlines() if line.startswith(title))
            st = pool.memory_stats()
            assert row.split()[-4:] == [str(st[f"{key}.{m}"]) for m in ("current", "peak", "allocated", "freed")]
        assert next(line for line in text.splitlines() if line.startswith("Oversize allocations")).split()[-4] == "1"
        pool.free(keep)
    finally:
        pool.close()

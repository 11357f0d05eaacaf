"""Derived figures and the readable summary of a pool's counters."""

from .units import format_bytes


def external_fragmentation(stats):
    """The fragmentation ratio, one meaning everywhere (memory_stats, the metric, bench and replay
    JSON): 1 - largest free block / cached free bytes, in 0..1, 0 when nothing is cached. stats:
    a mapping with cached_free_bytes and largest_free_block_bytes (bytes)."""
    cached = stats["cached_free_bytes"]
    if cached <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - stats["largest_free_block_bytes"] / cached))


def with_derived(raw):
    """Adds fragmentation figures to the raw counters (all in bytes or ratios):
    external_fragmentation (see external_fragmentation()),
    internal_waste_bytes = active (rounded) - requested bytes: both count a block freed after
    record_stream until its free completes, as PyTorch's."""
    out = dict(raw)
    out["external_fragmentation"] = external_fragmentation(raw)
    out["internal_waste_bytes"] = raw["active_bytes.all.current"] - raw["requested_bytes.all.current"]
    return out


def _accumulated(key):
    return key.endswith((".allocated", ".freed")) or key.startswith("num_")


def baseline(stats):
    """The accumulated counters of stats (the .allocated and .freed values and the num_* event
    counts), which reset_accumulated_stats subtracts from then on."""
    return {k: v for k, v in stats.items() if _accumulated(k) and isinstance(v, int)}


def minus_baseline(stats, base):
    """stats with base's counters subtracted (no-op when base is None)."""
    if base:
        for k, v in base.items():
            if k in stats:
                stats[k] -= v
    return stats


_ROWS = (
    ("Allocated memory", "allocated_bytes", True),
    ("Active memory", "active_bytes", True),
    ("Requested memory", "requested_bytes", True),
    ("Reserved memory", "reserved_bytes", True),
    ("Non-releasable memory", "inactive_split_bytes", True),
    ("Allocations", "allocation", False),
    ("Active allocs", "active", False),
    ("Reserved segments", "segment", False),
    ("Non-releasable allocs", "inactive_split", False),
)


_KINDS = (("all", "all"), ("small_pool", "small"), ("large_pool", "large"))

# torch.cuda.memory_summary's last rows (no per-pool split, shown abbreviated too): blocks and
# segments of max_split_size_mb or more, which are never split
_OVERSIZE_ROWS = (("Oversize allocations", "oversize_allocations"), ("Oversize segments", "oversize_segments"))


def summary(stats, device, backend_name, abbreviated=False):
    """A fixed-width table of current/peak/allocated/freed per pool (abbreviated: the "all" rows
    only, as torch.cuda.memory_summary(abbreviated=True)), then the pool's own figures."""
    fmt = lambda v, b: format_bytes(v) if b else str(v)  # noqa: E731
    lines = [f"ascend_pool memory summary, device {device} ({backend_name})",
             f"{'metric':<24}{'pool':<8}{'current':>14}{'peak':>14}{'allocated':>14}{'freed':>14}"]
    for title, key, is_bytes in _ROWS:
        for kind, label in _KINDS[:1] if abbreviated else _KINDS:
            vals = [stats[f"{key}.{kind}.{m}"] for m in ("current", "peak", "allocated", "freed")]
            lines.append(f"{title if kind == 'all' else '':<24}{label:<8}" + "".join(f"{fmt(v, is_bytes):>14}" for v in vals))
    for title, key in _OVERSIZE_ROWS:
        vals = [stats[f"{key}.{m}"] for m in ("current", "peak", "allocated", "freed")]
        lines.append(f"{title:<24}{'all':<8}" + "".join(f"{v:>14}" for v in vals))
    lines += [
        f"cached free {format_bytes(stats['cached_free_bytes'])}, largest free block "
        f"{format_bytes(stats['largest_free_block_bytes'])}, external fragmentation "
        f"{stats['external_fragmentation']:.3f}, internal waste {format_bytes(stats['internal_waste_bytes'])}",
        f"pending frees {stats['pending_free_blocks']} ({format_bytes(stats['pending_free_bytes'])}), "
        f"device mallocs {stats['num_device_alloc']}, device frees {stats['num_device_free']}, "
        f"retries {stats['num_alloc_retries']}, OOMs {stats['num_ooms']}",
        # 0 of 0: a device whose pool was never opened (its figures read without a context)
        f"device memory: {format_bytes(stats['device_free_bytes'])} free of {format_bytes(stats['device_total_bytes'])}"
        if stats['device_total_bytes'] else "device memory: not read (no pool of this device is open)",
    ]
    return "\n".join(lines)

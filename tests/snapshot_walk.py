"""The snapshot walk the stateful model tests (test_reliability_property.py,
test_pool_stateful_knobs.py) check a pool with after each step."""


def walk_segments(snap, pi, live_spans, seg_spans):
    """Checks that the blocks of each segment of `snap` (pool number pi's snapshot) tile it in
    address order; adds (start, end, pi) of each block not inactive to live_spans and of each
    segment to seg_spans. Returns the addresses of its allocated blocks, the requested bytes of
    its blocks freed after record_stream (requested until the free completes, as torch's), and
    its segments' bytes."""
    active, pending_requested, seg_bytes = set(), 0, 0
    for seg in snap["segments"]:
        cursor = seg["address"]
        for b in seg["blocks"]:
            assert b["address"] == cursor, "blocks must tile their segment in address order"
            cursor += b["size"]
            if b["state"] != "inactive":
                live_spans.append((b["address"], b["address"] + b["size"], pi))
            if b["state"] == "active_allocated":
                active.add(b["address"])
            elif b["state"] == "active_pending_free":
                pending_requested += b["requested_size"]
        assert cursor == seg["address"] + seg["total_size"], "block sizes must add up to the segment"
        seg_spans.append((seg["address"], seg["address"] + seg["total_size"], pi))
        seg_bytes += seg["total_size"]
    return active, pending_requested, seg_bytes

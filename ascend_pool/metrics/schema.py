"""The metric families ascend_pool exports, and the per-(device, tenant) fields they are built from.

One table serves the in-process collector, the shared-memory stats file (whose record layout is
FIELDS in this order) and the node service, so a metric cannot mean one thing in-process and
another on the node. Units are base units: bytes, counts; ratios are 0..1.

A *field* is one int64 figure of one (device, tenant) in one process:
  - gauges are summed across the pools of that (device, tenant), except largest_free_block_bytes
    (the max), quota_bytes (the max; -1 = no quota) and the device figures (the same for every pool
    of a device; taken from any);
  - counters are monotonic over the process's life: the last values of closed pools are kept
    (see sample.PoolAggregator), so a pool that comes and goes does not make rate() see a reset.
"""

# Fields with a small/large split, as (field prefix, memory_stats() key stem).
POOL_GAUGES = (
    ("reserved_bytes", "reserved_bytes"),
    ("allocated_bytes", "allocated_bytes"),
    ("requested_bytes", "requested_bytes"),
    ("segments", "segment"),
)
POOL_COUNTERS = (("allocations", "allocation"),)
POOL_KINDS = ("small", "large")  # the `pool` label values; memory_stats() says small_pool/large_pool

# Fields without a pool split: (field, memory_stats() key or None when not read from the stats).
PLAIN_GAUGES = (
    ("cached_free_bytes", "cached_free_bytes"),
    ("largest_free_block_bytes", "largest_free_block_bytes"),
    ("pending_free_bytes", "pending_free_bytes"),
    ("quota_bytes", None),  # getattr(pool, "quota_bytes", None); -1 = no quota
)
DEVICE_GAUGES = (
    ("device_free_bytes", "device_free_bytes"),
    ("device_total_bytes", "device_total_bytes"),
)
PLAIN_COUNTERS = (
    ("device_mallocs", "num_device_alloc"),
    ("device_frees", "num_device_free"),
    ("ooms", "num_ooms"),
    ("quota_exceeded", "num_quota_exceeded"),
    ("alloc_retries", "num_alloc_retries"),
)

NO_QUOTA = -1


def _pool_fields(prefixes):
    return tuple(f"{prefix}.{kind}" for prefix, _ in prefixes for kind in POOL_KINDS)


#: Every field of a (device, tenant) record, in the stats file's order. Append only, and bump
#: service.layout.VERSION when this changes: readers check the record size and the version.
FIELDS = (_pool_fields(POOL_GAUGES) + tuple(f for f, _ in PLAIN_GAUGES) + tuple(f for f, _ in DEVICE_GAUGES)
          + _pool_fields(POOL_COUNTERS) + tuple(f for f, _ in PLAIN_COUNTERS)
          + ("quota_warn_ppm",))  # the tenant's warn ratio in millionths (0: none); exported as a ratio
#: Fields that are counters (kept monotonic across pool lifetimes).
COUNTER_FIELDS = frozenset(_pool_fields(POOL_COUNTERS) + tuple(f for f, _ in PLAIN_COUNTERS))

# Exported families: (metric name without _total, type, help, field or field prefix, split by pool).
FAMILIES = (
    ("ascend_pool_reserved_bytes", "gauge",
     "Device memory held by the pool in segments (bytes).", "reserved_bytes", True),
    ("ascend_pool_allocated_bytes", "gauge",
     "Bytes handed out to callers, rounded to block sizes (bytes).", "allocated_bytes", True),
    ("ascend_pool_requested_bytes", "gauge",
     "Bytes callers asked for, before rounding (bytes).", "requested_bytes", True),
    ("ascend_pool_segments", "gauge",
     "Device segments the pool holds.", "segments", True),
    ("ascend_pool_cached_free_bytes", "gauge",
     "Reserved bytes not allocated: the pool's cache (bytes).", "cached_free_bytes", False),
    ("ascend_pool_largest_free_block_bytes", "gauge",
     "Largest free block in the cache: the biggest request served without a device call (bytes).",
     "largest_free_block_bytes", False),
    ("ascend_pool_pending_free_bytes", "gauge",
     "Bytes freed but not yet reusable: waiting on stream events (bytes).", "pending_free_bytes", False),
    ("ascend_pool_allocations", "counter",
     "Allocations served by the pool.", "allocations", True),
    ("ascend_pool_device_mallocs", "counter",
     "Device allocation calls the pool made (aclrtMalloc; with expandable segments, each physical chunk mapped).",
     "device_mallocs", False),
    ("ascend_pool_device_frees", "counter",
     "Device free calls (aclrtFree) the pool made.", "device_frees", False),
    ("ascend_pool_ooms", "counter",
     "Requests that failed for lack of device memory (or the pool's limit) after trim and retry.",
     "ooms", False),
    ("ascend_pool_quota_exceeded", "counter",
     "Requests refused because the tenant's quota would be exceeded.", "quota_exceeded", False),
    ("ascend_pool_alloc_retries", "counter",
     "Device allocations retried after the pool released cached memory.", "alloc_retries", False),
)
FRAGMENTATION = ("ascend_pool_fragmentation_ratio",
                 "External fragmentation of the cache: 1 - largest free block / cached free bytes (0..1).")
QUOTA = ("ascend_pool_quota_bytes", "The tenant's byte quota on this device (bytes); absent when it has none.")
QUOTA_WARN = ("ascend_pool_quota_warn_ratio",
              "The tenant's warn level as a fraction of its quota (0..1): the near-quota alert's threshold; "
              "absent when it has no quota or no warn level.")
WARN_PPM = 1_000_000  # quota_warn_ppm units per 1.0
DEVICE_FAMILIES = (
    ("ascend_pool_device_free_bytes", "Free device memory as the runtime reports it (aclrtGetMemInfo, bytes).",
     "device_free_bytes"),
    ("ascend_pool_device_total_bytes", "Total device memory as the runtime reports it (aclrtGetMemInfo, bytes).",
     "device_total_bytes"),
)

"""The binary layout of a process's stats file (one file per process, little-endian).

    header (HEADER_SIZE = 128 bytes)
      off  size  field
        0     8  magic          b"APSTATS\\0"
        8     4  version        u32, VERSION; any layout change bumps it
       12     4  header_size    u32, 128
       16     4  record_size    u32, RECORD_SIZE
       20     4  capacity       u32, record slots in the file (file size = 128 + capacity * record_size)
       24     4  pid            i32, the writing process, in its own pid namespace (a label)
       28     4  uid            u32, its host uid (identity.host_uid: the file owner's, translated)
       32     8  start_time     u64, the process's start time in that namespace, clock ticks after boot
       40    16  boot_id        the kernel's boot id (/proc/sys/kernel/random/boot_id, raw 16 bytes)
       56     8  seq            u64, seqlock: odd while the owner writes, even when the data is whole
       64     8  publish_ns     u64, wall-clock time of the last publish (ns since the epoch)
       72     4  n_records      u32, records in use (<= capacity)
       76     4  flags          u32, FLAG_OVERFLOW | FLAG_EXITED
       80     4  crc            u32, zlib.crc32 of bytes 64..80 and of the n_records records in use
       84     4  reserved       zero
       88     8  instance       u64, the writer's instance id (ascend_pool/identity.py): also its file name
       96     8  pidns          u64, inode of the writer's pid namespace (what `pid` is relative to)
      104    24  reserved       zero

Liveness: the writer holds flock(LOCK_EX) on its file for its whole life; the kernel drops it when
the writer dies, in whatever pid namespace. A reader that can take the lock knows the file is
stale. No decision rests on the pid (it may belong to another namespace).
    record (RECORD_SIZE bytes), capacity of them after the header
        0     4  device         i32
        4     4  tenant_len     u32, bytes of tenant used (<= TENANT_MAX)
        8    64  tenant         UTF-8, zero padded
       72  8*N  values          i64 each, schema.FIELDS in order (bytes, counts; quota -1 = none)

Why a CRC besides the seqlock: the writer is Python storing into a shared mapping with no memory
barriers, so on a weakly ordered CPU (the aarch64 hosts Ascend cards sit in) a reader could see
the even sequence number before the data it guards. The CRC turns such a torn read into a retry.
"""

import struct
import zlib

from ..metrics.schema import FIELDS

MAGIC = b"APSTATS\0"
VERSION = 3                    # 2: named by instance, liveness by lock; 3: quota_warn_ppm
HEADER_SIZE = 128
TENANT_MAX = 64
N_FIELDS = len(FIELDS)
RECORD_SIZE = 8 + TENANT_MAX + 8 * N_FIELDS
# (device, tenant) pairs per process: 8 devices x 8 tenants open, and the 64 closed pairs whose
# counters the process keeps (metrics.sample.PoolAggregator.RETIRED_KEEP): with 64 in all, a
# service naming a tenant per job overflowed beside its first open pool, and `ascend-pool serve`
# lost counters the in-process exporter kept.
# A process with more has its file remade larger (StatsFile.max_capacity; the publisher's, up to
# MAX_CAPACITY): a ledger holds 64 tenants per device, so 4 devices of 40 tenants are 160 live pairs.
DEFAULT_CAPACITY = 64 + 64
MAX_CAPACITY = 4096            # readers refuse more: a file claiming more is not ours
FLAG_OVERFLOW = 1              # the process had more (device, tenant) pairs than capacity
FLAG_EXITED = 2                # the owner exited cleanly: the records are its final counters

# The parts of the header, as struct formats with their offsets.
STATIC = struct.Struct("<8sIIIIiIQ16s")   # magic .. boot_id, offset 0
SEQ = struct.Struct("<Q")                 # offset 56
SEQ_OFFSET = 56
DYNAMIC = struct.Struct("<QII")           # publish_ns, n_records, flags, offset 64
DYNAMIC_OFFSET = 64
CRC = struct.Struct("<I")                 # offset 80
CRC_OFFSET = 80
IDENTITY = struct.Struct("<QQ")           # instance, pidns, offset 88
IDENTITY_OFFSET = 88
RECORD = struct.Struct(f"<iI{TENANT_MAX}s{N_FIELDS}q")

assert STATIC.size == SEQ_OFFSET and RECORD.size == RECORD_SIZE


def file_size(capacity):
    """Bytes of a stats file with `capacity` record slots."""
    return HEADER_SIZE + capacity * RECORD_SIZE


def encode_tenant(name):
    """(bytes, length): the tenant name as UTF-8, cut at a character boundary to TENANT_MAX bytes."""
    raw = name.encode("utf-8", "replace")[:TENANT_MAX]
    while raw:
        try:
            raw.decode("utf-8")
            break
        except UnicodeDecodeError:
            raw = raw[:-1]
    return raw, len(raw)


def pack_record(device, tenant, values):
    """One record's bytes; values: a mapping holding every schema field (ints)."""
    raw, n = encode_tenant(tenant)
    return RECORD.pack(device, n, raw, *(int(values[f]) for f in FIELDS))


def checksum(dynamic_bytes, records_bytes):
    """The CRC stored at CRC_OFFSET: over the dynamic header part and the records in use."""
    return zlib.crc32(records_bytes, zlib.crc32(dynamic_bytes)) & 0xFFFFFFFF

"""The reader's side of a stats file: validate everything, trust nothing, never block the writer.

A file is read with pread() into private memory, never mapped: a file truncated under a mapping
would kill the reader with SIGBUS. Before its records are believed, a file must be a regular,
non-symlink file owned by an allowed uid, not writable by group or others, of exactly the size
its header declares, with our magic, version, record size and the instance id of its name, and
written by a process that is still running: its writer holds flock(LOCK_EX) on it for life, so a
reader that can take the lock knows the writer is gone, in whatever pid namespace either runs
(the pid in the header is a label; it is looked at only when it belongs to the reader's own
namespace). Its records must pass the seqlock and CRC checks and hold sane values. Anything else
raises Refused (not ours, or damaged: logged, left alone) or Stale (its process is gone: the
caller removes it).
"""

import fcntl
import os
import stat
import struct
import time
from dataclasses import dataclass, field

from . import layout as L
from . import paths
from .. import identity
from ..metrics.sample import TenantSample
from ..metrics.schema import FIELDS, NO_QUOTA
from ..private_dir import is_trusted

MAX_DEVICE = 1024       # more devices than any node has: a record claiming more is corrupt
READ_ATTEMPTS = 20      # seqlock retries before giving up on this scrape (the writer takes ~µs)
RETRY_SLEEP_S = 0.0005


class StatsFileError(Exception):
    """Base: a stats file that is not read this time. .reason is one short line."""

    def __init__(self, path, reason):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class Refused(StatsFileError):
    """Not a valid stats file of a live process we may trust (foreign, damaged, or unknown format)."""


class OtherVersion(Refused):
    """Another ascend_pool build's stats file (another layout version: a rolling upgrade) whose
    writer runs: skipped, counted apart from the refused (damaged or foreign) ones."""


class Stale(StatsFileError):
    """A well-formed stats file whose process has exited (or whose pid now names another process).
    .stats: its last whole publish (ProcessStats, the final counters of a process that exited
    cleanly), or None when it cannot be read or is from an earlier boot: what the node service
    folds into its node counters before removing the file."""

    def __init__(self, path, reason, stats=None):
        super().__init__(path, reason)
        self.stats = stats


class Busy(StatsFileError):
    """The owner was writing during every attempt; try at the next scrape."""


@dataclass
class ProcessStats:
    """One process's published figures."""

    pid: int            # in the writer's own pid namespace (pidns): a label
    uid: int
    start_time: int
    publish_ns: int
    flags: int
    path: str
    samples: list = field(default_factory=list)
    instance: str = ""  # 16 hex digits, unique on the node
    pidns: int = 0


def read_stats_file(path, allowed_uids, allowed_gids=()):
    """Reads and validates the stats file at path. Returns ProcessStats; raises Refused or Stale."""
    inst = paths.instance_of(os.path.basename(path))
    if inst is None:
        raise Refused(path, "name is not ascend_pool-stats-<16 hex digits>")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise Stale(path, "removed while being read") from None
    except OSError as e:  # ELOOP for a symlink, EACCES for a file we may not read
        raise Refused(path, f"cannot open: {e.strerror}" + (" (a symlink?)" if e.errno == 40 else "")) from None
    try:
        return _read(fd, path, inst, allowed_uids, allowed_gids)
    finally:
        os.close(fd)


def _in_group_dir(path, gid):
    """True when path lies in the 2770 directory of group gid (ascend_pool/private_dir.py)."""
    try:
        return is_trusted(os.lstat(os.path.dirname(path)), "g", identity.host_gid(gid))
    except OSError:
        return False


def _writer_alive(fd):
    """True while the writer holds its lock on the file (see the module doc)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _other_version(fd, path, header):
    """Another ascend_pool build's file (our magic, another layout version: a rolling upgrade), told
    by its first 12 bytes and its writer's lock, which every layout version since 2 takes for the
    writer's life: Stale (removed) once its writer is gone, its counters not read (their layout is
    not this one's); before, a dead one was refused at every scan and stayed for good. Refused
    (skipped, counted) while its writer runs. Nothing for a file of this version."""
    if len(header) < 12 or header[:8] != L.MAGIC:
        return
    (version,) = struct.unpack_from("<I", header, 8)
    if version == L.VERSION:
        return
    if not _writer_alive(fd):
        raise Stale(path, f"process has exited (another ascend_pool build's file, layout version {version})")
    raise OtherVersion(path, f"layout version {version}, this reader knows {L.VERSION}: another ascend_pool build's live "
                  "process (a rolling upgrade), not exported until it ends")


def _read(fd, path, inst, allowed_uids, allowed_gids=()):
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise Refused(path, "not a regular file")
    owner = identity.owner_host_uid(st.st_uid)  # allowed_uids and the header: the host's uids
    by_group = owner not in allowed_uids
    if by_group and not (st.st_gid in allowed_gids and _in_group_dir(path, st.st_gid)):
        raise Refused(path, f"owned by uid {st.st_uid}, not by an allowed uid ({sorted(allowed_uids)})")
    if st.st_mode & 0o022:
        raise Refused(path, f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})")
    header = os.pread(fd, L.HEADER_SIZE, 0)
    _other_version(fd, path, header)
    if st.st_size < L.HEADER_SIZE:
        raise Refused(path, f"truncated: {st.st_size} bytes, a header alone is {L.HEADER_SIZE}")
    if len(header) < L.HEADER_SIZE:
        raise Refused(path, "truncated while being read")
    magic, version, header_size, record_size, capacity, hpid, uid, start, boot = L.STATIC.unpack_from(header, 0)
    if magic != L.MAGIC:
        raise Refused(path, f"bad magic {magic!r}: not an ascend_pool stats file")
    if version != L.VERSION:
        raise Refused(path, f"layout version {version}, this reader knows {L.VERSION} (mixed ascend_pool versions?)")
    if header_size != L.HEADER_SIZE or record_size != L.RECORD_SIZE:
        raise Refused(path, f"header/record size {header_size}/{record_size}, expected {L.HEADER_SIZE}/{L.RECORD_SIZE}")
    if not 0 < capacity <= L.MAX_CAPACITY:
        raise Refused(path, f"capacity {capacity} out of range")
    if st.st_size != L.file_size(capacity):
        raise Refused(path, f"size {st.st_size} bytes, the header declares {L.file_size(capacity)} (truncated or corrupted)")
    hinst, pidns = L.IDENTITY.unpack_from(header, L.IDENTITY_OFFSET)
    if hinst != inst:
        raise Refused(path, f"header names instance {hinst:016x}, the file name {inst:016x}")
    # In a group's directory the group is what is trusted: another member's file whose owner this
    # user namespace's map leaves out (shown as the overflow uid) is read by its header's uid.
    if uid != owner and not (owner is None and by_group):
        raise Refused(path, f"header names uid {uid}, the file is owned by uid {st.st_uid}"
                      + (f" (host uid {owner})" if owner not in (None, st.st_uid) else ""))
    pid = hpid

    def contents(published=None):
        publish_ns, flags, body = published or _consistent_body(fd, path, header, capacity)
        out = ProcessStats(pid, uid, start, publish_ns, flags, path, instance=f"{inst:016x}", pidns=pidns)
        out.samples = _records(path, pid, body, out.instance, uid)
        return out

    # Liveness before contents: a dead process's file is Stale (removed) whatever it holds; what
    # it holds is only its last counters, for the node's totals. The writer's lock decides: one
    # that holds it runs now, whatever boot id it wrote (zeros where its /proc has no /proc/sys:
    # procfs mounted subset=pid, systemd's ProcSubset=pid; before 2026-12-05 such a live worker's
    # file was taken for an earlier boot's, left out of `ps` and removed by every scan). The boot
    # id only keeps a dead writer's counters of an earlier boot out of this boot's totals.
    if not _writer_alive(fd):
        here = identity.boot_id()
        if boot != here and any(boot) and any(here):
            raise Stale(path, "process has exited (an earlier boot)")
        raise Stale(path, "process has exited", _last_publish(contents))
    if identity.pid_here(pidns) and identity.gone_here(pid):
        raise Stale(path, "process has exited (a zombie, or gone from this pid namespace)", _last_publish(contents))
    published = _consistent_body(fd, path, header, capacity)
    if published[1] & L.FLAG_EXITED:  # its final counters (statsfile.StatsFile.close)
        raise Stale(path, "process marked it exited", _last_publish(contents, published))
    return contents(published)


def _last_publish(contents, published=None):
    """A dead writer's last whole publish, or None (damaged: nothing to keep from it)."""
    try:
        return contents(published)
    except (StatsFileError, OSError):
        return None


def _consistent_body(fd, path, header, capacity):
    """(publish_ns, flags, records bytes) from one whole publish: seq even and unchanged across the
    read, CRC matching. A CRC that keeps failing while seq stays put is corruption, not a race."""
    last_bad_crc_seq = None
    for attempt in range(READ_ATTEMPTS):
        if attempt:
            time.sleep(RETRY_SLEEP_S)
            header = os.pread(fd, L.HEADER_SIZE, 0)
        (seq1,) = L.SEQ.unpack_from(header, L.SEQ_OFFSET)
        if seq1 & 1:
            continue
        publish_ns, n, flags = L.DYNAMIC.unpack_from(header, L.DYNAMIC_OFFSET)
        (crc,) = L.CRC.unpack_from(header, L.CRC_OFFSET)
        if n > capacity:
            body = None
        else:
            body = os.pread(fd, n * L.RECORD_SIZE, L.HEADER_SIZE)
        (seq2,) = L.SEQ.unpack_from(os.pread(fd, L.SEQ.size, L.SEQ_OFFSET), 0)
        if seq2 != seq1:
            continue
        dyn = header[L.DYNAMIC_OFFSET:L.DYNAMIC_OFFSET + L.DYNAMIC.size]
        if body is not None and len(body) == n * L.RECORD_SIZE and L.checksum(dyn, body) == crc:
            return publish_ns, flags, body
        if last_bad_crc_seq == seq1:
            what = f"{n} records for {capacity} slots" if body is None else "checksum mismatch"
            raise Refused(path, f"corrupted: {what} with no write in progress")
        last_bad_crc_seq = seq1
    raise Busy(path, f"the owner was writing during all {READ_ATTEMPTS} attempts")


def _records(path, pid, body, instance="", uid=None):
    samples, seen = [], set()
    for i in range(len(body) // L.RECORD_SIZE):
        device, tlen, raw, *values = L.RECORD.unpack_from(body, i * L.RECORD_SIZE)
        if not 0 <= device < MAX_DEVICE:
            raise Refused(path, f"record {i}: device {device} out of range")
        if tlen > L.TENANT_MAX or any(raw[tlen:]):
            raise Refused(path, f"record {i}: bad tenant name length {tlen}")
        try:
            tenant = raw[:tlen].decode("utf-8")
        except UnicodeDecodeError:
            raise Refused(path, f"record {i}: tenant name is not UTF-8") from None
        vals = dict(zip(FIELDS, values))
        for f, v in vals.items():
            if v < (NO_QUOTA if f == "quota_bytes" else 0):
                raise Refused(path, f"record {i}: negative {f} ({v})")
        if (device, tenant) in seen:
            raise Refused(path, f"record {i}: device {device} tenant {tenant!r} appears twice")
        seen.add((device, tenant))
        samples.append(TenantSample(device, tenant, vals, pid, instance, uid=uid))
    return samples

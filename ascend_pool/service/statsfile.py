"""The owner's side of a stats file: create it, publish records into it with a seqlock, remove it.

Only one thread of the owning process writes (the publisher, under its own lock); readers in
other processes never lock anything and never make the writer wait, so a slow or stuck reader
cannot slow an application down. Layout: service/layout.py.
"""

import fcntl
import mmap
import os
import time

from .. import identity
from . import layout as L
from . import paths


class StatsFile:
    """This process's stats file in `directory` (default: this user's private directory inside
    paths.stats_dir()), created owner-only (0600), locked (the lease readers test) and complete
    before it appears under its final name (written under a temporary name, then renamed), so a
    reader never sees a half-initialised header nor an unlocked live file."""

    def __init__(self, directory=None, capacity=L.DEFAULT_CAPACITY, max_capacity=None):
        """max_capacity: how far publish() may grow the file when the process has more (device,
        tenant) pairs than it holds (default: capacity, never grown)."""
        self.pid = os.getpid()
        self.instance = identity.instance()
        self.directory = directory or paths.own_dir()
        self.shared = _group_dir(self.directory)  # a 2770 group directory: the group may read
        self.path = os.path.join(self.directory, paths.file_name(self.instance))
        self.capacity = capacity
        self.max_capacity = min(L.MAX_CAPACITY, max(capacity, max_capacity or capacity))
        self._seq = 0
        self._map = None
        self._old_fds = []  # the files _grow() replaced, their locks kept (see there)
        self._fd, self._map = self._make(capacity, [], 0)
        identity.fork_guard(self._fd)  # its lock is its writer's lease: a child forked from C drops it

    def _make(self, capacity, records, flags):
        """(fd, mapping) of a new file with `capacity` slots holding `records`, locked, complete,
        then renamed to self.path."""
        tmp = os.path.join(self.directory, f".{paths.file_name(self.instance)}.tmp")
        fd = self._create(tmp, 0o640 if self.shared else 0o600)
        m = None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held for life: readers test it
            size = L.file_size(capacity)
            # Every page now: a mapped write to a page the file system cannot give (a full /dev/shm,
            # at creation or later, when another user fills it) is SIGBUS, the process's death.
            os.posix_fallocate(fd, 0, size)
            # Mapped through an open file of its own: the mapping, and mmap's copy of its descriptor,
            # which a child forked from C inherits, kept the locked one, and the killed writer's
            # file live, for as long as the child lived.
            mfd = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
            try:
                m = mmap.mmap(mfd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(mfd)
            st = identity.start_time(self.pid)
            m[0:L.SEQ_OFFSET] = L.STATIC.pack(L.MAGIC, L.VERSION, L.HEADER_SIZE, L.RECORD_SIZE, capacity,
                                              self.pid, identity.host_uid(), st or 0, identity.boot_id())
            L.IDENTITY.pack_into(m, L.IDENTITY_OFFSET, self.instance, identity.pidns())
            self._write(records, flags, m)
            os.rename(tmp, self.path)  # atomic; instance ids are never reused
        except BaseException:
            if m is not None:
                m.close()
            identity.close_dropped(fd)
            _unlink(tmp)
            raise
        return fd, m

    @staticmethod
    def _create(tmp, mode=0o600):
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        # Marked for a forked child's drop as it is opened (its lock is the writer's lease): a fork
        # from C before the mark gave the child the file the parent then locked, and a killed
        # writer's file stayed live while the child lived.
        try:
            fd = identity.open_dropped(tmp, flags, mode)
        except FileExistsError:  # left by an earlier attempt of ours (e.g. recreating a damaged file)
            os.unlink(tmp)
            fd = identity.open_dropped(tmp, flags, mode)
        try:
            os.fchmod(fd, mode)  # whatever the umask: owner-only (group-readable in a group directory)
        except BaseException:  # the caller retries each interval: one descriptor lost at each
            identity.close_dropped(fd)
            _unlink(tmp)
            raise
        return fd

    def intact(self):
        """False if the file was truncated under us (writing into the mapping would then raise
        SIGBUS and kill the process) or removed (readers no longer see it). Only our uid or root
        can do either."""
        if self._map is None:
            return False
        st = os.fstat(self._fd)
        return st.st_size == L.file_size(self.capacity) and st.st_nlink > 0

    def publish(self, samples, flags=0):
        """Writes samples (TenantSample list) as the file's records, first growing the file (up to
        max_capacity) when they do not fit; more than capacity then sets
        FLAG_OVERFLOW and keeps `capacity` of them, those of live pools first, then the most
        recently closed (a (device, tenant) whose pools all closed keeps only counters; the least
        recently closed are left out, as the aggregator forgets them first). Returns True when
        some were left out.
        Raises OSError if the file was damaged."""
        if not self.intact():
            raise OSError(f"stats file {self.path} was truncated or closed; not writing into it")
        if len(samples) > self.capacity and self.capacity < self.max_capacity:
            self._grow(min(self.max_capacity, max(len(samples), 2 * self.capacity)))
        overflow = len(samples) > self.capacity
        if overflow:
            keep = sorted(samples, key=lambda s: (not getattr(s, "live", True), -getattr(s, "idle_rank", 0)))
            keep = {id(s) for s in keep[:self.capacity]}
            samples = [s for s in samples if id(s) in keep]  # in their own order
            flags |= L.FLAG_OVERFLOW
        self._write([L.pack_record(s.device, s.tenant, s.values) for s in samples], flags)
        return overflow

    def _grow(self, capacity):
        """Remakes the file with `capacity` slots, holding what it holds now (so no reader sees the
        process with no records): with a fixed 128, the node service and `ps` left out the tenants
        of a process with more (device, tenant) pairs, live ones too, and their memory from the
        node's totals. The replaced file stays locked until close(): a reader that opened it
        before the rename and found it unlocked would take it for a dead process's and remove it
        by name, the new file. When the new file cannot be made (a full /dev/shm), the file stays
        as it is and is not grown again."""
        _, n, flags = L.DYNAMIC.unpack_from(self._map, L.DYNAMIC_OFFSET)
        now = [self._map[L.HEADER_SIZE + i * L.RECORD_SIZE:L.HEADER_SIZE + (i + 1) * L.RECORD_SIZE] for i in range(n)]
        try:
            fd, m = self._make(capacity, now, flags)
        except OSError:
            self.max_capacity = self.capacity
            return
        identity.fork_guard(fd)
        self._map.close()
        self._old_fds.append(self._fd)
        self._fd, self._map, self.capacity = fd, m, capacity

    def _write(self, records, flags, m=None):
        m = self._map if m is None else m
        body = b"".join(records)
        dynamic = L.DYNAMIC.pack(time.time_ns(), len(records), flags)
        crc = L.checksum(dynamic, body)
        self._seq += 1  # odd: readers that see this retry
        L.SEQ.pack_into(m, L.SEQ_OFFSET, self._seq)
        m[L.HEADER_SIZE:L.HEADER_SIZE + len(body)] = body
        m[L.DYNAMIC_OFFSET:L.DYNAMIC_OFFSET + L.DYNAMIC.size] = dynamic
        L.CRC.pack_into(m, L.CRC_OFFSET, crc)
        self._seq += 1  # even: whole again
        L.SEQ.pack_into(m, L.SEQ_OFFSET, self._seq)

    def close(self, remove=True, final=None):
        """Marks the file exited and (by default) removes it. final: the process's last samples,
        written with the mark: its final counters, which the node service folds into its node
        counters before it removes the file (publisher.Publisher.stop). Idempotent."""
        if self._map is None:
            return
        try:
            if not self.intact():
                return
            if final is not None:
                self.publish(final, L.FLAG_EXITED)
                return
            dyn = L.DYNAMIC.unpack_from(self._map, L.DYNAMIC_OFFSET)
            self._seq += 1
            L.SEQ.pack_into(self._map, L.SEQ_OFFSET, self._seq)
            L.DYNAMIC.pack_into(self._map, L.DYNAMIC_OFFSET, dyn[0], 0, dyn[2] | L.FLAG_EXITED)
            L.CRC.pack_into(self._map, L.CRC_OFFSET,
                            L.checksum(self._map[L.DYNAMIC_OFFSET:L.DYNAMIC_OFFSET + L.DYNAMIC.size], b""))
            self._seq += 1
            L.SEQ.pack_into(self._map, L.SEQ_OFFSET, self._seq)
        finally:
            if remove:
                _unlink(self.path)
            self._map.close()
            self._map = None
            self._close_fds()

    def _close_fds(self):
        for fd in [self._fd] + self._old_fds:
            identity.close_dropped(fd)
        self._old_fds = []

    def abandon(self):
        """Forgets the file without touching it: for a forked child, whose parent still owns it."""
        if self._map is not None:
            self._map.close()
            self._map = None
            self._close_fds()


def _group_dir(directory):
    try:
        st = os.lstat(directory)
    except OSError:
        return False
    return bool(st.st_mode & 0o2000) and (st.st_mode & 0o070) == 0o070


def _unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

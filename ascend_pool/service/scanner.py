"""Reading the stats directories: every live process's figures, stale files removed, bad ones
refused with one log line each (repeated only when the reason changes, so a bad file left in
place does not flood the log at every scrape).

Which directories: the private directories (ascend_pool/private_dir.py) of the trusted uids and
groups inside the base directory, and nothing else there: any local user can create names in
/dev/shm, and such files are not even opened (no log line, no time spent). A scan reads at most
MAX_FILES files, so its time is bounded whatever the directories hold."""

import logging
import os
import threading
import time

from .. import identity
from ..private_dir import candidates
from . import paths
from .layout import FLAG_EXITED
from .reader import Busy, OtherVersion, Refused, Stale, read_stats_file

log = logging.getLogger("ascend_pool.service")


MAX_FILES = 4096  # stats files read per scan: far more processes than a node runs


class StatsScanner:
    """Reads the stats files in the private directories of the trusted uids and groups inside the
    base `directory` (default paths.stats_dir()); a directory given explicitly is also read itself
    (e.g. a private directory). allowed_uids: owners whose files are believed, by their host uids
    (default: the host uid this service runs as, identity.host_uid; a root service reading other
    users' processes must name them);
    allowed_gids: groups whose shared directories (ascend_pool-g<gid>) are read. remove_stale:
    unlink files of processes that are gone (where we may). refusal_level: the log level of
    "refused" lines (an application clearing stale files at start passes DEBUG: reporting other
    files' problems is the service's job). keep_exited_s: a dead process's file whose last publish
    is younger than this is not removed (left for the node service, which reads the final
    counters in it, see scan(exited=))."""

    def __init__(self, directory=None, allowed_uids=None, remove_stale=True, refusal_level=logging.WARNING,
                 allowed_gids=(), keep_exited_s=0.0):
        self.explicit = directory is not None
        self.directory = directory or paths.stats_dir()
        self.allowed_uids = frozenset(allowed_uids) if allowed_uids else frozenset({identity.host_uid()})
        self.allowed_gids = frozenset(allowed_gids or ())
        self.remove_stale = remove_stale
        self.refusal_level = refusal_level
        self.keep_exited_s = keep_exited_s
        self._lock = threading.Lock()
        self._reported = {}  # path -> last reason logged
        # other_version: another build's live writer (a rolling upgrade), apart from refused (damaged, foreign)
        self.counts = {"live": 0, "stale": 0, "refused": 0, "busy": 0, "other_version": 0}

    def directories(self):
        """The directories a scan reads: the trusted private ones in the base directory."""
        dirs = [p for p, _, _ in candidates(self.directory, self.allowed_uids, self.allowed_gids)]
        return ([self.directory] if self.explicit else []) + dirs

    def _paths(self, half_made=None):
        out = []
        for d in self.directories():
            try:
                names = os.listdir(d)
            except OSError as e:
                self._report(d, f"cannot list the stats directory {d}: {e.strerror}", logging.WARNING)
                continue
            out.extend(os.path.join(d, n) for n in names if paths.instance_of(n) is not None)
            if half_made is not None:  # statsfile.StatsFile makes its file as ".<file name>.tmp", then renames it
                half_made.extend(os.path.join(d, n) for n in names
                                 if n.startswith(".") and n.endswith(".tmp") and paths.instance_of(n[1:-4]) is not None)
        if len(out) > MAX_FILES:
            self._report(self.directory, f"more than {MAX_FILES} stats files in the trusted directories of "
                         f"{self.directory}; reading the first {MAX_FILES}", logging.WARNING)
            out = out[:MAX_FILES]
        return out

    def scan(self, exited=None):
        """A list of reader.ProcessStats, one per live publishing process, sorted by pid.
        exited: a list that gets the last publish (ProcessStats) of each dead process's file
        read, before the file is removed."""
        out, counts, seen, half_made = [], dict.fromkeys(self.counts, 0), set(), []
        for path in self._paths(half_made if self.remove_stale else None):
            seen.add(path)
            try:
                out.append(read_stats_file(path, self.allowed_uids, self.allowed_gids))
                counts["live"] += 1
                self._clear(path)
            except Stale as e:
                counts["stale"] += 1
                if exited is not None and e.stats is not None:
                    exited.append(e.stats)
                self._remove(e)
            except Busy as e:
                counts["busy"] += 1
                log.debug("%s", e)
            except OtherVersion as e:
                counts["other_version"] += 1
                self._report(path, f"skipped stats file {path}: {e.reason}", self.refusal_level)
            except Refused as e:
                counts["refused"] += 1
                self._report(path, f"refused stats file {path}: {e.reason}", self.refusal_level)
            except OSError as e:  # vanished or unreadable between listing and reading
                counts["refused"] += 1
                self._report(path, f"cannot read stats file {path}: {e}", self.refusal_level)
        with self._lock:
            self.counts = counts
            for path in list(self._reported):
                if path not in seen and path != self.directory and not os.path.isdir(path):
                    del self._reported[path]
        self._remove_half_made(half_made)
        return sorted(out, key=lambda p: (p.pid, p.instance))

    def _remove_half_made(self, half_made):
        """Removes the half-made files (about 32 KiB of /dev/shm each) of our uid's writers killed while
        making theirs: only a new publisher's start removed them, never the service's scans, so
        they stayed for good once the node's last such process was gone. Age alone does not say the
        writer is dead (one stopped between creating and renaming its file, a clock stepped
        forward): its lease does, the flock StatsFile takes right after creating the file, as for
        every stats file (reader.py). A file whose writer holds it is left alone."""
        for path in half_made[:MAX_FILES]:
            try:
                identity.remove_abandoned(path)
            except OSError as e:
                log.debug("removing a half-made stats file %s: %s", path, e)

    def _remove(self, e):
        if not self.remove_stale:
            return
        if self.keep_exited_s and e.stats is not None:
            age = (time.time_ns() - e.stats.publish_ns) / 1e9
            if abs(age) < self.keep_exited_s:  # a clock stepped back does not keep it for good
                return
        try:
            os.unlink(e.path)
            # an exit is every process's end now that the file stays for its final counters: a debug line
            clean = e.stats is not None and e.stats.flags & FLAG_EXITED
            log.log(logging.DEBUG if clean else logging.INFO, "removed stats file %s: %s", e.path, e.reason)
        except FileNotFoundError:
            pass  # its owner or another reader was faster
        except OSError as err:  # someone else's file in a sticky directory
            self._report(e.path, f"cannot remove stale stats file {e.path} ({e.reason}): {err.strerror}", logging.INFO)

    def _report(self, key, line, level):
        with self._lock:
            if self._reported.get(key) == line:
                return
            self._reported[key] = line
        log.log(level, "%s", line)

    def _clear(self, path):
        with self._lock:
            self._reported.pop(path, None)

"""Private directories inside a shared one (/dev/shm, a hostPath): where this package's files live.

/dev/shm is writable by every local user, so any file name this package would use there can be
taken first by someone else (a denial of service), and a file someone else wrote cannot be
trusted. So each user (or the trusted group named by $ASCEND_POOL_LEDGER_GROUP) works in a
directory of its own inside the configured one:

    <base>/ascend_pool-u<uid>[.<n>]     mode 0700, owned by the user
    <base>/ascend_pool-g<gid>[.<n>]     mode 2770, group gid (set-gid: files inherit the group)

uid and gid are the host's (identity.host_uid, identity.host_gid): a process in a user namespace
names the same directory as its host user's processes outside it; the owner is checked as the
namespace shows it.

verified after every open (owner, group, mode, a real directory and not a symbolic link). When a
name is taken by someone else, the next one (`.1`, `.2`, ...) is tried: squatting names cannot
stop a user from working, because the user's own processes walk the same sequence and settle on
the first directory that is theirs. They look LOOKAHEAD names past the first free one for a
directory of theirs before creating one, so a squatted name given back later does not split the
user's processes over two directories (two quota ledgers). A directory is created whole: made
under a temporary name with its final owner, group and mode, then renamed into place only where
the name is still free (renameat2 RENAME_NOREPLACE), so a peer (another member of the group)
starting at the same moment never sees a half-made directory and takes it for a squatter's. The
node service reads the directories of the uids and groups it is told to trust (`candidates()`),
and never looks at anything else in the base directory.
"""

import ctypes
import errno
import logging
import os
import re
import secrets
import stat
import threading
import time

from . import identity

MAX_PROBES = 100000   # names tried before giving up (each costs one lstat)
LOOKAHEAD = 64        # names looked at past the first free one (as the simulator's node records)
_ATTEMPTS = 20        # creations lost to a peer (or a squatter) before giving up
NAME_RE = re.compile(r"^ascend_pool-(u|g)(\d+)(?:\.(\d+))?$")

_lock = threading.RLock()
_cache = {}  # (base, kind, id) -> path
_userns_told = False
log = logging.getLogger("ascend_pool")


def _tell_user_namespace(base):
    """Once per process: a process in a user namespace whose map leaves its euid out (nothing
    written yet: `unshare --user` without a map) cannot tell its host uid, so it names its
    directory by its uid inside the namespace, which nobody outside looks for
    (identity.user_namespace). A map that holds the euid needs no word: the process names
    everything by its host uid, as the host user's other processes do."""
    global _userns_told
    if _userns_told:
        return
    _userns_told = True
    ns = identity.user_namespace()
    if ns is not None and ns[1] is not None and identity.runs_as_overflow_uid():  # mapped, yet 65534
        log.warning("this process runs in a user namespace (/proc/self/uid_map: %s) as the overflow uid %d, which "
                    "every file of an owner the map leaves out shows as: it cannot tell those files from its own, "
                    "so another host user's stale records in %s may be taken for this process's. Run it as another "
                    "uid (docs/containers.md).", ns[0] or "empty", os.geteuid(), base)
    if ns is not None and ns[1] is not None and ns[1] != os.geteuid():
        _tell_earlier_scheme(base, ns[0])
    if ns is None or ns[1] is not None:
        return
    uid = os.geteuid()
    log.warning("this process runs in a user namespace (/proc/self/uid_map: %s) whose map leaves its uid %d out, "
                "so its host uid cannot be told: its private directory in %s (%s), stats file and quota ledgers "
                "are named by its uid inside the namespace, so `ascend-pool ps` and the node service outside it "
                "do not see it (--allow-uid does not help), and a tenant's processes inside and outside it do not "
                "share a quota ledger. Give the namespace a uid map that holds the uid (docs/containers.md).",
                ns[0] or "empty", uid, base, _name("u", uid, 0))


def _tell_earlier_scheme(base, uid_map):
    """Once per process, in a user namespace whose map holds the euid: processes of an earlier
    version (before 2026-12) named their directory by the uid inside the namespace. While one of
    them lives (a lease held in such a directory of this user's), a tenant's quota holds per
    directory, and ps and the node service see only this side: said, since nothing can merge a
    live process's mapped ledger into another file. Looks at the first LOOKAHEAD names only."""
    uid = os.geteuid()
    for n in range(LOOKAHEAD):
        path = os.path.join(base, _name("u", uid, n))
        try:
            st = os.lstat(path)
        except OSError:
            return  # the earlier version, too, created the first free name
        if not (stat.S_ISDIR(st.st_mode) and st.st_uid == uid):
            continue  # another user's (squatted, or a host user whose uid is this number)
        try:
            leases = [e for e in os.listdir(path) if e.startswith(identity.LEASE_PREFIX)][:256]
        except OSError:
            return
        for e in leases:
            try:
                value = int(e[len(identity.LEASE_PREFIX):], 16)
            except ValueError:
                continue
            if identity.lease_alive(path, value):
                log.warning("%s holds the files of a live process of this user named by its uid %d inside this "
                            "user namespace (/proc/self/uid_map: %s), as ascend_pool before 2026-12 named them (or "
                            "a process of a namespace nested in this one does); this process names its files by "
                            "its host uid %d: until the earlier processes restart, their quota ledgers and stats "
                            "are apart from this process's (a tenant's quota holds per side, ps and the node "
                            "service do not list them together). Restart them (docs/containers.md).",
                            path, uid, uid_map, identity.host_uid())
                return
        return


def _name(kind, num, n):
    return f"ascend_pool-{kind}{num}" + (f".{n}" if n else "")


def is_trusted(st, kind, num):
    """True when the lstat() result st is a directory that user (kind "u") or group (kind "g")
    `num` can trust: owned by that user with mode 0700, or of that group with mode 2770. num is the
    host's id (what names the directory); st's owner is this namespace's view of it
    (identity.owned_by, identity.owner_host_gid)."""
    if not stat.S_ISDIR(st.st_mode):
        return False
    mode = stat.S_IMODE(st.st_mode)
    if kind == "u":
        return identity.owned_by(st.st_uid, num) and mode == 0o700
    return identity.owner_host_gid(st.st_gid) == num and mode == 0o2770


def private_dir(base, group=None):
    """This user's (or, with group=gid, the group's) private directory inside base, created if
    needed. Raises OSError (PermissionError naming the problem) when none can be had."""
    base = os.fspath(base)
    if not isinstance(base, str) or "\0" in base:
        raise NotADirectoryError(f"{base!r} is not a directory path")
    if group is not None and (isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < 2**32 - 1):
        raise PermissionError(f"{group!r} is not a group id (0 to {2**32 - 2})")
    # named by the host's id (identity.host_uid), checked as this namespace sees the owner
    kind, num = ("g", identity.host_gid(group)) if group is not None else ("u", identity.host_uid())
    _tell_user_namespace(base)
    key = (os.path.abspath(base), kind, num)
    path = _cache.get(key)
    if path is not None and _still_ours(path, kind, num):
        return _usable(path, group)
    with _lock:
        for _ in range(_ATTEMPTS):
            first_free, n = None, 0
            # The first directory of ours among the names up to LOOKAHEAD past the first free one.
            while n < MAX_PROBES and (first_free is None or n <= first_free + LOOKAHEAD):
                path = os.path.join(key[0], _name(kind, num, n))
                if _still_ours(path, kind, num):
                    _cache[key] = path
                    # Once per process: a creator killed between its mkdir and its rename left its
                    # temporary directory, too recent to go when the next process created this one
                    # (then the only creation: it stayed for good).
                    _remove_stale_temporaries(key[0], kind, num)
                    return _usable(path, group)
                if first_free is None and not os.path.lexists(path):
                    first_free = n
                n += 1  # taken by someone else (or not a directory): the next name
            if first_free is None:
                raise PermissionError(f"no private directory for {'group' if kind == 'g' else 'uid'} {num} in "
                                      f"{base}: {MAX_PROBES} names are taken by others")
            path = os.path.join(key[0], _name(kind, num, first_free))
            if _create(key[0], path, kind, num, group) and _still_ours(path, kind, num):
                _cache[key] = path
                return _usable(path, group)
            # A peer (or a squatter) took the name first: look again.
        raise PermissionError(f"no private directory for {'group' if kind == 'g' else 'uid'} {num} in {base}: "
                              "its names keep being taken by others while it is created")


STALE_TEMPORARY_S = 60  # a temporary directory this old was left by a process killed while creating


def _remove_stale_temporaries(base, kind, num):
    # A process killed between its mkdir and its rename leaves its temporary directory; this
    # user removes its own (empty, and old enough that no creation is still in flight).
    prefix = f".ascend_pool-tmp-{kind}{num}-"
    try:
        names = [n for n in os.listdir(base) if n.startswith(prefix)]
    except OSError:
        return
    now = time.time()
    for name in names:
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and now - st.st_mtime > STALE_TEMPORARY_S:
                os.rmdir(path)
        except OSError:
            pass


def _create(base, path, kind, num, group=None):
    """Creates the directory `path` whole: under a temporary name in base, with its final group
    and mode, then renamed to path if path is still free. True when it was; False when the name
    was taken meanwhile (by a peer starting at the same moment, or by someone else)."""
    _remove_stale_temporaries(base, kind, num)
    for _ in range(100):
        tmp = os.path.join(base, f".ascend_pool-tmp-{kind}{num}-{secrets.token_hex(8)}")
        try:
            os.mkdir(tmp, 0o700)
            break
        except FileExistsError:  # a name someone else chose: another one
            continue
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise PermissionError(e.errno, _base_refused(base, kind, num, e)) from None
            raise
    else:
        raise PermissionError(f"cannot create a temporary directory in {base}: every name tried is taken")
    try:
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid():  # replaced under us (a base directory without the sticky bit)
                raise PermissionError(f"the directory {tmp} this process created was replaced by another user's")
            if kind == "g":
                try:
                    os.fchown(fd, -1, group)  # the gid as this namespace sees it
                except PermissionError:
                    raise PermissionError(f"cannot create the directory of group {group} in {base}: "
                                          f"{_not_member(group)}") from None
                os.fchmod(fd, 0o2770)
            else:
                os.fchmod(fd, 0o700)  # whatever the umask
        finally:
            os.close(fd)
        try:
            _rename_noreplace(tmp, path)
            tmp = None
            return True
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.EPERM, errno.EACCES, errno.EISDIR, errno.ENOTDIR):
                return False
            raise
    finally:
        if tmp is not None:
            try:
                os.rmdir(tmp)
            except OSError:
                pass


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
_renameat2 = None


def _rename_noreplace(src, dst):
    """rename(src, dst) that fails with EEXIST when dst exists (an empty directory included, which
    plain rename replaces)."""
    global _renameat2
    if _renameat2 is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).renameat2
            fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
            fn.restype = ctypes.c_int
            _renameat2 = fn
        except (AttributeError, OSError):  # a C library without it (glibc < 2.28, some musl)
            _renameat2 = False
    if _renameat2:
        if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL):  # EINVAL: a file system without the flag
            raise OSError(err, os.strerror(err), dst)
    # Without the flag: refuse an existing name first; the window left replaces at most an empty
    # directory a peer made a moment ago, whose processes then find this one under the same name.
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    os.rename(src, dst)


def _base_refused(base, kind, num, err):
    """Why this process cannot create its private directory in base (a hostPath made by root 0755,
    a read-only mount), and what to do: before, the error named only a random temporary name
    (".ascend_pool-tmp-u65534-7aff...: Permission denied"), not the directory nor its mode."""
    who = f"group {num}" if kind == "g" else f"uid {num}"
    try:
        st = os.stat(base)
        what = f"owner uid {st.st_uid}, group {st.st_gid}, mode {stat.S_IMODE(st.st_mode):04o}"
    except OSError as e:
        what = e.strerror or str(e)
    if err.errno == errno.EROFS:
        return f"cannot create the private directory of {who} in {base}: it is on a read-only file system ({what})"
    return (f"cannot create the private directory of {who} in {base} ({what}): this process (uid {os.geteuid()}) "
            "may not create entries there. The shared directory must be writable by every user of the node's "
            "processes, with the sticky bit (mode 1777, as /dev/shm), or already hold this user's (group's) "
            "directory")


def _not_member(group):
    """Why a process outside group cannot use its directory, what to do."""
    return (f"this process (uid {os.geteuid()}, groups {', '.join(map(str, sorted({os.getegid(), *os.getgroups()})))}) "
            f"is not a member of group {group} ($ASCEND_POOL_LEDGER_GROUP): add its user to the group, or "
            "run it without $ASCEND_POOL_LEDGER_GROUP")


def _usable(path, group):
    """path, a group's directory (group not None) this process can create files in; else
    PermissionError naming the membership (before, a process outside the group failed later
    with a bare "Permission denied" on a ledger or stats file, or "Operation not permitted" naming
    nothing). A user's own directory is its owner's: path as it is."""
    if group is None or os.access(path, os.W_OK | os.X_OK, effective_ids=True):
        return path
    raise PermissionError(f"cannot use the directory {path} of group {group}: {_not_member(group)}")


def _still_ours(path, kind, num):
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if (kind == "u" and stat.S_ISDIR(st.st_mode) and identity.owned_by(st.st_uid, num)
            and stat.S_IMODE(st.st_mode) != 0o700):
        try:  # ours with a looser mode (an old umask): tighten it rather than leave it
            os.chmod(path, 0o700, follow_symlinks=False)
            st = os.lstat(path)
        except OSError:
            return False
    return is_trusted(st, kind, num)


def candidates(base, uids=(), gids=()):
    """The private directories in base of the trusted uids (the host's, as names and --allow-uid
    give them) and gids (as this namespace sees them, as --allow-group and $ASCEND_POOL_LEDGER_GROUP
    give them): [(path, kind, id)], id the host's id the name holds. Entries of anyone else are skipped silently (an
    untrusted user can create any name in base)."""
    uids, gids = set(uids), {identity.host_gid(g) for g in gids}  # gids: as this namespace sees them
    out = []
    try:
        names = os.listdir(base)
    except OSError:
        return out
    for name in names:
        m = NAME_RE.match(name)
        if not m:
            continue
        kind, num = m.group(1), int(m.group(2))
        if num not in (uids if kind == "u" else gids):
            continue
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if is_trusted(st, kind, num):
            out.append((path, kind, num))
    return sorted(out)


def _forget_after_fork():
    global _lock
    _lock = threading.RLock()


os.register_at_fork(after_in_child=_forget_after_fork)

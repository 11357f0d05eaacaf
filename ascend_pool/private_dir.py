"""Private directories inside a shared one (/dev/shm, a hostPath): where this package's files live.

/dev/shm is writable by every local user, so any file name this package would use there can be
taken first by someone else (a denial of service), and a file someone else wrote cannot be
trusted. So each user (or the trusted group named by $ASCEND_POOL_LEDGER_GROUP) works in a
directory of its own inside the configured one:

    <base>/ascend_pool-u<uid>[.<n>]     mode 0700, owned by the user
    <base>/ascend_pool-g<gid>[.<n>]     mode 2770, group gid (set-gid: files inherit the group)

verified after every open (owner, group, mode, a real directory and not a symbolic link). When a
name is taken by someone else, the next one (`.1`, `.2`, ...) is tried: squatting names cannot
stop a user from working, because the user's own processes walk the same sequence and settle on
the first directory that is theirs. The node service reads the directories of the uids and groups
it is told to trust (`candidates()`), and never looks at anything else in the base directory.
"""

import os
import re
import stat
import threading

MAX_PROBES = 100000   # names tried before giving up (each costs one lstat)
NAME_RE = re.compile(r"^ascend_pool-(u|g)(\d+)(?:\.(\d+))?$")

_lock = threading.Lock()
_cache = {}  # (base, kind, id) -> path


def _name(kind, num, n):
    return f"ascend_pool-{kind}{num}" + (f".{n}" if n else "")


def is_trusted(st, kind, num):
    """True when the lstat() result st is a directory that user (kind "u") or group (kind "g")
    `num` can trust: owned by that user with mode 0700, or of that group with mode 2770."""
    if not stat.S_ISDIR(st.st_mode):
        return False
    mode = stat.S_IMODE(st.st_mode)
    if kind == "u":
        return st.st_uid == num and mode == 0o700
    return st.st_gid == num and mode == 0o2770


def private_dir(base, group=None):
    """This user's (or, with group=gid, the group's) private directory inside base, created if
    needed. Raises OSError (PermissionError naming the problem) when none can be had."""
    kind, num = ("g", int(group)) if group is not None else ("u", os.geteuid())
    key = (os.path.abspath(base), kind, num)
    path = _cache.get(key)
    if path is not None and _still_ours(path, kind, num):
        return path
    with _lock:
        for n in range(MAX_PROBES):
            path = os.path.join(key[0], _name(kind, num, n))
            try:
                os.mkdir(path, 0o700)
                if kind == "g":
                    os.chown(path, -1, num)
                    os.chmod(path, 0o2770)
                else:
                    os.chmod(path, 0o700)  # whatever the umask
            except FileExistsError:
                pass
            if _still_ours(path, kind, num):
                _cache[key] = path
                return path
            # Taken by someone else (or not a directory): the next name.
        raise PermissionError(f"no private directory for {'group' if kind == 'g' else 'uid'} {num} in {base}: "
                              f"{MAX_PROBES} names are taken by others")


def _still_ours(path, kind, num):
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if kind == "u" and stat.S_ISDIR(st.st_mode) and st.st_uid == num and stat.S_IMODE(st.st_mode) != 0o700:
        try:  # ours with a looser mode (an old umask): tighten it rather than leave it
            os.chmod(path, 0o700, follow_symlinks=False)
            st = os.lstat(path)
        except OSError:
            return False
    return is_trusted(st, kind, num)


def candidates(base, uids=(), gids=()):
    """The private directories in base of the trusted uids and gids: [(path, kind, id)]. Entries
    of anyone else are skipped silently (an untrusted user can create any name in base)."""
    uids, gids = set(uids), set(gids)
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
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)

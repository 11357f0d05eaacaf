"""Where stats files live and how they are named.

Base directory: $ASCEND_POOL_STATS_DIR, else /dev/shm (memory-backed, shared by the node's
processes), else the temp directory. Files live in the writer's private directory inside it
(ascend_pool/private_dir.py: ascend_pool-u<uid>, mode 0700), so another local user can neither
take their names nor slow the node service with junk. One file per process, named by its
instance id (ascend_pool/identity.py), never by its pid: two containers' workers are both pid 1.

    <base>/ascend_pool-u<uid>/ascend_pool-stats-<instance as 16 hex digits>
"""

import os
import re
import tempfile

from ..errors import ConfigError
from ..private_dir import private_dir
from ..tenants.ledger import ledger_group

ENV_DIR = "ASCEND_POOL_STATS_DIR"
PREFIX = "ascend_pool-stats-"
NAME_RE = re.compile(r"^ascend_pool-stats-([0-9a-f]{16})$")


def stats_dir():
    """The base directory stats files are published under and read from. ConfigError when
    $ASCEND_POOL_STATS_DIR is a relative path: each process, and the node service, would read it
    from its own working directory, and the service would never see the files."""
    d = os.environ.get(ENV_DIR)
    if d:
        if not os.path.isabs(d):
            raise ConfigError(f"{ENV_DIR}={d!r} is a relative path; processes and the node service in other "
                              "working directories would not find each other's stats files (set it to an absolute "
                              "directory, the one the node service reads)")
        return d
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def own_dir(base=None):
    """This user's private directory for stats files inside base (default stats_dir()); with
    $ASCEND_POOL_LEDGER_GROUP, the group's shared one (2770), which a service in that group reads."""
    return private_dir(base or stats_dir(), ledger_group())


def file_name(instance):
    return f"{PREFIX}{int(instance):016x}"


def instance_of(name):
    """The instance id in a stats file's name, or None if the name is not one of ours."""
    m = NAME_RE.match(name)
    return int(m.group(1), 16) if m else None


def unreadable_reason(path):
    """None when path is a directory this process can list, else the reason (naming the path):
    `serve` and `ps` refuse such a stats directory, /healthz reports it."""
    if not os.path.exists(path):
        return f"the stats directory {path} does not exist"
    if not os.path.isdir(path):
        return f"the stats directory {path} is not a directory"
    try:
        os.listdir(path)
    except OSError as e:
        return f"cannot read the stats directory {path}: {e.strerror or e}"
    if not os.access(path, os.R_OK | os.X_OK):
        return f"cannot read the stats directory {path}: permission denied"
    return None

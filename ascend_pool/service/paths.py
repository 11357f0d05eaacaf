"""Where stats files live and how they are named.

$ASCEND_POOL_STATS_DIR, else /dev/shm (memory-backed, shared by the node's processes, sticky so
each user can create only their own files and remove only their own), else the temp directory.
One file per process: ascend_pool-stats-PID.
"""

import os
import re
import tempfile

ENV_DIR = "ASCEND_POOL_STATS_DIR"
PREFIX = "ascend_pool-stats-"
NAME_RE = re.compile(r"^ascend_pool-stats-([0-9]{1,10})$")


def stats_dir():
    """The directory stats files are published to and read from."""
    d = os.environ.get(ENV_DIR)
    if d:
        return d
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def file_name(pid):
    return f"{PREFIX}{int(pid)}"


def pid_of(name):
    """The pid in a stats file's name, or None if the name is not one of ours."""
    m = NAME_RE.match(name)
    return int(m.group(1)) if m else None

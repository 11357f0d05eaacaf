"""What /proc says about a process: is it the same process that wrote a stats file?

A pid alone is not an identity: pids are reused. (pid, start time since boot, boot id) is. The
start time is field 22 of /proc/PID/stat, in clock ticks after boot; it never changes for the
life of a process, and a new process with the same pid has a later one.
"""

import os

_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def start_time(pid):
    """The process's start time (clock ticks after boot), or None if there is no such process."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm (field 2) is in parentheses and may itself hold spaces and ')': split after the last ')'.
    rest = data[data.rindex(b")") + 2:].split()
    state = rest[0]
    if state in (b"Z", b"X"):  # a zombie has exited: its stats are as gone as the process
        return None
    return int(rest[19])  # field 22 overall; rest starts at field 3


def process_uid(pid):
    """The real uid owning /proc/PID, or None if there is no such process."""
    try:
        return os.stat(f"/proc/{int(pid)}").st_uid
    except (FileNotFoundError, ProcessLookupError):
        return None


def boot_id():
    """The kernel's boot id as 16 raw bytes (zeros where /proc does not tell it)."""
    try:
        with open(_BOOT_ID_PATH) as f:
            return bytes.fromhex(f.read().strip().replace("-", ""))[:16].ljust(16, b"\0")
    except (OSError, ValueError):
        return b"\0" * 16


def is_alive(pid, expected_start, expected_boot=None):
    """True if pid is running and is the process that started at expected_start in this boot."""
    if expected_boot is not None and expected_boot != boot_id():
        return False
    return start_time(pid) == expected_start

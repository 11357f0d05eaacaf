"""Errors of the tenant layer that ascend_pool.errors does not already name."""

from ..errors import PoolError


class LedgerError(PoolError, OSError):
    """The node-wide quota ledger (a file under /dev/shm or $ASCEND_POOL_LEDGER_DIR) cannot be
    used: it is foreign (another owner or group, wrong permissions, a symbolic link), malformed
    (bad magic, version, layout or contents), full, or its lock is held by a wedged process.
    ``kind`` is one of "permission", "malformed", "full", "lock", "io", "argument". The ledger is
    never repaired or trusted in these cases; the message names the file and the reason."""

    def __init__(self, message, kind="io"):
        super().__init__(message)
        self.kind = kind

    def __str__(self):
        return self.args[0]

    def __reduce__(self):
        return (type(self), (self.args[0], self.kind))

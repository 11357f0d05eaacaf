"""Errors of the tenant layer: LedgerError, defined in ascend_pool.errors (the compiled ledger
code raises it and sits below this layer) and re-exported here where users know it."""

from ..errors import LedgerError

__all__ = ["LedgerError"]

"""Quota values as people write them, and warn ratios.

A quota is bytes of device memory held by a tenant on one device (node-wide):
  - an int number of bytes (> 0), e.g. 8589934592;
  - a size string with a unit, e.g. "8GiB", "512MiB", "1.5GB" (KiB/MiB/GiB/TiB and bare k/M/G/T are
    powers of 1024, KB/MB/GB/TB powers of 1000);
  - a percentage of the device's total memory, e.g. "25%" (in (0, 100]).
A warn ratio is a number in (0, 1]: a warning is logged when the tenant's node-wide held bytes pass
warn * quota.
"""

import re

from ..errors import ConfigError
from ..units import _UNITS, as_index, decimal_bytes

_SIZE = re.compile(r"^\s*([+-]?)\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")
_PERCENT = re.compile(r"^\s*([+-]?[0-9]+(?:\.[0-9]*)?|[+-]?\.[0-9]+)\s*%\s*$")
KNOWN_UNITS = "B, KiB, MiB, GiB, TiB, KB, MB, GB, TB, k, M, G, T"
MAX_QUOTA_BYTES = 2**63  # quotas are stored as 64-bit counts in the node ledger; no device is near this


class QuotaSpec:
    """A parsed quota: either `bytes` (int) or `fraction` (of the device, float in (0, 1]).
    `text` keeps what was written, for messages."""

    __slots__ = ("bytes", "fraction", "text")

    def __init__(self, nbytes=None, fraction=None, text=None):
        self.bytes = nbytes
        self.fraction = fraction
        self.text = text if text is not None else (f"{fraction * 100:g}%" if fraction is not None else str(nbytes))

    def resolve(self, device_total_bytes):
        """Bytes on a device of device_total_bytes (a fraction rounds down; at least 1 byte)."""
        if self.bytes is not None:
            return self.bytes
        return max(1, int(self.fraction * device_total_bytes))

    def __eq__(self, other):
        return isinstance(other, QuotaSpec) and (self.bytes, self.fraction) == (other.bytes, other.fraction)

    def __repr__(self):
        return f"QuotaSpec({self.text!r})"


def parse_quota(value, what="quota"):
    """QuotaSpec from an int, a size string or a percentage; ConfigError naming `what` and the
    problem (negative or zero, bad unit, not a number, percentage out of range)."""
    if isinstance(value, QuotaSpec):
        return value
    if not isinstance(value, str) and as_index(value) is not None:  # a numpy integer, as malloc and set_limit take
        value = as_index(value)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        hint = " (a fraction of the device is written as a percentage, e.g. \"25%\")" if isinstance(value, float) else ""
        raise ConfigError(f"{what}: expected bytes (int), a size like \"8GiB\" or a percentage like \"25%\", "
                          f"got {type(value).__name__} {value!r}{hint}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{what}: negative quota {value} bytes")
        if value == 0:
            raise ConfigError(f"{what}: zero quota (a quota must be positive; omit it for no quota)")
        if value >= MAX_QUOTA_BYTES:
            raise ConfigError(f"{what}: quota {value} bytes is larger than any device (at most {MAX_QUOTA_BYTES - 1})")
        return QuotaSpec(nbytes=value, text=str(value))
    m = _PERCENT.match(value)
    if m:
        pct = float(m.group(1))
        if pct < 0:
            raise ConfigError(f"{what}: negative quota {value!r}")
        if pct == 0:
            raise ConfigError(f"{what}: zero quota {value!r} (a quota must be positive; omit it for no quota)")
        if pct > 100:
            raise ConfigError(f"{what}: {value!r} is more than the whole device (a percentage must be in (0, 100])")
        return QuotaSpec(fraction=pct / 100, text=value.strip())
    m = _SIZE.match(value)
    if not m:
        raise ConfigError(f"{what}: cannot read {value!r} as a quota (examples: 8589934592, \"8GiB\", "
                          f"\"512MiB\", \"25%\")")
    sign, number, unit = m.groups()
    if unit.lower() not in _UNITS:
        raise ConfigError(f"{what}: bad unit {unit!r} in {value!r} (known units: {KNOWN_UNITS}; or a "
                          f"percentage like \"25%\")")
    if sign == "-":
        raise ConfigError(f"{what}: negative quota {value!r}")
    n = decimal_bytes(number, _UNITS[unit.lower()], MAX_QUOTA_BYTES)
    if n is None:
        raise ConfigError(f"{what}: quota {value!r} is larger than any device (at most {MAX_QUOTA_BYTES - 1} bytes)")
    if n <= 0:
        raise ConfigError(f"{what}: zero quota {value!r} (a quota must be positive; omit it for no quota)")
    return QuotaSpec(nbytes=n, text=value.strip())


def parse_warn(value, what="warn"):
    """A warn ratio in (0, 1] (None stays None); ConfigError otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{what}: expected a number in (0, 1], got {type(value).__name__} {value!r}")
    if not 0 < value <= 1:
        raise ConfigError(f"{what}: {value!r} is outside (0, 1] (a fraction of the quota, e.g. 0.9)")
    return float(value)


_NAME = re.compile(r"[A-Za-z0-9_.-]{1,63}")  # fullmatch: "$" would let a trailing newline through


def check_tenant_name(name, what="tenant name"):
    """The name if it is 1-63 of A-Z a-z 0-9 _ . - (it is stored in the ledger and used as a
    metric label); ConfigError otherwise."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"{what} {name!r} is not valid: use 1-63 of A-Z a-z 0-9 _ . -")
    return name

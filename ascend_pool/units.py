"""Byte sizes as people write them: 1024, "512MiB", "8GiB", "1.5GB", "64k"; and integer arguments
as callers pass them (ints and numpy integers, never bools or floats)."""

import re
from fractions import Fraction

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kb": 1000, "kib": 1024,
    "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1024**4, "tb": 1000**4, "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value, what="size"):
    """Bytes (int) from an int or a string with an optional unit (k/M/G/T: binary; KB/MB/GB/TB:
    decimal; KiB/MiB/GiB/TiB: binary). Raises ValueError naming `what` on anything else."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected bytes, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what}: negative byte count {value}")
        return value
    if isinstance(value, float):
        if value < 0 or value != value or value == float("inf"):
            raise ValueError(f"{what}: bad byte count {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"{what}: expected bytes or a string like '8GiB', got {type(value).__name__}")
    m = _PATTERN.match(value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{what}: cannot read {value!r} as a byte size{_why(value)} (examples: 1048576, '512MiB', "
                         f"'8GiB')")
    n = decimal_bytes(m.group(1), _UNITS[m.group(2).lower()], _MOST_WRITTEN)
    if n is None:
        raise ValueError(f"{what}: {value!r} is larger than any byte count")
    return n


def _why(text):
    """What is wrong with a size text that float() reads ("-1", "1e3"): the grammar's refusal
    alone read as if the number were unreadable, while the float 1e3 is taken."""
    if text.strip().startswith("-") and _PATTERN.match(text.strip()[1:]):
        return ": negative"
    try:
        f = float(text)
    except ValueError:
        return ""
    if f < 0:
        return ": negative"
    if f != f or f in (float("inf"), float("-inf")):
        return ": not a finite number"
    if "e" in text.lower():
        return ": no exponent is taken" + (f" (write {int(f)})" if f.is_integer() and f < 1e30 else "")
    return ""


_MOST_WRITTEN = 2**1024  # past a double's range: refused as before, when the product was inf


def decimal_bytes(number, unit, most):
    """The whole bytes in the decimal text `number` (digits, at most one point) times `unit`,
    rounded down, computed exactly (a float's product was a byte short: "4.1GB" was 4099999999,
    and past 2**53 rounded up); None from `most` on, or past int()'s 4300 digits."""
    try:
        n = int(Fraction(number) * unit)  # int() of a positive Fraction rounds down
    except ValueError:  # sys.get_int_max_str_digits()
        return None
    return n if n < most else None


def format_bytes(n):
    """Human-readable bytes with binary units, e.g. '1.50 GiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def as_index(value):
    """value as an int when it is one (an int or a numpy integer, through __index__), else None: a
    bool, a float, a string, an object whose __index__ refuses (numpy.array([1, 2])) or any other
    object is not an index. Callers raise their own typed
    error naming the argument."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        return None
    try:
        return type(value).__index__(value)
    except TypeError:  # an __index__ that refuses (a numpy array of several items): not an index
        return None

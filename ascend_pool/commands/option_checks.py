"""Range checks of the subcommands' numeric options, done before a command starts any work.

argparse only converts (type=int, type=float); it accepts `nan`, `inf`, `0` and `-1` for a
float and any size of int. Each command lists its numeric options with their ranges and calls
check(args, RANGES): a value outside its range raises ConfigError naming the option and the
value, which the CLI prints as one line and exits 2 with (as for every other bad input).
"""

import argparse
import math

from ..errors import ConfigError

UID_MAX = 2**32 - 2  # (uid_t)-1 means "no uid"


def _num(x):
    return format(x, "g") if isinstance(x, float) else str(x)


class Range:
    """Accepted values of one option: low <= value (low < value when open_low) and value <= high;
    floats must also be finite. what: the quantity the message names ("a finite number of seconds")."""

    def __init__(self, low=None, high=None, open_low=False, what="a number"):
        self.low, self.high, self.open_low, self.what = low, high, open_low, what

    def describe(self):
        bounds = []
        if self.low is not None:
            bounds.append(f"{'>' if self.open_low else '>='} {_num(self.low)}")
        if self.high is not None:
            bounds.append(f"<= {_num(self.high)}")
        return " ".join([self.what] + [" and ".join(bounds)] * bool(bounds))

    def check(self, option, value):
        """ConfigError naming option and value unless value is in range; None passes (not given)."""
        if value is None:
            return
        bad = isinstance(value, float) and not math.isfinite(value)
        if not bad and self.low is not None:
            bad = value <= self.low if self.open_low else value < self.low
        if not bad and self.high is not None:
            bad = value > self.high
        if bad:
            raise ConfigError(f"{option}: expected {self.describe()}, got {value!r}")


def check(args, ranges):
    """Checks every option of ranges ({"--option-name": Range}) in the parsed args; list values
    (action="append") are checked one by one."""
    for option, rng in ranges.items():
        value = getattr(args, option.lstrip("-").replace("-", "_"))
        for v in value if isinstance(value, list) else [value]:
            rng.check(option, v)


DAY_S = 86400.0
DEVICE = Range(0, what="a device index")
UID = Range(0, UID_MAX, what="a uid")


def path(text):
    """argparse type of a file or directory option: refuses the empty string, which an unset shell
    variable gives (--stats-dir "$DIR"): it read as the default directory, or as "." ("'.' is a
    directory", "PosixPath('.') has an empty name"), or as no file named at all."""
    if text == "":
        raise argparse.ArgumentTypeError("expected a path, got '' (an unset variable?)")
    return text


def name(text):
    """argparse type of a name option (bench --trace NAME): refuses the empty string, which an
    unset shell variable gives (--trace "$T"): it said "no trace(s)  in DIR", naming nothing."""
    if text == "":
        raise argparse.ArgumentTypeError("expected a name, got '' (an unset variable?)")
    return text

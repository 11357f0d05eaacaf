"""One home for each shared idea (issue 22): the error map, process identity, the fragmentation
formula and the pool registry each have exactly one definition site in the Python package, and
the names Python uses for the C ABI's codes are the header's."""

import re
from pathlib import Path

import ascend_pool as ap
from ascend_pool import errors

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "ascend_pool" / "include" / "ascend_pool.h"


def test_status_names_match_the_shipped_header():
    codes = {name: int(num) for name, num in
             re.findall(r"#define ASCEND_POOL_(OK|E_[A-Z_]+)\s+(\d+)", HEADER.read_text())}
    assert codes, "no ASCEND_POOL_E_* codes found in ascend_pool.h"
    assert {num: name.removeprefix("E_") for name, num in codes.items()} == errors.STATUS_NAMES


def test_from_code_gives_the_typed_error_users_catch():
    assert isinstance(errors.from_code(10, "over"), ap.QuotaExceededError)
    assert isinstance(errors.from_code(1, "oom"), ap.OutOfMemoryError)
    e = errors.from_code(6, "runtime said no", device_code=207001)
    assert isinstance(e, ap.DeviceError) and e.code == 207001 and str(e) == "runtime said no"
    assert isinstance(errors.from_code(100, "dev 9"), ap.InvalidDeviceError)
    e = errors.from_code(101, "python finalizing")
    assert type(e) is ap.PoolError and "NOT_READY" in str(e) and "python finalizing" in str(e)

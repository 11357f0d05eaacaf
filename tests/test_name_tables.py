"""The Python tables that name C enum values match the C headers, in order and value.

The compiled core reads counters, trace entries, block states and error codes as numbers; the
names users see (memory_stats() keys, snapshot actions and states, exception types, the C ABI's
error names) come from Python tables written beside them. A new enum member in the middle of a C
enum would silently shift every later name: these tests parse the headers and compare.
"""

import re
from importlib import import_module
from pathlib import Path

import ascend_pool.stats as stats_mod
from ascend_pool import _core, config
from ascend_pool.metrics import schema

snapshot = import_module("ascend_pool.snapshot")  # the module: the package's `snapshot` attribute is a function
ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "cython" / "core"


def c_enum(header, prefix):
    """{NAME: value} of the members starting with prefix, from the anonymous or named enums of
    header (C rules: a member without `= value` is the previous one plus 1)."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", "", (CORE / header if "/" not in header else ROOT / header).read_text(),
                  flags=re.S)
    out = {}
    for body in re.findall(r"\benum\b[^{;]*\{(.*?)\}", text, re.S):
        value = -1
        for member in filter(None, (m.strip() for m in body.split(","))):
            name, _, expr = (s.strip() for s in member.partition("="))
            value = int(expr, 0) if expr else value + 1
            if name.startswith(prefix):
                out[name] = value
    assert out, f"no enum member {prefix}* in {header}"
    return out


def in_order(members, prefix, skip=()):
    """Lower-case names of the members by value, checking they are 0..n-1 with no gap."""
    members = {k: v for k, v in members.items() if k not in skip}
    assert sorted(members.values()) == list(range(len(members))), members
    return tuple(k[len(prefix):].lower() for k, _ in sorted(members.items(), key=lambda kv: kv[1]))


def test_stat_names_match_stats_h():
    stats = c_enum("stats.h", "AP_STAT_")
    kinds = {k: stats.pop(k) for k in ("AP_STAT_ALL", "AP_STAT_SMALL", "AP_STAT_LARGE")}
    assert _core._STAT_NAMES == in_order(stats, "AP_STAT_")
    assert len(_core._STAT_NAMES) == c_enum("stats.h", "AP_N_STATS")["AP_N_STATS"]
    assert kinds == {"AP_STAT_ALL": _core._STAT_TYPES.index("all"), "AP_STAT_SMALL": _core._STAT_TYPES.index("small_pool"),
                     "AP_STAT_LARGE": _core._STAT_TYPES.index("large_pool")}
    assert len(_core._STAT_TYPES) == c_enum("stats.h", "AP_N_STAT_TYPES")["AP_N_STAT_TYPES"]


def test_tables_that_name_stats_use_names_the_core_has():
    names = set(_core._STAT_NAMES)
    assert {key for _, key, _ in stats_mod._ROWS} <= names
    assert {stem for _, stem in schema.POOL_GAUGES + schema.POOL_COUNTERS} <= names


def test_history_actions_match_history_h():
    actions = in_order(c_enum("history.h", "AP_ACT_"), "AP_ACT_")
    # config's table names the snapshot's entries and torch's skip_actions bits alike
    assert config.HISTORY_ACTIONS == actions
    assert snapshot.HISTORY_ACTIONS is config.HISTORY_ACTIONS


def test_block_states_match_block_h():
    """A snapshot reports a block's C state as an index into PyTorch's three state names."""
    states = c_enum("block.h", "AP_BLOCK_")
    for table in (_core.BLOCK_STATES, snapshot._STATES):
        assert table[states["AP_BLOCK_FREE"]] == "inactive"
        assert table[states["AP_BLOCK_ALLOCATED"]] == "active_allocated"
        assert table[states["AP_BLOCK_PENDING"]] == "active_pending_free"
        assert len(table) == 3


def test_share_states_match_share_h():
    states = c_enum("share.h", "AP_SHARE_")
    assert _core._SHARE_STATES == {v: k[len("AP_SHARE_"):].lower() for k, v in states.items()}


def test_error_codes_match_pool_h_and_the_public_header():
    """One name per code: the pool's statuses (pool.h) are the C ABI's codes (ascend_pool.h) of the
    same name, and the C ABI's own codes are all named."""
    public = {m.group(1): int(m.group(2)) for m in re.finditer(r"^#define ASCEND_POOL_(OK|E_\w+) (\d+)",
                                                                   (ROOT / "ascend_pool/include/ascend_pool.h").read_text(),
                                                                   re.M)}
    assert _core.CAPI_ERRORS == {code: name.removeprefix("E_") for name, code in public.items()}
    statuses = c_enum("pool.h", "AP_")
    statuses = {k: v for k, v in statuses.items() if k == "AP_OK" or k.startswith("AP_E_")}
    assert statuses.pop("AP_E_BUSY") not in _core.CAPI_ERRORS  # internal: never reported
    for name, code in statuses.items():
        assert _core.CAPI_ERRORS[code] == name.removeprefix("AP_").removeprefix("E_"), name


# A status tested, then an exception made from it: `if code == AP_E_X: raise/return SomeError(`,
# or a table entry `AP_E_X: (..., SomeError, ...)`.
_STATUS_TO_EXCEPTION = re.compile(r"\b(?:AP_E|ASCEND_POOL_E)_\w+\b(?::[^\n]*\b\w*Error\b|[^\n]*\n\s*(?:raise|return) \w*Error\()")


def test_one_error_map():
    """The status -> exception map is written once, in ascend_pool/errors.py (STATUS_ERRORS,
    from_code); no .pxi tests statuses itself: the pool, the C ABI and the other Cython faces go
    through core/errors.pxi's _c_error, which reads that table."""
    homes = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "cython").rglob("*.pxi")
                   if _STATUS_TO_EXCEPTION.search(p.read_text()))
    assert homes == []
    faces = (ROOT / "cython/core/errors.pxi").read_text()
    assert "from ascend_pool.errors import" in faces and "STATUS_ERRORS" in faces

"""One home for each shared idea (issue 22): the error map, process identity, the fragmentation
formula and the pool registry each have exactly one definition site in the Python package, and
the names Python uses for the C ABI's codes are the header's."""

import ast
import os
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


# ---- one definition site per idea, found in the syntax trees of the package ----------------------

PKG = ROOT / "ascend_pool"
EXCEPTIONS = {name for name in errors.__all__ if isinstance(getattr(errors, name), type)} | {"MemoryError"}


def _trees():
    for path in sorted(PKG.rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), str(path))


def _texts(node):
    """The constant text of a str literal or f-string (its literal parts joined)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "{}".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
    return None


def _sites(predicate):
    """{file: first line} of the nodes for which predicate(node, source) holds."""
    out = {}
    for rel, tree in _trees():
        src = (ROOT / rel).read_text()
        docs = {id(n.value) for n in ast.walk(tree)  # docstrings: prose
                if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        for node in ast.walk(tree):
            if id(node) not in docs and predicate(node, src):
                out.setdefault(rel, node.lineno)
    return out


def test_the_error_map_has_one_home():
    # A table from codes to exception classes: a dict literal naming three or more of them.
    def is_map(node, src):
        return isinstance(node, ast.Dict) and \
            len({v.id for v in node.values if isinstance(v, ast.Name)} & EXCEPTIONS) >= 3
    assert set(_sites(is_map)) == {"ascend_pool/errors.py"}


def test_process_identity_has_one_home():
    # Reading who a process is: /proc/PID/stat (start time), the boot id, the pid namespace.
    def reads_proc(node, src):
        text = _texts(node)
        return text is not None and "/proc/" in text and any(k in text for k in ("/stat", "boot_id", "ns/pid"))
    assert set(_sites(reads_proc)) == {"ascend_pool/identity.py"}


def test_the_fragmentation_formula_has_one_home():
    def divides_largest_free(node, src):
        return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and \
            "largest_free" in (ast.get_source_segment(src, node) or "")
    assert set(_sites(divides_largest_free)) == {"ascend_pool/stats.py"}


def test_the_pool_registry_has_one_home():
    # Module-level collections of pools, and the call that tells the C ABI a device's default.
    def holds_pools(node, src):
        if isinstance(node, ast.Call):
            f = node.func
            return (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")) == "_set_default_pool"
        return False

    def module_level_pools():
        out = set()
        for rel, tree in _trees():
            for node in tree.body:
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, ast.AnnAssign) else []
                if any(isinstance(t, ast.Name) and re.search(r"pools?$|defaults$", t.id) for t in targets):
                    out.add(rel)
        return out

    assert set(_sites(holds_pools)) == {"ascend_pool/registry.py"}
    assert module_level_pools() == {"ascend_pool/registry.py"}


def test_policy_names_of_the_knobs_are_the_compiled_pools():
    from ascend_pool import _core, config

    assert set(config.RELEASE_POLICIES) == set(_core.RELEASE_POLICIES)
    assert set(config.STREAM_REUSE) == set(_core.STREAM_REUSE)


def test_one_identity_serves_ledger_shares_and_stats_files():
    from ascend_pool import identity

    assert identity.start_time(1 << 30) is None          # no such process
    assert identity.gone_here(1 << 30) is True
    assert len(identity.boot_id()) == 16
    assert identity.start_time(os.getpid()) and identity.gone_here(os.getpid()) is False


# ---- ARCHITECTURE.md matches the tree ------------------------------------------------------------

# A move that another branch of the same issue makes (C side: the host pool out of core/): the
# new path is named, the old one accepted until that branch lands. Remove the entry then.
def test_every_path_in_architecture_md_exists():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    paths = set(re.findall(r"`((?:ascend_pool|cython|tests|scripts|docs)/[\w./-]*)`", text))
    assert len(paths) >= 30, f"ARCHITECTURE.md names only {len(paths)} paths: is the pattern still right?"
    missing = [p for p in sorted(paths) if not (ROOT / p).exists()]
    assert not missing, f"ARCHITECTURE.md names paths that do not exist: {missing}"


"""Bad input to the node-level surfaces (bad13): the sharing group, private directories, ledger
views, a closed tenant context, torch_npu's base_addr_aligned_kb, open_shared's arguments. Each
gave a bare ValueError / OverflowError / TypeError / AttributeError from deep inside, a wrong
answer, or (a group id of (gid_t)-1) 40 directories left in /dev/shm; each is a typed error now."""
import dataclasses
import os
import warnings

import pytest

import ascend_pool as ap
from ascend_pool import private_dir as pd
from ascend_pool import config, sharing
from ascend_pool.config import knobs_to_config, parse_conf_string
from ascend_pool.errors import ConfigError, InvalidDeviceError, LedgerError, PoolError
from ascend_pool.tenants.ledger import ledger_group, read_view


@pytest.mark.parametrize("value", ["4294967295", "99999999999999999999", "\u00b2", 2**32 - 1, -1])
def test_a_group_that_is_no_group_id_is_a_ledger_error(value):
    with pytest.raises(LedgerError, match="ASCEND_POOL_LEDGER_GROUP"):
        ledger_group(value)


def test_a_group_id_of_gid_t_minus_one_leaves_no_directories(tmp_path, monkeypatch):
    # chown takes (gid_t)-1 as "leave the group": every creation of the group's directory made a
    # directory it could never trust, 20 per attempt, all left behind.
    monkeypatch.setenv("ASCEND_POOL_LEDGER_GROUP", str(2**32 - 1))
    monkeypatch.setenv("ASCEND_POOL_LEDGER_DIR", str(tmp_path))
    pool = ap.Pool(0, backend="sim")
    try:
        with pytest.raises(LedgerError):
            pool.context("no-group", quota="8MiB")
        pool.free(pool.malloc(4096))  # the pool keeps serving
    finally:
        pool.close()
    assert [n for n in os.listdir(tmp_path) if n.startswith("ascend_pool-g")] == []


@pytest.mark.parametrize("base,group,error", [
    ("with\0nul", None, NotADirectoryError), (".", "x", PermissionError), (".", "", PermissionError),
    (".", 2**70, PermissionError), (".", True, PermissionError), (".", 2**32 - 1, PermissionError),
])
def test_private_dir_refuses_bad_arguments_as_os_errors(tmp_path, base, group, error):
    with pytest.raises(error):
        pd.private_dir(str(tmp_path / base) if base != "." else str(tmp_path), group)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("args", [
    ("{path}\0junk", 0, "sim"), ("", 0, "sim"), (None, 0, "sim"), ("{path}", 2**70, "sim"), ("{path}", "x", "sim"),
    ("{path}", True, "sim"), ("{path}", 0, None),
    ("{path}", 0, "sim", "", -1), ("{path}", 0, "sim", "", "users"), ("{path}", 0, "sim", "", None, -1),
    ("{path}", 0, "sim", "", None, "root"), ("{path}", 0, "sim", "", None, 2**32 - 1),
])
def test_read_view_refuses_bad_arguments(args):
    pool = ap.Pool(0, backend="sim")
    ctx = pool.context("view-args", quota="8MiB")
    try:
        path = ctx.ledger.path
        a = tuple(x.format(path=path) if isinstance(x, str) else x for x in args)
        with pytest.raises(LedgerError):  # the NUL path read the real ledger (C stopped at the NUL)
            read_view(*a)
        assert read_view(path, 0, "sim", ctx.ledger.view()["node"])["path"] == path
    finally:
        ctx.close()
        pool.close()


def test_a_closed_tenant_contexts_mem_get_info_is_refused():
    # (free, total) of the whole device: a framework sizing itself from it took 64 GiB.
    pool = ap.Pool(0, backend="sim")
    ctx = pool.context("closed-info", quota="8MiB")
    assert ctx.mem_get_info()[1] == 8 << 20
    ctx.close()
    try:
        with pytest.raises(PoolError, match="closed"):
            ctx.mem_get_info()
    finally:
        pool.close()


@pytest.mark.parametrize("value", ["17", "9" * 400, str(2**70), "1.5", "True", "-1", "abc"])
def test_base_addr_aligned_kb_takes_torch_npus_range(value, monkeypatch):
    monkeypatch.setattr(config, "_warned", set())  # its once-per-process warning stays for the others' tests
    with pytest.raises(ConfigError, match="base_addr_aligned_kb"):
        knobs_to_config(parse_conf_string(f"base_addr_aligned_kb:{value}"), 1 << 30, 1 << 30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its one "has no effect" warning
        knobs_to_config(parse_conf_string("base_addr_aligned_kb:16"), 1 << 30, 1 << 30)  # in range: taken


def test_open_shared_refuses_what_is_no_pool_and_a_device_that_is_no_number():
    pool = ap.Pool(0, backend="sim")
    ptr = pool.share_malloc(2 << 20)
    h = pool.share(ptr, any_process=True)
    try:
        for bad in ("x", 0, object()):
            with pytest.raises(sharing.SharingError, match="Pool"):
                ap.open_shared(h, pool=bad)
        for device in (True, "0", 1.5):
            with pytest.raises(InvalidDeviceError):
                dataclasses.replace(h, node_device=device).local_device()
        for device in (False, 0.0):  # equal to device 0: with a pool given, the block opened
            with pytest.raises(InvalidDeviceError, match="not a device number"):
                ap.open_shared(dataclasses.replace(h, node_device=device), pool=pool)
        blk = ap.open_shared(h, pool=pool)  # the true handle still opens
        blk.close()
    finally:
        assert pool.share_free(ptr) is True
        pool.close()

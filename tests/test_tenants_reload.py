"""Reloading the tenants file into live contexts (explicitly, by the mtime watcher, on SIGHUP),
and $ASCEND_POOL_TENANT making the process's default pools tenant contexts."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import ascend_pool as ap
from ascend_pool.errors import ConfigError
from ascend_pool.tenants import install_sighup_reload, reload_config, watch_config

sys.path.insert(0, os.path.dirname(__file__))
from quota_fixtures import MiB, base, large, ledger_dir  # noqa: E402,F401  (pytest fixtures)

PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(ap.__file__)))


def write_config(path, **quotas):
    text = "".join(f'[tenants.{name}]\nquota = "{q}"\n' for name, q in quotas.items())
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # atomic, like an operator's editor or a config management tool


def test_reload_up_and_down_with_live_blocks(base, tmp_path, caplog):
    cfg = str(tmp_path / "tenants.toml")
    write_config(cfg, online="16MiB", batch="8MiB")
    online = base.context("online", quota=16 * MiB)
    batch = base.context("batch", quota=8 * MiB)
    other = base.context("untouched", quota=4 * MiB)
    try:
        live = [online.malloc(large(4)) for _ in range(3)]
        online.free(online.malloc(large(4)))  # a cached segment
        allocated = online.memory_stats()["allocated_bytes.all.current"]

        write_config(cfg, online="6MiB", batch="32MiB")
        assert reload_config(cfg)
        assert (online.quota, batch.quota, other.quota) == (6 * MiB, 32 * MiB, 4 * MiB)
        assert online.memory_stats()["allocated_bytes.all.current"] == allocated  # nothing lost
        assert online.memory_stats()["reserved_bytes.all.current"] == 12 * MiB  # cache trimmed
        with pytest.raises(ap.QuotaExceededError):
            online.malloc(large(2))
        b = [batch.malloc(large(4)) for _ in range(8)]  # batch grew to its new 32 MiB

        write_config(cfg, online="64MiB", batch="8MiB")
        assert reload_config(cfg)
        live += [online.malloc(large(4)) for _ in range(4)]
        assert online.held == 28 * MiB
        assert batch.held == 32 * MiB and batch.quota == 8 * MiB  # over quota, nothing freed
        with pytest.raises(ap.QuotaExceededError):
            batch.malloc(large(2))
        for p in live:
            online.free(p)
        for p in b:
            batch.free(p)

        # A file with mistakes is not applied: the quotas stay, each mistake is logged.
        with open(cfg, "w") as f:
            f.write('[tenants.online]\nquota = "1XB"\n')
        with caplog.at_level(logging.ERROR, logger="ascend_pool.tenants"):
            assert not reload_config(cfg)
        assert online.quota == 64 * MiB
        assert any(f"{cfg}:2: tenants.online.quota: bad unit 'XB'" in r.getMessage() for r in caplog.records)
    finally:
        for c in (online, batch, other):
            c.close()


def test_a_tenant_removed_from_the_file_keeps_its_quota_and_is_named(base, tmp_path, caplog):
    cfg = str(tmp_path / "tenants.toml")
    write_config(cfg, kept="8MiB", dropped="8MiB")
    kept = base.context("kept", quota=8 * MiB)
    dropped = base.context("dropped", quota=8 * MiB)
    try:
        write_config(cfg, kept="16MiB")
        with caplog.at_level(logging.WARNING, logger="ascend_pool.tenants"):
            assert reload_config(cfg)
        assert (kept.quota, dropped.quota) == (16 * MiB, 8 * MiB)
        msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("'dropped'" in m and "keeps its quota of 8388608 bytes" in m and cfg in m for m in msgs), msgs
        assert not any("'kept'" in m for m in msgs), msgs
        with pytest.raises(ap.QuotaExceededError):  # still enforced
            dropped.malloc(large(10))
    finally:
        for c in (kept, dropped):
            c.close()


def test_watcher_applies_a_changed_file(base, tmp_path):
    cfg = str(tmp_path / "tenants.toml")
    write_config(cfg, watched="8MiB")
    ctx = base.context("watched", quota=8 * MiB)
    watcher = watch_config(cfg, interval=0.02)
    try:
        p = ctx.malloc(large(8))
        write_config(cfg, watched="4MiB")
        deadline = time.monotonic() + 30  # generous: a loaded machine
        # The watcher counts a reload once reload_config has applied it: wait for both.
        while (ctx.quota != 4 * MiB or watcher.reloads < 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ctx.quota == 4 * MiB and watcher.reloads >= 1
        assert ctx.block_info(p) is not None
        write_config(cfg, watched="24MiB")
        while ctx.quota != 24 * MiB and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ctx.quota == 24 * MiB
        ctx.free(p)
    finally:
        watcher.stop()
        ctx.close()


def test_sighup_reload_main_thread_only(base, tmp_path, monkeypatch):
    cfg = str(tmp_path / "tenants.toml")
    write_config(cfg, hup="8MiB")
    monkeypatch.setenv("ASCEND_POOL_CONFIG", cfg)
    ctx = base.context("hup", quota=8 * MiB)
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(ConfigError, install_sighup_reload)))
    t.start()
    t.join()
    assert "main thread" in str(errors[0].value)
    previous = signal.getsignal(signal.SIGHUP)
    reloader = install_sighup_reload()
    try:
        write_config(cfg, hup="2MiB")
        os.kill(os.getpid(), signal.SIGHUP)
        assert reloader.wait_reload(5.0)
        assert ctx.quota == 2 * MiB and reloader.reloads == 1
    finally:
        reloader.uninstall()
        ctx.close()
    assert signal.getsignal(signal.SIGHUP) == (previous if previous is not None else signal.SIG_DFL)


TENANT_SCRIPT = """
    import json, os, signal, time
    import ascend_pool as ap
    MiB = 1 << 20
    pool = ap.default_pool(0)
    out = {"type": type(pool).__name__, "tenant": pool.tenant, "quota": pool.quota}
    p = ap.malloc(4 * MiB - 1024)
    try:
        ap.malloc(4 * MiB - 1024)
    except ap.QuotaExceededError as e:
        out["refused"] = [e.tenant, e.quota, e.held]
    with open(os.environ["ASCEND_POOL_CONFIG"], "w") as f:
        f.write('[tenants.svc]\\nquota = "12MiB"\\n')
    os.kill(os.getpid(), signal.SIGHUP)
    deadline = time.time() + 30  # generous: a loaded machine
    while pool.quota != 12 * MiB and time.time() < deadline:
        time.sleep(0.01)
    out["after_hup"] = pool.quota
    q = ap.malloc(4 * MiB - 1024)
    out["allocated_after_hup"] = ap.memory_allocated()
    print(json.dumps(out))
"""


def test_process_tenant_from_environment(tmp_path):
    cfg = tmp_path / "tenants.toml"
    cfg.write_text('[tenants.svc]\nquota = "6MiB"\nwarn = 0.9\n[tenants.other]\nquota = "1GiB"\ndevices = [1]\n')
    env = dict(os.environ, PYTHONPATH=PKG_PARENT, ASCEND_POOL_CONFIG=str(cfg), ASCEND_POOL_TENANT="svc",
               ASCEND_POOL_CONFIG_RELOAD="sighup")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(TENANT_SCRIPT)], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    import json

    out = json.loads(r.stdout)
    assert out["type"] == "Context" and out["tenant"] == "svc" and out["quota"] == 6 * MiB
    assert out["refused"] == ["svc", 6 * MiB, 4 * MiB]
    assert out["after_hup"] == 12 * MiB and out["allocated_after_hup"] > 8 * MiB - 4096

    # A tenant that is not in the file, or not on this device, is a clear error.
    cfg.write_text('[tenants.svc]\nquota = "6MiB"\n[tenants.other]\nquota = "1GiB"\ndevices = [1]\n')
    for tenant, device, text in (("nobody", 0, "no tenant 'nobody' (tenants: other, svc)"),
                                 ("other", 0, "tenant 'other' (ASCEND_POOL_TENANT) is not configured for device 0")):
        env.update(ASCEND_POOL_TENANT=tenant)
        r = subprocess.run([sys.executable, "-c", f"import ascend_pool as ap; ap.default_pool({device})"], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and text in r.stderr, r.stderr


BAD_RELOAD_SCRIPT = """
import json
import ascend_pool as ap
from ascend_pool import registry
from ascend_pool.tenants import reload
out = []
for _ in range(2):
    try:
        ap.free(ap.malloc(100))
        out.append("served")
    except ap.ConfigError as e:
        out.append(str(e))
print(json.dumps({"calls": out, "open_contexts": len(registry.live_pools()), "triggers": len(reload._env_handles)}))
"""


@pytest.mark.parametrize("value", ["bogus", "watch,bogus"])
def test_a_bad_reload_trigger_is_refused_at_every_call_and_leaves_nothing_open(tmp_path, value):
    # $ASCEND_POOL_CONFIG_RELOAD with an unknown trigger: the first call raised with the tenant's
    # context already open (left in no one's hands) and the triggers before it on ("watch"); the
    # second call was served, the mistake never said again
    cfg = tmp_path / "tenants.toml"
    cfg.write_text('[tenants.svc]\nquota = "1GiB"\n')
    env = dict(os.environ, PYTHONPATH=PKG_PARENT, ASCEND_POOL_CONFIG=str(cfg), ASCEND_POOL_TENANT="svc",
               ASCEND_POOL_CONFIG_RELOAD=value)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(BAD_RELOAD_SCRIPT)], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    import json

    out = json.loads(r.stdout)
    said = f"ASCEND_POOL_CONFIG_RELOAD={value!r}: unknown trigger 'bogus' (expected sighup, watch)"
    assert out == {"calls": [said, said], "open_contexts": 0, "triggers": 0}, out


@pytest.mark.parametrize("interval", [0, -1, float("nan"), float("inf"), 1e-9, 86401, "1", None, True])
def test_a_watcher_interval_that_would_spin_or_kill_its_thread_is_refused(tmp_path, interval):
    # Before: 0, -1 and NaN polled the file without a pause (a core's worth of stat calls), inf
    # ended the thread with an OverflowError traceback, "1"/None were float()'s bare errors
    cfg = str(tmp_path / "tenants.toml")
    write_config(cfg, a="8MiB")
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(ConfigError, match=r"watch_config: interval must be a number of seconds from 0\.01 to 86400, got "):
        watch_config(cfg, interval=interval)
    assert not [t for t in threading.enumerate() if t.ident not in before and t.name == "ascend_pool-config-watch"]

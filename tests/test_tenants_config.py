"""The tenants file: every kind of mistake rejected with a precise line, valid files understood,
and `ascend-pool check-config` exit codes and output."""

import json
import os
import subprocess
import sys

import pytest

import ascend_pool
from ascend_pool.cli import main as cli_main
from ascend_pool.errors import ConfigError
from ascend_pool.tenants.config import ConfigErrors, load, parse_text

GiB = 1 << 30
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(ascend_pool.__file__)))


def write(tmp_path, text, name="tenants.toml"):
    path = tmp_path / name
    path.write_text(text) if isinstance(text, str) else path.write_bytes(text)
    return str(path)


def errors_of(path):
    with pytest.raises(ConfigErrors) as info:
        load(path)
    assert isinstance(info.value, ConfigError)
    return info.value.errors


# (file text, the one expected error line after "FILE:")
BAD = [
    ('[tenants.a]\nquota = "8GiB"\ncolour = "red"\n', '3: tenants.a.colour: unknown key (known: quota, warn, devices)'),
    ('[defaults]\nspeed = 1\n', '2: defaults.speed: unknown key'),
    ('[tenant.a]\nquota = 1\n', "1: tenant: unknown key (expected [tenants.NAME] tables"),
    ('[tenants.a]\nquota = "8XB"\n', "2: tenants.a.quota: bad unit 'XB' in '8XB'"),
    ('[tenants.a]\nquota = "8 gigs"\n', "2: tenants.a.quota: bad unit 'gigs' in '8 gigs'"),
    ('[tenants.a]\nquota = "eight GiB"\n', "2: tenants.a.quota: cannot read 'eight GiB' as a quota"),
    ('[tenants.a]\nquota = -5\n', "2: tenants.a.quota: negative quota -5 bytes"),
    ('[tenants.a]\nquota = "-1GiB"\n', "2: tenants.a.quota: negative quota '-1GiB'"),
    ('[tenants.a]\nquota = "-10%"\n', "2: tenants.a.quota: negative quota '-10%'"),
    ('[tenants.a]\nquota = 0\n', "2: tenants.a.quota: zero quota"),
    ('[tenants.a]\nquota = "0MiB"\n', "2: tenants.a.quota: zero quota '0MiB'"),
    ('[tenants.a]\nquota = "0%"\n', "2: tenants.a.quota: zero quota '0%'"),
    ('[tenants.a]\nquota = "120%"\n', "2: tenants.a.quota: '120%' is more than the whole device"),
    ('[tenants.a]\nquota = 0.25\n', "2: tenants.a.quota: expected bytes (int), a size like \"8GiB\" or a percentage"),
    ('[tenants.a]\nquota = 1\nwarn = 0\n', "3: tenants.a.warn: 0 is outside (0, 1]"),
    ('[tenants.a]\nquota = 1\nwarn = 1.01\n', "3: tenants.a.warn: 1.01 is outside (0, 1]"),
    ('[tenants.a]\nquota = 1\nwarn = -0.5\n', "3: tenants.a.warn: -0.5 is outside (0, 1]"),
    ('[tenants.a]\nquota = 1\nwarn = "high"\n', "3: tenants.a.warn: expected a number in (0, 1], got str 'high'"),
    ('[defaults]\nwarn = true\n', "2: defaults.warn: expected a number in (0, 1], got bool True"),
    ('[tenants.a]\nquota = 1\n\n[tenants.a]\nquota = 2\n', "4: tenants.a: duplicate tenant 'a' (first declared at line 1)"),
    ('[tenants.a]\nquota = 1\ndevices = 0\n', "3: tenants.a.devices: expected a list of device indexes"),
    ('[tenants.a]\nquota = 1\ndevices = [0, 0]\n', "3: tenants.a.devices: device 0 is listed twice"),
    ('[tenants.a]\nquota = 1\ndevices = [-1]\n', "3: tenants.a.devices: -1 is not a device index"),
    ('[tenants.a]\nquota = 1\ndevices = [64]\n', "3: tenants.a.devices: 64 is not a device index (an int from 0 to 63)"),
    ('[tenants."a\\nb"]\nquota = 1\n', " tenants.\"a\\nb\": tenant name 'a\\nb' is not valid"),
    ('[tenants."a b"]\nquota = 1\n', "1: tenants.\"a b\": tenant name 'a b' is not valid"),
    ('[tenants]\na = 3\n', "2: tenants.a: must be a table ([tenants.a])"),
    ('[tenants.a]\nquota = \n', "2: not valid TOML: Invalid value"),
    ('[tenants.a\nquota = 1\n', "1: not valid TOML:"),
    ('[tenants.a]\nquota = 1\nquota = 2\n', "3: not valid TOML: Cannot overwrite a value"),
    ('this is not toml at all\n', "1: not valid TOML:"),
]


@pytest.mark.parametrize("text,expected", BAD, ids=[e.split(": ", 2)[1][:40] for _, e in BAD])
def test_each_mistake_has_one_precise_line(tmp_path, text, expected):
    path = write(tmp_path, text)
    errors = errors_of(path)
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"{path}:{expected}"), (errors[0], expected)


def test_all_mistakes_reported_in_file_order(tmp_path):
    path = write(tmp_path, """\
[defaults]
warn = 0.9
colour = "red"

[tenants.online]
quota = "24GiB"
warn = 1.5

[tenants.batch]
quota = "8XB"
speed = 3

[tenants.online]
quota = 1

[tenants.zero]
quota = 0
""")
    errors = errors_of(path)
    assert [e.split(":")[1] for e in errors] == ["3", "7", "10", "11", "13", "17"], errors
    assert "duplicate tenant 'online' (first declared at line 5)" in errors[4]


def test_not_utf8_and_oversized_files(tmp_path):
    path = write(tmp_path, b'[tenants.a]\nquota = "\xff\xfe"\n')
    assert errors_of(path) == [f"{path}:2: not valid TOML: the file is not UTF-8 text"]
    big = write(tmp_path, "# padding\n" * 110_000, "big.toml")
    (err,) = errors_of(big)
    assert err.startswith(f"{big}: file is 1100000 bytes, larger than the 1048576 byte (1 MiB) limit")
    missing = str(tmp_path / "missing.toml")
    (err,) = errors_of(missing)
    assert err.startswith(f"{missing}: cannot read the tenants file")


def test_a_file_starting_with_a_byte_order_mark_is_named_as_such(tmp_path):
    # As Notepad saves UTF-8 (and `kubectl create configmap --from-file` keeps): invisible in an
    # editor, and tomllib said only "Invalid statement" at line 1 of a file that looks right.
    path = write(tmp_path, b'\xef\xbb\xbf[tenants.a]\nquota = "1GiB"\n')
    assert errors_of(path) == [f"{path}:1: not valid TOML: the file starts with a byte order mark (U+FEFF, as "
                               "some Windows editors save UTF-8); save it without one"]


def test_valid_file_understood_with_defaults_and_overcommit(tmp_path):
    cfg = parse_text("""\
[defaults]
warn = 0.8
devices = [0, 1]
[tenants.online]
quota = "24GiB"
warn = 0.95
[tenants.batch]
quota = "75%"
[tenants.audit]
quota = 1048576
devices = [2]
[tenants.free]
""", "f.toml")
    online, batch, audit, free = (cfg.tenants[n] for n in ("online", "batch", "audit", "free"))
    assert (online.quota.bytes, online.warn, online.devices) == (24 * GiB, 0.95, (0, 1))
    assert (batch.quota.fraction, batch.warn) == (0.75, 0.8)
    assert batch.quota_bytes(64 * GiB) == 48 * GiB
    assert audit.devices == (2,) and audit.applies_to(2) and not audit.applies_to(0)
    assert free.quota is None and "tenant free: warn has no effect without a quota" in cfg.notes
    assert cfg.overcommit_warnings() == []  # percentages alone: 75%
    (w0, w1) = cfg.overcommit_warnings(device_total_bytes=32 * GiB)
    assert "quotas on device 0 add up to 150% of the device (online 24GiB, batch 75%)" in w0
    assert "device 1" in w1 and "allowed" in w1
    with pytest.raises(ConfigError, match=r"no tenant 'nobody' \(tenants: audit, batch, free, online\)"):
        cfg.tenant("nobody")


def test_check_config_ok_prints_what_it_understood(tmp_path, capsys):
    path = write(tmp_path, '[tenants.online]\nquota = "24GiB"\nwarn = 0.9\n[tenants.batch]\nquota = "60%"\n'
                           '[tenants.bulk]\nquota = "50%"\ndevices = [0]\n')
    assert cli_main(["check-config", path]) == 0
    out, err = capsys.readouterr()
    assert f"{path}: 3 tenant(s)" in out
    assert "tenant online: quota 25769803776 bytes (24.00 GiB), warn at 90%, on every device" in out
    assert "tenant batch: quota 60% of the device, no warn level, on every device" in out
    assert out.rstrip().endswith(f"{path}: ok")
    assert "quotas on device 0 add up to 110% of the device" in err and "overcommitted" in err
    assert cli_main(["check-config", path, "--json", "--device-bytes", "32GiB"]) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert data["path"] == path and data["valid"] is True
    assert data["tenants"]["online"]["quota_bytes"] == 24 * GiB and data["tenants"]["batch"]["quota"] == "60%"
    assert len(data["warnings"]) == 2  # device 0: 75% + 60% + 50%; others: 75% + 60%


def test_check_config_refuses_a_device_of_no_bytes(tmp_path, capsys):
    # "--device-bytes 0" (or 0.5, which rounds to 0) ran as if no size were given: no overcommit
    # check of the byte quotas, exit 0
    path = write(tmp_path, '[tenants.online]\nquota = "24GiB"\n')
    for size in ("0", "0.5", ""):
        assert cli_main(["check-config", path, "--device-bytes", size]) == 2
        assert "--device-bytes" in capsys.readouterr().err


def test_check_config_errors_exit_2_one_line_each(tmp_path, capsys):
    path = write(tmp_path, '[tenants.a]\nquota = "8XB"\nwarn = 2\n[tenants.b]\nquota = -1\n')
    assert cli_main(["check-config", path]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        f"{path}:2: tenants.a.quota: bad unit 'XB' in '8XB' (known units: B, KiB, MiB, GiB, TiB, KB, MB, GB, TB, "
        "k, M, G, T; or a percentage like \"25%\")",
        f"{path}:3: tenants.a.warn: 2 is outside (0, 1] (a fraction of the quota, e.g. 0.9)",
        f"{path}:5: tenants.b.quota: negative quota -1 bytes",
    ]
    # --json: a machine reader gets JSON on stdout either way (before: nothing), the lines on stderr
    assert cli_main(["check-config", path, "--json"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out) == {"path": path, "valid": False, "errors": err.splitlines()}
    assert len(err.splitlines()) == 3


def test_check_config_as_a_command(tmp_path):
    good = write(tmp_path, '[tenants.a]\nquota = "1GiB"\n', "good.toml")
    bad = write(tmp_path, "[tenants.a]\nquota = nope\n", "bad.toml")
    env = dict(os.environ, PYTHONPATH=PKG_PARENT)
    run = lambda f: subprocess.run([sys.executable, "-m", "ascend_pool.cli", "check-config", f],  # noqa: E731
                                   capture_output=True, text=True, env=env, timeout=60)
    ok, ko = run(good), run(bad)
    assert ok.returncode == 0 and "tenant a: quota 1073741824 bytes" in ok.stdout
    assert ko.returncode == 2 and ko.stdout == ""
    assert ko.stderr.startswith(f"{bad}:2: not valid TOML: Invalid value") and len(ko.stderr.splitlines()) == 1


def test_a_long_devices_list_is_refused_at_once(tmp_path):
    # 100,000 device indexes (~590 KB, under the 1 MiB cap) took more than 20 s (a quadratic
    # duplicate check); indexes past the C ABI's 64 devices are refused at the first
    import time
    path = write(tmp_path, "[tenants.a]\nquota = 1\ndevices = [" + ", ".join(map(str, range(100_000))) + "]\n")
    start = time.process_time()  # CPU time: a loaded machine delays the process, not its work
    errors = errors_of(path)
    assert time.process_time() - start < 5
    assert len(errors) == 1 and "64 is not a device index" in errors[0], errors


def test_a_tenant_context_refuses_to_open_over_an_unusable_operator_file(tmp_path, monkeypatch):
    # $ASCEND_POOL_CONFIG names the operator's quotas: a missing or broken file used to count as
    # no file, and pool.context("online") then ran without the operator's quota, silently
    bad = tmp_path / "tenants.toml"
    bad.write_text('[tenants.online]\nquota = "24 parsecs"\n')
    good = tmp_path / "good.toml"
    good.write_text('[tenants.online]\nquota = "64MiB"\n')
    pool = ascend_pool.Pool(0, backend="sim")
    try:
        for path, words in ((tmp_path / "missing.toml", "cannot read the tenants file"), (bad, "tenants.online.quota")):
            monkeypatch.setenv("ASCEND_POOL_CONFIG", str(path))
            with pytest.raises(ConfigError, match=rf"ASCEND_POOL_CONFIG={path}: .*{words}"):
                pool.context("online")
            pool.free(pool.malloc(4096))  # the pool keeps serving
        monkeypatch.setenv("ASCEND_POOL_CONFIG", str(good))
        ctx = pool.context("online")
        assert ctx.quota == 64 << 20
        ctx.close()
    finally:
        pool.close()

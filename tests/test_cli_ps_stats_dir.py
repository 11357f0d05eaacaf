"""`ascend-pool ps` refuses a stats directory that does not exist or is not a directory, as `serve`
does (one line, exit 2; before: an empty table and exit 0, which hid the mistake); an existing
empty directory is an empty table (or `[]` with --json), exit 0."""

import json
import os
import subprocess
import sys

import pytest

import ascend_pool
from ascend_pool import cli
from ascend_pool.commands import ps
from ascend_pool.errors import ConfigError


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
@pytest.mark.parametrize("kind", ["missing", "file"])
def test_ps_refuses_a_bad_stats_dir(tmp_path, capsys, kind, json_flag):
    path = tmp_path / "nonexistent"
    if kind == "file":
        path.write_text("x")
    assert cli.main(["ps", "--stats-dir", str(path), *json_flag]) == 2
    out, err = capsys.readouterr()
    why = "does not exist" if kind == "missing" else "is not a directory"
    assert err == (f"ascend-pool ps: ConfigError: the stats directory {path} {why} "
                   f"(--stats-dir or $ASCEND_POOL_STATS_DIR)\n")
    assert out == ""  # nothing a script could take for an empty node


def test_ps_refuses_a_bad_stats_dir_from_the_environment(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ASCEND_POOL_STATS_DIR", "/etc/passwd")
    assert cli.main(["ps", "--json"]) == 2
    assert "the stats directory /etc/passwd is not a directory" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="/etc/passwd is not a directory"):
        ps.rows()


def test_ps_of_an_empty_directory_is_an_empty_table_and_a_missing_one_an_error(tmp_path, capsys):
    assert cli.main(["ps", "--json", "--stats-dir", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().out == ""
    assert cli.main(["ps", "--stats-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert out.split() == ["PID", "INSTANCE", "DEVICE", "TENANT", "HELD", "ALLOCATED", "PID_HERE", "UID",
                           "PIDNS"] and err == ""
    assert cli.main(["ps", "--json", "--stats-dir", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_ps_reads_the_private_directory_the_files_sit_in(tmp_path, capsys):
    # --stats-dir naming ascend_pool-u<uid> itself (where the files are) listed nothing, exit 0
    import os
    import ascend_pool as ap
    from ascend_pool.service.publisher import Publisher
    from ascend_pool.service import paths

    pool = ap.Pool(0, backend="sim")
    pool.tenant = "ps-private"
    pub = Publisher(paths.own_dir(str(tmp_path)), interval=0.05)
    try:
        held = pool.malloc(3 << 20)
        pub.publish_now()
        private = os.path.dirname(pub.path)
        for where in (str(tmp_path), private):
            assert cli.main(["ps", "--json", "--stats-dir", where]) == 0
            rows = [r for r in json.loads(capsys.readouterr().out) if r["tenant"] == "ps-private"]
            assert [r["pid"] for r in rows] == [os.getpid()], where
        pool.free(held)
    finally:
        pub.stop()
        pool.close()


def test_ps_and_list_gpu_processes_list_the_users_processes_of_a_sharing_group(tmp_path):
    # With $ASCEND_POOL_LEDGER_GROUP a process publishes in the group's directory
    # (ascend_pool-g<gid>); `ps` and list_gpu_processes read only the private ones (the node
    # service added the group, they did not): the user's own 8 MiB holder was not listed.
    import os
    import subprocess
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from sim_fixtures import SimNode
    node = SimNode(str(tmp_path / "shm"))
    os.makedirs(node.shm_dir, exist_ok=True)
    env = dict(ASCEND_POOL_LEDGER_GROUP=str(os.getgid()), ASCEND_POOL_STATS_DIR=str(tmp_path),
               ASCEND_POOL_LEDGER_DIR=str(tmp_path), ASCEND_POOL_STATS_INTERVAL="0.05", ASCEND_POOL_BACKEND="sim")
    holder = node.spawn("""
        import ascend_pool as ap
        ctx = ap.Pool(0).context("grouped", quota="64MiB")
        x = ctx.malloc(8 << 20)
        time.sleep(0.3)
        print(os.getpid(), flush=True)
        sys.stdin.readline()
    """, **env)
    try:
        pid = int(holder.stdout.readline())
        out = node.run_json("""
            import contextlib, io
            import ascend_pool as ap
            from ascend_pool import cli
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                cli.main(["ps", "--json"])
            print(json.dumps({"rows": json.loads(buf.getvalue()), "text": ap.list_gpu_processes(0)}))
        """, **env)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    mine = [r for r in out["rows"] if r["tenant"] == "grouped"]
    assert [(r["pid"], r["held_bytes"] >= 8 << 20) for r in mine] == [(pid, True)], out["rows"]
    assert str(pid) in out["text"] and "no processes are running" not in out["text"], out["text"]


def test_ps_with_a_sharing_group_that_does_not_exist_still_lists(tmp_path, capsys, monkeypatch):
    # ps reads the sharing group's directory; a group name that does not resolve made ps and
    # list_gpu_processes raise LedgerError instead of listing what they can read.
    import ascend_pool as ap
    monkeypatch.setenv("ASCEND_POOL_LEDGER_GROUP", "no-such-group-ascend-pool")
    assert cli.main(["ps", "--json", "--stats-dir", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert ap.list_gpu_processes(0).splitlines()[0] == "NPU:0"


def test_ps_table_shows_tenant_names_whole_and_one_row_each(tmp_path, capsys):
    # The table cut tenant names at 20 characters: two tenants differing past that (the JSON had
    # them whole) printed as one name twice. A name with a newline (another user's stats file may
    # hold any UTF-8) printed a row of its own.
    import ascend_pool as ap
    from ascend_pool import identity
    from ascend_pool.service.publisher import Publisher
    from ascend_pool.service import paths

    long_a, long_b = "team-inference-prod-" + "a" * 43, "team-inference-prod-b"  # 63 characters, 21
    pool = ap.Pool(0, backend="sim")
    ctxs = [pool.context(long_a), pool.context(long_b)]
    odd = ap.Pool(0, backend="sim")
    odd.tenant = "x\n  999 forged"
    pub = Publisher(paths.own_dir(str(tmp_path)), interval=0.05)
    try:
        held = [(c, c.malloc(1 << 20)) for c in ctxs + [odd]]
        pub.publish_now()
        assert cli.main(["ps", "--stats-dir", str(tmp_path)]) == 0
        lines = capsys.readouterr().out.splitlines()
        # every line a whole row (this process's other open pools, if any, are listed too)
        assert all(ln.split()[0].isdigit() and ln.split()[1] == identity.instance_hex() for ln in lines[1:]), lines
        cells = [ln.split()[3] for ln in lines[1:]]
        assert long_a in cells and long_b in cells, lines
        assert [ln for ln in lines if ascii(odd.tenant) in ln], lines
        # columns stay aligned: HELD ends where its heading does
        assert {len(ln) for ln in lines} == {len(lines[0])}, lines
        for c, p in held:
            c.free(p)
    finally:
        pub.stop()
        for c in ctxs:
            c.close()
        odd.close()
        pool.close()


def test_a_relative_stats_dir_in_the_environment_is_refused_naming_it(tmp_path, monkeypatch):
    # read from each process's working directory: a worker published where the node service (in
    # its own working directory) never looked, and ps listed the directory under its own
    (tmp_path / "stats").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ASCEND_POOL_STATS_DIR", "stats")
    said = "ASCEND_POOL_STATS_DIR='stats' is a relative path"
    with pytest.raises(ConfigError, match=said):
        ps.rows()
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(ascend_pool.__file__)))
    worker = subprocess.run([sys.executable, "-c", "import ascend_pool as ap; ap.free(ap.malloc(100))"], env=env,
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert worker.returncode == 0 and said in worker.stderr, worker.stderr  # stats not published, said why
    assert not any((tmp_path / "stats").iterdir())

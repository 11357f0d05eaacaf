"""`ascend-pool serve`: --replay runs the bundled traces inside the service and its own pools show
up like any process's; bad arguments fail with exit 2 and one clear line; SIGTERM ends it cleanly
(its stats file removed); the endpoint refuses other methods."""

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(__file__))
from metrics_scrape import start_serve  # noqa: E402

import ascend_pool as _ap

# children import the same build as this process (installed package or in-place tree)
_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(_ap.__file__)))


def env_for(tmp_path):
    env = dict(os.environ)
    for d in ("stats", "ledger"):
        (tmp_path / d).mkdir(exist_ok=True)
    env.update(ASCEND_POOL_STATS="1", ASCEND_POOL_STATS_DIR=str(tmp_path / "stats"), ASCEND_POOL_LEDGER_DIR=str(tmp_path / "ledger"),
               ASCEND_SIM_NODE=f"sv{uuid.uuid4().hex[:10]}", ASCEND_POOL_BACKEND="sim",
               PYTHONPATH=os.pathsep.join(filter(None, [_PKG_PARENT, env.get("PYTHONPATH")])))
    env.pop("ASCEND_POOL_CONFIG", None)
    env.pop("ASCEND_POOL_TENANT", None)
    return env


def run_serve(env, *args, timeout=30):
    return subprocess.run([sys.executable, "-m", "ascend_pool.cli", "serve", "--port", "0", *args],
                          capture_output=True, text=True, env=env, timeout=timeout)


def metrics(port):
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(body) for s in fam.samples}


def test_replay_shows_the_service_working_and_sigterm_cleans_up(tmp_path):
    env = env_for(tmp_path)
    proc, port = start_serve(env, tmp_path / "serve.log", "--replay", "--replay-pause", "0.05")
    try:
        deadline = time.monotonic() + 15
        while True:
            m = metrics(port)
            runs = {dict(lab)["trace"]: v for (n, lab), v in m.items()
                    if n == "ascend_pool_replay_runs_total" and dict(lab)["result"] == "ok"}
            mine = [v for (n, lab), v in m.items()
                    if n == "ascend_pool_allocations_total" and dict(lab).get("pid") == str(proc.pid)]
            if len(runs) == 3 and sum(mine) > 0:
                break
            assert time.monotonic() < deadline, f"replay not seen: {runs}, {mine}"
            time.sleep(0.2)
        assert set(runs) == {"bert_serving_varlen_prefix", "resnet18_train_prefix",
                             "resnet18_train_prefetch_2stream_prefix"}
        (instance,) = {dict(lab)["instance"] for (n, lab), v in m.items()
                       if n == "ascend_pool_allocations_total" and dict(lab).get("pid") == str(proc.pid)}
        assert (tmp_path / "stats" / f"ascend_pool-u{os.geteuid()}" / f"ascend_pool-stats-{instance}").exists()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", data=b"x", method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 405
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=15)
    assert rc == 0, (tmp_path / "serve.log").read_text()
    assert [n for _, _, names in os.walk(tmp_path / "stats") for n in names] == []


def test_replay_of_a_missing_trace_fails_cleanly(tmp_path):
    r = run_serve(env_for(tmp_path), "--replay", str(tmp_path / "nope.npz"))
    assert r.returncode == 2
    assert "nope.npz" in r.stderr and "Traceback" not in r.stderr


def test_device_without_replay_is_said_to_be_ignored_and_one_that_does_not_exist_is_refused(tmp_path):
    # --device is the device of --replay: without --replay `serve --device 8` on a 1-device node
    # started as if it had not been given, nothing said
    env = dict(env_for(tmp_path), ASCEND_SIM_DEVICES="1")
    log = tmp_path / "serve.log"
    proc, _ = start_serve(env, log, "--device", "8")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
    said = [ln for ln in log.read_text().splitlines() if "--device" in ln]
    assert said == ["ascend-pool serve: --device 8 is ignored: it is the device --replay runs on, and there is no "
                    "--replay (the service exports every device's processes)"], log.read_text()
    proc, _ = start_serve(env, log)  # not given: nothing said
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0 and "--device" not in log.read_text()
    r = run_serve(env, "--device", "8", "--replay")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "device 8 does not exist: the sim backend has 1 device(s)" in r.stderr.splitlines()[-1], r.stderr


def test_bad_tenants_file_fails_with_its_errors(tmp_path):
    cfg = tmp_path / "tenants.toml"
    cfg.write_text('[tenants.online]\nquota = "lots"\n')
    r = run_serve(env_for(tmp_path), "--config", str(cfg), "--replay")
    assert r.returncode == 2
    assert "quota" in r.stderr and "Traceback" not in r.stderr


def test_port_in_use_fails_cleanly(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "ascend_pool.cli", "serve", "--port", str(port)],
                           capture_output=True, text=True, env=env_for(tmp_path), timeout=30)
    assert r.returncode == 2
    assert "Address already in use" in r.stderr and "Traceback" not in r.stderr
    assert f"port {port}" in r.stderr, r.stderr  # which port, so the operator knows what to free


def test_the_tenants_file_is_the_option_else_the_variable_else_the_demo(tmp_path, monkeypatch):
    # --config's help says "(as $ASCEND_POOL_CONFIG)": serve --replay with the variable set replays
    # that file's tenants, not the demo's (whose quotas then disagreed with the file's); an
    # explicit --config wins over the variable, in this process's environment too
    from ascend_pool.commands.serve import DEMO_TENANTS, tenants_file
    mine, other = tmp_path / "mine.toml", tmp_path / "other.toml"
    monkeypatch.delenv("ASCEND_POOL_CONFIG", raising=False)
    assert tenants_file(None, replaying=False) is None and "ASCEND_POOL_CONFIG" not in os.environ
    assert tenants_file(None, replaying=True) == DEMO_TENANTS
    monkeypatch.setenv("ASCEND_POOL_CONFIG", str(mine))
    assert str(tenants_file(None, replaying=True)) == str(mine)
    assert tenants_file(other, replaying=True) == other and os.environ["ASCEND_POOL_CONFIG"] == str(other)


def test_a_replay_run_frees_what_the_trace_leaves_live_and_what_a_failed_run_held():
    # `serve --replay` of a trace ending with allocations live (a snapshot, a dump_trace of a
    # running program): each loop kept them in its warm pool (3 MiB more per run here), and a run
    # stopped by an error other than out-of-memory (a stream destroyed) kept what it had
    import numpy as np

    from ascend_pool.service.replay_loop import _Prepared, replay_once
    from ascend_pool.traces import trace_from_arrays

    live_at_end = _Prepared(trace_from_arrays(np.array([1, 1, 0], np.int8), np.array([0, 1, 0]),
                                              np.array([1 << 20, 3 << 20, 1 << 20], np.int64),
                                              np.zeros(3, np.int32), name="live_at_end"))
    two_streams = _Prepared(trace_from_arrays(np.array([1, 1, 0, 0], np.int8), np.array([0, 1, 0, 1]),
                                              np.array([1 << 20, 3 << 20, 1 << 20, 3 << 20], np.int64),
                                              np.array([0, 1, 0, 1], np.int32), name="two_streams"))
    pool = _ap.Pool(0, backend="sim")
    try:
        for _ in range(3):
            assert replay_once(pool, live_at_end, {0: None}) == "ok"
            assert pool.memory_stats()["allocation.all.current"] == 0
        gone = pool.create_stream()
        pool.destroy_stream(gone)
        with pytest.raises(_ap.InvalidStreamError):
            replay_once(pool, two_streams, {0: None, 1: gone})
        assert pool.memory_stats()["allocation.all.current"] == 0
    finally:
        pool.close()


def test_a_replay_run_frees_the_rest_when_one_leftover_cannot_be_freed(caplog):
    # Blocks a run leaves are freed one by one: one refused (its stream destroyed meanwhile, here
    # at the trace's peak) is logged and the others still go back; before, the first refusal
    # escaped replay_once and every block after it stayed in the warm pool
    import numpy as np

    from ascend_pool.service.replay_loop import _Prepared, replay_once
    from ascend_pool.traces import trace_from_arrays

    three = _Prepared(trace_from_arrays(np.array([1, 1, 1], np.int8), np.array([0, 1, 2]),
                                        np.array([1 << 20, 3 << 20, 2 << 20], np.int64),
                                        np.array([1, 0, 1], np.int32), name="three"))
    pool = _ap.Pool(0, backend="sim")
    try:
        gone = pool.create_stream()
        with caplog.at_level("WARNING", logger="ascend_pool.service"):
            assert replay_once(pool, three, {0: None, 1: gone}, at_peak=lambda: pool.destroy_stream(gone)) == "ok"
        stats = pool.memory_stats()
        assert stats["allocation.all.current"] == 2  # the two on the destroyed stream; stream 0's went back
        assert stats["allocated_bytes.all.current"] == pool.round_size(1 << 20) + pool.round_size(2 << 20)
        assert sum("could not be freed" in r.getMessage() for r in caplog.records) == 2
    finally:
        pool.close()

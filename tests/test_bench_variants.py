"""The robustness harness (`ascend-pool bench --variants N`): its perturbed workloads and its summary."""

import json
import statistics

import numpy as np
import pytest

from ascend_pool import cli
from ascend_pool.bench.robustness import summarize
from ascend_pool.bench.variants import RANGES, derive, derive_all, phases
from ascend_pool.traces import bundled_traces_dir, list_traces, load_trace, trace_from_arrays

TRACES = sorted(list_traces(bundled_traces_dir()))


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name[:-4])
def test_variants_are_valid_complete_traces_within_the_documented_ranges(path):
    tr = load_trace(path)
    base_sizes = sorted(set(tr.size.tolist()))
    for v in derive_all(tr, 8):
        # a valid trace (trace_from_arrays checked every free against its allocation) ending empty
        live = np.cumsum(np.where(v.op == 1, v.size, -v.size))
        assert live[-1] == 0 and live.min() >= 0
        p = v.meta["perturbations"]
        lo, hi = RANGES["scale"]
        assert lo <= p["scale"] <= hi
        if "truncate" in p:
            assert RANGES["truncate"][0] <= p["truncate"] <= RANGES["truncate"][1]
            assert v.n_events < tr.n_events * 1.0 + tr.n_allocs  # a prefix plus its closing frees
        if "streams" in p and p["streams"] == "merged":
            assert set(v.stream.tolist()) == {0}
        assert v.meta["variant_of"] == tr.name
    assert base_sizes  # the trace is not empty


def test_variants_repeat_exactly_and_differ_from_each_other():
    tr = load_trace(TRACES[0])
    a, b = derive(tr, 3), derive(tr, 3)
    assert np.array_equal(a.op, b.op) and np.array_equal(a.size, b.size) and np.array_equal(a.stream, b.stream)
    c = derive(tr, 4)
    assert not (c.n_events == a.n_events and np.array_equal(c.size, a.size))
    assert derive(tr, 3, seed=7).meta["perturbations"] != a.meta["perturbations"] or \
        not np.array_equal(derive(tr, 3, seed=7).size, a.size)


def test_phases_cut_where_live_memory_falls_back():
    # ten identical steps on top of a persistent allocation: a phase per step, each cut right after
    # the step's last free
    op, ids, size = [1], [0], [100]
    for k in range(10):
        a, b = 1 + 2 * k, 2 + 2 * k
        op += [1, 1, 0, 0]
        ids += [a, b, a, b]
        size += [10, 10, 10, 10]
    op.append(0); ids.append(0); size.append(100)
    tr = trace_from_arrays(np.array(op, np.int8), np.array(ids), np.array(size))
    ph = phases(tr).tolist()
    assert ph[-1] == 10  # the final free of the persistent allocation is a phase of its own
    assert [i for i in range(1, len(ph)) if ph[i] != ph[i - 1]] == [1 + 4 * k for k in range(1, 11)]


def test_summary_counts_and_distribution():
    ws = [{"name": f"w{i}", "waste_reduction_pct": r, "steady_pct": s, "whole_pct": w, "reserves_more": m}
          for i, (r, s, w, m) in enumerate([(50.0, 0.1, 1.0, False), (-10.0, 2.0, 0.5, True), (90.0, 0.0, 4.0, False)])]
    s = summarize(ws)
    assert s["workloads"] == 3 and s["reserves_more"] == 1
    assert s["min"] == -10.0 and s["max"] == 90.0 and s["median"] == 50.0
    assert s["mean"] == pytest.approx(statistics.fmean([50, -10, 90]))
    assert s["worst_steady_pct"] == 2.0 and s["worst_whole_pct"] == 4.0
    assert s["worst_reduction_workload"] == "w1" and s["worst_steady_workload"] == "w1"
    assert s["misses_call_target"] == 2  # w1 above 1 % steady, w2 above 3 % whole-trace; w0 neither


def test_cli_variants_json(capsys):
    rc = cli.main(["bench", "--traces", str(bundled_traces_dir()), "--backend", "sim", "--no-micro",
                   "--trace", "resnet18_train_prefix", "--allocators", "ascend_pool,torch_npu_policy",
                   "--variants", "3", "--json", "-"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res) >= {"rows", "micro", "variants"}
    v = res["variants"]
    assert v["config"]["n"] == 3
    assert [w["variant"] for w in v["workloads"]] == [0, 1, 2]
    assert set(v["per_trace"]) == {"resnet18_train_prefix"}
    for w in v["workloads"]:
        assert w["reserves_more"] == (w["ascend_pool_reserved_bytes"] > w["reference_reserved_bytes"])
        assert w["ascend_pool_reserved_bytes"] >= w["peak_live_bytes"]
    assert v["overall"]["workloads"] == 3
    assert v["overall"]["reserves_more"] == sum(w["reserves_more"] for w in v["workloads"])
    assert {t["id"] for t in res["targets"]} >= {"variants_never_more", "variants_mean_reduction",
                                                  "variants_steady_calls", "variants_whole_calls"}


def test_cli_without_variants_has_none_and_a_negative_count_is_refused():
    assert cli.main(["bench", "--traces", str(bundled_traces_dir()), "--no-micro", "--variants", "-1"]) == 2


def test_variant_targets_are_not_judged_when_no_variant_could_be_replayed(monkeypatch):
    # every variant fails (a device too small for the trace, an injected fault): the targets say
    # n/a, as the bench's own targets do without rows, not PASS on zero workloads and FAIL on none
    from ascend_pool import OutOfMemoryError
    from ascend_pool.bench import robustness

    def failing(*args, **kwargs):
        raise OutOfMemoryError("out of memory: injected")
    monkeypatch.setattr(robustness._peers, "run_peer", failing)
    res = robustness.run_variants([bundled_traces_dir() / "resnet18_train_prefix.npz"], 2, "sim")
    assert res["overall"]["workloads"] == 0 and len(res["errors"]) == 2
    assert [t["passed"] for t in res["targets"]] == [None, None, None, None]
    assert all("no perturbed workload" in t["detail"] for t in res["targets"])


def test_bench_exits_1_when_only_variant_replays_failed(monkeypatch, tmp_path, capsys):
    # the bench's own rows replayed, every variant failed: exit 0 before, the failures only in
    # the JSON's variants.errors, as if the harness had judged something
    import types

    from ascend_pool import OutOfMemoryError
    from ascend_pool.bench import robustness

    def failing(*args, **kwargs):
        raise OutOfMemoryError("out of memory: injected")
    monkeypatch.setattr(robustness, "_peers", types.SimpleNamespace(run_peer=failing))
    out = tmp_path / "b.json"
    argv = ["bench", "--traces", str(bundled_traces_dir()), "--trace", "resnet18_train_prefix", "--no-micro",
            "--allocators", "direct", "--backend", "sim", "--json", str(out), "--no-progress"]
    assert cli.main(argv + ["--variants", "1"]) == 1
    res = json.loads(out.read_text())
    assert res["rows"] and not res["errors"] and len(res["variants"]["errors"]) == 1
    assert "error on resnet18_train_prefix" in capsys.readouterr().out

"""Bad arguments to the public functions: each is a typed error naming the argument as the caller
gave it, and the pool keeps serving (docs/bad_input.md)."""

import numpy as np
import pytest

import ascend_pool as ap


@pytest.mark.parametrize("kwargs, error, start", [
    ({"size": 2**64}, ap.ConfigError, "set_limit: size must be a byte count from 0 to 2**64-2"),
    ({"size": 1e30}, ap.ConfigError, "set_limit: size must be a byte count from 0 to 2**64-2"),
    ({"size": -1}, ap.ConfigError, "set_limit: size must be a byte count from 0 to 2**64-2"),
    ({"size": float("nan")}, ap.ConfigError, "set_limit: size must be"),
    ({"size": "1GiB"}, ap.ConfigTypeError, "set_limit: size must be a byte count"),
    ({"size": True}, ap.ConfigTypeError, "set_limit: size must be a byte count"),
    ({"fraction": 2}, ap.ConfigError, "set_limit: fraction must be a number in [0, 1]"),
    ({"fraction": float("nan")}, ap.ConfigError, "set_limit: fraction must be a number in [0, 1]"),
    ({"fraction": "0.5"}, ap.ConfigTypeError, "set_limit: fraction must be a number in [0, 1]"),
    ({"limit_bytes": -1}, ap.ConfigError, "set_limit: limit_bytes must be a byte count from 0 to 2**64-2"),
    ({"limit_bytes": 2**70}, ap.ConfigError, "set_limit: limit_bytes must be a byte count from 0 to 2**64-2"),
    ({"limit_bytes": True}, ap.ConfigTypeError, "set_limit: limit_bytes must be a byte count"),
])
def test_set_limit_names_the_argument_it_refuses_one_way(pool, kwargs, error, start):
    # a size past 2**64-2 was "limit must be None or a byte count ..." (limit_bytes='s words),
    # any other bad size "memory limit size must be ..."; a str was no TypeError
    with pytest.raises(error) as e:
        pool.set_limit(**kwargs)
    assert str(e.value).startswith(start) and repr(next(iter(kwargs.values())))[:8] in str(e.value)
    assert pool.get_limit() == 0, "a refused call changes nothing"
    pool.free(pool.malloc(4096))


@pytest.mark.parametrize("value", ["no", None, 1, 0, [], object()])
def test_include_traces_takes_true_or_false_only(pool, value):
    # any object was taken: "no" (a non-empty str) kept the traces, None dropped them
    for call in (pool.snapshot, ap.memory_snapshot):
        with pytest.raises(ap.ConfigTypeError, match="include_traces must be True or False"):
            call(include_traces=value)
    assert isinstance(pool.snapshot(include_traces=np.False_)["segments"], list)
    assert isinstance(ap.memory_snapshot(include_traces=False), list)


@pytest.mark.parametrize("value", ["no", None, 1, 0.0])
def test_memory_summary_and_clear_history_take_true_or_false_only(pool, value):
    # any object was taken: memory_summary(abbreviated="no") abbreviated (a non-empty str is
    # true), record_memory_history(clear_history="no") dropped every pool's events
    pool.record_memory_history(True)
    pool.free(pool.malloc(4096))
    for call, name in ((pool.memory_summary, "abbreviated"), (ap.memory_summary, "abbreviated")):
        with pytest.raises(ap.ConfigTypeError, match=f"{name} must be True or False"):
            call(abbreviated=value)
    with pytest.raises(ap.ConfigTypeError, match="clear_history must be True or False"):
        ap.record_memory_history(True, clear_history=value)
    assert pool.snapshot()["device_traces"][0], "the refused call dropped no event"
    assert "Oversize" in pool.memory_summary(abbreviated=np.True_)
    ap.record_memory_history(None)


@pytest.mark.parametrize("ptr", ["x", -1, 1.5, None, 2**70, True])
def test_allocation_traceback_refuses_what_is_no_address_with_or_without_a_history(ptr):
    # Pool.allocation_traceback("x") was None until the pool recorded a history, then an
    # InvalidPointerError; ap._allocation_traceback(-1) so too, with no pool recording
    fresh = ap.Pool(0, backend="sim")
    try:
        for call in (fresh.allocation_traceback, ap._allocation_traceback):
            with pytest.raises(ap.InvalidPointerError, match="address"):
                call(ptr)
        assert ap._allocation_traceback(0) is None  # an empty tensor's null address, as torch's
        fresh.record_memory_history(True)
        with pytest.raises(ap.InvalidPointerError):
            fresh.allocation_traceback(ptr)
        block = fresh.malloc(4096)
        assert fresh.allocation_traceback(block)
        fresh.free(block)
    finally:
        fresh.close()


def test_every_call_of_a_closed_pool_is_refused_as_closed():
    # mem_get_info() of a closed Pool answered the device's figures (a closed tenant context's
    # is refused, as every other call of a closed pool; free_all_free: free_all_blocks deprecated)
    import inspect

    p = ap.Pool(0, backend="sim")
    block = p.malloc(4096)
    p.free(block)
    p.close()
    values = {"nbytes": 4096, "size": 4096, "ptr": block, "name": "t", "stream": 1, "handle": 1,
              "path": "/nonexistent/x"}
    answered = []
    for name in dir(p):
        call = getattr(p, name)
        if name.startswith("_") or not callable(call) or name in ("close", "use_count", "id", "free_all_free"):
            continue
        params = inspect.signature(call).parameters.values()
        args = {q.name: values.get(q.name) for q in params
                if q.default is q.empty and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)}
        try:
            call(**args)
            answered.append(name)
        except ap.PoolError as e:
            assert "closed" in str(e), (name, e)
    assert answered == []

"""The range checks of the subcommands' options (ascend_pool/commands/option_checks.py) accept
their boundary values: only values outside the documented ranges are refused."""

import argparse
import math

import pytest

from ascend_pool.commands import bench, option_checks as oc, serve
from ascend_pool.errors import ConfigError


def test_boundaries_are_accepted():
    serve_ok = argparse.Namespace(device=0, replay_pause=0.0, allow_uid=[0, oc.UID_MAX], sweep_interval=oc.DAY_S)
    oc.check(serve_ok, serve.RANGES)
    oc.check(argparse.Namespace(sweep_interval=1e-3, device=3, replay_pause=oc.DAY_S, allow_uid=[]), serve.RANGES)
    oc.check(argparse.Namespace(device=0, malloc_latency_us=0, free_latency_us=10_000_000, micro_runs=1,
                                micro_ms=60_000.0, variants=0), bench.RANGES)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0.0, -1.0, oc.DAY_S * 2])
def test_sweep_interval_outside_its_range(value):
    expected = r"^--sweep-interval: expected a finite number of seconds > 0 and <= 86400, got "
    with pytest.raises(ConfigError, match=expected):
        oc.check(argparse.Namespace(sweep_interval=value, device=0, replay_pause=0.1, allow_uid=[]), serve.RANGES)


def test_an_appended_value_is_checked_one_by_one():
    with pytest.raises(ConfigError, match=r"--allow-uid: expected a uid >= 0 and <= 4294967294, got -7"):
        oc.check(argparse.Namespace(allow_uid=[1000, -7]), {"--allow-uid": oc.UID})

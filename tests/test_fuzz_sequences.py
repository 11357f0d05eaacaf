"""Randomized operation sequences (tests/fuzz_sequences.py says what one run does and checks), one
child process per seed on its own simulated node, so that an abort (an invariant of a checked or
ASan build), a crash or a hang fails the test with the run's last operations instead of ending the
suite. The seeds are fixed: a failure reproduces with `python tests/fuzz_sequences.py SEED OPS`.

The fuzzer this was made from (about 80 seeds of 300 operations, over a -DAP_DEBUG build) found
that destroy_stream of a hung stream the pool had never used waited forever (cd1140b; seeds 9 and
12 below still hang on the tree before it); these six seeds are a fast guard that runs on every
build, the ASan one included (scripts/asan.sh), where a broken invariant aborts the child."""
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import TESTS, sim_node  # noqa: E402,F401  (pytest fixture)

SEEDS = (1, 2, 3, 4, 9, 12)  # 9 and 12 hung in destroy_stream before cd1140b (c4a0fb0)
OPS = 150


@pytest.mark.parametrize("seed", SEEDS)
def test_random_operation_sequences_keep_every_promise(sim_node, seed):  # noqa: F811
    p = subprocess.run([sys.executable, "-X", "faulthandler", os.path.join(TESTS, "fuzz_sequences.py"), str(seed),
                        str(OPS)], env=sim_node.env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, (f"seed {seed}: exit {p.returncode}\n--- stdout\n{p.stdout[-6000:]}\n"
                               f"--- stderr\n{p.stderr[-4000:]}")

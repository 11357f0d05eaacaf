"""The worked examples of docs/sharing.md and of the README run as written (weights loaded once, N
spawned workers verify them, device memory stays that of one copy), so neither can rot."""
import os
import re
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sim_fixtures import sim_node  # noqa: E402,F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = {
    "docs/sharing.md": "4 workers verified 64 MiB of weights; device memory in use: 64 MiB",
    "README.md": "4 workers verified 64 MiB; device memory in use: 64 MiB",
}


def example_code(doc):
    """The one ```python block of `doc` that is a script (it has a __main__ guard)."""
    text = open(os.path.join(ROOT, doc)).read()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if '__name__ == "__main__"' in b]
    assert len(blocks) == 1, f"{doc}: expected one runnable example, found {len(blocks)}"
    return blocks[0]


@pytest.mark.parametrize("doc", sorted(EXAMPLES))
def test_worked_example_runs(doc, sim_node, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(example_code(doc))
    env = sim_node.env(ASCEND_POOL_BACKEND="sim")
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert EXAMPLES[doc] in p.stdout, p.stdout


HOLDER = """
import sys
import ascend_pool as ap
pool = ap.Pool(0)
ptr = pool.malloc(32 << 20)
print("holding", flush=True)
sys.stdin.read()
pool.free(ptr)
"""


@pytest.mark.parametrize("doc", sorted(EXAMPLES))
def test_example_holds_while_another_process_uses_the_device(doc, sim_node, tmp_path):
    # `ascend-pool serve --replay` (the README's own demo) may run on the same node: the
    # example's "one copy" check must count its own process tree, not the whole device.
    script = tmp_path / "example.py"
    script.write_text(example_code(doc))
    env = sim_node.env(ASCEND_POOL_BACKEND="sim")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert p.returncode == 0, p.stdout + p.stderr
    assert EXAMPLES[doc] in p.stdout, p.stdout

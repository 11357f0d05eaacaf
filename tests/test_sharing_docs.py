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

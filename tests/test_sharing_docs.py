"""The worked example of docs/sharing.md runs as written (weights loaded once, N spawned workers
verify them, device memory stays that of one copy)."""
import os
import re
import subprocess
import sys

from sim_fixtures import sim_node  # noqa: F401

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "sharing.md")


def example_code():
    text = open(DOC).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    return next(b for b in blocks if '__name__ == "__main__"' in b)


def test_worked_example_runs(sim_node, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(example_code())
    env = sim_node.env(ASCEND_POOL_BACKEND="sim")
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "4 workers verified 64 MiB of weights; device memory in use: 64 MiB" in p.stdout, p.stdout

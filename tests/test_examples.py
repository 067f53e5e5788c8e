"""The examples the README points to really run."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_embed_server_example_converges():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "embed_server.py")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    m = re.search(r"updates (\d+)  mean staleness ([\d.]+)  max \|w - w\*\| ([\d.e+-]+)", proc.stdout)
    assert m, proc.stdout
    assert int(m.group(1)) == 600
    assert float(m.group(3)) < 1e-3  # the three learners solved the regression through the server

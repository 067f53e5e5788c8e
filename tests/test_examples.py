"""The examples the README points to really run."""

import asyncio
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

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


async def test_aiohttp_application_embeds_the_server_and_serves_its_metrics_and_page():
    pytest.importorskip("aiohttp")
    prometheus = pytest.importorskip("prometheus_client.parser")
    spec = importlib.util.spec_from_file_location("embed_aiohttp", ROOT / "examples" / "embed_aiohttp.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    policy, loop = asyncio.get_event_loop_policy(), asyncio.get_running_loop()
    out = await example.demo()  # on this test's running loop (uvloop), the application's own
    assert asyncio.get_event_loop_policy() is policy and asyncio.get_running_loop() is loop
    metrics = {s.name: s.value for f in prometheus.text_string_to_metric_families(out["metrics"]) for s in f.samples}
    assert metrics["rudra_clock"] == 600 and metrics["rudra_gradients_applied_total"] == 600
    assert metrics["rudra_learners"] == 0  # the three learners said bye
    assert "<svg" in out["page"] and "status.json" in out["page"]
    assert out["status"]["clock"] == 600 and len(out["status"]["learners"]) == 3
    w = np.array(out["weights"]["w"])
    assert out["weights"]["clock"] == 600 and np.abs(w - np.arange(8) / 8).max() < 1e-2  # it learned

"""Checked types and style: mypy (configuration in pyproject.toml: strict on the pure layers,
the server and the transports) and ruff (lint and format) over everything we ship."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["rudra_async", "transports", "plugins", "tests", "benchmarks", "examples"]
PLUGINS = ["transports/ucx/rudra_async_ucx", "plugins/rudra-async-example/rudra_async_example"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_lint_and_format_are_clean():
    lint = run("ruff", "check", "--no-cache", *SOURCES)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = run("ruff", "format", "--check", "--no-cache", *SOURCES)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_mypy_is_clean_on_the_package_and_the_shipped_plugins(tmp_path):
    result = run("mypy", "--cache-dir", str(tmp_path / "cache"), "rudra_async", *PLUGINS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout

"""The declared public surface (docs/api.md) is what the modules export, and importing the
package stays light."""

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
SECTIONS = re.findall(r"^## `([\w.]+)`\nNames: (.+)$", DOC, flags=re.M)


def test_the_doc_lists_every_public_module():
    assert [name for name, _ in SECTIONS] == [
        "rudra_async",
        "rudra_async.errors",
        "rudra_async.wire",
        "rudra_async.layout",
        "rudra_async.sync",
        "rudra_async.lr",
        "rudra_async.advice",
        "rudra_async.model_state",
        "rudra_async.transports",
        "rudra_async.kernels",
        "rudra_async.client",
        "rudra_async.config",
        "rudra_async.checkpoint",
        "rudra_async.security",
        "rudra_async.testing",
        "rudra_async.torch",
        "rudra_async.server",
        "rudra_async.monitor",
        "rudra_async.runs.ray_launch",
    ]


@pytest.mark.parametrize(
    "module, names",
    [pytest.param(m, n, id=m, marks=[pytest.mark.torch] if m == "rudra_async.torch" else []) for m, n in SECTIONS],
)
def test_all_is_exactly_the_documented_names_and_each_exists(module, names):
    mod = importlib.import_module(module)
    documented = re.findall(r"`(\w+)`", names)
    assert sorted(mod.__all__) == sorted(documented)
    for name in documented:
        assert getattr(mod, name) is not None


def imported_by(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_import_rudra_async_is_light():
    assert not {"numpy", "msgpack", "torch", "rudra_async.server"} & imported_by("import rudra_async")


@pytest.mark.parametrize(
    "statement",
    [
        "import rudra_async.server",
        "import rudra_async.client",
        "import rudra_async.config",
        "import rudra_async.cli",
        "import rudra_async.monitor",
    ],
)
def test_the_server_the_client_and_the_command_line_do_not_import_torch(statement):
    assert "torch" not in imported_by(statement)

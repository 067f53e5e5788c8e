"""The package's layers: every module belongs to one, imports only from its own layer or
below, and no two modules import each other, even through a function-level ("deferred")
import. And the server's core is I/O-free: importing it loads no event loop, socket or TLS.

The layers, lowest first, are :data:`LAYERS` (docs/architecture.md draws them). The graph is
read from the source (``ast``): every ``import`` that runs, at module level or inside a
function; imports under ``if TYPE_CHECKING:`` are types only and do not count.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "rudra_async"

#: lowest first; a module's layer is that of the longest prefix listed (``kernels`` covers
#: ``kernels.torch_kernel``); "" is the package itself
LAYERS: list[tuple[str, list[str]]] = [
    (
        "foundation",
        [
            "",
            "errors",
            "options",
            "addresses",
            "security",
            "proofs",
            "layout",
            "registry",
            "sync",
            "logs",
            "bodies",
            "wire",
            "schema",
            "lr",
            "model_state",
            "kernels",
            "groups",
            "staleness",
            "eventloop",
        ],
    ),
    ("transports", ["transports"]),
    ("settings", ["checkpoint", "config", "advice"]),
    ("core and client", ["server", "server.core", "server.store", "server.guard", "server.session", "client"]),
    ("monitor", ["monitor"]),
    (
        "server shell",
        ["server.parameter_server", "server.shell", "server.pipeline", "server.checkpointer", "server.traffic"],
    ),
    ("learner", ["learner", "torch"]),
    ("runs", ["runs", "testing"]),
    ("command line", ["cli", "__main__"]),
]

#: what importing :mod:`rudra_async.server.core` must not load
IO_MODULES = ("asyncio", "socket", "ssl", "uvloop")  # not selectors: numpy loads it with subprocess


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted name (``package.sub.mod``) → file, for every module under ``root``."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module → the package's modules it imports when it runs (module level or deferred)."""
    names = module_names(root, package)
    graph: dict[str, set[str]] = {name: set() for name in names}
    for name, path in names.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = here[: len(here) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                submodules = [f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in names]
                # ``from pkg import submodule`` runs the submodule; any other name is pkg's own
                targets = submodules if len(submodules) == len(node.names) else [module, *submodules]
            graph[name] |= {t for t in targets if t in names and t != name}
    return graph


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.orelse:
                    walk(stmt)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            walk(child)

    walk(tree)
    return found


def layer_of(module: str, package: str, layers: list[tuple[str, list[str]]]) -> int:
    """The index of ``module``'s layer; KeyError if no layer lists it or a package above it."""
    relative = module.removeprefix(package).lstrip(".")
    best, index = -1, None
    for i, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            covers = relative == prefix or (prefix and relative.startswith(prefix + "."))
            if covers and len(prefix) > best:
                best, index = len(prefix), i
    if index is None:
        raise KeyError(f"{module} belongs to no layer: add it to LAYERS")
    return index


def upward_imports(graph: dict[str, set[str]], package: str, layers: list[tuple[str, list[str]]]) -> list[str]:
    """``a -> b`` for every import of a module in a higher layer."""
    return sorted(
        f"{a} ({layers[layer_of(a, package, layers)][0]}) -> {b} ({layers[layer_of(b, package, layers)][0]})"
        for a, targets in graph.items()
        for b in targets
        if layer_of(b, package, layers) > layer_of(a, package, layers)
    )


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_module_has_a_layer() -> None:
    for module in module_names(PACKAGE, "rudra_async"):
        layer_of(module, "rudra_async", LAYERS)


def test_no_module_imports_a_higher_layer() -> None:
    assert upward_imports(import_graph(PACKAGE, "rudra_async"), "rudra_async", LAYERS) == []


def test_no_import_cycles_even_through_deferred_imports() -> None:
    assert cycles(import_graph(PACKAGE, "rudra_async")) == []


def test_the_checks_find_a_planted_cycle_and_upward_import(tmp_path: Path) -> None:
    """The two checks above on a package made to break them: they must say so."""
    pkg = tmp_path / "planted"
    pkg.mkdir()
    files = {
        "__init__.py": "",
        "low.py": "from . import high\n",  # upward
        "high.py": "def f():\n    from .other import g\n",  # deferred, part of a cycle
        "other.py": "from .high import f\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import low\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(textwrap.dedent(text))
    layers = [("low", ["", "low"]), ("high", ["high", "other"])]
    graph = import_graph(pkg, "planted")
    assert graph["planted.other"] == {"planted.high"}  # the TYPE_CHECKING import does not count
    assert upward_imports(graph, "planted", layers) == ["planted.low (low) -> planted.high (high)"]
    assert cycles(graph) == [["planted.high", "planted.other"]]
    with pytest.raises(KeyError, match="belongs to no layer"):
        layer_of("planted.elsewhere", "planted", layers)


def _loaded_io(module: str) -> list[str]:
    probe = f"import sys, {module}; print(' '.join(m for m in {IO_MODULES!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    return out.stdout.split()


def test_importing_the_core_loads_no_event_loop_socket_or_tls() -> None:
    assert _loaded_io("rudra_async.server.core") == []
    assert _loaded_io("rudra_async.server.session") == []  # the session is sans I/O too
    assert "asyncio" in _loaded_io("rudra_async.server.parameter_server")  # the probe sees what the shell loads

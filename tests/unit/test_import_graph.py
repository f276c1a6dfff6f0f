"""The package's modules import each other one way: no import cycle in ``qaccel/``.

The graph is built from the source (``ast``), so it sees what a reader sees: every ``import`` and
``from ... import`` of a ``qaccel`` module, at module level or inside a function (a lazy import is
still a dependency), except those under ``if TYPE_CHECKING:`` (annotations only, never executed).
A package's ``__init__`` re-exporting its own submodules is not a dependency of design and is left
out; everything else counts.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "qaccel"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _typing_only_nodes(tree: ast.AST) -> set[int]:
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            hidden |= {id(inner) for statement in node.body for inner in ast.walk(statement)}
    return hidden


def _imported_modules(path: Path, known: set[str]) -> set[str]:
    """The ``qaccel`` modules ``path`` imports (a name taken from a package counts as the submodule when it is one)."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    hidden = _typing_only_nodes(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(anchor + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found.add(source)
            found |= {f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in known}
    deps = {name for name in found if name in known and name != me}
    if path.name == "__init__.py":  # re-exports of the package's own members
        deps = {name for name in deps if not name.startswith(me + ".")}
    return deps


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE_ROOT.rglob("*.py"))
    known = {_module_name(path) for path in paths}
    return {_module_name(path): _imported_modules(path, known) for path in paths}


def test_the_graph_sees_real_edges() -> None:
    # A control: the builder must find the edges the source plainly has (absolute, relative one and two
    # levels up, a package's member module), or an empty graph would pass below.
    graph = import_graph()
    assert "qaccel.checkpoint" in graph["qaccel.train"]
    assert {"qaccel._torch_internals", "qaccel.quant", "qaccel.comm._accounting"} <= graph["qaccel.comm._quantized"]
    assert "qaccel.comm" in graph["qaccel.fsdp._plan"]


def test_a_cycle_is_found_when_there_is_one() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    with pytest.raises(graphlib.CycleError):
        tuple(graphlib.TopologicalSorter(graph).static_order())


def test_no_import_cycle_in_the_package() -> None:
    try:
        tuple(graphlib.TopologicalSorter(import_graph()).static_order())
    except graphlib.CycleError as err:
        cycle = err.args[1]
        pytest.fail("import cycle in qaccel/: " + " -> ".join(cycle))

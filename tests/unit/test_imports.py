"""No import circle among a package's modules: each part reads the parts below it, never the whole above it.

Read from the source (every import, those under ``TYPE_CHECKING`` too), so a
circle hidden from the interpreter by a deferred import counts as well.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

from stalwart.testing.modules import package_modules


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that module ``name`` (at ``path``) imports; ``from package import module`` names the
    module, not the package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found.update(target for target in targets if target in known and target != name)
    return found


@pytest.mark.parametrize(
    "package",
    [
        "stalwart.data",
        "stalwart.coord",
        "stalwart.launch",
        "stalwart.cli",
        "stalwart.redundancy",
        "stalwart.integrations",
    ],
)
def test_the_modules_of_a_package_import_one_another_without_a_circle(package: str) -> None:
    known = package_modules()
    inside = {name: path for name, path in known.items() if name.startswith(f"{package}.")}
    graph = {name: {m for m in imports(name, path, known) if m in inside} for name, path in inside.items()}
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as circle:
        pytest.fail(f"an import circle in {package}: {' -> '.join(circle.args[1])}")


def test_the_reader_sees_deferred_imports_and_modules_imported_from_their_package(tmp_path: Path) -> None:
    source = tmp_path / "status.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from stalwart.coord import history\n"
        "from . import roster\n"
        "if TYPE_CHECKING:\n"
        "    from stalwart.coord.quorum import LighthouseState\n"
    )
    known = {name: source for name in ("stalwart.coord", "stalwart.coord.quorum", "stalwart.coord.history")}
    known["stalwart.coord.roster"] = source
    found = imports("stalwart.coord.status", source, known)
    assert found == {"stalwart.coord.quorum", "stalwart.coord.history", "stalwart.coord.roster"}


def test_integrations_stand_above_runtime_and_the_library_never_imports_them() -> None:
    known = package_modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    inside = {name for name in known if name.startswith("stalwart.integrations")}
    importers = sorted(name for name, found in graph.items() if name not in inside and found & inside)
    assert importers == [], f"modules importing an integration: {importers}"
    above = ("stalwart.launch", "stalwart.cli", "stalwart.testing")
    upward = sorted(f"{name} -> {m}" for name in inside for m in graph[name] if m.startswith(above))
    assert upward == [], f"integrations importing a layer above runtime: {upward}"

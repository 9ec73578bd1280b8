"""No module of stalwart reads or writes another object's private (``_x``) members.

A part used by another through its private members cannot change without
breaking that other part unseen (issue 38: DiLoCo's round loop used the
Manager's through 51 private accesses). The check reads the source: an
attribute ``obj._name`` where ``obj`` is not ``self`` or ``cls`` is an
offence when ``_name`` is a private member some stalwart class defines
(assigned as ``self._name`` or a method ``_name``) and the class the access
sits in does not define it itself (a class may read its own members on
another instance of itself, as ``DataLedger`` copying a ledger does).
Private names of other libraries (torch's ``_allgather_base``) are theirs.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import stalwart

SOURCE = Path(stalwart.__file__).parent
LIBRARIES: dict[tuple[str, str], str] = {
    ("runtime/comm.py", "_timeout"): "torch's process group options take their timeout as _timeout",
}
"""Another library's private member that shares a name with one of stalwart's, by (module, member)."""


@dataclass(frozen=True)
class Access:
    module: str
    line: int
    text: str
    member: str


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _assigns_own_private(node: ast.AST) -> bool:
    """``self._x = ...`` (or ``cls._x``)."""
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and _is_private(node.attr)
        and _is_self(node.value)
    )


def _own_members(cls: ast.ClassDef) -> set[str]:
    """The private members ``cls`` defines: its methods and class attributes, and what it assigns to ``self._x``."""
    members = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _is_private(node.name):
            members.add(node.name)
        elif _assigns_own_private(node):
            assert isinstance(node, ast.Attribute)
            members.add(node.attr)
    for node in cls.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        members.update(t.id for t in targets if isinstance(t, ast.Name) and _is_private(t.id))
    return members


def _accesses(tree: ast.Module, module: str) -> Iterator[tuple[Access, set[str]]]:
    """Each ``obj._x`` (``obj`` not self/cls) with the private members of the classes around it."""

    def visit(node: ast.AST, around: set[str]) -> Iterator[tuple[Access, set[str]]]:
        if isinstance(node, ast.ClassDef):
            around = around | _own_members(node)
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            owner = node.value
            if not _is_self(owner):
                yield Access(module, node.lineno, ast.unparse(node), node.attr), around
        for child in ast.iter_child_nodes(node):
            yield from visit(child, around)

    yield from visit(tree, set())


def _offences() -> list[Access]:
    trees = {
        str(path.relative_to(SOURCE)): ast.parse(path.read_text(encoding="utf-8")) for path in SOURCE.rglob("*.py")
    }
    ours = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                ours |= _own_members(node)
    found = []
    for module, tree in trees.items():
        for access, around in _accesses(tree, module):
            if access.member in ours and access.member not in around and (module, access.member) not in LIBRARIES:
                found.append(access)
    return found


def test_no_module_touches_another_objects_private_members() -> None:
    offences = _offences()
    assert not offences, "\n".join(f"{a.module}:{a.line}: {a.text}" for a in offences)


def test_the_check_catches_a_private_access_and_lets_a_class_read_its_own() -> None:
    source = """
class Keeper:
    def __init__(self):
        self._boundary = True

    def copy(self, other):
        return other._boundary  # its own member on another instance: allowed

class Loop:
    def steps(self, keeper):
        return keeper._boundary
"""
    tree = ast.parse(source)
    ours = set().union(*(_own_members(node) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)))
    flagged = [a.text for a, around in _accesses(tree, "x.py") if a.member in ours and a.member not in around]
    assert flagged == ["keeper._boundary"]

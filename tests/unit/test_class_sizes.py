"""No class in stalwart is longer than ``MAX_CLASS_LINES``: a class that long does more than one job (issue 38).

The check parses every module of the package with :mod:`ast` and measures each
class from its ``class`` line to its last line, docstrings included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import stalwart

SOURCE = Path(stalwart.__file__).parent
MAX_CLASS_LINES = 450


def class_sizes(tree: ast.Module) -> dict[str, int]:
    """Each class of ``tree`` (nested ones too) by name, with its length in lines."""
    return {
        node.name: (node.end_lineno or node.lineno) - node.lineno + 1
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    }


def oversized(source: Path, limit: int) -> dict[tuple[str, str], int]:
    """The classes under ``source`` longer than ``limit`` lines, by (module, class)."""
    found = {}
    for path in sorted(source.rglob("*.py")):
        module = path.relative_to(source).as_posix()
        for name, lines in class_sizes(ast.parse(path.read_text(), str(path))).items():
            if lines > limit:
                found[module, name] = lines
    return found


def test_no_class_is_over_the_limit() -> None:
    assert oversized(SOURCE, MAX_CLASS_LINES) == {}, f"classes over {MAX_CLASS_LINES} lines: split them"


def test_a_long_class_is_found_and_a_short_one_is_not(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    (tmp_path / "long.py").write_text(f"class Long:\n{body}\n\n\nclass Short:\n    x = 1\n")
    nested = "\n".join(f"        y{i} = {i}" for i in range(MAX_CLASS_LINES))
    (tmp_path / "nested.py").write_text(f"def outer():\n    class Inner:\n{nested}\n")
    assert oversized(tmp_path, MAX_CLASS_LINES) == {
        ("long.py", "Long"): MAX_CLASS_LINES + 1,
        ("nested.py", "Inner"): MAX_CLASS_LINES + 1,
    }

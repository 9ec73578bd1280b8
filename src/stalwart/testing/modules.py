"""The modules of the ``stalwart`` package, read from its source tree, for the tests that check every one of them.

From the files rather than ``pkgutil.walk_packages``: ``stalwart.runtime`` is a
namespace package (no ``__init__.py``), which the walk does not enter.
"""

from __future__ import annotations

from pathlib import Path

import stalwart

SOURCE = Path(stalwart.__file__).parent.parent
"""The directory holding the ``stalwart`` package."""


def package_modules() -> dict[str, Path]:
    """Every module of ``stalwart`` by dotted name (a package by its own name), but ``__main__`` modules (importing
    them runs a command)."""
    found = {}
    for path in sorted(SOURCE.joinpath("stalwart").rglob("*.py")):
        parts = path.relative_to(SOURCE).with_suffix("").parts
        if parts[-1] != "__main__":
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


FRAMEWORK_MODULES = frozenset(
    {"stalwart.integrations.torchtitan.trainer", "stalwart.integrations.torchtitan.config_registry"}
)
"""Modules that import an optional framework (torchtitan, an install extra) when imported: a test that imports every
module leaves them out where the framework is missing."""

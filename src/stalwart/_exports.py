"""Public names imported on first use (PEP 562), for the packages whose ``__init__`` re-exports them.

A package lists ``name -> defining module`` and takes this module's
``__getattr__`` and ``__dir__`` for its own, so that importing the package
does not import what its names need (torch, for most of them) until a name is
used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, namespace: dict[str, Any], locations: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``, whose module dict is ``namespace``."""

    def __getattr__(name: str) -> Any:
        """Import a public name's module on first access and cache the name in the package."""
        module = locations.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        """The package's own names and the lazily imported public ones."""
        return sorted({*namespace, *locations})

    return __getattr__, __dir__

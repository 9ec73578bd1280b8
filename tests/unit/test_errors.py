"""Every public error class derives from StalwartError and is imported from one place: the ``stalwart`` package."""

from __future__ import annotations

import ast
import importlib
import inspect
from types import ModuleType

import stalwart
from stalwart.testing.modules import FRAMEWORK_MODULES, package_modules


def misplaced_errors(modules: list[ModuleType]) -> list[str]:
    """The public exception classes defined in ``modules`` that do not derive from ``StalwartError`` or that the
    ``stalwart`` package does not export, each with what is wrong."""
    found = []
    for module in modules:
        for name, value in vars(module).items():
            if name.startswith("_") or not inspect.isclass(value) or not issubclass(value, BaseException):
                continue
            if value.__module__ != module.__name__:
                continue  # imported here, defined elsewhere
            if not issubclass(value, stalwart.StalwartError):
                found.append(f"{module.__name__}.{name} does not derive from StalwartError")
            if name not in stalwart.__all__ or getattr(stalwart, name) is not value:
                found.append(f"{module.__name__}.{name} is not exported by the stalwart package")
    return found


def test_every_public_error_class_is_a_stalwart_error_exported_by_the_package() -> None:
    modules = [importlib.import_module(name) for name in package_modules() if name not in FRAMEWORK_MODULES]
    assert len(modules) > 100, "every module of the package is read"
    assert misplaced_errors(modules) == []


def test_the_modules_importing_a_framework_define_no_error_class() -> None:
    """They are read, not imported (an optional framework, seconds of import): a class of theirs deriving from an
    ``...Error`` or ``...Exception`` would escape the test above."""
    paths = package_modules()
    for name in FRAMEWORK_MODULES:
        classes = [node for node in ast.walk(ast.parse(paths[name].read_text())) if isinstance(node, ast.ClassDef)]
        bases = [ast.unparse(base) for node in classes for base in node.bases]
        assert not [base for base in bases if base.endswith(("Error", "Exception"))], (name, bases)


def test_an_error_outside_the_rules_is_named() -> None:
    module = ModuleType("stalwart.example")

    class Stray(ValueError):
        pass

    class Unlisted(stalwart.StalwartError):
        pass

    class _Private(RuntimeError):
        pass

    for error in (Stray, Unlisted, _Private):
        error.__module__ = module.__name__
        setattr(module, error.__name__, error)
    module.JoinError = stalwart.JoinError  # imported, not defined here
    assert misplaced_errors([module]) == [
        "stalwart.example.Stray does not derive from StalwartError",
        "stalwart.example.Stray is not exported by the stalwart package",
        "stalwart.example.Unlisted is not exported by the stalwart package",
    ]

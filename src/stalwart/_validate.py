"""Argument checks shared by every public entry point.

Each check raises ``ValueError`` (or ``TypeError``) whose message names the
parameter, the value it got and what is allowed, so that a user can fix a bad
call without reading the source.
"""

from __future__ import annotations

import numbers
from typing import Any


def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """Return ``value`` as an int if it is an integer within [minimum, maximum], else raise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        low = "-inf" if minimum is None else str(minimum)
        high = "inf" if maximum is None else str(maximum)
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """Return ``value`` if it is a bool, else raise."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value

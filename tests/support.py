"""Helpers shared by the tests: bounded waiting."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_until(predicate: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    """Poll ``predicate`` every 20 ms until it is truthy; fail after ``timeout`` seconds."""
    for _ in range(int(timeout / 0.02)):
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")

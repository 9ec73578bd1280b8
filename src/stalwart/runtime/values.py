"""Plain loop values healed with the model: a script's ``best_val_loss``, ``iter_num`` and the like.

A training script keeps some state in plain variables, not in objects with
``state_dict()``. :class:`LoopValues` holds such values as attributes (read
and set them as the script did its variables), so that the Manager heals them
with the model and optimizer (``manager.register_values("loop",
best_val_loss=1e9)``). Values are what JSON carries: numbers, strings,
booleans, None, and lists and dicts (string keys) of them. They travel as
JSON, never pickled, and anything else is refused when set, naming the value
and where it sits.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_VALUES_BYTES = 1 << 20
"""Largest JSON form of a member's loop values (they are scalars and small lists, not data)."""


def check_value(where: str, value: Any) -> Any:
    """``value`` if JSON carries it exactly (finite numbers, strings, booleans, None, lists, dicts with string keys),
    else ``ValueError`` naming ``where`` and the value."""
    if value is None or isinstance(value, bool | str | int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} must be a finite number, got {value!r}")
        return value
    if isinstance(value, list | tuple):
        return [check_value(f"{where}[{index}]", item) for index, item in enumerate(value)]
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise ValueError(f"{where} must have string keys (JSON objects do), got the key {key!r}")
        return {key: check_value(f"{where}[{key!r}]", item) for key, item in value.items()}
    raise ValueError(
        f"{where} must be a plain value (a number, string, bool, None, or a list or dict of them), got "
        f"{type(value).__name__} {value!r:.80}: register an object with state_dict()/load_state_dict() instead"
    )


class LoopValues:
    """Named plain values, read and set as attributes, healed as one state (``state_dict`` / ``load_state_dict``).

    The names are fixed at creation (every member must hold the same ones);
    setting another name, or a value JSON does not carry, raises.
    """

    def __init__(self, **values: Any) -> None:
        for name in values:
            if not _NAME.fullmatch(name) or name.startswith("_"):
                raise ValueError(f"a loop value's name must be an identifier not starting with '_', got {name!r}")
        checked = {name: check_value(name, value) for name, value in values.items()}
        object.__setattr__(self, "_values", checked)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(f"no loop value {name!r}; the values are {sorted(values)}")

    def __setattr__(self, name: str, value: Any) -> None:
        values = object.__getattribute__(self, "_values")
        if name not in values:
            raise AttributeError(
                f"no loop value {name!r} (give every name when the values are registered: {sorted(values)})"
            )
        values[name] = check_value(name, value)

    def __repr__(self) -> str:
        return f"LoopValues({', '.join(f'{name}={value!r}' for name, value in self._values.items())})"

    def state_dict(self) -> dict[str, Any]:
        """The values as JSON text (a copy: later changes do not alter it)."""
        text = json.dumps(self._values, allow_nan=False)
        if len(text) > MAX_VALUES_BYTES:
            raise ValueError(f"loop values take {len(text)} bytes as JSON, over {MAX_VALUES_BYTES}: keep data out")
        return {"json": text}

    def load_state_dict(self, state_dict: Any) -> None:
        """Restore values a peer's :meth:`state_dict` made; a malformed state or other names raise ``ValueError``."""
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("json"), str):
            raise ValueError(f'a loop values state must be {{"json": str}}, got {state_dict!r:.80}')
        try:
            loaded = json.loads(state_dict["json"])
        except ValueError as error:
            raise ValueError(f"a loop values state holds malformed JSON: {error}") from None
        if not isinstance(loaded, dict) or set(loaded) != set(self._values):
            names = sorted(loaded) if isinstance(loaded, dict) else loaded
            raise ValueError(f"a loop values state names {names!r:.200}; this member's are {sorted(self._values)}")
        for name, value in loaded.items():
            self._values[name] = check_value(name, value)

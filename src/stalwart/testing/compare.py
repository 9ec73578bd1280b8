"""Exact comparison of nested state (model, optimizer, registered state), naming where two states first differ."""

from __future__ import annotations

from typing import Any

import torch


def assert_same(left: Any, right: Any, where: str = "state") -> None:
    """Exact equality of nested state: tensors by value and dtype, same-type sequences element-wise, else ``==``.

    Raises ``AssertionError`` naming the path of the first difference (``state['param_groups'][0]``).
    """
    if isinstance(left, torch.Tensor):
        assert isinstance(right, torch.Tensor), where
        assert left.dtype == right.dtype and torch.equal(left, right), where
    elif isinstance(left, dict):
        assert isinstance(right, dict) and set(left) == set(right), where
        for key in left:
            assert_same(left[key], right[key], f"{where}[{key!r}]")
    elif isinstance(left, (list, tuple)):
        assert type(right) is type(left) and len(left) == len(right), where
        for position, (a, b) in enumerate(zip(left, right, strict=True)):
            assert_same(a, b, f"{where}[{position}]")
    else:
        assert left == right, where

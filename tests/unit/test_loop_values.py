"""Plain loop values: what JSON carries is kept exactly and travels as JSON; anything else is refused by name."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from stalwart.runtime.values import LoopValues

SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
PLAIN = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4))
NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True)


@given(st.dictionaries(NAMES, PLAIN, min_size=1, max_size=4), st.data())
def test_a_peers_values_are_restored_exactly_through_json(values: dict[str, Any], data: st.DataObject) -> None:
    source = LoopValues(**values)
    name = data.draw(st.sampled_from(sorted(values)))
    setattr(source, name, data.draw(PLAIN))
    target = LoopValues(**dict.fromkeys(values))
    target.load_state_dict(source.state_dict())
    for key in values:
        assert getattr(target, key) == getattr(source, key)
    assert set(source.state_dict()) == {"json"} and isinstance(source.state_dict()["json"], str)


def test_the_values_read_and_set_as_the_scripts_variables_did() -> None:
    loop = LoopValues(best_val_loss=1e9, iter_num=0, history=[])
    loop.best_val_loss = min(loop.best_val_loss, 2.5)
    loop.iter_num += 1
    loop.history = [*loop.history, {"step": 1, "loss": 2.5}]
    assert (loop.best_val_loss, loop.iter_num, loop.history) == (2.5, 1, [{"step": 1, "loss": 2.5}])
    snapshot = loop.state_dict()
    loop.iter_num = 7
    restored = LoopValues(best_val_loss=0.0, iter_num=0, history=None)
    restored.load_state_dict(snapshot)
    assert restored.iter_num == 1, "a state_dict is a copy, not a view"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (math.nan, "best must be a finite number, got nan"),
        (torch.zeros(1), "best must be a plain value .* got Tensor"),
        ({1: 2}, "best must have string keys"),
        ([1, {2}], r"best\[1\] must be a plain value .* got set"),
        (object(), "best must be a plain value"),
    ],
)
def test_a_value_json_does_not_carry_is_refused_naming_where_it_sits(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoopValues(best=value)
    loop = LoopValues(best=0.0)
    with pytest.raises(ValueError, match=message):
        loop.best = value
    assert loop.best == 0.0, "nothing changes on a refusal"


def test_names_are_fixed_and_a_state_of_other_names_is_refused() -> None:
    loop = LoopValues(step=0)
    with pytest.raises(AttributeError, match=r"no loop value 'steps' \(give every name"):
        loop.steps = 1
    with pytest.raises(AttributeError, match="no loop value 'other'"):
        _ = loop.other
    with pytest.raises(ValueError, match=r"names \['a'\]; this member's are \['step'\]"):
        loop.load_state_dict({"json": '{"a": 1}'})
    for bad in ({}, {"json": 1}, {"json": "{"}, []):
        with pytest.raises(ValueError, match="loop values state"):
            loop.load_state_dict(bad)
    with pytest.raises(ValueError, match="must be an identifier"):
        LoopValues(**{"_hidden": 1})
    assert loop.step == 0 and repr(loop) == "LoopValues(step=0)"

"""What a peer publishes of its sharded state is checked before a reshard uses it: a malformed record is a failed
collective, never a crash (pure: no processes)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from stalwart.redundancy.config import Overlap
from stalwart.redundancy.layout import make_layout
from stalwart.runtime.comm import CollectiveError
from stalwart.runtime.zero.repair import PEER_FIELDS, peer_info
from stalwart.runtime.zero.state import ShardState


def shard_state() -> ShardState:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return ShardState(list(model.parameters()), optimizer, Overlap(0.5), "node-a")


def good_record(state: ShardState) -> dict[str, Any]:
    layout = make_layout(Overlap(0.5), ["node-a", "node-b"], state.elements)
    return {
        "node": "node-b", "layout": layout.describe(), "rank": 1, "updates": 3, "committed": True,
        "parity_valid": False, "keys": ["exp_avg", "exp_avg_sq"], "scalars": {"step": [3.0, "float32"]},
        "rows_before": 3, "loaded": True,
    }  # fmt: skip


def test_a_well_formed_record_passes() -> None:
    state = shard_state()
    record = good_record(state)
    assert peer_info(json.dumps(record).encode(), 1, state) == record
    assert set(record) == PEER_FIELDS


BAD_CHANGES = [
    ("not json", lambda r: b"{nope"),
    ("not an object", lambda r: json.dumps([r]).encode()),
    ("missing field", lambda r: json.dumps({k: v for k, v in r.items() if k != "updates"}).encode()),
    ("extra field", lambda r: json.dumps({**r, "eval": "__import__('os')"}).encode()),
    ("rank a string", lambda r: json.dumps({**r, "rank": "1"}).encode()),
    ("rank outside the layout", lambda r: json.dumps({**r, "rank": 7}).encode()),
    ("negative updates", lambda r: json.dumps({**r, "updates": -1}).encode()),
    ("committed not a bool", lambda r: json.dumps({**r, "committed": 1}).encode()),
    ("keys not names", lambda r: json.dumps({**r, "keys": [1, 2]}).encode()),
    ("other keys", lambda r: json.dumps({**r, "keys": ["momentum_buffer"]}).encode()),
    ("rows past the keys", lambda r: json.dumps({**r, "rows_before": 9}).encode()),
    ("scalar not finite", lambda r: json.dumps({**r, "scalars": {"step": [float("inf"), "float32"]}}).encode()),
    ("scalar dtype unknown", lambda r: json.dumps({**r, "scalars": {"step": [1, "complex128"]}}).encode()),
    ("layout garbage", lambda r: json.dumps({**r, "layout": {"redundancy": 3}}).encode()),
    ("layout of another model", lambda r: json.dumps({**r, "layout": {**r["layout"], "parameters": 10**9}}).encode()),
    ("huge", lambda r: b" " * (2 << 20)),
]


@pytest.mark.parametrize(("what", "change"), BAD_CHANGES, ids=[what for what, _ in BAD_CHANGES])
def test_a_malformed_record_is_a_failed_collective(what: str, change: Any) -> None:
    state = shard_state()
    record = good_record(state)
    own_keys = ["exp_avg", "exp_avg_sq"] if what == "other keys" else []
    state.keys = lambda: own_keys  # type: ignore[method-assign]
    with pytest.raises(CollectiveError, match=r"process 1's sharded-state record is malformed"):
        peer_info(change(record), 1, state)


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from(sorted(PEER_FIELDS)), value=st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=6,
))  # fmt: skip
@example(field="scalars", value={"": [None, []]})  # once a TypeError: a list where a dtype name stands
def test_any_value_in_any_field_is_accepted_or_a_failed_collective(field: str, value: Any) -> None:
    """Whatever a peer writes into one field, the reshard either gets a checked record or a CollectiveError."""
    state = shard_state()
    record = {**good_record(state), field: value}
    try:
        checked = peer_info(json.dumps(record).encode(), 1, state)
    except CollectiveError:
        return
    assert checked == record
    assert isinstance(checked["rank"], int) and not isinstance(checked["rank"], bool)
    assert all(isinstance(key, str) for key in checked["keys"])

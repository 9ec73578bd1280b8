"""Healing a replica group sharded with FSDP2, shard by shard, over real Gloo groups.

Four spawned processes form two replica groups of two ("live" and "joining"),
each with its own Gloo default process group and DeviceMesh and a
``fully_shard``-ed MLP with Adam. The live group has trained a few steps; the
joining group is fresh, with other parameters and no optimizer state. Process
r of each group then joins a cross-group Communicator of its own (one process
per group), and ``transfer_state`` heals the joining group's shard r from the
live group's. Both groups take one more identical step. Layouts that do not
match (another model shape, another shard, no sharding) are refused before
anything is allocated.
"""

from __future__ import annotations

import datetime
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from stalwart.runtime import heal
from stalwart.runtime.comm import Communicator
from stalwart.runtime.heal import HealError, transfer_state
from stalwart.runtime.sharding import sharding_layout
from stalwart.testing.compare import assert_same
from tests.integration.fsdp_support import HOST, TIMEOUT, batch, client, join_group, loss, mlp, run_processes, shard

GROUP_SIZE = 2
LIVE, JOINING = 0, 1
"""Group indices; also the ranks in the cross-group communicators (the live group's process is the source)."""
STEPS = 3


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, micros: range) -> None:
    for micro in micros:
        optimizer.zero_grad()
        loss(model, batch(rank, micro)).backward()
        optimizer.step()


def plain(value: Any, full: bool) -> Any:
    """``value`` with every DTensor made a plain tensor: the whole tensor (collective) if ``full``, else the shard."""
    if isinstance(value, DTensor):
        return value.full_tensor() if full else value.to_local().clone()
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {key: plain(item, full) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(item, full) for item in value)
    return value


def snapshot(states: dict[str, Any]) -> dict[str, Any]:
    """Whole tensors and this process's shards of the model's and optimizer's state."""
    state = {name: obj.state_dict() for name, obj in states.items()}
    return {"full": plain(state, full=True), "local": plain(state, full=False)}


class Receiver:
    """A receiving process's view of a cross-group communicator, without a group: a broadcast is a failure."""

    rank = JOINING
    world_size = 2
    device = torch.device("cpu")

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    def read(self, key: str) -> bytes:
        return bytes(self.store.get(key))

    def broadcast(self, tensors: list[torch.Tensor], source_rank: int, *, timeout: float | None = None) -> None:
        raise AssertionError("a refused heal must not reach the broadcast")


def refusal(store: dist.Store, states: dict[str, Any]) -> str:
    """The HealError a joining process gets from the metadata in ``store``; it must come before any allocation."""

    def allocate(specs: list[heal.TensorSpec], device: torch.device) -> list[torch.Tensor]:
        raise AssertionError("a refused heal must not allocate")

    heal._allocate = allocate  # private on purpose: nothing may be allocated (this spawned process is done healing)
    try:
        transfer_state(Receiver(store), LIVE, states, 0, is_target=True)  # type: ignore[arg-type]
    except HealError as error:
        return str(error)
    raise AssertionError("the heal was not refused")


def member(group: int, rank: int, port: int, run: str, out: str) -> None:
    """Process ``rank`` of replica group ``group``: train (live) or not (joining), heal, step once more."""
    mesh = join_group(port, f"{run}/group-{group}", rank, GROUP_SIZE)
    model = shard(mlp(seed=group), mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    if group == LIVE:
        train(model, optimizer, rank, range(STEPS))
    states = {"model": model, "optimizer": optimizer}
    before = snapshot(states)
    cross = Communicator(client(port, f"{run}/cross-{rank}"), group, 2, timeout=TIMEOUT, device=torch.device("cpu"))
    try:
        applied = transfer_state(cross, LIVE, states, STEPS if group == LIVE else 0, is_target=group == JOINING)
    finally:
        cross.abort()
    after = snapshot(states)
    train(model, optimizer, rank, range(STEPS, STEPS + 1))
    result = {"before": before, "after": after, "next": snapshot(states), "applied": applied}
    result["layout"] = sharding_layout(model)
    if group == JOINING:
        wider = shard(mlp(seed=2, hidden=8), mesh)
        wider_states = {"model": wider, "optimizer": torch.optim.Adam(wider.parameters(), lr=0.01)}
        result["wider"] = refusal(client(port, f"{run}/cross-{rank}"), wider_states)
        result["other_shard"] = refusal(client(port, f"{run}/cross-{1 - rank}"), states)
    torch.save(result, Path(out) / f"{group}-{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def healed(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[tuple[int, int], Any], dist.TCPStore, str]:
    """The four processes' results by (group, rank), the master store and the run's prefix."""
    out = tmp_path_factory.mktemp("heal-fsdp")
    master = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=TIMEOUT))
    run = f"heal-fsdp-{uuid.uuid4().hex}"
    processes = [(group, rank) for group in (LIVE, JOINING) for rank in range(GROUP_SIZE)]
    run_processes(member, [(group, rank, master.port, run, str(out)) for group, rank in processes], timeout=4 * TIMEOUT)
    results = {key: torch.load(out / f"{key[0]}-{key[1]}.pt", weights_only=True) for key in processes}
    return results, master, run


def test_the_joining_group_gets_the_live_groups_shards_and_steps_the_same(healed: tuple) -> None:
    results = healed[0]
    for rank in range(GROUP_SIZE):
        live, joining = results[LIVE, rank], results[JOINING, rank]
        weights = [peer["before"]["full"]["model"]["0.weight"] for peer in (live, joining)]
        assert not torch.equal(*weights)
        assert joining["before"]["full"]["optimizer"]["state"] == {}
        assert set(live["before"]["full"]["optimizer"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
        assert_same(live["after"], live["before"], f"live {rank}")
        assert_same(joining["after"], live["after"], f"joining {rank}")  # whole tensors and this rank's shards
        assert_same(joining["next"], live["next"], f"next step {rank}")
        assert not torch.equal(live["next"]["full"]["model"]["0.weight"], live["after"]["full"]["model"]["0.weight"])
        assert joining["layout"] == live["layout"]
        assert live["applied"] == joining["applied"] == STEPS
    shards = [results[LIVE, rank]["after"]["local"]["model"]["2.weight"].shape for rank in range(GROUP_SIZE)]
    assert shards == [(1, 6), (0, 6)]  # an uneven layer, with an empty shard, healed too


def test_a_model_of_another_shape_is_refused_naming_the_tensor_and_both_shapes(healed: tuple) -> None:
    for rank in range(GROUP_SIZE):
        assert healed[0][JOINING, rank]["wider"] == (
            f"heal metadata tensor #0 'model/0.weight' is [3, 4] torch.float32, the shard at [{rank}] of [6, 4] "
            f"(Shard(dim=0) over a mesh of [2]); this member's is [4, 4] torch.float32, the shard at [{rank}] of "
            "[8, 4] (Shard(dim=0) over a mesh of [2])"
        )


def test_another_processs_shard_is_refused_even_when_its_shape_fits(healed: tuple) -> None:
    for rank in range(GROUP_SIZE):
        assert healed[0][JOINING, rank]["other_shard"].startswith(
            f"heal metadata tensor #0 'model/0.weight' is [3, 4] torch.float32, the shard at [{1 - rank}] of [6, 4] "
            f"(Shard(dim=0) over a mesh of [2]); this member's is [3, 4] torch.float32, the shard at [{rank}] of"
        )


def test_an_unsharded_member_refuses_a_shard_before_allocating(healed: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    _, master, run = healed
    allocations: list[Any] = []
    monkeypatch.setattr(heal, "_allocate", lambda specs, device: allocations.append(specs) or [])
    store = dist.PrefixStore(f"{run}/cross-0", master)
    meta = json.loads(store.get(heal.META_KEY))
    layout = {"shape": [6, 4], "placements": ["Shard(dim=0)"], "mesh": [2], "coordinate": [0]}
    assert meta["tensors"][0]["dtensor"] == layout
    model = mlp(seed=1)
    states = {"model": model, "optimizer": torch.optim.Adam(model.parameters(), lr=0.01)}
    with pytest.raises(HealError) as refused:
        transfer_state(Receiver(store), LIVE, states, 0, is_target=True)  # type: ignore[arg-type]
    assert str(refused.value) == (
        "heal metadata tensor #0 'model/0.weight' is [3, 4] torch.float32, the shard at [0] of [6, 4] "
        "(Shard(dim=0) over a mesh of [2]); this member's is [6, 4] torch.float32"
    )
    assert allocations == []

"""Healing over a real Gloo group: a target receives the source's whole state exactly; others keep theirs.

Three spawned processes rendezvous on a TCPStore started by the test: rank 0
(the source) has trained a few steps, rank 1 (the target) is fresh, rank 2
(a bystander) has trained differently. The state is the model, Adam, a StepLR
scheduler, a small custom stateful object and the RNG states. Each saves its
state before and after ``transfer_state`` and after one more identical step;
the test compares them. Planted metadata (a huge shape, a wrong dtype, swapped
names, a total over budget) is refused before anything is allocated.
"""

from __future__ import annotations

import copy
import json
import random
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from stalwart.launch.processes import preloaded_context
from stalwart.runtime import heal
from stalwart.runtime.comm import CollectiveError, Communicator
from stalwart.runtime.heal import HealError, flatten_states, transfer_state
from stalwart.runtime.state import host_rng_states
from stalwart.testing.compare import assert_same
from stalwart.testing.loopback import prefix_store

HOST = "127.0.0.1"
TIMEOUT = 60.0  # collectives and rendezvous of spawned peers on a busy machine: a bound, not an expectation
ROLES = ("source", "target", "bystander")
SOURCE_STEPS = 3
BYSTANDER_STEPS = 1


def model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Adam]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


class Counters:
    """A user's stateful object: python values, int-keyed dicts, a tuple and a tensor."""

    def __init__(self) -> None:
        self.seen = 0
        self.losses: list[float] = []
        self.by_step: dict[int, str] = {}
        self.window = (0, 0)
        self.ema = torch.zeros(3)

    def update(self, loss: float) -> None:
        self.seen += 16
        self.losses.append(loss)
        self.by_step[len(self.losses)] = f"loss {loss:.3f}"
        self.window = (self.window[1], self.seen)
        self.ema = 0.9 * self.ema + 0.1 * loss

    def state_dict(self) -> dict[str, Any]:
        return {
            "seen": self.seen,
            "losses": list(self.losses),
            "by_step": dict(self.by_step),
            "window": self.window,
            "ema": self.ema.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"]
        self.losses = list(state["losses"])
        self.by_step = dict(state["by_step"])
        self.window = state["window"]
        self.ema = state["ema"].clone()


def make_states(seed: int) -> dict[str, Any]:
    model, optimizer = model_and_optimizer(seed)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "counters": Counters(),
        **host_rng_states(),
    }


def train(states: dict[str, Any], steps: int, seed: int) -> None:
    model, optimizer = states["model"], states["optimizer"]
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        inputs = torch.randn(16, 4, generator=generator)
        optimizer.zero_grad()
        loss = model(inputs).pow(2).sum()
        loss.backward()
        optimizer.step()
        states["scheduler"].step()
        states["counters"].update(float(loss.detach()))


def snapshot(states: dict[str, Any]) -> dict[str, Any]:
    return {name: copy.deepcopy(states[name].state_dict()) for name in ("model", "optimizer", "scheduler", "counters")}


def draws() -> list[float]:
    """One draw from each global generator a heal carries."""
    return [float(torch.rand(())), float(np.random.rand()), random.random()]


def heal_peer(rank: int, port: int, prefix: str, out: str) -> None:
    """One member: build its state by role, take part in the transfer from rank 0, then step once more."""
    torch.set_num_threads(1)
    role = ROLES[rank]
    states = make_states(seed=rank)
    steps = {"source": SOURCE_STEPS, "target": 0, "bystander": BYSTANDER_STEPS}[role]
    train(states, steps, seed=100 + rank)
    torch.manual_seed(10 + rank)
    np.random.seed(20 + rank)
    random.seed(30 + rank)
    store = prefix_store(HOST, port, prefix, TIMEOUT)
    comm = Communicator(store, rank, len(ROLES), timeout=TIMEOUT, device=torch.device("cpu"))
    try:
        before = snapshot(states)
        applied = transfer_state(comm, 0, states, steps, is_target=role == "target")
        after = snapshot(states)
        drawn = draws()
        train(states, 1, seed=999)
        result = {
            "before": before,
            "after": after,
            "next": snapshot(states),
            "applied": applied,
            "draws": drawn,
            "lr": states["optimizer"].param_groups[0]["lr"],
        }
        torch.save(result, Path(out) / f"{role}.pt")
    finally:
        comm.abort()


def differs(left: Any, right: Any) -> bool:
    try:
        assert_same(left, right)
    except AssertionError:
        return True
    return False


def test_the_target_gets_the_source_state_exactly_and_steps_the_same(store: dist.TCPStore, tmp_path: Path) -> None:
    context = preloaded_context()
    prefix = f"heal-{uuid.uuid4().hex}/"
    peers = [context.Process(target=heal_peer, args=(rank, store.port, prefix, str(tmp_path))) for rank in range(3)]
    try:
        for peer in peers:
            peer.start()
        for peer in peers:
            peer.join(timeout=2 * TIMEOUT)
        assert [peer.exitcode for peer in peers] == [0, 0, 0]
    finally:
        for peer in peers:
            if peer.is_alive():
                peer.kill()
                peer.join(timeout=TIMEOUT)
    source, target, bystander = (torch.load(tmp_path / f"{role}.pt", weights_only=True) for role in ROLES)

    assert differs(source["before"]["model"], target["before"]["model"])
    assert target["before"]["optimizer"]["state"] == {}
    assert set(source["before"]["optimizer"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert source["before"]["scheduler"]["last_epoch"] == SOURCE_STEPS
    assert target["before"]["scheduler"]["last_epoch"] == 0
    assert list(source["before"]["counters"]["by_step"]) == [1, 2, 3]  # int keys survive the JSON
    assert target["before"]["counters"]["seen"] == 0
    assert_same(source["after"], source["before"], "source")
    assert_same(target["after"], source["after"], "target")
    assert_same(target["next"], source["next"], "next step")
    assert target["lr"] == source["lr"] == 0.01 * 0.5**2
    assert target["draws"] == source["draws"]
    assert differs(source["next"]["model"], source["after"]["model"])

    assert_same(bystander["after"], bystander["before"], "bystander")
    assert differs(bystander["after"]["model"], source["after"]["model"])
    assert bystander["draws"] != source["draws"]
    assert [peer["applied"] for peer in (source, target, bystander)] == [SOURCE_STEPS] * 3


def test_optimizer_state_that_is_not_json_raises_a_clear_type_error(store: dist.TCPStore) -> None:
    states = make_states(seed=0)
    train(states, 1, seed=0)
    states["optimizer"].param_groups[0]["schedule"] = {0.1, 0.01}
    alone = prefix_store(HOST, store.port, f"json-{uuid.uuid4().hex}/", TIMEOUT)
    comm = Communicator(alone, 0, 1, timeout=TIMEOUT, device=torch.device("cpu"))
    try:
        with pytest.raises(TypeError, match=r"optimizer/param_groups/0/schedule.*set.*cannot be sent as JSON"):
            transfer_state(comm, 0, states, 1, is_target=False)
    finally:
        comm.abort()


class Receiver:
    """A receiving member's communicator as transfer_state sees it, without a group: a broadcast is a failure."""

    rank = 1
    world_size = 2
    device = torch.device("cpu")

    def __init__(self, meta: dict[str, Any]) -> None:
        self.store = dist.HashStore()
        self.store.set(heal.META_KEY, json.dumps(meta))

    def read(self, key: str) -> bytes:
        return bytes(self.store.get(key))

    def broadcast(self, tensors: list[torch.Tensor], source_rank: int, *, timeout: float | None = None) -> None:
        raise AssertionError("a refused heal must not reach the broadcast")


def twin_layers(seed: int) -> dict[str, Any]:
    """A model with two layers of the same shape (a permutation between them keeps every shape)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return {"model": model, "optimizer": optimizer}


def source_meta() -> dict[str, Any]:
    states = twin_layers(seed=0)
    states["model"](torch.ones(2, 4)).sum().backward()
    states["optimizer"].step()
    meta, _ = flatten_states(states, applied_step=1)
    return meta


def plant_huge_shape(meta: dict[str, Any]) -> str:
    meta["tensors"][0]["shape"] = [1 << 20, 1 << 20]  # 4 TiB of float32
    return r"#0 'model/0.weight' is \[1048576, 1048576\] torch.float32; this member's is \[4, 4\]"


def plant_wrong_dtype(meta: dict[str, Any]) -> str:
    meta["tensors"][1]["dtype"] = "float64"
    return r"#1 'model/0.bias' is \[4\] torch.float64; this member's is \[4\] torch.float32"


def plant_swapped_names(meta: dict[str, Any]) -> str:
    first, third = meta["tensors"][0], meta["tensors"][2]
    first["name"], third["name"] = third["name"], first["name"]
    return r"#0 'model/2.weight' is out of order: this member expects 'model/0.weight' here"


def plant_unknown_tensor(meta: dict[str, Any]) -> str:
    meta["tensors"].append({"name": "model/extra", "shape": [1 << 40], "dtype": "uint8"})
    return r"'model/extra' is not part of this member's state"


def plant_shard_claim(meta: dict[str, Any]) -> str:
    meta["tensors"][0]["shape"] = [2, 4]
    meta["tensors"][0]["dtensor"] = {"shape": [4, 4], "placements": ["Shard(dim=0)"], "mesh": [2], "coordinate": [1]}
    return (
        r"#0 'model/0.weight' is \[2, 4\] torch.float32, the shard at \[1\] of \[4, 4\] \(Shard\(dim=0\) over a mesh "
        r"of \[2\]\); this member's is \[4, 4\] torch.float32$"
    )


def plant_malformed_layout(meta: dict[str, Any]) -> str:
    meta["tensors"][1]["dtensor"] = {"shape": [4], "placements": ["Shard(dim=0)"], "mesh": [2], "coordinate": "0"}
    return r"#1 'model/0.bias' has a malformed DTensor coordinate 0"


@pytest.mark.parametrize(
    "plant",
    [
        plant_huge_shape,
        plant_wrong_dtype,
        plant_swapped_names,
        plant_unknown_tensor,
        plant_shard_claim,
        plant_malformed_layout,
    ],
)
def test_planted_metadata_is_refused_before_anything_is_allocated(plant: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    allocations: list[Any] = []
    monkeypatch.setattr(heal, "_allocate", lambda specs, device: allocations.append(specs) or [])
    meta = source_meta()
    expected = plant(meta)
    target = twin_layers(seed=1)
    with pytest.raises(HealError, match=expected):
        transfer_state(Receiver(meta), 0, target, 0, is_target=True)  # type: ignore[arg-type]
    assert allocations == []


def test_a_heal_over_its_byte_budget_is_refused_and_a_fitting_one_allocates(monkeypatch: pytest.MonkeyPatch) -> None:
    allocations: list[Any] = []
    monkeypatch.setattr(heal, "_allocate", lambda specs, device: allocations.append(specs) or [])
    meta = source_meta()
    with pytest.raises(HealError, match=r"#1 'model/0.bias' brings the heal to 80 bytes, over the budget of 64"):
        transfer_state(Receiver(meta), 0, twin_layers(seed=1), 0, is_target=True, max_bytes=64)  # type: ignore[arg-type]
    assert allocations == []

    specs = heal.check_heal_meta(meta, twin_layers(seed=1))
    names = [spec.name for spec in specs]
    assert names[:4] == ["model/0.weight", "model/0.bias", "model/2.weight", "model/2.bias"]
    assert "optimizer/state/0/exp_avg" in names  # Adam state the fresh target has not created yet is allowed


def test_states_registered_differently_are_refused() -> None:
    meta = source_meta()
    target = twin_layers(seed=1)
    target["scheduler"] = torch.optim.lr_scheduler.StepLR(target["optimizer"], step_size=1)
    with pytest.raises(HealError, match=r"the source's states \['model', 'optimizer'\] differ"):
        heal.check_heal_meta(meta, target)


def _optimizer_groups(meta: dict[str, Any]) -> list[Any]:
    """The encoded ``param_groups`` of the optimizer in ``meta`` (a list of encoded dicts)."""
    optimizer = dict(meta["states"][1]["__dict__"])
    return optimizer["param_groups"]


def _set_group_value(meta: dict[str, Any], key: str, value: Any) -> None:
    for pair in _optimizer_groups(meta)[0]["__dict__"]:
        if pair[0] == key:
            pair[1] = value


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda meta: _set_group_value(meta, "lr", "0.01; import os"), r"group 0 'lr' is '0.01; import os'"),
        (lambda meta: _set_group_value(meta, "lr", float("nan")), r"group 0 'lr' is nan"),
        (lambda meta: _set_group_value(meta, "amsgrad", 1), r"group 0 'amsgrad' is 1; this member's is a bool"),
        (lambda meta: _set_group_value(meta, "betas", {"__tuple__": [0.9]}), r"'betas' must be a sequence of 2"),
        (lambda meta: _set_group_value(meta, "params", [0, 1, 2, 7]), r"'params' names other parameters"),
        (lambda meta: _optimizer_groups(meta).append(_optimizer_groups(meta)[0]), r"another number of parameter"),
        (lambda meta: _optimizer_groups(meta)[0]["__dict__"].pop(), r"group 0 has keys"),
        (lambda meta: meta["states"][1]["__dict__"].append(["extra", 1]), r"is not an optimizer state"),
        (lambda meta: meta["states"][0]["__dict__"].append([["a"], 1]), r"malformed key-value pair"),
        (lambda meta: meta["states"][0].update(oops=1), r"unexpected keys"),
    ],
)
def test_malformed_non_tensor_values_are_refused_before_anything_is_loaded(
    change: Any, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The source's hyper-parameters and structure are checked against the receiver's own (a failed collective)."""
    monkeypatch.setattr(heal, "_allocate", lambda specs, device: [])
    meta = source_meta()
    change(meta)
    target = twin_layers(seed=1)
    before = json.dumps(target["optimizer"].state_dict()["param_groups"])
    with pytest.raises(HealError, match=expected) as refused:
        transfer_state(Receiver(meta), 0, target, 0, is_target=True)  # type: ignore[arg-type]
    assert isinstance(refused.value, CollectiveError), "a failed collective: the quorum is asked again"
    assert json.dumps(target["optimizer"].state_dict()["param_groups"]) == before


def test_a_state_that_refuses_its_values_is_a_heal_error_not_a_crash() -> None:
    class Picky:
        def state_dict(self) -> dict[str, Any]:
            return {"epoch": 3}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            raise ValueError(f"epoch must be an int, got {state['epoch']!r}")

    meta = {"applied_step": 1, "names": ["picky"], "states": [{"__dict__": [["epoch", "x"]]}], "tensors": []}
    with pytest.raises(HealError, match="state 'picky' refused the values the heal brought: epoch must be an int"):
        heal._load({"picky": Picky()}, meta, [])  # private on purpose: the load step alone, without a group

"""Healing over a real Gloo group: a target receives the source's model and Adam state exactly; others keep theirs.

Three spawned processes rendezvous on a TCPStore started by the test: rank 0
(the source) has trained a few steps, rank 1 (the target) is fresh, rank 2
(a bystander) has trained differently. Each saves its state before and after
``transfer_state`` and after one more identical step; the test compares them.
"""

from __future__ import annotations

import copy
import datetime
import multiprocessing
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from stalwart.runtime.comm import Communicator, quorum_store
from stalwart.runtime.heal import transfer_state

HOST = "127.0.0.1"
TIMEOUT = 20.0
ROLES = ("source", "target", "bystander")
SOURCE_STEPS = 3
BYSTANDER_STEPS = 1


def model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Adam]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        inputs = torch.randn(16, 4, generator=generator)
        optimizer.zero_grad()
        model(inputs).pow(2).sum().backward()
        optimizer.step()


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(optimizer.state_dict())}


def heal_peer(rank: int, port: int, prefix: str, out: str) -> None:
    """One member: build its state by role, take part in the transfer from rank 0, then step once more."""
    torch.set_num_threads(1)
    role = ROLES[rank]
    model, optimizer = model_and_optimizer(seed=rank)
    steps = {"source": SOURCE_STEPS, "target": 0, "bystander": BYSTANDER_STEPS}[role]
    train(model, optimizer, steps, seed=100 + rank)
    store = quorum_store(HOST, port, prefix, TIMEOUT)
    comm = Communicator(store, rank, len(ROLES), timeout=TIMEOUT, device=torch.device("cpu"))
    try:
        before = snapshot(model, optimizer)
        applied = transfer_state(comm, 0, model, optimizer, steps, is_target=role == "target")
        after = snapshot(model, optimizer)
        train(model, optimizer, 1, seed=999)
        result = {"before": before, "after": after, "next": copy.deepcopy(model.state_dict()), "applied": applied}
        torch.save(result, Path(out) / f"{role}.pt")
    finally:
        comm.abort()


def assert_same(left: Any, right: Any, where: str = "state") -> None:
    """Exact equality of nested state: tensors by value and dtype, same-type sequences element-wise, else ==."""
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


def differs(left: Any, right: Any) -> bool:
    try:
        assert_same(left, right)
    except AssertionError:
        return True
    return False


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    master = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=TIMEOUT))
    yield master


def test_the_target_gets_the_source_state_exactly_and_steps_the_same(store: dist.TCPStore, tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
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
    assert_same(source["after"], source["before"], "source")
    assert_same(target["after"], source["after"], "target")
    assert_same(target["next"], source["next"], "next step")
    assert differs(source["next"], source["after"]["model"])

    assert_same(bystander["after"], bystander["before"], "bystander")
    assert differs(bystander["after"]["model"], source["after"]["model"])
    assert [peer["applied"] for peer in (source, target, bystander)] == [SOURCE_STEPS] * 3


def test_optimizer_state_that_is_not_json_raises_a_clear_type_error(store: dist.TCPStore) -> None:
    model, optimizer = model_and_optimizer(seed=0)
    train(model, optimizer, 1, seed=0)
    optimizer.param_groups[0]["schedule"] = {0.1, 0.01}
    alone = quorum_store(HOST, store.port, f"json-{uuid.uuid4().hex}/", TIMEOUT)
    comm = Communicator(alone, 0, 1, timeout=TIMEOUT, device=torch.device("cpu"))
    try:
        with pytest.raises(TypeError, match=r"set.*cannot be sent as JSON"):
            transfer_state(comm, 0, model, optimizer, 1, is_target=False)
    finally:
        comm.abort()

"""Checkpoints: the lighthouse vouches for reported checkpoints and resumes a whole fleet from the newest.

Pure tests drive ``LighthouseState`` with the simulated cluster of
``test_quorum``; ``test_checkpoint_resume.py`` runs real processes.
"""

from __future__ import annotations

import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from stalwart.coord.client import CheckpointAnnouncement
from stalwart.coord.hosted_ledger import ledger_digest
from stalwart.coord.quorum import RequestError
from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan
from stalwart.data.world import WorldInfo
from stalwart.errors import StateLostError
from stalwart.runtime.checkpoint import Checkpointer, CheckpointError, CheckpointMeta, load_checkpoint
from stalwart.runtime.checkpointing import CheckpointPolicy
from stalwart.runtime.config import Checkpointing
from stalwart.runtime.group import GroupLink
from stalwart.runtime.replica import Replica
from stalwart.testing.fleet import SimulatedFleet

PLAN = EpochPlan(120, 12, seed=3)


def ledger_at(cluster: SimulatedFleet, step: int) -> dict[str, Any]:
    """The ledger state the members hold after committing ``step`` steps in the current quorum (a replay)."""
    ledger = DataLedger(cluster.state.plan)
    for _ in range(step):
        ledger.begin_step(cluster.members)
        ledger.commit()
    return ledger.state_dict()


def report(cluster: SimulatedFleet, at: int, path: str = "/ckpt", **changes: Any) -> dict[str, Any]:
    """A checkpoint report of step ``at`` (as a member sends it), with ``changes`` to its fields."""
    ledger = ledger_at(cluster, at)
    body = {"member": cluster.members[0], "step": at, "path": path, "ledger": ledger, "digest": ledger_digest(ledger)}
    return {**body, **changes}


def test_a_checkpoint_is_kept_only_when_its_ledger_is_the_one_committed() -> None:
    cluster = SimulatedFleet(PLAN)
    cluster.start(2)
    cluster.run_steps(5)
    assert cluster.state.step == 5
    revision = cluster.state.revision
    for body, status in [
        (report(cluster, 6), 409),
        (report(cluster, 3, digest="0" * 32), 422),
        (report(cluster, 3, step=4), 422),
        (report(cluster, 3, path=""), 400),
        (report(cluster, 3, ledger={"nonsense": 1}), 400),
        (report(cluster, 3, extra=1), 400),
        ([1, 2], 400),
        (report(cluster, 3, member=cluster.state.quorum.members[1]), 403),  # not the quorum's writer (its rank 0)
        (report(cluster, 3, member="never-in-a-quorum"), 403),
    ]:
        with pytest.raises(RequestError) as refused:
            cluster.state.record_checkpoint(body, cluster.now)
        assert refused.value.status == status, body
    assert cluster.state.checkpoint is None and cluster.state.revision == revision

    forged = ledger_at(cluster, 3)
    forged["base_index"] = forged["base_index"] + 1
    with pytest.raises(RequestError) as refused:
        cluster.state.record_checkpoint(report(cluster, 3, ledger=forged, digest=ledger_digest(forged)), cluster.now)
    assert refused.value.status in (400, 422)

    assert cluster.state.record_checkpoint(report(cluster, 3), cluster.now).step == 3
    assert cluster.state.record_checkpoint(report(cluster, 5, path="/later"), cluster.now).path == "/later"
    assert cluster.state.record_checkpoint(report(cluster, 4, path="/older"), cluster.now).path == "/later"
    assert cluster.state.to_status()["checkpoint"]["step"] == 5


def test_a_whole_fleet_restarted_resumes_from_the_checkpoint_and_the_ledger_rolls_back() -> None:
    cluster = SimulatedFleet(PLAN)
    cluster.start(2)
    cluster.run_steps(3)
    cluster.state.record_checkpoint(report(cluster, 3), cluster.now)
    cluster.run_steps(4)
    assert cluster.state.step == 7
    for member in list(cluster.members):
        cluster.kill(member)
    newcomers = [cluster.spawn() for _ in range(2)]
    for member in newcomers:
        assert cluster.ask(member, "join") is None
    formation = cluster.settle()
    assert formation.heal is not None
    assert formation.heal["source_rank"] is None
    assert formation.heal["checkpoint"] == {"step": 3, "path": "/ckpt", "digest": ledger_digest(ledger_at(cluster, 3))}
    assert sorted(formation.heal["targets"]) == sorted(newcomers)
    assert formation.applied_step == 3 and cluster.state.step == 3
    status = cluster.state.to_status()
    assert [(r["from_step"], r["to_step"]) for r in status["resumed_from_checkpoint"]] == [(7, 3)]
    assert status["counts"]["checkpoint_resumes"] == 1
    cluster.run_steps(2)
    assert cluster.state.step == 5
    restored = type(cluster.state).from_state_dict(cluster.state.state_dict(), now=cluster.now)
    assert (
        restored.checkpoint == cluster.state.checkpoint
        and restored.to_status()["resumed_from_checkpoint"] == status["resumed_from_checkpoint"]
    )


def test_without_a_checkpoint_a_lost_state_is_announced_as_lost() -> None:
    cluster = SimulatedFleet(PLAN)
    cluster.start(2)
    cluster.run_steps(4)
    for member in list(cluster.members):
        cluster.kill(member)
    newcomer = cluster.spawn()
    assert cluster.ask(newcomer, "join") is None
    formation = cluster.settle()
    assert formation.heal == {"source_rank": None, "targets": [newcomer], "checkpoint": None}
    assert cluster.state.step == 4


def test_survivors_holding_the_state_are_healed_from_not_rolled_back() -> None:
    cluster = SimulatedFleet(PLAN)
    cluster.start(2)
    cluster.run_steps(3)
    cluster.state.record_checkpoint(report(cluster, 3), cluster.now)
    cluster.run_steps(2)
    survivor, victim = cluster.members
    cluster.kill(victim)
    cluster.ask(survivor, "failure")
    formation = cluster.settle()
    assert formation.heal is None and cluster.state.step == 5
    newcomer = cluster.spawn()
    cluster.ask(newcomer, "join")
    cluster.ask(survivor, "reconfigure")
    formation = cluster.settle()
    assert formation.heal is not None and formation.heal["checkpoint"] is None
    assert formation.heal["source_rank"] == 0 and cluster.state.step == 5


def test_manager_state_dict_round_trips_model_optimizer_and_registered_state() -> None:
    from stalwart.launch.digits import digits_model, digits_optimizer, digits_scheduler
    from stalwart.runtime.manager import Manager

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        model = digits_model(0)
        optimizer = digits_optimizer(model)
        return model, optimizer, digits_scheduler(optimizer)

    from stalwart.coord.server import Lighthouse

    with Lighthouse(PLAN) as lighthouse:
        model, optimizer, scheduler = build()
        model(torch.rand(3, 64)).sum().backward()
        optimizer.step()  # before the Manager: under it, optimizer.step() is a reduced step's update only
        for _ in range(12):
            scheduler.step()
        source = Manager(model, optimizer, lighthouse=lighthouse.url, member="a", max_microbatch=4)
        source.register_state("lr_scheduler", scheduler)
        loop = source.register_values("loop", best_val_loss=1e9, iter_num=0)
        loop.best_val_loss, loop.iter_num = 2.75, 12
        states = {name: obj.state_dict() for name, obj in source.states.items()}
        ledger = DataLedger(PLAN).state_dict()
        source.load_state_dict({"applied_step": 0, "ledger": ledger, "states": states})
        saved = source.state_dict()
        target_model, target_optimizer, target_scheduler = build()
        target = Manager(target_model, target_optimizer, lighthouse=lighthouse.url, member="b", max_microbatch=4)
        target.register_state("lr_scheduler", target_scheduler)
        target_loop = target.register_values("loop", best_val_loss=1e9, iter_num=0)
        with pytest.raises(ValueError, match="states"):
            target.load_state_dict({**saved, "states": {}})
        target.load_state_dict(saved)
        source.close()
        target.close()
    for name, value in model.state_dict().items():
        assert torch.equal(value, target_model.state_dict()[name])
    assert target_scheduler.state_dict() == scheduler.state_dict()
    assert (target_loop.best_val_loss, target_loop.iter_num) == (2.75, 12), "plain loop values travel too"
    assert target_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    first = next(iter(optimizer.state.values()))
    assert torch.equal(first["exp_avg"], next(iter(target_optimizer.state.values()))["exp_avg"])


def test_a_member_the_quorum_went_on_without_is_told_it_is_left_out() -> None:
    cluster = SimulatedFleet(PLAN)
    cluster.start(2)
    first, second = cluster.members
    assert not cluster.state.left_out(first) and not cluster.state.left_out(second)
    cluster.run_steps(2)
    cluster.now += 3.0  # second falls silent past the heartbeat timeout; first keeps heartbeating
    cluster.heartbeat([first])
    cluster.ask(first, "failure")
    formation = cluster.settle()
    assert formation.members == (first,)
    cluster.state.heartbeat(second, cluster.applied[second], cluster.now)  # it was only late: alive again
    assert cluster.state.left_out(second) and not cluster.state.left_out(first)
    cluster.ask(second, "join")
    assert not cluster.state.left_out(second), "asking to join is enough"


def test_a_finished_checkpoint_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    """DCP's metadata is pickled and the JSON holds the ledger: 0600 files in 0700 directories."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    finished: list[Path] = []
    writer = Checkpointer(Checkpointing(tmp_path / "ckpt", every_steps=1), on_finished=lambda d, m: finished.append(d))
    ledger = DataLedger(EpochPlan(8, 4)).state_dict()
    writer.start({"model": model, "optimizer": optimizer}, CheckpointMeta(1, ledger, ledger_digest(ledger)))
    assert writer.wait(120) and len(finished) == 1
    directory = finished[0]
    assert (directory / ".metadata").is_file() and (directory / "stalwart.json").is_file()
    assert stat.S_IMODE((tmp_path / "ckpt").stat().st_mode) == 0o700
    for path in [directory, *directory.rglob("*")]:
        assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600), path
    assert load_checkpoint(directory, {"model": model, "optimizer": optimizer}).step == 1


def _written(tmp_path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Path:
    finished: list[Path] = []
    writer = Checkpointer(Checkpointing(tmp_path / "ckpt", every_steps=1), on_finished=lambda d, m: finished.append(d))
    ledger = DataLedger(EpochPlan(8, 4)).state_dict()
    writer.start({"model": model, "optimizer": optimizer}, CheckpointMeta(1, ledger, ledger_digest(ledger)))
    assert writer.wait(120) and finished
    return finished[0]


def test_a_corrupt_checkpoint_is_one_checkpoint_error_not_a_raw_dcp_exception(tmp_path: Path) -> None:
    """DCP's CheckpointException derives from BaseException: it must still become a CheckpointError."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    directory = _written(tmp_path, model, optimizer)
    for data in directory.glob("*.distcp"):
        data.write_bytes(b"not a tensor file")
    with pytest.raises(CheckpointError, match="cannot load the checkpoint"):
        load_checkpoint(directory, {"model": model, "optimizer": optimizer})


def test_a_checkpoint_announced_outside_the_workers_directory_is_refused(tmp_path: Path) -> None:
    """The lighthouse's announcement names a path: a worker loads only from inside its own checkpoint_dir."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    elsewhere = _written(tmp_path / "elsewhere", model, optimizer)
    config = Checkpointing(tmp_path / "mine", every_steps=1)
    session = SimpleNamespace(member="w0", client=None, group=GroupLink(WorldInfo(0, 1)))
    policy = CheckpointPolicy(config, session, Replica(model, optimizer), None)  # type: ignore[arg-type]
    meta = CheckpointMeta.read(elsewhere)
    for path in (str(elsewhere), str(config.path / ".." / "elsewhere" / "ckpt" / elsewhere.name)):
        with pytest.raises(StateLostError, match="outside this worker's checkpoint directory"):
            policy.load(CheckpointAnnouncement(1, path, meta.digest))

"""stalwart's torchtitan trainer on CPU: two replica groups of torchtitan's llama3 debug model (their processes
forked with torchrun's environment, :meth:`Groups.launch`; one failure-free run a torchrun job).

Group 1's processes are SIGKILLed while both groups are held at the top of
step ``KILL_AT`` (:mod:`tests.integration.torchtitan_job`); group 0 trains
on alone with the whole global batch, group 1's replacement (launched
with the job and waiting until told to go, so that its torch and torchtitan
imports overlap the run instead of following the kill) joins group 0's
quorum and is healed to its step; both finish. The run must train every
step on the same global batch, each sample exactly once (the audit of
``--fault_tolerance.audit_dir``), and end, on every process of both groups,
with the parameters of a failure-free run (one group of the same size alone:
the step's gradient is the mean over its samples whoever trains them) within
1e-4. Two shapes: groups of one process saving torchtitan's checkpoints (the
relaunched group loads its own last one first); groups of two with FSDP2
inside (healed shard by shard) whose optimizer state is sharded across the
groups with ``Parity``. The failure-free runs (:class:`FailureFree`) train
alongside the first test's groups: every run here spends most of its seconds
starting torch and torchtitan, so runs side by side take the machine's spare
share.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[torchtitan]')")

from stalwart.coord.server import Lighthouse
from stalwart.data.audit import audit_directory
from stalwart.testing import torchtitan_cpu
from stalwart.testing.digits_job import together
from stalwart.testing.groups import ForkedGroup
from stalwart.testing.torchrun import TorchrunGroup
from stalwart.testing.torchtitan_assets import TorchtitanAssets
from stalwart.testing.waiting import wait_until
from tests.integration.torchtitan_seams import GO_VARIABLE, HOLD_VARIABLE, RUN_DIR_VARIABLE

STEPS = 6
GLOBAL_BATCH = 4
KILL_AT = 2
REJOIN_AT = 3
TOLERANCE = 1e-4
RUN_TIMEOUT = 420.0
REPOSITORY = Path(__file__).resolve().parents[2]


def stalwart_args(
    assets: TorchtitanAssets, dump: Path, replica: int, local_batch: int, *more: str, steps: int = STEPS
) -> list[str]:
    """The llama3 debug model under stalwart's (held) trainer: short sequences, a global batch of 4, a fixed seed,
    ``steps`` steps."""
    return [
        "--module", "tests.integration.torchtitan_job", "--config", "llama3_held", *assets.flags(),
        "--training.seq-len", "32", "--training.local-batch-size", str(local_batch),
        "--training.global-batch-size", str(GLOBAL_BATCH), "--training.steps", str(steps), "--debug.seed", "7",
        "--checkpoint.no-enable", "--validator.no-enable", "--metrics.disable-color-printing",
        "--dump-folder", str(dump / f"dump-{replica}"),
        "--fault-tolerance.replica-id", str(replica), "--fault-tolerance.audit-dir", str(dump / "audit"),
        *more,
    ]  # fmt: skip


class Groups:
    """Replica groups (one per launch) against one lighthouse, writing into one run directory.

    With ``exit_at_once`` a process whose run ended well skips the
    interpreter's teardown (:data:`torchtitan_cpu.EXIT_VARIABLE`); the
    failure-free runs keep it, so that a crash there still fails a test."""

    def __init__(
        self,
        run_dir: Path,
        lighthouse: Lighthouse,
        assets: TorchtitanAssets,
        processes: int,
        steps: int = STEPS,
        per_replica: Mapping[int, Mapping[str, str]] | None = None,
        exit_at_once: bool = True,
        torchrun: bool = False,
    ) -> None:
        self.run_dir = run_dir
        self.per_replica = per_replica or {}
        self.steps_to_train = steps
        self.assets = assets
        self.processes = processes
        self.environ = {
            **torchtitan_cpu.environment(run_dir),
            "STALWART_LIGHTHOUSE": lighthouse.url,
            RUN_DIR_VARIABLE: str(run_dir),
            HOLD_VARIABLE: str(run_dir / "hold"),
            torchtitan_cpu.EXIT_VARIABLE: "1" if exit_at_once else "0",
        }
        self.environ["PYTHONPATH"] = os.pathsep.join([self.environ["PYTHONPATH"], str(REPOSITORY)])
        self.torchrun = torchrun
        self.launched: list[TorchrunGroup | ForkedGroup] = []

    def launch(self, replica: int, *more: str, waits_for: Path | None = None) -> TorchrunGroup | ForkedGroup:
        """Group ``replica``: its processes forked from the preloaded forkserver with torchrun's environment
        (:class:`ForkedGroup`: no agent, torch imported already; these tests launch some fifteen groups), or, with
        ``torchrun``, a torchrun job as users launch one. With ``waits_for``, its processes import torchtitan, then
        wait until that file exists before they build the trainer (a replacement started early)."""
        args = stalwart_args(self.assets, self.run_dir, replica, 2 // self.processes, *more, steps=self.steps_to_train)
        environ = {**self.environ, **self.per_replica.get(replica, {})}
        if waits_for is not None:
            environ[GO_VARIABLE] = str(waits_for)
        log = self.run_dir / f"replica-{replica}.log"
        group: TorchrunGroup | ForkedGroup
        if self.torchrun:
            group = TorchrunGroup(torchtitan_cpu.torchrun_command(self.processes, args), log, environ)
        else:
            group = ForkedGroup(args, environ, log, self.processes, entry="stalwart.testing.torchtitan_cpu:forked_main")
        self.launched.append(group)
        return group

    def steps(self, replica: int, rank: int = 0) -> list[tuple[int, int]]:
        """``(step, pid)`` of every step the group's process ``rank`` started, in order."""
        path = self.run_dir / f"step-replica-{replica}.{rank}"
        if not path.exists():
            return []
        return [(int(step), int(pid)) for step, pid in (line.split() for line in path.read_text().splitlines())]

    def at(self, replica: int, step: int) -> Callable[[], bool]:
        """Whether every process of the group started ``step`` or a later one."""
        return lambda: all(
            (found := self.steps(replica, rank)) and found[-1][0] >= step for rank in range(self.processes)
        )

    def hold(self, step: int | None) -> None:
        """Hold every group at the top of ``step`` and later (None: release them)."""
        path = self.run_dir / "hold"
        if step is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(str(step))

    def log(self, replica: int) -> str:
        return groups_log(self.run_dir, replica)[-6000:]

    def end(self) -> None:
        for group in self.launched:
            group.kill()
            group.wait(timeout=60)


def finals(run_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {path.name: torch.load(path, weights_only=True) for path in sorted(run_dir.glob("final-*.pt"))}


def groups_log(run_dir: Path, replica: int) -> str:
    return (run_dir / f"replica-{replica}.log").read_text(errors="replace")


def worst_difference(one: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> float:
    assert one.keys() == other.keys()
    return max(float((one[name] - other[name]).abs().max()) for name in one)


class FailureFree:
    """The failure-free runs the failure tests compare with: one group of each size alone, all launched at once
    when the module's first test asks (they train while that test's groups do), each awaited when needed.

    One group of the same size as the tested groups: FSDP2's initialisation of
    a sharded parameter draws differently from a whole one's. Parity leaves the
    parameters as they are: its run compares with the run of its size without it.
    Their processes end through the interpreter's teardown (off the failure
    tests' path: they end first), each group's exit status 0 asserted. The run of two processes is a torchrun job:
    stalwart's trainer under torchrun as users launch it, where the tested groups are forked."""

    def __init__(self, directory: Path, assets: TorchtitanAssets, sizes: Sequence[int]) -> None:
        self.directory = directory
        self.stack = contextlib.ExitStack()
        self.runs: dict[int, TorchrunGroup | ForkedGroup] = {}
        self.parameters: dict[int, dict[str, torch.Tensor]] = {}
        options = {"min_replicas": 1, "start_replicas": 1, "heartbeat_timeout": 5.0, "join_timeout": 30.0}
        for processes in sizes:
            lighthouse = self.stack.enter_context(Lighthouse(None, **options))
            groups = Groups(
                directory / f"size-{processes}",
                lighthouse,
                assets,
                processes,
                exit_at_once=False,
                torchrun=processes > 1,
            )
            groups.run_dir.mkdir()
            self.stack.callback(groups.end)
            self.runs[processes] = groups.launch(0)

    def __call__(self, processes: int) -> dict[str, torch.Tensor]:
        """The final parameters of the run of ``processes`` processes (waiting for it to end)."""
        if processes not in self.parameters:
            run_dir = self.directory / f"size-{processes}"
            assert self.runs[processes].wait(timeout=RUN_TIMEOUT) == 0, groups_log(run_dir, 0)[-6000:]
            found = finals(run_dir)
            assert sorted(found) == [f"final-replica-0.{rank}.pt" for rank in range(processes)]
            self.parameters[processes] = found["final-replica-0.0.pt"]
        return self.parameters[processes]


@pytest.fixture(scope="module")
def failure_free(
    tmp_path_factory: pytest.TempPathFactory, torchtitan_assets: TorchtitanAssets
) -> Iterator[FailureFree]:
    """:class:`FailureFree` for groups of one and of two processes, kept for the module."""
    runs = FailureFree(tmp_path_factory.mktemp("failure_free"), torchtitan_assets, (1, 2))
    with runs.stack:
        yield runs


def alone_since(lighthouse: Lighthouse) -> int | None:
    """The id of the first quorum of group 0 alone, None before it formed."""
    quorums = lighthouse.status()["quorums"]
    return next((q["quorum_id"] for q in quorums if q["members"] == ["replica-0"]), None)


def kill_restart_and_heal(
    run_dir: Path,
    lighthouse: Lighthouse,
    assets: TorchtitanAssets,
    processes: int,
    more: Sequence[str] = (),
    per_replica: Mapping[int, Mapping[str, str]] | None = None,
) -> None:
    """Groups 0 and 1 start; all of group 1 is SIGKILLed at ``KILL_AT``, its replacement (started with them,
    waiting) goes and is healed; both finish. ``per_replica``: each group's own environment variables (its GPU)."""
    groups = Groups(run_dir, lighthouse, assets, processes, per_replica=per_replica)
    groups.hold(KILL_AT)
    go = run_dir / "go"
    try:
        first = {replica: groups.launch(replica, *more) for replica in (0, 1)}
        restarted = groups.launch(1, *more, waits_for=go)
        wait_until(lambda: groups.at(1, KILL_AT)() or first[1].poll() is not None, RUN_TIMEOUT, "group 1 held")
        assert first[1].poll() is None, groups.log(1)
        killed = {groups.steps(1, rank)[-1][1] for rank in range(processes)}
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        assert first[1].wait(timeout=RUN_TIMEOUT) != 0
        groups.hold(REJOIN_AT)  # group 0 trains on alone, then waits there for the replacement's join
        wait_until(
            lambda: alone_since(lighthouse) is not None or first[0].poll() is not None,
            RUN_TIMEOUT,
            "group 0 in a quorum alone",
        )
        alone = alone_since(lighthouse)
        assert alone is not None and first[0].poll() is None and restarted.poll() is None, groups.log(0)
        go.touch()  # the replacement builds its trainer while group 0 trains on; it joins at a later boundary
        wait_until(
            lambda: together(lighthouse, ["replica-0", "replica-1"], alone) or restarted.poll() is not None,
            RUN_TIMEOUT,
            "the restarted group 1 in group 0's quorum",
        )
        groups.hold(None)
        assert first[0].wait(timeout=RUN_TIMEOUT) == 0, groups.log(0)
        assert restarted.wait(timeout=RUN_TIMEOUT) == 0, groups.log(1)
    finally:
        groups.end()
    for rank in range(processes):  # the restarted group was healed to the quorum's step and trained to the end
        restarted_steps = [step for step, pid in groups.steps(1, rank) if pid not in killed]
        last = groups.steps(0, rank)[-1][0]  # STEPS - 1; with DiLoCo later (group 0's extra inner steps count)
        assert restarted_steps[0] >= REJOIN_AT and restarted_steps[-1] == last >= STEPS - 1, restarted_steps
    quorums = lighthouse.status()["quorums"]
    assert sorted(quorums[-1]["members"]) == ["replica-0", "replica-1"]


def assert_audited_exactly_once_at_a_constant_global_batch(
    audit_dir: Path, steps: int = STEPS, samples: int = GLOBAL_BATCH
) -> None:
    """Every committed step (a DiLoCo round: ``steps`` rounds of ``samples``) recorded alike by every group that
    recorded it, each of ``samples`` samples, and the epoch's samples trained exactly once."""
    records = [
        json.loads(line) for path in sorted(audit_dir.glob("steps-*.jsonl")) for line in path.read_text().splitlines()
    ]
    by_step: dict[int, set[tuple[int, ...]]] = {}
    for record in records:
        by_step.setdefault(record["step"], set()).add(tuple(record["indices"]))
    assert sorted(by_step) == list(range(steps))
    assert all(len(versions) == 1 and len(next(iter(versions))) == samples for versions in by_step.values()), by_step
    report = audit_directory(audit_dir)
    assert report.ok
    assert all(epoch.coverage.exactly_once for epoch in report.epochs)


CHECKPOINTS = ("--checkpoint.enable", "--checkpoint.interval", "2")
"""torchtitan's own checkpoints, every 2 steps: the relaunched group loads its last one, then is healed."""
PARITY = ("--fault-tolerance.redundancy", "parity:1,1")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("processes", "more"),
    [(1, CHECKPOINTS), (2, PARITY)],
    ids=["groups-of-one-with-torchtitan-checkpoints", "fsdp2-groups-of-two-with-parity"],
)
def test_a_killed_group_restarts_rejoins_and_is_healed(
    tmp_path: Path,
    make_lighthouse: Callable[..., Lighthouse],
    torchtitan_assets: TorchtitanAssets,
    failure_free: FailureFree,
    processes: int,
    more: tuple[str, ...],
) -> None:
    lighthouse = make_lighthouse(None, workers=2, heartbeat_timeout=5.0, join_timeout=120.0)
    kill_restart_and_heal(tmp_path, lighthouse, torchtitan_assets, processes, more)
    reference = failure_free(processes)  # awaited only now: it trained beside this test's groups
    assert_audited_exactly_once_at_a_constant_global_batch(tmp_path / "audit")
    found = finals(tmp_path)
    assert sorted(found) == [f"final-replica-{replica}.{rank}.pt" for replica in (0, 1) for rank in range(processes)]
    for name, parameters in found.items():
        assert worst_difference(parameters, reference) < TOLERANCE, name
    if CHECKPOINTS[0] in more:  # the relaunched group loaded its step-2 checkpoint before the heal replaced it
        assert (tmp_path / "dump-0" / "checkpoint" / f"step-{STEPS}").is_dir()
        assert "Loading the checkpoint from" in groups_log(tmp_path, 1)
    if PARITY[0] in more:  # the optimizer's state was sharded across the groups, and rebuilt for group 0 alone
        assert "shrinks to" in groups_log(tmp_path, 0)


@pytest.mark.slow
def test_diloco_groups_through_a_kill_end_on_the_same_parameters_and_train_each_sample_once(
    tmp_path: Path, make_lighthouse: Callable[..., Lighthouse], torchtitan_assets: TorchtitanAssets
) -> None:
    """``--fault-tolerance.semi-sync-method diloco``: each group trains its inner steps alone, the outer step of
    every round leaves both on the same global parameters; a round is one step of the ledger. Group 1 is SIGKILLed
    at the top of round 2, group 0 trains that round alone, and group 1's replacement joins at a round's end,
    healed; every round trains its planned samples, each once, and both groups end on the same parameters."""
    sync_steps = 2
    lighthouse = make_lighthouse(None, workers=2, heartbeat_timeout=5.0, join_timeout=120.0)
    more = ("--fault-tolerance.semi-sync-method", "diloco", "--fault-tolerance.sync-steps", str(sync_steps))
    kill_restart_and_heal(tmp_path, lighthouse, torchtitan_assets, 1, more)
    assert_audited_exactly_once_at_a_constant_global_batch(
        tmp_path / "audit", STEPS // sync_steps, GLOBAL_BATCH * sync_steps
    )
    found = finals(tmp_path)
    assert sorted(found) == ["final-replica-0.0.pt", "final-replica-1.0.pt"]
    first, second = found.values()
    assert worst_difference(first, second) < TOLERANCE


def test_a_heal_moves_the_parameters_in_place_without_the_models_state_dict_hooks() -> None:
    from stalwart.integrations.torchtitan.trainer import HealedParameters

    def collective_on_save(*args: object) -> None:
        raise AssertionError("torchtitan's export hook ran (on FSDP2 groups: a collective on one side only)")

    source, target = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    for model in (source, target):
        model.register_state_dict_post_hook(collective_on_save)
    state = HealedParameters(source).state_dict()
    assert sorted(state) == ["model.bias", "model.weight"] and not any(value.requires_grad for value in state.values())
    HealedParameters(target).load_state_dict(state)
    assert torch.equal(target.weight, source.weight) and torch.equal(target.bias, source.bias)
    with pytest.raises(KeyError, match=r"differ from the state's \['model.weight'\]"):
        HealedParameters(target).load_state_dict({"model.weight": state["model.weight"]})


FLEET_HOLD = 4
"""The step both groups are held at (and SIGKILLed) once the lighthouse vouched for a durable checkpoint."""


@pytest.mark.slow
def test_the_whole_fleet_killed_resumes_from_stalwarts_checkpoint(
    tmp_path: Path,
    make_lighthouse: Callable[..., Lighthouse],
    torchtitan_assets: TorchtitanAssets,
    failure_free: FailureFree,
) -> None:
    """``--fault-tolerance.checkpoint-folder``: both groups SIGKILLed together, then launched again, resume from the
    newest checkpoint the lighthouse vouched for, train the steps after it again and end on the failure-free
    parameters, each sample once. (torchtitan's own checkpoints are off: a group's own state cannot rewind the
    lighthouse's ledger.)"""
    lighthouse = make_lighthouse(None, workers=2, heartbeat_timeout=5.0, join_timeout=120.0)
    folder = str(tmp_path / "checkpoints")
    more = ("--fault-tolerance.checkpoint-folder", folder, "--fault-tolerance.checkpoint-interval", "2")
    groups = Groups(tmp_path, lighthouse, torchtitan_assets, processes=1)
    groups.hold(FLEET_HOLD)
    go = tmp_path / "go"
    try:
        first = [groups.launch(replica, *more) for replica in (0, 1)]
        resumed = [groups.launch(replica, *more, waits_for=go) for replica in (0, 1)]  # importing meanwhile
        wait_until(
            lambda: (
                (
                    all(groups.at(replica, FLEET_HOLD)() for replica in (0, 1))
                    and (lighthouse.status()["checkpoint"] or {}).get("step", 0) >= 2
                )
                or any(group.poll() is not None for group in first)
            ),
            RUN_TIMEOUT,
            "both groups held and a checkpoint vouched for",
        )
        assert all(group.poll() is None for group in first), groups.log(0) + groups.log(1)
        killed = {groups.steps(replica)[-1][1] for replica in (0, 1)}
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        assert [group.wait(timeout=RUN_TIMEOUT) for group in first] != [0, 0]
        groups.hold(None)
        go.touch()
        codes = [group.wait(timeout=RUN_TIMEOUT) for group in resumed]
    finally:
        groups.end()
    assert codes == [0, 0], groups.log(0) + groups.log(1)
    resumes = lighthouse.status()["resumed_from_checkpoint"]
    assert len(resumes) == 1, resumes  # the ledger went back once, to a checkpoint (the held step's commit may be lost)
    checkpoint = resumes[0]["to_step"]
    assert 2 <= checkpoint <= resumes[0]["from_step"] <= FLEET_HOLD, resumes
    trained = {replica: [step for step, pid in groups.steps(replica) if pid not in killed] for replica in (0, 1)}
    # the first group back trained from the checkpoint on; the other joined it then or at a later step, healed
    assert min(steps[0] for steps in trained.values()) == checkpoint, (trained, resumes)
    assert all(steps[-1] == STEPS - 1 for steps in trained.values()), trained
    assert_audited_exactly_once_at_a_constant_global_batch(tmp_path / "audit")
    reference = failure_free(1)
    for name, parameters in finals(tmp_path).items():
        assert worst_difference(parameters, reference) < TOLERANCE, name

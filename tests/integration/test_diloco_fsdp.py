"""DiLoCo over FSDP2 replica groups: durable checkpoints of the sharded outer state through a whole-fleet SIGKILL.

Each group is two workers with ``--fsdp`` started as torchrun starts them
(:class:`~stalwart.testing.groups.ForkedGroup`). With H = 1, inner SGD without
momentum and an outer SGD at learning rate 1 without momentum, DiLoCo is
data-parallel SGD whatever the number of groups, so a job
that resumes from a checkpoint must end on the failure-free parameters: a
shard of the globals saved or loaded on the wrong process (a DTensor taken
for a replicated tensor, rank 0's shard written for every rank) would start
the resumed rounds from other parameters (a checkpoint's load makes the model
the globals). The inner optimizer keeps no state: each DiLoCo group has its
own (a momentum buffer of its own share's gradients), and a checkpoint holds
the writing group's, so with a stateful inner optimizer a resumed job is
not the failure-free one (only the groups' average of it was).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from stalwart import EpochPlan, Lighthouse
from stalwart.launch.report import audit_steps, committed_steps, planned_total
from stalwart.launch.tasks import reference_run
from stalwart.testing.groups import ForkedGroup, end_group
from stalwart.testing.waiting import wait_until
from tests.integration.test_diloco import (
    JOB_TIMEOUT,
    PLAN,
    TOLERANCE,
    assert_same_outer_state,
    finished,
    largest_difference,
)

STEPS = 6
SGD_PLAN = EpochPlan(PLAN.dataset_size, 15, seed=0)


def test_fsdp_groups_killed_together_resume_their_sharded_outer_state_from_a_checkpoint(tmp_path: Path) -> None:
    """Two FSDP2 groups in DiLoCo checkpoint every round, each process its shards of the model, the globals and
    the optimizers; both groups are SIGKILLed while held in round 4, rounds 0-3 on record and a checkpoint of
    step 3 or 4 written, asynchronously, and vouched for (an FSDP2 group waits for its last checkpoint before
    the next, so it writes at every round boundary; the one of step 4 may be vouched before the kill or not).
    One new group (another number of groups) resumes from the newest checkpoint the lighthouse vouched for,
    trains the rounds after it again, commits each round's planned samples once and ends on the failure-free
    parameters, both its processes on the same global parameters."""
    run_dir, checkpoints, hold = tmp_path / "run", tmp_path / "checkpoints", tmp_path / "hold"
    run_dir.mkdir()
    hold.write_text("4")
    args = ["--model", "gpt-tiny", "--optimizer", "plain-sgd", "--clip", "1e9", "--max-steps", str(STEPS),
            "--max-microbatch", "4", "--step-seconds", "0", "--collective-timeout", "5.0", "--diloco", "1",
            "--outer-lr", "1", "--outer-momentum", "0", "--fsdp", "--checkpoint-dir", str(checkpoints),
            "--checkpoint-every", "1", "--hold-file", str(hold)]  # fmt: skip
    with Lighthouse(SGD_PLAN, min_replicas=1, start_replicas=2, heartbeat_timeout=1.0, join_timeout=30.0) as server:
        agents = [launch(server.url, name, run_dir, args) for name in ("group-a", "group-b")]
        resumed = None
        try:
            wait_until(
                lambda: (
                    server.status()["ledger"]["step"] == 4
                    and (server.status()["checkpoint"] or {}).get("step", 0) >= 3
                    and [record["step"] for record in committed_steps(run_dir)] == [0, 1, 2, 3]
                ),
                JOB_TIMEOUT,
                "the groups to be held in round 4 with rounds 0-3 on record and the lighthouse to vouch for a "
                "checkpoint of step 3 or 4",
            )
            for agent in agents:
                end_group(agent)
            wait_until(
                lambda: all(member["state"] == "dead" for member in server.status()["members"]),
                JOB_TIMEOUT,
                "the lighthouse to see both groups dead",
            )
            checkpoint = server.status()["checkpoint"]
            hold.unlink()
            resumed = launch(server.url, "group-c", run_dir, args)
            assert resumed.wait(timeout=JOB_TIMEOUT) == 0
            status = server.status()
        finally:
            for agent in [*agents, resumed]:
                if agent is not None:
                    end_group(agent)
    assert checkpoint["step"] in (3, 4)
    assert [(r["from_step"], r["to_step"]) for r in status["resumed_from_checkpoint"]] == [(4, checkpoint["step"])]
    assert status["checkpoint"]["step"] == STEPS
    written = sorted(path.name for path in Path(status["checkpoint"]["path"]).glob("*.distcp"))
    assert written == [f"__{rank}_0.distcp" for rank in (0, 1)], "each process of the writer wrote its own"
    records = committed_steps(run_dir)
    assert [record["step"] for record in records] == list(range(STEPS))
    assert [record["samples"] for record in records] == [planned_total(SGD_PLAN, step) for step in range(STEPS)]
    assert audit_steps(SGD_PLAN, records) == (True, 0, 0)
    assert {record["member"] for record in records[checkpoint["step"] :]} == {"group-c"}
    reference, _ = reference_run(SGD_PLAN, STEPS, optimizer_name="plain-sgd", clip=1e9, task="gpt-tiny")
    finals = sorted(run_dir.glob("final-*.pt"))
    assert [path.name for path in finals] == [f"final-group-c.{rank}.pt" for rank in (0, 1)]
    for path in finals:
        assert largest_difference(torch.load(path, weights_only=True), reference) < TOLERANCE, path.name
    assert_same_outer_state(finished(run_dir), sharded=True)


def launch(url: str, name: str, run_dir: Path, args: list[str]) -> ForkedGroup:
    """Replica group ``name`` of two workers (started as torchrun would)."""
    argv = ["--lighthouse", url, "--member", name, "--run-dir", str(run_dir), *args]
    return ForkedGroup(argv, os.environ, run_dir / f"{name}.log")

"""Fault-tolerant HSDP: two replica groups of two processes, each sharding the model with FSDP2.

Each group is two digits workers with ``--fsdp``, started as torchrun starts
them (:class:`~stalwart.testing.groups.ForkedGroup`): the group's processes
``fully_shard`` the MLP over their own mesh, FSDP2 reduce-scatters gradients
within the group and the Manager reduces each shard across the groups. One
process of group B is SIGKILLed while the step's buckets are in flight (the
group's launcher ends its sibling, as torchrun's agent does; group A waits
before that step until B is gone, so that they cannot complete); group A
recomputes B's share of that step and carries it alone; B is launched again,
asks to join while the job is held, and is healed shard by shard from A. The
run must keep every step's global batch, train each sample exactly once, and
end with the failure-free parameters on all four processes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.launch.cluster import latest_step
from stalwart.launch.report import audit_steps, committed_steps, planned_total
from stalwart.launch.tasks import reference_run
from stalwart.testing.digits_job import PARAM_TOLERANCE
from stalwart.testing.groups import GROUP_PLAN as PLAN
from stalwart.testing.groups import GROUP_STEPS as STEPS
from stalwart.testing.groups import end_group, launch_group
from stalwart.testing.waiting import wait_until
from tests.integration.hsdp_scenario import KILL_AT, TIMEOUT, assert_finals_match_the_reference, kill_restart_and_heal

WORKERS = 2  # groups


def run_groups(url: str, run_dir: Path, options: dict[str, list[str]]) -> dict[str, int]:
    """Launch one group per entry of ``options`` (name: its worker options) and wait for all; their exit codes."""
    agents = {name: launch_group(url, name, run_dir, more) for name, more in options.items()}
    try:
        return {name: agent.wait(timeout=TIMEOUT) for name, agent in agents.items()}
    finally:
        for agent in agents.values():
            end_group(agent)


@pytest.mark.slow
def test_a_killed_fsdp_group_restarts_and_is_healed_shard_by_shard(tmp_path: Path, lighthouse: Lighthouse) -> None:
    kill_restart_and_heal(tmp_path, lighthouse, {})


def test_a_group_that_does_not_shard_like_the_others_is_refused(tmp_path: Path, lighthouse: Lighthouse) -> None:
    short = ["--max-steps", "4", "--step-seconds", "0"]  # the refusal comes at the first quorum
    codes = run_groups(lighthouse.url, tmp_path, {"group-a": ["--fsdp", *short], "group-b": short})
    refused = [name for name, code in codes.items() if code != 0]
    assert len(refused) == 1, codes
    log = (tmp_path / f"{refused[0]}.log").read_text()
    assert "shard" in log and "every group of a job must run the same training script" in log
    assert latest_step(tmp_path)[0] == 4
    assert audit_steps(PLAN, committed_steps(tmp_path)) == (True, 0, 0)


UNEVEN_PLAN = EpochPlan(1797, 400, seed=0, local_batch_multiple=4)
"""Four full steps, then 197 samples: the groups' processes get 13 and 12 micro-batches at step 4."""


def test_fsdp_groups_run_in_step_when_their_processes_get_unequal_parts(tmp_path: Path) -> None:
    steps = 6
    with Lighthouse(UNEVEN_PLAN, min_replicas=2, heartbeat_timeout=5.0, join_timeout=30.0) as server:
        more = ["--fsdp", "--max-steps", str(steps), "--step-seconds", "0"]
        codes = run_groups(server.url, tmp_path, {"group-a": more, "group-b": more})
    assert codes == {"group-a": 0, "group-b": 0}
    records = committed_steps(tmp_path)
    assert [record["samples"] for record in records] == [planned_total(UNEVEN_PLAN, step) for step in range(steps)]
    assert records[4]["samples"] == 197
    assert audit_steps(UNEVEN_PLAN, records) == (True, 0, 0)
    reference, _ = reference_run(UNEVEN_PLAN, steps)
    for path in sorted(tmp_path.glob("final-*.pt")):
        parameters = torch.load(path, weights_only=True)
        worst = max(float((parameters[key] - value).abs().max()) for key, value in reference.items())
        assert worst < PARAM_TOLERANCE, path.name


@pytest.mark.slow
def test_fsdp_groups_split_their_shards_optimizer_state_with_parity(tmp_path: Path) -> None:
    """HSDP with a partial replicate dimension: three FSDP2 groups, each shard's Adam state split with parity (2, 1).

    The processes holding the same FSDP shard in the three groups hold a
    third of its optimizer state each, plus parity. Group B dies while the
    step's parameters are gathered; A and C rebuild its part from parity,
    finish the step and go on with the failure-free parameters.
    """
    with Lighthouse(PLAN, min_replicas=1, start_replicas=3, heartbeat_timeout=1.0, join_timeout=30.0) as server:
        more = ["--fsdp", "--parity", "2,1"]
        kill = ["--kill-at", f"{KILL_AT}:during_gather", "--kill-rank", "1"]
        codes = run_groups(server.url, tmp_path, {"group-a": more, "group-b": [*more, *kill], "group-c": more})
    assert codes["group-a"] == codes["group-c"] == 0 and codes["group-b"] != 0
    steps = committed_steps(tmp_path)
    assert [record["samples"] for record in steps] == [planned_total(PLAN, step) for step in range(STEPS)]
    assert audit_steps(PLAN, steps) == (True, 0, 0)
    assert steps[0]["world_size"] == 3 and steps[-1]["world_size"] == 2
    assert_finals_match_the_reference(tmp_path, "ac")
    finished = [
        json.loads(line)
        for path in sorted(tmp_path.glob("events-group-[ac].*.jsonl"))
        for line in path.read_text().splitlines()
        if '"finished"' in line
    ]
    assert len(finished) == 4 and all(event["repairs"] >= 1 for event in finished)


@pytest.mark.slow
@pytest.mark.parametrize("redundancy", [[], ["--overlap", "0"]], ids=["replicated", "sharded-across-groups"])
def test_fsdp_groups_killed_together_resume_from_their_checkpoint_at_another_number_of_groups(
    tmp_path: Path, redundancy: list[str]
) -> None:
    """Durable checkpoints of FSDP2 groups: every process writes its shards, a resumed job may have other groups.

    Two groups checkpoint every 3 steps and are held at step 10; both are
    SIGKILLed. One new group (another number of groups) resumes from the
    newest checkpoint the lighthouse vouched for, each of its processes
    reading its shards, trains the steps after it again and ends with the
    failure-free parameters; every step keeps its planned samples once.
    Sharded across groups (overlap 0), process r of each group holds half of
    shard r's Adam state: process r of the other group sends its half to the
    writer at each checkpoint, and the one resumed group holds it all.
    """
    checkpoints, hold = tmp_path / "checkpoints", tmp_path / "hold"
    hold.write_text("10")
    more = ["--fsdp", "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "3", "--hold-file", str(hold)]
    more += redundancy
    with Lighthouse(PLAN, min_replicas=1, start_replicas=2, heartbeat_timeout=1.0, join_timeout=30.0) as server:
        agents = {name: launch_group(server.url, name, tmp_path, more) for name in ("group-a", "group-b")}
        resumed = None
        try:
            # the hold keeps them at step 10 while the checkpoint of 9 steps (asynchronous) ends and is vouched for
            wait_until(
                lambda: (
                    server.status()["ledger"]["step"] == 10 and (server.status()["checkpoint"] or {}).get("step") == 9
                ),
                TIMEOUT,
                "the groups to commit step 10 and the lighthouse to vouch for the checkpoint of step 9",
            )
            for agent in agents.values():
                end_group(agent)
            wait_until(
                lambda: all(member["state"] == "dead" for member in server.status()["members"]),
                TIMEOUT,
                "the lighthouse to see both groups dead",
            )
            checkpoint = server.status()["checkpoint"]
            hold.unlink()
            resumed = launch_group(server.url, "group-c", tmp_path, more)
            assert resumed.wait(timeout=TIMEOUT) == 0
            status = server.status()
        finally:
            for agent in [*agents.values(), resumed]:
                if agent is not None:
                    end_group(agent)
    assert checkpoint["step"] == 9
    assert status["checkpoint"]["step"] == STEPS, "the writing group checkpoints the last step"
    assert sorted(path.name for path in Path(status["checkpoint"]["path"]).glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ], "each process of the writing group wrote its own shards"
    assert [(r["from_step"], r["to_step"]) for r in status["resumed_from_checkpoint"]] == [(10, 9)]
    assert status["ledger"]["step"] == STEPS
    steps = committed_steps(tmp_path)
    assert [record["samples"] for record in steps] == [planned_total(PLAN, step) for step in range(STEPS)]
    assert audit_steps(PLAN, steps) == (True, 0, 0)
    assert {record["member"] for record in steps[9:]} == {"group-c"}
    assert_finals_match_the_reference(tmp_path, "c")  # the killed groups wrote none


@pytest.mark.parametrize("redundancy", [[], ["--parity", "2,1"]], ids=["replicated", "parity-across-groups"])
def test_a_drifted_fsdp_group_is_found_shard_by_shard_and_healed_whole(tmp_path: Path, redundancy: list[str]) -> None:
    """The replica checksum across FSDP2 groups: each process checksums its own shard.

    Group C's processes perturb their shards at the start of step 4 (after
    the step's share was computed from the parameters of step 3's update, the
    perturbation is in the parameters the step's update applies to). The
    check compares process r of each group with process r of the others; C is
    the odd one out and is healed whole from a group that agrees, recomputes
    its share, and the job ends with the failure-free parameters everywhere.
    With parity (2, 1) across the groups the parameters are healed the same
    way, while each process keeps its own part of the optimizer state.
    """
    with Lighthouse(PLAN, min_replicas=1, start_replicas=3, heartbeat_timeout=5.0, join_timeout=30.0) as server:
        more = ["--fsdp", "--step-seconds", "0", *redundancy]
        corrupt = ["--corrupt-at", "4"]
        codes = run_groups(server.url, tmp_path, {"group-a": more, "group-b": more, "group-c": [*more, *corrupt]})
    assert codes == {"group-a": 0, "group-b": 0, "group-c": 0}
    steps = committed_steps(tmp_path)
    assert [record["samples"] for record in steps] == [planned_total(PLAN, step) for step in range(STEPS)]
    assert audit_steps(PLAN, steps) == (True, 0, 0)
    assert {record["drift_heals"] for record in steps if record["step"] < 4} == {0}
    assert {record["drift_heals"] for record in steps if record["step"] >= 4} == {1}
    log = (tmp_path / "group-c.log").read_text()
    assert re.search(r"step 4 replicas drifted: healing groups \[\d\] from group \d \(this one\)", log), log
    assert_finals_match_the_reference(tmp_path, "abc")

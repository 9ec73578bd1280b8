"""Preemption is a departure: SIGTERM makes a worker (or a replica group) leave at a step boundary, announced.

Real worker processes, a real SIGTERM, the real lighthouse: the departing
worker finishes the step it is in, leaves, exits 0; the others form the next
quorum without it at the boundary (no failure counted, no step or sample
trained twice, none waiting for a timeout) and end on the failure-free
parameters.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from stalwart import Checkpointing, ElasticLoader, EpochPlan, Manager
from stalwart.coord.server import Lighthouse
from stalwart.launch.cluster import LocalCluster, latest_step
from stalwart.launch.digits import digits_dataset, digits_model, digits_optimizer, mean_loss
from stalwart.launch.report import audit_steps, committed_steps, planned_total
from stalwart.launch.tasks import reference_run
from stalwart.testing.digits_job import PARAM_TOLERANCE, STEPS, WORKERS, check_job, wait_for, worker_args
from stalwart.testing.groups import GROUP_PLAN, GROUP_STEPS, end_group, launch_group, worker_pids
from stalwart.testing.waiting import wait_until

DEPART_AFTER = 4
"""The step whose boundary the SIGTERMed worker leaves at (it is held at the top of this step when signalled)."""
GROUP_TIMEOUT = 180.0


def events_of(run_dir: Path, member: str) -> list[str]:
    return [json.loads(line)["event"] for line in (run_dir / f"events-{member}.jsonl").read_text().splitlines()]


def test_a_sigtermed_worker_leaves_at_the_step_boundary_and_nobody_recovers(
    tmp_path: Path, lighthouse: Lighthouse, reference: dict[str, torch.Tensor]
) -> None:
    cluster = LocalCluster(lighthouse.url, tmp_path, worker_args())
    cluster.hold(from_step=DEPART_AFTER)
    for worker in range(WORKERS):
        cluster.start(worker)
    wait_for(cluster, until_step=DEPART_AFTER)  # every worker reduced step DEPART_AFTER - 1: none armed the next
    cluster.processes[1].send_signal(signal.SIGTERM)
    cluster.release()
    wait_for(cluster)
    assert [cluster.processes[worker].returncode for worker in range(WORKERS)] == [0] * WORKERS
    check_job(tmp_path, reference, finishers=WORKERS - 1)
    steps = committed_steps(tmp_path)
    assert [record["world_size"] for record in steps] == [WORKERS] * (DEPART_AFTER + 1) + [WORKERS - 1] * (
        STEPS - DEPART_AFTER - 1
    )
    assert events_of(tmp_path, "worker-1")[-1] == "departed"
    status = lighthouse.status()
    assert status["counts"].get("failures", 0) == 0
    assert [departure["member"] for departure in status["departures"]][:1] == ["worker-1"]
    assert "failure" not in {quorum["reason"] for quorum in status["quorums"]}


def test_a_replica_group_leaves_whole_when_one_of_its_processes_gets_sigterm(
    tmp_path: Path, make_lighthouse: Callable[..., Lighthouse]
) -> None:
    """Only process 1 of group B is signalled (torchrun signals each, not at one instant): both of B's leave."""
    # the groups' plan, and the first quorum formed once both groups ask (not after the join timeout for a third)
    lighthouse = make_lighthouse(GROUP_PLAN, workers=2)
    agents = {name: launch_group(lighthouse.url, name, tmp_path) for name in ("group-a", "group-b")}
    try:
        wait_until(lambda: latest_step(tmp_path)[0] >= 4, GROUP_TIMEOUT, "the groups to train")
        os.kill(worker_pids(agents["group-b"])[1], signal.SIGTERM)
        codes = {name: agent.wait(timeout=GROUP_TIMEOUT) for name, agent in agents.items()}
    finally:
        for agent in agents.values():
            end_group(agent)
    assert codes == {"group-a": 0, "group-b": 0}
    steps = committed_steps(tmp_path)
    assert [record["step"] for record in steps] == list(range(GROUP_STEPS))
    assert [record["samples"] for record in steps] == [planned_total(GROUP_PLAN, step) for step in range(GROUP_STEPS)]
    assert audit_steps(GROUP_PLAN, steps) == (True, 0, 0)
    world_sizes = [record["world_size"] for record in steps]
    assert world_sizes[0] == 2 and world_sizes[-1] == 1 and sorted(world_sizes, reverse=True) == world_sizes
    assert sorted(path.name for path in tmp_path.glob("final-*.pt")) == ["final-group-a.0.pt", "final-group-a.1.pt"]
    reference, _ = reference_run(GROUP_PLAN, GROUP_STEPS)
    for path in tmp_path.glob("final-*.pt"):
        parameters = torch.load(path, weights_only=True)
        assert max(float((parameters[n] - value).abs().max()) for n, value in reference.items()) < PARAM_TOLERANCE
    status = lighthouse.status()
    assert status["counts"].get("failures", 0) == 0
    assert [departure["member"] for departure in status["departures"]][:1] == ["group-b"]


SOLO_PLAN = EpochPlan(1797, 48, seed=0)


def solo_steps(
    server: Lighthouse, model: torch.nn.Module, steps: int, depart_in: int | None, **options: object
) -> tuple[Manager, list[int]]:
    """One member's loop for ``steps`` steps, asking to depart in step ``depart_in``'s body; its Manager and steps."""
    optimizer = digits_optimizer(model)
    manager = Manager(model, optimizer, lighthouse=server.url, member="solo", max_microbatch=16, plan=SOLO_PLAN,
                      **options)  # type: ignore[arg-type]  # fmt: skip
    loader = ElasticLoader(digits_dataset())
    trained = []
    try:
        for step in manager.steps(loader, max_steps=steps):
            for batch in step:
                step.backward(mean_loss(model, batch))
            optimizer.step()
            optimizer.zero_grad()
            trained.append(step.number)
            if step.number == depart_in:
                manager.request_departure("spot notice")  # the loop is the user's, unchanged: a hook calls this
    finally:
        manager.close()
        loader.close()
    return manager, trained


@pytest.fixture
def solo() -> Iterator[Lighthouse]:
    with Lighthouse(None, min_replicas=1, start_replicas=1, heartbeat_timeout=2.0, join_timeout=10.0) as server:
        yield server


def test_a_departure_before_the_first_quorum_leaves_at_once(solo: Lighthouse) -> None:
    model = digits_model(0)
    manager = Manager(
        model, digits_optimizer(model), lighthouse=solo.url, member="early", max_microbatch=16, plan=SOLO_PLAN
    )
    manager.request_departure()
    loader = ElasticLoader(digits_dataset())
    try:
        assert list(manager.steps(loader, max_steps=5)) == []
    finally:
        manager.close()
        loader.close()
    assert manager.departed
    assert manager.last_round is None  # every-step training has no rounds
    status = solo.status()
    assert [(d["member"], d["in_quorum"]) for d in status["departures"]] == [("early", False)]
    assert status["quorums"] == []


def test_a_whole_quorum_departing_leaves_unannounced_so_that_a_restart_resumes_from_its_checkpoint(
    solo: Lighthouse, tmp_path: Path
) -> None:
    """Its only member departs after step 3 (asked in step 2's body, the request rides in step 3's reduction)."""
    checkpoint = Checkpointing(tmp_path / "checkpoints", every_steps=3)
    manager, trained = solo_steps(solo, digits_model(0), 8, 2, checkpoint=checkpoint)
    assert manager.departed and trained == [0, 1, 2, 3]
    assert solo.status()["departures"] == [], "nobody left holding the state: a restart must not take it for ended"
    restarted, resumed = solo_steps(solo, digits_model(1), 8, None, checkpoint=checkpoint)
    assert not restarted.departed
    assert resumed == [4, 5, 6, 7], "the restart resumed from the checkpoint written at the departure (not step 3's)"

"""DiLoCo and Streaming DiLoCo under the Manager: the user's loop, exactly-once rounds through real failures.

A round is one step of the ledger: the tests read the workers' round records
(``steps-*.jsonl``, one per committed round) and audit them like every-step
runs: each round commits the planned samples, each sample once. Groups that
finish must hold the same outer state (global parameters and outer optimizer
state) bit for bit, a group that joined late included, which its digest in
the ``finished`` event shows. Failures are real SIGKILLs at named points.

In this process: a single group with an outer SGD of learning rate 1 trains
exactly what the every-step reference trains (the outer step then copies the
local parameters), with fragments and overlap too; and bad configurations
are refused before training.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch.utils.data import DataLoader

from stalwart import ElasticLoader, EpochPlan, Lighthouse, ManagedDistributedSampler, Manager, Overlap
from stalwart.cli import cli
from stalwart.data.audit import audit_directory
from stalwart.launch.cluster import LocalCluster
from stalwart.launch.report import audit_steps, committed_steps, planned_total, write_audit
from stalwart.launch.tasks import TASKS, gpt_datasets, reference_run
from stalwart.runtime.config import Checks
from stalwart.runtime.diloco.config import DiLoCo
from stalwart.testing.digits_job import together, wait_until_together
from stalwart.testing.groups import ForkedGroup, end_group
from stalwart.testing.waiting import wait_until

TOLERANCE = 1e-4
INNER = 4
PLAN = EpochPlan(len(gpt_datasets("gpt-tiny")[0]), 16, seed=0)
ROUND_PLAN = EpochPlan(PLAN.dataset_size, 16 * INNER, seed=0)
JOB_TIMEOUT = 240.0


def copy_outer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """An outer step that makes the globals the (averaged) local parameters."""
    return torch.optim.SGD(params, lr=1.0)


def largest_difference(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> float:
    return max(float((left[name] - value).abs().max()) for name, value in right.items())


# --- in this process -----------------------------------------------------------------------------------------


@pytest.fixture
def solo() -> Any:
    # one member and no failure to detect: a heartbeat timeout a busy machine's scheduler cannot reach
    with Lighthouse(None, min_replicas=1, start_replicas=1, heartbeat_timeout=15.0, join_timeout=10.0) as server:
        yield server


@pytest.mark.parametrize(
    ("fragments", "overlap", "steps", "loader"),
    [(1, None, 8, "elastic"), (2, None, 8, "elastic"), (3, 0, 12, "elastic"), (2, None, 8, "dataloader")],
    ids=["diloco", "streaming", "no-overlap", "dataloader"],
)
def test_one_group_with_an_outer_lr_of_1_trains_the_every_step_run(
    solo: Lighthouse,
    fragments: int,
    overlap: int | None,
    steps: int,
    loader: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With one group every inner step is the reference's step, and lr 1 makes each outer step a copy.

    A mistake in the inner-step schedule (other samples, other order), in a
    fragment's pseudo-gradient or in the local update after an overlapped
    exchange would move the parameters off the reference; with a DataLoader
    driven by the Manager's sampler, the foreseen inner steps are what it loads.
    ``Checks(audit_dir=...)`` records each committed round whole.
    """
    caplog.set_level(logging.INFO, logger="stalwart")  # a failure's report shows the quorums, joins and drops
    reference, losses = reference_run(PLAN, steps, optimizer_name="adamw", clip=1e9, task="gpt-tiny")
    task = TASKS["gpt-tiny"]
    model = task.model(0)
    optimizer = task.optimizer(model, "adamw", task.lr)
    scheduler = task.scheduler(optimizer, steps)
    sync = DiLoCo(INNER, outer_optimizer=copy_outer, fragments=fragments, overlap=overlap)
    checks = Checks(audit_dir=tmp_path)
    manager = Manager(
        model, optimizer, lighthouse=solo.url, member="solo", max_microbatch=5, plan=PLAN, sync=sync, checks=checks
    )
    manager.register_state("scheduler", scheduler)
    seen = []
    dataset = task.dataset()
    source: Any = (
        ElasticLoader(dataset)
        if loader == "elastic"
        else DataLoader(dataset, batch_sampler=ManagedDistributedSampler(manager, dataset), num_workers=1)
    )
    try:
        for step in manager.steps(source, max_steps=steps):
            for batch in step:
                step.backward(task.loss(model, batch))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            report = step.report
            seen.append((step.number, report.samples, report.loss, report.quorum_id, report.recoveries))
    finally:
        manager.close()
    # what a failure shows: each inner step as (number, samples, loss, quorum, recoveries), the lighthouse's quorums
    # and failures
    status = solo.status()
    evidence = {"steps": seen, "quorums": status["quorums"], "failures": status["failures"]}
    assert [number for number, *_ in seen] == list(range(steps)), evidence
    assert [samples for _, samples, *_ in seen] == [16] * steps, evidence
    assert [loss for _, _, loss, *_ in seen] == pytest.approx(losses, abs=1e-4), (evidence, losses)
    state = model.state_dict()
    differences = sorted(((float((state[name] - value).abs().max()), name) for name, value in reference.items()))
    assert differences[-1][0] < TOLERANCE, (differences[-5:], evidence)
    assert manager.last_round is not None and manager.last_round.step == steps // INNER - 1, manager.last_round
    assert manager.last_round.samples == 16 * INNER, manager.last_round
    assert manager.applied_step == steps // INNER
    assert manager.dropped_microbatches == 0  # the DataLoader loaded what the inner steps took, nothing else
    rounds = [json.loads(line) for line in (tmp_path / "steps-solo.jsonl").read_text().splitlines()]
    assert [(record["step"], len(record["indices"])) for record in rounds] == [
        (number, 16 * INNER) for number in range(steps // INNER)
    ]
    audit = audit_directory(tmp_path)
    assert audit.ok and audit.epochs[0].coverage.consumed == 16 * steps, audit


def test_bad_configurations_are_refused_before_training(solo: Lighthouse) -> None:
    model = TASKS["gpt-tiny"].model(0)
    optimizer = torch.optim.AdamW(model.parameters())
    tensors = len(list(model.parameters()))

    def build(**kwargs: Any) -> Manager:
        return Manager(model, optimizer, lighthouse=solo.url, member="bad", max_microbatch=4, plan=PLAN, **kwargs)

    with pytest.raises(ValueError, match=r"DiLoCo\.inner_steps must be in"):
        build(sync=DiLoCo(0))
    with pytest.raises(ValueError, match=f"fragments={tensors + 1} is more than the model's {tensors} "):
        build(sync=DiLoCo(2 * (tensors + 1), fragments=tensors + 1, overlap=0))
    with pytest.raises(TypeError, match=r"must return a torch\.optim\.Optimizer"):
        build(sync=DiLoCo(4, outer_optimizer=lambda params: list(params)))
    with pytest.raises(TypeError, match="sync must be a DiLoCo"):
        build(sync={"inner_steps": 4})
    with pytest.raises(ValueError, match="redundancy"):
        build(sync=DiLoCo(4), redundancy=Overlap(0.5))
    manager = build(sync=DiLoCo(4))
    try:
        with pytest.raises(ValueError, match="reserved"):
            manager.register_state("sync/mine", torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0))
        with pytest.raises(ValueError, match=r"max_steps=6 must be a multiple of DiLoCo\.inner_steps=4"):
            next(iter(manager.steps(ElasticLoader(TASKS["gpt-tiny"].dataset()), max_steps=6)))
        with pytest.raises(RuntimeError, match=r"request_departure\(\) is not supported with sync=DiLoCo"):
            manager.request_departure()
        assert not manager.departing
    finally:
        manager.close()


# --- real processes -------------------------------------------------------------------------------------------


def diloco_args(steps: int, *extra: str) -> list[str]:
    return ["--model", "gpt-tiny", "--optimizer", "adamw", "--max-steps", str(steps), "--max-microbatch", "4",
            "--collective-timeout", "5.0", "--diloco", str(INNER), *extra]  # fmt: skip


def wait_for(cluster: LocalCluster, timeout: float = JOB_TIMEOUT) -> None:
    """Wait (bounded) until every worker exited; fail with the workers' logs otherwise."""
    deadline = time.monotonic() + timeout
    while cluster.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    if cluster.running():
        cluster.terminate()
        logs = "\n".join(path.read_text(errors="replace")[-3000:] for path in sorted(cluster.run_dir.glob("*.log")))
        pytest.fail(f"the job did not end in {timeout} s; worker logs:\n{logs}")


def launch_group(url: str, name: str, run_dir: Path, args: list[str]) -> ForkedGroup:
    """Two worker processes forming replica group ``name`` (started as torchrun would)."""
    argv = ["--lighthouse", url, "--member", name, "--run-dir", str(run_dir), *args]
    return ForkedGroup(argv, os.environ, run_dir / f"{name}.log")


def finished(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Each finishing process's ``finished`` event, by member."""
    events = {}
    for path in sorted(run_dir.glob("events-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            event = json.loads(line)
            if event["event"] == "finished":
                events[path.stem.removeprefix("events-")] = event
    return events


def check_rounds(run_dir: Path, rounds: int) -> list[dict[str, Any]]:
    """Every round committed as planned, each sample in one committed round; ``stalwart audit`` agrees."""
    records = committed_steps(run_dir)
    assert [record["step"] for record in records] == list(range(rounds))
    assert [record["samples"] for record in records] == [planned_total(ROUND_PLAN, step) for step in range(rounds)]
    assert audit_steps(ROUND_PLAN, records) == (True, 0, 0)
    write_audit(ROUND_PLAN, run_dir / "audit", records)
    audited = CliRunner().invoke(cli, ["audit", str(run_dir / "audit")])
    assert audited.exit_code == 0, audited.output
    return records


def test_diloco_survives_kills_at_an_inner_step_and_at_the_outer_reduction_and_heals_a_joiner_bit_for_bit(
    tmp_path: Path,
) -> None:
    """Four groups. Group 1 dies in inner step 5 (round 1) and is restarted; it joins at a round's end and is
    healed. Group 2 dies at round 3's (the last) outer reduction, when the joiner is back.

    The survivors train a dead group's whole share of its round as extra inner
    steps, so every round commits its planned samples, each sample once; the
    three groups that finish hold the same global parameters and outer
    optimizer state, bit for bit, the healed joiner's included.
    """
    rounds = 4
    kills = {1: f"{INNER + 1}:during_backward", 2: "3:during_outer"}
    with Lighthouse(ROUND_PLAN, min_replicas=1, start_replicas=4, heartbeat_timeout=1.0, join_timeout=30.0) as server:
        cluster = LocalCluster(server.url, tmp_path, diloco_args(rounds * INNER))
        cluster.hold(from_step=2)
        for worker in range(4):
            cluster.start(worker, ["--kill-at", kills[worker]] if worker in kills else None)
        deadline = time.monotonic() + JOB_TIMEOUT
        while cluster.processes[1].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cluster.processes[1].returncode == -signal.SIGKILL
        since = server.status()["quorums"][-1]["quorum_id"]
        cluster.start(1)
        wait_until_together(server, [f"worker-{worker}" for worker in range(4)], cluster, since)
        cluster.release()
        wait_for(cluster, timeout=JOB_TIMEOUT)
        status = server.status()
    assert cluster.processes[2].returncode == -signal.SIGKILL
    records = check_rounds(tmp_path, rounds)
    world_sizes = [record["world_size"] for record in records]
    # group 1 is back at the end of round 1 or of round 2, whichever boundary it is healed for first (the
    # machine's speed decides); round 3 ends with 3, group 2 having died in its outer reduction
    assert world_sizes[:2] == [4, 3] and world_sizes[2] in (3, 4) and world_sizes[3] == 3, world_sizes
    quorums = [(quorum["reason"], sorted(quorum["members"])) for quorum in status["quorums"]]
    assert quorums == [
        ("start-up", ["worker-0", "worker-1", "worker-2", "worker-3"]),
        ("failure", ["worker-0", "worker-2", "worker-3"]),
        ("boundary", ["worker-0", "worker-1", "worker-2", "worker-3"]),
        ("failure", ["worker-0", "worker-1", "worker-3"]),
    ]
    ends = finished(tmp_path)
    assert sorted(ends) == ["worker-0", "worker-1", "worker-3"]
    assert len({event["outer_digest"] for event in ends.values()}) == 1
    assert ends["worker-0"]["inner_steps"] > rounds * INNER  # the survivors took extra inner steps
    restarted = [
        json.loads(line)["event"]
        for line in (tmp_path / "events-worker-1.jsonl").read_text().splitlines()
        if json.loads(line)["pid"] == cluster.processes[1].pid
    ]
    assert restarted[:3] == ["started", "healed", "joined"]
    finals = [torch.load(path, weights_only=True) for path in sorted(tmp_path.glob("final-*.pt"))]
    assert all(largest_difference(final, finals[0]) == 0.0 for final in finals)  # every model is the globals


def test_a_whole_diloco_fleet_killed_resumes_from_its_checkpoint_and_commits_each_round_once(tmp_path: Path) -> None:
    """Two groups checkpoint every round (globals, outer optimizer state); both are SIGKILLed while held at round 2.

    Rounds 0-1 are on record before the kill, and a checkpoint of step 1 or
    2 is vouched for: the writer skips a due step while its last checkpoint
    is still being written or reported, and a held fleet reaches no later
    boundary, so a newer one never comes while held. The restarted groups
    load the newest checkpoint the lighthouse vouches for, the ledger rolls
    back to it once, and every round then commits its planned samples, each
    sample once, with both groups ending on the same outer state bit for bit.
    """
    rounds = 4
    run_dir, checkpoints = tmp_path / "run", tmp_path / "checkpoints"
    args = diloco_args(rounds * INNER, "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1")
    with Lighthouse(
        ROUND_PLAN,
        min_replicas=1,
        start_replicas=2,
        heartbeat_timeout=1.0,
        join_timeout=30.0,
        state_path=tmp_path / "lighthouse.sqlite",
    ) as server:
        cluster = LocalCluster(server.url, run_dir, args)
        cluster.hold(from_step=2)
        for worker in range(2):
            cluster.start(worker)
        wait_until(
            lambda: (
                server.status()["ledger"]["step"] == 2
                and server.status()["checkpoint"]
                and [record["step"] for record in committed_steps(run_dir)] == [0, 1]
            ),
            timeout=JOB_TIMEOUT,
            what="the groups to be held at round 2 with rounds 0-1 on record and the lighthouse to vouch for a "
            "checkpoint",
        )
        for worker in range(2):
            cluster.processes[worker].send_signal(signal.SIGKILL)
        for worker in range(2):
            assert cluster.processes[worker].wait(timeout=JOB_TIMEOUT) == -signal.SIGKILL
        wait_until(
            lambda: all(member["state"] == "dead" for member in server.status()["members"]),
            timeout=JOB_TIMEOUT,
            what="the lighthouse to see every group dead",
        )
        checkpoint = server.status()["checkpoint"]
        cluster.hold(from_step=3)  # the resumed job waits at round 3 until both groups are in its quorum
        since = server.status()["quorums"][-1]["quorum_id"]
        for worker in range(2):
            cluster.start(worker)
        wait_until_together(server, ["worker-0", "worker-1"], cluster, since)
        cluster.release()
        wait_for(cluster, timeout=JOB_TIMEOUT)
        status = server.status()
    assert checkpoint["step"] in (1, 2)
    assert [(r["from_step"], r["to_step"]) for r in status["resumed_from_checkpoint"]] == [(2, checkpoint["step"])]
    assert status["ledger"]["step"] == rounds and status["checkpoint"]["step"] == rounds
    logs = "".join(path.read_text(errors="replace") for path in run_dir.glob("*.log"))
    assert "refused checkpoint" not in logs, "a checkpoint was written with a round in progress"
    check_rounds(run_dir, rounds)
    ends = finished(run_dir)
    assert sorted(ends) == ["worker-0", "worker-1"]
    assert len({event["outer_digest"] for event in ends.values()}) == 1
    for worker in range(2):
        restarted = [
            json.loads(line)["event"]
            for line in (run_dir / f"events-worker-{worker}.jsonl").read_text().splitlines()
            if json.loads(line)["pid"] == cluster.processes[worker].pid
        ]
        assert restarted[:3] == ["started", "healed", "joined"], restarted


def test_streaming_diloco_in_8_bits_survives_a_kill_during_a_fragments_exchange(tmp_path: Path) -> None:
    """Three groups, two fragments exchanged in int8 with error feedback; group 1 dies as round 1's first
    fragment exchange starts. The survivors finish the exchange without it, train its share, and agree."""
    rounds = 3
    args = diloco_args(rounds * INNER, "--fragments", "2", "--pseudo-gradient-dtype", "int8")
    with Lighthouse(ROUND_PLAN, min_replicas=1, start_replicas=3, heartbeat_timeout=1.0, join_timeout=30.0) as server:
        cluster = LocalCluster(server.url, tmp_path, args)
        for worker in range(3):
            cluster.start(worker, ["--kill-at", "1:during_exchange"] if worker == 1 else None)
        wait_for(cluster, timeout=JOB_TIMEOUT)
        lighthouse_rounds = server.status()["rounds"]
    assert cluster.processes[1].returncode == -signal.SIGKILL
    records = check_rounds(tmp_path, rounds)
    assert [record["world_size"] for record in records] == [3, 2, 2]
    assert lighthouse_rounds["rounds_committed"] == rounds  # the lighthouse counts rounds, from the heartbeats
    assert (lighthouse_rounds["inner_steps"], lighthouse_rounds["fragments"]) == (INNER, 2)
    assert lighthouse_rounds["bytes_exchanged"] > 0 and lighthouse_rounds["exchanges"] > 0
    ends = finished(tmp_path)
    assert sorted(ends) == ["worker-0", "worker-2"]
    assert len({event["outer_digest"] for event in ends.values()}) == 1
    for event in ends.values():
        exchanges = [entry for entry in event["exchange_log"] if entry["kind"] == "exchange"]
        assert {entry["fragment"] for entry in exchanges} == {0, 1}
        tails = [entry["round"] for entry in event["exchange_log"] if entry["kind"] == "tail"]
        assert tails == list(range(rounds))  # one tail per committed round, in order
        overlapped = [entry for entry in exchanges if entry["overlap"]]
        assert overlapped and all(entry["overlap"] == 1 for entry in overlapped)
        full_float32 = 4 * sum(p.numel() for p in TASKS["gpt-tiny"].model(0).parameters())
        assert event["largest_exchange"] < full_float32 / 4  # a fragment, in 8 bits


@pytest.mark.parametrize("fsdp", [[], ["--fsdp"]], ids=["replicated", "fsdp"])
def test_groups_of_two_processes_exchange_slices_and_equal_data_parallel_sgd(tmp_path: Path, fsdp: list[str]) -> None:
    """Two groups of two processes, H = 1, inner SGD, outer SGD at lr 1 without momentum: process r of
    each group exchanges slice r of the pseudo-gradient and the group gathers the slices. A step's 15 samples
    split 8 and 7, so only the pseudo-gradients' average weighted by samples is the mean gradient: the run is the
    every-step reference on every process (a wrong weighting, a slice or a group counted twice or not at all, is
    not). With FSDP2 groups, process r holds shard r of every parameter and exchanges it whole with process r of
    the other group (a shard exchanged with the wrong rank, or summed inside the group, is not the reference)."""
    steps = 4
    plan = EpochPlan(PLAN.dataset_size, 15, seed=0)
    reference, _ = reference_run(plan, steps, optimizer_name="sgd", clip=1e9, task="gpt-tiny")
    args = ["--model", "gpt-tiny", "--optimizer", "sgd", "--clip", "1e9", "--max-steps", str(steps),
            "--max-microbatch", "4", "--step-seconds", "0", "--collective-timeout", "5.0", "--diloco", "1",
            "--outer-lr", "1", "--outer-momentum", "0", *fsdp]  # fmt: skip
    with Lighthouse(plan, min_replicas=2, start_replicas=2, heartbeat_timeout=1.0, join_timeout=30.0) as server:
        agents = {name: launch_group(server.url, name, tmp_path, args) for name in ("group-a", "group-b")}
        try:
            codes = {name: agent.wait(timeout=JOB_TIMEOUT) for name, agent in agents.items()}
        finally:
            for agent in agents.values():
                end_group(agent)
    assert codes == {"group-a": 0, "group-b": 0}
    shares = {
        (record["member"], record["step"]): record["samples"]
        for path in tmp_path.glob("inner-*.jsonl")
        for record in map(json.loads, path.read_text(encoding="utf-8").splitlines())
    }
    assert sorted(set(shares.values())) == [7, 8]  # unequal shares: an unweighted average would be off
    finals = sorted(tmp_path.glob("final-*.pt"))
    assert len(finals) == 4
    for path in finals:
        assert largest_difference(torch.load(path, weights_only=True), reference) < TOLERANCE, path.name
    assert_same_outer_state(finished(tmp_path), sharded=bool(fsdp))


def assert_same_outer_state(ends: dict[str, dict[str, Any]], *, sharded: bool) -> None:
    """Every group's outer state (globals, outer optimizer) is the same bit for bit: with FSDP2 groups, process r's
    shards of it in every group (the digest covers this process's shards), else every process's whole copy."""
    by_rank: dict[str, set[str]] = {}
    for name, event in ends.items():
        by_rank.setdefault(name.rsplit(".", 1)[1] if sharded else "", set()).add(event["outer_digest"])
    assert all(len(digests) == 1 for digests in by_rank.values()), by_rank
    if sharded:  # process 0 and process 1 hold different shards
        assert len(by_rank) == 2 and by_rank["0"] != by_rank["1"], by_rank


@pytest.mark.parametrize(
    "streaming", [[], ["--fragments", "2", "--pseudo-gradient-dtype", "int8"]], ids=["diloco", "streaming-int8"]
)
def test_diloco_over_fsdp_groups_survives_a_sigkilled_process_and_heals_its_group_shard_by_shard(
    tmp_path: Path, streaming: list[str]
) -> None:
    """Two FSDP2 groups of two processes in DiLoCo: process 1 of group B is SIGKILLed in inner step 5 (round 1),
    its group ends with it (torchrun's agent's way) and is launched again; it joins at a round's end and is healed
    shard by shard from group A (globals, outer optimizer state, model, inner optimizer).

    Group A trains B's share of round 1 as extra inner steps, so every round commits its planned samples, each
    sample once; both groups end on the same global parameters bit for bit (each process's shards of the outer
    state equal the same rank's in the other group) and their models are the globals. Streaming: two fragments,
    one exchanged mid-round behind an inner step, in int8 with error feedback, shard by shard.
    """
    rounds = 4
    hold = tmp_path / "hold"
    hold.write_text("2")  # group A waits in round 2 (a hold counts rounds) until the restarted group B is in its quorum
    args = diloco_args(rounds * INNER, "--fsdp", "--hold-file", str(hold), *streaming)
    kill = ["--kill-at", f"{INNER + 1}:during_backward", "--kill-rank", "1"]
    with Lighthouse(ROUND_PLAN, min_replicas=1, start_replicas=2, heartbeat_timeout=1.0, join_timeout=30.0) as server:
        agents = {"group-a": launch_group(server.url, "group-a", tmp_path, args)}
        agents["group-b"] = launch_group(server.url, "group-b", tmp_path, [*args, *kill])
        restarted = None
        try:
            assert agents["group-b"].wait(timeout=JOB_TIMEOUT) != 0  # process 1 SIGKILLed itself, its sibling ended
            wait_until(
                lambda: any(q["reason"] == "failure" for q in server.status()["quorums"]),
                JOB_TIMEOUT,
                "group A to form a failure quorum alone",
            )
            since = server.status()["quorums"][-1]["quorum_id"]
            restarted = launch_group(server.url, "group-b", tmp_path, args)
            wait_until(lambda: together(server, ["group-a", "group-b"], since), JOB_TIMEOUT, "A and B in one quorum")
            hold.unlink()
            codes = {"group-a": agents["group-a"].wait(timeout=JOB_TIMEOUT), "group-b": restarted.wait(JOB_TIMEOUT)}
            status = server.status()
        finally:
            for agent in [*agents.values(), restarted]:
                if agent is not None:
                    end_group(agent)
    assert codes == {"group-a": 0, "group-b": 0}, codes
    records = check_rounds(tmp_path, rounds)
    world_sizes = [record["world_size"] for record in records]
    assert world_sizes[:2] == [2, 1] and world_sizes[-1] == 2, world_sizes
    quorums = [(quorum["reason"], sorted(quorum["members"])) for quorum in status["quorums"]]
    assert quorums[:2] == [("start-up", ["group-a", "group-b"]), ("failure", ["group-a"])], quorums
    ends = finished(tmp_path)
    assert sorted(ends) == ["group-a.0", "group-a.1", "group-b.0", "group-b.1"]
    assert_same_outer_state(ends, sharded=True)
    assert ends["group-a.0"]["inner_steps"] > rounds * INNER  # group A took B's share of round 1 as extra steps
    for rank in (0, 1):
        pids = {event["pid"] for event in events_of(tmp_path, f"group-b.{rank}") if event["event"] == "started"}
        assert len(pids) == 2  # the killed group and the restarted one
        assert "healed" in [event["event"] for event in events_of(tmp_path, f"group-b.{rank}")]
    finals = [torch.load(path, weights_only=True) for path in sorted(tmp_path.glob("final-*.pt"))]
    assert len(finals) == 4 and all(largest_difference(final, finals[0]) == 0.0 for final in finals)


def events_of(run_dir: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / f"events-{name}.jsonl").read_text().splitlines() if line]

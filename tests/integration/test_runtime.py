"""Failure-transparent training with real processes and real signals.

Each test runs the digits job on a local cluster of worker processes against
an embedded lighthouse, injects failures with SIGKILL or SIGSTOP at named
points of a step, and checks the three promises: every committed step has the
configured global batch, the committed samples are exactly once, and the
final parameters equal those of training without failures.

Tolerance: the failure-free reference sums each step's per-sample gradients
in one pass; the cluster sums per-member partial sums, in an order that
changes with the quorum. Both are float32 sums of the same terms, so they
differ by re-association only: a few ulps per step, about 1e-7 relative,
compounded over the steps. ``PARAM_TOLERANCE`` leaves two orders of
magnitude above what we observe, and ``test_tolerance_detects_a_dropped_share``
shows that dropping one member's share of a single step (what a lossy
fault-tolerance scheme does) moves the parameters far beyond it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from stalwart.coord.server import Lighthouse
from stalwart.launch.cluster import LocalCluster, latest_step
from stalwart.launch.digits import digits_dataset, digits_model, digits_optimizer, digits_scheduler, mean_loss
from stalwart.launch.report import committed_steps
from stalwart.testing.digits_job import (
    GLOBAL_BATCH,
    JOB_TIMEOUT,
    LONG_STEPS,
    PARAM_TOLERANCE,
    PLAN,
    STEPS,
    WORKERS,
    check_job,
    latest_quorum,
    wait_for,
    wait_until_together,
    worker_args,
)
from stalwart.testing.waiting import wait_until


def test_failure_free_run_matches_the_reference(
    tmp_path: Path, lighthouse: Lighthouse, reference: dict[str, torch.Tensor]
) -> None:
    cluster = LocalCluster(lighthouse.url, tmp_path, worker_args())
    for worker in range(WORKERS):
        cluster.start(worker)
    wait_for(cluster)
    check_job(tmp_path, reference, finishers=WORKERS)
    assert {record["world_size"] for record in committed_steps(tmp_path)} == {WORKERS}


POINTS = ["before_forward", "during_backward", "during_reduce", "after_reduce"]


def test_a_sigkill_at_each_point_of_a_step(
    tmp_path: Path, make_lighthouse: Callable[..., Lighthouse], reference: dict[str, torch.Tensor]
) -> None:
    """Five workers; worker k (1 to 4) is SIGKILLed at step 2k at the k-th point of a step: one job meets a kill at
    every point, each with a different world size, and ends on the failure-free parameters."""
    lighthouse = make_lighthouse(PLAN, workers=5)
    kills = {1 + index: f"{2 + 2 * index}:{point}" for index, point in enumerate(POINTS)}
    cluster = LocalCluster(lighthouse.url, tmp_path, worker_args())
    for worker in range(5):
        cluster.start(worker, ["--kill-at", kills[worker]] if worker in kills else None)
    wait_for(cluster)
    assert [cluster.processes[worker].returncode for worker in kills] == [-signal.SIGKILL] * len(POINTS)
    check_job(tmp_path, reference, finishers=1)
    world_sizes = [record["world_size"] for record in committed_steps(tmp_path)]
    assert world_sizes == sorted(world_sizes, reverse=True) and set(world_sizes) == {5, 4, 3, 2, 1}


def test_two_workers_killed_at_once(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    with Lighthouse(
        PLAN, min_replicas=1, start_replicas=WORKERS + 1, heartbeat_timeout=1.0, join_timeout=30.0
    ) as server:
        cluster = LocalCluster(server.url, tmp_path, worker_args())
        for worker in range(WORKERS + 1):
            cluster.start(worker, ["--kill-at", "3:during_backward"] if worker in (1, 2) else None)
        wait_for(cluster)
    check_job(tmp_path, reference, finishers=WORKERS - 1)
    world_sizes = [record["world_size"] for record in committed_steps(tmp_path)]
    assert world_sizes[0] == WORKERS + 1 and world_sizes[-1] == WORKERS - 1


def test_two_of_three_killed_at_once_with_min_replicas_2_restart_and_the_job_ends_exact(
    tmp_path: Path, long_reference: dict[str, torch.Tensor]
) -> None:
    """``min_replicas=2``: workers 1 and 2 are SIGKILLed in the same step and started again.

    The lone survivor holds the job's state: it forms a failure quorum alone,
    finishes the step with the dead workers' samples and trains on below
    ``min_replicas``; the restarted workers join it at a step boundary and
    are healed from it. The job is held before step 8 until both are back
    in its quorum, so the test does not depend on how long they take to start.
    """
    with Lighthouse(PLAN, min_replicas=2, start_replicas=WORKERS, heartbeat_timeout=1.0, join_timeout=30.0) as server:
        cluster = LocalCluster(server.url, tmp_path, worker_args(LONG_STEPS))
        cluster.hold(from_step=8)
        for worker in range(WORKERS):
            cluster.start(worker, ["--kill-at", "3:during_backward"] if worker in (1, 2) else None)
        deadline = time.monotonic() + JOB_TIMEOUT
        while any(cluster.processes[w].poll() is None for w in (1, 2)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [cluster.processes[w].returncode for w in (1, 2)] == [-signal.SIGKILL] * 2
        since = latest_quorum(server)
        for worker in (1, 2):
            cluster.start(worker)
        wait_until_together(server, [f"worker-{worker}" for worker in range(WORKERS)], cluster, since)
        cluster.release()
        wait_for(cluster)
        status = server.status()
    check_job(tmp_path, long_reference, finishers=WORKERS, steps_run=LONG_STEPS)
    world_sizes = [record["world_size"] for record in committed_steps(tmp_path)]
    assert world_sizes[:3] == [WORKERS] * 3 and world_sizes[3] == 1 and world_sizes[-1] == WORKERS
    quorums = status["quorums"]
    reasons = [quorum["reason"] for quorum in quorums]
    boundary = reasons.index("boundary")
    assert reasons[0] == "start-up" and boundary >= 2 and set(reasons[1:boundary]) == {"failure"}
    # the deaths may be seen more than ahead_settle apart: a failure quorum formed ahead after the first one broke
    # at the second (docs/protocol.md, "Forming a failure quorum ahead"); the survivor's requests formed the last
    assert all(quorum.get("ahead") for quorum in quorums[1 : boundary - 1]), quorums
    assert {failure["member"] for failure in status["failures"]} == {"worker-1", "worker-2"}


def test_killed_worker_restarts_and_is_healed(
    tmp_path: Path, lighthouse: Lighthouse, long_reference: dict[str, torch.Tensor]
) -> None:
    """Worker 2 dies at step 2; the others are held before step 6 until its new process has rejoined.

    The hold makes the test independent of how long the restarted process
    takes to start (seconds on a busy machine): the job cannot end first.
    """
    cluster = LocalCluster(lighthouse.url, tmp_path, worker_args(LONG_STEPS))
    cluster.hold(from_step=6)
    for worker in range(WORKERS):
        cluster.start(worker, ["--kill-at", "2:before_forward"] if worker == 2 else None)
    deadline = time.monotonic() + JOB_TIMEOUT
    while cluster.processes[2].poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cluster.processes[2].returncode == -signal.SIGKILL
    since = latest_quorum(lighthouse)
    cluster.start(2)
    wait_until_together(lighthouse, [f"worker-{worker}" for worker in range(WORKERS)], cluster, since)
    cluster.release()
    wait_for(cluster)
    check_job(tmp_path, long_reference, finishers=WORKERS, steps_run=LONG_STEPS)
    world_sizes = [record["world_size"] for record in committed_steps(tmp_path)]
    assert min(world_sizes) == WORKERS - 1 and world_sizes[-1] == WORKERS
    events = [json.loads(line) for line in (tmp_path / "events-worker-2.jsonl").read_text().splitlines()]
    restarted = [event for event in events if event["pid"] == cluster.processes[2].pid]
    assert [event["event"] for event in restarted][:3] == ["started", "healed", "joined"]


@pytest.mark.slow
def test_hung_worker_is_excluded_then_rejoins(
    tmp_path: Path, lighthouse: Lighthouse, long_reference: dict[str, torch.Tensor]
) -> None:
    """Worker 1 is SIGSTOPped at step 3, the others go on to step 5 without it, then it resumes and rejoins.

    Holds pin each phase to a step, so no phase depends on how fast the machine is.
    """
    cluster = LocalCluster(lighthouse.url, tmp_path, worker_args(LONG_STEPS))
    cluster.hold(from_step=3)
    for worker in range(WORKERS):
        cluster.start(worker)
    wait_for(cluster, until_step=3)
    cluster.kill(1, "STOP", step=3)
    cluster.hold(from_step=5)
    wait_for(cluster, until_step=5)
    since = latest_quorum(lighthouse)
    cluster.revive(1)
    wait_until_together(lighthouse, [f"worker-{worker}" for worker in range(WORKERS)], cluster, since)
    cluster.release()
    wait_for(cluster)
    check_job(tmp_path, long_reference, finishers=WORKERS, steps_run=LONG_STEPS)
    world_sizes = [record["world_size"] for record in committed_steps(tmp_path)]
    assert world_sizes[:3] == [WORKERS] * 3 and world_sizes[3] == WORKERS - 1 and world_sizes[-1] == WORKERS


@pytest.mark.parametrize("checkpointed", [False, True], ids=["untrained", "final-checkpoint"])
def test_a_mid_step_rejoin_after_the_job_ended_stops_as_a_late_joiner(
    tmp_path: Path, lighthouse: Lighthouse, reference: dict[str, torch.Tensor], checkpointed: bool
) -> None:
    """Worker 1 is SIGSTOPped inside step 3 and resumed after the others finished: it stops with exit status 0.

    Its step's all-reduce fails and its heal finds the job ended: it loads
    the final checkpoint, or has none to load; either way it used to train
    that step on the finished ledger and fail (``the quorum reduced ...
    samples, the ledger holds ...``).
    """
    checkpoints = ["--checkpoint-dir", str(tmp_path / "checkpoints"), "--checkpoint-every", "4"]
    cluster = LocalCluster(lighthouse.url, tmp_path, [*worker_args(), *(checkpoints if checkpointed else [])])
    cluster.hold(from_step=3)
    for worker in range(WORKERS):
        cluster.start(worker)
    wait_for(cluster, until_step=3)
    cluster.kill(1, "STOP", step=3)  # held at the top of step 3: the step is yielded, not reduced
    cluster.release()
    others = [cluster.processes[worker] for worker in range(WORKERS) if worker != 1]
    wait_until(lambda: all(process.poll() is not None for process in others), JOB_TIMEOUT, "the others to finish")
    cluster.revive(1)
    wait_for(cluster)
    assert [cluster.processes[worker].returncode for worker in range(WORKERS)] == [0] * WORKERS
    check_job(tmp_path, reference, finishers=WORKERS - 1)
    events = [json.loads(line)["event"] for line in (tmp_path / "events-worker-1.jsonl").read_text().splitlines()]
    assert events[-1] == "joined_after_end"
    log = (tmp_path / "worker-1.log").read_text()
    assert "the ledger holds" not in log
    assert ("its final checkpoint is loaded" in log) == checkpointed


def test_lighthouse_killed_and_restarted_mid_run(tmp_path: Path, long_reference: dict[str, torch.Tensor]) -> None:
    state = tmp_path / "lighthouse.sqlite"
    command = [
        sys.executable, "-m", "stalwart", "lighthouse", "--min-replicas", "1", "--state", str(state),
        "--start-replicas", str(WORKERS), "--heartbeat-timeout", "3", "--join-timeout", "30",
        "--dataset-size", str(PLAN.dataset_size), "--global-batch", str(GLOBAL_BATCH), "--seed", "0",
    ]  # fmt: skip

    def start_lighthouse(port: int = 0) -> tuple[subprocess.Popen[str], str]:
        process = subprocess.Popen([*command, "--port", str(port)], stdout=subprocess.PIPE, text=True)
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("lighthouse listening on "), line
        return process, line.removeprefix("lighthouse listening on ").strip()

    server, url = start_lighthouse()
    port = int(url.rpartition(":")[2])
    cluster = LocalCluster(url, tmp_path / "run", worker_args(LONG_STEPS))
    cluster.hold(from_step=8)  # the job cannot end before the lighthouse is back
    try:
        for worker in range(WORKERS):
            cluster.start(worker)
        wait_for(cluster, until_step=3)
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=10)
        server, _ = start_lighthouse(port)
        lighthouse_restarted_before_the_end = latest_step(cluster.run_dir)[0] < LONG_STEPS
        cluster.release()
        wait_for(cluster)
    finally:
        cluster.terminate()
        server.kill()
        server.wait(timeout=10)
    check_job(tmp_path / "run", long_reference, finishers=WORKERS, steps_run=LONG_STEPS)
    assert lighthouse_restarted_before_the_end


def test_tolerance_detects_a_dropped_share(reference: dict[str, torch.Tensor]) -> None:
    """A lossy recovery (one member's share of step 4 never trained) is far outside the tolerance."""
    dataset = digits_dataset()
    model = digits_model(0)
    optimizer = digits_optimizer(model)
    scheduler = digits_scheduler(optimizer)
    for step in range(STEPS):
        indices = PLAN.indices(0, PLAN.step_start(step), PLAN.step_start(step + 1))
        if step == 4:
            indices = indices[: 2 * len(indices) // 3]
        optimizer.zero_grad()
        mean_loss(model, dataset[torch.from_numpy(indices)]).backward()
        optimizer.step()
        scheduler.step()
    lossy = model.state_dict()
    worst = max(float((lossy[name] - value).abs().max()) for name, value in reference.items())
    assert np.isfinite(worst) and worst > 100 * PARAM_TOLERANCE

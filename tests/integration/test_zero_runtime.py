"""Sharded optimizer state under the Manager: real worker processes, real SIGKILLs at named points of a step.

Each job shards Adam's state with an overlap or parity over the workers,
kills workers at a point of a step (including during the optimizer update,
the parameter gather and the parity exchange), and checks the promises of
``test_runtime.py`` (constant global batch, exactly once, final parameters
equal to the failure-free reference within its tolerance) plus the sharded
state's own: every finisher holds the bytes its layout says, and the
survivors repaired in memory.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from stalwart.coord.server import Lighthouse
from stalwart.launch.cluster import LocalCluster
from stalwart.launch.report import committed_steps
from stalwart.testing.digits_job import (
    JOB_TIMEOUT,
    PLAN,
    check_job,
    latest_quorum,
    wait_for,
    wait_until_together,
    worker_args,
)
from stalwart.testing.waiting import wait_until

WORKERS = 4


def finished_events(run_dir: Path) -> list[dict[str, object]]:
    events = []
    for path in sorted(run_dir.glob("events-*.jsonl")):
        events += [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == "finished"]
    return events


CASES = [
    (["--overlap", "0.25"], "during_update", [1]),
    (["--parity", "3,1"], "during_parity", [3]),
    (["--parity", "2,2"], "during_gather", [1, 2]),
]
"""A double kill during the reduction of overlap 0.5 is the GPT loop's (test_training_loop) and the harness's
(test_zero: two kills at gather and update); a kill during the reduction the replicated job's (test_runtime)."""


@pytest.mark.parametrize(("redundancy", "point", "victims"), CASES, ids=lambda value: str(value))
def test_kill_at_a_point_of_a_sharded_step(
    tmp_path: Path,
    lighthouse: Lighthouse,
    reference: dict[str, torch.Tensor],
    redundancy: list[str],
    point: str,
    victims: list[int],
) -> None:
    cluster = LocalCluster(lighthouse.url, tmp_path, [*worker_args(), *redundancy])
    for worker in range(WORKERS):
        cluster.start(worker, ["--kill-at", f"4:{point}"] if worker in victims else None)
    wait_for(cluster)
    for victim in victims:
        assert cluster.processes[victim].returncode == -signal.SIGKILL
    check_job(tmp_path, reference, finishers=WORKERS - len(victims))
    assert min(record["world_size"] for record in committed_steps(tmp_path)) == WORKERS - len(victims)
    finished = finished_events(tmp_path)
    assert all(event["repairs"] >= 1 for event in finished)


def test_more_failures_than_covered_stop_the_job_which_resumes_from_its_checkpoint(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """Overlap 0 loses worker 1's shard: the survivors stop naming it; the fleet restarts from the checkpoint."""
    with Lighthouse(PLAN, min_replicas=1, start_replicas=3, heartbeat_timeout=1.0, join_timeout=30.0) as server:
        options = ["--overlap", "0", "--checkpoint-dir", str(tmp_path / "checkpoints"), "--checkpoint-every", "3"]
        cluster = LocalCluster(server.url, tmp_path, [*worker_args(), *options])
        # The kill waits at step 8 until the lighthouse vouches for a checkpoint (of step 3, or of 6 when 3's was
        # done by then): each is written in the background and reported once the lighthouse's ledger has its step,
        # which may take longer than the steps up to the kill; a killed writer would take it along, and the
        # restarted fleet would have nothing to resume from.
        cluster.hold(from_step=8)
        for worker in range(3):
            cluster.start(worker, ["--kill-at", "8:during_gather"] if worker == 1 else None)
        try:
            wait_until(lambda: server.status()["checkpoint"], JOB_TIMEOUT, "the lighthouse to vouch for a checkpoint")
        except AssertionError:
            cluster.terminate()
            raise
        cluster.release()
        wait_for(cluster)
        assert [cluster.processes[worker].returncode for worker in range(3)] == [2, -signal.SIGKILL, 2]
        errors = {
            int(path.stem.rsplit("-", 1)[1]): event
            for path in sorted(tmp_path.glob("events-*.jsonl"))
            for event in map(json.loads, path.read_text().splitlines())
            if event["event"] == "error"
        }
        # each survivor names the dead worker's shard, never its own: shards are numbered by rank in the last
        # quorum worker 1 was in (ranks follow the order the workers first asked in, which is any on a busy
        # machine); the one that stops second may find the first gone as well (its quorum formed after it left)
        assert sorted(errors) == [0, 2], errors
        last = [q["members"] for q in server.status()["quorums"] if "worker-1" in q["members"]][-1]
        rank = {int(member.rsplit("-", 1)[1]): number for number, member in enumerate(last)}
        lost = {worker: event["shards_lost"] for worker, event in errors.items()}
        assert all(rank[1] in lost[worker] and rank[worker] not in lost[worker] for worker in errors), (lost, last)
        assert min(len(event["shards_lost"]) for event in errors.values()) == 1, "the first to stop names only 1's"
        assert all("resume from a checkpoint" in event["message"] for event in errors.values())
        cluster.hold(from_step=4)  # the first restarted worker must not finish the job alone
        checkpoint = server.status()["checkpoint"]
        since = latest_quorum(server)
        for worker in range(3):  # the whole fleet again, as a scheduler would: it resumes from a checkpoint
            cluster.start(worker)
        wait_until_together(server, [f"worker-{worker}" for worker in range(3)], cluster, since)
        cluster.release()
        wait_for(cluster)
        assert [cluster.processes[worker].returncode for worker in range(3)] == [0, 0, 0]
        assert [record["to_step"] for record in server.status()["resumed_from_checkpoint"]] == [checkpoint["step"]]
    check_job(tmp_path, reference, finishers=3)
    # the restarted fleet trained together; a spurious eviction on a busy machine may shrink a later step
    resumed = [record for record in committed_steps(tmp_path) if record["quorum_id"] > since]
    assert any(record["world_size"] == 3 for record in resumed)

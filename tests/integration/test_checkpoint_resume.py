"""A whole fleet SIGKILLed mid-run resumes from its newest durable checkpoint, with real processes.

The job is held at step 10 (see ``LocalCluster.hold``) so that every worker is
killed at the same known step; once all are gone, new processes start, the
lighthouse rolls its ledger back to the checkpoint and the job trains the
steps after it again. The final parameters equal the failure-free run's and
every committed step has its planned samples once.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import torch

from stalwart.coord.server import Lighthouse
from stalwart.launch.cluster import LocalCluster, latest_step
from stalwart.testing.digits_job import (
    LONG_STEPS,
    PLAN,
    check_job,
    latest_quorum,
    wait_for,
    wait_until_together,
    worker_args,
)
from stalwart.testing.waiting import wait_until

TIMEOUT = 240.0
WORKERS = 2  # the whole fleet: two processes killed and started again


def test_whole_fleet_killed_resumes_from_the_newest_checkpoint(
    tmp_path: Path, long_reference: dict[str, torch.Tensor]
) -> None:
    checkpoints = tmp_path / "checkpoints"
    with Lighthouse(
        PLAN,
        min_replicas=1,
        start_replicas=WORKERS,
        heartbeat_timeout=1.0,
        join_timeout=30.0,
        state_path=tmp_path / "lighthouse.sqlite",
    ) as lighthouse:
        args = [*worker_args(LONG_STEPS), "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "3"]
        cluster = LocalCluster(lighthouse.url, tmp_path / "run", args)
        cluster.hold(from_step=10)
        for worker in range(WORKERS):
            cluster.start(worker)
        wait_for(cluster, until_step=10, timeout=TIMEOUT)
        wait_until(
            lambda: lighthouse.status()["ledger"]["step"] == 10 and lighthouse.status()["checkpoint"],
            timeout=TIMEOUT,
            what="the lighthouse to commit step 10 and vouch for a checkpoint",
        )
        for worker in range(WORKERS):
            cluster.processes[worker].send_signal(signal.SIGKILL)
        for worker in range(WORKERS):
            assert cluster.processes[worker].wait(timeout=TIMEOUT) == -signal.SIGKILL
        wait_until(
            lambda: all(m["state"] == "dead" for m in lighthouse.status()["members"]),
            timeout=TIMEOUT,
            what="the lighthouse to see every worker dead",
        )
        checkpoint = lighthouse.status()["checkpoint"]
        cluster.hold(from_step=12)  # the resumed job waits at step 12 until every new process is in its quorum
        since = latest_quorum(lighthouse)
        for worker in range(WORKERS):
            cluster.start(worker)
        wait_until_together(lighthouse, [f"worker-{worker}" for worker in range(WORKERS)], cluster, since)
        cluster.release()
        wait_for(cluster, timeout=TIMEOUT)
        status = lighthouse.status()
        late = subprocess.run(
            [
                sys.executable,
                "-m",
                "stalwart.launch.worker",
                "--lighthouse",
                lighthouse.url,
                "--member",
                "late",
                "--run-dir",
                str(tmp_path / "late"),
                "--max-steps",
                str(LONG_STEPS),
                "--checkpoint-dir",
                str(checkpoints),
                "--checkpoint-every",
                "3",
            ],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        after_late = lighthouse.status()
    assert [(r["from_step"], r["to_step"]) for r in status["resumed_from_checkpoint"]] == [(10, checkpoint["step"])]
    assert checkpoint["step"] in (3, 6, 9)
    assert status["ledger"]["step"] == LONG_STEPS
    assert status["checkpoint"]["step"] == LONG_STEPS, "the writer checkpoints the last step"
    assert latest_step(tmp_path / "run")[0] == LONG_STEPS
    check_job(tmp_path / "run", long_reference, finishers=WORKERS, steps_run=LONG_STEPS)
    assert late.returncode == 0, late.stderr
    assert f"the job had already committed its {LONG_STEPS} steps" in late.stderr
    assert after_late["ledger"]["step"] == LONG_STEPS
    assert [(r["from_step"], r["to_step"]) for r in after_late["resumed_from_checkpoint"]][1:] == [
        (LONG_STEPS, LONG_STEPS)
    ], "a late joiner loads the final checkpoint and rolls nothing back"


def test_a_lighthouse_restarted_without_its_state_ends_workers_with_one_line(tmp_path: Path) -> None:
    """Documented outcome: the members of the old job are refused at their next quorum and exit with one line."""
    first = Lighthouse(PLAN, min_replicas=1, start_replicas=2, heartbeat_timeout=1.0, join_timeout=30.0)
    first.start()
    port = first.port
    cluster = LocalCluster(first.url, tmp_path / "run", worker_args(LONG_STEPS))
    cluster.hold(from_step=5)
    for worker in range(2):
        cluster.start(worker)
    try:
        wait_for(cluster, until_step=5, timeout=TIMEOUT)
        first.stop()
        with Lighthouse(PLAN, min_replicas=1, port=port, heartbeat_timeout=1.0, join_timeout=30.0):
            cluster.processes[1].send_signal(signal.SIGKILL)
            cluster.release()
            assert cluster.processes[0].wait(timeout=TIMEOUT) == 2
    finally:
        cluster.terminate()
    log = (tmp_path / "run" / "worker-0.log").read_text()
    assert "Traceback" not in log
    last = log.strip().splitlines()[-1]
    assert last.startswith("stalwart worker worker-0: lighthouse answered 422")
    assert "restarted without its --state file" in last

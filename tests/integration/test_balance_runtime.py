"""Straggler relief with real processes: a slow worker gets a smaller share, through a SIGKILL, exactly once.

The digits job on a local cluster against an embedded lighthouse that balances
its ledger every two steps; one worker sleeps four times longer per sample
than the others. The job must keep the promises of ``test_runtime`` (every
step trains on the planned total, each sample once, parameters equal to a
failure-free run's) while the weights, decided by the workers from their
all-reduce and replayed by the lighthouse from their heartbeats, give the slow
worker less.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch

from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.launch.cluster import LocalCluster
from stalwart.launch.report import audit_steps, committed_steps, planned_total
from stalwart.launch.tasks import reference_run

STEPS = 12
PLAN = EpochPlan(1797, 48, seed=0, local_batch_multiple=4)
PARAM_TOLERANCE = 1e-4
JOB_TIMEOUT = 150.0
FAST, SLOW = 0.001, 0.004


def test_a_slow_worker_gets_less_and_the_job_stays_exact_through_a_sigkill(tmp_path: Path) -> None:
    reference, _ = reference_run(PLAN, STEPS)
    lighthouse = Lighthouse(
        PLAN, min_replicas=1, start_replicas=3, heartbeat_timeout=1.0, join_timeout=30.0, balance_every=2
    )
    lighthouse.start()
    try:
        arguments = ["--max-steps", str(STEPS), "--max-microbatch", "8", "--collective-timeout", "1.0"]
        cluster = LocalCluster(lighthouse.url, tmp_path, [*arguments, "--sample-seconds", str(FAST)])
        cluster.start(0)
        cluster.start(1, ["--kill-at", "7:during_backward"])
        cluster.start(2, ["--sample-seconds", str(SLOW)])
        deadline = time.monotonic() + JOB_TIMEOUT
        while cluster.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        if cluster.running():
            cluster.terminate()
            logs = "\n".join(path.read_text(errors="replace")[-3000:] for path in sorted(tmp_path.glob("*.log")))
            pytest.fail(f"the job did not end in {JOB_TIMEOUT} s; worker logs:\n{logs}")
        status = lighthouse.status()
    finally:
        lighthouse.stop()
    assert cluster.processes[1].returncode == -signal.SIGKILL
    steps = committed_steps(tmp_path)
    assert [record["step"] for record in steps] == list(range(STEPS))
    assert [record["samples"] for record in steps] == [planned_total(PLAN, step) for step in range(STEPS)]
    assert audit_steps(PLAN, steps) == (True, 0, 0)
    for path in sorted(tmp_path.glob("final-*.pt")):
        parameters = torch.load(path, weights_only=True)
        assert max(float((parameters[name] - value).abs().max()) for name, value in reference.items()) < PARAM_TOLERANCE
    assert status["ledger"]["step"] == STEPS, "the lighthouse committed every step: its replay matched the digests"
    balance = status["ledger"]["balance"]
    assert balance["every"] == 2 and balance["step"] >= 2
    weights = balance["weights"]
    assert weights["worker-0"] >= 2 * weights["worker-2"], weights

"""A peer slower than the collective timeout, alive all along: the job makes progress instead of livelocking.

Worker 1 reaches every step's all-reduce 2.5 s after the others (``--step-seconds 2.5``:
its heartbeat goes on, as a slow link's does) while the collective timeout is
1 s. Each all-reduce of the others times out, and the lighthouse forms a
failure quorum of the same three members. Before the growth rule
(:mod:`stalwart.runtime.patience`) that happened at every step; with it the
timeout doubles with each such quorum, and once it covers the slow peer the
steps commit without failures. Asserted: the job ends exact, with at most
``log2(MAX_GROWTH)`` failure quorums of the same members, fewer than its steps.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from stalwart.coord.server import Lighthouse
from stalwart.launch.cluster import LocalCluster
from stalwart.runtime.patience import MAX_GROWTH
from stalwart.testing.digits_job import WORKERS, check_job, reference_parameters, wait_for, worker_args

SLOW_SECONDS = 2.5
STEPS = 5
"""More steps than the rule's growths (4): without the rule, every step breaks its quorum once."""


@pytest.mark.slow
def test_a_peer_slower_than_the_collective_timeout_stops_failing_steps(tmp_path: Path, lighthouse: Lighthouse) -> None:
    cluster = LocalCluster(lighthouse.url, tmp_path, worker_args(STEPS))
    for worker in range(WORKERS):
        cluster.start(worker, ["--step-seconds", str(SLOW_SECONDS)] if worker == 1 else None)
    wait_for(cluster)
    assert [cluster.processes[worker].returncode for worker in range(WORKERS)] == [0] * WORKERS
    check_job(tmp_path, reference_parameters(STEPS), finishers=WORKERS, steps_run=STEPS)
    quorums = lighthouse.status()["quorums"]
    same_member_failures = [
        later
        for earlier, later in itertools.pairwise(quorums)
        if later["reason"] == "failure" and later["members"] == earlier["members"]
    ]
    assert 1 <= len(same_member_failures) <= MAX_GROWTH.bit_length() - 1 < STEPS
    assert "collective timeout 1 s -> 2 s" in (tmp_path / "worker-0.log").read_text()

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
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from stalwart.coord.server import Lighthouse
from stalwart.launch.cluster import LocalCluster
from stalwart.launch.report import committed_steps
from tests.test_runtime import PLAN, STEPS, check_job, wait_for, worker_args

WORKERS = 4


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    from stalwart.launch.digits import reference_run

    parameters, _ = reference_run(PLAN, STEPS)
    return parameters


@pytest.fixture
def lighthouse() -> Iterator[Lighthouse]:
    server = Lighthouse(PLAN, min_replicas=1, start_replicas=WORKERS, heartbeat_timeout=1.0, join_timeout=30.0)
    server.start()
    yield server
    server.stop()


def finished_events(run_dir: Path) -> list[dict[str, object]]:
    events = []
    for path in sorted(run_dir.glob("events-*.jsonl")):
        events += [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == "finished"]
    return events


CASES = [
    (["--overlap", "0.25"], "during_update", [1]),
    (["--overlap", "0.25"], "during_gather", [2]),
    (["--parity", "3,1"], "during_gather", [1]),
    (["--parity", "3,1"], "during_parity", [3]),
    (["--parity", "2,2"], "during_update", [1, 2]),
    (["--overlap", "0.5"], "during_reduce", [0, 3]),
]


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

"""Training through a SIGKILL with the user's own DataLoader: ``ManagedDistributedSampler(manager, dataset)``.

The workers of :mod:`tests.test_runtime`'s job load through a plain
``DataLoader`` (``--loader dataloader``) with 0 or 2 worker processes; one
member is SIGKILLed during step 4's backward. The promises are those of
``check_job``: every step's global batch, every sample exactly once, the
failure-free run's parameters. With 2 DataLoader workers the survivors had
step 5 and 6's micro-batches in flight when step 4's retry gave them more
positions: those are dropped, never trained on.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from stalwart.coord.server import Lighthouse
from stalwart.launch.cluster import LocalCluster
from stalwart.launch.report import committed_steps
from stalwart.testing.digits_job import PLAN, WORKERS, check_job, wait_for, worker_args
from stalwart.testing.waiting import wait_until


@pytest.mark.parametrize("loader_workers", [0, 2])
def test_sigkill_mid_step_with_the_users_dataloader(
    tmp_path: Path, lighthouse: Lighthouse, reference: dict[str, torch.Tensor], loader_workers: int
) -> None:
    args = [*worker_args(), "--loader", "dataloader", "--loader-workers", str(loader_workers)]
    cluster = LocalCluster(lighthouse.url, tmp_path, args)
    for worker in range(WORKERS):
        cluster.start(worker, ["--kill-at", "4:during_backward"] if worker == 1 else None)
    wait_for(cluster)
    assert cluster.processes[1].returncode == -signal.SIGKILL
    check_job(tmp_path, reference, finishers=WORKERS - 1)
    assert min(record["world_size"] for record in committed_steps(tmp_path)) == WORKERS - 1
    for survivor in (0, 2):
        records = [json.loads(line) for line in (tmp_path / f"steps-worker-{survivor}.jsonl").read_text().splitlines()]
        assert [record["base_index"] for record in records] == [PLAN.step_start(record["step"]) for record in records]
        dropped = {record["step"]: record["dropped"] for record in records}
        assert {dropped[step] for step in range(4)} == {0}
        # prefetch_factor 2 x 2 workers: 4 micro-batches in flight when step 4's retry superseded them
        assert dropped[4] >= 4 if loader_workers else set(dropped.values()) == {0}
    # the killed worker's DataLoader workers end with it (torch's watchdog follows the process that started them)
    wait_until(
        lambda: not processes_logging_to(tmp_path), timeout=60.0, what="no process of the job to be left running"
    )


def processes_logging_to(folder: Path) -> list[int]:
    """Pids of the processes whose stdout is a file in ``folder`` (the workers and their DataLoader workers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                target = os.readlink(entry / "fd" / "1")
            except OSError:
                continue
            if target.startswith(f"{folder}/"):
                pids.append(int(entry.name))
    return pids

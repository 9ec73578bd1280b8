"""Replica groups, started as torchrun starts them, against a separately started lighthouse.

Two groups of two processes each (one
:class:`~stalwart.testing.groups.ForkedGroup` per group: torchrun's
environment, its agent's end-together rule) train the digits job; each group's
share is split by intra-group rank. One process of a group is SIGKILLed
mid-run: the group's launcher ends its sibling, the lighthouse sees the
group's leader go, and the other group finishes the steps alone, computing the
lost share. The run must keep every step's global batch, train each sample
exactly once, and end with the failure-free parameters on every surviving
process.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from stalwart.coord.server import Lighthouse
from stalwart.launch.cluster import latest_step
from stalwart.launch.report import audit_steps, committed_steps, planned_total
from stalwart.launch.tasks import reference_run
from stalwart.testing.digits_job import PARAM_TOLERANCE
from stalwart.testing.groups import GROUP_PLAN as PLAN
from stalwart.testing.groups import GROUP_STEPS as STEPS
from stalwart.testing.groups import end_group, launch_group, worker_pids

TIMEOUT = 180.0
WORKERS = 2  # groups


def test_groups_split_shares_and_a_lost_group_is_recomputed(tmp_path: Path, lighthouse: Lighthouse) -> None:
    agents = {name: launch_group(lighthouse.url, name, tmp_path) for name in ("group-a", "group-b")}
    try:
        deadline = time.monotonic() + TIMEOUT
        while latest_step(tmp_path)[0] < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert latest_step(tmp_path)[0] >= 6, "the groups did not start training"
        victim = worker_pids(agents["group-b"])[1]
        os.kill(victim, signal.SIGKILL)
        for agent in agents.values():
            agent.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for agent in agents.values():
            end_group(agent)
    assert agents["group-a"].returncode == 0
    assert agents["group-b"].returncode != 0
    steps = committed_steps(tmp_path)
    assert [record["step"] for record in steps] == list(range(STEPS))
    assert [record["samples"] for record in steps] == [planned_total(PLAN, step) for step in range(STEPS)]
    assert audit_steps(PLAN, steps) == (True, 0, 0)
    world_sizes = [record["world_size"] for record in steps]
    assert world_sizes[0] == 2 and world_sizes[-1] == 1
    reference, _ = reference_run(PLAN, STEPS)
    finals = sorted(tmp_path.glob("final-group-a.*.pt"))
    assert [path.name for path in finals] == ["final-group-a.0.pt", "final-group-a.1.pt"]
    for path in finals:
        parameters = torch.load(path, weights_only=True)
        worst = max(float((parameters[name] - value).abs().max()) for name, value in reference.items())
        assert worst < PARAM_TOLERANCE

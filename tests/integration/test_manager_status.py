"""``Manager.lighthouse_status()`` against a real lighthouse: its settings as the torchtitan trainer checks them."""

from __future__ import annotations

import pytest
import torch

from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.integrations.torchtitan.config import FaultTolerance, check_min_replica_size
from stalwart.runtime.manager import Manager

PLAN = EpochPlan(16, 4, seed=0)


@pytest.mark.parametrize("min_replicas", [1, 3])
def test_the_group_leader_reads_the_lighthouses_min_replicas_before_any_step(min_replicas: int) -> None:
    with Lighthouse(PLAN, min_replicas=min_replicas, heartbeat_timeout=2.0, join_timeout=10.0) as server:
        model = torch.nn.Linear(2, 1)
        manager = Manager(
            model, torch.optim.SGD(model.parameters(), lr=0.1), lighthouse=server.url, member="solo", max_microbatch=4
        )
        try:
            status = manager.lighthouse_status()
            assert status is not None and status["min_replicas"] == min_replicas
            assert status["quorum"] is None, "asked before the first quorum"
            check_min_replica_size(FaultTolerance(min_replica_size=min_replicas), status)
            with pytest.raises(ValueError, match=rf"runs with --min-replicas {min_replicas} "):
                check_min_replica_size(FaultTolerance(min_replica_size=min_replicas + 1), status)
        finally:
            manager.close()  # before any step: what the torchtitan trainer does when the check fails

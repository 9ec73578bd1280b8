"""The checks that ride on each step's all-reduce: replica drift and the data audit.

Unit tests cover the pieces (exact float32 sums, the drift decision); a
one-member job in this process with a loader that substitutes one sample
shows the audit refusing the step; a three-worker job whose worker 1 gets its
parameters perturbed at step 4 shows the drift check healing it from the
others before the step is applied, ending with the failure-free parameters.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.launch.cluster import LocalCluster
from stalwart.launch.digits import digits_dataset, digits_model, digits_optimizer, mean_loss
from stalwart.launch.report import audit_steps, committed_steps, planned_total
from stalwart.launch.tasks import reference_run
from stalwart.runtime.consistency import (
    DRIFT_SLOTS,
    AuditError,
    audit_pieces,
    audit_value,
    default_check_every,
    drift_plan,
    drift_slots,
    index_checksum,
    parameter_checksum,
)
from stalwart.runtime.loader import ElasticLoader
from stalwart.runtime.manager import Manager

STEPS = 10
PLAN = EpochPlan(1797, 48, seed=0)
PARAM_TOLERANCE = 1e-4
JOB_TIMEOUT = 150.0


def test_audit_pieces_sum_exactly_in_float32_for_many_processes() -> None:
    rng = np.random.default_rng(0)
    checksums = [int(value) for value in rng.integers(0, 1 << 63, size=4096, dtype=np.int64) * 2 + 1]
    reduced = torch.stack([audit_pieces(checksum) for checksum in checksums]).sum(dim=0)
    assert reduced.dtype == torch.float32
    assert audit_value(reduced.tolist()) == sum(checksums) % (1 << 64)


def test_index_checksum_is_order_free_and_sees_a_substitution_and_the_epoch() -> None:
    indices = np.arange(100, 148)
    whole = index_checksum(0, indices)
    halves = (index_checksum(0, indices[::2]) + index_checksum(0, indices[1::2])) % (1 << 64)
    assert whole == halves
    assert index_checksum(0, np.r_[indices[:-1], 999]) != whole
    assert index_checksum(1, indices) != whole
    assert index_checksum(np.zeros(48, dtype=np.int64), indices) == whole


def reduce_slots(reports: Sequence[tuple[float, float, int]]) -> torch.Tensor:
    world = len(reports)
    return torch.stack([drift_slots(rank, world, *report) for rank, report in enumerate(reports)]).sum(dim=0)


def test_drift_plan_heals_the_minority_from_the_majority() -> None:
    model = digits_model(0)
    same = parameter_checksum(list(model.parameters()))
    with torch.no_grad():
        next(model.parameters())[0, 0] += 1e-3
    odd = parameter_checksum(list(model.parameters()))
    assert drift_plan(reduce_slots([(*same, 5)] * 3), 3) is None
    plan = drift_plan(reduce_slots([(*same, 5), (*odd, 5), (*same, 5)]), 3)
    assert plan is not None and (plan.source, plan.targets) == (0, (1,))
    plan = drift_plan(reduce_slots([(*odd, 5), (*same, 5), (*same, 5)]), 3)
    assert plan is not None and (plan.source, plan.targets) == (1, (0,))
    plan = drift_plan(reduce_slots([(*same, 5), (*same, 4), (*same, 5)]), 3)
    assert plan is not None and plan.targets == (1,)
    plan = drift_plan(reduce_slots([(1.0, 1.0, 0), (2.0, 2.0, 0), (3.0, 3.0, 0)]), 3)
    assert plan is not None and (plan.source, plan.targets) == (0, (1, 2))  # no majority: lowest rank wins
    nan = (float("nan"), float("nan"), 1)
    assert drift_plan(reduce_slots([nan, nan]), 2) is None
    assert reduce_slots([(*same, 5)] * 3).numel() == 3 * DRIFT_SLOTS


def test_a_checksum_sees_layers_swapped() -> None:
    torch.manual_seed(0)
    first, second = torch.randn(4, 4), torch.randn(4, 4)
    assert parameter_checksum([first, second]) != parameter_checksum([second, first])


def test_checks_run_every_step_for_small_models_and_less_often_for_large_ones() -> None:
    assert default_check_every(4810) == 1
    assert default_check_every(10_004_500) == 77
    assert default_check_every(808_704) == 7  # the GPT example: the checksum costs under 1% of a step
    assert default_check_every(10**12) == 100


class SubstitutingLoader(ElasticLoader):
    """Loads sample 0 instead of the first sample of its share while ``substitute`` (a buggy or hostile loader)."""

    substitute = False

    def microbatches(self, epoch: int, indices: Sequence[int], max_microbatch: int) -> Iterator[Any]:
        indices = list(indices)
        if self.substitute and 0 not in indices:
            indices[0] = 0
        return super().microbatches(epoch, indices, max_microbatch)


def test_a_loader_that_substitutes_a_sample_makes_the_step_fail() -> None:
    with Lighthouse(PLAN, min_replicas=1, start_replicas=1, heartbeat_timeout=2.0, join_timeout=10.0) as server:
        model = digits_model(0)
        optimizer = digits_optimizer(model)
        manager = Manager(model, optimizer, lighthouse=server.url, member="solo", max_microbatch=16)
        loader = SubstitutingLoader(digits_dataset())
        committed = []
        try:
            with pytest.raises(AuditError, match=r"step 2: the samples the quorum loaded .* ledger's 48 positions"):
                for step in manager.steps(loader, max_steps=5):
                    loader.substitute = manager.ledger.step == 2
                    for batch in step:
                        step.backward(mean_loss(model, batch))
                    optimizer.step()
                    committed.append(step.report.step)
        finally:
            manager.close()
            loader.close()
        assert committed == [0, 1]
        assert manager.applied_step == 2


@pytest.fixture
def lighthouse() -> Iterator[Lighthouse]:
    server = Lighthouse(PLAN, min_replicas=1, start_replicas=3, heartbeat_timeout=1.0, join_timeout=30.0)
    server.start()
    yield server
    server.stop()


def test_a_corrupted_replica_is_healed_before_the_step_is_applied(tmp_path: Path, lighthouse: Lighthouse) -> None:
    reference, _ = reference_run(PLAN, STEPS)
    args = ["--max-steps", str(STEPS), "--max-microbatch", "8", "--collective-timeout", "1.0"]
    cluster = LocalCluster(lighthouse.url, tmp_path, args)
    for worker in range(3):
        cluster.start(worker, ["--corrupt-at", "4"] if worker == 1 else None)
    deadline = time.monotonic() + JOB_TIMEOUT
    while cluster.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    cluster.terminate()
    logs = "\n".join(path.read_text(errors="replace")[-2000:] for path in sorted(tmp_path.glob("*.log")))
    assert [process.returncode for process in cluster.processes.values()] == [0, 0, 0], logs

    steps = committed_steps(tmp_path)
    assert [record["step"] for record in steps] == list(range(STEPS))
    assert [record["samples"] for record in steps] == [planned_total(PLAN, step) for step in range(STEPS)]
    assert audit_steps(PLAN, steps) == (True, 0, 0)
    records = [json.loads(line) for path in tmp_path.glob("steps-*.jsonl") for line in path.read_text().splitlines()]
    assert {record["drift_heals"] for record in records if record["step"] < 4} == {0}
    assert {record["drift_heals"] for record in records if record["step"] >= 4} == {1}
    log = (tmp_path / "worker-1.log").read_text()
    assert re.search(r"step 4 replicas drifted: healing processes \[\d\] from process \d \(this one\)", log), log
    for path in sorted(tmp_path.glob("final-*.pt")):
        parameters = torch.load(path, weights_only=True)
        worst = max(float((parameters[name] - value).abs().max()) for name, value in reference.items())
        assert worst < PARAM_TOLERANCE, path

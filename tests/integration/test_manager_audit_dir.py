"""A user's loop gets ``stalwart audit``-able records with one option: ``Checks(audit_dir=DIR)``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from click.testing import CliRunner
from torch.utils.data import TensorDataset

from stalwart.cli import cli
from stalwart.coord.server import Lighthouse
from stalwart.data.audit import QUORUM, audit_directory
from stalwart.data.plan import EpochPlan
from stalwart.launch.digits import digits_dataset, digits_model, digits_optimizer
from stalwart.runtime.config import Checks
from stalwart.runtime.loader import ElasticLoader
from stalwart.runtime.manager import Manager

PLAN = EpochPlan(96, 32, seed=0)


def test_a_managed_loop_with_an_audit_dir_is_audited_exactly_once(tmp_path: Path) -> None:
    audit_dir = tmp_path / "audit"
    digits = digits_dataset()
    dataset = TensorDataset(*(tensor[: PLAN.dataset_size] for tensor in digits.tensors))
    model = digits_model(0)
    optimizer = digits_optimizer(model)
    with Lighthouse(PLAN, min_replicas=1, start_replicas=1, heartbeat_timeout=2.0, join_timeout=10.0) as server:
        manager = Manager(
            model,
            optimizer,
            lighthouse=server.url,
            member="solo",
            max_microbatch=32,
            checks=Checks(audit_dir=audit_dir),
        )
        loader = ElasticLoader(dataset)
        try:
            for step in manager.steps(loader, max_steps=7):  # epochs 0 and 1, then one step of epoch 2
                for inputs, targets in step:
                    step.backward(torch.nn.functional.cross_entropy(model(inputs), targets))
                optimizer.step()
                optimizer.zero_grad()
        finally:
            manager.close()
            loader.close()
    records = [json.loads(line) for line in (audit_dir / "steps-solo.jsonl").read_text().splitlines()]
    assert [(record["epoch"], record["step"]) for record in records] == [(s // 3, s) for s in range(7)]
    report = audit_directory(audit_dir)
    assert report.ok and report.spec == {"plan": PLAN.to_dict()}
    assert [(epoch.epoch, epoch.complete) for epoch in report.epochs] == [(0, True), (1, True), (2, False)]
    assert all(epoch.coverage.exactly_once for epoch in report.epochs[:2])
    assert report.epochs[0].rank_samples == {(QUORUM, None): 96}
    result = CliRunner().invoke(cli, ["audit", str(audit_dir)])
    assert result.exit_code == 0, result.output
    assert "OK: 3 epoch(s)" in result.output

"""The Manager's data API: ``get_data_loading_info()`` as each step began, ``step.epoch_end``, and the user's
own DataLoader driven by ``ManagedDistributedSampler(manager, dataset)`` (one member, in this process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from stalwart.coord.server import Lighthouse
from stalwart.data.info import LocalLedgerSource
from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan
from stalwart.data.sampler import ManagedDistributedSampler
from stalwart.data.world import WorldInfo
from stalwart.launch.processes import preloaded_context
from stalwart.runtime.loader import ElasticLoader
from stalwart.runtime.manager import Manager
from stalwart.runtime.planner import step_began

SMALL_PLAN = EpochPlan(40, 16, seed=3)
"""Three steps an epoch: 16, 16 and 8 samples."""


def small_dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(40, 4, generator=generator), torch.randint(0, 2, (40,), generator=generator))


def test_data_loading_info_is_the_ledgers_as_each_step_began_and_epoch_ends_are_flagged() -> None:
    dataset = small_dataset()
    reference = LocalLedgerSource(SMALL_PLAN, WorldInfo(0, 1))
    with Lighthouse(SMALL_PLAN, min_replicas=1, start_replicas=1, heartbeat_timeout=2.0, join_timeout=10.0) as server:
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        manager = Manager(model, optimizer, lighthouse=server.url, member="solo", max_microbatch=8)
        loader = ElasticLoader(dataset)
        ends = []
        try:
            for step in manager.steps(loader, max_steps=7):
                expected = reference.next_step()
                if expected is None:
                    reference.set_epoch(reference.epoch + 1)
                    expected = reference.next_step()
                assert manager.get_data_loading_info() == expected
                for inputs, targets in step:
                    assert manager.get_data_loading_info() == expected
                    step.backward(torch.nn.functional.cross_entropy(model(inputs), targets))
                optimizer.step()
                ends.append((step.report.epoch, step.epoch_end))
        finally:
            manager.close()
            loader.close()
    assert ends == [(0, False), (0, False), (0, True), (1, False), (1, False), (1, True), (2, False)]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 120), st.integers(1, 24), st.data())
def test_the_step_start_is_read_back_from_a_ledger_in_step_after_failures(
    size: int, batch: int, data: st.DataObject
) -> None:
    """The runtime's ledgers (every failure reassigned in its step): base_index and missing as at begin_step."""
    multiple = data.draw(st.integers(1, batch))
    ledger = DataLedger(EpochPlan(size, batch, local_batch_multiple=multiple))
    members = [f"m{number}" for number in range(data.draw(st.integers(1, 5)))]
    for _ in range(data.draw(st.integers(1, 12))):
        began = (0, []) if ledger.epoch_complete else (ledger.base_index, ledger.missing_indices.tolist())
        ledger.begin_step(members)
        live = list(members)
        while len(live) > 1 and data.draw(st.booleans()):
            ledger.member_failed(live.pop(data.draw(st.integers(0, len(live) - 1))))
            ledger.reassign(live)
        base_index, missing = step_began(ledger)
        assert (base_index, np.asarray(missing).tolist()) == began
        ledger.commit()


def train_solo(loader_for: Any, steps: int = 7) -> tuple[dict[str, torch.Tensor], list[bool]]:
    """Train one member for ``steps`` steps on ``loader_for(manager)``; final parameters and epoch_end flags."""
    with Lighthouse(SMALL_PLAN, min_replicas=1, start_replicas=1, heartbeat_timeout=2.0, join_timeout=10.0) as server:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        manager = Manager(model, optimizer, lighthouse=server.url, member="solo", max_microbatch=6)
        loader = loader_for(manager)
        ends = []
        try:
            for step in manager.steps(loader, max_steps=steps):
                for inputs, targets in step:
                    step.backward(torch.nn.functional.cross_entropy(model(inputs), targets))
                optimizer.step()
                ends.append(step.epoch_end)
        finally:
            manager.close()
            if isinstance(loader, ElasticLoader):
                loader.close()
    return model.state_dict(), ends


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataloader_over_the_managed_sampler_trains_what_the_elastic_loader_does(workers: int) -> None:
    dataset = small_dataset()
    expected, expected_ends = train_solo(lambda manager: ElasticLoader(dataset))

    def dataloader(manager: Manager) -> DataLoader[Any]:
        sampler = ManagedDistributedSampler(manager, dataset)
        # workers from the preloaded forkserver, not forked from this pytest process: it ran other tests before
        # (Arrow's thread pools, other libraries' threads), and a worker forked from it once died of SIGSEGV
        context = preloaded_context() if workers else None
        return DataLoader(
            dataset, batch_sampler=sampler, num_workers=workers, pin_memory=False, multiprocessing_context=context
        )

    parameters, ends = train_solo(dataloader)
    assert ends == expected_ends == [False, False, True, False, False, True, False]
    for name, value in expected.items():
        assert torch.equal(parameters[name], value), name


def test_steps_refuses_a_dataloader_it_does_not_drive_and_the_loader_is_not_iterated_alone() -> None:
    dataset = small_dataset()
    with Lighthouse(SMALL_PLAN, min_replicas=1, start_replicas=1, heartbeat_timeout=2.0, join_timeout=10.0) as server:
        model = torch.nn.Linear(4, 2)
        manager = Manager(model, torch.optim.SGD(model.parameters(), lr=0.1), lighthouse=server.url, member="solo",
                          max_microbatch=6)  # fmt: skip
        try:
            sampler = ManagedDistributedSampler(manager, dataset)
            with pytest.raises(RuntimeError, match=r"iterated by manager.steps\(loader\) only"):
                iter(DataLoader(dataset, batch_sampler=sampler))
            bad = [
                (DataLoader(dataset, batch_size=4), ValueError, "batch_sampler must be ManagedDistributedSampler"),
                (DataLoader(dataset, batch_sampler=sampler, in_order=False), ValueError, "in_order=True"),
                (DataLoader(dataset, batch_sampler=ManagedDistributedSampler(manager, 41)), ValueError, "41"),
                (dataset, TypeError, "ElasticLoader or a torch DataLoader"),
            ]
            for loader, error, message in bad:
                with pytest.raises(error, match=message):
                    next(manager.steps(loader, max_steps=1))  # type: ignore[arg-type]
        finally:
            manager.close()


@pytest.mark.slow
def test_the_dataloader_example_runs_as_written() -> None:
    """``examples/train_dataloader.py`` with two workers, each with a DataLoader of two worker processes."""
    script = Path(__file__).resolve().parents[2] / "examples" / "train_dataloader.py"
    with Lighthouse(None, min_replicas=2, start_replicas=2, join_timeout=60.0) as lighthouse:  # the script's plan
        environment = {**os.environ, "STALWART_LIGHTHOUSE": lighthouse.url}
        workers = [
            subprocess.Popen(
                [sys.executable, str(script)],
                env={**environment, "STALWART_MEMBER": f"w{index}"},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for index in range(2)
        ]
        outputs = [worker.communicate(timeout=180) for worker in workers]
        status = lighthouse.status()
    for worker, (_, stderr) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, stderr
    printed = [stdout for stdout, _ in outputs if stdout]
    assert len(printed) == 1  # the leader's
    assert [line.split(":")[0] for line in printed[0].splitlines()] == [
        f"epoch {epoch} done at step {16 * epoch + 15}" for epoch in range(6)
    ]
    assert "world 2" in printed[0]
    assert status["ledger"]["step"] == 100

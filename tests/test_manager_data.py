"""The Manager's data API: ``get_data_loading_info()`` as each step began, and ``step.epoch_end``."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

from stalwart.coord.server import Lighthouse
from stalwart.data.info import LocalLedgerSource
from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan
from stalwart.data.world import WorldInfo
from stalwart.runtime.loader import ElasticLoader
from stalwart.runtime.manager import Manager, _step_began

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
                    step.backward(torch.nn.functional.cross_entropy(model(inputs), targets, reduction="sum"))
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
        base_index, missing = _step_began(ledger)
        assert (base_index, np.asarray(missing).tolist()) == began
        ledger.commit()

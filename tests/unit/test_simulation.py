"""The ledger simulation under random failures and joins, and the ``stalwart simulate`` command."""

from __future__ import annotations

import itertools
import re
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from stalwart.cli.simulate import simulate_command
from stalwart.data import simulation
from stalwart.data.ledger import DataLedger, Positions
from stalwart.data.schedule import step_total
from stalwart.data.simulation import SimulationConfig, planned_steps, simulate


@st.composite
def configs(draw: st.DrawFn, reassign: bool | None = None) -> SimulationConfig:
    size = draw(st.integers(1, 400))
    batch = draw(st.integers(1, 40))
    multiple = draw(st.integers(1, batch))
    drop_last = draw(st.booleans())
    assume(not drop_last or step_total(0, batch, multiple) <= size)
    return SimulationConfig(
        dataset_size=size,
        global_batch_size=batch,
        workers=draw(st.integers(1, 6)),
        local_batch_multiple=multiple,
        failures=draw(st.integers(0, 8)),
        joins=draw(st.integers(0, 5)),
        seed=draw(st.integers(0, 2**32)),
        reassign=draw(st.booleans()) if reassign is None else reassign,
        drop_last=drop_last,
        epochs=draw(st.integers(1, 3)),
    )


@settings(max_examples=80, deadline=None)
@given(configs())
def test_every_epoch_is_exactly_once_under_failures_and_joins(config: SimulationConfig) -> None:
    result = simulate(config)
    summary = result.summary
    assert summary.exactly_once and summary.passed
    assert len(result.coverage) == config.epochs
    assert all(audit.exactly_once for audit in result.coverage)
    assert summary.failures + summary.failures_unapplied == config.failures
    assert summary.final_members == config.workers + config.joins - summary.failures
    assert summary.steps == len(result.records)
    assert [record.epoch for record in result.records] == sorted(record.epoch for record in result.records)
    for record in result.records:
        assert sum(record.share_sizes) == record.total
        assert len(record.share_sizes) == record.survivors <= record.members


@settings(max_examples=80, deadline=None)
@given(configs(reassign=True))
def test_reassign_keeps_every_step_at_the_schedules_total(config: SimulationConfig) -> None:
    result = simulate(config)
    assert result.summary.off_schedule_steps == 0
    assert len(result.records) == planned_steps(config)
    plan = config.plan()
    for record in result.records:
        assert record.total == record.planned_total == plan.step_total(record.step)
        assert record.missing == 0


@settings(max_examples=80, deadline=None)
@given(configs(reassign=False))
def test_requeue_hands_lost_positions_out_first_in_the_next_step(config: SimulationConfig) -> None:
    records = simulate(config).records
    assert records[-1].lost == 0
    for record, following in itertools.pairwise(records):
        assert following.missing >= record.lost
        lost = sum(int(event.split(": ")[1].split()[0]) for event in record.events if " died: " in event)
        assert lost == record.lost


@settings(max_examples=30, deadline=None)
@given(configs())
def test_a_run_is_determined_by_its_seed(config: SimulationConfig) -> None:
    assert simulate(config) == simulate(config)


def test_the_last_live_member_never_dies() -> None:
    result = simulate(SimulationConfig(100, 10, workers=1, failures=3))
    assert result.summary.failures == 0 and result.summary.failures_unapplied == 3
    assert result.summary.exactly_once and all(record.survivors == 1 for record in result.records)


def test_failures_and_joins_show_in_the_records() -> None:
    config = SimulationConfig(1000, 32, workers=4, failures=3, joins=2, seed=7, local_batch_multiple=4)
    result = simulate(config)
    events = [event for record in result.records for event in record.events]
    assert sum(" died: " in event for event in events) == 3
    assert sum(event.endswith(" joined") for event in events) == 2
    for before, after in itertools.pairwise(result.records):
        joined = sum(event.endswith(" joined") for event in after.events)
        assert after.members == before.survivors + joined
    assert max(record.survivors for record in result.records) >= 4


def test_on_step_sees_every_record() -> None:
    seen: list[Any] = []
    result = simulate(SimulationConfig(50, 8, workers=2, epochs=2), on_step=seen.append)
    assert seen == result.records


@pytest.mark.parametrize(
    ("changes", "error", "named"),
    [
        ({"workers": 0}, ValueError, "workers"),
        ({"failures": -1}, ValueError, "failures"),
        ({"joins": -1}, ValueError, "joins"),
        ({"epochs": 0}, ValueError, "epochs"),
        ({"reassign": "yes"}, TypeError, "reassign"),
        ({"local_batch_multiple": 9}, ValueError, "local_batch_multiple"),
        ({"dataset_size": 0}, ValueError, "dataset_size"),
    ],
)
def test_bad_configs_name_the_parameter(changes: dict[str, Any], error: type[Exception], named: str) -> None:
    arguments: dict[str, Any] = {"dataset_size": 20, "global_batch_size": 8, "workers": 2, **changes}
    with pytest.raises(error, match=named):
        SimulationConfig(**arguments)


def run_cli(*arguments: str) -> Any:
    return CliRunner().invoke(simulate_command, list(arguments))


@pytest.mark.parametrize("mode", ["--reassign", "--requeue"])
def test_cli_prints_steps_and_a_passing_audit(mode: str) -> None:
    result = run_cli(
        "--dataset-size", "500", "--global-batch", "32", "--workers", "4", "--failures", "3", "--joins", "1", mode
    )
    assert result.exit_code == 0, result.output
    assert "exactly once" in result.output and "yes" in result.output and "PASS" in result.output
    assert "died" in result.output and "joined" in result.output
    assert "re-queue" in result.output if mode == "--requeue" else "reassign" in result.output


def test_cli_elides_the_middle_of_long_runs() -> None:
    result = run_cli("--dataset-size", "2000", "--global-batch", "10", "--workers", "3", "--max-rows", "6")
    assert result.exit_code == 0, result.output
    assert "194 steps not shown" in result.output
    shown = re.findall(r"^│\s+0 │\s+(\d+) │", result.output, flags=re.MULTILINE)
    assert shown == ["0", "1", "2", "197", "198", "199"]


def test_cli_exits_1_when_the_audit_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    class DuplicatingLedger(DataLedger):
        def commit(self) -> Positions:
            positions = super().commit()
            return np.concatenate([positions, positions[:1]])

    monkeypatch.setattr(simulation, "DataLedger", DuplicatingLedger)
    result = run_cli("--dataset-size", "100", "--global-batch", "10", "--workers", "2")
    assert result.exit_code == 1
    assert "no" in result.output and "FAIL" in result.output


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        (["--dataset-size", "100", "--global-batch", "10", "--workers", "0"], "'--workers'"),
        (["--dataset-size", "0", "--global-batch", "10", "--workers", "2"], "'--dataset-size'"),
        (["--dataset-size", "100", "--global-batch", "10", "--workers", "2", "--multiple", "11"], "'--multiple'"),
        (["--dataset-size", "100", "--global-batch", "10", "--workers", "2", "--failures", "-1"], "'--failures'"),
        (["--dataset-size", "5", "--global-batch", "10", "--workers", "2", "--drop-last"], "'--global-batch'"),
        (["--global-batch", "10", "--workers", "2"], "'--dataset-size'"),
    ],
)
def test_cli_bad_arguments_name_the_option(arguments: list[str], named: str) -> None:
    result = run_cli(*arguments)
    assert result.exit_code == 2
    assert named in result.output

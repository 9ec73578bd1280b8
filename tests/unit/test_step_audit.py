"""Step records (``Checks(audit_dir=...)``): each member records every committed step whole; the audit counts a
step once when its members agree and names the step and the members when they do not."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from stalwart.cli.audit import audit_command
from stalwart.data.audit import QUORUM, AuditFileError, AuditWriter, StepAuditWriter, audit_directory
from stalwart.data.plan import EpochPlan
from stalwart.runtime.config import Checks

MEMBERS = ("a", "b", "c", "d")


def step_positions(plan: EpochPlan, epoch_step: int) -> np.ndarray:
    return np.arange(plan.step_start(epoch_step), plan.step_start(epoch_step + 1))


def record_steps(directory: Path, plan: EpochPlan, recorders: dict[int, list[str]]) -> None:
    """Each member in ``recorders[s]`` records step ``s`` (epoch 0's steps, then epoch 1's first as step S)."""
    writers = {member: StepAuditWriter(directory, member) for member in MEMBERS}
    try:
        for step, members in recorders.items():
            epoch, epoch_step = divmod(step, plan.steps_per_epoch)
            for member in members:
                writers[member].write(plan, epoch, step, step_positions(plan, epoch_step))
    finally:
        for writer in writers.values():
            writer.close()


@st.composite
def plans(draw: st.DrawFn) -> EpochPlan:
    size = draw(st.integers(2, 60))
    return EpochPlan(size, draw(st.integers(1, size)), seed=draw(st.integers(0, 5)))


@settings(max_examples=60, deadline=None)
@given(plans(), st.data())
def test_an_epoch_is_exactly_once_iff_every_step_was_recorded_by_some_member(
    plan: EpochPlan, data: st.DataObject
) -> None:
    members = st.lists(st.sampled_from(MEMBERS), unique=True, max_size=len(MEMBERS))
    recorders = {step: data.draw(members, label=f"step {step}") for step in range(plan.steps_per_epoch)}
    recorders[plan.steps_per_epoch] = ["a"]  # epoch 1 began: epoch 0 is complete
    present = [step for step, members in recorders.items() if members and step < plan.steps_per_epoch]
    assume(present)  # an epoch without a single record is not in the audit at all
    with tempfile.TemporaryDirectory() as name:
        record_steps(Path(name), plan, recorders)
        report = audit_directory(name)
    first = report.epochs[0]
    every_step = len(present) == plan.steps_per_epoch
    assert first.complete and first.coverage.exactly_once == every_step and report.ok == every_step
    assert not report.disagreements and not first.coverage.duplicates
    assert first.rank_batches == ({(QUORUM, None): len(present)} if present else {})
    assert first.coverage.consumed == sum(step_positions(plan, step).size for step in present)


@settings(max_examples=40, deadline=None)
@given(plans().filter(lambda plan: plan.steps_per_epoch > 1), st.data())
def test_members_recording_one_step_differently_is_a_violation_naming_the_step_and_members(
    plan: EpochPlan, data: st.DataObject
) -> None:
    odd_step = data.draw(st.integers(0, plan.steps_per_epoch - 1), label="odd step")
    odd_member = data.draw(st.sampled_from(MEMBERS), label="odd member")
    with tempfile.TemporaryDirectory() as name:
        record_steps(Path(name), plan, {step: list(MEMBERS) for step in range(plan.steps_per_epoch)})
        with StepAuditWriter(name, odd_member) as writer:  # its record of the step also names the next step's
            other = (odd_step + 1) % plan.steps_per_epoch
            wrong = np.concatenate([step_positions(plan, odd_step), step_positions(plan, other)[:1]])
            writer.write(plan, 0, odd_step, wrong)
        report = audit_directory(name)
        result = CliRunner().invoke(audit_command, [name])
    (disagreement,) = report.disagreements
    assert (disagreement.epoch, disagreement.step) == (0, odd_step)
    assert disagreement.versions == [MEMBERS, (odd_member,)]  # the agreeing majority first
    assert not report.ok and report.epochs[0].coverage.exactly_once  # the majority's record is counted
    assert result.exit_code == 1, result.output
    assert f"epoch 0 step {odd_step}: members a, b, c, d | {odd_member} recorded different samples" in result.output


def test_records_hold_the_whole_step_sorted_and_the_plan_goes_to_audit_json(tmp_path: Path) -> None:
    plan = EpochPlan(20, 8, seed=3)
    with StepAuditWriter(tmp_path, "node-1:0") as writer:
        writer.write(plan, 0, 0, step_positions(plan, 0)[::-1])
    (line,) = (tmp_path / "steps-node-1:0.jsonl").read_text().splitlines()
    assert json.loads(line) == {
        "epoch": 0,
        "step": 0,
        "member": "node-1:0",
        "indices": sorted(plan.indices(0, 0, 8).tolist()),
    }
    assert json.loads((tmp_path / "audit.json").read_text()) == {"plan": plan.to_dict()}
    with StepAuditWriter(tmp_path, "other") as writer, pytest.raises(ValueError, match="conflicts with the spec"):
        writer.write(EpochPlan(20, 8, seed=4), 0, 0, [0])


def test_a_torn_last_line_is_skipped_and_cut_when_the_member_writes_again(tmp_path: Path) -> None:
    plan = EpochPlan(12, 4, shuffle=False)
    record_steps(tmp_path, plan, {0: ["a", "b"], 1: ["a", "b"]})
    path = tmp_path / "steps-b.jsonl"
    with path.open("a") as file:
        file.write('{"epoch":0,"step":2,"member":"b","ind')  # b was killed writing step 2
    report = audit_directory(tmp_path)
    assert report.torn_lines == 1 and report.ok and report.epochs[0].coverage.consumed == 8
    with StepAuditWriter(tmp_path, "b") as writer:  # b restarted
        writer.write(plan, 0, 2, step_positions(plan, 2))
    report = audit_directory(tmp_path)
    assert report.torn_lines == 0 and report.ok and report.epochs[0].coverage.exactly_once


def test_a_record_in_another_members_file_is_unreadable(tmp_path: Path) -> None:
    plan = EpochPlan(12, 4, shuffle=False)
    record_steps(tmp_path, plan, {0: ["a"]})
    (tmp_path / "steps-b.jsonl").write_text('{"epoch":0,"step":1,"member":"a","indices":[4,5,6,7]}\n')
    with pytest.raises(AuditFileError, match=r"steps-b.jsonl:1: member 'a' in a file of member 'b'"):
        audit_directory(tmp_path)
    assert CliRunner().invoke(audit_command, [str(tmp_path)]).exit_code == 2


def test_rank_and_step_records_share_a_directory(tmp_path: Path) -> None:
    plan = EpochPlan(12, 4, shuffle=False)
    record_steps(tmp_path, plan, {0: ["a", "b"], 1: ["b"]})
    with AuditWriter(tmp_path, 0, world_size=1) as writer:
        writer.write(0, 2, plan.indices(0, 8, 12))
    (epoch,) = audit_directory(tmp_path).epochs
    assert epoch.coverage.exactly_once
    assert [str(consumer) for consumer in epoch.rank_batches] == ["0 of 1", QUORUM]
    assert list(epoch.rank_batches.values()) == [1, 2]


@pytest.mark.parametrize(
    ("audit_dir", "error", "match"),
    [(3, TypeError, "Checks.audit_dir must be a directory path or None, got 3"), ("", TypeError, "got ''")],
)
def test_checks_audit_dir_is_validated(audit_dir: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Checks(audit_dir=audit_dir)  # type: ignore[arg-type]


def test_checks_audit_dir_must_not_be_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match=r"Checks.audit_dir must be a directory, got the file '.*/f'"):
        Checks(audit_dir=tmp_path / "f")
    with pytest.raises(ValueError, match=r"member must be a non-empty name without '/'"):
        StepAuditWriter(tmp_path, "a/b")

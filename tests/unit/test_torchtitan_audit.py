"""The torchtitan audit's arithmetic: which batches count as trained, and samples lost or trained twice against a
failure-free run; and the step lines read back from a torchtitan log."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.testing.torchtitan_audit import (
    AUDIT_LABEL_ENV,
    Audit,
    Batch,
    data_outcome,
    finish,
    held,
    read_audit,
    wait_at_hold,
)
from stalwart.testing.torchtitan_log import losses_by_step, step_records


def batch(label: str, pid: int, step: int, *samples: str) -> Batch:
    return Batch(label, pid, step, float(step), samples)


def test_the_step_in_flight_of_a_killed_process_is_not_trained() -> None:
    audit = Audit(
        (
            batch("A", 1, 1, "a1"), batch("A", 1, 2, "a2"), batch("A", 1, 3, "a3"),
            batch("B", 2, 1, "b1"), batch("B", 2, 2, "b2"),  # killed during step 2
            batch("B", 3, 2, "b2"), batch("B", 3, 3, "b3"),  # relaunched, finished
        ),
        frozenset({("A", 1), ("B", 3)}),
    )  # fmt: skip
    assert [(b.label, b.pid, b.step) for b in audit.trained()] == [
        ("A", 1, 1), ("A", 1, 2), ("A", 1, 3), ("B", 2, 1), ("B", 3, 2), ("B", 3, 3),
    ]  # fmt: skip
    reference = Audit(
        (batch("A", 7, 1, "a1"), batch("A", 7, 2, "a2"), batch("A", 7, 3, "a3"), batch("B", 8, 1, "b1"),
         batch("B", 8, 2, "b2"), batch("B", 8, 3, "b3")),
        frozenset({("A", 7), ("B", 8)}),
    )  # fmt: skip
    assert data_outcome(reference, audit).lost == 0
    assert data_outcome(reference, audit).trained_twice == 0


def test_a_restart_from_the_start_trains_twice_and_a_short_run_loses() -> None:
    reference = Audit((batch("A", 1, 1, "x", "y"), batch("A", 1, 2, "z", "w")), frozenset({("A", 1)}))
    replayed = Audit(
        (batch("A", 2, 1, "x", "y"), batch("A", 2, 2, "z", "w"), batch("A", 3, 1, "x", "y")),
        frozenset({("A", 2), ("A", 3)}),
    )
    assert (data_outcome(reference, replayed).lost, data_outcome(reference, replayed).trained_twice) == (0, 2)
    unfinished = Audit((batch("A", 4, 1, "x", "y"), batch("A", 4, 2, "z", "w")), frozenset())
    assert (data_outcome(reference, unfinished).lost, data_outcome(reference, unfinished).trained_twice) == (2, 0)


def test_audit_files_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AUDIT_LABEL_ENV, "group-b")
    (tmp_path / "group-b-41.jsonl").write_text('{"step": 1, "time": 5.0, "samples": ["s"]}\n\n')
    finish(tmp_path)
    audit = read_audit(tmp_path)
    assert audit.batches == (Batch("group-b", 41, 1, 5.0, ("s",)),)
    assert len(audit.finished) == 1


def test_step_lines_are_read_with_or_without_colours() -> None:
    log = (
        "[titan] 2026-12-06 10:16:21,486 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss:  8.18734  "
        "\x1b[38;2;180;60;0mgrad_norm:  0.8617  \x1b[34mtps: 200\n"
        "[titan] 2026-12-06 10:16:22,089 - root - INFO - step:  2  loss:  8.00484  grad_norm:  0.8725  tps: 425\n"
        "[titan] 2026-12-06 10:16:23,000 - root - INFO - validate step:  2  loss:  9.0\n"
    )
    assert [(r.step, r.loss, r.grad_norm) for r in step_records(log)] == [(1, 8.18734, 0.8617), (2, 8.00484, 0.8725)]
    assert losses_by_step(log) == {1: 8.18734, 2: 8.00484}


def test_a_hold_keeps_back_only_the_steps_above_it_while_it_exists(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    assert not held(hold, 10)
    hold.write_text("4")
    assert [held(hold, step) for step in (3, 4, 5)] == [False, False, True]
    wait_at_hold(hold, 4)  # returns at once: step 4 is not held
    hold.unlink()
    assert not held(hold, 5)

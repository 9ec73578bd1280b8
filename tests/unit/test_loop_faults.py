"""The instrumented loop's faults: which points exist, which Manager events reach them, and the corruption."""

from __future__ import annotations

import argparse

import pytest
import torch

from stalwart.launch.loop import KILL_POINTS, MANAGER_EVENTS, Faults, parse_kill_at
from stalwart.runtime.events import Event


def test_kill_at_parses_step_and_point_and_names_what_is_allowed() -> None:
    assert parse_kill_at("3:during_gather") == (3, "during_gather")
    assert parse_kill_at(None) is None
    for text in ("3", "x:before_forward", "-1:before_forward", "2:during_lunch"):
        with pytest.raises(argparse.ArgumentTypeError, match="--kill-at must be STEP:POINT") as error:
            parse_kill_at(text)
        assert repr(text) in str(error.value) and "before_forward" in str(error.value)


def test_a_fault_at_an_unknown_point_is_refused() -> None:
    with pytest.raises(ValueError, match="'during_lunch'"):
        Faults(kill_at=(1, "during_lunch"))


def test_the_kill_points_name_events_the_manager_sends() -> None:
    # A kill point keyed by a renamed or removed event would never fire: the kill test would pass without a kill.
    assert all(isinstance(event, Event) and Event(event.value) is event for event in MANAGER_EVENTS)
    assert set(MANAGER_EVENTS.values()) <= set(KILL_POINTS)
    assert len(set(MANAGER_EVENTS.values())) == len(MANAGER_EVENTS)


def test_every_manager_event_that_is_a_point_is_reported_and_no_other() -> None:
    faults = Faults(kill_at=(5, "during_reduce"))  # another step: nothing is killed here
    assert all(faults.manager_event(event, 4) for event in MANAGER_EVENTS)
    assert not any(faults.manager_event(event, 5) for event in ("joined", "healed", "finished"))


def test_corruption_changes_the_parameters_once_at_its_step() -> None:
    model = torch.nn.Linear(3, 2)
    before = [param.detach().clone() for param in model.parameters()]
    faults = Faults(corrupt_at=2)
    faults.corrupt(model, 1)
    assert all(torch.equal(param, old) for param, old in zip(model.parameters(), before, strict=True))
    faults.corrupt(model, 2)
    changed = [param.detach().clone() for param in model.parameters()]
    assert all(not torch.equal(param, old) for param, old in zip(changed, before, strict=True))
    faults.corrupt(model, 2)  # once only
    assert all(torch.equal(param, old) for param, old in zip(model.parameters(), changed, strict=True))

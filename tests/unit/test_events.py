"""The Manager's events: one ``str`` enum, names accepted where users write them, and the hook's filter."""

from __future__ import annotations

import json

import pytest

from stalwart.runtime.events import Event, EventHook, check_events


def test_events_are_their_names_to_user_code() -> None:
    assert Event.JOINED == "joined" and str(Event.JOINED) == "joined" and f"{Event.HEALED}" == "healed"
    assert json.dumps({"event": Event.OUTER_STARTED}) == '{"event": "outer_started"}'
    assert check_events(None) is None
    assert check_events(["joined", Event.REDUCE_FINISHED]) == {Event.JOINED, Event.REDUCE_FINISHED}


def test_an_unknown_event_name_is_refused_naming_it_and_the_kinds() -> None:
    with pytest.raises(ValueError, match=r"events names unknown kinds \['commited'\]; the kinds are \[.*'joined'"):
        check_events({"joined", "commited"})
    with pytest.raises(TypeError, match="events must be a collection"):
        check_events("joined")


def test_the_hook_is_told_the_wanted_events_at_the_current_step_unless_one_is_given() -> None:
    told: list[tuple[Event, int]] = []
    step = 7
    hook = EventHook(lambda event, at: told.append((event, at)), check_events(["joined", "healed"]), lambda: step)
    hook.notify(Event.JOINED)
    hook.notify(Event.REDUCE_STARTED)  # not wanted
    hook.notify(Event.HEALED, 3)
    assert told == [(Event.JOINED, 7), (Event.HEALED, 3)]
    everything = EventHook(lambda event, at: told.append((event, at)), None, lambda: step)
    everything.notify(Event.OUTER_STARTED)
    assert told[-1] == (Event.OUTER_STARTED, 7)
    EventHook(None, None, lambda: step).notify(Event.JOINED)  # no hook: nothing to tell

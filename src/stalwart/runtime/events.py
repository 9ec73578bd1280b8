"""The events a Manager tells its ``on_event`` hook: one enum, so that a rename breaks its users loudly.

The failure tests kill a worker at these points (``stalwart.launch.loop``'s
kill points map events to points); a name matched by string would silently
stop matching when renamed. ``Event`` is a ``str`` enum: a user's hook that
compares ``event == "joined"`` and an ``events=("joined",)`` filter keep
working, and ``str(event)`` is the name the event logs write.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection


class Event(str, enum.Enum):
    """A point of a member's life or of a step that ``on_event(event, step)`` is told about."""

    JOINED = "joined"
    """This member is in a new quorum, connected and healed."""
    HEALED = "healed"
    """This member loaded a peer's state or a checkpoint."""
    REDUCE_STARTED = "reduce_started"
    REDUCE_FINISHED = "reduce_finished"
    UPDATE_STARTED = "update_started"
    """Before a sharded update (``redundancy``)."""
    GATHER_STARTED = "gather_started"
    PARITY_STARTED = "parity_started"
    QUORUM_BROKEN = "quorum_broken"
    """DiLoCo: an inner step saw another group die."""
    EXCHANGE_STARTED = "exchange_started"
    """DiLoCo: a fragment's exchange across groups starts."""
    OUTER_STARTED = "outer_started"
    """DiLoCo: the round's end (its exchanges, tail and outer step) starts."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


Notify = Callable[[Event], None]
"""Tells the hook that an event happened in the current step."""


def check_events(events: Collection[str] | None) -> frozenset[Event] | None:
    """``events`` as a set of :class:`Event` (None: every kind); else an error naming the unknown ones."""
    if events is None:
        return None
    if isinstance(events, str) or not isinstance(events, Collection):
        raise TypeError(f"events must be a collection of event kinds or None, got {events!r:.80}")
    known = {event.value for event in Event}
    unknown = sorted(str(event) for event in events if event not in known)
    if unknown:
        raise ValueError(f"events names unknown kinds {unknown}; the kinds are {sorted(known)}")
    return frozenset(Event(event) for event in events)


class EventHook:
    """The user's ``on_event(event, step)``, told the events ``wanted`` lets through (None: all), for every part."""

    def __init__(
        self, on_event: Callable[[Event, int], None] | None, wanted: frozenset[Event] | None, step: Callable[[], int]
    ) -> None:
        self._on_event = on_event
        self._wanted = wanted
        self._step = step

    def notify(self, event: Event, step: int | None = None) -> None:
        """Tell the hook that ``event`` happened in ``step`` (default: the ledger's current step)."""
        if self._on_event is not None and (self._wanted is None or event in self._wanted):
            self._on_event(event, self._step() if step is None else step)

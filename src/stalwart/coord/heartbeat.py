"""One heartbeat message as the lighthouse reads it: JSON text in, a checked report and the refusals out.

Each field has its own parser, which checks every number it carries (the
right type, finite, in ``[0, 2**62]`` or its field's range) and names the
field and the value when it refuses: ``applied_step``, ``digest`` and
``weights`` (:mod:`~stalwart.coord.wire`), ``heal``
(:mod:`~stalwart.coord.heal_report`, counted by the metrics) and ``rounds``
(:mod:`~stalwart.coord.rounds`). A malformed ``heal`` or ``rounds`` is dropped
and the heartbeat still counts; anything else malformed refuses the heartbeat.
Whatever the text, reading it raises nothing (``tests/unit/test_heartbeat.py``
property-tests it over arbitrary JSON): a number of 400 digits is a refusal,
never an ``OverflowError`` on the event loop. No I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from stalwart.coord.metrics import LighthouseMetrics
from stalwart.coord.rounds import RoundsBoard
from stalwart.coord.wire import RequestError, parse_report


@dataclass(frozen=True)
class HeartbeatReading:
    """What one heartbeat says: the report (None when it is refused) and the error texts to send back."""

    applied_step: int | None
    digest: str | None
    weights: dict[str, Any] | None
    errors: tuple[str, ...]


def read_heartbeat(
    text: str, member: str, incarnation: str | None, metrics: LighthouseMetrics, rounds: RoundsBoard
) -> HeartbeatReading:
    """Parse heartbeat ``text`` of ``member``'s ``incarnation``, counting its heal and rounds figures."""
    errors: list[str] = []
    try:
        report = json.loads(text)
    except (ValueError, RecursionError) as error:
        return HeartbeatReading(None, None, None, (f"not JSON: {error}",))
    for note in (metrics.take_heal_report(member, incarnation, report), rounds.take(member, incarnation, report)):
        if note is not None:
            errors.append(note)
    try:
        applied_step, digest, weights = parse_report(report)
    except RequestError as error:
        return HeartbeatReading(None, None, None, (*errors, error.message))
    return HeartbeatReading(applied_step, digest, weights, tuple(errors))

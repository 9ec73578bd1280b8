"""What the lighthouse knows of DiLoCo rounds: each member's round figures, for the status, dashboard and metrics.

A member training with ``sync=DiLoCo(...)`` sends in every heartbeat
``"rounds": {"inner_steps": H, "fragments": F, "inner_step": int,
"in_flight": int, "bytes": int, "exchanges": int}``: the round's shape, the
inner step it is at in the round in progress, its fragment exchanges launched
and not applied, and its running totals of bytes sent to other groups and of
exchanges. A step of the ledger is then a round (the quorums form at outer
boundaries by themselves: the ledger's steps are the rounds), so the figures
need no state of their own: the board keeps each member's latest report
(with the incarnation that sent it), and counts the bytes a report adds to
the same incarnation's last one, so a lost or repeated heartbeat neither
loses nor doubles any. Not persisted: a restarted lighthouse learns them from
the next heartbeats. Pure but for the Prometheus metrics it feeds.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from stalwart.coord.wire import RequestError, parse_count, take_field

logger = logging.getLogger(__name__)

ROUNDS_FIELD = "rounds"
"""The heartbeat field that carries :class:`RoundsReport`."""
_FIELDS = ("inner_steps", "fragments", "inner_step", "in_flight", "bytes", "exchanges")


@dataclass(frozen=True)
class RoundsReport:
    """One member's round figures (see the module docstring)."""

    inner_steps: int
    fragments: int
    inner_step: int
    in_flight: int
    bytes: int
    exchanges: int

    def to_json(self) -> dict[str, int]:
        return asdict(self)


def parse_rounds_report(value: Any) -> RoundsReport:
    """The ``rounds`` field of a heartbeat; ``RequestError`` 400 naming the field and the value otherwise."""
    if not isinstance(value, Mapping) or set(value) != set(_FIELDS):
        raise RequestError(
            400, f"rounds must be an object of the fields {list(_FIELDS)}, got {value!r:.200}", field="rounds"
        )
    least = {"inner_steps": 1, "fragments": 1}
    return RoundsReport(**{name: parse_count(value[name], f"rounds['{name}']", least.get(name, 0)) for name in _FIELDS})


class RoundsBoard:
    """Each member's latest round figures; the ``rounds`` part of the status, and ``stalwart_*`` round metrics."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._reports: dict[str, tuple[str | None, RoundsReport]] = {}
        self._earlier_bytes: dict[str, int] = {}
        """Bytes earlier incarnations of each member sent (their last reports)."""
        self.bytes_exchanged = Counter(
            "stalwart_bytes_exchanged", "Bytes members sent to other groups in DiLoCo exchanges.", registry=registry
        )
        self.exchanges = Counter(
            "stalwart_exchanges", "DiLoCo fragment exchanges members took part in.", registry=registry
        )
        self.fragments_in_flight = Gauge(
            "stalwart_fragments_in_flight", "DiLoCo fragment exchanges launched and not applied.", registry=registry
        )
        self.inner_steps = Gauge("stalwart_inner_steps", "DiLoCo inner steps a round has (0: every-step mode).",
                                 registry=registry)  # fmt: skip
        self.rounds_committed = Gauge(
            "stalwart_rounds_committed", "DiLoCo rounds (outer steps) committed.", registry=registry
        )

    def take(self, member: str, incarnation: str | None, report: Any) -> str | None:
        """Remove a heartbeat's ``rounds`` field from ``report`` and record it; the error text if malformed.

        A malformed field is dropped (the heartbeat itself still counts) and logged.
        """
        rounds, error = take_field(report, ROUNDS_FIELD, parse_rounds_report, member, logger)
        if rounds is None:
            return error
        previous = self._reports.get(member)
        before = previous[1] if previous is not None and previous[0] == incarnation else None
        if previous is not None and before is None:  # a new incarnation: the old one's bytes stay counted
            self._earlier_bytes[member] = self._earlier_bytes.get(member, 0) + previous[1].bytes
        if before is None or (rounds.bytes >= before.bytes and rounds.exchanges >= before.exchanges):
            self.bytes_exchanged.inc(rounds.bytes - (before.bytes if before else 0))
            self.exchanges.inc(rounds.exchanges - (before.exchanges if before else 0))
            self._reports[member] = (incarnation, rounds)
        return None

    def to_status(self, status: Mapping[str, Any]) -> dict[str, Any] | None:
        """The ``rounds`` part of ``/v1/status`` (None when no member trains in rounds); ``status``: the rest of it.

        Members are the current quorum's; totals are over every member that
        reported (dead ones' bytes were sent too).
        """
        if not self._reports:
            return None
        quorum = status.get("quorum")
        members = [] if quorum is None else list(quorum["members"])
        shapes = {(report.inner_steps, report.fragments) for _, report in self._reports.values()}
        inner_steps, fragments = max(shapes)
        current = {member: self._reports[member][1] for member in members if member in self._reports}
        in_flight = sum(report.in_flight for report in current.values())
        committed = int(status["ledger"]["step"])
        self.inner_steps.set(inner_steps)
        self.rounds_committed.set(committed)
        self.fragments_in_flight.set(in_flight)
        return {
            "inner_steps": inner_steps,
            "fragments": fragments,
            "rounds_committed": committed,
            "fragments_in_flight": in_flight,
            "bytes_exchanged": sum(report.bytes for _, report in self._reports.values())
            + sum(self._earlier_bytes.values()),
            "exchanges": sum(report.exchanges for _, report in self._reports.values()),
            "members": {member: report.to_json() for member, report in current.items()},
        }

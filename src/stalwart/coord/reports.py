"""What a member reports to the lighthouse: its applied step (with the ledger digest and weights), the heals it
loaded and DiLoCo's round figures. Pure: no I/O.

The worker's callable (``LighthouseClient.start_heartbeat``) is asked on the
client's thread each time a heartbeat goes; quorum requests and ``leave`` for
the same step carry the same digest and weights (:meth:`MemberReport.at`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stalwart.coord.heal_report import HealTotals
from stalwart.coord.protocol import heartbeat_message

Report = int | tuple[int, str | None] | tuple[int, str | None, dict[str, Any] | None]
"""What ``start_heartbeat``'s callable returns: ``applied_step``, or ``(applied_step, ledger digest or None)``,
or ``(applied_step, digest, weights record or None)`` (a balanced ledger's ``weights_record()``)."""


class MemberReport:
    """The member's report: ``applied_step`` (set by the heartbeat's start), ``heals`` and ``rounds``."""

    def __init__(self) -> None:
        self.applied_step: Callable[[], Report] | None = None
        """The worker's callable (None until the heartbeat starts)."""
        self.heals = HealTotals()
        """The heals this worker loaded."""
        self.rounds: Callable[[], dict[str, Any]] | None = None
        """DiLoCo's figures, each heartbeat's ``rounds`` field (None: none)."""

    def step(self) -> dict[str, Any]:
        """The callable's report as a message: ``applied_step``, and ``digest`` and ``weights`` if set."""
        assert self.applied_step is not None
        report = self.applied_step()
        step, digest, weights = (*report, None, None)[:3] if isinstance(report, tuple) else (report, None, None)
        return heartbeat_message(step, digest, weights)

    def at(self, applied_step: int) -> dict[str, Any]:
        """The reported ``digest`` and ``weights`` when the heartbeat reports ``applied_step`` too, else nothing."""
        if self.applied_step is None:
            return {}
        message = self.step()
        if message.pop("applied_step") != applied_step:
            return {}
        return message

    def message(self) -> dict[str, Any]:
        """A heartbeat: the report, with the heal totals and DiLoCo's rounds when there are any."""
        message = self.step()
        heal = self.heals
        rounds = None if self.rounds is None else self.rounds()
        if heal.heals or rounds is not None:
            message = heartbeat_message(
                message["applied_step"],
                message.get("digest"),
                message.get("weights"),
                heal.to_json() if heal.heals else None,
                rounds,
            )
        return message

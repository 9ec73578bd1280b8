"""Heal figures a worker reports in its heartbeats: how many heals it loaded, their bytes and seconds.

A member sends its running totals, ``"heal": {"heals": int, "bytes": int,
"seconds": float}``, in every heartbeat once it has been healed; the
lighthouse counts the growth since the last totals of the same incarnation, so
a lost or repeated heartbeat neither loses nor doubles a heal. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stalwart.coord.wire import MAX_WIRE_INT, RequestError, parse_count

HEAL_FIELD = "heal"
"""The heartbeat field that carries :class:`HealTotals`."""


@dataclass(frozen=True)
class HealTotals:
    """Running totals of the heals one incarnation loaded: count, bytes of state loaded, seconds spent."""

    heals: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, nbytes: int, seconds: float) -> HealTotals:
        """The totals after one more heal of ``nbytes`` bytes that took ``seconds``."""
        return HealTotals(self.heals + 1, self.bytes + nbytes, self.seconds + seconds)

    def to_json(self) -> dict[str, Any]:
        """The heartbeat's ``heal`` value."""
        return {"heals": self.heals, "bytes": self.bytes, "seconds": self.seconds}


def parse_heal_totals(value: Any) -> HealTotals:
    """Return the ``heal`` field of a heartbeat; ``RequestError`` 400 naming the field and the value otherwise."""
    if not isinstance(value, Mapping) or set(value) != {"heals", "bytes", "seconds"}:
        raise RequestError(
            400, f'heal must be {{"heals": int, "bytes": int, "seconds": float}}, got {value!r:.200}', field="heal"
        )
    heals, nbytes = (parse_count(value[name], f"heal['{name}']") for name in ("heals", "bytes"))
    seconds = value["seconds"]
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 <= seconds <= MAX_WIRE_INT:
        raise RequestError(400, f"heal['seconds'] must be a finite number in [0, 2**62], got {seconds!r:.60}",
                           field="heal['seconds']")  # fmt: skip
    return HealTotals(heals, nbytes, float(seconds))


def heal_growth(previous: HealTotals | None, current: HealTotals) -> HealTotals | None:
    """What ``current`` adds to ``previous`` (the same incarnation's last totals), or None if nothing new.

    Totals that went down (a report out of order) add nothing.
    """
    before = previous or HealTotals()
    if current.heals <= before.heals or current.bytes < before.bytes or current.seconds < before.seconds:
        return None
    return HealTotals(current.heals - before.heals, current.bytes - before.bytes, current.seconds - before.seconds)

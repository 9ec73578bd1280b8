"""The redundancy of sharded optimizer state, chosen per run: an overlap fraction or ``(k, m)`` parity.

Both split the state into one shard per process (process ``p`` is the primary
of shard ``p``) and add redundant units that let a shard outlive its primary:

- :class:`Overlap`: each shard is also held, whole, by ``copies(N)`` other
  processes, ``round(overlap * N)`` with halves rounded up, capped at
  ``N - 1``. Overlap 0 is plain sharding (ZeRO), 1 is full replication (DDP).
- :class:`Parity`: each shard is cut into ``k`` cells; groups of ``k`` cells
  from ``k`` processes get ``m`` parity cells on ``m`` further processes
  (``m = 1`` like RAID-5, ``m = 2`` like RAID-6).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from stalwart._validate import check_int


@dataclass(frozen=True)
class Overlap:
    """Each shard also held whole by ``round(fraction * N)`` other processes (capped at ``N - 1``)."""

    fraction: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "fraction", _check_fraction(self.fraction))

    def copies(self, processes: int) -> int:
        """Copies of each shard besides its primary's, for a world of ``processes``."""
        processes = check_int("processes", processes, minimum=1)
        return min(math.floor(self.fraction * processes + 0.5), processes - 1)

    def __str__(self) -> str:
        return f"overlap {self.fraction:g}"


@dataclass(frozen=True)
class Parity:
    """Groups of ``k`` data cells plus ``m`` parity cells, each on its own process; any ``m`` of them can be lost."""

    k: int
    m: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "k", check_int("parity k", self.k, minimum=1))
        object.__setattr__(self, "m", check_int("parity m", self.m, minimum=1))

    def check_processes(self, processes: int) -> int:
        """Return ``processes`` if a group's ``k + m`` cells fit on distinct processes, else raise ``ValueError``."""
        processes = check_int("processes", processes, minimum=1)
        if self.k + self.m > processes:
            raise ValueError(
                f"parity k + m must be at most the number of processes ({processes}), "
                f"got {self.k} + {self.m} = {self.k + self.m}"
            )
        return processes

    def __str__(self) -> str:
        return f"parity ({self.k}, {self.m})"


Redundancy = Overlap | Parity
"""The redundancy of a run: an :class:`Overlap` or a :class:`Parity`."""


def parse_parity(text: str) -> Parity:
    """``"7,1"`` -> ``Parity(7, 1)``; a malformed text raises ``ValueError`` naming it."""
    parts = text.split(",")
    try:
        k, m = (int(part.strip()) for part in parts)
    except ValueError:
        raise ValueError(f"parity must be two integers K,M such as 7,1, got {text!r}") from None
    return Parity(k, m)


def _check_fraction(value: Any) -> float:
    """``value`` as a float in [0, 1], else ``TypeError``/``ValueError`` naming overlap."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"overlap must be a number, got {value!r} ({type(value).__name__})")
    fraction = float(value)
    if not 0.0 <= fraction <= 1.0:  # NaN fails too
        raise ValueError(f"overlap must be in [0, 1], got {value!r}")
    return fraction


REDUNDANCY_FORMS = "'overlap:F' (F in [0, 1], e.g. 'overlap:0.5') or 'parity:K,M' (e.g. 'parity:2,1')"
"""The text forms :func:`parse_redundancy` takes (what a config system that passes only literals can say)."""


def parse_redundancy(value: Redundancy | str | None) -> Redundancy | None:
    """An :class:`Overlap` or :class:`Parity` given as itself or as text (``"overlap:0.5"``, ``"parity:2,1"``); None
    stays None. Anything else raises ``ValueError`` (``TypeError`` for another type) naming ``redundancy``, the
    value and the forms allowed."""
    if value is None or isinstance(value, Overlap | Parity):
        return value
    if not isinstance(value, str):
        raise TypeError(
            f"redundancy must be Overlap(...), Parity(...), a string {REDUNDANCY_FORMS} or None, got {value!r}"
        )
    kind, separator, argument = value.strip().partition(":")
    try:
        if separator and kind.strip().lower() == "overlap":
            return Overlap(float(argument))
        if separator and kind.strip().lower() == "parity":
            return parse_parity(argument)
    except ValueError as error:
        raise ValueError(f"redundancy={value!r}: {error}") from None
    raise ValueError(f"redundancy must be {REDUNDANCY_FORMS}, got {value!r}")

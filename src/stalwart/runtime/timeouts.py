"""Timeouts that fit the work: rendezvous, collectives and heals each get their own.

Each is resolved in this order: the Manager's argument, else its environment
variable, else the default:

==========================  ===============================  =========
Manager argument            environment variable             default
==========================  ===============================  =========
``rendezvous_timeout``      ``STALWART_RENDEZVOUS_TIMEOUT``  10 s
``collective_timeout``      ``STALWART_COLLECTIVE_TIMEOUT``  2 s
``heal_timeout``            ``STALWART_HEAL_TIMEOUT``        30 s
``heal_min_bandwidth``      ``STALWART_HEAL_MIN_BANDWIDTH``  50e6 B/s
``quorum_timeout``          ``STALWART_QUORUM_TIMEOUT``      120 s
``connect_timeout``         ``STALWART_CONNECT_TIMEOUT``     60 s
``leader_timeout``          ``STALWART_LEADER_TIMEOUT``      3600 s
==========================  ===============================  =========

A heal's deadline grows with what it moves: ``heal_timeout + bytes /
heal_min_bandwidth``. A rendezvous (building a quorum's process group) can
wait on peers that are still starting; a collective of a live quorum should
end in well under a second, so its timeout decides how fast a hung peer is
given up. ``quorum_timeout`` bounds one wait for the lighthouse's next quorum,
``connect_timeout`` the wait for the lighthouse to answer at start-up, and
``leader_timeout`` how long the other processes wait while the leader runs
:meth:`~stalwart.runtime.manager.Manager.on_leader` work (an evaluation): they
stop waiting at once if the leader dies, so it only bounds a leader that
hangs. An error that gives up on one of them names it and its variable.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stalwart.runtime.heal import DEFAULT_HEAL_TIMEOUT, DEFAULT_MIN_BANDWIDTH

DEFAULT_RENDEZVOUS_TIMEOUT = 10.0
DEFAULT_COLLECTIVE_TIMEOUT = 2.0
ENVIRONMENT = {
    "rendezvous_timeout": "STALWART_RENDEZVOUS_TIMEOUT",
    "collective_timeout": "STALWART_COLLECTIVE_TIMEOUT",
    "heal_timeout": "STALWART_HEAL_TIMEOUT",
    "heal_min_bandwidth": "STALWART_HEAL_MIN_BANDWIDTH",
    "quorum_timeout": "STALWART_QUORUM_TIMEOUT",
    "connect_timeout": "STALWART_CONNECT_TIMEOUT",
    "leader_timeout": "STALWART_LEADER_TIMEOUT",
}
DEFAULTS = {
    "rendezvous_timeout": DEFAULT_RENDEZVOUS_TIMEOUT,
    "collective_timeout": DEFAULT_COLLECTIVE_TIMEOUT,
    "heal_timeout": DEFAULT_HEAL_TIMEOUT,
    "heal_min_bandwidth": DEFAULT_MIN_BANDWIDTH,
    "quorum_timeout": 120.0,
    "connect_timeout": 60.0,
    "leader_timeout": 3600.0,
}


@dataclass(frozen=True)
class Timeouts:
    """The resolved timeouts (seconds) and the heal's assumed minimum bandwidth (bytes per second)."""

    rendezvous_timeout: float
    collective_timeout: float
    heal_timeout: float
    heal_min_bandwidth: float
    quorum_timeout: float
    connect_timeout: float
    leader_timeout: float

    @classmethod
    def resolve(cls, environ: Mapping[str, str] | None = None, **arguments: float | None) -> Timeouts:
        """Each value from ``arguments`` (not None), else ``environ`` (default ``os.environ``), else the default."""
        unknown = set(arguments) - set(DEFAULTS)
        if unknown:
            raise TypeError(f"unknown timeouts {sorted(unknown)}; known: {sorted(DEFAULTS)}")
        env = os.environ if environ is None else environ
        return cls(**{name: resolve_positive(name, arguments.get(name), env) for name in DEFAULTS})

    def describe(self, name: str) -> str:
        """``name=value s (ENVIRONMENT_VARIABLE)``, for the message of an error that gave up on it."""
        return f"{name}={getattr(self, name):g} s (environment variable {ENVIRONMENT[name]})"


def resolve_positive(name: str, argument: Any, environ: Mapping[str, str]) -> float:
    """``argument`` if given, else the value of ``name``'s environment variable, else its default; all > 0."""
    variable = ENVIRONMENT[name]
    if argument is not None:
        if isinstance(argument, bool) or not isinstance(argument, (int, float)) or not _positive(float(argument)):
            raise ValueError(f"{name} must be a positive finite number, got {argument!r}")
        return float(argument)
    raw = environ.get(variable)
    if raw is None or not raw.strip():
        return DEFAULTS[name]
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not _positive(value):
        raise ValueError(f"environment variable {variable}={raw!r} must be a positive finite number ({name})")
    return value


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0

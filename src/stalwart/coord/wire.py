"""What the lighthouse accepts on the wire, field by field: ids, steps, digests, weights, plans, heartbeats, checked.

The messages these make up are typed in :mod:`~stalwart.coord.protocol`.

Every parser raises :class:`RequestError` naming the field, the value and what
is allowed; the server turns it into a 4xx JSON answer and changes nothing.
Pure: no I/O.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any, TypeVar

from stalwart.data.plan import EpochPlan
from stalwart.errors import StalwartError

REASONS = ("join", "failure", "reconfigure")
PLAN_FIELDS = tuple(f.name for f in fields(EpochPlan))
"""The fields of a plan on the wire: ``EpochPlan``'s, as ``EpochPlan.to_dict()`` writes them."""
MAX_WIRE_INT = 1 << 62
"""Largest integer any count on the wire may hold (a step, a weight, a heal's bytes): an int64 with room to add,
and a float without overflow."""
MAX_PLAN_INT = MAX_WIRE_INT
"""Largest integer a plan field may hold on the wire (positions are int64 in the ledger)."""
_MEMBER_PATTERN = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")
_DIGEST_PATTERN = re.compile(r"[0-9a-f]{32}")


class RequestError(StalwartError, ValueError):
    """A request the lighthouse refuses: ``status`` is the HTTP status, ``details`` go into the JSON body
    (``headers`` into the answer's headers)."""

    def __init__(self, status: int, message: str, *, headers: dict[str, str] | None = None, **details: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers
        self.details = details

    def to_json(self) -> dict[str, Any]:
        """The JSON error body: ``{"error": message, **details}``."""
        return {"error": self.message, **self.details}


def parse_member(value: Any, name: str = "member") -> str:
    """Return a member id: 1-128 characters of ``[A-Za-z0-9_.:@-]``; else ``RequestError`` 400 naming it."""
    if not isinstance(value, str) or not _MEMBER_PATTERN.fullmatch(value):
        raise RequestError(400, f"{name} must be 1-128 characters of [A-Za-z0-9_.:@-], got {value!r}", field=name)
    return value


def parse_count(value: Any, name: str, minimum: int = 0) -> int:
    """Return an int in ``[minimum, MAX_WIRE_INT]``; else ``RequestError`` 400 naming the field and the value."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_WIRE_INT:
        raise RequestError(400, f"{name} must be an int in [{minimum}, 2**62], got {_shown(value)}", field=name)
    return value


def parse_step(value: Any, name: str = "applied_step") -> int:
    """Return a step: an int in ``[0, MAX_WIRE_INT]``; else ``RequestError`` 400 naming the field."""
    return parse_count(value, name)


def _shown(value: Any) -> str:
    """``value`` for an error message: its repr, cut at 60 characters (a number of 400 digits is named, not copied)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def parse_digest(value: Any, name: str = "digest") -> str | None:
    """Return a ledger digest (32 lowercase hex digits) or None; else ``RequestError`` 400 naming the field."""
    if value is None:
        return None
    if not isinstance(value, str) or not _DIGEST_PATTERN.fullmatch(value):
        raise RequestError(400, f"{name} must be 32 lowercase hex digits or null, got {value!r}", field=name)
    return value


def parse_weights(value: Any, name: str = "weights") -> dict[str, Any] | None:
    """Return a balanced ledger's weights record ``{"step": int, "weights": {member: int >= 1}}``, or None.

    Else ``RequestError`` 400 naming the field and the value.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) != {"step", "weights"} or not isinstance(value["weights"], Mapping):
        raise RequestError(
            400, f'{name} must be {{"step": int, "weights": {{member: int}}}} or null, got {value!r:.200}', field=name
        )
    weights = {}
    for member, weight in value["weights"].items():
        parse_member(member, f"{name}['weights']")
        weights[member] = parse_count(weight, f"{name}['weights'][{member!r}]", minimum=1)
    return {"step": parse_step(value["step"], f"{name}['step']"), "weights": weights}


def parse_plan(value: Any, name: str = "plan") -> EpochPlan | None:
    """Return the :class:`EpochPlan` a member offers (its ``to_dict()`` fields, every one), or None.

    ``EpochPlan``'s own validation checks types and ranges; integers above
    ``MAX_PLAN_INT`` are refused first. Anything else is ``RequestError`` 400
    naming the field and the value.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise RequestError(
            400, f"{name} must be an object of the fields {list(PLAN_FIELDS)}, got {value!r:.200}", field=name
        )
    unknown = sorted(str(key) for key in set(value) - set(PLAN_FIELDS))
    missing = [key for key in PLAN_FIELDS if key not in value]
    if unknown or missing:
        raise RequestError(
            400,
            f"{name} must have exactly the fields {list(PLAN_FIELDS)}; unknown {unknown}, missing {missing}",
            field=name,
        )
    for key in PLAN_FIELDS:
        item = value[key]
        if isinstance(item, int) and not isinstance(item, bool) and item > MAX_PLAN_INT:
            raise RequestError(400, f"{name}['{key}'] must be at most {MAX_PLAN_INT}, got {item}", field=name)
    try:
        return EpochPlan(**{key: value[key] for key in PLAN_FIELDS})
    except (TypeError, ValueError) as error:
        raise RequestError(400, f"{name} is not a valid plan: {error}", field=name) from None


def plan_differences(ours: EpochPlan, theirs: EpochPlan) -> dict[str, dict[str, Any]]:
    """``{field: {"lighthouse": ours, "member": theirs}}`` for each field where the two plans differ."""
    mine, offered = ours.to_dict(), theirs.to_dict()
    return {key: {"lighthouse": mine[key], "member": offered[key]} for key in PLAN_FIELDS if mine[key] != offered[key]}


def parse_report(body: Any) -> tuple[int, str | None, dict[str, Any] | None]:
    """Return ``(applied_step, digest, weights)`` from a heartbeat message.

    The message is ``{"applied_step": int, "digest"?: str, "weights"?: {...}}``
    (``weights``: see :func:`parse_weights`; balanced ledgers only).
    """
    if not isinstance(body, Mapping) or "applied_step" not in body:
        shape = '{"applied_step": int, "digest"?: str, "weights"?: ...}'
        raise RequestError(400, f"a heartbeat must be an object {shape}, got {body!r:.200}")
    unknown = sorted(set(body) - {"applied_step", "digest", "weights"})
    if unknown:
        raise RequestError(400, f"unknown heartbeat fields {unknown}", field=unknown[0])
    return parse_step(body["applied_step"]), parse_digest(body.get("digest")), parse_weights(body.get("weights"))


def parse_heartbeat(body: Any) -> int:
    """Return ``applied_step`` from a heartbeat message (see :func:`parse_report`)."""
    return parse_report(body)[0]


def check_seconds(name: str, value: Any) -> float:
    """Return ``value`` as a float if it is a finite number of seconds > 0, else raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def optional_seconds(name: str, value: Any) -> float | None:
    """``None``, or ``value`` checked by :func:`check_seconds`."""
    return None if value is None else check_seconds(name, value)


_Field = TypeVar("_Field")


def take_field(
    report: Any, field: str, parse: Callable[[Any], _Field], member: str, logger: logging.Logger
) -> tuple[_Field | None, str | None]:
    """Remove the optional ``field`` from a heartbeat ``report`` and parse it: (value, None), or (None, error text).

    (None, None) when the report has no such field. A malformed field is
    dropped and logged; the heartbeat itself still counts.
    """
    if not isinstance(report, dict) or field not in report:
        return None, None
    try:
        return parse(report.pop(field)), None
    except RequestError as error:
        logger.warning("member %s sent a malformed %s report: %s", member, field, error.message)
        return None, error.message

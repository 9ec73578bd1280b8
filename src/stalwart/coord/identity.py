"""Who may speak for a member: the incarnation (one per process start) and its secret. Pure: no I/O.

A worker registers ``(member, incarnation)`` and gets a secret (kept by the
lighthouse only as a SHA-256 hash); every later heartbeat, quorum request and
leave carries both. A new incarnation replaces the old one, whose secret stops
working; a replaced incarnation cannot register again (it would evict the
process that replaced it). While the old one lives, replacing it needs its
secret (the state refuses otherwise, see ``LighthouseState.register``). An
incarnation that left cleanly has no more say: its secret is refused with 410
``left`` (a heartbeat sent just before the leave, or a socket opened just
after it, must not make it alive again). Registrations are rate limited
(:class:`RegistrationRate`), so that churn cannot keep the lighthouse busy.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from stalwart.coord.tracked import Tracked, TrackedDict
from stalwart.coord.wire import RequestError

_INCARNATION_PATTERN = re.compile(r"[0-9a-f]{32}")
RETIRED_PER_MEMBER = 8
"""How many replaced incarnations of one member are remembered (and refused)."""


def parse_incarnation(value: Any, name: str = "incarnation") -> str:
    """Return an incarnation id (32 lowercase hex digits, ``uuid4().hex``); else ``RequestError`` 400 naming it."""
    if not isinstance(value, str) or not _INCARNATION_PATTERN.fullmatch(value):
        raise RequestError(400, f"{name} must be 32 lowercase hex digits (uuid4().hex), got {value!r}", field=name)
    return value


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class Identity:
    """A member's registered incarnation and the hash of its secret."""

    incarnation: str
    secret_sha256: str
    left: bool = False
    """True once this incarnation left cleanly (``/v1/leave``): it may not speak again."""


class Identities(Tracked):
    """The registered incarnation of every member, and the replaced ones that may not come back.

    A persisted part (:mod:`~stalwart.coord.tracked`), saved one row per member: both maps record which members
    changed.
    """

    def __init__(self) -> None:
        self.current: TrackedDict[str, Identity] = TrackedDict(keys=True)
        self.retired: TrackedDict[str, tuple[str, ...]] = TrackedDict(keys=True)

    def take_changed(self) -> set[str]:
        """The members whose row changed since the last call."""
        return self.current.take_keys() | self.retired.take_keys()

    def __len__(self) -> int:
        return len(self.current)

    def __contains__(self, member: object) -> bool:
        return member in self.current

    def register(self, member: str, incarnation: str) -> tuple[str, str | None]:
        """Register ``incarnation`` of ``member``: returns ``(secret, replaced incarnation or None)``.

        ``RequestError`` 409 when this incarnation was replaced or is already registered.
        """
        if incarnation in self.retired.get(member, ()):
            raise RequestError(
                409,
                f"incarnation {incarnation} of member {member!r} was replaced by a newer process; "
                "this process must not speak for the member any more",
                field="incarnation",
                code="superseded",
            )
        previous = self.current.get(member)
        if previous is not None and previous.incarnation == incarnation:
            raise RequestError(
                409, f"incarnation {incarnation} of member {member!r} is already registered", field="incarnation"
            )
        secret = secrets.token_urlsafe(32)
        self.current[member] = Identity(incarnation, _hash(secret))
        if previous is None:
            return secret, None
        self.retired[member] = (*self.retired.get(member, ()), previous.incarnation)[-RETIRED_PER_MEMBER:]
        return secret, previous.incarnation

    def check(self, member: str, incarnation: Any, secret: Any) -> None:
        """``RequestError`` 403 unless ``secret`` is the current secret of ``member``'s ``incarnation``.

        The body's ``code`` is ``unregistered`` when the lighthouse knows no
        incarnation of the member (register again), ``superseded`` when a newer
        one replaced it, ``forbidden`` otherwise.
        """
        if not isinstance(incarnation, str) or not incarnation:
            raise RequestError(403, "the X-Stalwart-Incarnation header is required", code="forbidden")
        if not isinstance(secret, str) or not secret:
            raise RequestError(403, "the X-Stalwart-Secret header is required", code="forbidden")
        identity = self.current.get(member)
        if identity is None or identity.incarnation != incarnation:
            if incarnation in self.retired.get(member, ()):
                raise RequestError(
                    403, f"incarnation {incarnation} of member {member!r} was replaced", code="superseded"
                )
            raise RequestError(
                403,
                f"incarnation {incarnation} of member {member!r} is not registered: POST /v1/register first",
                code="unregistered",
            )
        if not hmac.compare_digest(identity.secret_sha256, _hash(secret)):
            raise RequestError(403, f"wrong secret for member {member!r}", code="forbidden")
        if identity.left:
            raise RequestError(
                410,
                f"incarnation {incarnation} of member {member!r} left the job; a new process registers anew",
                code="left",
            )

    def has_left(self, member: str) -> bool:
        """Whether ``member``'s current incarnation left cleanly."""
        identity = self.current.get(member)
        return identity is not None and identity.left

    def leave(self, member: str) -> bool:
        """Mark ``member``'s current incarnation as left; returns whether it had not left before."""
        identity = self.current.get(member)
        if identity is None or identity.left:
            return False
        self.current[member] = replace(identity, left=True)
        return True

    def forget(self, member: str) -> None:
        """Drop everything known of ``member`` (it was forgotten as long dead)."""
        self.current.pop(member, None)
        self.retired.pop(member, None)

    def member_json(self, member: str) -> dict[str, Any]:
        """One member's row: ``{"identity": {incarnation, secret_sha256, left} | None, "retired": [...]}``."""
        identity = self.current.get(member)
        retired = list(self.retired.get(member, ()))
        return {"identity": None if identity is None else _identity_json(identity), "retired": retired}

    def to_json(self) -> dict[str, Any]:
        """JSON form (hashes only, never a secret)."""
        return {
            "current": {member: _identity_json(identity) for member, identity in self.current.items()},
            "retired": {m: list(r) for m, r in self.retired.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Identities:
        """Inverse of ``to_json``."""
        identities = cls()
        for member, entry in data["current"].items():
            identities.current[member] = Identity(
                str(entry["incarnation"]), str(entry["secret_sha256"]), entry.get("left") is True
            )
        for member, retired in data["retired"].items():
            identities.retired[member] = tuple(str(i) for i in retired)
        return identities


class RegistrationRate:
    """A token bucket: ``burst`` registrations at once, then ``per_second`` (time is passed as ``now``)."""

    def __init__(self, burst: int, per_second: float) -> None:
        self.burst = burst
        self.per_second = per_second
        self._tokens = float(burst)
        self._at: float | None = None

    def take(self, now: float) -> None:
        """Spend one registration; ``RequestError`` 429 (asked again later) when none is left."""
        if self._at is not None:
            self._tokens = min(float(self.burst), self._tokens + max(0.0, now - self._at) * self.per_second)
        self._at = now
        if self._tokens < 1:
            wait = (1 - self._tokens) / self.per_second
            raise RequestError(
                429,
                f"too many registrations: at most {self.burst} at once and {self.per_second:g} a second; "
                f"register again in {wait:.2f} s",
                code="rate_limited",
                retry_after=max(0.001, round(wait, 3)),
            )
        self._tokens -= 1


def _identity_json(identity: Identity) -> dict[str, Any]:
    return {"incarnation": identity.incarnation, "secret_sha256": identity.secret_sha256, "left": identity.left}

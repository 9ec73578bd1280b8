"""What a :class:`~stalwart.coord.server.Lighthouse` is configured with, besides its plan: one frozen, validated value.

Every field is checked when the settings are built, before the lighthouse
binds or opens anything: a bad one raises ``ValueError`` or ``TypeError``
naming the field, the value and what is allowed (a token is never echoed).
``stalwart lighthouse`` builds one from its options; ``Lighthouse(plan,
settings)`` takes it, and ``Lighthouse(plan, join_timeout=30.0)`` is short
for ``Lighthouse(plan, LighthouseSettings(join_timeout=30.0))``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

from stalwart._validate import check_bool, check_int
from stalwart.coord.connections import HEADER_TIMEOUT
from stalwart.coord.protocol import DEFAULT_HEARTBEAT_TIMEOUT, MAX_HEADER_CHARS
from stalwart.coord.quorum import MAX_MEMBERS
from stalwart.coord.store import StoreLimits
from stalwart.coord.tls import is_loopback
from stalwart.coord.wire import check_seconds
from stalwart.errors import InsecureLighthouseError

MAX_WAITERS = 4096
"""Default cap on pending quorum long polls (``max_waiters``)."""
AHEAD_SETTLE_S = 0.05
"""Default ``ahead_settle``: members dying together (a machine, a rack) are seen over some milliseconds; their
survivors' failure quorum forms ahead of their requests once no more died for this long."""
MAX_UNAUTHENTICATED = 1024
"""Default cap on stalled connections: not yet past the credential check, with no complete request head
(``max_unauthenticated``, see :mod:`stalwart.coord.connections`)."""

FilePath = str | os.PathLike[str]


@dataclass(frozen=True)
class LighthouseSettings:
    """A lighthouse's configuration (see :class:`~stalwart.coord.server.Lighthouse` for what each does)."""

    min_replicas: int = 1
    """Fewest members the job starts with (or restarts with from a checkpoint)."""
    start_replicas: int | None = None
    """Members the first quorum waits for, up to ``join_timeout`` (None: ``min_replicas``)."""
    host: str = "127.0.0.1"
    port: int = 0
    """0: a free one."""
    state_path: FilePath | None = None
    """The SQLite file holding the state (None: the state lives in memory only)."""
    token: str | None = field(default=None, repr=False)
    """The bearer token every request but ``/healthz`` must carry (None: none is checked); never in the repr."""
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    join_timeout: float = 5.0
    tick_interval: float = 0.05
    max_members: int = MAX_MEMBERS
    max_waiters: int = MAX_WAITERS
    balance_every: int | None = None
    """Every how many steps members' shares are rebalanced (None: as persisted, else 0, off)."""
    insecure: bool = False
    """Serve a host other than loopback without a token or without TLS."""
    tls_cert: FilePath | None = None
    tls_key: FilePath | None = None
    max_connections: int | None = None
    """None: the process's file-descriptor limit less ``RESERVED_FDS``."""
    max_unauthenticated: int = MAX_UNAUTHENTICATED
    header_timeout: float = HEADER_TIMEOUT
    store_limits: StoreLimits | None = None
    ahead_settle: float | None = AHEAD_SETTLE_S
    """Seconds after the last death in a quorum before its survivors' failure quorum forms ahead of their requests,
    from their last reports (None: never ahead, their requests decide; ``docs/protocol.md``, "Forming a failure
    quorum ahead")."""

    def __post_init__(self) -> None:
        check_int("min_replicas", self.min_replicas, minimum=1)
        if self.start_replicas is not None:
            check_int("start_replicas", self.start_replicas, minimum=self.min_replicas)
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty string, got {self.host!r}")
        check_int("port", self.port, minimum=0, maximum=65535)
        for name in ("state_path", "tls_cert", "tls_key"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str | os.PathLike):
                raise TypeError(f"{name} must be a str, an os.PathLike or None, got {value!r}")
        _check_token(self.token)
        for name in ("heartbeat_timeout", "join_timeout", "tick_interval", "header_timeout"):
            object.__setattr__(self, name, check_seconds(name, getattr(self, name)))
        if self.ahead_settle is not None:
            object.__setattr__(self, "ahead_settle", check_seconds("ahead_settle", self.ahead_settle))
        check_int("max_members", self.max_members, minimum=1)
        check_int("max_waiters", self.max_waiters, minimum=1)
        if self.balance_every is not None:
            check_int("balance_every", self.balance_every, minimum=0)
        check_bool("insecure", self.insecure)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both PEM files, or neither")
        if self.max_connections is not None:
            check_int("max_connections", self.max_connections, minimum=2)
        check_int("max_unauthenticated", self.max_unauthenticated, minimum=1)
        if self.store_limits is not None and not isinstance(self.store_limits, StoreLimits):
            raise TypeError(f"store_limits must be a StoreLimits or None, got {self.store_limits!r}")
        if not self.insecure and not is_loopback(self.host):
            _check_exposed(self.host, self.token, self.tls_cert)

    @classmethod
    def of(cls, settings: LighthouseSettings | None, overrides: dict[str, Any]) -> LighthouseSettings:
        """``settings`` (default ones when None) with the fields named in ``overrides`` replaced, validated;
        ``TypeError`` naming an unknown field and the known ones."""
        if settings is not None and not isinstance(settings, LighthouseSettings):
            raise TypeError(f"settings must be a LighthouseSettings or None, got {settings!r}")
        known = [setting.name for setting in fields(cls)]
        unknown = sorted(set(overrides) - set(known))
        if unknown:
            raise TypeError(f"unknown lighthouse setting(s) {', '.join(unknown)}: the settings are {', '.join(known)}")
        return replace(settings or cls(), **overrides)


def _check_token(token: object) -> None:
    """A token is printable ASCII (it travels in a header), of at most ``MAX_HEADER_CHARS``; never echoed."""
    if token is None:
        return
    if not isinstance(token, str):
        raise TypeError(f"token must be a str or None, got a {type(token).__name__}")
    printable = all(" " <= character <= "~" for character in token)
    if not token or len(token) > MAX_HEADER_CHARS or not printable:
        raise ValueError(
            f"token must be 1 to {MAX_HEADER_CHARS} characters of printable ASCII or None, got one of "
            f"{len(token)} characters{'' if printable else ' with others'}"
        )


def _check_exposed(host: str, token: str | None, tls_cert: object) -> None:
    """On an address other machines reach, refuse to serve without a token or without TLS (one line, naming the
    address and the ways out)."""
    if token is None:
        raise InsecureLighthouseError(
            f"host={host!r} is reachable from other machines and no token is set: anyone there could register, "
            "report checkpoints and read the quorum's keys. Give a token (STALWART_LIGHTHOUSE_TOKEN, or "
            "--token-file) and --tls-cert/--tls-key, or say insecure=True (--insecure) on a network you trust"
        )
    if tls_cert is None:
        raise InsecureLighthouseError(
            f"host={host!r} is reachable from other machines and TLS is not set: the token and the quorum's keys "
            "would cross the network in cleartext. Give --tls-cert/--tls-key (tls_cert, tls_key), or say "
            "insecure=True (--insecure) on a network you trust"
        )

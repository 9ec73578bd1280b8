"""A client's registration with the lighthouse: the secret that authenticates this incarnation's calls.

Registering (``POST /v1/register``) is asked again while the member's old
process lives (409 ``member_alive``: it may be dead by heartbeat soon),
registrations are rate limited (429 ``rate_limited``), or the connection
closed before an answer (a lighthouse at its connection cap), up to
``register_timeout``. A refusal no retry changes (superseded, another plan,
no plan) is kept and raised by every later call. The lighthouse's answers
also say how often to heartbeat at least, and the heartbeat timeout a member's
default interval follows (:meth:`Registration.adopt_interval`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp

from stalwart.coord.protocol import (
    BEATS_PER_TIMEOUT,
    DEFAULT_HEARTBEAT_TIMEOUT,
    REGISTER_PATH,
    identity_headers,
    register_body,
)
from stalwart.data.plan import EpochPlan
from stalwart.errors import LighthouseError

logger = logging.getLogger(__name__)

MIN_PAUSE_S = 0.05
"""The shortest pause before a registration is asked again."""
RETRY_PAUSE_S = 0.1
"""The longest pause before a failed request is tried again, unless the lighthouse asks for a longer heartbeat
interval: a slow default heartbeat (it spares the training loop) must not slow the recovery of quorum requests."""
MAX_PAUSE_S = 2.0
"""The longest pause before a registration is asked again (whatever ``retry_after`` says)."""
STICKY_CODES = frozenset({"superseded", "plan_mismatch", "no_plan"})
"""Registration refusals that no retry can change: every later call raises the same error."""
RETRIED_CODES = frozenset({"member_alive", "rate_limited"})
"""Registration refusals asked again until ``register_timeout``: the member's old process is alive (it will be dead
by heartbeat soon, or it really is alive), or registrations come too fast."""

Request = Callable[[str, str, Any], Awaitable[dict[str, Any]]]
"""``request(method, path, body)``: the answer's JSON, :class:`LighthouseError` for a refusal."""


class Registration:
    """Registers ``incarnation`` of ``member`` (with its ``plan``) when a call needs it, through ``request``."""

    def __init__(
        self,
        member: str,
        incarnation: str,
        plan: EpochPlan | None,
        register_timeout: float,
        bearer: Mapping[str, str],
        request: Request,
    ) -> None:
        self.member = member
        self.incarnation = incarnation
        self.plan = plan
        self.register_timeout = register_timeout
        self.bearer = dict(bearer)
        self.request = request
        self.secret: str | None = None
        """This incarnation's secret (None: register before the next call)."""
        self.refused: LighthouseError | None = None
        """A registration refusal no retry changes: raised by every call."""
        self.recommended_interval = 0.0
        """The least heartbeat interval the lighthouse asked for (its register and quorum answers say)."""
        self.heartbeat_timeout: float | None = None
        """The lighthouse's heartbeat timeout, once an answer said it (a default interval is a fraction of it)."""
        self._lock: asyncio.Lock | None = None

    def start(self) -> None:
        """Ready the registration on the client's running loop."""
        self._lock = asyncio.Lock()

    async def headers(self) -> dict[str, str]:
        """Bearer token, incarnation and secret headers; registers this incarnation first when needed."""
        assert self._lock is not None
        async with self._lock:
            if self.refused is not None:
                raise self.refused
            if self.secret is None:
                await self.register()
        assert self.secret is not None
        return {**self.bearer, **identity_headers(self.incarnation, self.secret)}

    async def register(self) -> None:
        """Register this incarnation, asking again as the module says, up to ``register_timeout``."""
        body = register_body(self.member, self.incarnation, self.plan)
        deadline = time.monotonic() + self.register_timeout
        warned = False
        while True:
            try:
                registered = await self.request("POST", REGISTER_PATH, body)
            except aiohttp.ClientConnectionError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(MIN_PAUSE_S)
                continue
            except LighthouseError as error:
                code = error.body.get("code")
                if code in STICKY_CODES:
                    self.refused = error
                retry_after = error.body.get("retry_after")
                if code not in RETRIED_CODES or time.monotonic() >= deadline:
                    raise
                if not warned:
                    logger.warning("%s: %s; registering again", self.member, error.body.get("error"))
                    warned = True
                pause = retry_after if isinstance(retry_after, int | float) and not isinstance(retry_after, bool) else 0
                await asyncio.sleep(min(max(MIN_PAUSE_S, float(pause)), MAX_PAUSE_S))
                continue
            self.secret = str(registered["secret"])
            self.adopt_interval(registered)
            return

    def adopt_interval(self, answer: Mapping[str, Any]) -> None:
        """Heartbeat no faster than the lighthouse asks, and by default at the pace its timeout sets
        (``heartbeat_interval`` and ``heartbeat_timeout`` in its answers, when they say)."""
        recommended = _seconds(answer.get("heartbeat_interval"), below=3600)
        if recommended is not None:
            self.recommended_interval = recommended
        timeout = _seconds(answer.get("heartbeat_timeout"), below=86400)
        if timeout:
            self.heartbeat_timeout = timeout

    def heartbeat_interval(self, own: float | None) -> float:
        """The interval heartbeats go at: ``own`` (None: a ``BEATS_PER_TIMEOUT``-th of the lighthouse's heartbeat
        timeout, or of its default before an answer said it), or longer when the lighthouse asks for it."""
        if own is None:
            timeout = DEFAULT_HEARTBEAT_TIMEOUT if self.heartbeat_timeout is None else self.heartbeat_timeout
            own = timeout / BEATS_PER_TIMEOUT
        return max(own, self.recommended_interval)

    def retry_cap(self, own: float | None) -> float:
        """The longest pause (s) before a failed quorum request or heartbeat connection is tried again: the
        heartbeat interval up to ``RETRY_PAUSE_S``, or the least interval the lighthouse asks for (a fleet at
        scale spreads its retries as it spreads its heartbeats). The client floors it at its first pause."""
        return max(min(self.heartbeat_interval(own), RETRY_PAUSE_S), self.recommended_interval)

    def forget(self, secret: str | None) -> None:
        """Register again before the next call (the lighthouse no longer knows ``secret``)."""
        if self.secret == secret:
            self.secret = None


def _seconds(value: Any, *, below: float) -> float | None:
    """A lighthouse's answer's number of seconds in [0, ``below``), as a float; None for anything else (ignored)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < below:
        return float(value)
    return None

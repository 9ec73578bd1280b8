"""Connection hygiene for the lighthouse's HTTP port: a header-read timeout and caps on open connections.

:class:`ConnectionGuard` wraps aiohttp's protocol factory. Each connection
must send a request's headers within ``header_timeout`` seconds of opening,
or of the first byte of its next request (a kept-alive connection that sends
nothing is aiohttp's to close, after its keep-alive timeout); else it is
closed. At most ``max_connections`` are open and at most
``max_unauthenticated`` of them have not yet made a request that passed the
bearer-token check (without a token: any request but ``/healthz``); past
either cap the oldest unauthenticated connection is closed for the new one,
and a new connection is refused only when every open one is authenticated.
So half-sent requests and silent clients cannot use up the file descriptors
or starve ``/healthz`` and the members. The caps keep ``RESERVED_FDS`` file
descriptors free of the process's limit, so that accepting never fails with
"too many open files".
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)

HEADER_TIMEOUT = 10.0
"""Seconds a connection has to send a request's headers."""
RESERVED_FDS = 64
"""File descriptors left to the process (its database, logs, the clients it embeds) under the connection cap."""


def descriptor_limit(raise_soft: bool) -> int:
    """The process's open-file limit; with ``raise_soft``, the soft limit is raised to the hard one first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if raise_soft and soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class ConnectionGuard:
    """Counts the lighthouse's connections, closes slow and surplus ones (see the module doc)."""

    def __init__(
        self,
        factory: Callable[[], Any],
        *,
        max_connections: int,
        max_unauthenticated: int,
        header_timeout: float = HEADER_TIMEOUT,
    ) -> None:
        self._factory = factory
        self.max_connections = max_connections
        self.max_unauthenticated = max_unauthenticated
        self.header_timeout = header_timeout
        self.open = 0
        self.refused = 0
        """Connections closed at once (every open one was authenticated and the cap was reached)."""
        self.evicted = 0
        """Unauthenticated connections closed to make room."""
        self.timed_out = 0
        """Connections closed for not sending their headers in time."""
        self._unauthenticated: OrderedDict[_Guarded, None] = OrderedDict()
        self._by_handler: dict[int, _Guarded] = {}

    def __call__(self) -> asyncio.Protocol:
        return _Guarded(self, self._factory())

    # --- what the server tells -----------------------------------------------------------------------------

    def request_started(self, request: web.BaseRequest) -> None:
        """A request's headers arrived: its connection's header timer stops."""
        guarded = self._by_handler.get(id(request.protocol))
        if guarded is not None:
            guarded.in_request = True
            guarded.disarm()

    def request_ended(self, request: web.BaseRequest) -> None:
        """A request was answered: the connection's next bytes start the timer again."""
        guarded = self._by_handler.get(id(request.protocol))
        if guarded is not None:
            guarded.in_request = False

    def authenticated(self, request: web.BaseRequest) -> None:
        """The request passed the credential check: its connection no longer counts as unauthenticated."""
        guarded = self._by_handler.get(id(request.protocol))
        if guarded is not None:
            self._unauthenticated.pop(guarded, None)

    # --- bookkeeping ---------------------------------------------------------------------------------------

    def _admit(self, guarded: _Guarded) -> bool:
        if self.open >= self.max_connections and not self._evict_oldest():
            self.refused += 1
            return False
        if len(self._unauthenticated) >= self.max_unauthenticated:
            self._evict_oldest()
        self.open += 1
        self._unauthenticated[guarded] = None
        self._by_handler[id(guarded.handler)] = guarded
        return True

    def _evict_oldest(self) -> bool:
        for oldest in self._unauthenticated:
            self.evicted += 1
            oldest.close()
            return True
        return False

    def _closed(self, guarded: _Guarded) -> None:
        self.open -= 1
        self._unauthenticated.pop(guarded, None)
        self._by_handler.pop(id(guarded.handler), None)


class _Guarded(asyncio.Protocol):
    """aiohttp's request handler for one connection, behind the guard's timer and caps."""

    def __init__(self, guard: ConnectionGuard, handler: Any) -> None:
        self.guard = guard
        self.handler = handler
        self.transport: asyncio.Transport | None = None
        self.in_request = False
        self._admitted = False
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if not self.guard._admit(self):
            transport.abort()
            return
        self._admitted = True
        self.handler.connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return
        if not self.in_request and self._timer is None:
            self._arm()  # the first bytes of a request: its headers must follow in time
        self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received() if self._admitted else None

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        if not self._admitted:
            return
        self._admitted = False
        self.guard._closed(self)
        self.handler.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._admitted:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self._admitted:
            self.handler.resume_writing()

    def close(self) -> None:
        """Close the connection at once."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self) -> None:
        self.disarm()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.guard.header_timeout, self._expire)

    def _expire(self) -> None:
        self._timer = None
        if not self.in_request:
            self.guard.timed_out += 1
            self.close()

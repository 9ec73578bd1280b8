"""Connection hygiene for the lighthouse's HTTP port: a header-read timeout and caps on open connections.

:class:`ConnectionGuard` wraps aiohttp's protocol factory. Each connection
must send a request's headers within ``header_timeout`` seconds of opening,
or of the first byte of its next request (a kept-alive connection that sends
nothing is aiohttp's to close, after its keep-alive timeout); else it is
closed. At most ``max_connections`` are open, and at most
``max_unauthenticated`` of them are *stalled*: open, not yet past the
bearer-token check (without a token: any request but ``/healthz``), and
without a complete request head. Past either cap the oldest stalled
connection is closed for the new one; a new connection is refused only when
the total cap is reached and none can be closed.

A connection whose request head has arrived is never closed for room: it
waits only for the server's event loop, which authenticates or refuses it
next (a slowloris never completes its head). Nor is one whose bytes wait
unread in its socket (``FIONREAD``): in a join storm (every member of a
4,096-member fleet restarting at once) the busy loop accepts connections
before it reads them, and closing the oldest unread one closed honest
requests mid-body. Only the ``_EVICTION_LOOKS`` oldest stalled connections
are examined per new connection; when all of them wait unread, the new one
is admitted past ``max_unauthenticated`` (the total cap still holds). So
half-sent requests and silent clients cannot use up the file descriptors or
starve ``/healthz`` and the members, and a burst of real requests is let in
up to the file-descriptor budget. The caps keep ``RESERVED_FDS`` file
descriptors free of the process's limit, so that accepting never fails with
"too many open files".

Hand-written on purpose: it is the lighthouse's own admission policy
(which connection to close when a cap is reached), which no server library
offers; the head scan is four bytes of state per connection.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import resource
import struct
import termios
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)

HEADER_TIMEOUT = 10.0
"""Seconds a connection has to send a request's headers."""
RESERVED_FDS = 64
"""File descriptors left to the process (its database, logs, the clients it embeds) under the connection cap."""
_EVICTION_LOOKS = 8
"""Stalled connections examined, oldest first, for one to close when a cap is reached."""
_HEAD_END = b"\r\n\r\n"
"""What ends an HTTP/1.1 request head."""


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
            guarded.request_done()

    def authenticated(self, request: web.BaseRequest) -> None:
        """The request passed the credential check: its connection no longer counts as unauthenticated."""
        guarded = self._by_handler.get(id(request.protocol))
        if guarded is not None:
            guarded.authenticated = True
            self._unauthenticated.pop(guarded, None)

    # --- what the connections tell ---------------------------------------------------------------------

    def head_arrived(self, guarded: _Guarded) -> None:
        """``guarded``'s request head is complete: it is no longer stalled, only queued for the event loop."""
        self._unauthenticated.pop(guarded, None)

    def request_refused(self, guarded: _Guarded) -> None:
        """``guarded``'s request was answered without authenticating it: it is stalled again (the newest)."""
        if not guarded.authenticated and guarded.admitted:
            self._unauthenticated[guarded] = None

    def admit(self, guarded: _Guarded) -> bool:
        """Count a new connection in (evicting a stalled one for room when a cap is reached); False: refuse it."""
        if self.open >= self.max_connections and not self._evict_stalled():
            self.refused += 1
            return False
        if len(self._unauthenticated) >= self.max_unauthenticated:
            self._evict_stalled()
        self.open += 1
        self._unauthenticated[guarded] = None
        self._by_handler[id(guarded.handler)] = guarded
        return True

    def _evict_stalled(self) -> bool:
        """Close the oldest stalled connection with nothing unread in its socket (among the first few looked at)."""
        for number, candidate in enumerate(self._unauthenticated):
            if number == _EVICTION_LOOKS:
                return False
            if not candidate.unread():
                self.evicted += 1
                candidate.close()
                return True
        return False

    def closed(self, guarded: _Guarded) -> None:
        """``guarded``'s connection is gone: it no longer counts."""
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
        self.authenticated = False
        self.admitted = False
        self._head_seen = False
        """A complete request head arrived since the last answer (the connection waits for the loop, not stalls)."""
        self._tail = b""
        """The last bytes of an unfinished head (its end may straddle two reads)."""
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if not self.guard.admit(self):
            transport.abort()
            return
        self.admitted = True
        self.handler.connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if not self.admitted:
            return
        if not self.in_request and not self._head_seen:
            if self._timer is None:
                self._arm()  # the first bytes of a request: its headers must follow in time
            seen = self._tail + data
            if _HEAD_END in seen:
                self._head_seen, self._tail = True, b""
                self.disarm()
                if not self.authenticated:
                    self.guard.head_arrived(self)
            else:
                self._tail = seen[-(len(_HEAD_END) - 1) :]
        self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received() if self.admitted else None

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        if not self.admitted:
            return
        self.admitted = False
        self.guard.closed(self)
        self.handler.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.admitted:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.handler.resume_writing()

    def request_done(self) -> None:
        """The request was answered: the next one's head is scanned for afresh; unauthenticated, it stalls again."""
        self._head_seen, self._tail = False, b""
        if not self.authenticated:
            self.guard.request_refused(self)

    def unread(self) -> bool:
        """Whether bytes wait in the socket that the event loop has not read yet."""
        sock = None if self.transport is None else self.transport.get_extra_info("socket")
        if sock is None:
            return False
        try:
            waiting = fcntl.ioctl(sock.fileno(), termios.FIONREAD, struct.pack("i", 0))
        except OSError:
            return False
        return struct.unpack("i", waiting)[0] > 0

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

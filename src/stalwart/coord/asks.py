"""Quorum requests on the heartbeat socket: the client's side (``docs/protocol.md``, "Asking on the heartbeat socket").

A member already holds an authenticated websocket to the lighthouse. Asking
for a quorum on it costs the lighthouse no TCP connection, no HTTP parsing
and no token check: after a failure at thousands of members those were most
of what each survivor's ``POST /v1/quorum`` cost. The answer is the same
status and JSON the POST would get. :class:`SocketAsks` keeps the socket the
heartbeat has open, numbers the asks and hands each answer to its waiter; a
socket that closes answers the asks in flight with None, and the client asks
again (on the next socket, or by POST while none is open).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping
from typing import Any, NamedTuple

import aiohttp

from stalwart.coord.protocol import MAX_SOCKET_MESSAGE_BYTES, ask_message

MAX_ANSWER_BYTES = 64 << 20
"""The largest answer message the client reads on its heartbeat socket (a wire-1 answer carries the ledger)."""


class SocketAnswer(NamedTuple):
    """An ask's answer: what the POST would get, and the answer message's length (characters)."""

    status: int
    body: Any
    size: int


class SocketAsks:
    """The quorum requests this client sent on its heartbeat socket and not yet answered (its loop only)."""

    def __init__(self) -> None:
        self._socket: aiohttp.ClientWebSocketResponse | None = None
        self._pending: dict[int, asyncio.Future[SocketAnswer | None]] = {}
        self._ids = itertools.count()

    def attach(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        """Ask on ``socket`` from now on (the heartbeat opened it)."""
        self._socket = socket

    def detach(self) -> None:
        """The socket closed: no more asks on it, and those in flight get None (they are asked again elsewhere)."""
        self._socket = None
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_result(None)

    def message(self, body: Mapping[str, Any]) -> tuple[int, str] | None:
        """A numbered ask for ``body``, or None when no socket is open or the ask does not fit a socket message."""
        if self._socket is None or self._socket.closed:
            return None
        ask_id = next(self._ids)
        text = ask_message(ask_id, body)
        return (ask_id, text) if len(text.encode()) <= MAX_SOCKET_MESSAGE_BYTES else None

    async def ask(self, ask_id: int, text: str) -> SocketAnswer | None:
        """Send ask ``text`` and wait for its answer, or None when the socket closed first (the caller bounds the
        wait)."""
        socket = self._socket
        if socket is None or socket.closed:
            return None
        future: asyncio.Future[SocketAnswer | None] = asyncio.get_running_loop().create_future()
        self._pending[ask_id] = future
        try:
            await socket.send_str(text)
            return await future
        except (aiohttp.ClientConnectionError, ConnectionError):
            return None
        finally:
            self._pending.pop(ask_id, None)

    def answered(self, message: Mapping[str, Any], size: int) -> None:
        """Hand an ``{"type": "answer"}`` message (``size`` characters long) to its ask's waiter (an answer nobody
        waits for is dropped: its ask was given up)."""
        ask_id, status, body = message.get("ask"), message.get("status"), message.get("body")
        future = self._pending.get(ask_id) if isinstance(ask_id, int) else None
        if future is None or future.done() or not isinstance(status, int):
            return
        future.set_result(SocketAnswer(status, body if isinstance(body, dict) else {"error": repr(body)[:200]}, size))

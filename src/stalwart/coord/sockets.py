"""The members' heartbeat sockets on the lighthouse: heartbeats in, notices out, quorum requests on the socket.

``GET /v1/heartbeat?member=ID`` opens a member's websocket (``docs/protocol.md``):
its heartbeats are handed to the state (a repeated one only as a sign of
life), a member that should come to a boundary or was left out is told so
(once per notice and ``RENOTICE_S``), a quorum whose member died or that a
joiner waits for is pushed to its members at once
(:meth:`HeartbeatSockets.push_reconfigure`), and a
quorum request sent on the socket (``ASK_PREFIX``) is answered on it with what
``POST /v1/quorum`` would answer. A socket that closes is a death unless its
member closed it to reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web

from stalwart.coord.heartbeat import read_heartbeat
from stalwart.coord.metrics import LighthouseMetrics
from stalwart.coord.protocol import (
    ASK_PREFIX,
    HEARTBEAT_RECONNECT_CODE,
    MAX_SOCKET_ASKS,
    MAX_SOCKET_MESSAGE_BYTES,
    QuorumRequest,
    answer_message,
    parse_ask,
)
from stalwart.coord.quorum import LighthouseState, RequestError, parse_member
from stalwart.coord.rounds import RoundsBoard

logger = logging.getLogger(__name__)

MAX_HEARTBEAT_BYTES = MAX_SOCKET_MESSAGE_BYTES
"""Largest heartbeat message; a balanced ledger's carry the weights (up to ``balanced_bytes``)."""
PUSH_BUFFERED = 1 << 16
"""Bytes waiting in a socket's transport past which a push to it gets a task of its own (see :func:`push`)."""
RENOTICE_S = 1.0
"""Seconds before a heartbeat's answer repeats a reconfigure notice its socket already got (pushed or answered)."""
SOCKET_ERRORS = (ConnectionError, RuntimeError)
"""What writing to a websocket that is closing raises (aiohttp: ``ClientConnectionResetError``, a ``RuntimeError``
after close); the member is gone, or going, and nothing else happens."""
PUSH_PER_ITERATION = 64
"""Sockets a push sends to before it yields to the loop (3-20 ms of sends at 4,096 members): larger batches reach
the last member sooner and stall the other requests longer (docs/design.md, issue 40, sixth and eighth sessions)."""


class HeartbeatSockets:
    """Each member's heartbeat socket (``sockets``), served by :meth:`serve`.

    What it needs of the server comes as callables: ``authenticate(request,
    member)`` (403/410 unless the request speaks for the member), ``advance()`` (form a quorum if due), and
    ``answer_quorum(request)`` (the answer to a quorum request, however it
    came); ``stopping()`` tells whether the server shuts down; ``demote(socket)`` has the loop report an
    upgraded socket with the members' bulk (:mod:`~stalwart.coord.selector`).
    """

    def __init__(
        self,
        state: LighthouseState,
        metrics: LighthouseMetrics,
        rounds: RoundsBoard,
        *,
        authenticate: Callable[[web.Request, str], None],
        advance: Callable[[], None],
        answer_quorum: Callable[[QuorumRequest], Awaitable[bytes]],
        stopping: Callable[[], bool],
        balanced_bytes: int,
        demote: Callable[[Any], None],
    ) -> None:
        self.state = state
        self.metrics = metrics
        self.rounds = rounds
        self.authenticate = authenticate
        self.advance = advance
        self.answer_quorum = answer_quorum
        self.stopping = stopping
        self.balanced_bytes = balanced_bytes
        """Largest heartbeat message of a balanced ledger (its weights)."""
        self.demote = demote
        """Has the event loop report an upgraded socket with the members' bulk, a batch per iteration."""
        self.sockets: dict[str, web.WebSocketResponse] = {}
        """Each member's open heartbeat socket."""
        self._pushed: set[tuple[int, bool]] = set()
        self._noticed: dict[str, tuple[web.WebSocketResponse, tuple[int, bool, bool], float]] = {}
        """Each member's last reconfigure notice: its socket, ``(quorum_id, broken, left_out)`` and when. During a
        failure every heartbeat of a member that has not asked yet is due a notice; answering each of them with it
        (8,000 a second at 1,024 members) took the loop from the survivors' quorum requests."""

    def retire(self, member: str, code: int, message: bytes) -> None:
        """Close ``member``'s socket (it left, or a new incarnation replaced it): its close counts for nothing."""
        socket = self.sockets.pop(member, None)
        if socket is not None and not socket.closed:
            asyncio.get_running_loop().create_task(socket.close(code=code, message=message)).add_done_callback(consume)

    def _speaks(self, request: web.Request, member: str) -> bool:
        """Whether the request's incarnation still speaks for ``member`` (not replaced, not left)."""
        try:
            self.authenticate(request, member)
        except RequestError:
            return False
        return True

    async def close_all(self) -> None:
        """Close every socket: the lighthouse shuts down."""
        closing = [ws.close(code=WSCloseCode.GOING_AWAY, message=b"shutting down") for ws in self.sockets.values()]
        await asyncio.gather(*closing, return_exceptions=True)

    async def serve(self, request: web.Request) -> web.WebSocketResponse:
        member = parse_member(request.query.get("member"))
        self.authenticate(request, member)
        limit = self.balanced_bytes if self.state.balance_every else MAX_HEARTBEAT_BYTES
        ws = web.WebSocketResponse(max_msg_size=limit, timeout=1.0)
        await ws.prepare(request)
        if request.transport is not None and (raw := request.transport.get_extra_info("socket")) is not None:
            self.demote(raw)
        previous = self.sockets.get(member)
        self.sockets[member] = ws
        if previous is not None:
            await previous.close(code=WSCloseCode.POLICY_VIOLATION, message=b"replaced by a newer heartbeat socket")
        if self.stopping():
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"lighthouse shutting down")
            return ws
        if self.sockets.get(member) is not ws or not self._speaks(request, member):
            # it left (or was replaced) while the socket opened: the socket is not a sign of life
            if self.sockets.get(member) is ws:
                del self.sockets[member]
            await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"this incarnation has no more say")
            return ws
        self.state.connected(member, time.time())
        self.advance()
        spoke = False
        asks: set[asyncio.Task[None]] = set()
        """The quorum requests of this socket being answered."""
        counted: tuple[str, int] | None = None
        """The last heartbeat text counted in full without a refusal, and the quorum then: the same text again in the
        same quorum is only a sign of life (:meth:`LighthouseState.heard_again`)."""
        try:
            async for message in ws:
                # no await from this check to the state's: a leave (which retires this socket) cannot come between
                if self.stopping() or self.sockets.get(member) is not ws:
                    break
                if message.type != WSMsgType.TEXT:
                    await send(ws, {"type": "error", "error": "heartbeats must be JSON text messages"})
                    continue
                spoke = True
                if message.data.startswith(ASK_PREFIX):
                    await self._take_ask(ws, member, message.data, asks)
                    continue
                quorum = self.state.quorum
                seen = (message.data, -1 if quorum is None else quorum.quorum_id)
                if seen != counted or not self.state.heard_again(member, time.time()):
                    counted = None
                    reading = read_heartbeat(message.data, member, self.state.incarnation(member), self.metrics,
                                             self.rounds)  # fmt: skip
                    errors = list(reading.errors)
                    refused = reading.applied_step is None
                    if reading.applied_step is not None:
                        try:
                            step, digest, weights = reading.applied_step, reading.digest, reading.weights
                            if self.state.heartbeat(member, step, time.time(), digest, weights) and not errors:
                                counted = seen
                        except RequestError as error:
                            errors.append(error.message)
                            refused = True
                    self.deliver_refusals()
                    for text in errors:
                        await send(ws, {"type": "error", "error": text})
                    if refused:
                        continue
                quorum = self.state.quorum
                if quorum is None:
                    continue
                if self.state.should_reconfigure(member):
                    broken = self.state.quorum_broken
                    if self._notice_due(member, ws, (quorum.quorum_id, broken, False)):
                        await send(ws, self._reconfigure_notice(quorum.quorum_id, broken))
                elif self.state.left_out(member) and self._notice_due(member, ws, (quorum.quorum_id, False, True)):
                    await send(ws, {"type": "reconfigure", "quorum_id": quorum.quorum_id, "left_out": True})
        finally:
            for ask in asks:  # a long poll on a closed socket: nobody reads its answer
                ask.cancel()
            if self._noticed.get(member, (None,))[0] is ws:
                del self._noticed[member]
            if self.sockets.get(member) is ws:
                del self.sockets[member]
                if not self.stopping():
                    # a socket its member closed to reconnect, or one that carried no heartbeat (a reconnection
                    # abandoned while the lighthouse did not answer), is no sign of death
                    reconnecting = not spoke or ws.close_code == HEARTBEAT_RECONNECT_CODE
                    self.state.disconnected(member, time.time(), reconnecting=reconnecting)
                    self.advance()
        return ws

    async def _take_ask(
        self, socket: web.WebSocketResponse, member: str, text: str, asks: set[asyncio.Task[None]]
    ) -> None:
        """Start answering a quorum request sent on ``member``'s heartbeat socket; a bad one is answered with its
        error (4xx) at once and the socket serves on."""
        try:
            ask_id, quorum_request = parse_ask(text)
        except RequestError as error:
            await socket.send_str(answer_message(error.details.get("ask", -1), error.status, error_body(error)))
            return
        refusal = None
        if quorum_request.member != member:
            refusal = RequestError(
                403, f"this heartbeat socket is member {member!r}'s, the request is {quorum_request.member!r}'s"
            )
        elif len(asks) >= MAX_SOCKET_ASKS:
            refusal = RequestError(429, f"{MAX_SOCKET_ASKS} quorum requests of this socket are in flight already")
        if refusal is not None:
            await socket.send_str(answer_message(ask_id, refusal.status, error_body(refusal)))
            return
        task = asyncio.get_running_loop().create_task(self._answer_ask(socket, ask_id, quorum_request))
        asks.add(task)
        task.add_done_callback(asks.discard)
        task.add_done_callback(consume)

    async def _answer_ask(self, socket: web.WebSocketResponse, ask_id: int, quorum_request: QuorumRequest) -> None:
        """Answer a quorum request that came on ``socket`` (its member's heartbeat socket, authenticated when it
        opened) with what ``POST /v1/quorum`` would answer, status included."""
        try:
            status, body = 200, await self.answer_quorum(quorum_request)
            self.metrics.quorum_requests.labels(via="socket").inc()
        except RequestError as error:
            status, body = error.status, error_body(error)
        except Exception:  # what aiohttp does for a request: log it, answer 500, serve on
            logger.exception("answering the quorum request of %s on its heartbeat socket failed", quorum_request.member)
            status, body = 500, error_body(RequestError(500, "internal error answering the quorum request"))
        if not socket.closed:
            await socket.send_str(answer_message(ask_id, status, body))

    def push_reconfigure(self) -> None:
        """Tell the members of the current quorum at once that it must come to a boundary, once per quorum and cause.

        A member died: every survivor is told (with whom it lost), so that
        one blocked in a collective with a peer that is not the dead member
        (the peer left it on its own error) abandons it instead of waiting for
        its timeout. A joiner waits: the members not asking yet are told, so
        that it joins at their next step rather than after their next
        heartbeat (a quarter of the heartbeat timeout by default).
        """
        quorum = self.state.quorum
        if quorum is None or not self.state.reconfigure_pending:
            return
        broken = self.state.quorum_broken
        if (quorum.quorum_id, broken) in self._pushed:
            return
        self._pushed.add((quorum.quorum_id, broken))
        message = json.dumps(self._reconfigure_notice(quorum.quorum_id, broken))
        now = time.monotonic()
        sockets = []
        for member in quorum.members:
            socket = self.sockets.get(member)
            if socket is None or socket.closed or not (broken or self.state.should_reconfigure(member)):
                continue
            self._noticed[member] = (socket, (quorum.quorum_id, broken, False), now)
            sockets.append(socket)
        asyncio.get_running_loop().create_task(push(sockets, message)).add_done_callback(consume)

    def _reconfigure_notice(self, quorum_id: int, broken: bool) -> dict[str, Any]:
        """The notice that calls quorum ``quorum_id``'s members to a boundary (naming whom it lost when broken)."""
        notice: dict[str, Any] = {"type": "reconfigure", "quorum_id": quorum_id, "broken": broken}
        if broken:
            notice["down"] = self.state.broken_by
        return notice

    def _notice_due(self, member: str, socket: web.WebSocketResponse, key: tuple[int, bool, bool]) -> bool:
        """Whether ``member``'s heartbeat answer carries the reconfigure notice ``key``: not when its socket got the
        same one less than ``RENOTICE_S`` ago (then it is recorded as sent now)."""
        now = time.monotonic()
        last = self._noticed.get(member)
        if last is not None and last[0] is socket and last[1] == key and now - last[2] < RENOTICE_S:
            return False
        self._noticed[member] = (socket, key, now)
        return True

    def deliver_refusals(self) -> None:
        """Tell members whose reports were refused after the event that made them (their replay took slices)."""
        for member, text in self.state.take_refusals():
            socket = self.sockets.get(member)
            if socket is not None and not socket.closed:
                task = asyncio.get_running_loop().create_task(send(socket, {"type": "error", "error": text}))
                task.add_done_callback(consume)


async def push(sockets: list[web.WebSocketResponse], message: str) -> None:
    """Send ``message`` on each socket, in one task: a send whose transport takes it without waiting completes at
    once, so only a socket whose peer stopped reading (its transport's buffer over ``PUSH_BUFFERED`` bytes) gets a
    task of its own, never holding up the others. A task per socket cost 4,096 tasks per failure at 4,096 members.
    The task yields to the loop every ``PUSH_PER_ITERATION`` sockets."""
    loop = asyncio.get_running_loop()
    for number, member_socket in enumerate(sockets, start=1):
        if number % PUSH_PER_ITERATION == 0:
            await asyncio.sleep(0)  # let requests in between (a /healthz, a store read): 4,096 sends took 200 ms
        if member_socket.closed:
            continue
        transport = member_socket.get_extra_info("transport")
        if transport is None or transport.get_write_buffer_size() > PUSH_BUFFERED:
            loop.create_task(member_socket.send_str(message)).add_done_callback(consume)
            continue
        with contextlib.suppress(*SOCKET_ERRORS):
            await member_socket.send_str(message)


def consume(task: asyncio.Task[Any]) -> None:
    """Retrieve a push's outcome: a member whose socket closed meanwhile misses it, and nothing else happens."""
    if not task.cancelled():
        task.exception()


def error_body(error: RequestError) -> bytes:
    return json.dumps(error.to_json()).encode()


async def send(socket: web.WebSocketResponse, message: dict[str, Any]) -> None:
    """Send a message on a member's socket; a socket closing meanwhile misses it (the member is gone)."""
    with contextlib.suppress(*SOCKET_ERRORS):
        await socket.send_json(message)

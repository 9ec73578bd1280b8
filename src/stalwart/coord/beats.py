"""A member's heartbeat: one websocket to the lighthouse, the latest report on it every interval.

Heartbeats are the latest value, not a queue: each goes with a websocket ping,
and the next is sent only once the lighthouse answered the ping (it read
everything before); a socket left without an answer for the client's
``silence_timeout`` is closed with
:data:`~stalwart.coord.protocol.HEARTBEAT_RECONNECT_CODE` (the lighthouse
does not count that as a death) and opened again, with bounded backoff. What
comes back on the socket: the reconfigure notices
(:mod:`~stalwart.coord.notices`), the answers to quorum requests sent on it
(:mod:`~stalwart.coord.asks`), and refusals of reports, logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Protocol

import aiohttp

from stalwart.coord.asks import MAX_ANSWER_BYTES, SocketAsks
from stalwart.coord.notices import Notices
from stalwart.coord.protocol import HEARTBEAT_PATH, HEARTBEAT_RECONNECT_CODE, SECRET_HEADER
from stalwart.coord.registration import Registration
from stalwart.coord.reports import MemberReport
from stalwart.errors import LighthouseError

logger = logging.getLogger("stalwart.coord.client")
"""The client's logger: a member's connection to the lighthouse logs in one place."""

MIN_BACKOFF = 0.05
"""The first pause before a lost heartbeat socket is opened again (it doubles up to the client's ``retry_cap``)."""
CLOSE_S = 1.0
"""How long closing a heartbeat socket waits for the lighthouse's close frame."""


class HeartbeatHost(Protocol):
    """What the heartbeat needs of its client (:class:`~stalwart.coord.client.LighthouseClient`)."""

    member: str
    url: str
    heartbeat_connected: threading.Event
    notices: Notices
    registration: Registration
    report: MemberReport
    socket_asks: SocketAsks

    @property
    def session(self) -> aiohttp.ClientSession: ...

    @property
    def leaving(self) -> bool: ...

    @property
    def silence_timeout(self) -> float: ...

    @property
    def retry_cap(self) -> float: ...

    @property
    def effective_heartbeat_interval(self) -> float: ...

    def lose_path(self, reason: str) -> None: ...

    def heard(self) -> None: ...


class HeartbeatLoop:
    """The heartbeat of ``host``'s member (:meth:`run`, a task on the client's loop)."""

    def __init__(self, host: HeartbeatHost) -> None:
        self.host = host

    async def run(self) -> None:
        """Keep the socket open, reconnecting with bounded backoff, until the member leaves or is refused."""
        backoff = MIN_BACKOFF
        while not self.host.leaving:
            headers: dict[str, str] = {}
            try:
                headers = await self.host.registration.headers()
                async with asyncio.timeout(self.host.silence_timeout):  # the handshake: answered, or the path is dead
                    socket = await self.host.session.ws_connect(
                        self.host.url + HEARTBEAT_PATH,
                        params={"member": self.host.member},
                        headers=headers,
                        heartbeat=None,
                        autoping=False,  # the pongs are the lighthouse's answers (see _beat)
                        timeout=aiohttp.ClientWSTimeout(ws_close=CLOSE_S),
                        max_msg_size=MAX_ANSWER_BYTES,
                    )
                async with socket:
                    backoff = MIN_BACKOFF
                    self.host.heartbeat_connected.set()
                    self.host.socket_asks.attach(socket)
                    if await self._beat(socket):
                        self.host.socket_asks.detach()  # before the close, which may wait: nothing more is asked on it
                        self.host.lose_path(f"no answer on the heartbeat socket for {self.host.silence_timeout:g} s")
                        await socket.close(code=HEARTBEAT_RECONNECT_CODE, message=b"no answer: reconnecting")
            except asyncio.CancelledError:
                raise
            except aiohttp.WSServerHandshakeError as error:
                if error.status == 410:  # this incarnation left
                    return
                if error.status == 403:
                    self.host.registration.forget(headers.get(SECRET_HEADER))
                logger.debug("heartbeat of %s refused (%s); reconnecting", self.host.member, error)
            except LighthouseError as error:
                if self.host.registration.refused is not None:
                    logger.error(
                        "%s: the lighthouse refuses this process; no more heartbeats (%s)", self.host.member, error
                    )
                    return
                logger.warning("heartbeat of %s cannot register (%s); retrying", self.host.member, error)
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as error:
                logger.debug("heartbeat of %s lost (%s); reconnecting", self.host.member, error)
                self.host.lose_path(describe_error(error))
            except Exception:
                logger.exception("heartbeat of %s failed; reconnecting", self.host.member)
            finally:
                self.host.socket_asks.detach()
                self.host.heartbeat_connected.clear()
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, self.host.retry_cap)

    async def _beat(self, socket: aiohttp.ClientWebSocketResponse) -> bool:
        """Send the latest report every interval until the socket closes; True when the lighthouse stopped answering.

        Each report goes with a ping; the next only once the pong came back (the lighthouse read the report), so a
        dead path holds one report, never a queue: the report sent next is the latest. A report unanswered for
        :attr:`silence_timeout` gives the socket up.
        """
        assert self.host.report.applied_step is not None
        answered = asyncio.Event()
        answered.set()
        receiver = asyncio.create_task(self._receive(socket, answered))
        sent = time.monotonic()
        try:
            while not receiver.done():
                if self.host.leaving:  # the lighthouse closes the socket once the leave is in
                    await receiver
                    return False
                if answered.is_set():
                    answered.clear()
                    await socket.send_json(self.host.report.message())
                    await socket.ping()
                    sent = time.monotonic()
                elif time.monotonic() - sent > self.host.silence_timeout:
                    return True
                await asyncio.wait({receiver}, timeout=self.host.effective_heartbeat_interval)
            return False
        finally:
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)

    async def _receive(self, socket: aiohttp.ClientWebSocketResponse, answered: asyncio.Event) -> None:
        async for message in socket:
            if message.type == aiohttp.WSMsgType.PONG:
                answered.set()
                self.host.heard()
                continue
            if message.type == aiohttp.WSMsgType.PING:
                await socket.pong(message.data)
                continue
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            try:
                data = json.loads(message.data)
            except ValueError:
                logger.warning("lighthouse sent a message that is not JSON: %r", message.data)
                continue
            if not isinstance(data, dict):
                continue
            if data.get("type") == "reconfigure":
                self.host.notices.receive(data)
            elif data.get("type") == "answer":
                self.host.socket_asks.answered(data, len(message.data))
            elif data.get("type") == "error":
                logger.warning("lighthouse refused a heartbeat of %s: %s", self.host.member, data.get("error"))


def describe_error(error: BaseException) -> str:
    """What went wrong, in a few words (aiohttp's timeouts have no message)."""
    return str(error) or type(error).__name__

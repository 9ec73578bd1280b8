"""The lighthouse client each worker runs: heartbeats in the background, quorum requests on demand.

:class:`LighthouseClient` owns an asyncio loop in a daemon thread. Each
client is one *incarnation* of its member (``uuid4().hex``, new per process
start): before anything else it registers (``POST /v1/register``) and gets a
secret that authenticates its later calls; when the lighthouse answers that it
does not know the incarnation (it restarted without its state), the client
registers again transparently. The
heartbeat keeps a websocket open (``GET /v1/heartbeat``), sends the worker's
``applied_step`` every ``heartbeat_interval`` (by default a quarter of the
lighthouse's ``heartbeat_timeout``: 0.5 s) and reconnects with bounded
backoff when the lighthouse restarts (once the worker was healed, each
heartbeat also carries its heal totals: :meth:`LighthouseClient.report_heal`);
a ``{"type": "reconfigure"}`` push sets
the thread-safe :attr:`LighthouseClient.reconfigure_requested` flag that the
worker folds into its next all-reduce. The worker's main thread calls the
synchronous methods (``quorum``, ``status``, ``leave``), which run on the
client's loop.

A registration of a member whose old process is still alive (409
``member_alive``) or that comes too fast (429 ``rate_limited``) is asked again
for up to ``register_timeout``. An ``https://`` lighthouse is verified with
``ca_file`` (else ``STALWART_LIGHTHOUSE_CA``, else the system's trust store);
a token sent in cleartext to another machine is warned about. Every message
is built and read with :mod:`stalwart.coord.protocol`.

A client given the job's ``plan`` sends it with its registration: a
lighthouse started without one adopts it, one with a plan refuses a different
one (:class:`LighthouseError`, status 409, ``body["code"] == "plan_mismatch"``
and ``body["differences"]``). ``leave`` stops the heartbeat first, so that
nothing it sends after the leave makes the member alive again.

Its parts: ``registration`` (the secret, :mod:`~stalwart.coord.registration`),
``report`` (what the heartbeat reports, :mod:`~stalwart.coord.reports`),
``notices`` (the reconfigure notices, :mod:`~stalwart.coord.notices`), the
heartbeat loop (:mod:`~stalwart.coord.beats`) and the quorum requests sent on
its socket (``socket_asks``, :mod:`~stalwart.coord.asks`).

The Manager passes its settings as plain seconds; timeout messages name them
and their environment variables (:data:`QUORUM_TIMEOUT_SETTING`,
:data:`CONNECT_TIMEOUT_SETTING`).

Dead paths (a link down, a lighthouse that stopped answering) are given up
fast, and a path that comes back is used at once:

- every request has a connect timeout (one attempt:
  :attr:`LighthouseClient.connect_attempt_timeout`, twice the heartbeat
  interval, at least 1 s) and a read timeout (``request_timeout``; a quorum
  request's long poll: what is left of its ``timeout``); each request opens its
  own connection, so none is reused after its path died (a pooled keep-alive
  connection would carry the next request into TCP's retransmission backoff),
  except a quorum request while the heartbeat socket is open: it is sent on
  that socket (:mod:`stalwart.coord.asks`), whose path the heartbeat watches;
- a quorum request that fails is asked again on a fresh connection after a
  pause that grows up to 0.1 s, or the heartbeat interval the lighthouse
  asks for when that is longer (:attr:`LighthouseClient.retry_cap`), and
  one in flight is given up (and asked again) as soon as the heartbeat
  finds the path dead;
- heartbeats are the latest value, not a queue: each goes with a websocket
  ping, and the next is sent only once the lighthouse answered the ping (it
  read everything before); a socket left without an answer for
  :attr:`LighthouseClient.silence_timeout` (four heartbeat intervals, at least
  2 s) is closed with :data:`~stalwart.coord.protocol.HEARTBEAT_RECONNECT_CODE`
  (the lighthouse does not count that as a death) and opened again;
- the lighthouse becoming unreachable and reachable again is logged once per
  change; a quorum request that reached nothing within its timeout raises
  :class:`LighthouseUnreachable` naming the URL and the setting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import aiohttp

from stalwart._validate import check_int
from stalwart.coord.asks import SocketAsks
from stalwart.coord.beats import MIN_BACKOFF, HeartbeatLoop, describe_error
from stalwart.coord.notices import Notices
from stalwart.coord.protocol import (
    CHECKPOINT_PATH,
    LEAVE_PATH,
    QUORUM_PATH,
    REACH_PATH,
    SECRET_HEADER,
    CheckpointAnnouncement,
    HealPlan,
    QuorumAnswer,
    QuorumRequest,
    StaleAnswer,
    StoreAddress,
    bearer_headers,
    checkpoint_body,
    leave_body,
)
from stalwart.coord.registration import Registration
from stalwart.coord.reports import MemberReport, Report
from stalwart.coord.tls import client_context, warn_cleartext
from stalwart.coord.wire import RequestError, check_seconds, optional_seconds, parse_member
from stalwart.data.plan import EpochPlan
from stalwart.errors import LighthouseError, LighthouseUnreachable

__all__ = [
    "CONNECT_TIMEOUT_SETTING",
    "QUORUM_TIMEOUT_SETTING",
    "CheckpointAnnouncement",
    "HealPlan",
    "LighthouseClient",
    "LighthouseError",
    "LighthouseUnreachable",
    "QuorumAnswer",
    "StaleAnswer",
    "StoreAddress",
]

logger = logging.getLogger(__name__)

MAX_BACKOFF = 0.5
"""The longest pause (seconds) between tries to reach the lighthouse (``wait_reachable``); the first is
``MIN_BACKOFF``."""
MIN_CONNECT_S = 1.0
"""Floor of one connection attempt's timeout (a SYN lost on a dead path is retransmitted after 1 s)."""
MIN_SILENCE_S = 2.0
"""Floor of how long the heartbeat socket may go without the lighthouse's answer before it is reopened."""
_RETRIED_STATUSES = frozenset({408, 502, 503, 504})
"""Answers a quorum request is asked again after, until its timeout: the long poll's end, and a lighthouse (or a
proxy before it) that cannot answer now."""
QUORUM_TIMEOUT_SETTING = "the Manager's quorum_timeout, or the STALWART_QUORUM_TIMEOUT environment variable"
CONNECT_TIMEOUT_SETTING = "the Manager's connect_timeout, or the STALWART_CONNECT_TIMEOUT environment variable"
T = TypeVar("T")


class LighthouseClient:
    """One worker's connection to the lighthouse at ``url``, as member ``member``."""

    def __init__(
        self,
        url: str,
        member: str,
        *,
        token: str | None = None,
        heartbeat_interval: float | None = None,
        request_timeout: float = 10.0,
        plan: EpochPlan | None = None,
        ca_file: str | os.PathLike[str] | None = None,
        register_timeout: float = 60.0,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        try:
            self.member = parse_member(member)
        except RequestError as error:
            raise ValueError(error.message) from None
        if token is not None and (not isinstance(token, str) or not token):
            raise ValueError("token must be a non-empty string or None")
        if plan is not None and not isinstance(plan, EpochPlan):
            raise TypeError(f"plan must be an EpochPlan or None, got {plan!r} ({type(plan).__name__})")
        self.plan = plan
        """The plan this member trains with, sent with its registration (None: the lighthouse's is taken)."""
        self.url = url.rstrip("/")
        self.heartbeat_interval = optional_seconds("heartbeat_interval", heartbeat_interval)
        """Seconds between heartbeats; None: a ``BEATS_PER_TIMEOUT``-th of the lighthouse's heartbeat timeout."""
        self.request_timeout = check_seconds("request_timeout", request_timeout)
        self.register_timeout = check_seconds("register_timeout", register_timeout)
        """How long a registration is retried while the member's old process lives or registrations are limited."""
        self.token = token
        self.ssl_context = client_context(self.url, ca_file)
        """What verifies the lighthouse's certificate (None over plain HTTP); the quorum's store uses it too."""
        warn_cleartext(self.url, token)
        self.notices = Notices()
        """What the lighthouse told this member on its heartbeat socket (:mod:`~stalwart.coord.notices`)."""
        self.heartbeat_connected = threading.Event()
        """Set while the heartbeat websocket is open."""
        self._headers = bearer_headers(token)
        self.incarnation = uuid.uuid4().hex
        """This process's incarnation of the member (registered with the lighthouse on first use)."""
        self.registration = Registration(
            self.member, self.incarnation, plan, self.register_timeout, self._headers, self._request
        )
        """This incarnation's secret, registered when a call needs it (:mod:`~stalwart.coord.registration`)."""
        self._leaving = False
        self._answer: QuorumAnswer | None = None
        """The last quorum answer: the next request names it (``known``) so the next answer can be a delta."""
        self.report = MemberReport()
        """What this member reports: its step, heals and rounds (:mod:`~stalwart.coord.reports`)."""
        self._heartbeat = HeartbeatLoop(self)
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._closed = False
        self._reachability = _Reachability(self.url)
        self.socket_asks = SocketAsks()
        """Quorum requests sent on the heartbeat socket while it is open (see :mod:`stalwart.coord.asks`)."""
        self._path_lost: asyncio.Future[None] | None = None
        """Done when the heartbeat finds the path to the lighthouse dead (then replaced): quorum requests in flight
        give up their connection and ask again."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"lighthouse-client-{member}", daemon=True)
        self._thread.start()
        self._session: aiohttp.ClientSession = self._run(self._open_session())

    @property
    def reconfigure_requested(self) -> bool:
        """True once the lighthouse asked the quorum to come to a step boundary; ``quorum()`` clears it."""
        return self.notices.reconfigure_requested

    # --- synchronous API (worker threads) --------------------------------------------------------

    @property
    def quorum_broken(self) -> bool:
        """True once the lighthouse reported a member of this member's quorum dead (cleared by ``quorum()``)."""
        return self.notices.quorum_broken

    @property
    def quorum_down(self) -> tuple[str, ...]:
        """The members the lighthouse named when it reported this member's quorum broken (cleared by ``quorum()``;
        empty before, or from a lighthouse that does not name them)."""
        return self.notices.down

    @property
    def connect_attempt_timeout(self) -> float:
        """One connection attempt's timeout (s): twice the heartbeat interval, at least ``MIN_CONNECT_S``, at most
        ``request_timeout``; a failed attempt is followed by a fresh one."""
        return min(self.request_timeout, max(MIN_CONNECT_S, 2 * self.effective_heartbeat_interval))

    @property
    def silence_timeout(self) -> float:
        """How long (s) a heartbeat may go unanswered before its socket is given up: four heartbeat intervals, at
        least ``MIN_SILENCE_S``."""
        return max(MIN_SILENCE_S, 4 * self.effective_heartbeat_interval)

    @property
    def retry_cap(self) -> float:
        """The longest pause (s) before a failed request or heartbeat connection is tried again (see Registration)."""
        return max(MIN_BACKOFF, self.registration.retry_cap(self.heartbeat_interval))

    def wait_reachable(self, timeout: float = 60.0) -> None:
        """Return once the lighthouse answers ``GET /healthz``; :class:`LighthouseUnreachable` after ``timeout`` s.

        Workers call it first, so that a wrong address or a lighthouse that is
        not running is reported with the address and the refusal, not as a
        quorum that never forms.
        """
        timeout = check_seconds("timeout", timeout)
        gave_up = f"cannot reach the lighthouse at {self.url}; gave up after {timeout:g} s ({CONNECT_TIMEOUT_SETTING})"
        self._run(self._wait_reachable(time.monotonic() + timeout, timeout), timeout + self.request_timeout, gave_up)

    def start_heartbeat(self, get_applied_step: Callable[[], Report]) -> None:
        """Keep the heartbeat websocket open, reporting ``get_applied_step()`` (called on the client's thread).

        It returns the applied step, or ``(applied_step, digest)`` with the
        member's ``ledger_digest`` at that step: the lighthouse commits steps
        only on a matching digest; a balanced ledger adds its weights record,
        ``(applied_step, digest, weights)``. Quorum requests and ``leave`` for
        the same step carry the same digest and weights.
        """
        if not callable(get_applied_step):
            raise TypeError(f"get_applied_step must be callable, got {get_applied_step!r}")
        if self._heartbeat_task is not None:
            raise RuntimeError("the heartbeat is already running")
        self.report.applied_step = get_applied_step

        async def spawn() -> asyncio.Task[None]:
            return asyncio.create_task(self._heartbeat.run())

        self._heartbeat_task = self._run(spawn())

    def report_heal(self, nbytes: int, seconds: float) -> None:
        """Count a heal this worker loaded (``nbytes`` of state in ``seconds``); its heartbeats carry the totals."""
        nbytes = check_int("nbytes", nbytes, minimum=0)
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 <= seconds < math.inf:
            raise ValueError(f"seconds must be a finite number >= 0, got {seconds!r}")
        self.report.heals = self.report.heals.add(nbytes, float(seconds))

    def report_rounds(self, rounds: Callable[[], dict[str, Any]]) -> None:
        """Send ``rounds()`` (called on the client's thread) as every heartbeat's ``rounds`` field (DiLoCo's figures,
        see :mod:`stalwart.coord.rounds`)."""
        if not callable(rounds):
            raise TypeError(f"rounds must be callable, got {rounds!r}")
        self.report.rounds = rounds

    def quorum(
        self,
        applied_step: int,
        quorum_id: int | None,
        reason: str,
        timeout: float = 60.0,
        *,
        unreachable: Sequence[str] = (),
    ) -> QuorumAnswer:
        """Ask for the next quorum (long poll); asks again after 408s, 502-504s and connection errors until
        ``timeout`` seconds (the Manager's ``quorum_timeout``) passed, however long the lighthouse keeps it waiting.

        ``unreachable``: the members of this member's last quorum it could not
        reach (``docs/protocol.md``, "Reachability").

        Raises ``TimeoutError`` when no quorum formed in time (the message names
        ``quorum_timeout`` and ``STALWART_QUORUM_TIMEOUT``),
        :class:`LighthouseUnreachable` when the lighthouse did not answer
        meanwhile, and :class:`LighthouseError` when it refuses the request
        (``status`` 409 with ``body["quorum_id"]``: stale, ask with ``join``; 409
        ``plan_mismatch`` / ``no_plan`` at registration, see the module doc).
        """
        body = {"member": self.member, "applied_step": applied_step, "quorum_id": quorum_id, "reason": reason}
        body.update(self.report.at(applied_step))
        if isinstance(unreachable, str):
            raise TypeError(f"unreachable must be a sequence of member ids, not the string {unreachable!r}")
        if unreachable:
            body["unreachable"] = list(unreachable)
        try:
            body = QuorumRequest.from_json(body).to_body()
        except RequestError as error:
            raise ValueError(error.message) from None
        timeout = check_seconds("timeout", timeout)
        answer = self._run(
            self._ask_quorum(body, time.monotonic() + timeout, timeout),
            timeout + self.request_timeout,
            _no_quorum(self.member, timeout),
        )
        if self.member in answer.members:
            self._answer = answer
            self.notices.joined(answer.quorum_id)
        return answer

    def status(self) -> dict[str, Any]:
        """The lighthouse's ``/v1/status`` JSON."""
        return self._run(self._request("GET", "/v1/status"))

    def leave(self, applied_step: int | None = None) -> None:
        """Tell the lighthouse this member exits cleanly (it is counted as gone at once, never as a failure).

        ``applied_step`` reports the member's last step first: a short job can
        end between two heartbeats, and the ledger must still commit its steps.
        The heartbeat sends nothing after this is called (the lighthouse closes
        its socket, and refuses this incarnation from then on: 410 ``left``).
        """
        reported = {} if applied_step is None else self.report.at(applied_step)
        body = leave_body(self.member, applied_step, reported.get("digest"), reported.get("weights"))
        self._leaving = True
        self._run(self._authenticated_request("POST", LEAVE_PATH, body))

    def report_reached(self, peers: Sequence[str]) -> int:
        """Tell the lighthouse this member's probe got through to ``peers`` again (it was left out for its cuts);
        how many cuts that ended (``docs/protocol.md``, "Reachability")."""
        if isinstance(peers, str):
            raise TypeError(f"peers must be a sequence of member ids, not the string {peers!r}")
        body = {"member": self.member, "reached": list(peers)}
        answer = self._run(self._authenticated_request("POST", REACH_PATH, body))
        return int(answer.get("ended", 0))

    def report_checkpoint(self, step: int, path: str, ledger: dict[str, Any], digest: str) -> dict[str, Any]:
        """Tell the lighthouse that a durable checkpoint of ``step`` (its ledger and digest) lies at ``path``.

        Raises :class:`LighthouseError` when it is refused (409: the step is
        not committed yet, report it again later).
        """
        body = checkpoint_body(self.member, step, path, ledger, digest)
        return self._run(self._authenticated_request("POST", CHECKPOINT_PATH, body))

    def identity_headers(self) -> dict[str, str]:
        """The headers that authenticate this incarnation (registering first if needed), for tools and tests."""
        return self._run(self.registration.headers())

    def close(self) -> None:
        """Stop the heartbeat (its socket closes), any call in flight (it raises ``RuntimeError``) and the thread."""
        if self._closed:
            return
        self._run(self._shutdown())
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
        self._loop.close()

    def __enter__(self) -> LighthouseClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None, gave_up: str = "") -> T:
        """Run ``coroutine`` on the client's loop; past ``timeout`` it is cancelled and ``TimeoutError(gave_up)``
        raised (each coroutine bounds itself first: this is the backstop)."""
        if self._closed:
            coroutine.close()
            raise RuntimeError("the lighthouse client is closed")
        limit = self.request_timeout + 5.0 if timeout is None else timeout
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(limit)
        except aiohttp.ClientConnectionError as error:  # refused, reset, cut short: say where, in the library's terms
            raise LighthouseUnreachable(
                f"cannot reach the lighthouse at {self.url} ({describe_error(error)})"
            ) from None
        except concurrent.futures.CancelledError:  # close() ended it
            raise RuntimeError(f"the lighthouse client of {self.member} was closed while this call waited") from None
        except concurrent.futures.TimeoutError:
            if future.done():  # the coroutine's own TimeoutError, already worded
                raise
            future.cancel()
            raise TimeoutError(
                gave_up or f"the lighthouse at {self.url} did not answer within {limit:g} s (request_timeout)"
            ) from None

    # --- coroutines (the client's loop) ----------------------------------------------------------

    async def _open_session(self) -> aiohttp.ClientSession:
        self.registration.start()
        self._path_lost = asyncio.get_running_loop().create_future()
        # a connection per request: none outlives a dead path (see the module's doc)
        connector = aiohttp.TCPConnector(force_close=True, ssl=self.ssl_context or True)
        return aiohttp.ClientSession(connector=connector, timeout=self._timeouts(self.request_timeout))

    def _timeouts(self, read: float) -> aiohttp.ClientTimeout:
        """A request's timeouts: ``read`` in all and between reads, one connection attempt's to connect."""
        return aiohttp.ClientTimeout(total=read, sock_connect=self.connect_attempt_timeout, sock_read=read)

    def lose_path(self, reason: str) -> None:
        """The path to the lighthouse is dead: log it (once), and make quorum requests in flight ask again."""
        self._reachability.lost(reason, self.retry_cap)
        lost = self._path_lost
        if lost is not None and not lost.done():
            lost.set_result(None)
        self._path_lost = asyncio.get_running_loop().create_future()

    async def _shutdown(self) -> None:
        in_flight = asyncio.all_tasks() - {asyncio.current_task()}
        for task in in_flight:
            task.cancel()
        await asyncio.gather(*in_flight, return_exceptions=True)
        await self._session.close()

    async def _request(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        try:
            async with self._session.request(
                method, self.url + path, json=body, headers=self._headers, timeout=self._timeouts(self.request_timeout)
            ) as response:
                data = await _json(response)
        except asyncio.TimeoutError:
            raise self._no_answer(method, path) from None
        if response.status != 200:
            raise LighthouseError(response.status, data)
        return data

    def _no_answer(self, method: str, path: str) -> TimeoutError:
        return _NoAnswer(
            f"the lighthouse at {self.url} did not answer {method} {path} within {self.request_timeout:g} s "
            "(LighthouseClient's request_timeout)"
        )

    async def _wait_reachable(self, deadline: float, timeout: float) -> None:
        backoff = MIN_BACKOFF
        while True:
            left = min(self.request_timeout, deadline - time.monotonic())
            try:
                async with self._session.get(self.url + "/healthz", timeout=self._timeouts(max(left, 0.01))) as answer:
                    await answer.read()
                    self._reachability.answered()
                    return
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as error:
                reason = describe_error(error)
                if time.monotonic() + backoff >= deadline:
                    raise LighthouseUnreachable(
                        f"cannot reach the lighthouse at {self.url} ({reason}); gave up after {timeout:g} s "
                        f"({CONNECT_TIMEOUT_SETTING})"
                    ) from None
                self._reachability.lost(reason, MAX_BACKOFF)
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, MAX_BACKOFF)

    @property
    def leaving(self) -> bool:
        """Set by ``leave``: the heartbeat sends nothing more and does not reconnect."""
        return self._leaving

    @property
    def session(self) -> aiohttp.ClientSession:
        """The client's HTTP session (a connection per request; see the module's doc)."""
        return self._session

    def heard(self) -> None:
        """The lighthouse answered: it is reachable (logged once after it was not)."""
        self._reachability.answered()

    @property
    def effective_heartbeat_interval(self) -> float:
        """The interval heartbeats go at (:meth:`~stalwart.coord.registration.Registration.heartbeat_interval`)."""
        return self.registration.heartbeat_interval(self.heartbeat_interval)

    async def _authenticated_request(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        """A request with the identity headers; registers again once if the lighthouse forgot the incarnation."""
        for attempt in range(2):
            headers = await self.registration.headers()
            try:
                async with self._session.request(
                    method, self.url + path, json=body, headers=headers, timeout=self._timeouts(self.request_timeout)
                ) as response:
                    data = await _json(response)
            except asyncio.TimeoutError:
                raise self._no_answer(method, path) from None
            if response.status == 200:
                return data
            if attempt == 0 and response.status == 403 and data.get("code") == "unregistered":
                self.registration.forget(headers[SECRET_HEADER])
                continue
            raise LighthouseError(response.status, data)
        raise AssertionError("unreachable")

    async def _ask_quorum(self, body: dict[str, Any], deadline: float, timeout: float) -> QuorumAnswer:
        """Ask until answered; the request names the quorum this member holds, so the answer may be a delta.

        Each attempt goes on the heartbeat socket while it is open, else on a fresh connection; one the heartbeat
        finds cut off is given up and asked again; pauses between attempts grow up to :attr:`retry_cap`."""
        previous = self._answer
        body = {**body, "known": None if previous is None else previous.quorum_id}
        backoff = MIN_BACKOFF
        unreachable: str | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if unreachable is not None:
                    raise LighthouseUnreachable(
                        f"cannot reach the lighthouse at {self.url} ({unreachable}) to ask for a quorum; gave up "
                        f"after {timeout:g} s ({QUORUM_TIMEOUT_SETTING})"
                    )
                raise TimeoutError(_no_quorum(self.member, timeout))
            try:
                headers = await self.registration.headers()
                status, data = await self._post_quorum(body, headers, remaining)
            except aiohttp.ClientError as error:  # refused, reset, cut short (a restart), no connection in time
                unreachable = describe_error(error)
                self._reachability.lost(unreachable, self.retry_cap)
            except asyncio.TimeoutError:
                logger.debug("quorum request for %s timed out; asking again", self.member)
            except _PathLost:
                unreachable = f"no answer for {self.silence_timeout:g} s"
            else:
                unreachable = None
                self._reachability.answered()
                if status == 200:
                    self.registration.adopt_interval(data)
                    try:
                        return QuorumAnswer.from_json(data, previous, url=self.url)
                    except StaleAnswer as error:
                        logger.warning("%s: %s; asking for the whole answer", self.member, error)
                        body["known"] = previous = None
                        continue
                if status == 403 and data.get("code") == "unregistered":
                    self.registration.forget(headers[SECRET_HEADER])
                    continue
                if status not in _RETRIED_STATUSES:
                    raise LighthouseError(status, data)
                if status == 408:
                    continue
            await asyncio.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
            backoff = min(2 * backoff, self.retry_cap)

    async def _post_quorum(self, body: dict[str, Any], headers: dict[str, str], read: float) -> tuple[int, Any]:
        """One quorum request, on the heartbeat socket while it is open, else on its own connection: the status and
        JSON; :class:`_PathLost` when the heartbeat finds the path dead (or the socket closes) meanwhile (the
        request is abandoned, its connection closed)."""
        lost = self._path_lost
        assert lost is not None
        on_socket = self.socket_asks.message(body)

        async def post() -> tuple[int, Any]:
            if on_socket is not None:
                async with asyncio.timeout(read):
                    answer = await self.socket_asks.ask(*on_socket)
                if answer is None:  # the socket closed first
                    raise _PathLost
                return answer.status, answer.body
            async with self._session.post(
                self.url + QUORUM_PATH, json=body, headers=headers, timeout=self._timeouts(read)
            ) as response:
                return response.status, await _json(response)

        attempt = asyncio.ensure_future(post())
        either: set[asyncio.Future[Any]] = {attempt, lost}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if attempt.done():
            return attempt.result()
        attempt.cancel()
        await asyncio.gather(attempt, return_exceptions=True)
        raise _PathLost


class _NoAnswer(LighthouseUnreachable, TimeoutError):
    """A request the lighthouse did not answer within ``request_timeout`` (a timeout, retried where requests are)."""


class _PathLost(Exception):
    """The heartbeat found the path to the lighthouse dead while a request was in flight."""


class _Reachability:
    """Logs the lighthouse becoming unreachable, and reachable again, once per change (not per failed attempt)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.since: float | None = None
        """Since when (monotonic) nothing answered; None while the lighthouse answers."""

    def lost(self, reason: str, retry: float) -> None:
        if self.since is None:
            self.since = time.monotonic()
            logger.warning(
                "lighthouse at %s unreachable (%s); training goes on, retrying every %.2g s at most",
                self.url,
                reason,
                retry,
            )

    def answered(self) -> None:
        if self.since is not None:
            logger.warning("lighthouse at %s reachable again after %.1f s", self.url, time.monotonic() - self.since)
            self.since = None


def _no_quorum(member: str, timeout: float) -> str:
    return f"no quorum formed for {member!r} within {timeout:g} s ({QUORUM_TIMEOUT_SETTING})"


async def _json(response: aiohttp.ClientResponse) -> dict[str, Any]:
    """The response's JSON object, or ``{"error": text}`` when the body is not one."""
    text = await response.text()
    try:
        data = json.loads(text)
    except ValueError:
        return {"error": text}
    return data if isinstance(data, dict) else {"error": text}

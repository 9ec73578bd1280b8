"""The lighthouse client each worker runs: heartbeats in the background, quorum requests on demand.

:class:`LighthouseClient` owns an asyncio loop in a daemon thread. Each
client is one *incarnation* of its member (``uuid4().hex``, new per process
start): before anything else it registers (``POST /v1/register``) and gets a
secret that authenticates its later calls; when the lighthouse answers that it
does not know the incarnation (it restarted without its state), the client
registers again transparently. The
heartbeat keeps a websocket open (``GET /v1/heartbeat``), sends the worker's
``applied_step`` every ``heartbeat_interval`` and reconnects with bounded
backoff when the lighthouse restarts (once the worker was healed, each
heartbeat also carries its heal totals: :meth:`LighthouseClient.report_heal`);
a ``{"type": "reconfigure"}`` push sets
the thread-safe :attr:`LighthouseClient.reconfigure_requested` flag that the
worker folds into its next all-reduce. The worker's main thread calls the
synchronous methods (``quorum``, ``status``, ``leave``), which run on the
client's loop.

A client given the job's ``plan`` sends it with its registration: a
lighthouse started without one adopts it, one with a plan refuses a different
one (:class:`LighthouseError`, status 409, ``body["code"] == "plan_mismatch"``
and ``body["differences"]``). ``leave`` stops the heartbeat first, so that
nothing it sends after the leave makes the member alive again.

The Manager passes its settings as plain seconds; timeout messages name them
and their environment variables (:data:`QUORUM_TIMEOUT_SETTING`,
:data:`CONNECT_TIMEOUT_SETTING`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from stalwart._validate import check_int
from stalwart.coord.formation import MemberDelta, step_ledger
from stalwart.coord.heal_report import HEAL_FIELD, HealTotals
from stalwart.coord.hosted_ledger import ledger_digest
from stalwart.coord.rounds import ROUNDS_FIELD
from stalwart.coord.wire import QuorumRequest, RequestError, check_seconds, parse_member
from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan
from stalwart.errors import StalwartError

logger = logging.getLogger(__name__)

MIN_BACKOFF = 0.05
MAX_BACKOFF = 0.5
"""Reconnection backoff bounds (seconds): well under the default heartbeat timeout of 2 s."""
_RETRIED_STATUSES = frozenset({408, 502, 503, 504})
"""Answers a quorum request is asked again after, until its timeout: the long poll's end, and a lighthouse (or a
proxy before it) that cannot answer now."""
_STICKY_CODES = frozenset({"superseded", "plan_mismatch", "no_plan"})
"""Registration refusals that no retry can change: every later call raises the same error."""
QUORUM_TIMEOUT_SETTING = "the Manager's quorum_timeout, or the STALWART_QUORUM_TIMEOUT environment variable"
CONNECT_TIMEOUT_SETTING = "the Manager's connect_timeout, or the STALWART_CONNECT_TIMEOUT environment variable"
KEEPALIVE_S = 60.0
"""How long an idle connection to the lighthouse is kept for the next request (aiohttp's server keeps it 75 s)."""
INCARNATION_HEADER = "X-Stalwart-Incarnation"
SECRET_HEADER = "X-Stalwart-Secret"

T = TypeVar("T")
Report = int | tuple[int, str | None] | tuple[int, str | None, dict[str, Any] | None]
"""What ``start_heartbeat``'s callable returns: ``applied_step``, or ``(applied_step, ledger digest or None)``,
or ``(applied_step, digest, weights record or None)`` (a balanced ledger's ``weights_record()``)."""


class LighthouseError(StalwartError, RuntimeError):
    """The lighthouse refused a request: ``status`` and the JSON ``body`` (``body["error"]`` says why)."""

    def __init__(self, status: int, body: Mapping[str, Any]) -> None:
        super().__init__(f"lighthouse answered {status}: {body.get('error', body)}")
        self.status = status
        self.body = dict(body)


class LighthouseUnreachable(StalwartError, ConnectionError):
    """Nothing answered at the lighthouse's address within the time allowed (the message names both)."""


class StaleAnswer(StalwartError, ValueError):
    """A wire-2 answer's delta does not apply to the answer the member holds: ask again for the whole answer."""


@dataclass(frozen=True)
class StoreAddress:
    """Where the quorum's process group rendezvouses: a TCPStore and the quorum's key prefix."""

    host: str
    port: int
    prefix: str


@dataclass(frozen=True)
class CheckpointAnnouncement:
    """A durable checkpoint the quorum resumes from: its step, where it lies and its ledger's digest."""

    step: int
    path: str
    digest: str


@dataclass(frozen=True)
class HealPlan:
    """Who is behind and where their state comes from.

    ``source_rank``: the member that broadcasts it; ``checkpoint``: load it
    from that checkpoint instead (no live member held the job's state); both
    None: the state is lost.
    """

    source_rank: int | None
    targets: tuple[str, ...]
    checkpoint: CheckpointAnnouncement | None = None


@dataclass(frozen=True)
class QuorumAnswer:
    """The lighthouse's answer to ``POST /v1/quorum`` (see ``docs/protocol.md``)."""

    quorum_id: int
    members: tuple[str, ...]
    rank: int
    world_size: int
    store: StoreAddress
    applied_step: int
    heal: HealPlan | None
    ledger: dict[str, Any]

    @classmethod
    def from_json(cls, data: Any, previous: QuorumAnswer | None = None) -> QuorumAnswer:
        """Build from the decoded JSON answer, of either wire (``docs/protocol.md``); ``ValueError`` when it is not
        well formed.

        A wire-2 answer carries the ledger as the committed ledger plus the
        step's events, rebuilt here and checked against its digest; its members
        may come as a delta from ``previous`` (the answer the member holds):
        :class:`StaleAnswer` when that delta or digest does not fit it.
        """
        try:
            store = data["store"]
            heal = data["heal"]
            members = cls._members(data, previous)
            answer = cls(
                quorum_id=int(data["quorum_id"]),
                members=members,
                rank=int(data["rank"]),
                world_size=int(data["world_size"]),
                store=StoreAddress(str(store["host"]), int(store["port"]), str(store["prefix"])),
                applied_step=int(data["applied_step"]),
                heal=None
                if heal is None
                else HealPlan(
                    None if heal["source_rank"] is None else int(heal["source_rank"]),
                    tuple(str(member) for member in heal["targets"]),
                    None
                    if heal.get("checkpoint") is None
                    else CheckpointAnnouncement(
                        int(heal["checkpoint"]["step"]),
                        str(heal["checkpoint"]["path"]),
                        str(heal["checkpoint"]["digest"]),
                    ),
                ),
                ledger=cls._ledger(data, members, previous),
            )
        except StaleAnswer:
            raise
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"malformed quorum answer {data!r:.2000}: {error}") from error
        if answer.world_size != len(answer.members) or not 0 <= answer.rank < answer.world_size:
            raise ValueError(f"malformed quorum answer: rank {answer.rank} of members {list(answer.members)}")
        return answer

    @staticmethod
    def _members(data: Any, previous: QuorumAnswer | None) -> tuple[str, ...]:
        if "delta" not in data:
            return tuple(str(member) for member in data["members"])
        delta = data["delta"]
        if previous is None or previous.quorum_id != int(delta["from"]):
            held = None if previous is None else previous.quorum_id
            raise StaleAnswer(f"the answer is a delta from quorum {delta['from']}, but this member holds {held}")
        change = MemberDelta(int(delta["from"]), tuple(delta["removed"]), tuple(delta["added"]), False)
        return change.apply(previous.members)

    @staticmethod
    def _ledger(data: Any, members: tuple[str, ...], previous: QuorumAnswer | None) -> dict[str, Any]:
        """The ledger in the answer's step: as sent (wire 1), or rebuilt and checked against its digest (wire 2)."""
        ledger = data["ledger"]
        if "base" not in ledger:
            return dict(ledger)
        begun_by = ledger["begun_by"]
        if begun_by == "members":
            begun_by = members
        elif begun_by == "from":
            if previous is None:
                raise StaleAnswer("the answer's step began with the members of a quorum this member does not hold")
            begun_by = previous.members
        state = step_ledger(ledger["base"], begun_by, ledger["failed"]).state_dict()
        if ledger_digest(state) != ledger["digest"]:
            error = StaleAnswer if "delta" in data else ValueError
            raise error(f"the ledger rebuilt from the answer does not match its digest {ledger['digest']}")
        return state

    @property
    def member(self) -> str:
        """The member this answer was for."""
        return self.members[self.rank]

    def data_ledger(self) -> DataLedger:
        """The ledger in step ``applied_step``, as the lighthouse holds it."""
        return DataLedger.from_state_dict(self.ledger)


def _checkpoint_announcement(data: Any) -> CheckpointAnnouncement | None:
    if data is None:
        return None
    return CheckpointAnnouncement(int(data["step"]), str(data["path"]), str(data["digest"]))


class LighthouseClient:
    """One worker's connection to the lighthouse at ``url``, as member ``member``."""

    def __init__(
        self,
        url: str,
        member: str,
        *,
        token: str | None = None,
        heartbeat_interval: float = 0.1,
        request_timeout: float = 10.0,
        plan: EpochPlan | None = None,
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
        self.heartbeat_interval = check_seconds("heartbeat_interval", heartbeat_interval)
        self.request_timeout = check_seconds("request_timeout", request_timeout)
        self._reconfigure = threading.Event()
        self._broken = threading.Event()
        self.heartbeat_connected = threading.Event()
        """Set while the heartbeat websocket is open."""
        self._headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        self.incarnation = uuid.uuid4().hex
        """This process's incarnation of the member (registered with the lighthouse on first use)."""
        self._secret: str | None = None
        self._register_lock: asyncio.Lock | None = None
        self._refused: LighthouseError | None = None
        """A registration refusal no retry changes (superseded, another plan, no plan): raised by every call."""
        self._leaving = False
        """Set by ``leave``: the heartbeat sends nothing more and does not reconnect."""
        self._quorum_id: int | None = None
        self._answer: QuorumAnswer | None = None
        """The last quorum answer: the next request names it (``known``) so the next answer can be a delta."""
        self._recommended_interval = 0.0
        """The least heartbeat interval the lighthouse asked for (its register and quorum answers say)."""
        self._get_applied_step: Callable[[], Report] | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._heal_totals = HealTotals()
        self._rounds: Callable[[], dict[str, Any]] | None = None
        """What ``report_rounds`` gave: each heartbeat's ``rounds`` field (DiLoCo members)."""
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"lighthouse-client-{member}", daemon=True)
        self._thread.start()
        self._session: aiohttp.ClientSession = self._run(self._open_session())

    @property
    def reconfigure_requested(self) -> bool:
        """True once the lighthouse asked the quorum to come to a step boundary; ``quorum()`` clears it."""
        return self._reconfigure.is_set()

    # --- synchronous API (worker threads) --------------------------------------------------------

    @property
    def quorum_broken(self) -> bool:
        """True once the lighthouse reported a member of this member's quorum dead (cleared by ``quorum()``)."""
        return self._broken.is_set()

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
        self._get_applied_step = get_applied_step

        async def spawn() -> asyncio.Task[None]:
            return asyncio.create_task(self._heartbeat_forever())

        self._heartbeat_task = self._run(spawn())

    def report_heal(self, nbytes: int, seconds: float) -> None:
        """Count a heal this worker loaded (``nbytes`` of state in ``seconds``); its heartbeats carry the totals."""
        nbytes = check_int("nbytes", nbytes, minimum=0)
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 <= seconds < math.inf:
            raise ValueError(f"seconds must be a finite number >= 0, got {seconds!r}")
        self._heal_totals = self._heal_totals.add(nbytes, float(seconds))

    def report_rounds(self, rounds: Callable[[], dict[str, Any]]) -> None:
        """Send ``rounds()`` (called on the client's thread) as every heartbeat's ``rounds`` field (DiLoCo's figures,
        see :mod:`stalwart.coord.rounds`)."""
        if not callable(rounds):
            raise TypeError(f"rounds must be callable, got {rounds!r}")
        self._rounds = rounds

    def quorum(self, applied_step: int, quorum_id: int | None, reason: str, timeout: float = 60.0) -> QuorumAnswer:
        """Ask for the next quorum (long poll); asks again after 408s, 502-504s and connection errors until
        ``timeout`` seconds (the Manager's ``quorum_timeout``) passed, however long the lighthouse keeps it waiting.

        Raises ``TimeoutError`` when no quorum formed in time (the message names
        ``quorum_timeout`` and ``STALWART_QUORUM_TIMEOUT``),
        :class:`LighthouseUnreachable` when the lighthouse did not answer
        meanwhile, and :class:`LighthouseError` when it refuses the request
        (``status`` 409 with ``body["quorum_id"]``: stale, ask with ``join``; 409
        ``plan_mismatch`` / ``no_plan`` at registration, see the module doc).
        """
        body = {"member": self.member, "applied_step": applied_step, "quorum_id": quorum_id, "reason": reason}
        body.update(self._reported_at(applied_step))
        try:
            QuorumRequest.from_json(body)
        except RequestError as error:
            raise ValueError(error.message) from None
        timeout = check_seconds("timeout", timeout)
        answer = self._run(
            self._ask_quorum(body, time.monotonic() + timeout, timeout),
            timeout + self.request_timeout,
            _no_quorum(self.member, timeout),
        )
        if self.member in answer.members:
            self._quorum_id = answer.quorum_id
            self._answer = answer
            self._reconfigure.clear()
            self._broken.clear()
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
        body: dict[str, Any] = {"member": self.member}
        if applied_step is not None:
            body["applied_step"] = applied_step
            body.update(self._reported_at(applied_step))
        self._leaving = True
        self._run(self._authenticated_request("POST", "/v1/leave", body))

    def report_checkpoint(self, step: int, path: str, ledger: dict[str, Any], digest: str) -> dict[str, Any]:
        """Tell the lighthouse that a durable checkpoint of ``step`` (its ledger and digest) lies at ``path``.

        Raises :class:`LighthouseError` when it is refused (409: the step is
        not committed yet, report it again later).
        """
        body = {"member": self.member, "step": step, "path": path, "ledger": ledger, "digest": digest}
        return self._run(self._authenticated_request("POST", "/v1/checkpoint", body))

    def _report(self) -> dict[str, Any]:
        """The heartbeat callable's report as a message: ``applied_step``, and ``digest`` and ``weights`` if set."""
        assert self._get_applied_step is not None
        report = self._get_applied_step()
        step, digest, weights = (*report, None, None)[:3] if isinstance(report, tuple) else (report, None, None)
        message: dict[str, Any] = {"applied_step": int(step)}
        if digest is not None:
            message["digest"] = digest
        if weights is not None:
            message["weights"] = weights
        return message

    def _reported_at(self, applied_step: int) -> dict[str, Any]:
        """The reported ``digest`` and ``weights`` when the heartbeat reports ``applied_step`` too, else nothing."""
        if self._get_applied_step is None:
            return {}
        message = self._report()
        if message.pop("applied_step") != applied_step:
            return {}
        return message

    def identity_headers(self) -> dict[str, str]:
        """The headers that authenticate this incarnation (registering first if needed), for tools and tests."""
        return self._run(self._identity_headers())

    def close(self) -> None:
        """Stop the heartbeat (its socket closes) and the client's thread; safe to call twice."""
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
        except concurrent.futures.TimeoutError:
            if future.done():  # the coroutine's own TimeoutError, already worded
                raise
            future.cancel()
            raise TimeoutError(
                gave_up or f"the lighthouse at {self.url} did not answer within {limit:g} s (request_timeout)"
            ) from None

    # --- coroutines (the client's loop) ----------------------------------------------------------

    async def _open_session(self) -> aiohttp.ClientSession:
        self._register_lock = asyncio.Lock()
        # a quorum request after a failure reuses the connection of the last one (the lighthouse keeps it 75 s)
        connector = aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S)
        return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=self.request_timeout))

    async def _shutdown(self) -> None:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            await asyncio.gather(self._heartbeat_task, return_exceptions=True)
        await self._session.close()

    async def _request(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        try:
            async with self._session.request(method, self.url + path, json=body, headers=self._headers) as response:
                data = await _json(response)
        except asyncio.TimeoutError:
            raise self._no_answer(method, path) from None
        if response.status != 200:
            raise LighthouseError(response.status, data)
        return data

    def _no_answer(self, method: str, path: str) -> TimeoutError:
        return TimeoutError(
            f"the lighthouse at {self.url} did not answer {method} {path} within {self.request_timeout:g} s "
            "(LighthouseClient's request_timeout)"
        )

    async def _wait_reachable(self, deadline: float, timeout: float) -> None:
        backoff = MIN_BACKOFF
        warned = False
        while True:
            try:
                async with self._session.get(self.url + "/healthz") as response:
                    await response.read()
                    return
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as error:
                reason = str(error) or type(error).__name__
                if time.monotonic() + backoff >= deadline:
                    raise LighthouseUnreachable(
                        f"cannot reach the lighthouse at {self.url} ({reason}); gave up after {timeout:g} s "
                        f"({CONNECT_TIMEOUT_SETTING})"
                    ) from None
                if not warned:
                    logger.warning(
                        "lighthouse at %s unreachable (%s); retrying for up to %g s", self.url, reason, timeout
                    )
                    warned = True
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, MAX_BACKOFF)

    async def _identity_headers(self) -> dict[str, str]:
        """Bearer token, incarnation and secret headers; registers this incarnation first when needed."""
        assert self._register_lock is not None
        async with self._register_lock:
            if self._refused is not None:
                raise self._refused
            if self._secret is None:
                body: dict[str, Any] = {"member": self.member, "incarnation": self.incarnation}
                if self.plan is not None:
                    body["plan"] = self.plan.to_dict()
                try:
                    registered = await self._request("POST", "/v1/register", body)
                    self._secret = str(registered["secret"])
                    self._adopt_interval(registered)
                except LighthouseError as error:
                    if error.body.get("code") in _STICKY_CODES:
                        self._refused = error
                    raise
        return {**self._headers, INCARNATION_HEADER: self.incarnation, SECRET_HEADER: self._secret}

    def _adopt_interval(self, answer: Mapping[str, Any]) -> None:
        """Heartbeat no faster than the lighthouse asks (``heartbeat_interval`` in its answers, when it says)."""
        recommended = answer.get("heartbeat_interval")
        if isinstance(recommended, int | float) and not isinstance(recommended, bool) and 0 <= recommended < 3600:
            self._recommended_interval = float(recommended)

    @property
    def effective_heartbeat_interval(self) -> float:
        """The interval heartbeats go at: ``heartbeat_interval``, or longer when the lighthouse asks for it."""
        return max(self.heartbeat_interval, self._recommended_interval)

    def _forget_secret(self, secret: str | None) -> None:
        """Register again before the next call (the lighthouse no longer knows ``secret``)."""
        if self._secret == secret:
            self._secret = None

    async def _authenticated_request(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        """A request with the identity headers; registers again once if the lighthouse forgot the incarnation."""
        for attempt in range(2):
            headers = await self._identity_headers()
            try:
                async with self._session.request(method, self.url + path, json=body, headers=headers) as response:
                    data = await _json(response)
            except asyncio.TimeoutError:
                raise self._no_answer(method, path) from None
            if response.status == 200:
                return data
            if attempt == 0 and response.status == 403 and data.get("code") == "unregistered":
                self._forget_secret(headers[SECRET_HEADER])
                continue
            raise LighthouseError(response.status, data)
        raise AssertionError("unreachable")

    async def _ask_quorum(self, body: dict[str, Any], deadline: float, timeout: float) -> QuorumAnswer:
        """Ask until answered; the request names the quorum this member holds, so the answer may be a delta."""
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
                headers = await self._identity_headers()
                async with self._session.post(
                    self.url + "/v1/quorum",
                    json=body,
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=remaining),
                ) as response:
                    data = await _json(response)
                    unreachable = None
                    if response.status == 200:
                        self._adopt_interval(data)
                        try:
                            return QuorumAnswer.from_json(data, previous)
                        except StaleAnswer as error:
                            logger.warning("%s: %s; asking for the whole answer", self.member, error)
                            body["known"] = previous = None
                            continue
                    if response.status == 403 and data.get("code") == "unregistered":
                        self._forget_secret(headers[SECRET_HEADER])
                        continue
                    if response.status not in _RETRIED_STATUSES:
                        raise LighthouseError(response.status, data)
                    if response.status == 408:
                        continue
            except aiohttp.ClientError as error:  # refused, reset, or an answer cut short (the lighthouse restarts)
                if unreachable is None:
                    logger.warning("lighthouse at %s unreachable (%s); retrying", self.url, error)
                unreachable = str(error) or type(error).__name__
            except asyncio.TimeoutError:
                logger.debug("quorum request for %s timed out; asking again", self.member)
            await asyncio.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
            backoff = min(2 * backoff, MAX_BACKOFF)

    async def _heartbeat_forever(self) -> None:
        backoff = MIN_BACKOFF
        while not self._leaving:
            headers: dict[str, str] = {}
            try:
                headers = await self._identity_headers()
                async with self._session.ws_connect(
                    self.url + "/v1/heartbeat",
                    params={"member": self.member},
                    headers=headers,
                    heartbeat=None,
                    timeout=aiohttp.ClientWSTimeout(ws_close=1.0),
                ) as socket:
                    backoff = MIN_BACKOFF
                    self.heartbeat_connected.set()
                    await self._beat(socket)
            except asyncio.CancelledError:
                raise
            except aiohttp.WSServerHandshakeError as error:
                if error.status == 410:  # this incarnation left
                    return
                if error.status == 403:
                    self._forget_secret(headers.get(SECRET_HEADER))
                logger.debug("heartbeat of %s refused (%s); reconnecting", self.member, error)
            except LighthouseError as error:
                if self._refused is not None:
                    logger.error("%s: the lighthouse refuses this process; no more heartbeats (%s)", self.member, error)
                    return
                logger.warning("heartbeat of %s cannot register (%s); retrying", self.member, error)
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as error:
                logger.debug("heartbeat of %s lost (%s); reconnecting", self.member, error)
            except Exception:
                logger.exception("heartbeat of %s failed; reconnecting", self.member)
            finally:
                self.heartbeat_connected.clear()
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, MAX_BACKOFF)

    async def _beat(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        """Send the applied step every interval until the socket closes."""
        assert self._get_applied_step is not None
        receiver = asyncio.create_task(self._receive(socket))
        try:
            while not receiver.done():
                if self._leaving:  # the lighthouse closes the socket once the leave is in
                    await receiver
                    return
                message = self._report()
                heal = self._heal_totals
                if heal.heals:
                    message[HEAL_FIELD] = heal.to_json()
                if self._rounds is not None:
                    message[ROUNDS_FIELD] = self._rounds()
                await socket.send_json(message)
                await asyncio.wait({receiver}, timeout=self.effective_heartbeat_interval)
        finally:
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)

    async def _receive(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        async for message in socket:
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
                quorum_id = data.get("quorum_id")
                if data.get("left_out") is True:
                    # a newer quorum went on without this member: abandon what it runs and join again
                    if isinstance(quorum_id, int) and self._quorum_id is not None and quorum_id > self._quorum_id:
                        self._reconfigure.set()
                        self._broken.set()
                elif quorum_id is None or self._quorum_id is None or quorum_id == self._quorum_id:
                    self._reconfigure.set()
                    if data.get("broken") is True:
                        self._broken.set()
            elif data.get("type") == "error":
                logger.warning("lighthouse refused a heartbeat of %s: %s", self.member, data.get("error"))


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

"""The lighthouse HTTP server: aiohttp around :class:`~stalwart.coord.quorum.LighthouseState`.

Endpoints (``docs/protocol.md``): ``GET /healthz``, ``GET /v1/status``,
``POST /v1/register``, ``GET /v1/heartbeat?member=ID`` (websocket),
``POST /v1/quorum`` (long poll), ``POST /v1/leave`` and ``POST /v1/checkpoint``
(a member wrote a durable checkpoint), ``POST /v1/store/{quorum_id}`` (the
quorum store, :mod:`stalwart.coord.store`), and the dashboard's ``GET /``,
``GET /v1/events`` and ``GET /metrics`` (:mod:`stalwart.coord.dashboard`);
heartbeats, quorum requests, leaves and checkpoint reports carry the member's
incarnation and secret (:mod:`stalwart.coord.protocol`), store requests the
quorum's store key. Every event is handed to the pure state with the
wall-clock time; a periodic task (every ``tick_interval``) expires heartbeats
and join timeouts and forms quorums. The state is persisted
(:mod:`stalwart.coord.persist`) on a single save thread, off the event loop,
and the save is awaited before any quorum answer or registration leaves, so a
restarted lighthouse never forgets a quorum it announced; it fails closed: an
answer whose state could not be saved is not handed out (503, asked again),
until a save succeeds. Ledger commits reported by heartbeats are saved within
one tick (coalesced: a commit lost with the process is replayed identically
from the members' next heartbeats).

Safe on a shared network (``docs/design.md``, "Security model"): bound to an
address other than loopback it refuses to start without a token and TLS
(``tls_cert``/``tls_key``) unless told ``insecure``; every connection
must send its headers within a timeout and the open and unauthenticated
connections are capped (:mod:`stalwart.coord.connections`); a quorum long poll
per incarnation; client errors are logged once per kind per interval
(:mod:`stalwart.coord.quiet_log`); no request or message does more than a few
milliseconds of work on the event loop.

:class:`Lighthouse` runs the server in a background thread with its own event
loop (``start``/``stop``), so tests and launchers can embed it, or in the
foreground for the CLI (``serve_forever``).

Its parts: ``gate`` (the token and browser checks, :mod:`~stalwart.coord.gate`),
``heartbeats`` (the members' websockets, the notices and the quorum requests
sent on them, :mod:`~stalwart.coord.sockets`), ``waiters`` (the quorum long
polls, :mod:`~stalwart.coord.waiters`), ``saves`` (durability,
:mod:`~stalwart.coord.saves`); request bodies and the store's route are
:mod:`~stalwart.coord.bodies`'.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from typing import Any

from aiohttp import WSCloseCode, web

from stalwart.coord import quiet_log
from stalwart.coord.bodies import MAX_BODY_BYTES, json_body, serve_store
from stalwart.coord.collector import QuietCollector
from stalwart.coord.connections import RESERVED_FDS, ConnectionGuard, descriptor_limit
from stalwart.coord.dashboard import Dashboard
from stalwart.coord.gate import RequestGate, identity
from stalwart.coord.metrics import LighthouseMetrics
from stalwart.coord.persist import StateStore
from stalwart.coord.protocol import (
    BEATS_PER_TIMEOUT,
    CHECKPOINT_PATH,
    HEARTBEAT_PATH,
    LEAVE_PATH,
    QUORUM_PATH,
    REACH_PATH,
    REGISTER_PATH,
    STORE_PATH,
    QuorumRequest,
    parse_unreachable,
)
from stalwart.coord.quorum import (
    RequestError,
    parse_digest,
    parse_member,
    parse_step,
    parse_weights,
)
from stalwart.coord.rounds import RoundsBoard
from stalwart.coord.saves import Saves, load_state
from stalwart.coord.selector import LoopSelector
from stalwart.coord.settings import LighthouseSettings
from stalwart.coord.sockets import HeartbeatSockets
from stalwart.coord.store import QuorumStores
from stalwart.coord.tls import is_loopback, server_context
from stalwart.coord.turnstile import Turnstile
from stalwart.coord.waiters import QuorumWaiters
from stalwart.coord.wire import parse_plan
from stalwart.data.plan import EpochPlan

logger = logging.getLogger(__name__)

HEARTBEATS_PER_SECOND = 8192
"""The heartbeat rate the lighthouse plans for: with M members it recommends an interval of at least
``M / HEARTBEATS_PER_SECOND`` seconds (see :func:`recommended_heartbeat_interval`)."""
CATCH_UP_SLICES = 8
"""Extra slices of a report's replay per tick (each a few milliseconds, with the loop serving between them)."""
_REGISTER_FIELDS = frozenset({"member", "incarnation", "plan"})


class Lighthouse:
    """The lighthouse server: membership, quorums and the ledger of record, over HTTP.

    ``plan=None`` leaves the plan to the members: the lighthouse adopts the
    first plan a member registers with (and persists it like a configured one);
    a member offering another plan is refused, naming each differing field.
    With ``state_path`` the state lives in that SQLite file; when it already
    holds a state, that state (and its plan) is resumed and ``plan``, if
    given, must equal it; the file is locked while the lighthouse runs.
    ``port=0`` picks a free port (see ``port`` once started). The
    configuration is one validated :class:`~stalwart.coord.settings.LighthouseSettings`;
    keyword arguments name its fields (``Lighthouse(plan, join_timeout=30.0)``),
    replacing those of ``settings``.
    ``balance_every=K > 0`` balances the ledger: members' shares follow their
    measured throughput, decided every ``K`` steps (None: as persisted, else
    0, off; a persisted state must agree).

    On a ``host`` other than loopback a ``token`` and TLS (``tls_cert`` and
    ``tls_key``, PEM files: HTTPS) are required unless ``insecure=True``
    (:class:`~stalwart.errors.InsecureLighthouseError`); with ``insecure`` a token on such a
    host travels in cleartext (a warning says so). A ``tls_key`` its group or
    others may read is refused (:class:`~stalwart.coord.tls.ExposedSecretError`).
    ``max_connections`` (default: the process's file-descriptor limit less
    ``RESERVED_FDS``) and ``max_unauthenticated`` cap open connections;
    a connection that has not sent a request's headers ``header_timeout``
    seconds after it opened (or after its next request's first byte) is closed.
    """

    def __init__(
        self, plan: EpochPlan | None = None, settings: LighthouseSettings | None = None, **overrides: Any
    ) -> None:
        if plan is not None and not isinstance(plan, EpochPlan):
            raise TypeError(f"plan must be an EpochPlan or None, got {type(plan).__name__}")
        settings = LighthouseSettings.of(settings, overrides)
        self.settings = settings
        """The validated configuration (:class:`~stalwart.coord.settings.LighthouseSettings`)."""
        host, token = settings.host, settings.token
        cert, key = settings.tls_cert, settings.tls_key
        self._ssl = server_context(cert, key) if cert is not None and key is not None else None
        if token is not None and self._ssl is None and not is_loopback(host):
            logger.warning(
                "the lighthouse on %s takes its token over plain HTTP: anyone on the network can read it; give "
                "--tls-cert and --tls-key",
                host,
            )
        self.host = host
        self._requested_port = settings.port
        self.max_connections = settings.max_connections
        self.max_unauthenticated = settings.max_unauthenticated
        self.header_timeout = settings.header_timeout
        self.join_timeout = settings.join_timeout
        self.tick_interval = settings.tick_interval
        self.max_waiters = settings.max_waiters
        database = StateStore(settings.state_path) if settings.state_path is not None else None
        try:
            self.state = load_state(plan, settings, database)
        except BaseException:
            if database is not None:
                database.close()
            raise
        self.metrics = LighthouseMetrics()
        self.saves = Saves(self.state, database, self.metrics)
        """The state's durability: one save thread, awaited before an answer leaves (:mod:`~stalwart.coord.saves`)."""
        self.state.history.listener = self.metrics.on_history_event
        self.rounds = RoundsBoard(self.metrics.registry)
        """DiLoCo members' round figures, from their heartbeats (:mod:`stalwart.coord.rounds`)."""
        self._dashboard = Dashboard(
            self._status,
            lambda: self.state.revision,
            self.state.incarnation,
            self.metrics,
            port=lambda: self.port,
            secure=self._ssl is not None,
        )
        self._port: int | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._selector = LoopSelector()
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        self.guard: ConnectionGuard | None = None
        """The connection caps and header timeout (once started)."""
        self._ticker: asyncio.Task[None] | None = None
        self.stores = QuorumStores(settings.store_limits)
        """The current quorum's store."""
        self.heartbeats = HeartbeatSockets(
            self.state,
            self.metrics,
            self.rounds,
            authenticate=self._authenticate,
            advance=self._advance,
            answer_quorum=self._answer_quorum,
            stopping=lambda: self._stopping,
            balanced_bytes=MAX_BODY_BYTES,
            demote=self._selector.demote,
        )
        """The members' heartbeat sockets (:mod:`~stalwart.coord.sockets`)."""
        self.waiters = QuorumWaiters(self.max_waiters)
        """The quorum long polls held (:mod:`~stalwart.coord.waiters`)."""
        self.answers = Turnstile()  # the quorum answers, paced over the loop's iterations
        self.gate = RequestGate(token, is_loopback(host), lambda: self.port, lambda: self.guard)
        """The token and browser checks every request passes (:mod:`~stalwart.coord.gate`)."""
        self._collector: QuietCollector | None = None
        """Set by ``serve_forever`` (the process is the lighthouse's): full collections at quiet times only."""
        self._own_process = False
        """Set by ``serve_forever``: the process's file-descriptor limit is raised to its hard limit."""
        self._stopping = False

    # --- addresses -------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The HTTP port (once started)."""
        if self._port is None:
            raise RuntimeError("the lighthouse is not started; call start() first")
        return self._port

    @property
    def url(self) -> str:
        """``http(s)://host:port`` of the server (once started)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self._ssl is not None else 'http'}://{host}:{self.port}"

    # --- life cycle ------------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> None:
        """Serve in a background thread with its own event loop; returns once the server listens."""
        if self._thread is not None:
            raise RuntimeError("the lighthouse is already started")
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = self._selector.new_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._start())
            except BaseException as error:
                failure.append(error)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="stalwart-lighthouse", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise TimeoutError(f"the lighthouse did not start within {timeout} s")
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]

    def stop(self, timeout: float = 30.0) -> None:
        """Stop serving, close the websockets and the database; the state stays persisted."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            self.saves.close()
            return
        asyncio.run_coroutine_threadsafe(self._stop(), loop).result(timeout)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        self._thread = None
        self._loop = None

    def serve_forever(self) -> None:
        """Serve until SIGINT or SIGTERM (call from the main thread), then stop cleanly.

        The process is the lighthouse's: garbage collection pauses are kept out of failure handling
        (:mod:`stalwart.coord.collector`).
        """
        if self._thread is None:
            self._own_process = True
            self.start()
        collector = QuietCollector()
        collector.start()
        self._collector = collector
        stop = threading.Event()
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            while not stop.wait(0.5):
                pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.stop()

    def status(self, timeout: float = 10.0) -> dict[str, Any]:
        """``GET /v1/status``'s JSON, read on the server's loop (thread-safe)."""
        if self._loop is None:
            raise RuntimeError("the lighthouse is not started; call start() first")

        async def read() -> dict[str, Any]:
            return self._status()

        return asyncio.run_coroutine_threadsafe(read(), self._loop).result(timeout)

    def __enter__(self) -> Lighthouse:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def _start(self) -> None:
        quiet_log.install()
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(quiet_log.loop_exception_handler)
        app = web.Application(middlewares=[self.gate.middleware], client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/v1/status", self._get_status)
        app.router.add_get("/status", self._get_status)  # the short name people and scripts type
        app.router.add_post(REGISTER_PATH, self._register)
        app.router.add_get(HEARTBEAT_PATH, self.heartbeats.serve)
        app.router.add_post(QUORUM_PATH, self._quorum)
        app.router.add_post(LEAVE_PATH, self._leave)
        app.router.add_post(REACH_PATH, self._reach)
        app.router.add_post(CHECKPOINT_PATH, self._checkpoint)
        app.router.add_post(STORE_PATH + "/{quorum_id}", self._store)
        self._dashboard.add_routes(app)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        assert self._runner.server is not None
        limit = descriptor_limit(raise_soft=self._own_process) - RESERVED_FDS
        cap = max(2, limit if self.max_connections is None else min(self.max_connections, limit))
        self.guard = ConnectionGuard(
            self._runner.server,
            max_connections=cap,
            max_unauthenticated=min(self.max_unauthenticated, cap),
            header_timeout=self.header_timeout,
        )
        # every member may connect at once (a quorum request after a failure): a short accept queue drops their
        # connections, which the kernel retries after 1, 3, 7... s
        backlog = max(128, self.state.max_members)
        listener = socket.create_server(
            (self.host, self._requested_port), family=socket.AF_INET6 if ":" in self.host else socket.AF_INET,
            backlog=backlog,
        )  # fmt: skip
        self._listener = await loop.create_server(
            self.guard, sock=listener, ssl=self._ssl, backlog=backlog,
            ssl_handshake_timeout=self.guard.header_timeout if self._ssl is not None else None,
        )  # fmt: skip
        self._port = int(listener.getsockname()[1])
        self.state.expect_quorum(time.time())
        self.saves.start()
        await self.saves.durable()
        self._ticker = asyncio.create_task(self._tick_forever())

    async def _stop(self) -> None:
        self._stopping = True
        self._dashboard.close()
        if self._ticker is not None:
            self._ticker.cancel()
        self.waiters.refuse_all(RequestError(503, "the lighthouse is shutting down; ask again"))
        self.stores.close()
        await self.heartbeats.close_all()
        if self._listener is not None:
            self._listener.close()
        if self._runner is not None:
            await self._runner.cleanup()
        await self.saves.durable()
        self.saves.close()

    # --- the state -------------------------------------------------------------------------------

    async def _tick_forever(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.tick_interval)
            woke = time.monotonic()
            lag, last = woke - last - self.tick_interval, woke
            try:
                if lag > self.tick_interval:  # the loop was blocked: heartbeats waited unread in the sockets
                    self.state.excuse_silence(lag, time.time())
                self._advance(tick=True)
                for _ in range(CATCH_UP_SLICES):  # a report far ahead: more slices, the loop serving between them
                    if not self.state.catching_up:
                        break
                    await asyncio.sleep(0)
                    self.state.work_catch_up()
                    self._advance()
                self.heartbeats.deliver_refusals()
                await self.saves.durable()
            except Exception:
                logger.exception("lighthouse tick failed")

    def _advance(self, *, tick: bool = False) -> None:
        """Form a quorum if due, wake its waiters (each awaits the save); push a reconfigure; end a withdrawn one.

        After an event this costs constant time unless a quorum forms; the
        periodic ``tick`` also expires heartbeats and finds hung members.
        """
        if self._stopping:
            return
        now = time.time()
        formation = self.state.tick(now) if tick else self.state.try_form(now)
        if formation is not None:
            self.saves.formed(formation.quorum_id)
            self.metrics.on_formation(formation.reason, self.state.hosted)
            self.waiters.answer(formation)
        self.heartbeats.push_reconfigure()
        if (quorum := self.state.quorum) is not None and self.state.roster.withdrawn:
            self.stores.end(quorum.quorum_id)  # it never runs: a member waiting in its store asks again at once
        if self._collector is not None:
            # busy until a new quorum's answers are out (a quorum formed ahead is confirmed by thousands of asks)
            busy = bool(self.waiters.waiting or self.state.asking or self.state.quorum_broken or self.answers.waiting)
            busy = busy or bool(self.state.former.unconfirmed())
            gone = self.state.counts["failures"] + self.state.counts["departures"]
            live = self.state.live_members
            self._collector.update(now, busy=busy, formed=formation is not None, gone=gone, live=live)

    def heartbeat_advice(self) -> dict[str, float]:
        """What register and quorum answers say of heartbeats: the least interval for the members the lighthouse
        expects, and the timeout a member's default interval is a quarter of (``BEATS_PER_TIMEOUT``)."""
        members, timeout = max(self.state.live_members, self.state.start_replicas), self.state.heartbeat_timeout
        return {"heartbeat_interval": recommended_heartbeat_interval(members, timeout), "heartbeat_timeout": timeout}

    def _status(self) -> dict[str, Any]:
        status = self.state.to_status(time.time())
        return {**status, "url": self.url, "store": {"keys": self.stores.keys}, "rounds": self.rounds.to_status(status)}

    # --- HTTP ------------------------------------------------------------------------------------

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _get_status(self, request: web.Request) -> web.Response:
        return web.json_response(self._status())

    async def _quorum(self, request: web.Request) -> web.Response:
        quorum_request = QuorumRequest.from_json(await json_body(request))
        self._authenticate(request, quorum_request.member)
        body = await self._answer_quorum(quorum_request)
        self.metrics.quorum_requests.labels(via="post").inc()
        return web.Response(body=body, content_type="application/json")

    async def _answer_quorum(self, quorum_request: QuorumRequest) -> bytes:
        """The answer to an authenticated quorum request, however it came (a long poll: see docs/protocol.md)."""
        member = quorum_request.member
        self.waiters.check_room()
        formation = self.state.ask(quorum_request, time.time())
        if formation is None:
            self._advance()
            formation = self.state.formation_for(quorum_request)
        if formation is None:
            # one long poll per incarnation (a newer one replaces it), so one identity cannot fill max_waiters
            result = await self.waiters.wait(member, self.join_timeout) or self.state.formation_for(quorum_request)
            if isinstance(result, RequestError):
                raise result
            if result is None:
                raise RequestError(
                    408, f"no quorum formed within join_timeout={self.join_timeout} s; ask again", member=member
                )
            formation = result
        await self.saves.require_answer(formation)
        await self.answers.passage()  # a quorum's thousands of answers, a batch per loop iteration
        if self.state.quorum is None or self.state.quorum.quorum_id != formation.quorum_id:
            raise RequestError(  # another quorum formed while this answer was saved: ask again
                503, f"quorum {formation.quorum_id} was superseded meanwhile; ask again", member=member, retry=True
            )
        store = self.stores.open(formation.quorum_id)
        extra = {"store": {"quorum_id": formation.quorum_id, "key": store.key}, **self.heartbeat_advice()}
        return formation.render(member, extra, wire=quorum_request.wire, known=quorum_request.known)

    async def _leave(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        allowed = {"member", "applied_step", "digest", "weights"}
        if not isinstance(body, dict) or "member" not in body or not set(body) <= allowed:
            raise RequestError(
                400,
                f'the body must be {{"member": str, "applied_step"?: int, "digest"?: str, "weights"?: ...}}, '
                f"got {body!r:.200}",
            )
        member = parse_member(body["member"])
        applied_step = parse_step(body["applied_step"]) if "applied_step" in body else None
        digest = parse_digest(body.get("digest"))
        weights = parse_weights(body.get("weights"))
        try:
            self._authenticate(request, member)
        except RequestError as error:
            if error.details.get("code") == "left":
                return web.json_response({"ok": True})  # a retried leave: it left already
            raise
        self.state.leave(member, time.time(), applied_step, digest, weights)
        # its socket closing next is no failure: retire it now, so neither a heartbeat still on the way nor the
        # close counts (the incarnation's secret is refused from now on, 410 "left")
        self.heartbeats.retire(member, WSCloseCode.OK, b"left")
        self._advance()
        self.waiters.refuse(member, RequestError(410, f"member {member!r} left", member=member, code="left"))
        return web.json_response({"ok": True})

    async def _reach(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        if not isinstance(body, dict) or set(body) != {"member", "reached"}:
            raise RequestError(400, f'the body must be {{"member": str, "reached": [member ids]}}, got {body!r:.200}')
        member = parse_member(body["member"])
        reached = parse_unreachable(body["reached"], member, "reached")
        self._authenticate(request, member)
        ended = self.state.reached(member, reached, time.time())
        if ended:
            logger.info("%s reached %s again: %d cut(s) ended", member, ", ".join(reached), ended)
            self._advance()
        return web.json_response({"ok": True, "ended": ended})

    async def _checkpoint(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        member = parse_member(body.get("member") if isinstance(body, dict) else None)
        self._authenticate(request, member)
        record = self.state.record_checkpoint(body, time.time())
        self._advance()
        await self.saves.require(f"the checkpoint of step {record.step}")
        return web.json_response({"step": record.step, "path": record.path})

    async def _register(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        if not isinstance(body, dict) or not {"member", "incarnation"} <= set(body) <= _REGISTER_FIELDS:
            raise RequestError(
                400, f'the body must be {{"member": str, "incarnation": str, "plan"?: {{...}}}}, got {body!r:.300}'
            )
        member = parse_member(body["member"])
        plan = parse_plan(body.get("plan"))
        previous = self.state.incarnation(member)
        current = identity(request)
        given = None if current[0] is None and current[1] is None else current
        secret = self.state.register(member, body["incarnation"], time.time(), plan, given)
        if previous is not None:
            self._retire(member, previous)
        self._advance()
        await self.saves.require(f"the registration of member {member!r}")
        answer = {"member": member, "incarnation": body["incarnation"], "secret": secret}
        return web.json_response({**answer, **self.heartbeat_advice()})

    def _retire(self, member: str, incarnation: str) -> None:
        """Close the replaced incarnation's socket and refuse its pending quorum requests."""
        self.heartbeats.retire(member, WSCloseCode.POLICY_VIOLATION, b"replaced by a new incarnation")
        refused = RequestError(403, f"incarnation {incarnation} of member {member!r} was replaced", code="superseded")
        self.waiters.refuse(member, refused)

    async def _store(self, request: web.Request) -> web.Response:
        return await serve_store(self.stores, request)

    def _authenticate(self, request: web.Request, member: str) -> None:
        """403 unless the request carries ``member``'s current incarnation and secret (410 once it left)."""
        self.state.authenticate(member, *identity(request))


def recommended_heartbeat_interval(members: int, heartbeat_timeout: float) -> float:
    """The least heartbeat interval (seconds) for ``members`` members: ``members / HEARTBEATS_PER_SECOND``.

    Capped at ``heartbeat_timeout / BEATS_PER_TIMEOUT``, so that a live
    member is heard from four times per timeout; members heartbeat at this
    interval or their own, whichever is longer (by default their own is that
    cap, 0.5 s at the default 2 s timeout; a member given 0.1 s keeps it up to
    819 members). Beyond 4096 members, raise ``heartbeat_timeout`` with the
    fleet.
    """
    return min(heartbeat_timeout / BEATS_PER_TIMEOUT, members / HEARTBEATS_PER_SECOND)

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
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web

from stalwart.coord import quiet_log
from stalwart.coord.collector import QuietCollector
from stalwart.coord.connections import RESERVED_FDS, ConnectionGuard, descriptor_limit
from stalwart.coord.dashboard import Dashboard, browser_credential
from stalwart.coord.heartbeat import read_heartbeat
from stalwart.coord.metrics import LighthouseMetrics
from stalwart.coord.persist import StateStore
from stalwart.coord.protocol import (
    ASK_PREFIX,
    AUTHORIZATION_HEADER,
    CHECKPOINT_PATH,
    HEARTBEAT_PATH,
    HEARTBEAT_RECONNECT_CODE,
    INCARNATION_HEADER,
    LEAVE_PATH,
    MAX_SOCKET_ASKS,
    MAX_SOCKET_MESSAGE_BYTES,
    QUORUM_PATH,
    REACH_PATH,
    REGISTER_PATH,
    SECRET_HEADER,
    STORE_KEY_HEADER,
    STORE_PATH,
    QuorumRequest,
    StoreRequest,
    answer_message,
    parse_ask,
    parse_header,
    parse_unreachable,
)
from stalwart.coord.quorum import (
    Formation,
    LighthouseState,
    RequestError,
    parse_digest,
    parse_member,
    parse_step,
    parse_weights,
)
from stalwart.coord.rounds import RoundsBoard
from stalwart.coord.settings import LighthouseSettings
from stalwart.coord.store import QuorumStores, StoreLimits, answer_bytes, encode_answer
from stalwart.coord.tls import is_loopback, is_loopback_authority, is_loopback_origin, server_context
from stalwart.coord.wire import parse_plan
from stalwart.data.plan import EpochPlan

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024
MAX_HEARTBEAT_BYTES = MAX_SOCKET_MESSAGE_BYTES
"""Largest heartbeat message; a balanced ledger's carry the weights and may take up to ``MAX_BODY_BYTES``."""
PUSH_BUFFERED = 1 << 16
"""Bytes waiting in a socket's transport past which a push to it gets a task of its own (see ``_push``)."""
RENOTICE_S = 1.0
"""Seconds before a heartbeat's answer repeats a reconfigure notice its socket already got (pushed or answered)."""
HEARTBEATS_PER_SECOND = 8192
"""The heartbeat rate the lighthouse plans for: with M members it recommends an interval of at least
``M / HEARTBEATS_PER_SECOND`` seconds (see :func:`recommended_heartbeat_interval`)."""
CATCH_UP_SLICES = 8
"""Extra slices of a report's replay per tick (each a few milliseconds, with the loop serving between them)."""
BODY_TIMEOUT = 10.0
"""Seconds a request's body may take to arrive (a body sent byte by byte is cut off: 408)."""
MAX_STORE_BODY_BYTES = 4 * (StoreLimits().value_bytes // 3 + 1) + 4096
"""Largest store request: the largest value in base64, and its JSON."""
_PUBLIC_PATHS = frozenset({"/healthz"})
_REGISTER_FIELDS = frozenset({"member", "incarnation", "plan"})
_SOCKET_ERRORS = (ConnectionError, RuntimeError)
"""What writing to a websocket that is closing raises (aiohttp: ``ClientConnectionResetError``, a ``RuntimeError``
after close); the member is gone, or going, and nothing else happens."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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
        self._ssl = None
        if settings.tls_cert is not None and settings.tls_key is not None:
            self._ssl = server_context(settings.tls_cert, settings.tls_key)
        if token is not None and self._ssl is None and not is_loopback(host):
            logger.warning(
                "the lighthouse on %s takes its token over plain HTTP: anyone on the network can read it; give "
                "--tls-cert and --tls-key",
                host,
            )
        self.host = host
        self._requested_port = settings.port
        self._token = token
        self.max_connections = settings.max_connections
        self.max_unauthenticated = settings.max_unauthenticated
        self.header_timeout = settings.header_timeout
        self.join_timeout = settings.join_timeout
        self.tick_interval = settings.tick_interval
        self.max_waiters = settings.max_waiters
        state_path = settings.state_path
        self._database = StateStore(state_path) if state_path is not None else None
        try:
            self.state = self._load_state(plan, settings)
        except BaseException:
            if self._database is not None:
                self._database.close()
            raise
        self.metrics = LighthouseMetrics()
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
        self._snapshots_taken = 0
        """Snapshots of what changed taken for a save so far (numbered from 1, taken and saved in order)."""
        self._snapshot_saved = 0
        """The number of the last snapshot saved: a request waiting for snapshot ``n`` or later is durable."""
        self._save_failing = False
        self._save_lock: asyncio.Lock | None = None
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="stalwart-lighthouse-save")
        self._port: int | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        self.guard: ConnectionGuard | None = None
        """The connection caps and header timeout (once started)."""
        self._ticker: asyncio.Task[None] | None = None
        self.stores = QuorumStores(settings.store_limits)
        """The current quorum's store."""
        self._sockets: dict[str, web.WebSocketResponse] = {}
        self._waiters: dict[str, list[asyncio.Future[Formation | RequestError]]] = {}
        self._waiting = 0
        """How many quorum long polls wait (the sum of ``_waiters``' lengths)."""
        self._loopback = is_loopback(host)
        """Whether the lighthouse serves loopback only (then, without a token, a request's Host must name it)."""
        self._broken_pushed: set[int] = set()
        self._noticed: dict[str, tuple[web.WebSocketResponse, tuple[int, bool, bool], float]] = {}
        """Each member's last reconfigure notice: its socket, ``(quorum_id, broken, left_out)`` and when. During a
        failure every heartbeat of a member that has not asked yet is due a notice; answering each of them with it
        (8,000 a second at 1,024 members) took the loop from the survivors' quorum requests."""
        self._collector: QuietCollector | None = None
        """Set by ``serve_forever`` (the process is the lighthouse's): full collections at quiet times only."""
        self._own_process = False
        """Set by ``serve_forever``: the process's file-descriptor limit is raised to its hard limit."""
        self._stopping = False

    def _load_state(self, plan: EpochPlan | None, settings: LighthouseSettings) -> LighthouseState:
        """The persisted state when there is one (the plan, if given, and balance must agree), else a fresh one."""
        state_path, balance_every = settings.state_path, settings.balance_every
        rules: dict[str, Any] = {
            "min_replicas": settings.min_replicas,
            "start_replicas": settings.start_replicas,
            "heartbeat_timeout": settings.heartbeat_timeout,
            "join_timeout": settings.join_timeout,
            "max_members": settings.max_members,
            "require_digest": True,
        }
        persisted = self._database.load() if self._database is not None else None
        if persisted is None:
            return LighthouseState(plan, **rules, balance_every=balance_every or 0)
        state = LighthouseState.from_state_dict(persisted, now=time.time(), **rules)
        if plan is not None and state.plan is not None:
            _check_same_plan(plan, state.plan, state_path)
        if balance_every is not None and balance_every != state.balance_every:
            raise ValueError(
                f"balance_every={balance_every} does not match the state persisted in {state_path}: "
                f"balance_every={state.balance_every}"
            )
        return state

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
            loop = asyncio.new_event_loop()
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
            if self._database is not None:
                self._database.close()
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
        app = web.Application(middlewares=[self._middleware], client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/v1/status", self._get_status)
        app.router.add_get("/status", self._get_status)  # the short name people and scripts type
        app.router.add_post(REGISTER_PATH, self._register)
        app.router.add_get(HEARTBEAT_PATH, self._heartbeat)
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
        self._save_lock = asyncio.Lock()
        await self._durable()
        self._ticker = asyncio.create_task(self._tick_forever())

    async def _stop(self) -> None:
        self._stopping = True
        self._dashboard.close()
        if self._ticker is not None:
            self._ticker.cancel()
        for waiters in self._waiters.values():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(RequestError(503, "the lighthouse is shutting down; ask again"))
        self.stores.close()
        closing = [ws.close(code=WSCloseCode.GOING_AWAY, message=b"shutting down") for ws in self._sockets.values()]
        await asyncio.gather(*closing, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        if self._runner is not None:
            await self._runner.cleanup()
        await self._durable()
        self._saver.shutdown(wait=True)
        if self._database is not None:
            self._database.close()

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
                self._deliver_refusals()
                await self._durable()
            except Exception:
                logger.exception("lighthouse tick failed")

    def _advance(self, *, tick: bool = False) -> None:
        """Form a quorum if due and wake its waiting members (each awaits the save); push a broken quorum.

        After an event this costs constant time unless a quorum forms; the
        periodic ``tick`` also expires heartbeats and finds hung members.
        """
        if self._stopping:
            return
        now = time.time()
        formation = self.state.tick(now) if tick else self.state.try_form(now)
        if formation is not None:
            self.metrics.on_formation(formation.reason, self.state.state_dict())
            self._answer_waiters(formation)
        self._push_broken_quorum()
        if self._collector is not None:
            busy = bool(self._waiting or self.state.asking or self.state.quorum_broken)
            gone = self.state.counts["failures"] + self.state.counts["departures"]
            live = self.state.live_members
            self._collector.update(now, busy=busy, formed=formation is not None, gone=gone, live=live)

    def heartbeat_interval(self) -> float:
        """The interval the lighthouse asks its members to heartbeat at, at least (for the members it expects)."""
        members = max(self.state.live_members, self.state.start_replicas)
        return recommended_heartbeat_interval(members, self.state.heartbeat_timeout)

    def _push_broken_quorum(self) -> None:
        """Tell the live members of a quorum with a dead member at once, so they abandon its collectives.

        A survivor may be blocked in a collective with a peer that is not the
        dead member (the peer left it on its own error): without this push it
        would wait for the collective's timeout.
        """
        quorum = self.state.quorum
        if quorum is None or not self.state.quorum_broken or quorum.quorum_id in self._broken_pushed:
            return
        self._broken_pushed.add(quorum.quorum_id)
        message = json.dumps(
            {"type": "reconfigure", "quorum_id": quorum.quorum_id, "broken": True, "down": self.state.broken_by}
        )
        now = time.monotonic()
        sockets = []
        for member in quorum.members:
            socket = self._sockets.get(member)
            if socket is not None and not socket.closed:
                self._noticed[member] = (socket, (quorum.quorum_id, True, False), now)
                sockets.append(socket)
        asyncio.get_running_loop().create_task(_push(sockets, message)).add_done_callback(_consume)

    def _notice_due(self, member: str, socket: web.WebSocketResponse, key: tuple[int, bool, bool]) -> bool:
        """Whether ``member``'s heartbeat answer carries the reconfigure notice ``key``: not when its socket got the
        same one less than ``RENOTICE_S`` ago (then it is recorded as sent now)."""
        now = time.monotonic()
        last = self._noticed.get(member)
        if last is not None and last[0] is socket and last[1] == key and now - last[2] < RENOTICE_S:
            return False
        self._noticed[member] = (socket, key, now)
        return True

    async def _durable(self, after: int | None = None) -> bool:
        """Save what changed (on the save thread); False when the save failed.

        What changed is taken on the loop, so the save is a consistent
        snapshot; it costs what changed (:meth:`LighthouseState.changes`), and
        what a failed save held is saved with the next one. ``after``: the
        number of snapshots taken when the caller's change was made; a snapshot
        taken after it and saved meanwhile is enough (a thousand answers of one
        quorum, or a storm of registrations, wait for one or two saves, not a
        save each while heartbeats go on changing the state).
        """
        assert self._save_lock is not None
        if self.state.plan is None:
            return True  # nothing to keep before a member brought the plan (registering adopts it, then saves)
        async with self._save_lock:
            if after is not None and self._snapshot_saved > after:
                return True
            if not self.state.unsaved:
                return True
            changes = self.state.changes()  # drained even without a database, so nothing piles up
            self._snapshots_taken += 1
            snapshot = self._snapshots_taken
            if self._database is None:
                self._snapshot_saved = snapshot
                return True
            loop = asyncio.get_running_loop()
            try:
                started = time.perf_counter()
                await loop.run_in_executor(self._saver, self._database.save, changes, time.time())
                self.metrics.on_save(time.perf_counter() - started)
            except Exception as error:
                self.state.requeue(changes)
                if not self._save_failing:
                    logger.error("the lighthouse cannot save its state to %s: %s", self._database.path, error)
                self._save_failing = True
                return False
            if self._save_failing:
                logger.warning("the lighthouse saves its state to %s again", self._database.path)
            self._save_failing = False
            self._snapshot_saved = snapshot
            return True

    async def _require_durable(self, what: str) -> None:
        """503 (the client asks again) unless the state, ``what`` included (the change the caller made last), is
        saved."""
        if not await self._durable(after=self._snapshots_taken):
            raise RequestError(
                503, f"the lighthouse could not persist {what}; it is not handed out, ask again", retry=True
            )

    def _answer_waiters(self, formation: Formation) -> None:
        for member in formation.members:
            for waiter in self._waiters.get(member, ()):
                if not waiter.done():
                    waiter.set_result(formation)

    def _status(self) -> dict[str, Any]:
        status = self.state.to_status(time.time())
        return {**status, "url": self.url, "store": {"keys": self.stores.keys}, "rounds": self.rounds.to_status(status)}

    # --- HTTP ------------------------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Bearer-token check (all but ``/healthz``), JSON errors for refused requests, the connection guard's marks."""
        guard = self.guard
        if guard is not None:
            guard.request_started(request)
        try:
            if self._token is None:
                self._check_browser(request)
            if request.path not in _PUBLIC_PATHS:
                self._check_token(request)
                if guard is not None:
                    guard.authenticated(request)
            return await handler(request)
        except RequestError as error:
            return web.json_response(error.to_json(), status=error.status, headers=error.headers)
        except web.HTTPException as error:
            if error.status < 400:
                raise
            return web.json_response({"error": f"{error.reason}: {request.method} {request.path}"}, status=error.status)
        finally:
            if guard is not None:
                guard.request_ended(request)

    def _check_token(self, request: web.Request) -> None:
        """401 unless the request carries the bearer token (the dashboard's routes also take ?token= or the cookie)."""
        if self._token is None:
            return
        given = parse_header(request.headers.get(AUTHORIZATION_HEADER), AUTHORIZATION_HEADER)
        given = given or parse_header(browser_credential(request, self.port) or None, "token")
        if given is None or not hmac.compare_digest(given.encode(), f"Bearer {self._token}".encode()):
            raise RequestError(
                401,
                "missing or wrong bearer token in the Authorization header "
                "(the dashboard's / and /v1/events also take ?token= or the stalwart_token cookie)",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def _check_browser(self, request: web.Request) -> None:
        """Without a token, what keeps a browser page of another site out (``docs/protocol.md``, "Security").

        On loopback, a ``Host`` that is not a loopback name is refused (403): a page of another site reaching
        us through DNS rebinding sends its own name. A write (any method but GET and HEAD, or a websocket) with
        an ``Origin`` that is not a loopback page is refused (403), and a write must be JSON (415): a
        cross-origin page can send text/plain, a form or an untyped body without asking first, never JSON.
        """
        host = request.headers.get("Host", "")
        if self._loopback and not is_loopback_authority(host):
            raise RequestError(
                403, f"the Host header {host[:100]!r} does not name this machine: without a token the lighthouse "
                "serves only localhost, 127.0.0.0/8 and [::1] (a page of another site reaching it through DNS "
                "rebinding names its own site); give the lighthouse a token to serve other names", code="host",
            )  # fmt: skip
        upgrade = request.headers.get("Upgrade", "").lower() == "websocket"
        if request.method in ("GET", "HEAD") and not upgrade:
            return
        origin = request.headers.get("Origin")
        if origin is not None and not is_loopback_origin(origin):
            raise RequestError(
                403, f"a write from the page {origin[:100]!r} is refused: without a token the lighthouse takes "
                "writes only from its own machine (a cross-origin request)", code="origin",
            )  # fmt: skip
        content_type = request.headers.get("Content-Type", "").partition(";")[0].strip().lower()
        if not upgrade and content_type != "application/json":
            raise RequestError(415, f"a write must be JSON (Content-Type: application/json), got {content_type!r:.100}")

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _get_status(self, request: web.Request) -> web.Response:
        return web.json_response(self._status())

    async def _heartbeat(self, request: web.Request) -> web.WebSocketResponse:
        member = parse_member(request.query.get("member"))
        self._authenticate(request, member)
        limit = MAX_BODY_BYTES if self.state.balance_every else MAX_HEARTBEAT_BYTES
        ws = web.WebSocketResponse(max_msg_size=limit, timeout=1.0)
        await ws.prepare(request)
        previous = self._sockets.get(member)
        self._sockets[member] = ws
        if previous is not None:
            await previous.close(code=WSCloseCode.POLICY_VIOLATION, message=b"replaced by a newer heartbeat socket")
        if self._stopping:
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"lighthouse shutting down")
            return ws
        if self._sockets.get(member) is not ws or not self._speaks(request, member):
            # it left (or was replaced) while the socket opened: the socket is not a sign of life
            if self._sockets.get(member) is ws:
                del self._sockets[member]
            await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"this incarnation has no more say")
            return ws
        self.state.connected(member, time.time())
        self._advance()
        spoke = False
        asks: set[asyncio.Task[None]] = set()
        """The quorum requests of this socket being answered."""
        counted: tuple[str, int] | None = None
        """The last heartbeat text counted in full without a refusal, and the quorum then: the same text again in the
        same quorum is only a sign of life (:meth:`LighthouseState.heard_again`)."""
        try:
            async for message in ws:
                # no await from this check to the state's: a leave (which retires this socket) cannot come between
                if self._stopping or self._sockets.get(member) is not ws:
                    break
                if message.type != WSMsgType.TEXT:
                    await _send(ws, {"type": "error", "error": "heartbeats must be JSON text messages"})
                    continue
                spoke = True
                if message.data.startswith(ASK_PREFIX):
                    await self._take_socket_ask(ws, member, message.data, asks)
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
                    self._deliver_refusals()
                    for text in errors:
                        await _send(ws, {"type": "error", "error": text})
                    if refused:
                        continue
                quorum = self.state.quorum
                if quorum is None:
                    continue
                if self.state.should_reconfigure(member):
                    broken = self.state.quorum_broken
                    if self._notice_due(member, ws, (quorum.quorum_id, broken, False)):
                        notice = {"type": "reconfigure", "quorum_id": quorum.quorum_id, "broken": broken}
                        if broken:
                            notice["down"] = self.state.broken_by
                        await _send(ws, notice)
                elif self.state.left_out(member) and self._notice_due(member, ws, (quorum.quorum_id, False, True)):
                    await _send(ws, {"type": "reconfigure", "quorum_id": quorum.quorum_id, "left_out": True})
        finally:
            for ask in asks:  # a long poll on a closed socket: nobody reads its answer
                ask.cancel()
            if self._noticed.get(member, (None,))[0] is ws:
                del self._noticed[member]
            if self._sockets.get(member) is ws:
                del self._sockets[member]
                if not self._stopping:
                    # a socket its member closed to reconnect, or one that carried no heartbeat (a reconnection
                    # abandoned while the lighthouse did not answer), is no sign of death
                    reconnecting = not spoke or ws.close_code == HEARTBEAT_RECONNECT_CODE
                    self.state.disconnected(member, time.time(), reconnecting=reconnecting)
                    self._advance()
        return ws

    async def _quorum(self, request: web.Request) -> web.Response:
        quorum_request = QuorumRequest.from_json(await _json_body(request))
        self._authenticate(request, quorum_request.member)
        body = await self._answer_quorum(quorum_request)
        self.metrics.quorum_requests.labels(via="post").inc()
        return web.Response(body=body, content_type="application/json")

    async def _answer_socket_ask(
        self, socket: web.WebSocketResponse, ask_id: int, quorum_request: QuorumRequest
    ) -> None:
        """Answer a quorum request that came on ``socket`` (its member's heartbeat socket, authenticated when it
        opened) with what ``POST /v1/quorum`` would answer, status included."""
        try:
            status, body = 200, await self._answer_quorum(quorum_request)
            self.metrics.quorum_requests.labels(via="socket").inc()
        except RequestError as error:
            status, body = error.status, _error_body(error)
        except Exception:  # what aiohttp does for a request: log it, answer 500, serve on
            logger.exception("answering the quorum request of %s on its heartbeat socket failed", quorum_request.member)
            status, body = 500, _error_body(RequestError(500, "internal error answering the quorum request"))
        if not socket.closed:
            await socket.send_str(answer_message(ask_id, status, body))

    async def _answer_quorum(self, quorum_request: QuorumRequest) -> bytes:
        """The answer to an authenticated quorum request, however it came (a long poll: see docs/protocol.md)."""
        member = quorum_request.member
        if self._waiting >= self.max_waiters:
            raise RequestError(
                503,
                f"max_waiters={self.max_waiters} quorum requests are already pending; ask again later",
                cap="max_waiters",
            )
        formation = self.state.ask(quorum_request, time.time())
        if formation is None:
            self._advance()
            formation = self.state.formation_for(quorum_request)
        if formation is None:
            # one long poll per incarnation: a newer request of the same member replaces an older one (its client
            # gave up on it), so one identity cannot fill max_waiters
            replaced = RequestError(
                409, f"replaced by a newer quorum request of member {member!r}", member=member, code="replaced"
            )
            for older in self._waiters.get(member, ()):
                if not older.done():
                    older.set_result(replaced)
            waiter: asyncio.Future[Formation | RequestError] = asyncio.get_running_loop().create_future()
            self._waiters.setdefault(member, []).append(waiter)
            self._waiting += 1
            try:
                await asyncio.wait({waiter}, timeout=self.join_timeout)
            finally:
                self._waiting -= 1
                self._waiters[member].remove(waiter)
                if not self._waiters[member]:
                    del self._waiters[member]
            result = waiter.result() if waiter.done() else self.state.formation_for(quorum_request)
            if isinstance(result, RequestError):
                raise result
            if result is None:
                raise RequestError(
                    408, f"no quorum formed within join_timeout={self.join_timeout} s; ask again", member=member
                )
            formation = result
        await self._require_durable(f"quorum {formation.quorum_id}")
        if self.state.quorum is None or self.state.quorum.quorum_id != formation.quorum_id:
            raise RequestError(  # another quorum formed while this answer was saved: ask again
                503, f"quorum {formation.quorum_id} was superseded meanwhile; ask again", member=member, retry=True
            )
        store = self.stores.open(formation.quorum_id)
        extra = {
            "store": {"quorum_id": formation.quorum_id, "key": store.key},
            "heartbeat_interval": self.heartbeat_interval(),
        }
        return formation.render(member, extra, wire=quorum_request.wire, known=quorum_request.known)

    async def _take_socket_ask(
        self, socket: web.WebSocketResponse, member: str, text: str, asks: set[asyncio.Task[None]]
    ) -> None:
        """Start answering a quorum request sent on ``member``'s heartbeat socket; a bad one is answered with its
        error (4xx) at once and the socket serves on."""
        try:
            ask_id, quorum_request = parse_ask(text)
        except RequestError as error:
            await socket.send_str(answer_message(error.details.get("ask", -1), error.status, _error_body(error)))
            return
        refusal = None
        if quorum_request.member != member:
            refusal = RequestError(
                403, f"this heartbeat socket is member {member!r}'s, the request is {quorum_request.member!r}'s"
            )
        elif len(asks) >= MAX_SOCKET_ASKS:
            refusal = RequestError(429, f"{MAX_SOCKET_ASKS} quorum requests of this socket are in flight already")
        if refusal is not None:
            await socket.send_str(answer_message(ask_id, refusal.status, _error_body(refusal)))
            return
        task = asyncio.get_running_loop().create_task(self._answer_socket_ask(socket, ask_id, quorum_request))
        asks.add(task)
        task.add_done_callback(asks.discard)
        task.add_done_callback(_consume)

    async def _leave(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
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
        socket = self._sockets.pop(member, None)
        if socket is not None and not socket.closed:
            closing = socket.close(code=WSCloseCode.OK, message=b"left")
            asyncio.get_running_loop().create_task(closing).add_done_callback(_consume)
        self._advance()
        for waiter in self._waiters.get(member, []):
            if not waiter.done():
                waiter.set_result(RequestError(410, f"member {member!r} left", member=member, code="left"))
        return web.json_response({"ok": True})

    async def _reach(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
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
        body = await _json_body(request)
        member = parse_member(body.get("member") if isinstance(body, dict) else None)
        self._authenticate(request, member)
        record = self.state.record_checkpoint(body, time.time())
        self._advance()
        await self._require_durable(f"the checkpoint of step {record.step}")
        return web.json_response({"step": record.step, "path": record.path})

    async def _register(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if not isinstance(body, dict) or not {"member", "incarnation"} <= set(body) <= _REGISTER_FIELDS:
            raise RequestError(
                400, f'the body must be {{"member": str, "incarnation": str, "plan"?: {{...}}}}, got {body!r:.300}'
            )
        member = parse_member(body["member"])
        plan = parse_plan(body.get("plan"))
        previous = self.state.incarnation(member)
        current = self._identity(request)
        given = None if current[0] is None and current[1] is None else current
        secret = self.state.register(member, body["incarnation"], time.time(), plan, given)
        if previous is not None:
            self._retire(member, previous)
        self._advance()
        await self._require_durable(f"the registration of member {member!r}")
        answer = {"member": member, "incarnation": body["incarnation"], "secret": secret}
        return web.json_response({**answer, "heartbeat_interval": self.heartbeat_interval()})

    def _retire(self, member: str, incarnation: str) -> None:
        """Close the replaced incarnation's socket and refuse its pending quorum requests."""
        socket = self._sockets.pop(member, None)
        if socket is not None and not socket.closed:
            message = b"replaced by a new incarnation"
            asyncio.get_running_loop().create_task(socket.close(code=WSCloseCode.POLICY_VIOLATION, message=message))
        refused = RequestError(403, f"incarnation {incarnation} of member {member!r} was replaced", code="superseded")
        for waiter in self._waiters.get(member, []):
            if not waiter.done():
                waiter.set_result(refused)

    def _authenticate(self, request: web.Request, member: str) -> None:
        """403 unless the request carries ``member``'s current incarnation and secret (410 once it left)."""
        self.state.authenticate(member, *self._identity(request))

    def _identity(self, request: web.Request) -> tuple[str | None, str | None]:
        """The identity headers (400 when they are not printable ASCII)."""
        return (
            parse_header(request.headers.get(INCARNATION_HEADER), INCARNATION_HEADER),
            parse_header(request.headers.get(SECRET_HEADER), SECRET_HEADER),
        )

    async def _store(self, request: web.Request) -> web.Response:
        """One operation on a quorum's store: its key is checked before the body is read.

        A large body is decoded, and a large answer encoded, on a worker thread: a value of megabytes (heal
        metadata) must not hold the event loop.
        """
        quorum_id = _path_int(request.match_info["quorum_id"], "quorum_id")
        store = self.stores.get(quorum_id)
        store.check_key(parse_header(request.headers.get(STORE_KEY_HEADER), STORE_KEY_HEADER))
        raw = await _read_body(request.clone(client_max_size=MAX_STORE_BODY_BYTES))
        loop = asyncio.get_running_loop()
        limit = store.limits.value_bytes
        if len(raw) > MAX_BODY_BYTES:
            operation = await loop.run_in_executor(None, _parse_store_request, raw, limit)
        else:
            operation = _parse_store_request(raw, limit)
        answer = await store.apply(operation)
        if answer_bytes(answer) > MAX_BODY_BYTES:  # at most StoreLimits.answer_bytes
            body = await loop.run_in_executor(None, encode_answer, answer)
        else:
            body = encode_answer(answer)
        return web.Response(body=body, content_type="application/json")

    def _deliver_refusals(self) -> None:
        """Tell members whose reports were refused after the event that made them (their replay took slices)."""
        for member, text in self.state.take_refusals():
            socket = self._sockets.get(member)
            if socket is not None and not socket.closed:
                task = asyncio.get_running_loop().create_task(_send(socket, {"type": "error", "error": text}))
                task.add_done_callback(_consume)

    def _speaks(self, request: web.Request, member: str) -> bool:
        """Whether the request's incarnation still speaks for ``member`` (not replaced, not left)."""
        try:
            self._authenticate(request, member)
        except RequestError:
            return False
        return True


def recommended_heartbeat_interval(members: int, heartbeat_timeout: float) -> float:
    """The least heartbeat interval (seconds) for ``members`` members: ``members / HEARTBEATS_PER_SECOND``.

    Capped at a quarter of ``heartbeat_timeout``, so that a live member is
    heard from four times per timeout; members heartbeat at this interval or
    their own, whichever is longer (0.1 s by default: 819 members or fewer
    keep it; 4096 members heartbeat every 0.5 s). Beyond that, raise
    ``heartbeat_timeout`` with the fleet.
    """
    return min(heartbeat_timeout / 4, members / HEARTBEATS_PER_SECOND)


async def _push(sockets: list[web.WebSocketResponse], message: str) -> None:
    """Send ``message`` on each socket, in one task: a send whose transport takes it without waiting completes at
    once, so only a socket whose peer stopped reading (its transport's buffer over ``PUSH_BUFFERED`` bytes) gets a
    task of its own, never holding up the others. A task per socket cost 4,096 tasks per failure at 4,096 members."""
    loop = asyncio.get_running_loop()
    for member_socket in sockets:
        if member_socket.closed:
            continue
        transport = member_socket.get_extra_info("transport")
        if transport is None or transport.get_write_buffer_size() > PUSH_BUFFERED:
            loop.create_task(member_socket.send_str(message)).add_done_callback(_consume)
            continue
        with contextlib.suppress(*_SOCKET_ERRORS):
            await member_socket.send_str(message)


def _consume(task: asyncio.Task[Any]) -> None:
    """Retrieve a push's outcome: a member whose socket closed meanwhile misses it, and nothing else happens."""
    if not task.cancelled():
        task.exception()


async def _read_body(request: web.BaseRequest) -> bytes:
    """The request's body, read within ``BODY_TIMEOUT`` (408 after) and its size limit (413 above)."""
    if request.content.is_eof():  # the whole body came with the headers (most requests): no timer to arm
        return await request.read()
    try:
        return await asyncio.wait_for(request.read(), BODY_TIMEOUT)
    except asyncio.TimeoutError:
        raise RequestError(408, f"the body did not arrive within {BODY_TIMEOUT:g} s") from None


def _decode_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as error:
        raise RequestError(400, f"the body must be JSON: {error}") from error


async def _json_body(request: web.BaseRequest) -> Any:
    """The request's JSON body (see :func:`_read_body`); 400 when it is not JSON."""
    return _decode_json(await _read_body(request))


def _parse_store_request(raw: bytes, max_value_bytes: int) -> StoreRequest:
    return StoreRequest.from_json(_decode_json(raw), max_value_bytes)


def _error_body(error: RequestError) -> bytes:
    return json.dumps(error.to_json()).encode()


async def _send(socket: web.WebSocketResponse, message: dict[str, Any]) -> None:
    """Send a message on a member's socket; a socket closing meanwhile misses it (the member is gone)."""
    with contextlib.suppress(*_SOCKET_ERRORS):
        await socket.send_json(message)


def _path_int(value: str, name: str) -> int:
    """A non-negative integer from the URL path; 400 naming it otherwise."""
    if not (value.isascii() and value.isdigit()) or len(value) > 18:
        raise RequestError(400, f"{name} must be a non-negative integer, got {value[:40]!r}", field=name)
    return int(value)


def _check_same_plan(given: EpochPlan, persisted: EpochPlan, path: object) -> None:
    """Refuse a plan that differs from the persisted one, naming each differing field."""
    if given == persisted:
        return
    ours, theirs = given.to_dict(), persisted.to_dict()
    diffs = ", ".join(
        f"{name}={ours[name]!r} (persisted {theirs[name]!r})" for name in ours if ours[name] != theirs[name]
    )
    raise ValueError(f"plan does not match the state persisted in {path}: {diffs}")

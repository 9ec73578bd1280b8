"""The lighthouse's dashboard (``GET /``), its live stream (``GET /v1/events``) and ``GET /metrics``.

The page is one self-contained HTML file shipped in the package (inline CSS
and JavaScript, no external assets: clusters often have no internet). It
opens ``/v1/events``, a server-sent event stream that sends a snapshot of
``/v1/status`` (plus each member's incarnation and the headline figures of
:func:`~stalwart.coord.figures.summary`) whenever the state changes, and at
least every ``interval`` seconds (default 1) so heartbeat ages stay current.

A browser cannot set the ``Authorization`` header on a navigation or an
``EventSource``, so these two routes also take the token as ``?token=TOKEN``
or as the ``stalwart_token_PORT`` cookie, which ``GET /?token=TOKEN`` sets
(HttpOnly, SameSite=Strict, ``Secure`` under TLS; named after the
lighthouse's port, since browsers send a host's cookies to all its ports);
the page then drops the token from its address.
``/metrics`` takes the header only (Prometheus's ``authorization`` setting).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping
from importlib import resources
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from stalwart.coord.figures import summary
from stalwart.coord.metrics import LighthouseMetrics
from stalwart.coord.wire import RequestError

TOKEN_COOKIE = "stalwart_token"
"""The cookie's name, followed by ``_PORT`` (:func:`cookie_name`)."""
TOKEN_PARAMETER = "token"
BROWSER_PATHS = frozenset({"/", "/v1/events"})
"""Routes that also accept the token as a query parameter or cookie."""
DEFAULT_INTERVAL = 1.0
"""Seconds between snapshots of an idle stream."""
MIN_INTERVAL, MAX_INTERVAL = 0.1, 60.0
MAX_STREAMS = 64
"""Open event streams at most; more are refused with 503."""
LIST_LIMIT = 200
"""How many of the latest failures, recoveries, quorums and departures a snapshot carries."""
_POLL_SECONDS = 0.1
"""How often a stream looks for a change of the state."""


def cookie_name(port: int) -> str:
    """The token cookie of the lighthouse on ``port`` (another service on the same host does not get it)."""
    return f"{TOKEN_COOKIE}_{port}"


def browser_credential(request: web.Request, port: int) -> str:
    """``Bearer TOKEN`` from the query parameter or cookie on the dashboard's routes, else ``""``."""
    if request.path not in BROWSER_PATHS:
        return ""
    token = request.query.get(TOKEN_PARAMETER) or request.cookies.get(cookie_name(port))
    return f"Bearer {token}" if token else ""


def check_query(request: web.Request, allowed: Iterable[str]) -> None:
    """400 naming the first query parameter that ``request.path`` does not take (or a repeated one)."""
    allowed = set(allowed)
    for name in request.query:
        if name not in allowed:
            accepted = ", ".join(sorted(allowed)) or "none"
            raise RequestError(
                400, f"unknown query parameter {name!r} for {request.path} (accepted: {accepted})", field=name
            )
        if len(request.query.getall(name)) > 1:
            raise RequestError(400, f"query parameter {name!r} is given more than once", field=name)


def parse_interval(value: str | None) -> float:
    """The ``interval`` query parameter in seconds; ``RequestError`` 400 unless a number in the allowed range."""
    if value is None:
        return DEFAULT_INTERVAL
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or not MIN_INTERVAL <= seconds <= MAX_INTERVAL:
        raise RequestError(
            400,
            f"interval must be a number of seconds from {MIN_INTERVAL} to {MAX_INTERVAL}, got {value!r}",
            field="interval",
        )
    return seconds


def snapshot(status: Mapping[str, Any], incarnations: Mapping[str, str | None], now: float) -> dict[str, Any]:
    """What one event of the stream carries: the status (its event lists cut to ``LIST_LIMIT``), the figures."""
    trimmed = dict(status)
    for name in ("failures", "recoveries", "quorums", "departures", "resumed_from_checkpoint"):
        trimmed[name] = list(status[name])[-LIST_LIMIT:]
    return {"time": now, "status": trimmed, "summary": summary(status), "incarnations": dict(incarnations)}


def page_html() -> bytes:
    """The dashboard page, shipped as package data."""
    return resources.files("stalwart.coord").joinpath("static/dashboard.html").read_bytes()


class Dashboard:
    """The page, the event stream and the metrics route, reading the lighthouse through callables.

    ``status()`` is ``/v1/status``'s JSON, ``revision()`` grows with every
    change of the state, ``incarnation(member)`` is a member's current
    incarnation; all are called on the server's event loop.
    """

    def __init__(
        self,
        status: Callable[[], dict[str, Any]],
        revision: Callable[[], int],
        incarnation: Callable[[str], str | None],
        metrics: LighthouseMetrics,
        *,
        port: Callable[[], int],
        secure: bool,
        max_streams: int = MAX_STREAMS,
    ) -> None:
        self._port = port
        self._secure = secure
        self._status = status
        self._revision = revision
        self._incarnation = incarnation
        self.metrics = metrics
        self.max_streams = max_streams
        self._streams = 0
        self._closing = False
        self._page = page_html()

    def add_routes(self, app: web.Application) -> None:
        """Register ``GET /``, ``GET /v1/events`` and ``GET /metrics``."""
        app.router.add_get("/", self.page)
        app.router.add_get("/v1/events", self.events)
        app.router.add_get("/metrics", self.metrics_page)

    def close(self) -> None:
        """End every open stream at its next poll (the lighthouse is stopping)."""
        self._closing = True

    async def page(self, request: web.Request) -> web.Response:
        """The HTML page; a valid ``?token=`` becomes the token cookie (the middleware checked it)."""
        check_query(request, {TOKEN_PARAMETER})
        response = web.Response(
            body=self._page,
            content_type="text/html",
            charset="utf-8",
            headers={"Cache-Control": "no-store", "Content-Security-Policy": _CONTENT_SECURITY_POLICY},
        )
        token = request.query.get(TOKEN_PARAMETER)
        if token:
            response.set_cookie(
                cookie_name(self._port()),
                token,
                httponly=True,
                samesite="Strict",
                path="/",
                secure=self._secure or None,
            )
        return response

    async def events(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: ``event: status`` with a :func:`snapshot` on every change and every ``interval``."""
        check_query(request, {TOKEN_PARAMETER, "interval"})
        interval = parse_interval(request.query.get("interval"))
        if self._streams >= self.max_streams:
            raise RequestError(503, f"max_streams={self.max_streams} event streams are open; try again later")
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        )
        self._streams += 1
        try:
            await response.prepare(request)
            await response.write(b"retry: 1000\n\n")
            sent_revision, sent_at = -1, -math.inf
            loop = asyncio.get_running_loop()
            while not self._closing and request.transport is not None and not request.transport.is_closing():
                revision = self._revision()
                if revision != sent_revision or loop.time() - sent_at >= interval:
                    await response.write(self._event(revision))
                    sent_revision, sent_at = revision, loop.time()
                await asyncio.sleep(_POLL_SECONDS)
        except (ConnectionResetError, ConnectionError):
            pass  # the browser went away
        finally:
            self._streams -= 1
        return response

    async def metrics_page(self, request: web.Request) -> web.Response:
        """The Prometheus text exposition of this lighthouse's registry."""
        check_query(request, ())
        body = self.metrics.exposition(self._status())
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _event(self, revision: int) -> bytes:
        status = self._status()
        incarnations = {member["member"]: self._incarnation(member["member"]) for member in status["members"]}
        data = json.dumps(snapshot(status, incarnations, time.time()), separators=(",", ":"))
        return f"event: status\nid: {revision}\ndata: {data}\n\n".encode()


_CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src data:"
)

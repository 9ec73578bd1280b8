"""Who may speak to the lighthouse: the bearer token, and without one what keeps a browser page of another site out.

:meth:`RequestGate.middleware` runs before every handler: the token (all but
``/healthz``; the dashboard's routes also take ``?token=`` or its cookie), the
browser checks when there is no token (``docs/protocol.md``, "Security"),
JSON errors for refused requests, and the connection guard's marks
(:mod:`~stalwart.coord.connections`).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

from stalwart.coord.connections import ConnectionGuard
from stalwart.coord.dashboard import browser_credential
from stalwart.coord.protocol import AUTHORIZATION_HEADER, INCARNATION_HEADER, SECRET_HEADER, parse_header
from stalwart.coord.tls import is_loopback_authority, is_loopback_origin
from stalwart.coord.wire import RequestError

PUBLIC_PATHS = frozenset({"/healthz"})
"""The paths served without the token."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class RequestGate:
    """Checks every request against ``token`` (None: the browser checks instead; ``loopback``: the server serves
    loopback only); ``port()`` and ``guard()`` are the server's, once started."""

    def __init__(
        self, token: str | None, loopback: bool, port: Callable[[], int], guard: Callable[[], ConnectionGuard | None]
    ) -> None:
        self.token = token
        self.loopback = loopback
        self.port = port
        self.guard = guard

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Bearer-token check (all but ``/healthz``), JSON errors for refused requests, the connection guard's marks."""
        guard = self.guard()
        if guard is not None:
            guard.request_started(request)
        try:
            if self.token is None:
                self.check_browser(request)
            if request.path not in PUBLIC_PATHS:
                self.check_token(request)
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

    def check_token(self, request: web.Request) -> None:
        """401 unless the request carries the bearer token (the dashboard's routes also take ?token= or the cookie)."""
        if self.token is None:
            return
        given = parse_header(request.headers.get(AUTHORIZATION_HEADER), AUTHORIZATION_HEADER)
        given = given or parse_header(browser_credential(request, self.port()) or None, "token")
        if given is None or not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            raise RequestError(
                401,
                "missing or wrong bearer token in the Authorization header "
                "(the dashboard's / and /v1/events also take ?token= or the stalwart_token cookie)",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def check_browser(self, request: web.Request) -> None:
        """Without a token, what keeps a browser page of another site out (``docs/protocol.md``, "Security").

        On loopback, a ``Host`` that is not a loopback name is refused (403): a page of another site reaching
        us through DNS rebinding sends its own name. A write (any method but GET and HEAD, or a websocket) with
        an ``Origin`` that is not a loopback page is refused (403), and a write must be JSON (415): a
        cross-origin page can send text/plain, a form or an untyped body without asking first, never JSON.
        """
        host = request.headers.get("Host", "")
        if self.loopback and not is_loopback_authority(host):
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


def identity(request: web.Request) -> tuple[str | None, str | None]:
    """The member identity headers, incarnation and secret (400 when they are not printable ASCII)."""
    return (
        parse_header(request.headers.get(INCARNATION_HEADER), INCARNATION_HEADER),
        parse_header(request.headers.get(SECRET_HEADER), SECRET_HEADER),
    )

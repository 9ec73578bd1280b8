"""One log line per kind of client error per interval, instead of a traceback per event.

A hostile or broken client can make the lighthouse's HTTP stack log on every
connection (a malformed request, a socket closed mid-write, accept failures):
:class:`Throttle`, installed on those loggers and on the lighthouse's event
loop, lets the first record of each kind through per ``interval`` seconds,
without its traceback, and says how many of that kind it held back since.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

INTERVAL_S = 10.0
QUIETED_LOGGERS = ("aiohttp.server", "aiohttp.web", "aiohttp.websocket", "asyncio", "stalwart.coord.metrics")
"""Loggers that client behaviour can drive: the HTTP server's, aiohttp's web and websocket code's, asyncio's, the
heal reports'."""

log = logging.getLogger("stalwart.coord.server")


class Throttle(logging.Filter):
    """Passes one record per (logger, message, exception type) per ``interval`` seconds, tracebacks stripped."""

    def __init__(self, interval: float = INTERVAL_S) -> None:
        super().__init__("stalwart-throttle")
        self.interval = interval
        self._seen: dict[tuple[str, str, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        kind = (record.name, str(record.msg), type(error).__name__ if error is not None else "")
        now = time.monotonic()
        last, held = self._seen.get(kind, (-float("inf"), 0))
        if now - last < self.interval:
            self._seen[kind] = (last, held + 1)
            return False
        if len(self._seen) > 1024:
            self._seen.clear()
        self._seen[kind] = (now, 0)
        if error is not None:
            record.msg = f"{record.msg} ({type(error).__name__}: {error})"
            record.exc_info = None
            record.exc_text = None
        if held:
            record.msg = f"{record.msg} [{held} more like it in the last {self.interval:g} s]"
        return True


_THROTTLE = Throttle()


def install() -> Throttle:
    """Throttle the loggers of :data:`QUIETED_LOGGERS` (once per process)."""
    for name in QUIETED_LOGGERS:
        logger = logging.getLogger(name)
        if _THROTTLE not in logger.filters:
            logger.addFilter(_THROTTLE)
    return _THROTTLE


def loop_exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The lighthouse loop's handler: asyncio's errors (a failed accept, a task's lost exception), throttled."""
    error = context.get("exception")
    record = log.makeRecord(
        log.name, logging.ERROR, __file__, 0, str(context.get("message", "event loop error")), (), None
    )
    if error is not None:
        record.exc_info = (type(error), error, error.__traceback__)
    if _THROTTLE.filter(record):
        log.handle(record)

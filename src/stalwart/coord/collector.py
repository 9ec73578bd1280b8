"""Keeping the garbage collector's pauses out of failure handling, in a process the lighthouse owns.

CPython's full collection visits every object it tracks: a lighthouse holds
some 70 for each open connection (two per member) besides the 190,000 its
imports leave, so with thousands of members one collection stalls the event
loop for hundreds of milliseconds, and a failure (thousands of requests
allocated at once) is what triggers one. :class:`QuietCollector`:

- freezes what lives (:func:`gc.freeze`) at start-up and after each full
  collection, so the automatic collections only visit what was allocated since;
- switches automatic collection off while the lighthouse is *busy* (requests
  wait, the quorum is broken, or a new quorum's answers are going out), for
  at most ``max_busy`` seconds;
- runs the full collection (unfreeze, collect, freeze) when it is quiet again,
  ``delay`` seconds after a quorum formed, once the fleet changed by a
  quarter since the last one (at least one member):

  - members that died or left number a quarter of the live ones: their
    connections are the garbage frozen with them (some 80 objects each), so
    what is frozen but dead stays under a quarter of the fleet's;
  - or the live members grew by a quarter (the fleet's start-up among it):
    what members that joined since hold is not frozen, and every automatic
    full collection visits it. Heartbeats keep promoting short-lived
    objects to the oldest generation, so without this an automatic full
    collection ran every few seconds at 4,096 members, each a pause of
    300-800 ms, failure or not.

  Either way the pause (linear in the members) is paid once per quarter of
  the fleet changed, and never while requests wait.

``Lighthouse.serve_forever`` uses it; an embedded lighthouse leaves its host's
collector alone.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)

DELAY_S = 5.0
"""How long after a quorum formed the full collection waits (its answers are out, the fleet is training)."""
CHANGE_FRACTION = 0.25
"""A full collection once this fraction of the live members died or left, or joined, since the last one."""
MAX_BUSY_S = 60.0
"""The longest automatic collection stays off while busy (a quorum that cannot form must not grow memory)."""


class QuietCollector:
    """Garbage collection pauses only when nothing waits on the lighthouse; see the module doc."""

    def __init__(self, delay: float = DELAY_S, max_busy: float = MAX_BUSY_S) -> None:
        self.delay = delay
        self.max_busy = max_busy
        self._due: float | None = None
        self._busy_since: float | None = None
        self._gone = 0
        """Members that had died or left at the last full collection."""
        self._live = 0
        """Members alive at the last full collection."""

    def start(self) -> None:
        """Collect and freeze what the start-up left (imports, the store): later collections skip it."""
        gc.collect()
        gc.freeze()

    def update(self, now: float, *, busy: bool, formed: bool, gone: int, live: int) -> None:
        """After an event or a tick at ``now``: ``busy`` while requests wait or the quorum is broken; ``gone``
        counts the members that ever died or left, ``live`` those alive."""
        if formed:
            self._due = now + self.delay
        if busy:
            if self._busy_since is None:
                self._busy_since = now
            if now - self._busy_since <= self.max_busy:
                gc.disable()
                return
        else:
            self._busy_since = None
        gc.enable()
        lost = gone - self._gone >= max(1, CHANGE_FRACTION * live)
        grown = live - self._live >= max(1, CHANGE_FRACTION * self._live)
        if self._due is not None and now >= self._due and not busy and (lost or grown):
            self._due, self._gone, self._live = None, gone, live
            started = time.perf_counter()
            gc.unfreeze()
            collected = gc.collect()
            gc.freeze()
            pause = 1000 * (time.perf_counter() - started)
            logger.info("full garbage collection while quiet: %d objects freed in %.0f ms", collected, pause)

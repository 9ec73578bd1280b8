"""A turnstile for the lighthouse's event loop: at most so many tasks go on per iteration of the loop.

After a failure at thousands of members the survivors' answers all wait on
the same event (the quorum formed, its save done), and asyncio resumes every
task woken in one iteration together: some 50 µs each to render and send,
so 4,000 answers made one iteration of 200 ms, and a ``/healthz`` request
waited behind it. Tasks that pass the turnstile go on at most
``per_iteration`` a loop iteration, in the order they came, the others
waiting their turn; the answers still go out as fast as the loop sends
them, in iterations short enough for a request to pass between them. The
members' sockets are paced the same way on the reading side
(:mod:`~stalwart.coord.selector`), and the wake-ups of many waiters on one
event by :func:`release`.

Written here because asyncio has no such primitive (a semaphore bounds how
many run at once, not how many resume per iteration).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from typing import TypeVar

from stalwart._validate import check_int

PER_ITERATION = 64
"""Tasks let through per loop iteration: 3-5 ms of answers at 4,096 members (the selector's and the push's batch)."""

Result = TypeVar("Result")


def release(waiters: Iterable[asyncio.Future[Result]], result: Result, per_iteration: int = PER_ITERATION) -> None:
    """Set ``result`` on ``waiters`` in order, ``per_iteration`` of them per loop iteration (done ones skipped).

    For the events thousands of tasks wait on at once (a quorum formed, a
    save ended): setting every result together resumes every task in the
    next iteration.
    """
    check_int("per_iteration", per_iteration, minimum=1)
    pending = deque(waiters)

    def next_batch() -> None:
        _release_some(pending, result, per_iteration)
        if pending:
            asyncio.get_running_loop().call_soon(next_batch)

    next_batch()


def _release_some(pending: deque[asyncio.Future[Result]], result: Result, most: int) -> None:
    """Set ``result`` on the first ``most`` of ``pending`` not done yet (a waiter cancelled meanwhile leaves its turn
    to the next one), taking them, and the done ones before them, off the queue."""
    released = 0
    while pending and released < most:
        waiter = pending.popleft()
        if not waiter.done():
            waiter.set_result(result)
            released += 1


class Turnstile:
    """``await turnstile.passage()``: returns in a later loop iteration, at most ``per_iteration`` callers per
    iteration, in the order they came.

    Every caller queues, even when nobody else waits (one iteration of
    latency): one callback a loop iteration lets the next ``per_iteration``
    go, and they resume in the iteration after it, so no iteration resumes
    more than that, whoever arrives when.
    """

    def __init__(self, per_iteration: int = PER_ITERATION) -> None:
        self.per_iteration = check_int("per_iteration", per_iteration, minimum=1)
        self._queue: deque[asyncio.Future[None]] = deque()
        self._letting = False

    @property
    def waiting(self) -> int:
        """Callers queued."""
        return len(self._queue)

    async def passage(self) -> None:
        """Queue, and return once let through."""
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[None] = loop.create_future()
        self._queue.append(turn)
        if not self._letting:
            self._letting = True
            loop.call_soon(self._let_through, loop)
        await turn

    def _let_through(self, loop: asyncio.AbstractEventLoop) -> None:
        """Once a loop iteration while anyone queues: let the next ``per_iteration`` go (they resume in the next)."""
        _release_some(self._queue, None, self.per_iteration)
        if self._queue:
            loop.call_soon(self._let_through, loop)
        else:
            self._letting = False

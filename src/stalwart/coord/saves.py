"""The lighthouse's durability: what changed in its state, saved on one save thread, off the event loop.

A quorum answer or a registration leaves only once the state that made it is
saved (:meth:`Saves.require`), so a restarted lighthouse never forgets what it
announced; it fails closed: an answer whose state could not be saved is not
handed out (503, asked again) until a save succeeds. Saves are counted as
snapshots, numbered from 1 and saved in order, so that a thousand answers of
one quorum wait for one or two saves, not one each.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from stalwart.coord.formation import Formation
from stalwart.coord.metrics import LighthouseMetrics
from stalwart.coord.persist import StateStore
from stalwart.coord.quorum import LighthouseState, RequestError
from stalwart.coord.settings import LighthouseSettings
from stalwart.coord.turnstile import release
from stalwart.data.plan import EpochPlan

logger = logging.getLogger(__name__)


class Saves:
    """Saves ``state`` to ``database`` (None: nothing is written, the changes are drained all the same)."""

    def __init__(self, state: LighthouseState, database: StateStore | None, metrics: LighthouseMetrics) -> None:
        self.state = state
        self.database = database
        """The SQLite store (None without a ``state_path``)."""
        self.metrics = metrics
        self.taken = 0
        """Snapshots of what changed taken for a save so far (numbered from 1, taken and saved in order)."""
        self.saved = 0
        """The number of the last snapshot saved: a request waiting for snapshot ``n`` or later is durable."""
        self._failing = False
        self._lock: asyncio.Lock | None = None
        self._formed = (0, 0)
        """The last quorum formed, and how many snapshots had been taken then."""
        self._ending: list[asyncio.Future[None]] = []
        """Who waits for the save in progress to end (released a batch per loop iteration: thousands may wait)."""
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="stalwart-lighthouse-save")

    def start(self) -> None:
        """Ready the saves on the running event loop."""
        self._lock = asyncio.Lock()

    async def durable(self, after: int | None = None) -> bool:
        """Save what changed (on the save thread); False when the save failed.

        What changed is taken on the loop, so the save is a consistent
        snapshot; it costs what changed (:meth:`LighthouseState.changes`), and
        what a failed save held is saved with the next one. ``after``: the
        number of snapshots taken when the caller's change was made; a snapshot
        taken after it and saved meanwhile is enough (a thousand answers of one
        quorum, or a storm of registrations, wait for one or two saves, not a
        save each while heartbeats go on changing the state).
        """
        assert self._lock is not None
        if self.state.plan is None:
            return True  # nothing to keep before a member brought the plan (registering adopts it, then saves)
        while after is not None and self.saved <= after and self._lock.locked():
            # a save is in progress (the lock is held only while one runs): it may be enough, so wait for it, not
            # in the lock's queue behind the saves after it (a quorum's answers trickle in while the state changes)
            ended = asyncio.get_running_loop().create_future()
            self._ending.append(ended)
            await ended
        if after is not None and self.saved > after:
            return True
        async with self._lock:
            if after is not None and self.saved > after:
                return True
            if not self.state.unsaved:
                return True
            changes = self.state.changes()  # drained even without a database, so nothing piles up
            self.taken += 1
            snapshot = self.taken
            if self.database is None:
                self.saved = snapshot
                return True
            loop = asyncio.get_running_loop()
            try:
                started = time.perf_counter()
                await loop.run_in_executor(self._thread, self.database.save, changes, time.time())
                self.metrics.on_save(time.perf_counter() - started)
            except Exception as error:
                self.state.requeue(changes)
                if not self._failing:
                    logger.error("the lighthouse cannot save its state to %s: %s", self.database.path, error)
                self._failing = True
                return False
            finally:
                ending, self._ending = self._ending, []
                release(ending, None)
            if self._failing:
                logger.warning("the lighthouse saves its state to %s again", self.database.path)
            self._failing = False
            self.saved = snapshot
            return True

    async def require(self, what: str, after: int | None = None) -> None:
        """503 (the client asks again) unless the state, ``what`` included, is saved: the change the caller made
        last, or the one made when ``after`` snapshots were taken."""
        if not await self.durable(after=self.taken if after is None else after):
            raise RequestError(
                503, f"the lighthouse could not persist {what}; it is not handed out, ask again", retry=True
            )

    def formed(self, quorum_id: int) -> None:
        """Quorum ``quorum_id`` just formed: its answers need a snapshot taken from now on (:meth:`require_answer`)."""
        self._formed = (quorum_id, self.taken)

    async def require_answer(self, formation: Formation) -> None:
        """503 (asked again) unless what ``formation``'s answer needs is saved: the state when it is asked (what the
        request changed included), or, for a quorum formed ahead that some survivor has not confirmed yet, the
        formation (it holds what it presumed: a confirmation answered before it is saved is confirmed again, the
        same, after a restart; the last one must be saved first, as after it the quorum may run steps)."""
        after = None
        if formation.ahead is not None and self.state.former.unconfirmed() and self._formed[0] == formation.quorum_id:
            after = self._formed[1]
        await self.require(f"quorum {formation.quorum_id}", after)

    def close(self) -> None:
        """Wait for the save in progress, then close the database."""
        self._thread.shutdown(wait=True)
        if self.database is not None:
            self.database.close()


def load_state(plan: EpochPlan | None, settings: LighthouseSettings, database: StateStore | None) -> LighthouseState:
    """The persisted state when there is one (the plan, if given, and balance must agree), else a fresh one."""
    state_path, balance_every = settings.state_path, settings.balance_every
    rules: dict[str, Any] = {
        "min_replicas": settings.min_replicas,
        "start_replicas": settings.start_replicas,
        "heartbeat_timeout": settings.heartbeat_timeout,
        "join_timeout": settings.join_timeout,
        "max_members": settings.max_members,
        "require_digest": True,
        "ahead_settle": settings.ahead_settle,
    }
    persisted = database.load() if database is not None else None
    if persisted is None:
        return LighthouseState(plan, **rules, balance_every=balance_every or 0)
    state = LighthouseState.from_state_dict(persisted, now=time.time(), **rules)
    if plan is not None and state.plan is not None:
        check_same_plan(plan, state.plan, state_path)
    if balance_every is not None and balance_every != state.balance_every:
        raise ValueError(
            f"balance_every={balance_every} does not match the state persisted in {state_path}: "
            f"balance_every={state.balance_every}"
        )
    return state


def check_same_plan(given: EpochPlan, persisted: EpochPlan, path: object) -> None:
    """Refuse a plan that differs from the persisted one, naming each differing field."""
    if given == persisted:
        return
    ours, theirs = given.to_dict(), persisted.to_dict()
    diffs = ", ".join(
        f"{name}={ours[name]!r} (persisted {theirs[name]!r})" for name in ours if ours[name] != theirs[name]
    )
    raise ValueError(f"plan does not match the state persisted in {path}: {diffs}")

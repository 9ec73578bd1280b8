"""The lighthouse's saves: an answer waits for a save that holds what it needs, never behind the saves after it."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from stalwart.coord.metrics import LighthouseMetrics
from stalwart.coord.persist import StateStore
from stalwart.coord.quorum import LighthouseState
from stalwart.coord.saves import Saves
from stalwart.data.plan import EpochPlan

PLAN = EpochPlan(96, 8, seed=1)
BOUND_S = 10.0


class GatedStore(StateStore):
    """A real SQLite store whose saves each wait for the test to let them through (a slow disk, on demand)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.gates: list[threading.Event] = []
        self.started = threading.Semaphore(0)

    def save(self, changes: Any, saved_at: float) -> None:
        gate = threading.Event()
        self.gates.append(gate)
        self.started.release()
        if not gate.wait(BOUND_S):
            raise TimeoutError("the test never let this save through")
        super().save(changes, saved_at)


def test_a_caller_the_save_in_progress_holds_does_not_wait_for_the_next_save(tmp_path: Path) -> None:
    store = GatedStore(tmp_path / "state.db")
    state = LighthouseState(PLAN)
    saves = Saves(state, store, LighthouseMetrics())

    async def scenario() -> None:
        saves.start()
        state.register("a", "a" * 32, 1.0)
        after = saves.taken  # the change the answer needs was made with this many snapshots taken
        first = asyncio.create_task(saves.durable())  # takes snapshot 1 (the change included), then its disk waits
        await asyncio.to_thread(store.started.acquire, True, BOUND_S)
        state.register("b", "b" * 32, 1.0)  # the state goes on changing: the next save has work
        second = asyncio.create_task(saves.durable())  # queued on the lock behind the first
        answer = asyncio.create_task(saves.durable(after=after))
        await asyncio.sleep(0.05)
        store.gates[0].set()  # the first save ends; the second starts and its disk waits
        assert await asyncio.wait_for(answer, BOUND_S), "snapshot 1 held the change: the answer goes"
        assert not second.done(), "the second save is still in progress: the answer did not wait for it"
        await asyncio.to_thread(store.started.acquire, True, BOUND_S)
        store.gates[1].set()
        assert await first and await second and saves.saved == 2

    try:
        asyncio.run(scenario())
    finally:
        for gate in store.gates:
            gate.set()
        saves.close()

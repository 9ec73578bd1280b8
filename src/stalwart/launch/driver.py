"""The demo's chaos driver: fires failures at a local cluster and sees every restarted worker back in.

A failed worker (SIGKILL or SIGSTOP) is revived after ``restart_after``
seconds: started again, or sent SIGCONT (once the lighthouse has excluded
it, so that a short stop still shows as a failure and a rejoin). The
survivors train ``HOLD_LEAD`` more steps without it, then the job is *held*
(workers wait before their next step, see :class:`~stalwart.launch.cluster.LocalCluster`)
until the revived worker has rejoined, so that it rejoins however long its
start-up takes and however fast the steps are; the hold is bounded by
``rejoin_limit``. A hold never keeps a joiner out: once it asks, the
lighthouse wants a boundary and the held workers go on to it.
The job is also held at each planned failure's step until the signal is
sent, so that ``--kill STEP:WORKER`` lands at that step however fast steps are
(after the rejoin of a worker revived earlier, so that failures planned at
different steps never overlap).
Random failures (``mtbf``) are timed on a clock that runs only while the job
trains (not during start-up or holds), and hit workers that are in the
quorum, so that a worker is never killed again while it is still starting.

Every failure, restart, rejoin, heal and failed rejoin is kept in
:attr:`ChaosDriver.events` (for the report and the plot) and announced with
``say``, one line each.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stalwart.launch.cluster import LocalCluster, PlannedKill, latest_step, worker_events

HOLD_LEAD = 3
"""Steps the survivors train after a failure before the job waits for the failed worker to rejoin."""
REJOIN_LIMIT = 300.0
"""Seconds the job is held at most for one revived worker to rejoin."""
_STATUS_INTERVAL = 0.2
_POLL_INTERVAL = 0.05


@dataclass
class _Revival:
    """A revived worker the driver waits for: it asks to join, then joins (and is healed)."""

    worker: int
    since: float
    pid: int
    asked: bool = False


@dataclass
class Progress:
    """What the driver last saw: steps committed, last loss, world size, and what it waits for."""

    committed: int = 0
    loss: float | None = None
    world: int = 0
    waiting_for: str = ""


@dataclass
class ChaosDriver:
    """Runs a local cluster to the end of the job while injecting failures; see the module docstring."""

    cluster: LocalCluster
    workers: int
    steps: int
    planned: list[PlannedKill]
    random_times: list[float]
    restart_after: float
    signal_name: str
    status: Callable[[], dict[str, Any]]
    say: Callable[[str], None]
    rng: random.Random = field(default_factory=random.Random)
    rejoin_limit: float = REJOIN_LIMIT
    events: list[dict[str, Any]] = field(default_factory=list)
    progress: Progress = field(default_factory=Progress)
    _revivals_due: list[tuple[float, int]] = field(default_factory=list)
    _waiting: dict[int, _Revival] = field(default_factory=dict)
    _status_cache: dict[str, Any] = field(default_factory=dict)
    _status_time: float = 0.0
    _training_clock: float = 0.0
    _failure_holds: dict[int, int] = field(default_factory=dict)
    _hold_step: int | None = None
    _hold_since: float | None = None

    def run(self, timeout: float, on_progress: Callable[[Progress], None] = lambda progress: None) -> bool:
        """Start every worker and drive the job until all exited; False when ``timeout`` s passed first."""
        deadline = time.monotonic() + timeout
        for worker in range(self.workers):
            self.cluster.start(worker)
        last = time.monotonic()
        while self.cluster.running() and time.monotonic() < deadline:
            now = time.monotonic()
            self._tick(now - last)
            last = now
            on_progress(self.progress)
            time.sleep(_POLL_INTERVAL)
        self._settle()
        return not self.cluster.running()

    def _tick(self, elapsed: float) -> None:
        committed, loss, world = latest_step(self.cluster.run_dir)
        self.progress.committed, self.progress.loss, self.progress.world = committed, loss, world
        running = committed < self.steps
        if committed > 0 and running and self._hold_since is None:
            self._training_clock += elapsed
        if running:
            self._fire_planned(committed)
            self._fire_random(committed)
        self._revive_due(committed)
        self._follow_revivals(committed)
        self._update_hold(committed)
        if not running:
            for worker in list(self.cluster.stopped):
                self.cluster.revive(worker)
        self.progress.waiting_for = self._waiting_text(committed)

    def _waiting_text(self, committed: int) -> str:
        if committed == 0:
            return f"waiting for {self.workers} workers to start and join the first quorum"
        if self._hold_since is not None and self._failure_holds:
            names = ", ".join(f"worker-{worker}" for worker in sorted(self._failure_holds))
            return f"holding the job until {names} asks to rejoin"
        return ""

    # --- failures --------------------------------------------------------------------------------

    def _fire_planned(self, committed: int) -> None:
        """Send the planned failures that are due, once no revived worker is still rejoining.

        A failure landing in another's repair (a rejoin and its reshard) is two
        failures at once, which parity of one does not cover: the job is held at
        the planned step until the rejoin ends, then the signal goes.
        """
        if self._waiting:
            return
        due = [kill for kill in self.planned if kill.step <= committed]
        self.planned[:] = [kill for kill in self.planned if kill not in due]
        for kill in due:
            self._kill(kill.worker, committed)

    def _fire_random(self, committed: int) -> None:
        while self.random_times and self.random_times[0] <= self._training_clock:
            self.random_times.pop(0)
            candidates = [w for w in self._in_quorum() if w in self.cluster.alive() and w not in self._waiting]
            if len(candidates) > 1:
                self._kill(self.rng.choice(candidates), committed)

    def _kill(self, worker: int, committed: int) -> None:
        if worker not in self.cluster.alive():
            self.say(f"step {committed}: worker-{worker} is not running; no signal sent")
            return
        self.cluster.kill(worker, self.signal_name, committed)
        self._record("failure", worker, committed, signal=self.signal_name)
        self.say(f"step {committed}: SIG{self.signal_name} worker-{worker}")
        self._revivals_due.append((time.monotonic() + self.restart_after, worker))
        self._failure_holds[worker] = committed + HOLD_LEAD

    # --- revivals and rejoins --------------------------------------------------------------------

    def _revive_due(self, committed: int) -> None:
        now = time.monotonic()
        for when, worker in [item for item in self._revivals_due if item[0] <= now]:
            if self._still_in_quorum(worker) and now - when < self.rejoin_limit and committed < self.steps:
                continue
            self._revivals_due.remove((when, worker))
            if committed >= self.steps and worker not in self.cluster.stopped:
                self.say(f"worker-{worker} is not restarted: the job has ended")
                continue
            if not self.cluster.revive(worker):
                continue
            how = self.cluster.restarts[-1]["how"]
            self._record("restart", worker, committed, how=how)
            self._waiting[worker] = _Revival(worker, time.time(), self.cluster.processes[worker].pid)
            if committed < self.steps:
                self.say(f"step {committed}: {how} worker-{worker}; the job waits for it to rejoin")

    def _follow_revivals(self, committed: int) -> None:
        members = {entry["member"]: entry for entry in self._status().get("members", [])} if self._waiting else {}
        for worker, revival in list(self._waiting.items()):
            joined = [e for e in worker_events(self.cluster.run_dir, worker) if e["time"] >= revival.since]
            join = next((e for e in joined if e["event"] == "joined" and e["pid"] == revival.pid), None)
            if join is not None and join["step"] >= self.steps:
                self._failed(revival, committed, f"it joined after the job had committed its {join['step']} steps")
                continue
            if join is not None:
                self._rejoined(revival, join, joined)
                continue
            entry = members.get(f"worker-{worker}")
            if not revival.asked and entry is not None and (entry["asking"] == "join" or entry["state"] == "alive"):
                revival.asked = True  # the hold stays until it has joined: it lets the joiner's boundary through
                self.say(f"worker-{worker} asks to rejoin")
            process = self.cluster.processes[worker]
            if process.poll() is not None:
                self._failed(revival, committed, _exit_reason(joined, process.returncode))
            elif time.time() - revival.since > self.rejoin_limit:
                self._failed(revival, committed, f"did not rejoin within {self.rejoin_limit:g} s")

    def _rejoined(self, revival: _Revival, join: dict[str, Any], events: list[dict[str, Any]]) -> None:
        worker = revival.worker
        del self._waiting[worker]
        self._failure_holds.pop(worker, None)
        self._record("rejoin", worker, join["step"], quorum_id=join["quorum_id"], world_size=join["world_size"])
        heal = next((e for e in events if e["event"] == "healed" and e["pid"] == revival.pid), None)
        if heal is not None:
            self._record("heal", worker, heal["step"])
        healed = ", healed from a live peer" if heal is not None else ""
        where = f"quorum {join['quorum_id']}, world {join['world_size']}"
        self.say(f"step {join['step']}: worker-{worker} rejoined ({where}){healed}")

    def _failed(self, revival: _Revival, committed: int, reason: str) -> None:
        del self._waiting[revival.worker]
        self._failure_holds.pop(revival.worker, None)
        self._record("failed_rejoin", revival.worker, committed, reason=reason)
        self.say(f"step {committed}: worker-{revival.worker} did not rejoin: {reason}")

    def _settle(self) -> None:
        """After the job: revivals still waiting either joined at the very end or failed."""
        self._failure_holds.clear()
        self.planned.clear()
        self._update_hold(self.progress.committed)
        if self._waiting:
            self._follow_revivals(self.progress.committed)
        for revival in list(self._waiting.values()):
            self._failed(revival, self.progress.committed, "the job ended before it joined")

    # --- holds -----------------------------------------------------------------------------------

    def _update_hold(self, committed: int) -> None:
        """Hold the job at the earliest of the next planned failure and each failed worker's rejoin step.

        The time workers actually wait is kept as a ``hold`` event, which the
        report leaves out of recovery times.
        """
        wanted = [kill.step for kill in self.planned] + list(self._failure_holds.values())
        target = min(wanted) if wanted and committed < self.steps else None
        biting = target is not None and committed >= target
        if biting and self._hold_since is None:
            self._hold_since = time.time()
        if not biting and self._hold_since is not None:
            self.events.append({"kind": "hold", "step": committed, "time": self._hold_since, "end": time.time()})
            self._hold_since = None
        if target != self._hold_step:
            if target is None:
                self.cluster.release()
            else:
                self.cluster.hold(target)
            self._hold_step = target

    # --- helpers ---------------------------------------------------------------------------------

    def _still_in_quorum(self, worker: int) -> bool:
        """A stopped worker the lighthouse has not excluded yet: resuming it now would show no failure."""
        return worker in self.cluster.stopped and worker in self._in_quorum()

    def _in_quorum(self) -> list[int]:
        """Workers the lighthouse has in the current quorum."""
        quorum = self._status().get("quorum") or {}
        return [int(m.removeprefix("worker-")) for m in quorum.get("members", []) if m.startswith("worker-")]

    def _status(self) -> dict[str, Any]:
        now = time.monotonic()
        if now - self._status_time >= _STATUS_INTERVAL:
            with contextlib.suppress(OSError):
                self._status_cache = self.status()
            self._status_time = now
        return self._status_cache

    def _record(self, kind: str, worker: int, step: int, **details: Any) -> None:
        self.events.append({"kind": kind, "worker": worker, "step": step, "time": time.time(), **details})


def _exit_reason(events: list[dict[str, Any]], returncode: int | None) -> str:
    """Why a revived worker exited without joining: its own last word, else its exit status."""
    for event in reversed(events):
        if event["event"] == "error":
            return str(event["message"])
        if event["event"] == "joined_after_end":
            return f"it joined after the job had committed its {event['step']} steps"
    return f"it exited with status {returncode} before joining (see its log)"

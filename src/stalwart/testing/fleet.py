"""A simulated fleet: worker processes driving a ``LighthouseState`` on a simulated clock, as ``docs/protocol.md`` says.

No process, no socket, no real time: a test steps the clock, kills
members (their socket closes, or they just go silent), and checks what the
lighthouse decides. Each member either only counts its applied steps or, with
``replay_ledgers=True``, replays its own copy of the ledger as the Manager
does and reports its digest (and a balanced ledger's weights) with every
heartbeat and request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from stalwart.coord.hosted_ledger import ledger_digest
from stalwart.coord.protocol import QuorumRequest
from stalwart.coord.quorum import Formation, LighthouseState
from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan

TICK = 0.25
"""Simulated seconds between two of :meth:`SimulatedFleet.settle`'s ticks."""


@dataclass
class SimulatedMember:
    """What one simulated process knows: its applied step and, when it replays, its ledger and last report."""

    applied: int = 0
    ledger: DataLedger | None = None
    digest: str | None = None
    weights: dict[str, Any] | None = None


class SimulatedFleet:
    """Simulated processes around one ``LighthouseState``; ``state_options`` are the state's own keywords.

    ``formations`` lists every quorum formed; ``log`` maps each committed step to its epoch and positions.
    """

    def __init__(
        self,
        plan: EpochPlan,
        min_replicas: int = 1,
        heartbeat_timeout: float = 1.0,
        join_timeout: float = 2.0,
        *,
        replay_ledgers: bool = False,
        **state_options: Any,
    ) -> None:
        self.log: dict[int, tuple[int, list[int]]] = {}
        self.state = LighthouseState(
            plan, min_replicas, heartbeat_timeout, join_timeout, on_commit=self._committed, **state_options
        )
        self.replay_ledgers = replay_ledgers
        self.now = 0.0
        self.processes: dict[str, SimulatedMember] = {}
        self.formations: list[Formation] = []
        self.disclaimed: set[str] = set()
        self._next_id = 0

    def _committed(self, epoch: int, step: int, positions: np.ndarray) -> None:
        self.log[step] = (epoch, positions.tolist())

    @property
    def members(self) -> list[str]:
        """The current quorum's members (alive or not)."""
        quorum = self.state.quorum
        return [] if quorum is None else list(quorum.members)

    @property
    def applied(self) -> dict[str, int]:
        """Each live process's applied step."""
        return {name: process.applied for name, process in self.processes.items()}

    def current_shares(self) -> dict[str, list[int]]:
        """The shares of the step the quorum is in, as every member computes them (a fresh step's when none is)."""
        state = self.state.ledger_state()
        if state["members"] is not None:
            return {member: list(share) for member, share in state["in_flight"].items()}
        ledger = DataLedger.from_state_dict(state)
        return {member: share.tolist() for member, share in ledger.begin_step(self.members).items()}

    def holders(self) -> set[str]:
        """Live quorum members that hold the job's state (they did not disclaim it by asking to join afresh)."""
        return {m for m in self.members if m in self.processes and m not in self.disclaimed}

    def spawn(self, applied: int = 0) -> str:
        """A new process opens its heartbeat socket; returns its name (``w0``, ``w1``, ...)."""
        name = f"w{self._next_id}"
        self._next_id += 1
        self.processes[name] = SimulatedMember(applied)
        self.state.connected(name, self.now)
        return name

    def request(self, member: str, reason: str, applied: int | None = None) -> QuorumRequest:
        """The ``POST /v1/quorum`` body ``member`` sends for ``reason`` (at its applied step unless ``applied``)."""
        quorum = self.state.quorum
        quorum_id = None if reason == "join" or quorum is None else quorum.quorum_id
        process = self.processes[member]
        step = process.applied if applied is None else applied
        return QuorumRequest(member, step, quorum_id, reason, process.digest, process.weights)

    def ask(self, member: str, reason: str, applied: int | None = None) -> dict[str, Any] | None:
        """``member`` asks for a quorum; the answer if one formed at once."""
        return self.state.request(self.request(member, reason, applied), self.now)

    def heartbeat(self, members: list[str] | None = None) -> None:
        """Live processes (or ``members``) report their applied step (and digest and weights when replaying)."""
        for member in list(self.processes) if members is None else members:
            process = self.processes[member]
            self.state.heartbeat(member, process.applied, self.now, process.digest, process.weights)

    def kill(self, member: str, how: str = "socket") -> None:
        """A process dies: its socket closes at once (``socket``), or it just stops talking (``timeout``)."""
        if how not in ("socket", "timeout"):
            raise ValueError(f"how must be 'socket' or 'timeout', got {how!r}")
        del self.processes[member]
        if how == "socket":
            self.state.disconnected(member, self.now)

    def tick(self) -> Formation | None:
        """One tick of the lighthouse at the current time; a formed quorum is recorded and healed."""
        formation = self.state.tick(self.now)
        if formation is not None:
            self._adopt(formation)
        return formation

    def _adopt(self, formation: Formation) -> None:
        self.formations.append(formation)
        targets = [] if formation.heal is None else formation.heal["targets"]
        for member in targets:
            if member in self.processes:
                process = self.processes[member]
                process.applied, process.digest, process.weights = formation.applied_step, None, None
        if self.replay_ledgers:
            for member in formation.members:
                if member in self.processes:
                    self.processes[member].ledger = DataLedger.from_state_dict(formation.ledger)
        self.disclaimed -= set(formation.members)

    def settle(self, limit: int = 80) -> Formation:
        """Let time pass (live processes heartbeating) until a quorum forms; it is healed and returned."""
        for _ in range(limit):
            formation = self.tick()
            if formation is not None:
                return formation
            self.now += TICK
            self.heartbeat()
        raise AssertionError(f"no quorum formed in {limit} ticks; pending {self.state.pending}")

    def start(self, count: int) -> Formation:
        """``count`` new processes ask to join and form the first quorum at once."""
        for member in [self.spawn() for _ in range(count)]:
            if self.ask(member, "join") is not None:
                raise AssertionError(f"{member} got an answer before the others asked")
        formation = self.tick()
        if formation is None:
            raise AssertionError(f"no first quorum of {count}; pending {self.state.pending}")
        return formation

    def run_steps(self, count: int) -> None:
        """Every live quorum member applies ``count`` steps on the fast path and reports each."""
        for _ in range(count):
            for member in self.members:
                if member in self.processes:
                    self.finish(member)
            self.now += 0.05
            self.heartbeat()

    def begin(self) -> None:
        """Every live quorum member enters the step, as the Manager does; they must compute the same shares."""
        splits = []
        for member in self.members:
            ledger = self.processes[member].ledger
            if ledger is None:
                raise AssertionError(f"{member} replays no ledger (replay_ledgers=False or not in a quorum yet)")
            if not ledger.in_step:
                ledger.begin_step(self.members)
            splits.append({m: share.tolist() for m, share in ledger.in_flight.items()})
        if any(split != splits[0] for split in splits):
            raise AssertionError(f"the members computed different shares: {splits}")

    def finish(self, member: str, weights: dict[str, int] | None = None, *, reweigh_every: int = 0) -> None:
        """``member`` applies its step; replaying, it commits its ledger, re-weighs with ``weights`` at a decision
        step (every ``reweigh_every`` steps), and keeps the digest and weights it will report."""
        process = self.processes[member]
        process.applied += 1
        if not self.replay_ledgers:
            return
        ledger = process.ledger
        if ledger is None:
            raise AssertionError(f"{member} replays no ledger")
        if not ledger.in_step:
            ledger.begin_step(self.members)
        ledger.commit()
        if weights and reweigh_every and ledger.step % reweigh_every == 0:
            ledger.reweigh(weights)
        process.applied = ledger.step
        process.digest, process.weights = ledger_digest(ledger.state_dict()), ledger.weights_record()

    def act(self, *, members_too: bool = True) -> None:
        """Every live process that waits for nothing acts: the quorum's members answer a broken quorum with
        ``failure`` and a pending change at the step's end with ``reconfigure``; any other process asks to join."""
        pending = self.state.pending
        for member in list(self.processes):
            if member in pending:
                continue
            if member in self.members and member not in self.disclaimed:
                if not members_too:
                    continue
                if self.state.quorum_broken:
                    self.ask(member, "failure")
                elif self.state.reconfigure_pending:
                    self.finish(member)
                    self.heartbeat([member])
                    self.ask(member, "reconfigure")
            else:
                self.ask(member, "join", 0)

    def run(self, rounds: int, *, members_too: bool = True) -> None:
        """``rounds`` ticks of processes that follow the protocol on their own (see :meth:`act`)."""
        for _ in range(rounds):
            self.act(members_too=members_too)
            self.tick()
            self.now += TICK
            self.heartbeat()

"""The quorum keeper: a member's place in the quorum, shared by both sync modes.

It joins (asks the lighthouse, connects the groups, heals, reshards the
sharded state, with bounded attempts), checks the lighthouse's plan on the
first join, holds the one flag that asks for a step boundary (a new quorum
before the next step: :meth:`QuorumKeeper.want_boundary`), and ends the job
(the final checkpoint, the farewell). Every-step training
(:mod:`stalwart.runtime.every_step`) and DiLoCo's rounds
(:mod:`stalwart.runtime.diloco.rounds`) are both built on it, so that a join
behaves the same in both. Parts that must act after a heal (reset the step,
start a round over) register with :meth:`QuorumKeeper.on_heal`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader

from stalwart._validate import check_int
from stalwart.data.ledger import DataLedger
from stalwart.data.plan import EpochPlan
from stalwart.errors import JobFinishedError, JoinError, PlanMismatchError
from stalwart.runtime.checkpointing import CheckpointPolicy
from stalwart.runtime.comm import CollectiveError
from stalwart.runtime.config import Checkpointing, Checks, Transport
from stalwart.runtime.diagnosis import LeaderLoss
from stalwart.runtime.events import Event, EventHook
from stalwart.runtime.loader import ElasticLoader
from stalwart.runtime.patience import MAX_GROWTH, QUIET_STEPS, CollectivePatience, QuorumView
from stalwart.runtime.planner import StepPlanner
from stalwart.runtime.probe import LinkNeed
from stalwart.runtime.replica import Replica
from stalwart.runtime.session import CommittedReport, QuorumSession
from stalwart.runtime.timeouts import Timeouts
from stalwart.runtime.zero import ShardedOptimizer

log = logging.getLogger(__name__)
CLOSE_WAIT = 120.0
"""Seconds a departure or ``close()`` waits for a checkpoint being written and reported."""


class QuorumKeeper:
    """Keeps ``member`` in a working quorum: join, heal, plan check, the boundary flag, the job's end.

    ``internal`` is the context in which the Manager's own use of the
    optimizer (heal, checkpoints) bypasses the user's update window;
    ``link_bytes`` what one step's all-reduce carries (for a failure's
    diagnosis of the links).
    """

    def __init__(
        self,
        member: str,
        *,
        session: QuorumSession,
        planner: StepPlanner,
        replica: Replica,
        transport: Transport,
        timeouts: Timeouts,
        checks: Checks,
        plan: EpochPlan | None,
        checkpoint: Checkpointing | None,
        sharded: ShardedOptimizer | None,
        fsdp: bool,
        events: EventHook,
        internal: Callable[[], contextlib.AbstractContextManager[None]],
        link_bytes: Callable[[], int],
    ) -> None:
        self.member = member
        self.session = session
        self.planner = planner
        self.replica = replica
        self.transport = transport
        self.timeouts = timeouts
        self.checks = checks
        self.checkpoints = (
            None if checkpoint is None else CheckpointPolicy(checkpoint, session, replica, sharded, fsdp_group=fsdp)
        )
        """Durable checkpoints (``checkpoint``): ``fsdp``, this member is an FSDP2 group writing together."""
        self.events = events
        self.internal = internal
        self._plan = plan
        self._sharded = sharded
        self._link_bytes = link_bytes
        self._patience = CollectivePatience(timeouts.collective_timeout)
        self._boundary = True
        """A new quorum is wanted before the next step (the only place this is decided)."""
        self._committed_here: DataLedger | None = None
        """The ledger as committed at this boundary, kept when a quorum formed here (its answer begins the next step,
        which no checkpoint may hold); None when this member had none (it first joined here)."""
        self._heal_listeners: list[Callable[[], None]] = []
        self._connect_listeners: list[Callable[[], None]] = []
        self.max_steps: int | None = None
        """The steps (DiLoCo: rounds) the job commits, once ``steps()`` started."""
        self.recoveries = 0
        """Failures recovered from (a new quorum mid-step or mid-round)."""
        self.leader_loss: LeaderLoss | None = None
        """The current quorum broke while its leader ran on_leader() work: its failures' messages say so."""
        self.finished = False
        """The job's end was reached here (its last step, or a late join): ``close()`` then leaves cleanly."""
        self.joined_after_end = False
        """This worker joined after the job's last step and loaded its final checkpoint."""
        self.untrained_late_join = False
        self.stepping = False
        """A step was yielded and has not committed: a rejoin now is a mid-step one."""

    # --- what the parts read -------------------------------------------------------------------------

    @property
    def ledger(self) -> DataLedger:
        """This member's replica of the lighthouse's ledger."""
        return self.planner.ledger

    @property
    def world_size(self) -> int:
        """Members (replica groups) in the current quorum."""
        return len(self.session.members)

    def want_boundary(self) -> None:
        """Ask for a new quorum at the next step boundary (the tail said so, a gather or a checkpoint failed)."""
        self._boundary = True

    def leader_lost(self, loss: LeaderLoss) -> None:
        """The leader died inside ``on_leader``: re-form at the boundary, and say so in the failures' messages."""
        self.want_boundary()
        self.leader_loss = loss

    def on_heal(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after this process loaded a peer's state or a checkpoint (before ``healed``)."""
        self._heal_listeners.append(listener)

    def on_connect(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` once each quorum is connected and healed, inside the join's attempt.

        A :class:`~stalwart.runtime.comm.CollectiveError` it raises (a mode's
        own links that could not start) is a failed attempt: the keeper asks
        for a quorum again, within the same bounded attempts.
        """
        self._connect_listeners.append(listener)

    def count_recovery(self) -> None:
        """A failure was recovered from (the quorum re-formed mid-step or mid-round)."""
        self.recoveries += 1

    def link_need(self) -> LinkNeed:
        """What each link must carry: one step's all-reduce within the configured collective timeout (not the one
        patience grew: a link that needs the growth is a straggler's, see :mod:`stalwart.runtime.probe`)."""
        return LinkNeed(max(1, self._link_bytes()), self.timeouts.collective_timeout)

    # --- entering a step --------------------------------------------------------------------------------

    def enter(self, loader: ElasticLoader | DataLoader[Any], unit: str, join: Callable[[str], None]) -> None:
        """Before a step (a round): join when not yet in a quorum or a boundary is wanted; the plan on the first.

        ``join(reason)`` is the mode's join (this keeper's :meth:`join`, plus
        what the mode connects). ``unit`` names what the ledger counts in the
        error of a late joiner with nothing to load (``steps``, ``rounds``).
        """
        if not self._boundary and self.planner.joined:
            return
        first = not self.planner.joined
        self._committed_here = None if first else self.ledger.copy()
        join("join" if first else "reconfigure")
        if first:
            self._check_plan(loader)
        if self.untrained_late_join:
            raise JobFinishedError(
                f"the job had already committed its {self.ledger.step} {unit} when {self.member} joined, "
                "and no checkpoint holds the trained state: this worker's parameters are untrained"
            )

    def _check_plan(self, loader: ElasticLoader | DataLoader[Any]) -> None:
        """The lighthouse's plan against this worker's (``plan=``) and its loader's dataset (first join)."""
        theirs = self.ledger.plan
        if self._plan is not None and self._plan != theirs:
            raise PlanMismatchError(
                f"{self.member}: the lighthouse trains on {theirs} but this worker's plan is {self._plan}: give both "
                "the same plan"
            )
        try:
            length: int | None = len(loader.dataset)  # type: ignore[arg-type]
        except TypeError:
            length = None
        self.planner.check_dataset(length)

    # --- quorums ---------------------------------------------------------------------------------------

    def join(self, reason: str) -> None:
        """Ask for a quorum until this member is in one, its group is up and it is healed (bounded attempts)."""
        session = self.session
        last_failure = "none"
        attempts = self.transport.max_join_attempts
        for attempt in range(1, attempts + 1):
            session.abort()
            answer = session.next_answer(reason, self.replica.applied_step)
            if answer is None:
                reason, last_failure = "join", "excluded from the quorum"
                continue
            session.adopt(answer)
            self.planner.adopt(answer.ledger, answer.members)
            self._grow_patience(answer.quorum_id, answer.members)
            try:
                session.connect(answer)
                if answer.heal is not None:
                    self._heal(answer)
                if self._sharded is not None:
                    assert session.grad_comm is not None  # FSDP2 groups: the processes holding this process's shard
                    self._sharded.reshard(session.grad_comm, self.replica.applied_step)
                for listener in self._connect_listeners:
                    listener()
            except CollectiveError as error:
                log.warning(
                    "%s: quorum %d could not start (%s); peers: %s; asking again (attempt %d of %d)",
                    self.member,
                    answer.quorum_id,
                    error,
                    session.peers.diagnose(error, need=self.link_need()).describe(),
                    attempt,
                    attempts,
                )
                reason = "failure" if self.planner.covered else "reconfigure"
                session.abort()
                last_failure = str(error)
                continue
            self._boundary = False
            self.leader_loss = None
            self.events.notify(Event.JOINED)
            return
        raise JoinError(
            f"{self.member}: no working quorum after {attempts} attempts "
            f"(Transport.max_join_attempts={attempts}); last failure: {last_failure}"
        )

    def _grow_patience(self, quorum_id: int, members: tuple[str, ...]) -> None:
        """The adopted quorum's collective timeout (:mod:`stalwart.runtime.patience`), logged when it changes."""
        before = self._patience.timeout
        timeout = self._patience.adopt(QuorumView(quorum_id, members))
        self.session.timeouts = dataclasses.replace(self.timeouts, collective_timeout=timeout)
        if timeout > before:
            log.warning(
                "%s: quorum %d has the members of the last one, which broke: collective timeout "
                "%g s -> %g s (x%d of %s; at most x%d)",
                self.member,
                quorum_id,
                before,
                timeout,
                self._patience.growth,
                self.timeouts.describe("collective_timeout"),
                MAX_GROWTH,
            )
        elif timeout < before:
            log.info("%s: quorum %d has new members: collective timeout back to %g s", self.member, quorum_id, timeout)

    def quiet_step(self) -> None:
        """A step committed without a failure: after enough of them, halve the collective timeout grown before."""
        if not self._patience.committed():
            return
        timeout = self._patience.timeout
        self.session.timeouts = dataclasses.replace(self.timeouts, collective_timeout=timeout)
        for comm in (self.session.comm, self.session.grad_comm):  # one object twice without FSDP2 groups
            if comm is not None:
                comm.timeout = timeout
        log.info("%s: %d quiet steps: collective timeout down to %g s", self.member, QUIET_STEPS, timeout)

    def _heal(self, answer: Any) -> None:
        """Take part in the quorum's heal: from a live member, or (a target) from the announced checkpoint."""
        with self.internal():
            outcome = self.session.heal(
                answer, self.replica, max_steps=self.max_steps, max_bytes=self.checks.max_heal_bytes
            )
        if outcome.checkpoint is not None:
            if self.checkpoints is None:
                raise JobFinishedError(
                    f"{self.member}: the job resumes from checkpoint {outcome.checkpoint.path}, but this worker has "
                    "no checkpoint directory (Manager(checkpoint=Checkpointing(...))) to load it from"
                )
            with self.internal():
                step = self.checkpoints.load(outcome.checkpoint)
            self.replica.applied_step = step
            self.session.report = (step, outcome.checkpoint.digest, self.ledger.weights_record())
            self.joined_after_end = outcome.job_finished
            if self.joined_after_end:
                log.warning(
                    "%s: joined after the job committed its %d steps: loaded the final checkpoint, nothing to train",
                    self.member,
                    step,
                )
        elif outcome.job_finished:
            self.finished = True
            self.untrained_late_join = True
        if outcome.loaded or outcome.checkpoint is not None:
            for listener in self._heal_listeners:
                listener()
            self.events.notify(Event.HEALED)
        if outcome.job_finished and self.stepping:
            self._stop_mid_step()

    def _stop_mid_step(self) -> None:
        """A mid-step rejoin found the job past its last step: stop as a late joiner does, never train on.

        The step in progress is not the ledger's any more (the ledger is
        finished), so training it would reduce samples the ledger does not
        hold. With a checkpoint directory the final checkpoint is loaded
        (``joined_after_end``); either way the loop ends with
        :class:`~stalwart.errors.JobFinishedError` (raised from the step's
        iteration, where the loop body cannot be skipped) and ``close()``
        leaves cleanly.
        """
        self.finished = True
        state = (
            "its final checkpoint is loaded (manager.joined_after_end)"
            if self.joined_after_end
            else "no checkpoint holds the trained state: this worker's parameters are not the job's"
        )
        raise JobFinishedError(
            f"the job committed its {self.ledger.step} steps while {self.member} was rejoining in the middle of a "
            f"step; {state}"
        )

    # --- commits, saving and the job's end ---------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This member's whole state: applied step, ledger and every state (``Manager.state_dict``)."""
        return {
            "applied_step": self.replica.applied_step,
            "ledger": self.ledger.state_dict(),
            "states": self.replica.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (checked), and report it with the next heartbeat."""
        if not isinstance(state, dict) or set(state) != {"applied_step", "ledger", "states"}:
            raise ValueError("state must be a Manager.state_dict() with applied_step, ledger and states")
        self.replica.load_state_dict(state["states"])
        self.planner.restore(DataLedger.from_state_dict(state["ledger"]))
        self.replica.applied_step = check_int("state['applied_step']", state["applied_step"], minimum=0)
        self.report_applied()

    def report_applied(self) -> None:
        """Tell the lighthouse (with the next heartbeat) the applied step and the ledger's digest (computed then)."""
        ledger = self.ledger
        self.session.report = CommittedReport(self.replica.applied_step, ledger.copy(), ledger.weights_record())

    def between_steps(self) -> None:
        """A checkpoint due at this step (round) boundary; one whose state could not be gathered re-forms the quorum."""
        if self.checkpoints is None:
            return
        with self.internal():
            if not self.checkpoints.between_steps(self.committed_ledger()):
                self.want_boundary()

    def finish(self) -> None:
        """The job's last step is committed: the final checkpoint, then the farewell all-reduce."""
        self.finished = True
        if self.checkpoints is not None:
            with self.internal():
                self.checkpoints.final(self.committed_ledger())
        self.session.farewell()

    def committed_ledger(self) -> DataLedger | None:
        """The ledger as committed at this step boundary, for a checkpoint: the lighthouse vouches only for committed
        ledgers, and a quorum formed at this boundary began its next step; None when this member does not hold it
        (it joined at this boundary, or was healed to it)."""
        ledger = self.ledger
        if not ledger.in_step:
            return ledger
        committed = self._committed_here
        held = committed is not None and committed.step == ledger.step and not committed.in_step
        return committed if held else None

    def wait_for_checkpoint(self) -> None:
        """Before leaving: wait (at most :data:`CLOSE_WAIT` s) for a checkpoint being written to be reported."""
        if self.checkpoints is not None and not self.checkpoints.wait(CLOSE_WAIT):
            log.warning("%s: a checkpoint was still being written after %g s; leaving anyway", self.member, CLOSE_WAIT)

"""Every-step training: each step's gradients reduce over the whole quorum, and each step commits.

A step (see docs/protocol.md)::

    quorum (only when membership changed) -> share -> micro-batches, backward
      -> gradient buckets all-reduced while the last backward runs, the last
         one with the tail (stalwart.runtime.tail)
      -> divide by the step's summed weights -> the user's update window
         (clip, GradScaler, optimizer.step(), scheduler) -> commit

When a bucket's all-reduce fails (a peer died or hung), this member keeps its
gradient accumulator (buckets reduce copies: :mod:`stalwart.runtime.reducer`),
asks the lighthouse for a new quorum, computes the positions it was given on
top of what it has done (the dead member's share, split among the survivors),
and all-reduces again in the new group, all inside the iteration of the
step's micro-batches: the user's update sees the same reduced gradient as
without the failure. Replicas that drifted are healed from the majority, and
members that asked to leave (SIGTERM, a preemption notice) leave at the
boundary after the step that carried their request.

Built from the :class:`~stalwart.runtime.keeper.QuorumKeeper` (joins, heals,
the boundary flag) and the :class:`~stalwart.runtime.engine.StepEngine`
(accumulation, update window, commit), as DiLoCo's rounds are.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Iterator
from typing import Any

from torch.utils.data import DataLoader

from stalwart.errors import StepContractError
from stalwart.runtime.accumulation import Source
from stalwart.runtime.comm import CollectiveError
from stalwart.runtime.consistency import check_loaded
from stalwart.runtime.engine import StepEngine
from stalwart.runtime.events import Event
from stalwart.runtime.keeper import QuorumKeeper
from stalwart.runtime.loader import ElasticLoader
from stalwart.runtime.preemption import Departure, departing_members
from stalwart.runtime.step import StepReport, TrainStep
from stalwart.runtime.tail import ReducedTail, TailHead, TailLayout

log = logging.getLogger(__name__)


class EveryStep:
    """The every-step sync mode: one commit per step, a failure retried inside the step's iteration."""

    def __init__(self, keeper: QuorumKeeper, engine: StepEngine, departure: Departure) -> None:
        self.keeper = keeper
        self.engine = engine
        self.departure = departure
        self.departed = False
        """True once this worker left the quorum at a step boundary on request."""
        self._reduced: ReducedTail | None = None
        self._leaving: tuple[int, ...] = ()
        """The quorum ranks whose processes leave at the boundary of the step just committed."""

    @property
    def last_round(self) -> None:
        """None: every step commits on its own (its report is the step's, ``TrainStep.report``)."""
        return None

    def request_departure(self, reason: str) -> None:
        """Leave the quorum at the boundary after the step that carries the request (see :meth:`steps`)."""
        self.departure.request(reason)

    def commits_for(self, max_steps: int) -> int:
        """The ledger's steps ``max_steps`` steps make: the same."""
        return max_steps

    def foreseen_parts(self, max_steps: int) -> Iterator[tuple[int, list[int]]]:
        """``(epoch, indices)`` of this process in each later step if the quorum holds (a DataLoader's plan)."""
        return self.keeper.planner.foreseen_parts(max_steps)

    # --- the loop --------------------------------------------------------------------------------------

    def steps(self, source: Source, loader: ElasticLoader | DataLoader[Any], max_steps: int) -> Iterator[TrainStep]:
        """Plan (join when needed), train, after (commit, departures, prefetch): until ``max_steps`` committed."""
        keeper, planner = self.keeper, self.keeper.planner
        while not self.departed:
            if self.departure.requested and not planner.joined and keeper.session.group.size == 1:
                self._depart(whole_quorum=False)  # in no quorum yet: nobody waits on this worker
                return
            keeper.enter(loader, "steps", keeper.join)
            keeper.between_steps()
            if keeper.ledger.step >= max_steps:
                keeper.finish()
                return
            planner.begin_step()
            source.take_produced()  # anything produced outside a step is not this step's
            ledger = keeper.ledger
            accumulation = self.engine.accumulation
            step = TrainStep(ledger.step, ledger.epoch, planner.ends_epoch, accumulation, self._train(source))
            keeper.stepping = True
            yield step
            self._commit(step)
            keeper.stepping = False
            if self._leaving and keeper.ledger.step < max_steps and self._boundary_departures():
                return
            if isinstance(source, ElasticLoader) and source.prefetching:
                foreseen = planner.foresee_next(max_steps)
                if foreseen is not None:
                    source.prefetch(*foreseen)

    def _train(self, source: Source) -> Generator[Any, None, StepReport]:
        """The step's micro-batches until its reduction succeeds (retried on failure); returns the report."""
        keeper, engine = self.keeper, self.engine
        while True:
            part = keeper.planner.next_part()
            engine.balance.part_started()
            yield from engine.accumulation.microbatches(
                source,
                keeper.ledger.epoch,
                part.indices,
                part.sizes,
                arm=self._arm,
                sample_batch=lambda: engine.sample_batch(source),
            )
            failure: CollectiveError | None = None
            try:
                reduced = self._reduce()
                healed = self._heal_drift(reduced)
            except CollectiveError as error:
                failure = error
            if not keeper.session.group_agrees(failure is None) and failure is None:
                failure = CollectiveError("another process of this replica group failed it")
            if failure is not None:
                self._recover(failure)
                continue
            if healed:
                continue
            return self._reduced_step(reduced)

    def _recover(self, failure: CollectiveError) -> None:
        """The step's reduction failed: log what the peers look like, join the failure quorum."""
        keeper = self.keeper
        diagnosis = keeper.session.peers.diagnose(failure, need=keeper.link_need())
        if keeper.leader_loss is not None:
            hint = f" ({keeper.leader_loss.describe()})"
        elif diagnosis.busy_hint:
            hint = (
                " (a peer that is alive but busy, e.g. evaluating, needs manager.on_leader() or a larger "
                f"{keeper.timeouts.describe('collective_timeout')})"
            )
        else:
            hint = ""
        log.warning(
            "%s: step %d all-reduce failed (%s); peers: %s; asking for a new quorum%s",
            keeper.member,
            keeper.ledger.step,
            failure,
            diagnosis.describe(),
            hint,
        )
        keeper.join(reason="failure")
        keeper.count_recovery()

    def _reduced_step(self, reduced: ReducedTail) -> StepReport:
        """Check the reduced step (sample count, audit), put the mean gradients in place, open the update window."""
        ledger = self.keeper.ledger
        positions, indices = self.keeper.planner.step_indices()
        if reduced.samples != positions.size:
            raise RuntimeError(
                f"step {ledger.step}: the quorum reduced {reduced.samples} samples, the ledger holds {positions.size}"
            )
        where = f"step {ledger.step}"
        check_loaded(reduced.loaded_checksum, ledger.epoch, indices, where, "the quorum", "the ledger's")
        self._reduced = reduced
        return self.engine.open_update(reduced, ledger.step, positions)

    def _commit(self, step: TrainStep) -> None:
        """The loop body after the step ended: the step commits (its update ran, or every member skipped it)."""
        if self._reduced is None:
            raise StepContractError(
                f"step {step.number} was not iterated to its end: iterate every step's micro-batches before the next"
            )
        reduced, self._reduced = self._reduced, None
        self.engine.close_update(reduced, f"step {step.number} committed")
        self.engine.commit(reduced)
        self._leaving = reduced.departing
        self.keeper.quiet_step()
        self.engine.reset()
        self.engine.optimizer.zero_grad(set_to_none=True)

    # --- the reduction -----------------------------------------------------------------------------------

    def _arm(self) -> None:
        """Start this round's reduction; the tail's values known before the last backward go in now."""
        keeper, engine = self.keeper, self.engine
        session = keeper.session
        comm, grad_comm = session.comm, session.grad_comm
        assert comm is not None and grad_comm is not None
        layout = self._tail_layout()
        client = session.client
        accumulation, samples = engine.accumulation, keeper.planner.samples
        head = TailHead(
            drift=engine.drift.slots(keeper.ledger.step, comm.rank, comm.world_size, keeper.replica.applied_step),
            loaded_checksum=accumulation.loaded_checksum,
            row_checksum=accumulation.row_checksum,
            samples=samples,
            reconfigure=client is not None and client.reconfigure_requested,
            departures=layout.departure_slots(comm.rank, self.departure.requested),
        )
        accumulation.arm(
            grad_comm,
            None if grad_comm is comm else comm,
            layout,
            head,
            lambda: engine.balance.slots(layout, comm.rank, keeper.planner.samples),
            hold=session.leader_pending,  # the leader still works (on_leader): launch after backward, then wait
        )

    def _reduce(self) -> ReducedTail:
        """Finish the round's reduction and wait for it (an empty part arms it here)."""
        accumulation, events = self.engine.accumulation, self.engine.events
        if not accumulation.armed:
            self._arm()
        events.notify(Event.REDUCE_STARTED)
        reduced = accumulation.reduce(self._tail_layout())
        events.notify(Event.REDUCE_FINISHED)
        return reduced

    def _tail_layout(self) -> TailLayout:
        comm = self.keeper.session.comm
        assert comm is not None
        return TailLayout(comm.world_size, self.keeper.ledger.balanced)

    def _heal_drift(self, reduced: ReducedTail) -> bool:
        """If the replicas' checksums differ, heal the odd ones out from the majority and return True.

        FSDP2 groups are healed whole, shard by shard, over the communicators
        of the processes that hold the same shard (where a group's index is its rank).
        """
        keeper, engine = self.keeper, self.engine
        session = keeper.session
        comm = session.comm
        assert comm is not None
        plan = engine.drift.plan(keeper.ledger.step, reduced.drift, comm.world_size)
        if plan is None:
            return False
        heal_comm = session.grad_comm if session.sharded else comm  # FSDP2 groups: by shard
        assert heal_comm is not None
        is_target = heal_comm.rank in plan.targets
        units, unit = engine.drift.replica_names
        log.warning(
            "%s: step %d replicas drifted: healing %s %s from %s %d%s",
            keeper.member,
            keeper.ledger.step,
            units,
            list(plan.targets),
            unit,
            plan.source,
            " (this one)" if is_target else "",
        )
        with engine.internal():
            applied = session.transfer(
                keeper.replica, plan.source, is_target=is_target, budget=keeper.checks.max_heal_bytes, comm=heal_comm
            )
        if is_target:
            keeper.replica.applied_step = applied
            engine.optimizer.zero_grad(set_to_none=True)
            engine.reset()  # recompute this process's whole part with the healed parameters
        return True

    # --- departures at a boundary ------------------------------------------------------------------------

    def _boundary_departures(self) -> bool:
        """Members leave at the boundary of the step just committed: True if this process's group is one of them.

        Every member read the same departures from the step's reduction, so
        all of them are here: one last tiny all-reduce (the farewell) makes
        sure no member still waits on a collective of a departing one, then
        the departing groups leave announced and the others form the next
        quorum without them (a boundary, not a failure).
        """
        keeper = self.keeper
        session = keeper.session
        leaving = departing_members(self._leaving, session.members, session.group_sizes)
        self._leaving = ()
        session.farewell()
        if keeper.member not in leaving:
            log.warning(
                "%s: %s leave(s) the quorum after step %d; re-forming without them",
                keeper.member,
                ", ".join(leaving),
                keeper.ledger.step - 1,
            )
            keeper.want_boundary()
            return False
        whole_quorum = len(leaving) == len(session.members)
        if whole_quorum and keeper.checkpoints is not None:  # nobody keeps the state: it goes to a checkpoint
            with self.engine.internal():
                keeper.checkpoints.final(keeper.committed_ledger())
        self._depart(whole_quorum=whole_quorum)
        return True

    def _depart(self, *, whole_quorum: bool) -> None:
        """Leave at a step boundary: after a checkpoint being written is reported, announced (``/v1/leave``).

        When the whole quorum departs, no survivor holds the job's state: it
        was checkpointed at this boundary (with a checkpoint directory), and the
        members leave unannounced (failures), so that the restarted job resumes
        from that checkpoint instead of taking the job for ended.
        """
        keeper = self.keeper
        self.departed = True
        self.departure.uninstall()  # from here SIGTERM takes its previous action
        log.warning(
            "%s: departing (%s) %s%s",
            keeper.member,
            self.departure.reason or "another process of its replica group was asked",
            f"after step {keeper.ledger.step - 1}" if keeper.planner.joined else "before its first quorum",
            "; the whole quorum departs: a restart resumes from the last checkpoint" if whole_quorum else "",
        )
        keeper.wait_for_checkpoint()
        keeper.session.close(keeper.replica.applied_step, leave=not whole_quorum)

    def close(self) -> None:
        """Nothing of its own to stop (the Manager closes the shared parts)."""

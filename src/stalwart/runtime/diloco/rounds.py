"""The Manager's steps in DiLoCo mode: rounds of inner steps, fragment exchanges and outer steps.

A round is one step of the ledger (its plan's global batch is H times the
inner global batch). Its shares are handed out when it begins and committed
when it ends, at the outer step, so the lighthouse's quorums form at outer
boundaries and the audit covers outer steps. A round::

    begin_step(members)  ->  this group's share, cut into H inner steps (schedule.py)
      inner step: micro-batches, backward, reduction within the group, the user's update
        (after regular inner step launch_f: fragment f's exchange starts on a thread; overlap steps later it applies)
      ... extra inner steps for positions a failure handed over
    round end: the exchanges left (DiLoCo: the one fragment) and the round's tail over the whole quorum,
               then the outer steps, the ledger's commit

Failures. A dead group's socket closes at once; the lighthouse pushes the
broken quorum, which each group's processes carry in their next inner
step's tail (the same decision on all of them), or an exchange fails. The
survivors then ask for a failure quorum at that inner step: the lighthouse
hands them the dead group's whole share of the round (its positions go back
to the ledger: what it trained is lost with it), which they train as extra
inner steps before the round ends; so the round commits the same samples as
without the failure, each in one committed round. A process that completed
an outer step its peers did not (the dead group failed the collective late)
has applied the round and the others are healed from it, as in the
every-step mode; for a mid-round fragment exchange, every process compares
``syncs`` after the quorum forms and those one behind take the fragment's
globals and outer state from one ahead. Joiners wait for a round's end.

The inner communicator (a group's processes) never watches the lighthouse:
another group's death must not abandon a group's own reduction, which ends
in the same inner step on all its processes. The cross-group communicator
waits up to ``DiLoCo.round_timeout`` for the slowest group (a dead one is seen
at once), so a group that is a round's compute ahead does not time out.

One of the Manager's two sync modes, built as the every-step one is from the
:class:`~stalwart.runtime.keeper.QuorumKeeper` (joins, heals, the boundary
flag, the job's end) and the :class:`~stalwart.runtime.engine.StepEngine`
(accumulation, update window, the commit of a round).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stalwart.data.info import split_group_share
from stalwart.errors import PlanMismatchError, StepContractError
from stalwart.runtime.accumulation import Source
from stalwart.runtime.comm import CollectiveError
from stalwart.runtime.consistency import (
    DRIFT_SLOTS,
    ReplicaDriftError,
    check_loaded,
    drift_plan,
    drift_slots,
    parameter_checksum,
)
from stalwart.runtime.diloco.config import DiLoCo
from stalwart.runtime.diloco.links import GroupBrokenError, GroupLinks, Traffic
from stalwart.runtime.diloco.outer import Fragment, GlobalsState, OuterState
from stalwart.runtime.diloco.schedule import at_round_end, fragment_launches, inner_plan, next_inner_positions
from stalwart.runtime.engine import StepEngine
from stalwart.runtime.events import Event
from stalwart.runtime.keeper import QuorumKeeper
from stalwart.runtime.planner import microbatch_sizes
from stalwart.runtime.sharding import local_tensor
from stalwart.runtime.step import StepReport, TrainStep
from stalwart.runtime.tail import ReducedTail, TailHead, TailLayout

log = logging.getLogger(__name__)


@dataclass
class RoundProgress:
    """What this process did of the round in progress."""

    steps: int = 0
    """Inner steps taken (regular, then extra)."""
    samples: int = 0
    """Samples this process trained (its parts of the group's inner steps)."""
    loaded_checksum: int = 0
    row_checksum: int = 0
    loss: float = 0.0
    weight: float = 0.0


class InnerProgress:
    """The group's inner steps over the job (``step.number``), part of the member's state (``sync/progress``)."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"inner_steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["inner_steps"])


class RoundLoop:
    """The DiLoCo sync mode: a Manager's steps as rounds (see the module docstring), built on the keeper and engine."""

    def __init__(
        self, keeper: QuorumKeeper, engine: StepEngine, config: DiLoCo, params: list[torch.nn.Parameter]
    ) -> None:
        self.keeper = keeper
        self.engine = engine
        self.config = config
        self.outer = OuterState(params, config, sharded=keeper.session.sharded)
        self.inner = InnerProgress()
        replica = keeper.replica
        replica.add_internal("sync/globals", GlobalsState(self.outer))
        replica.add_internal("sync/progress", self.inner)
        for fragment in self.outer.fragments:
            replica.add_internal(f"sync/outer/{fragment.index}", fragment.optimizer)
        self.launches = fragment_launches(config.inner_steps, config.fragments, config.overlap_steps)
        self.mid_round = [f for f, launch in enumerate(self.launches) if not at_round_end(launch, config.inner_steps)]
        """Fragments exchanged inside a round, in launch order (the others at its end)."""
        self.progress = RoundProgress()
        self.last_round: StepReport | None = None
        self.links = GroupLinks(keeper, engine, config, self.outer)
        self._reduced: ReducedTail | None = None
        self._inner_positions: np.ndarray | None = None
        """The group's positions of the inner step in progress (None between inner steps): not foreseen."""
        self._own_samples = 0
        self._tail: ReducedTail | None = None
        client = keeper.session.client
        if client is not None:  # the group's leader: the lighthouse shows the rounds
            client.report_rounds(self.rounds_report)
        keeper.on_heal(self.healed)
        keeper.on_connect(self._connect_links)

    # --- what the Manager reads ------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Fragment exchanges launched and not applied (0 or 1)."""
        return sum(fragment.pending is not None for fragment in self.outer.fragments)

    def rounds_report(self) -> dict[str, Any]:
        """This member's round figures for the lighthouse's heartbeat (``rounds``)."""
        return {
            "inner_steps": self.config.inner_steps,
            "fragments": self.config.fragments,
            "inner_step": self.progress.steps,
            "in_flight": self.in_flight,
            "bytes": self.links.traffic.bytes,
            "exchanges": self.links.traffic.exchanges,
        }

    @property
    def traffic(self) -> Traffic:
        """What this process sent to other groups, and how."""
        return self.links.traffic

    @property
    def departed(self) -> bool:
        """Never: a departure at a step boundary is not supported in DiLoCo's rounds yet."""
        return False

    def request_departure(self, reason: str) -> None:
        """Refused: a departure at a step boundary is not supported in DiLoCo's rounds yet."""
        raise RuntimeError("request_departure() is not supported with sync=DiLoCo(...) yet")

    def commits_for(self, max_steps: int) -> int:
        """The rounds ``max_steps`` inner steps make; a ``ValueError`` unless a multiple of ``inner_steps``."""
        rounds, rest = divmod(max_steps, self.config.inner_steps)
        if rest:
            raise ValueError(
                f"max_steps={max_steps} must be a multiple of DiLoCo.inner_steps={self.config.inner_steps}: the job "
                "ends at a round's outer step"
            )
        return rounds

    # --- the loop ------------------------------------------------------------------------------------------

    def steps(self, source: Source, loader: Any, max_rounds: int) -> Iterator[TrainStep]:
        """Yield the inner steps of every round until the ledger has committed ``max_rounds`` rounds."""
        keeper = self.keeper
        while True:
            # A checkpoint due at this round boundary (globals, outer state), before a quorum formed here hands out
            # the next round: the checkpoint's ledger must be the committed one, with no round in progress.
            if keeper.planner.joined:
                keeper.between_steps()
            keeper.enter(loader, "rounds", self.join)
            ledger = keeper.ledger
            if ledger.balanced:
                raise PlanMismatchError(
                    "DiLoCo does not balance shares by throughput yet: start the lighthouse without --balance-every"
                )
            if ledger.step >= max_rounds:
                self.outer.reset_locals_to_globals()  # the job's end: the model holds the global parameters
                keeper.finish()
                return
            keeper.planner.begin_step()
            source.take_produced()  # anything produced outside a step is not this step's
            yield from self._round(source, last=ledger.step == max_rounds - 1)
            self._commit()

    def _round(self, source: Source, *, last: bool) -> Iterator[TrainStep]:
        """The round's inner steps (regular, then extra), then its end; failures re-form the quorum in between."""
        keeper, engine = self.keeper, self.engine
        failed_ends = 0
        while True:
            positions = self._next_inner()
            if positions is not None:
                regular = self.progress.steps < self.config.inner_steps
                ledger = keeper.ledger
                ends_epoch = keeper.planner.ends_epoch and self.progress.steps == self.config.inner_steps - 1
                step = TrainStep(
                    self.inner.steps,
                    ledger.epoch,
                    ends_epoch,
                    engine.accumulation,
                    self._inner_step(source, positions),
                )
                yield step
                broken = self._close_inner(step, positions)
                if broken:
                    engine.events.notify(Event.QUORUM_BROKEN, keeper.ledger.step)
                    self._failure()
                if regular:
                    self._fragment_schedule(self.progress.steps - 1)
                continue
            try:
                self._round_end(last=last)
                return
            except CollectiveError as error:
                failed_ends += 1
                if isinstance(error, GroupBrokenError) or failed_ends > keeper.transport.max_join_attempts:
                    raise
                log.warning(
                    "%s: round %d's exchange failed (%s); asking for a new quorum",
                    keeper.member,
                    keeper.ledger.step,
                    error,
                )
                self._failure()

    def _next_inner(self) -> np.ndarray | None:
        """The group's positions of its next inner step in this round, or None when the share is trained."""
        ledger = self.keeper.ledger
        member = self.keeper.member
        share = ledger.in_flight.get(member, np.zeros(0, dtype=np.int64))
        total = int(sum(part.size for part in ledger.in_flight.values()) + ledger.step_missing.size)
        plan = inner_plan(total, ledger.began_with, member, self.config.inner_steps, ledger.plan.local_batch_multiple)
        done = self.keeper.planner.done.size
        return next_inner_positions(share, done, self.progress.steps, plan)

    # --- one inner step -----------------------------------------------------------------------------------------

    def _inner_step(self, source: Source, positions: np.ndarray) -> Generator[Any, None, StepReport]:
        """The inner step's micro-batches, the group's reduction, then the update window; returns its report."""
        keeper, engine = self.keeper, self.engine
        ledger = keeper.ledger
        group = keeper.session.group
        multiple = ledger.plan.local_batch_multiple
        mine = split_group_share(positions, group.size, group.rank, multiple)
        indices = ledger.plan.indices_at(ledger.epoch, mine).tolist()
        sharded = self.outer.sharded
        sizes = microbatch_sizes(positions, group.size, group.rank, multiple, engine.max_microbatch, sharded)
        self._own_samples = mine.size
        self._inner_positions = positions
        accumulation = engine.accumulation
        yield from accumulation.microbatches(
            source, ledger.epoch, indices, sizes, arm=self._arm, sample_batch=lambda: engine.sample_batch(source)
        )
        if not accumulation.armed:
            self._arm()
        engine.events.notify(Event.REDUCE_STARTED, self.inner.steps)
        try:
            reduced = accumulation.reduce(self._layout())
        except CollectiveError as error:
            raise GroupBrokenError(
                f"{keeper.member}: the reduction inside replica group {keeper.member!r} failed ({error}); a process "
                "of the group died or hung, and the group restarts"
            ) from error
        engine.events.notify(Event.REDUCE_FINISHED, self.inner.steps)
        if reduced.samples != positions.size:
            raise RuntimeError(
                f"round {ledger.step}: the group reduced {reduced.samples} samples in inner step {self.inner.steps}, "
                f"its share holds {positions.size}"
            )
        where = f"round {ledger.step}, inner step {self.inner.steps}"
        indices = ledger.plan.indices_at(ledger.epoch, positions)
        check_loaded(reduced.loaded_checksum, ledger.epoch, indices, where, "the group", "its")
        self.progress.loaded_checksum = (self.progress.loaded_checksum + accumulation.loaded_checksum) % (1 << 64)
        self.progress.row_checksum = (self.progress.row_checksum + accumulation.row_checksum) % (1 << 64)
        self._reduced = reduced
        return engine.open_update(reduced, self.inner.steps, positions)

    def _arm(self) -> None:
        """Start the inner step's reduction within the group; the tail carries whether the quorum is broken.

        FSDP2 groups: FSDP2 summed the gradients in the group, so the buckets go to this process alone (``solo``)
        and the tail alone to the group.
        """
        comm = self.links.inner
        assert comm is not None
        layout = self._layout()
        accumulation = self.engine.accumulation
        head = TailHead(
            drift=torch.zeros(DRIFT_SLOTS * comm.world_size),
            loaded_checksum=accumulation.loaded_checksum,
            row_checksum=accumulation.row_checksum,
            samples=self._own_samples,
            reconfigure=self.keeper.session.abandon(),
        )
        solo = self.links.solo
        grads, tail = (comm, None) if solo is None else (solo, comm)
        accumulation.arm(grads, tail, layout, head, lambda: torch.zeros(0))

    def _layout(self) -> TailLayout:
        assert self.links.inner is not None
        return TailLayout(self.links.inner.world_size, False)

    def _close_inner(self, step: TrainStep, positions: np.ndarray) -> bool:
        """The loop body after an inner step ended; True when the group saw the quorum broken (ask for a new one)."""
        keeper, engine = self.keeper, self.engine
        reduced, self._reduced = self._reduced, None
        if reduced is None:
            raise StepContractError(
                f"inner step {step.number} was not iterated to its end: iterate every step's micro-batches before "
                "the next"
            )
        engine.close_update(reduced, f"inner step {step.number}")
        keeper.planner.mark_done(positions)
        self._inner_positions = None
        self.progress.steps += 1
        self.progress.samples += self._own_samples
        self.progress.loss += reduced.loss
        self.progress.weight += reduced.weight
        self.outer.add_samples(reduced.samples)
        self.inner.steps += 1
        engine.accumulation.reset()
        engine.optimizer.zero_grad(set_to_none=True)
        return reduced.reconfigure

    # --- fragments ---------------------------------------------------------------------------------------------

    def _fragment_schedule(self, step: int) -> None:
        """After regular inner step ``step``: apply the exchange due now, launch the next one due (mid-round)."""
        overlap = self.config.overlap_steps
        for pending in self.outer.fragments:
            if pending.pending is not None and self.launches[pending.index] + overlap == step:
                self._apply_pending(pending)
        fragment = self._next_mid_round()
        if fragment is not None and self.launches[fragment.index] == step and fragment.pending is None:
            self.links.launch(fragment, merge=overlap > 0)
            if overlap == 0:
                self._apply_pending(fragment)

    def _next_mid_round(self) -> Fragment | None:
        """The next mid-round fragment to exchange in this round, by the member's ``syncs`` (None: all done)."""
        done = self.outer.syncs - self.keeper.ledger.step * len(self.mid_round)
        if not 0 <= done < len(self.mid_round):
            return None
        return self.outer.fragments[self.mid_round[done]]

    def _apply_pending(self, fragment: Fragment) -> None:
        """Wait for ``fragment``'s mid-round exchange and apply it (a failure re-forms the quorum, then again)."""
        attempts = self.keeper.transport.max_join_attempts
        for attempt in range(1, attempts + 2):
            if fragment.pending is None:
                return
            try:
                done, whole, weight = self.links.await_exchange()
            except CollectiveError as error:
                if isinstance(error, GroupBrokenError) or attempt > attempts:
                    raise
                log.warning(
                    "%s: fragment %d's exchange failed (%s); asking for a new quorum",
                    self.keeper.member,
                    fragment.index,
                    error,
                )
                self._failure()
                continue
            self.outer.apply(done, whole, weight)
            self.outer.syncs += 1
            return

    # --- the round's end -------------------------------------------------------------------------------------

    def _round_end(self, *, last: bool) -> None:
        """The round's end-of-round exchanges (the last round: every fragment) and its tail; then the outer steps.

        Nothing is applied unless everything completed: a process that
        completed has applied the round (its peers that did not are healed
        from it at the next quorum).
        """
        keeper, engine = self.keeper, self.engine
        ledger = keeper.ledger
        for fragment in self.outer.fragments:  # a mid-round exchange left after a failure: finish it first
            if fragment.pending is not None and fragment.pending.merge:
                self._apply_pending(fragment)
        ending = [
            fragment
            for fragment in self.outer.fragments
            if last or at_round_end(self.launches[fragment.index], self.config.inner_steps)
        ]
        session = keeper.session
        comm = session.comm
        assert comm is not None
        tail_layout = TailLayout(comm.world_size, False)
        s1, s2 = parameter_checksum([local_tensor(p) for fragment in self.outer.fragments for p in fragment.globals])
        head = TailHead(
            drift=drift_slots(comm.rank, comm.world_size, s1, s2, self.outer.syncs),
            loaded_checksum=self.progress.loaded_checksum,
            row_checksum=self.progress.row_checksum,
            samples=self.progress.samples,
            reconfigure=session.client is not None and session.client.reconfigure_requested,
        )
        loss = torch.tensor(self.progress.loss, dtype=torch.float32)
        weight = torch.tensor(self.progress.weight, dtype=torch.float32)
        tail = tail_layout.encode(torch.zeros(0), head, weight, loss).to(engine.device)
        results: list[tuple[Fragment, torch.Tensor, float]] = []
        engine.events.notify(Event.OUTER_STARTED, ledger.step)
        wait_tail = comm.start_all_reduce_sum(tail)
        for fragment in ending:
            if fragment.pending is not None:  # launched before a failure: the extra inner steps since go in too
                self.outer.withdraw(fragment)
            self.links.launch(fragment, merge=False)
            results.append(self.links.await_exchange())
        wait_tail()
        reduced = tail_layout.decode(tail)
        positions, indices = keeper.planner.step_indices()
        if reduced.samples != positions.size:
            raise RuntimeError(
                f"round {ledger.step}: the quorum trained {reduced.samples} samples, the ledger's round holds "
                f"{positions.size}"
            )
        where = f"round {ledger.step}"
        check_loaded(reduced.loaded_checksum, ledger.epoch, indices, where, "the quorum", "the ledger's")
        group_size = keeper.session.group.size if self.outer.sharded else 1  # a group's processes: one shard each
        drifted = drift_plan(reduced.drift, comm.world_size, group_size)
        if drifted is not None:
            raise ReplicaDriftError(
                f"round {ledger.step}: the global parameters of {'groups' if group_size > 1 else 'processes'} "
                f"{list(drifted.targets)} differ from {drifted.source}'s: every group must hold the same global "
                "parameters bit for bit"
            )
        for fragment, whole, total in results:
            self.outer.apply(fragment, whole, total)
        members = len(keeper.session.members)
        tail_bytes = round(2 * (comm.world_size - 1) / comm.world_size * 4 * tail.numel()) if members > 1 else 0
        self.links.traffic.record_tail(ledger.step, tail_bytes, alone=not ending)
        self._tail = reduced
        self.last_round = StepReport(
            step=ledger.step,
            epoch=ledger.epoch,
            samples=reduced.samples,
            loss=reduced.mean_loss,
            world_size=keeper.world_size,
            quorum_id=keeper.session.quorum_id,
            recoveries=keeper.recoveries,
            positions=positions,
            loaded_checksum=reduced.loaded_checksum,
        )

    def _commit(self) -> None:
        """The round's outer step is applied: commit the ledger's round, report it."""
        reduced, self._tail = self._tail, None
        assert reduced is not None
        self.engine.commit(reduced)
        self.progress = RoundProgress()
        self.engine.reset()

    # --- quorums ----------------------------------------------------------------------------------------------

    def _failure(self) -> None:
        """A group died: ask for a failure quorum mid-round (or a boundary one when nothing of the round is done)."""
        self.keeper.count_recovery()
        self.join("failure" if self.keeper.planner.covered else "reconfigure")

    def join(self, reason: str) -> None:
        """Get into the next quorum: the exchange in flight is dropped first (its quorum is gone)."""
        self.links.drop()
        self.keeper.join(reason)

    def _connect_links(self) -> None:
        """Each quorum the keeper joins (inside its attempt: a failure here asks again): this mode's links."""
        self.links.drop()  # a failed attempt's
        self.links.connect()
        self.links.reconcile(self.mid_round)
        self.links.relaunch()

    def healed(self) -> None:
        """This process loaded a peer's state: its model becomes the globals, its round starts over."""
        self.links.drop()
        self.outer.reset_locals_to_globals()
        self.progress = RoundProgress()

    # --- foresight --------------------------------------------------------------------------------------------

    def foreseen_parts(self, max_rounds: int) -> Iterator[tuple[int, list[int]]]:
        """``(epoch, indices)`` of this process in each later inner step if the quorum holds (a DataLoader's plan).

        Later: after the inner step in progress (the feed asks while loading
        it), whose positions are not marked done yet.
        """
        keeper = self.keeper
        preview = copy.deepcopy(keeper.ledger)
        members = list(keeper.planner.members)
        group = keeper.session.group
        member = keeper.member
        done, steps = keeper.planner.done.size, self.progress.steps
        if self._inner_positions is not None:
            done, steps = done + self._inner_positions.size, steps + 1

        def parts() -> Iterator[tuple[int, list[int]]]:
            nonlocal done, steps
            while True:
                if not preview.in_step:
                    if preview.step >= max_rounds:
                        return
                    preview.begin_step(members)
                share = preview.in_flight.get(member, np.zeros(0, dtype=np.int64))
                total = int(sum(part.size for part in preview.in_flight.values()) + preview.step_missing.size)
                plan = inner_plan(
                    total, preview.began_with, member, self.config.inner_steps, preview.plan.local_batch_multiple
                )
                positions = next_inner_positions(share, done, steps, plan)
                if positions is None:
                    preview.commit()
                    done = steps = 0
                    continue
                done, steps = done + positions.size, steps + 1
                mine = split_group_share(positions, group.size, group.rank, preview.plan.local_batch_multiple)
                yield preview.epoch, preview.plan.indices_at(preview.epoch, mine).tolist()

        return parts()

    def close(self) -> None:
        """Stop the exchange thread (the Manager is closed)."""
        self.links.close()

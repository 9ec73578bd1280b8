"""The step engine: what a step does between its reduction and its commit, shared by both sync modes.

A step (an inner step under DiLoCo) accumulates its micro-batches
(:mod:`stalwart.runtime.accumulation`), opens the user's update window on the
reduced mean gradient (:mod:`stalwart.runtime.update`; with sharded state the
ZeRO update and the parameter gather run there), closes it, and commits:
the ledger's step, the audit record, the row digest, the applied step and
the report to the lighthouse. Every-step training commits each step here;
DiLoCo commits each round here, so a side effect added to a commit lands in
both modes. The engine never asks the lighthouse for anything: a commit
whose tail asked for a new quorum tells the :class:`~stalwart.runtime.keeper.QuorumKeeper`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader

from stalwart.data.audit import StepAuditWriter
from stalwart.runtime.accumulation import Source, StepAccumulation
from stalwart.runtime.comm import CollectiveError
from stalwart.runtime.drift import DriftCheck
from stalwart.runtime.events import EventHook
from stalwart.runtime.keeper import QuorumKeeper
from stalwart.runtime.loader import ElasticLoader
from stalwart.runtime.rebalance import BalanceWindow
from stalwart.runtime.step import StepReport, TrainStep
from stalwart.runtime.tail import ReducedTail
from stalwart.runtime.update import UpdateWindow
from stalwart.runtime.zero import ShardedOptimizer
from stalwart.runtime.zero.whole import WholeStateDict

log = logging.getLogger(__name__)


class StepEngine:
    """Accumulation, the update window, drift and balance bookkeeping, the commit, and the events of a step."""

    def __init__(
        self,
        keeper: QuorumKeeper,
        optimizer: torch.optim.Optimizer,
        accumulation: StepAccumulation,
        *,
        drift: DriftCheck,
        sharded: ShardedOptimizer | None,
        whole: WholeStateDict | None,
        step_audit: StepAuditWriter | None,
        events: EventHook,
        max_microbatch: int,
        device: torch.device,
    ) -> None:
        self.keeper = keeper
        self.optimizer = optimizer
        self.accumulation = accumulation
        self.drift = drift
        self.balance = BalanceWindow()
        self.events = events
        self.max_microbatch = max_microbatch
        self.device = device
        self.last_report: StepReport | None = None
        self._sharded = sharded
        self._whole = whole
        self._step_audit = step_audit
        self._window = UpdateWindow(optimizer, sharded=sharded, notify=events.notify, sync=self._sync_shards)
        self._warned_no_update = False
        keeper.on_heal(self._healed)

    @contextlib.contextmanager
    def internal(self) -> Iterator[None]:
        """The Manager's own use of the optimizer (heal, checkpoints): torch's calls, unguarded and not gathered."""
        with self._window.passthrough(), self._whole.internal() if self._whole else contextlib.nullcontext():
            yield

    def reset(self) -> None:
        """Forget the step's progress (a heal, a commit): it is computed again from its first part."""
        self.keeper.planner.reset_step()
        self.accumulation.reset()
        self.balance.reset_step()

    def _healed(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.reset()

    def sample_batch(self, source: Source) -> Any:
        """A one-sample batch (any sample of the epoch), for the shape of a zero-sample batch; not audited."""
        if not isinstance(source, ElasticLoader):
            raise RuntimeError(
                "an FSDP2 group's process got no samples before its first step with a DataLoader: use an "
                "ElasticLoader, or a plan whose steps give every process samples"
            )
        ledger = self.keeper.ledger
        index = int(ledger.plan.indices_at(ledger.epoch, np.zeros(1, dtype=np.int64))[0])
        return source.collate_fn([source.load(ledger.epoch, index)])

    # --- the update window -------------------------------------------------------------------------------

    def open_update(self, reduced: ReducedTail, number: int, positions: np.ndarray) -> StepReport:
        """Put the reduced mean gradient in place, open the update window of step ``number``; its report.

        ``positions`` are the step's (an inner step's) samples in the ledger's
        order, for the report.
        """
        if reduced.samples:
            if not reduced.weight > 0 or not math.isfinite(reduced.weight):
                raise ValueError(
                    f"step {number}: the micro-batches' weights sum to {reduced.weight} over {reduced.samples} "
                    "samples: step.backward(loss, weight=...) takes counts >= 0 that are not all 0"
                )
            self.accumulation.apply(reduced.weight)
        else:
            self.optimizer.zero_grad(set_to_none=True)
        self._window.open(number)
        keeper = self.keeper
        self.last_report = StepReport(
            step=number,
            epoch=keeper.ledger.epoch,
            samples=reduced.samples,
            loss=reduced.mean_loss,
            world_size=keeper.world_size,
            quorum_id=keeper.session.quorum_id,
            recoveries=keeper.recoveries,
            positions=positions,
            drift_heals=self.drift.heals,
            loaded_checksum=reduced.loaded_checksum,
        )
        return self.last_report

    def close_update(self, reduced: ReducedTail, what: str) -> None:
        """The loop body ended: close the update window (warned once when a step with samples had no update)."""
        if not self._window.close() and reduced.samples and not self._warned_no_update:
            self._warned_no_update = True
            log.warning("%s: %s without optimizer.step() (a GradScaler skip?)", self.keeper.member, what)

    def _sync_shards(self) -> None:
        """After the sharded update: gather the parameters, re-encode parity; a failure re-forms the quorum.

        The step commits anyway: every survivor holds its updated shards (and,
        for parity, its shard as before the update), so the next quorum's
        reshard finishes the update without training anything again.
        """
        keeper = self.keeper
        zero, grad_comm = self._sharded, keeper.session.grad_comm
        assert zero is not None and grad_comm is not None
        step = keeper.ledger.step
        failed = False
        try:
            zero.sync(grad_comm, lambda event: self.events.notify(event, step), check=step % self.drift.every == 0)
        except CollectiveError as error:
            log.warning(
                "%s: step %d's parameter gather failed (%s); asking for a new quorum", keeper.member, step, error
            )
            failed = True
        # A replica group's processes must all ask for the next quorum, or none (the gather can end differently
        # on them): they vote in the group's store, as after each reduction. Other groups find out at their next
        # collective.
        if not keeper.session.group_agrees(not failed):
            keeper.want_boundary()

    # --- the commit ------------------------------------------------------------------------------------

    def commit(self, reduced: ReducedTail) -> None:
        """The ledger's step (a DiLoCo round) commits: audit, row digest, applied step, balance, report.

        ``reduced`` is the tail reduced over the whole quorum (a round's tail
        under DiLoCo); when it says a member wants a new quorum, the keeper
        is asked for a boundary.
        """
        keeper = self.keeper
        replica = keeper.replica
        ledger = keeper.ledger
        epoch, ends_epoch, number = ledger.epoch, keeper.planner.ends_epoch, ledger.step
        positions = ledger.commit()
        if self._step_audit is not None:  # Checks(audit_dir=...): the group's leading process records the samples
            self._step_audit.write(ledger.plan, epoch, number, positions)
        replica.row_digest.add(epoch, reduced.row_checksum)
        if ends_epoch and not ledger.plan.drop_last:  # every row once: each epoch must sum the same
            replica.row_digest.close_epoch(epoch)
        replica.applied_step += 1
        replica.trained_step = replica.applied_step
        self.drift.step_committed()
        if ledger.balanced:
            session = keeper.session
            self.balance.after_commit(
                ledger, reduced.balance, session.members, session.group_sizes, keeper.planner.samples, keeper.member
            )
        keeper.report_applied()
        if reduced.reconfigure:
            keeper.want_boundary()

    def close(self) -> None:
        """Stop the reducer's thread, close the audit, remove the update window's hooks."""
        self.accumulation.close()
        if self._step_audit is not None:
            self._step_audit.close()
        self._window.remove()  # the whole-state hooks stay: after close, state_dict() says it is too late


class SyncMode(Protocol):
    """How the steps a Manager yields sync: every step (``EveryStep``) or in DiLoCo's rounds (``RoundLoop``).

    Both are built from the Manager's :class:`~stalwart.runtime.keeper.QuorumKeeper`
    and :class:`StepEngine`, never from the Manager.
    """

    @property
    def departed(self) -> bool:
        """Whether this worker left the quorum at a step boundary on request."""
        ...

    @property
    def last_round(self) -> StepReport | None:
        """What the last committed round did (DiLoCo); None in a mode whose commits are its steps."""
        ...

    def request_departure(self, reason: str) -> None:
        """Leave the quorum at the next step boundary (``Manager.request_departure``); a ``RuntimeError`` in a mode
        that cannot."""
        ...

    def commits_for(self, max_steps: int) -> int:
        """The ledger steps (rounds) that ``max_steps`` yielded steps make; a ``ValueError`` when none fits."""
        ...

    def steps(self, source: Source, loader: ElasticLoader | DataLoader[Any], max_steps: int) -> Iterator[TrainStep]:
        """Yield the steps until the ledger has committed ``max_steps`` (from :meth:`commits_for`)."""
        ...

    def foreseen_parts(self, max_steps: int) -> Iterator[tuple[int, list[int]]]:
        """``(epoch, indices)`` of this process in each later step if the quorum holds (a DataLoader's plan)."""
        ...

    def close(self) -> None:
        """Stop what the mode runs of its own (the Manager is closed)."""
        ...

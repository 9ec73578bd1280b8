"""The Manager: one per worker process, running failure-transparent steps.

A step (see docs/protocol.md)::

    quorum (only when membership changed) -> share -> micro-batches, backward
      -> all-reduce [gradient sums, sample count, loss sum, reconfigure flag]
      -> divide by the step's sample count -> optimizer.step() -> commit

When the all-reduce fails (a peer died or hung), this member keeps its
gradient accumulator, asks the lighthouse for a new quorum, computes the
positions it was given on top of what it has done (the dead member's share,
split among the survivors), and all-reduces again in the new group: the
committed step is the same step as without the failure. A member that is
behind (it joined, restarted, or missed the end of a step) is healed from a
live peer before it takes part.

Training code stays a plain loop::

    for step in manager.steps(loader, max_steps=1000):
        for inputs, targets in step:
            step.backward(loss_fn(model(inputs), targets))  # loss_fn(reduction="sum")
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from stalwart._validate import check_int
from stalwart.coord.client import LighthouseClient, LighthouseError, QuorumAnswer
from stalwart.data.ledger import DataLedger
from stalwart.runtime.comm import CollectiveError, Communicator, default_device
from stalwart.runtime.heal import transfer_state
from stalwart.runtime.loader import ElasticLoader

log = logging.getLogger(__name__)
_NO_POSITIONS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class StepReport:
    """What one committed step did, for progress displays and reports."""

    step: int
    epoch: int
    samples: int
    loss: float
    world_size: int
    quorum_id: int
    recoveries: int
    positions: np.ndarray


class Manager:
    """Keeps one worker in the quorum and runs its steps; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        lighthouse: str,
        member: str,
        max_microbatch: int,
        token: str | None = None,
        collective_timeout: float = 2.0,
        quorum_timeout: float = 120.0,
        heartbeat_interval: float = 0.1,
        host: str = "127.0.0.1",
        device: torch.device | None = None,
        on_event: Callable[[str, int], None] | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(member, str) or not member:
            raise ValueError(f"member must be a non-empty string, got {member!r}")
        for name, value in (("collective_timeout", collective_timeout), ("quorum_timeout", quorum_timeout)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
        self.model = model
        self.optimizer = optimizer
        self.member = member
        self.max_microbatch = check_int("max_microbatch", max_microbatch, minimum=1)
        self.collective_timeout = collective_timeout
        self.quorum_timeout = quorum_timeout
        self.host = host
        self.device = device or default_device()
        self.applied_step = 0
        self.recoveries = 0
        self._params = [param for param in model.parameters() if param.requires_grad]
        self._client = LighthouseClient(lighthouse, member, token=token, heartbeat_interval=heartbeat_interval)
        self._client.start_heartbeat(lambda: self.applied_step)
        self._comm: Communicator | None = None
        self._answer: QuorumAnswer | None = None
        self._ledger: DataLedger | None = None
        self._done = _NO_POSITIONS
        self._loss_sum = 0.0
        self._reconfigure = True
        self.last_report: StepReport | None = None
        self._on_event = on_event

    @property
    def ledger(self) -> DataLedger:
        """This member's replica of the lighthouse's ledger."""
        if self._ledger is None:
            raise RuntimeError("the Manager has not joined a quorum yet; iterate manager.steps() first")
        return self._ledger

    @property
    def quorum_id(self) -> int:
        """The id of the quorum this member runs steps in (-1 before the first)."""
        return -1 if self._answer is None else self._answer.quorum_id

    @property
    def world_size(self) -> int:
        """How many members the current quorum has."""
        return 0 if self._answer is None else len(self._answer.members)

    def steps(self, loader: ElasticLoader, *, max_steps: int) -> Iterator[TrainStep]:
        """Yield one :class:`TrainStep` per step until the job has committed ``max_steps`` steps."""
        max_steps = check_int("max_steps", max_steps, minimum=0)
        while True:
            if self._reconfigure or self._ledger is None:
                self._join(reason="join" if self._ledger is None else "reconfigure")
            if self.ledger.step >= max_steps:
                return
            if not self.ledger.in_step:
                self.ledger.begin_step(self._answer_members())
            step = TrainStep(self, loader)
            yield step
            if not step.committed:
                raise RuntimeError("a TrainStep must be iterated to its end before the next step starts")
            self._prefetch_next(loader)

    def close(self) -> None:
        """Leave the quorum cleanly and stop the heartbeat."""
        if self._comm is not None:
            self._comm.abort()
        self._client.leave()
        self._client.close()

    def _answer_members(self) -> list[str]:
        assert self._answer is not None
        return list(self._answer.members)

    def _work(self) -> np.ndarray:
        """Positions this member holds in the step and has not accumulated yet."""
        mine = self.ledger.in_flight.get(self.member, _NO_POSITIONS)
        return mine[~np.isin(mine, self._done)]

    def _microbatches(self, loader: ElasticLoader) -> Iterator[object]:
        while True:
            work = self._work()
            if work.size:
                indices = self.ledger.plan.indices_at(self.ledger.epoch, work)
                yield from loader.microbatches(self.ledger.epoch, indices.tolist(), self.max_microbatch)
                self._done = np.concatenate([self._done, work])
            try:
                reduced = self._all_reduce()
            except CollectiveError as error:
                log.warning(
                    "%s: step %d all-reduce failed (%s); asking for a new quorum", self.member, self.ledger.step, error
                )
                self._join(reason="failure")
                self.recoveries += 1
                continue
            self._apply(reduced)
            return

    def _all_reduce(self) -> torch.Tensor:
        assert self._comm is not None
        pieces = [
            param.grad.reshape(-1) if param.grad is not None else torch.zeros(param.numel(), device=self.device)
            for param in self._params
        ]
        flag = 1.0 if self._client.reconfigure_requested else 0.0
        tail = torch.tensor([float(self._done.size), self._loss_sum, flag], device=self.device)
        flat = torch.cat([*(piece.to(torch.float32) for piece in pieces), tail])
        wait = self._comm.start_all_reduce_sum(flat)
        self._notify("reduce_started")
        wait()
        self._notify("reduce_finished")
        return flat

    def _apply(self, reduced: torch.Tensor) -> None:
        samples = round(float(reduced[-3]))
        expected = sum(positions.size for positions in self.ledger.in_flight.values())
        if samples != expected:
            raise RuntimeError(
                f"step {self.ledger.step}: the quorum reduced {samples} samples, the ledger holds {expected}"
            )
        offset = 0
        for param in self._params:
            count = param.numel()
            if samples:
                param.grad = (reduced[offset : offset + count] / samples).view_as(param).to(param.dtype)
            offset += count
        if samples:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        step, epoch = self.ledger.step, self.ledger.epoch
        committed = self.ledger.commit()
        self.last_report = StepReport(
            step=step,
            epoch=epoch,
            samples=samples,
            loss=float(reduced[-2]) / max(samples, 1),
            world_size=self.world_size,
            quorum_id=self.quorum_id,
            recoveries=self.recoveries,
            positions=committed,
        )
        self.applied_step += 1
        self._done = _NO_POSITIONS
        self._loss_sum = 0.0
        self._reconfigure = float(reduced[-1]) > 0

    def _notify(self, event: str) -> None:
        """Tell the ``on_event`` hook (tracing, chaos tests) that ``event`` happened in the current step."""
        if self._on_event is not None:
            self._on_event(event, self.ledger.step)

    def _join(self, reason: str) -> None:
        """Ask for a quorum until this member is in one, its group is up and it is healed."""
        while True:
            if self._comm is not None:
                self._comm.abort()
                self._comm = None
            try:
                answer = self._client.quorum(
                    applied_step=self.applied_step,
                    quorum_id=self.quorum_id if self._answer else None,
                    reason=reason,
                    timeout=self.quorum_timeout,
                )
            except LighthouseError as error:
                if error.status != 409:
                    raise
                log.warning("%s: excluded from the quorum (%s); joining again", self.member, error)
                reason = "join"
                continue
            self._answer = answer
            self._ledger = DataLedger.from_state_dict(answer.ledger)
            try:
                comm = Communicator(
                    answer.store.host,
                    answer.store.port,
                    answer.store.prefix,
                    answer.rank,
                    answer.world_size,
                    timeout=self.collective_timeout,
                    device=self.device,
                    host=self.host,
                    abandon=lambda: self._client.quorum_broken,
                )
                if answer.heal is not None:
                    if answer.heal.source_rank is None:
                        raise RuntimeError(
                            f"no live member holds step {answer.applied_step}: the state is lost; "
                            "restart the job from its last checkpoint"
                        )
                    is_target = self.member in answer.heal.targets
                    self.applied_step = transfer_state(
                        comm,
                        answer.heal.source_rank,
                        self.model,
                        self.optimizer,
                        self.applied_step,
                        is_target=is_target,
                    )
                    if is_target:
                        self.optimizer.zero_grad(set_to_none=True)
                        self._done = _NO_POSITIONS
                        self._loss_sum = 0.0
            except CollectiveError as error:
                log.warning("%s: quorum %d could not start (%s); asking again", self.member, answer.quorum_id, error)
                reason = "failure" if self._done.size else "reconfigure"
                continue
            self._comm = comm
            self._reconfigure = False
            return

    def _prefetch_next(self, loader: ElasticLoader) -> None:
        preview = copy.deepcopy(self.ledger)
        share = preview.begin_step(self._answer_members()).get(self.member, _NO_POSITIONS)
        loader.prefetch(preview.epoch, preview.plan.indices_at(preview.epoch, share).tolist())


class TrainStep:
    """One step's micro-batches; iterating past the last one reduces, retries on failure, and commits."""

    def __init__(self, manager: Manager, loader: ElasticLoader) -> None:
        self._manager = manager
        self._loader = loader
        self.committed = False

    def __iter__(self) -> Iterator[object]:
        yield from self._manager._microbatches(self._loader)
        self.committed = True

    def backward(self, loss_sum: torch.Tensor) -> None:
        """Back-propagate a micro-batch's summed loss and count it towards the step's mean loss."""
        loss_sum.backward()
        self._manager._loss_sum += float(loss_sum.detach())

    @property
    def report(self) -> StepReport:
        """What the committed step did."""
        if not self.committed:
            raise RuntimeError("the step is not committed yet: iterate it to its end first")
        assert self._manager.last_report is not None
        return self._manager.last_report

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
import dataclasses
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from stalwart._validate import check_int
from stalwart.coord.client import LighthouseClient, LighthouseError, QuorumAnswer
from stalwart.coord.hosted_ledger import ledger_digest
from stalwart.data.info import DataLoadingInfo, split_group_share
from stalwart.data.ledger import DataLedger
from stalwart.data.world import WorldInfo
from stalwart.runtime.comm import CollectiveError, Communicator, default_device, quorum_store
from stalwart.runtime.group import GroupLink
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
    """Keeps one worker (or one replica group's worker) in the quorum and runs its steps.

    ``member`` names the lighthouse member: the worker, or its replica group
    when ``group`` says this process is one of several in a group launched
    together (see :mod:`stalwart.runtime.group`); the group's share is then
    split among its processes by intra-group rank. ``on_event(event, step)`` is
    called at ``"reduce_started"`` (the all-reduce is in flight) and
    ``"reduce_finished"`` (reduced, not yet applied), for tracing and for
    tests that kill a worker at those points.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        lighthouse: str,
        member: str,
        max_microbatch: int,
        token: str | None = None,
        group: WorldInfo | None = None,
        group_store: dist.Store | None = None,
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
        self.last_report: StepReport | None = None
        self._group = GroupLink(group or WorldInfo(rank=0, world_size=1), group_store, timeout=quorum_timeout)
        self._params = [param for param in model.parameters() if param.requires_grad]
        self._client: LighthouseClient | None = None
        self._report: tuple[int, str | None] = (0, None)
        """``(applied_step, ledger digest)`` for the heartbeat: the lighthouse commits only on a matching digest."""
        if self._group.is_leader:
            self._client = LighthouseClient(lighthouse, member, token=token, heartbeat_interval=heartbeat_interval)
            self._client.start_heartbeat(lambda: self._report)
        self._comm: Communicator | None = None
        self._answer: QuorumAnswer | None = None
        self._ledger: DataLedger | None = None
        self._group_sizes: list[int] = []
        self._foreseen: tuple[int, np.ndarray, list[int]] | None = None
        self._group_done = _NO_POSITIONS
        self._samples = 0
        self._loss_sum = 0.0
        self._reconfigure = True
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
        """How many members (replica groups) the current quorum has."""
        return 0 if self._answer is None else len(self._answer.members)

    def get_data_loading_info(self) -> DataLoadingInfo:
        """Where this process's samples of the current step come from (the proposal's ``DataLoadingInfo``).

        Valid inside a step (between ``manager.steps()`` yielding it and its
        commit); ``indices`` are this process's part of its group's share.
        """
        if self._answer is None or not self.ledger.in_step:
            raise RuntimeError("get_data_loading_info() needs a step in progress: call it inside manager.steps()")
        ledger = self.ledger
        return DataLoadingInfo.for_worker(
            ledger.plan,
            epoch=ledger.epoch,
            step=ledger.epoch_step,
            base_index=ledger.base_index,
            missing_indices=ledger.missing_indices,
            group_sizes=dict(zip(self._answer.members, self._group_sizes, strict=True)),
            member=self.member,
            group_share=ledger.in_flight.get(self.member, _NO_POSITIONS),
            intra_group_rank=self._group.rank,
        )

    def steps(self, loader: ElasticLoader, *, max_steps: int) -> Iterator[TrainStep]:
        """Yield one :class:`TrainStep` per step until the job has committed ``max_steps`` steps."""
        max_steps = check_int("max_steps", max_steps, minimum=0)
        while True:
            if self._reconfigure or self._ledger is None:
                self._join(reason="join" if self._ledger is None else "reconfigure")
            if self.ledger.step >= max_steps:
                self._farewell()
                return
            if not self.ledger.in_step:
                self.ledger.begin_step(self._answer_members())
            step = TrainStep(self, loader)
            yield step
            if not step.committed:
                raise RuntimeError("a TrainStep must be iterated to its end before the next step starts")
            self._prefetch_next(loader)

    def _farewell(self) -> None:
        """One last tiny all-reduce, so that no member leaves while another still waits on the final step's.

        Without it a member that finished the last all-reduce first could leave,
        and the lighthouse's broken-quorum push would make a slower member give
        up a collective that was about to complete. A failure here is harmless:
        the last step is already applied.
        """
        if self._comm is None:
            return
        try:
            self._comm.start_all_reduce_sum(torch.zeros(1, device=self.device))()
        except CollectiveError as error:
            log.info("%s: farewell all-reduce ended early (%s); the last step is applied", self.member, error)

    def close(self) -> None:
        """Leave the quorum cleanly and stop the heartbeat."""
        if self._comm is not None:
            self._comm.abort()
        if self._client is not None:
            self._client.leave(self.applied_step)
            self._client.close()

    def _answer_members(self) -> list[str]:
        assert self._answer is not None
        return list(self._answer.members)

    def _next_part(self) -> np.ndarray:
        """This process's part of the group's positions not yet covered in this step (marked covered)."""
        group_share = self.ledger.in_flight.get(self.member, _NO_POSITIONS)
        fresh = group_share[~np.isin(group_share, self._group_done)]
        self._group_done = np.concatenate([self._group_done, fresh])
        part = split_group_share(fresh, self._group.size, self._group.rank, self.ledger.plan.local_batch_multiple)
        self._samples += part.size
        return part

    def _microbatches(self, loader: ElasticLoader) -> Iterator[object]:
        while True:
            part = self._next_part()
            if part.size:
                yield from loader.microbatches(self.ledger.epoch, self._indices(part), self.max_microbatch)
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
        flag = 1.0 if self._client is not None and self._client.reconfigure_requested else 0.0
        tail = torch.tensor([float(self._samples), self._loss_sum, flag], device=self.device)
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
        self._report = (self.applied_step, ledger_digest(self.ledger.state_dict()))
        self._reset_step()
        self._reconfigure = float(reduced[-1]) > 0

    def _reset_step(self) -> None:
        self._group_done = _NO_POSITIONS
        self._samples = 0
        self._loss_sum = 0.0

    def _notify(self, event: str) -> None:
        """Tell the ``on_event`` hook (tracing, chaos tests) that ``event`` happened in the current step."""
        if self._on_event is not None:
            self._on_event(event, self.ledger.step)

    def _abandon(self) -> bool:
        """Whether the current quorum is known broken (polled while a collective runs)."""
        if self._client is None:
            return self._group.broken(self.quorum_id)
        if self._client.quorum_broken:
            self._group.mark_broken(self.quorum_id)
            return True
        return False

    def _next_answer(self, reason: str) -> QuorumAnswer:
        """The next quorum this member is in: asked by the leader, relayed to the rest of the group."""
        if self._client is None:
            return QuorumAnswer.from_json(self._group.receive())
        while True:
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
            self._group.publish(dataclasses.asdict(answer))
            return answer

    def _join(self, reason: str) -> None:
        """Ask for a quorum until this member is in one, its group is up and it is healed."""
        while True:
            if self._comm is not None:
                self._comm.abort()
                self._comm = None
            answer = self._next_answer(reason)
            self._answer = answer
            self._ledger = DataLedger.from_state_dict(answer.ledger)
            try:
                self._comm = self._connect(answer)
                if answer.heal is not None:
                    self._heal(answer)
            except CollectiveError as error:
                log.warning("%s: quorum %d could not start (%s); asking again", self.member, answer.quorum_id, error)
                reason = "failure" if self._group_done.size else "reconfigure"
                self._comm = None
                continue
            self._reconfigure = False
            return

    def _connect(self, answer: QuorumAnswer) -> Communicator:
        """Build the quorum's process group over every process of every member group."""
        store = quorum_store(answer.store.host, answer.store.port, answer.store.prefix, self.collective_timeout)
        if self._group.is_leader:
            store.set(f"group_size/{self.member}", str(self._group.size))
        self._group_sizes = [int(store.get(f"group_size/{member}")) for member in answer.members]
        offset = sum(self._group_sizes[: answer.rank])
        return Communicator(
            store,
            offset + self._group.rank,
            sum(self._group_sizes),
            timeout=self.collective_timeout,
            device=self.device,
            host=self.host,
            abandon=self._abandon,
        )

    def _heal(self, answer: QuorumAnswer) -> None:
        """Take part in the broadcast of the source's state; load it if this member is behind."""
        assert answer.heal is not None and self._comm is not None
        if answer.heal.source_rank is None:
            raise RuntimeError(
                f"no live member holds step {answer.applied_step}: the state is lost; "
                "restart the job from its last checkpoint"
            )
        is_target = self.member in answer.heal.targets
        source = sum(self._group_sizes[: answer.heal.source_rank])
        self.applied_step = transfer_state(
            self._comm, source, self.model, self.optimizer, self.applied_step, is_target=is_target
        )
        self._report = (self.applied_step, None)
        if is_target:
            self.optimizer.zero_grad(set_to_none=True)
            self._reset_step()

    def _indices(self, part: np.ndarray) -> list[int]:
        """Sample indices of ``part``: the prefetched ones when the share is the one foreseen (the usual case)."""
        foreseen = self._foreseen
        if foreseen is not None and foreseen[0] == self.ledger.epoch and np.array_equal(foreseen[1], part):
            return foreseen[2]
        return self.ledger.plan.indices_at(self.ledger.epoch, part).tolist()

    def _prefetch_next(self, loader: ElasticLoader) -> None:
        """Foresee the next step's share assuming the quorum holds, and start loading it."""
        preview = copy.deepcopy(self.ledger)
        group_share = preview.begin_step(self._answer_members()).get(self.member, _NO_POSITIONS)
        part = split_group_share(group_share, self._group.size, self._group.rank, preview.plan.local_batch_multiple)
        indices = preview.plan.indices_at(preview.epoch, part).tolist()
        self._foreseen = (preview.epoch, part, indices)
        loader.prefetch(preview.epoch, indices)


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

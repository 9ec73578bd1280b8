"""Worker processes of the runtime benchmark: one training loop per variant, same model, data and update.

Run by :mod:`benchmarks.runtime` as ``python -m benchmarks._runtime_workers LOOP ...``:

- ``ddp``: torch's ``DistributedDataParallel`` (bucketed, default bucket
  sizes, gradients reduced while the backward runs), ``no_sync()`` for all
  but the last micro-batch of a step. The baseline.
- ``plain``: ``torch.distributed``, no fault tolerance. Each rank takes its
  split of the plan's step, accumulates micro-batch gradients, all-reduces
  one flat buffer ``[gradient sums..., sample count]`` and steps.
- ``stalwart``: the same loop under :class:`stalwart.runtime.manager.Manager`
  and :class:`~stalwart.runtime.loader.ElasticLoader`, against a lighthouse:
  :func:`stalwart.launch.loop.train`, the loop the tests' and the demo's
  worker runs, timed by a probe; ``--prefetch`` turns the loader's
  background prefetch on.
- ``fsdp2``: ``fully_shard`` on each linear layer and the root over all
  processes; ``hsdp``: the same over a 2-D mesh (replicate, shard) of
  ``--group-size`` processes per shard group. Both skip the gradient sync
  (``set_requires_gradient_sync(False)``) for all but the last micro-batch.
- ``stalwart-hsdp``: stalwart's Manager over replica groups of
  ``--group-size`` processes, each group ``fully_shard``-ing the model over
  its own processes (fault-tolerant HSDP, the ``hsdp`` loop's layout).
- ``torchft``: torchft 0.2.0's Manager on its Gloo (NCCL on CUDA) process
  group, against its own lighthouse, each process a replica group of one;
  ``--mode allreduce`` all-reduces the same flat buffer through
  ``manager.allreduce``, ``--mode ddp`` uses torchft's
  ``DistributedDataParallel`` wrapper. Each step's line also says whether
  torchft committed it and with how many participants.

Every variant applies the same update, the mean gradient over the step's
global batch (see :func:`wrapper_loss_scale` for the wrappers that average
over processes). Every variant loads a micro-batch the way a ``DataLoader``
without worker processes does (one ``dataset[i]`` per sample, then
``default_collate``), so data loading costs the same everywhere (stalwart's
loader does the same, in its prefetch thread when that is on). The timed loop
is the same too: see :class:`StepLog` for how a step is timed and split into
phases. Every worker writes one JSON line per step to ``OUT-MEMBER.jsonl``,
flushed at once, so a killed worker leaves what it had done, and at the end
``OUT-MEMBER.summary.json`` with its peak memory: the growth of its peak RSS
from before the model was built (CPU), or ``torch.cuda.max_memory_allocated``
(CUDA). With ``--device cuda`` each process uses the GPU of its
``LOCAL_RANK`` (else its rank) and NCCL.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import IO, Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset, default_collate

from benchmarks._measure import peak_rss_bytes
from stalwart.data.plan import EpochPlan
from stalwart.data.schedule import split_microbatches, split_sizes
from stalwart.data.world import WorldInfo
from stalwart.launch.loop import Faults, LoopParts, Pacing, StepProbe, redundancy_report, train
from stalwart.redundancy.config import Overlap, Redundancy, parse_parity
from stalwart.redundancy.layout import ShardsLostError
from stalwart.runtime.config import ReplicaGroup
from stalwart.runtime.loader import ElasticLoader
from stalwart.runtime.manager import Manager
from stalwart.runtime.step import TrainStep
from stalwart.runtime.timeouts import Timeouts

_T = TypeVar("_T")
_STORE_TIMEOUT = timedelta(seconds=60)


@dataclass(frozen=True)
class ModelSpec:
    """An MLP and its synthetic data: ``layers`` hidden layers of width ``hidden``, a plan of ``global_batch``."""

    name: str
    in_features: int
    hidden: int
    layers: int
    classes: int
    global_batch: int
    max_microbatch: int
    steps_per_epoch: int

    @property
    def dataset_size(self) -> int:
        """Samples in the synthetic data set: a whole number of steps, so that every step has the same total."""
        return self.global_batch * self.steps_per_epoch

    def plan(self) -> EpochPlan:
        """The plan every variant follows."""
        return EpochPlan(self.dataset_size, self.global_batch, seed=0)


MODELS = {
    "tiny": ModelSpec("tiny", 64, 64, 1, 10, global_batch=48, max_microbatch=16, steps_per_epoch=64),
    "1m": ModelSpec("1m", 256, 512, 4, 10, global_batch=512, max_microbatch=64, steps_per_epoch=8),
    "10m": ModelSpec("10m", 512, 1536, 5, 10, global_batch=256, max_microbatch=32, steps_per_epoch=8),
    "50m": ModelSpec("50m", 1024, 3072, 6, 10, global_batch=64, max_microbatch=16, steps_per_epoch=8),
    "3m": ModelSpec("3m", 512, 1024, 3, 10, global_batch=128, max_microbatch=8, steps_per_epoch=16),
}
"""``tiny`` (5k parameters: fixed per-step costs) and MLPs of about 1M, 10M and 50M parameters; every one
gives each of 2 or 4 workers at least two micro-batches per step. ``3m`` (2.6M parameters, a small batch)
is the redundancy benchmark's: Adam's state dominates its memory, and 8 workers get two micro-batches each."""


def build_model(spec: ModelSpec, seed: int = 0) -> torch.nn.Module:
    """The MLP with parameters drawn from ``seed`` (the same in every process)."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Linear(spec.in_features, spec.hidden), torch.nn.ReLU()]
    for _ in range(spec.layers - 1):
        layers += [torch.nn.Linear(spec.hidden, spec.hidden), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(spec.hidden, spec.classes))
    return torch.nn.Sequential(*layers)


def synthetic_dataset(spec: ModelSpec) -> TensorDataset:
    """Random features and labels, drawn from a fixed seed (the same in every process)."""
    generator = torch.Generator().manual_seed(1234)
    features = torch.randn(spec.dataset_size, spec.in_features, generator=generator)
    labels = torch.randint(0, spec.classes, (spec.dataset_size,), generator=generator)
    return TensorDataset(features, labels)


def make_optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum (the runtime benchmark's) or Adam (the redundancy benchmark's: 3 fp32 per parameter)."""
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def adam_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters and every tensor of the optimizer's state (DDP's replicated state)."""
    tensors = [*model.parameters()]
    tensors += [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def worker_redundancy(args: argparse.Namespace) -> Redundancy | None:
    """``--overlap F`` or ``--parity K,M`` (None: a replicated optimizer)."""
    if args.parity is not None:
        return parse_parity(args.parity)
    return None if args.overlap is None else Overlap(args.overlap)


def summed_loss(model: torch.nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """Cross-entropy summed over the micro-batch (gradients are divided by the step's sample count later)."""
    features, labels = batch
    return torch.nn.functional.cross_entropy(model(features), labels, reduction="sum")


def mean_loss(model: torch.nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """Cross-entropy, the mean over the micro-batch (what a user's loop under the Manager back-propagates)."""
    features, labels = batch
    return torch.nn.functional.cross_entropy(model(features), labels)


def load_microbatches(
    dataset: TensorDataset, indices: Sequence[int], max_microbatch: int, device: torch.device
) -> Iterator[list[torch.Tensor]]:
    """What a ``DataLoader`` with ``num_workers=0`` does: one ``dataset[i]`` per sample, then collate (then copy)."""
    for chunk in split_microbatches(list(indices), max_microbatch):
        yield to_device(default_collate([dataset[index] for index in chunk]), device)


def to_device(batch: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The batch's tensors on ``device`` (the same tensors on the CPU)."""
    return [tensor.to(device, non_blocking=True) for tensor in batch]


def flagging_last(items: Iterable[_T]) -> Iterator[tuple[bool, _T]]:
    """``(is_last, item)`` for each item, looking one item ahead."""
    iterator = iter(items)
    try:
        item = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield False, item
        item = following
    yield True, item


def rank_positions(plan: EpochPlan, step: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """``(epoch, start, stop)``: the epoch positions of ``rank``'s split of step ``step`` for a fixed world."""
    epoch, epoch_step = divmod(step, plan.steps_per_epoch)
    sizes = split_sizes(plan.step_total(epoch_step), world_size, plan.local_batch_multiple)
    start = plan.step_start(epoch_step) + sum(sizes[:rank])
    return epoch, start, start + sizes[rank]


def rank_share(plan: EpochPlan, step: int, rank: int, world_size: int) -> list[int]:
    """Sample indices of ``rank``'s split of step ``step`` (counted over epochs) for a fixed world."""
    epoch, start, stop = rank_positions(plan, step, rank, world_size)
    return plan.indices(epoch, start, stop).tolist()


def wrapper_loss_scale(plan: EpochPlan, step: int, world_size: int) -> float:
    """The factor on a rank's summed loss under DDP and FSDP2/HSDP, which average gradients over the processes.

    They reduce to ``sum over ranks of g_r / world_size``; with ``g_r`` the
    gradient of ``loss_sum_r * world_size / global_batch`` that is
    ``sum over ranks of grad(loss_sum_r) / global_batch``: the mean over the
    global batch, which ``plain`` and stalwart compute as gradient sums
    divided by the reduced sample count.
    """
    return world_size / plan.step_total(step % plan.steps_per_epoch)


def flat_gradients(params: Sequence[torch.nn.Parameter], samples: int) -> torch.Tensor:
    """One buffer ``[gradient sums..., samples]`` for a single all-reduce."""
    pieces = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device) for p in params]
    return torch.cat([*pieces, torch.tensor([float(samples)], device=params[0].device)])


def apply_flat(params: Sequence[torch.nn.Parameter], reduced: torch.Tensor) -> None:
    """Set each gradient to its reduced sum divided by the reduced sample count."""
    samples = float(reduced[-1])
    offset = 0
    for param in params:
        count = param.numel()
        param.grad = (reduced[offset : offset + count] / samples).view_as(param)
        offset += count


STALL_DUMP_S = 20.0
"""Seconds a step may take before the worker dumps its threads' stacks (a recovery takes well under 1 s here)."""


class StepLog:
    """Per-step timings, written as JSON lines.

    A step runs from the top of one loop iteration to the top of the next and
    is split into ``compute`` (forward and backward), ``reduce`` (first
    all-reduce start to last all-reduce done), ``before`` (the rest up to the
    all-reduce: loading, quorum calls) and ``after`` (the rest from the
    all-reduce on: applying gradients, the optimizer, commit bookkeeping).
    ``cpu`` is the CPU time the whole process (every thread) used in the step:
    unlike wall time, it does not depend on how the scheduler shares the cores.
    Where the wrapper reduces while the backward runs (DDP, FSDP2, HSDP) the
    reduction is part of ``compute`` and the other phases are left out. On
    CUDA, ``synchronize`` waits for the device at each step's boundary, so
    that the total is the step's; the phases are host times.
    """

    def __init__(
        self, path: Path, member: str, launched_at: float, synchronize: Callable[[], None] = lambda: None
    ) -> None:
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.member = member
        self.launched_at = launched_at
        self._synchronize = synchronize
        self._top: float | None = None
        self._cpu_top = 0.0
        self._extra: dict[str, Any] = {}
        self.compute = 0.0
        self._reduce_started: float | None = None
        self._reduce_finished: float | None = None

    def top(self, **extra: Any) -> None:
        """Mark the top of a loop iteration: writes the previous step's line, then starts the next step."""
        self._synchronize()
        now, cpu = time.perf_counter(), time.process_time()
        if self._top is not None:
            self.write(now, cpu)
        self._top, self._cpu_top, self._extra = now, cpu, extra
        self.compute = 0.0
        self._reduce_started = self._reduce_finished = None
        # A step that stalls this long leaves every thread's stack in the worker's log (re-armed at each top;
        # faulthandler's own thread writes it, even while the stalled thread holds the GIL).
        faulthandler.dump_traceback_later(STALL_DUMP_S, file=sys.stderr)

    def annotate(self, **extra: Any) -> None:
        """Add fields to the line of the step in progress."""
        self._extra.update(extra)

    def write(self, now: float | None = None, cpu: float | None = None) -> None:
        """Write the step in progress (its total time up to ``now``, its CPU time up to ``cpu``)."""
        assert self._top is not None
        now = time.perf_counter() if now is None else now
        cpu = time.process_time() if cpu is None else cpu
        started, finished = self._reduce_started, self._reduce_finished
        phases: dict[str, float | None] = {"reduce": None, "before": None, "after": None}
        if started is not None and finished is not None:
            before = started - self._top - self.compute
            phases = {"reduce": finished - started, "before": before, "after": now - finished}
        record = {
            "member": self.member,
            **self._extra,
            "total": now - self._top,
            "cpu": cpu - self._cpu_top,
            "compute": self.compute,
            **phases,
            "time": time.time(),
            "since_launch": time.time() - self.launched_at,
        }
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    @contextmanager
    def computing(self) -> Iterator[None]:
        """Count the block's time as compute."""
        start = time.perf_counter()
        yield
        self.compute += time.perf_counter() - start

    @contextmanager
    def reducing(self) -> Iterator[None]:
        """Mark the block as the all-reduce."""
        self.reduce_event("reduce_started")
        yield
        self.reduce_event("reduce_finished")

    def reduce_event(self, event: str, step: int = 0) -> None:
        """Also the stalwart Manager's ``on_event`` hook: the all-reduce started or finished."""
        if event == "reduce_started" and self._reduce_started is None:
            self._reduce_started = time.perf_counter()
        elif event == "reduce_finished":
            self._reduce_finished = time.perf_counter()

    def killed(self) -> None:
        """Write a line saying this process kills itself now (the step in progress is not written)."""
        self._file.write(json.dumps({"member": self.member, "killed": True, "time": time.time()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Write the last step and close the file."""
        faulthandler.cancel_dump_traceback_later()
        if self._top is not None:
            self._synchronize()
            self.write()
            self._top = None
        self._file.close()


class SampleLog:
    """With ``--record-samples``: one JSON line per finished step, written and flushed at once, naming the
    epoch positions it trained, whether they went into the model (committed) and the run's incarnation.

    The goodput benchmark audits these lines (lost and twice-trained samples); written at the step's end,
    not at the next one's top like :class:`StepLog`'s, so that a SIGKILL right after a commit loses nothing.
    """

    def __init__(self, path: Path | None, member: str, incarnation: str) -> None:
        self._file: IO[str] | None = None if path is None else open(path, "a", encoding="utf-8")  # noqa: SIM115
        self.member = member
        self.incarnation = incarnation

    def write(self, step: int, epoch: int, positions: Sequence[int], committed: bool) -> None:
        """Record one finished step (nothing without ``--record-samples``)."""
        if self._file is None:
            return
        record = {
            "member": self.member,
            "incarnation": self.incarnation,
            "step": step,
            "epoch": epoch,
            "positions": list(positions),
            "committed": committed,
            "time": time.time(),
        }
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()


def _start_together(args: argparse.Namespace) -> None:
    """Wait (bounded) until every rank of the run has got here once, through the driver's store.

    torchft has no quorum size to wait for at the start only (stalwart's
    ``start_replicas``): without this, the replicas that start first train
    the first steps alone and the others' shares of them are lost. A
    relaunched replica passes at once.
    """
    store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=_STORE_TIMEOUT)
    key = f"{args.prefix}started"
    store.add(key, 1)
    deadline = time.monotonic() + _STORE_TIMEOUT.total_seconds()
    while store.add(key, 0) < args.world and time.monotonic() < deadline:
        time.sleep(0.01)


def _pace(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


def worker_device(args: argparse.Namespace) -> torch.device:
    """The CPU, or with ``--device cuda`` the GPU of ``LOCAL_RANK`` (else of the rank), made current."""
    if args.device != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", args.rank)))
    torch.cuda.set_device(device)
    return device


def peak_memory(device: torch.device) -> int:
    """Peak bytes so far: the process's resident set (CPU) or what torch allocated on the GPU (CUDA)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()


def join_process_group(args: argparse.Namespace, device: torch.device) -> None:
    """Join the run's process group through the driver's TCPStore on 127.0.0.1: Gloo, or NCCL on CUDA."""
    store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=_STORE_TIMEOUT)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.PrefixStore(args.prefix, store), rank=args.rank, world_size=args.world)


def run_plain(args: argparse.Namespace, spec: ModelSpec, log: StepLog, device: torch.device) -> None:
    """All-reduce of a flat gradient buffer after the last micro-batch, no fault tolerance.

    With ``--checkpoint-dir`` it is checkpoint-restart (torchelastic style):
    every ``--checkpoint-every`` steps all ranks save the model and optimizer
    with ``torch.distributed.checkpoint`` into ``step-N``, then rank 0 points
    ``latest`` at it (an atomic rename, so a SIGKILL mid-save leaves the
    previous one); a relaunched world loads ``latest`` on every rank and
    trains on from there. ``--kill-at`` SIGKILLs ``--kill-ranks`` at that
    step's top, as in the stalwart loop.
    """
    join_process_group(args, device)
    model = build_model(spec).to(device)
    optimizer = make_optimizer(args.optimizer, model)
    params = list(model.parameters())
    dataset, plan = synthetic_dataset(spec), spec.plan()
    first = 0 if args.checkpoint_dir is None else load_checkpoint(args.checkpoint_dir, model, optimizer)
    faults = step_top_kill(args, log)
    for step in range(first, args.steps):
        log.top(step=step)
        faults.kill_if("step_started", step)
        _pace(args.step_seconds)
        epoch, start, stop = rank_positions(plan, step, args.rank, args.world)
        indices = plan.indices(epoch, start, stop).tolist()
        for batch in load_microbatches(dataset, indices, spec.max_microbatch, device):
            with log.computing():
                summed_loss(model, batch).backward()
            _pace(args.sample_seconds * len(batch[1]))
        flat = flat_gradients(params, len(indices))
        with log.reducing():
            dist.all_reduce(flat)
        apply_flat(params, flat)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        args.samples.write(step, epoch, range(start, stop), committed=True)
        if args.checkpoint_dir is not None and (step + 1) % args.checkpoint_every == 0:
            save_checkpoint(args.checkpoint_dir, step + 1, model, optimizer, args.rank)
    log.close()
    dist.barrier()  # no peer still needs this process when it exits


def save_checkpoint(
    directory: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int
) -> None:
    """Every rank saves through DCP into ``directory/step-STEP``; then rank 0 makes it ``latest``."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=str(directory / f"step-{step}"))
    if rank == 0:
        (directory / "latest.tmp").write_text(str(step), encoding="utf-8")
        os.replace(directory / "latest.tmp", directory / "latest")


def load_checkpoint(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load ``latest`` (if any) into ``model`` and ``optimizer`` on this rank; the step to train next (0 if none)."""
    latest = directory / "latest"
    if not latest.exists():
        return 0
    step = int(latest.read_text(encoding="utf-8"))
    model_state, optimizer_state = get_state_dict(model, optimizer)  # the optimizer's state made, to load into
    dcp.load({"model": model_state, "optim": optimizer_state}, checkpoint_id=str(directory / f"step-{step}"))
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    return step


def run_ddp(args: argparse.Namespace, spec: ModelSpec, log: StepLog, device: torch.device) -> None:
    """torch's DistributedDataParallel with its default buckets; ``no_sync()`` but for the last micro-batch."""
    join_process_group(args, device)
    model = DistributedDataParallel(
        build_model(spec).to(device), device_ids=[device.index] if device.type == "cuda" else None
    )

    def gradient_sync(last: bool) -> AbstractContextManager[None]:
        return nullcontext() if last else model.no_sync()

    train_wrapped(args, spec, log, device, model, gradient_sync)


def run_fsdp2(args: argparse.Namespace, spec: ModelSpec, log: StepLog, device: torch.device) -> None:
    """``fully_shard`` over all processes."""
    join_process_group(args, device)
    run_sharded(args, spec, log, device, init_device_mesh(device.type, (args.world,)))


def run_hsdp(args: argparse.Namespace, spec: ModelSpec, log: StepLog, device: torch.device) -> None:
    """``fully_shard`` over a (replicate, shard) mesh: shard groups of ``--group-size`` processes, replicated."""
    join_process_group(args, device)
    shape = (args.world // args.group_size, args.group_size)
    run_sharded(args, spec, log, device, init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard")))


def run_sharded(
    args: argparse.Namespace, spec: ModelSpec, log: StepLog, device: torch.device, mesh: DeviceMesh
) -> None:
    """``fully_shard`` on each linear layer and on the root over ``mesh``; gradients sync on the last micro-batch."""
    model = build_model(spec).to(device)
    for layer in list(model.modules()):
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    sharded = fully_shard(model, mesh=mesh)

    def gradient_sync(last: bool) -> AbstractContextManager[None]:
        sharded.set_requires_gradient_sync(last)
        return nullcontext()

    train_wrapped(args, spec, log, device, model, gradient_sync)


def train_wrapped(
    args: argparse.Namespace,
    spec: ModelSpec,
    log: StepLog,
    device: torch.device,
    model: torch.nn.Module,
    gradient_sync: Callable[[bool], AbstractContextManager[None]],
) -> None:
    """The loop of the wrappers that reduce while the backward runs (DDP, FSDP2, HSDP).

    ``gradient_sync(last)`` wraps each micro-batch's forward and backward: the
    wrapper reduces only in the last one's. Losses are scaled by
    :func:`wrapper_loss_scale`, so the update is the others'.
    """
    optimizer = make_optimizer(args.optimizer, model)
    dataset, plan = synthetic_dataset(spec), spec.plan()
    for step in range(args.steps):
        log.top(step=step)
        _pace(args.step_seconds)
        scale = wrapper_loss_scale(plan, step, args.world)
        indices = rank_share(plan, step, args.rank, args.world)
        for last, batch in flagging_last(load_microbatches(dataset, indices, spec.max_microbatch, device)):
            with log.computing(), gradient_sync(last):
                (summed_loss(model, batch) * scale).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    log.close()
    args.summary["state_bytes"] = adam_state_bytes(model, optimizer)
    dist.barrier()  # no peer still needs this process when it exits


def step_top_kill(args: argparse.Namespace, log: StepLog) -> Faults:
    """``--kill-at`` for this rank (one of ``--kill-ranks``): a SIGKILL at that step's top, after the ``killed`` line.

    The same point, the instrumented loop's ``step_started``, for checkpoint-restart and for stalwart.
    """
    killed = args.kill_at is not None and args.rank in args.kill_ranks
    return Faults(kill_at=(args.kill_at, "step_started") if killed else None, before_kill=log.killed)


def run_stalwart(args: argparse.Namespace, spec: ModelSpec, log: StepLog, device: torch.device) -> None:
    """The plain loop under stalwart's Manager and ElasticLoader."""
    model = build_model(spec).to(device)
    train_stalwart(args, spec, log, device, model, member=args.member)


def run_stalwart_hsdp(args: argparse.Namespace, spec: ModelSpec, log: StepLog, device: torch.device) -> None:
    """stalwart over replica groups of ``--group-size`` processes, each ``fully_shard``-ing the model (HSDP).

    Process ``rank`` is intra-group rank ``rank % group_size`` of group ``rank // group_size``; the group's
    processes form their own default process group (the FSDP2 mesh) and link, through the driver's store.
    """
    number, intra = divmod(args.rank, args.group_size)
    store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=_STORE_TIMEOUT)
    group_store = dist.PrefixStore(f"{args.prefix}group-{number}/", store)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=group_store, rank=intra, world_size=args.group_size)
    model = build_model(spec).to(device)
    mesh = init_device_mesh(device.type, (args.group_size,))
    for layer in list(model.modules()):
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    group = WorldInfo(rank=intra, world_size=args.group_size)
    train_stalwart(args, spec, log, device, model, member=f"group-{number}", group=group, group_store=group_store)


def train_stalwart(
    args: argparse.Namespace,
    spec: ModelSpec,
    log: StepLog,
    device: torch.device,
    model: torch.nn.Module,
    *,
    member: str,
    group: WorldInfo | None = None,
    group_store: dist.Store | None = None,
) -> None:
    """The loop under the Manager: :func:`stalwart.launch.loop.train`, the tests' worker's, timed by a probe.

    Each micro-batch's mean loss goes through ``step.backward``, then the
    update. With ``--overlap``/``--parity`` the optimizer state is sharded;
    each step's line then carries the cumulative repair count and seconds.
    The ranks in ``--kill-ranks`` SIGKILL themselves at the top of step
    ``--kill-at`` (the loop's ``step_started`` point), after a ``killed``
    line with the time.
    """
    optimizer = make_optimizer(args.optimizer, model)
    manager = Manager(
        model,
        optimizer,
        lighthouse=args.lighthouse,
        member=member,
        max_microbatch=spec.max_microbatch,
        timeouts=Timeouts.resolve(collective_timeout=args.collective_timeout),
        device=device,
        on_event=log.reduce_event,
        group=None if group is None else ReplicaGroup(group, group_store),
        redundancy=worker_redundancy(args),
        node=member,
    )
    loader = ElasticLoader(synthetic_dataset(spec), prefetch=args.prefetch)
    faults = step_top_kill(args, log)
    pacing = Pacing(step_seconds=args.step_seconds, sample_seconds=args.sample_seconds)
    try:
        train(
            manager,
            loader,
            LoopParts(optimizer, mean_loss),
            max_steps=args.steps,
            faults=faults,
            pacing=pacing,
            probe=TimedSteps(log, args.samples),
        )
    except ShardsLostError as error:
        log.close()
        args.summary["shards_lost"] = str(error)
        return
    log.close()
    args.summary.update(redundancy_report(manager))
    loader.close()
    manager.close()


class TimedSteps(StepProbe):
    """The stalwart loop's probe: :class:`StepLog`'s phases, and each committed step's positions (SampleLog)."""

    def __init__(self, log: StepLog, samples: SampleLog) -> None:
        self.log = log
        self.sample_log = samples
        self.samples = 0

    def step_started(self, manager: Manager, number: int) -> None:
        self.log.top(step=manager.ledger.step, world=manager.world_size, quorum=manager.quorum_id, rank=manager.rank)
        self.samples = 0

    @contextmanager
    def microbatch(self, manager: Manager, samples: int) -> Iterator[None]:
        with self.log.computing():
            yield
        self.samples += samples

    def step_finished(self, manager: Manager, step: TrainStep, scaler: torch.amp.GradScaler | None) -> None:
        report = step.report  # the positions the whole quorum committed in this step
        repairs = redundancy_report(manager)
        self.log.annotate(samples=self.samples, committed=report.step, committed_at=time.time(), **repairs)
        self.sample_log.write(report.step, report.epoch, report.positions.tolist(), committed=True)


def run_torchft(args: argparse.Namespace, spec: ModelSpec, log: StepLog, device: torch.device) -> None:
    """torchft's Manager (a replica group of one) with its all-reduce or its DDP wrapper, on its Gloo (NCCL) group."""
    import torchft
    from torchft.checkpointing.pg_transport import PGTransport

    model = build_model(spec).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    params = list(model.parameters())

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    timeout = timedelta(seconds=args.collective_timeout)
    group_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = (
        torchft.ProcessGroupNCCL(timeout=timeout)
        if device.type == "cuda"
        else torchft.ProcessGroupGloo(timeout=timeout)
    )
    manager = torchft.Manager(
        pg=pg,
        min_replica_size=args.min_replicas,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"replica_{args.rank}",
        store_addr="127.0.0.1",
        store_port=group_store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
        hostname="127.0.0.1",
        timeout=timedelta(seconds=max(10.0, args.collective_timeout)),
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=30),
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=30), device=device),
    )
    ddp = torchft.DistributedDataParallel(manager, model) if args.mode == "ddp" else None
    dataset, plan = synthetic_dataset(spec), spec.plan()
    if args.elastic:
        _start_together(args)
    step = 0
    while step < args.steps:
        log.top(step=step)
        manager.start_quorum()
        optimizer.zero_grad(set_to_none=True)
        _pace(args.step_seconds)
        if args.elastic:  # the data of the quorum's step: a relaunched replica resumes where the others are
            manager.wait_quorum()
            step = manager.current_step()
            log.annotate(step=step)
        epoch, start, stop = rank_positions(plan, step, args.rank, args.world)
        indices = plan.indices(epoch, start, stop).tolist()
        if ddp is not None:
            batches = list(load_microbatches(dataset, indices, spec.max_microbatch, device))
            for number, batch in enumerate(batches):
                last = number == len(batches) - 1
                with log.computing(), nullcontext() if last else ddp.no_sync():
                    features, labels = batch
                    loss = torch.nn.functional.cross_entropy(ddp(features), labels, reduction="sum")
                    (loss / len(indices)).backward()
        else:
            for batch in load_microbatches(dataset, indices, spec.max_microbatch, device):
                with log.computing():
                    summed_loss(model, batch).backward()
                _pace(args.sample_seconds * len(batch[1]))
            flat = flat_gradients(params, len(indices))
            manager.wait_quorum()  # manager.allreduce waits for the step's quorum first: count that wait before it
            with log.reducing():
                manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()
            apply_flat(params, flat)
        committed = manager.should_commit()
        if committed:
            optimizer.step()
        log.annotate(
            committed=committed,
            committed_at=time.time(),
            participants=manager.num_participants(),
            manager_step=manager.current_step(),
            share=len(indices),
        )
        args.samples.write(step, epoch, range(start, stop), committed=committed)
        step = manager.current_step() if args.elastic else step + 1
    log.close()
    manager.shutdown(wait=False)


RUNNERS: dict[str, Callable[[argparse.Namespace, ModelSpec, StepLog, torch.device], None]] = {
    "ddp": run_ddp,
    "plain": run_plain,
    "stalwart": run_stalwart,
    "fsdp2": run_fsdp2,
    "hsdp": run_hsdp,
    "stalwart-hsdp": run_stalwart_hsdp,
    "torchft": run_torchft,
}


def main(argv: list[str] | None = None) -> None:
    """Parse the variant's arguments and run its loop."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", choices=sorted(RUNNERS), help="the training loop")
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True, help="JSON lines go to OUT-MEMBER.jsonl")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, GPU of LOCAL_RANK")
    parser.add_argument("--store-port", type=int, default=0, help="torch.distributed loops: the driver's TCPStore")
    parser.add_argument("--prefix", default="run/", help="torch.distributed loops: key prefix on that store")
    parser.add_argument("--group-size", type=int, default=1, help="hsdp: processes per shard group")
    parser.add_argument("--lighthouse", default="", help="stalwart / torchft: the lighthouse's address")
    parser.add_argument("--collective-timeout", type=float, default=5.0)
    parser.add_argument("--min-replicas", type=int, default=1, help="torchft: min_replica_size")
    parser.add_argument("--mode", choices=("allreduce", "ddp"), default="allreduce", help="torchft only")
    parser.add_argument("--prefetch", action="store_true", help="stalwart: ElasticLoader(prefetch=True)")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="Sleep at the start of every step.")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd", help="ddp / stalwart: the optimizer")
    redundancy = parser.add_mutually_exclusive_group()
    redundancy.add_argument("--overlap", type=float, default=None, help="stalwart: shard the optimizer, overlap F")
    redundancy.add_argument("--parity", default=None, help="stalwart: shard the optimizer, K,M parity")
    parser.add_argument(
        "--kill-at", type=int, default=None, help="stalwart, plain: SIGKILL --kill-ranks at this step's top"
    )
    parser.add_argument(
        "--kill-ranks", type=int, nargs="*", default=[], help="stalwart, plain: the ranks --kill-at kills"
    )
    parser.add_argument("--launched-at", type=float, default=None, help="time.time() when the driver started us")
    parser.add_argument(
        "--sample-seconds", type=float, default=0.0, help="Sleep this long per sample trained (accelerator compute)."
    )
    parser.add_argument("--record-samples", action="store_true", help="Write each step's positions (SampleLog).")
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="plain: checkpoint-restart from here")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="plain: steps between checkpoints")
    parser.add_argument(
        "--elastic", action="store_true", help="torchft: data step from the manager's step, up to --steps"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.variant == "torchft":
        import torchft  # noqa: F401 - imported before the memory baseline, like the other loops' modules
    args.member = f"worker-{args.rank}"
    device = worker_device(args)
    synchronize = partial(torch.cuda.synchronize, device) if device.type == "cuda" else lambda: None
    log = StepLog(Path(f"{args.out}-{args.member}.jsonl"), args.member, args.launched_at or time.time(), synchronize)
    samples_path = Path(f"{args.out}-{args.member}.samples.jsonl") if args.record_samples else None
    args.samples = SampleLog(samples_path, args.member, args.prefix)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    baseline = peak_memory(device)  # after the imports, before the model is built
    args.summary = {}
    RUNNERS[args.variant](args, MODELS[args.model], log, device)
    summary = {"member": args.member, "peak_memory_bytes": peak_memory(device) - baseline, **args.summary}
    Path(f"{args.out}-{args.member}.summary.json").write_text(json.dumps(summary), encoding="utf-8")
    os._exit(0)  # skip interpreter teardown (torch's, torchft's threads): the results are written


if __name__ == "__main__":
    main()

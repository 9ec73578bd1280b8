"""Worker processes of the runtime benchmark: one training loop per variant, same model and data.

Run by :mod:`benchmarks.runtime` as ``python -m benchmarks._runtime_workers VARIANT ...``:

- ``plain``: ``torch.distributed`` Gloo, no fault tolerance. Each rank takes
  its split of the plan's step, accumulates micro-batch gradients, all-reduces
  one flat buffer ``[gradient sums..., sample count]`` and steps.
- ``stalwart``: the same loop under :class:`stalwart.runtime.manager.Manager`
  and :class:`~stalwart.runtime.loader.ElasticLoader`, against a lighthouse;
  ``--prefetch`` turns the loader's background prefetch on.
- ``torchft``: torchft 0.2.0's Manager on its Gloo process group, against its
  own lighthouse, each process a replica group of one; ``--mode allreduce``
  all-reduces the same flat buffer through ``manager.allreduce``, ``--mode
  ddp`` uses torchft's ``DistributedDataParallel`` wrapper. Each step's line
  also says whether torchft committed it and with how many participants.

Every variant loads a micro-batch the way a ``DataLoader`` without worker
processes does (one ``dataset[i]`` per sample, then ``default_collate``), so
data loading costs the same everywhere (stalwart's loader does the same, in
its prefetch thread when that is on). The timed loop is the same too: see
:class:`StepLog` for how a step is timed and split into phases. Every worker
writes one JSON line per step to ``OUT-MEMBER.jsonl``, flushed at once, so a
killed worker leaves what it had done.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, Any, cast

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset, default_collate

from stalwart.data.plan import EpochPlan
from stalwart.data.schedule import split_microbatches, split_sizes


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
    "large": ModelSpec("large", 256, 1024, 2, 10, global_batch=1536, max_microbatch=128, steps_per_epoch=8),
}


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


def summed_loss(model: torch.nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """Cross-entropy summed over the micro-batch (gradients are divided by the step's sample count later)."""
    features, labels = batch
    return torch.nn.functional.cross_entropy(model(features), labels, reduction="sum")


def load_microbatches(dataset: TensorDataset, indices: Sequence[int], max_microbatch: int) -> Iterator[Any]:
    """What a ``DataLoader`` with ``num_workers=0`` does: one ``dataset[i]`` per sample, then collate."""
    for chunk in split_microbatches(list(indices), max_microbatch):
        yield default_collate([dataset[index] for index in chunk])


def rank_share(plan: EpochPlan, step: int, rank: int, world_size: int) -> list[int]:
    """Sample indices of ``rank``'s split of step ``step`` (counted over epochs) for a fixed world."""
    epoch, epoch_step = divmod(step, plan.steps_per_epoch)
    sizes = split_sizes(plan.step_total(epoch_step), world_size, plan.local_batch_multiple)
    start = plan.step_start(epoch_step) + sum(sizes[:rank])
    return plan.indices(epoch, start, start + sizes[rank]).tolist()


def flat_gradients(params: Sequence[torch.nn.Parameter], samples: int) -> torch.Tensor:
    """One buffer ``[gradient sums..., samples]`` for a single all-reduce."""
    pieces = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in params]
    return torch.cat([*pieces, torch.tensor([float(samples)])])


def apply_flat(params: Sequence[torch.nn.Parameter], reduced: torch.Tensor) -> None:
    """Set each gradient to its reduced sum divided by the reduced sample count."""
    samples = float(reduced[-1])
    offset = 0
    for param in params:
        count = param.numel()
        param.grad = (reduced[offset : offset + count] / samples).view_as(param)
        offset += count


class StepLog:
    """Per-step timings, written as JSON lines.

    A step runs from the top of one loop iteration to the top of the next and
    is split into ``compute`` (forward and backward), ``reduce`` (first
    all-reduce start to last all-reduce done), ``before`` (the rest up to the
    all-reduce: loading, quorum calls) and ``after`` (the rest from the
    all-reduce on: applying gradients, the optimizer, commit bookkeeping).
    ``cpu`` is the CPU time the whole process (every thread) used in the step:
    unlike wall time, it does not depend on how the scheduler shares the cores.
    """

    def __init__(self, path: Path, member: str, launched_at: float) -> None:
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.member = member
        self.launched_at = launched_at
        self._top: float | None = None
        self._cpu_top = 0.0
        self._extra: dict[str, Any] = {}
        self.compute = 0.0
        self._reduce_started: float | None = None
        self._reduce_finished: float | None = None

    def top(self, **extra: Any) -> None:
        """Mark the top of a loop iteration: writes the previous step's line, then starts the next step."""
        now, cpu = time.perf_counter(), time.process_time()
        if self._top is not None:
            self.write(now, cpu)
        self._top, self._cpu_top, self._extra = now, cpu, extra
        self.compute = 0.0
        self._reduce_started = self._reduce_finished = None

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

    def close(self) -> None:
        """Write the last step and close the file."""
        if self._top is not None:
            self.write()
            self._top = None
        self._file.close()


def _pace(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


def run_plain(args: argparse.Namespace, spec: ModelSpec, log: StepLog) -> None:
    """Gloo all-reduce of a flat gradient buffer, no fault tolerance."""
    store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(args.prefix, store), rank=args.rank, world_size=args.world)
    model = build_model(spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    params = list(model.parameters())
    dataset, plan = synthetic_dataset(spec), spec.plan()
    for step in range(args.steps):
        log.top(step=step)
        _pace(args.step_seconds)
        indices = rank_share(plan, step, args.rank, args.world)
        for batch in load_microbatches(dataset, indices, spec.max_microbatch):
            with log.computing():
                summed_loss(model, batch).backward()
        flat = flat_gradients(params, len(indices))
        with log.reducing():
            dist.all_reduce(flat)
        apply_flat(params, flat)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    log.close()
    dist.destroy_process_group()


def run_stalwart(args: argparse.Namespace, spec: ModelSpec, log: StepLog) -> None:
    """The same loop under stalwart's Manager and ElasticLoader."""
    from stalwart.runtime.loader import ElasticLoader
    from stalwart.runtime.manager import Manager

    model = build_model(spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    manager = Manager(
        model,
        optimizer,
        lighthouse=args.lighthouse,
        member=args.member,
        max_microbatch=spec.max_microbatch,
        collective_timeout=args.collective_timeout,
        on_event=log.reduce_event,
    )
    loader = ElasticLoader(synthetic_dataset(spec), prefetch=args.prefetch)
    for step in manager.steps(loader, max_steps=args.steps):
        log.top(step=manager.ledger.step, world=manager.world_size, quorum=manager.quorum_id)
        _pace(args.step_seconds)
        samples = 0
        for batch in step:
            tensors = cast(Sequence[torch.Tensor], batch)  # the loader's default_collate of (features, label) pairs
            with log.computing():
                step.backward(summed_loss(model, tensors))
            samples += len(tensors[1])
        log.annotate(samples=samples)
    log.close()
    loader.close()
    manager.close()


def run_torchft(args: argparse.Namespace, spec: ModelSpec, log: StepLog) -> None:
    """torchft's Manager (a replica group of one) with its all-reduce or its DDP wrapper, on its Gloo group."""
    import torchft
    from torchft.checkpointing.pg_transport import PGTransport

    model = build_model(spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    params = list(model.parameters())

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    timeout = timedelta(seconds=args.collective_timeout)
    group_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = torchft.ProcessGroupGloo(timeout=timeout)
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
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=30), device=torch.device("cpu")),
    )
    ddp = torchft.DistributedDataParallel(manager, model) if args.mode == "ddp" else None
    dataset, plan = synthetic_dataset(spec), spec.plan()
    for step in range(args.steps):
        log.top(step=step)
        manager.start_quorum()
        optimizer.zero_grad(set_to_none=True)
        _pace(args.step_seconds)
        indices = rank_share(plan, step, args.rank, args.world)
        if ddp is not None:
            batches = list(load_microbatches(dataset, indices, spec.max_microbatch))
            for number, batch in enumerate(batches):
                last = number == len(batches) - 1
                with log.computing(), nullcontext() if last else ddp.no_sync():
                    features, labels = batch
                    loss = torch.nn.functional.cross_entropy(ddp(features), labels, reduction="sum")
                    (loss / len(indices)).backward()
        else:
            for batch in load_microbatches(dataset, indices, spec.max_microbatch):
                with log.computing():
                    summed_loss(model, batch).backward()
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
    log.close()
    manager.shutdown(wait=False)


RUNNERS: dict[str, Callable[[argparse.Namespace, ModelSpec, StepLog], None]] = {
    "plain": run_plain,
    "stalwart": run_stalwart,
    "torchft": run_torchft,
}


def main(argv: list[str] | None = None) -> None:
    """Parse the variant's arguments and run its loop."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", choices=sorted(RUNNERS))
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True, help="JSON lines go to OUT-MEMBER.jsonl")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--store-port", type=int, default=0, help="plain: the TCPStore the driver hosts")
    parser.add_argument("--prefix", default="run/", help="plain: key prefix on that store")
    parser.add_argument("--lighthouse", default="", help="stalwart / torchft: the lighthouse's address")
    parser.add_argument("--collective-timeout", type=float, default=5.0)
    parser.add_argument("--min-replicas", type=int, default=1, help="torchft: min_replica_size")
    parser.add_argument("--mode", choices=("allreduce", "ddp"), default="allreduce", help="torchft only")
    parser.add_argument("--prefetch", action="store_true", help="stalwart: ElasticLoader(prefetch=True)")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="Sleep at the start of every step.")
    parser.add_argument("--launched-at", type=float, default=None, help="time.time() when the driver started us")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    args.member = f"worker-{args.rank}"
    spec = MODELS[args.model]
    log = StepLog(Path(f"{args.out}-{args.member}.jsonl"), args.member, args.launched_at or time.time())
    RUNNERS[args.variant](args, spec, log)
    os._exit(0)  # skip interpreter teardown (torch's, torchft's threads): the results are written


if __name__ == "__main__":
    main()

"""One worker process of the local cluster: trains a task (``--model``: the digits MLP, a GPT) under a Manager.

Started by torchrun (``RANK``/``WORLD_SIZE`` set), the processes of one launch
form a replica group named ``--member`` and split the group's share.

Run by :mod:`stalwart.launch.cluster` as ``python -m stalwart.launch.worker``.
After every committed step it appends a JSON line to ``RUN_DIR/steps-MEMBER.jsonl``
with the step's number, epoch, quorum, world size, samples, loss, wall time and
the positions the whole quorum committed (the audit's input); at the end it
saves its parameters (on the CPU) to ``RUN_DIR/final-MEMBER.pt``.

It trains on :func:`~stalwart.runtime.comm.default_device`: the GPU of its
``LOCAL_RANK`` when CUDA is available (NCCL), else the CPU (Gloo).

It also appends its life events to ``RUN_DIR/events-MEMBER.jsonl`` (``started``,
``joined``, ``healed``, ``finished``, ``joined_after_end``, ``departed``, ``error``), each
with its process id, so that a report can tell a restarted incarnation's
rejoin from the first one's steps.

The training loop is :func:`stalwart.launch.loop.train`, the one the
benchmarks time too; the options below are its faults and pacing.

``--kill-at STEP:POINT`` makes the worker SIGKILL itself at a named point of a
step, for tests (:data:`~stalwart.launch.loop.KILL_POINTS`: for example
``before_forward``, ``during_backward``, ``during_reduce`` (the buckets are in
flight: launched from backward's hooks, so a peer already waiting may complete
the reduction with them before the kill) or ``after_reduce`` (reduced, not
applied), or ``during_evaluate`` (inside the leader's ``manager.on_leader()``
evaluation after step ``STEP``, with ``--eval-every``); with ``--kill-rank R``
only the group's process of intra-group rank R does.

``--hold-file PATH``: while PATH exists and holds a step number ``S`` (the
ledger's: a round with ``--diloco``), the worker waits before starting any
step ``>= S`` (bounded by ``loop.HOLD_LIMIT``),
except that it runs a step whenever the lighthouse asks for a boundary, so
that a hold never keeps a joiner out.
The demo and the tests hold the job this way while a restarted worker starts,
so that it rejoins before the job ends, however slow the machine is.

Errors a user can fix (a lighthouse that does not answer, a wrong token, a
plan that does not fit the dataset) end the process with one line on stderr
and exit status 2; a worker that joins after the job ended prints one line
and exits 0. SIGTERM (a preemption) makes it leave the quorum at the next
step boundary, announced, and exit 0 (event ``departed``; no final
parameters saved); under torchrun the agent itself then exits non-zero, as
it does on any signal.

``--fsdp`` (a group of several processes): the group shards the model with
FSDP2's ``fully_shard`` over a mesh of its processes (fault-tolerant HSDP);
the final parameters are saved whole (``full_tensor()``).

``--sample-seconds S`` adds ``S`` seconds of simulated compute per sample of
each micro-batch: a straggler is a worker with a larger ``S`` than the others
(what a lighthouse started with ``--balance-every`` relieves).

``--data SPEC`` trains on the digits read from shards instead of memory:
``parquet:DIR``, ``hf:DIR`` or ``hf-iterable:DIR`` (see
:func:`~stalwart.launch.digits.digits_source`); a shard that cannot be read
ends the process with one line and exit status 2, like the errors above.

``--corrupt-at STEP`` adds noise to this worker's parameters (its shards, in
an FSDP2 group) at the start of step STEP, for tests of the replica-consistency
check (the Manager must heal it from the others before the step is applied).

``--diloco H`` trains semi-synchronously (DiLoCo: ``H`` inner steps a round;
``--fragments F`` for Streaming DiLoCo, ``--exchange-overlap``, ``--pseudo-gradient-dtype``,
``--outer-lr``, ``--outer-momentum``). ``--max-steps`` then counts inner steps;
``steps-NAME.jsonl`` gets one line per committed round (the round's number as
``step``, its samples and every position the round committed: the audit's
input), ``inner-NAME.jsonl`` one per inner step, and the ``finished`` event
holds the digest of the outer state and the bytes this process sent to other
groups. Kill points count inner steps (``STEP`` is ``step.number``), except
``during_exchange`` (a fragment's exchange of round ``STEP`` started) and
``during_outer`` (round ``STEP``'s end started).

``--loader dataloader`` loads through a plain ``DataLoader`` with
``ManagedDistributedSampler(manager, dataset)`` as its batch sampler and
``--loader-workers`` worker processes, instead of the ``ElasticLoader``. Each
step record then also holds ``base_index`` from
``manager.get_data_loading_info()`` at the step's last micro-batch (after
any failure retry) and ``dropped``, the micro-batches prefetched for a
superseded share and dropped so far.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import math
import os
import sys
import time
import traceback
from collections.abc import Iterator, Sized
from pathlib import Path
from typing import Any, TextIO, cast

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, default_collate

from stalwart.coord.client import LighthouseError, LighthouseUnreachable
from stalwart.data.sampler import ManagedDistributedSampler
from stalwart.data.shard_identity import ShardError
from stalwart.data.world import WorldInfo
from stalwart.errors import JobFinishedError, PlanMismatchError, ShardingMismatchError, StateLostError
from stalwart.launch.digits import OPTIMIZERS, digits_source
from stalwart.launch.loop import (
    Faults,
    LoopParts,
    Pacing,
    StepProbe,
    parse_kill_at,
    redundancy_report,
    train,
)
from stalwart.launch.tasks import TASKS, Task
from stalwart.redundancy.config import Overlap, parse_parity
from stalwart.redundancy.layout import ShardsLostError
from stalwart.runtime.comm import default_device
from stalwart.runtime.config import Checkpointing, ReplicaGroup, Transport
from stalwart.runtime.diloco.config import DiLoCo
from stalwart.runtime.events import Event
from stalwart.runtime.loader import ElasticLoader
from stalwart.runtime.manager import Manager
from stalwart.runtime.sharding import is_dtensor
from stalwart.runtime.step import StepReport, TrainStep
from stalwart.runtime.timeouts import Timeouts

CODECS = {"float32": None, "bfloat16": torch.bfloat16, "int8": "int8"}
EXIT_USER_ERROR = 2


class EventLog:
    """Appends this process's life events, one JSON line each, to ``RUN_DIR/events-NAME.jsonl``."""

    def __init__(self, path: Path) -> None:
        self._file: TextIO = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, event: str, **details: Any) -> None:
        """Append ``event`` with the process id, the wall time and ``details``."""
        record = {"event": event, "pid": os.getpid(), "time": time.time(), **details}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def _sample_seconds(text: str) -> float:
    """Parse ``--sample-seconds``: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"--sample-seconds must be a number of seconds in [0, inf), got {text!r}")
    return value


def main(argv: list[str] | None = None) -> None:
    """Join the lighthouse and train until the job has committed ``--max-steps`` steps."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lighthouse", required=True, help="The lighthouse's URL, e.g. http://127.0.0.1:29510.")
    parser.add_argument("--member", required=True, help="This worker's (or replica group's) member name.")
    parser.add_argument("--run-dir", type=Path, required=True, help="Where step records, events and results go.")
    parser.add_argument("--max-steps", type=int, required=True, help="Steps the job commits before it ends.")
    parser.add_argument("--max-microbatch", type=int, default=16, help="Largest micro-batch (gradient accumulation).")
    parser.add_argument(
        "--token",
        default=os.environ.get("STALWART_LIGHTHOUSE_TOKEN"),
        help="The lighthouse's bearer token (default: $STALWART_LIGHTHOUSE_TOKEN).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="The address other workers reach this one on.")
    parser.add_argument("--seed", type=int, default=0, help="Model initialisation and sample transform seed.")
    parser.add_argument("--model", choices=sorted(TASKS), default="digits", help="The task: digits or a GPT.")
    parser.add_argument("--lr", type=float, default=None, help="The initial learning rate (default: the task's).")
    parser.add_argument("--clip", type=float, default=None, help="Clip the gradient's norm (default: the task's).")
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="Durable checkpoints go here.")
    parser.add_argument("--checkpoint-every", type=int, default=None, help="Checkpoint every this many steps.")
    parser.add_argument("--collective-timeout", type=float, default=None, help="Default: STALWART_COLLECTIVE_TIMEOUT.")
    parser.add_argument("--rendezvous-timeout", type=float, default=None, help="Default: STALWART_RENDEZVOUS_TIMEOUT.")
    parser.add_argument("--heal-timeout", type=float, default=None, help="Default: STALWART_HEAL_TIMEOUT.")
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=None,
        help="Seconds to wait for the lighthouse to answer at start. Default: STALWART_CONNECT_TIMEOUT, else 60.",
    )
    parser.add_argument("--kill-at", type=parse_kill_at, default=None, help="STEP:POINT to SIGKILL itself (tests).")
    parser.add_argument(
        "--kill-rank", type=int, default=None, help="With --kill-at: only the process of this intra-group rank."
    )
    parser.add_argument("--corrupt-at", type=int, default=None, help="Perturb the parameters at this step (tests).")
    parser.add_argument("--scaler", action="store_true", help="Scale the loss with a GradScaler (fp16's recipe).")
    parser.add_argument("--inf-at", type=int, default=None, help="Make this worker's gradient inf at this step.")
    parser.add_argument("--eval-every", type=int, default=0, help="Evaluate on the leader every this many steps.")
    parser.add_argument(
        "--eval-first", action="store_true", help="Evaluate at the top of a step's body (nanoGPT's place)."
    )
    parser.add_argument("--eval-seconds", type=float, default=0.0, help="Simulated seconds each evaluation takes.")
    parser.add_argument("--data", default="digits", help="digits, or parquet:DIR, hf:DIR, hf-iterable:DIR (shards).")
    parser.add_argument("--fsdp", action="store_true", help="Shard the model over the group's processes (FSDP2).")
    redundancy = parser.add_mutually_exclusive_group()
    redundancy.add_argument(
        "--overlap", type=float, default=None, help="Shard the optimizer state; each shard held by round(F*N) more."
    )
    redundancy.add_argument("--parity", type=parse_parity, default=None, help="Shard the optimizer state; K,M parity.")
    parser.add_argument(
        "--optimizer", choices=sorted(OPTIMIZERS), default="adam", help="The optimizer (plain-sgd: no momentum)."
    )
    parser.add_argument("--node", default=None, help="This process's node label (default: the host name).")
    parser.add_argument("--hold-file", type=Path, default=None, help="Wait before steps >= the number it holds.")
    parser.add_argument(
        "--step-seconds", type=float, default=0.0, help="Extra seconds of simulated compute at the start of each step."
    )
    parser.add_argument(
        "--loader",
        choices=("elastic", "dataloader"),
        default="elastic",
        help="ElasticLoader, or a DataLoader with ManagedDistributedSampler(manager, dataset) as batch sampler.",
    )
    parser.add_argument(
        "--loader-workers", type=int, default=0, help="The DataLoader's num_workers (with --loader dataloader)."
    )
    parser.add_argument("--diloco", type=int, default=None, help="DiLoCo: inner steps per round (H).")
    parser.add_argument("--fragments", type=int, default=1, help="DiLoCo: fragments (Streaming DiLoCo when > 1).")
    parser.add_argument(
        "--exchange-overlap", type=int, default=None, help="DiLoCo: inner steps an exchange runs behind."
    )
    parser.add_argument("--pseudo-gradient-dtype", choices=sorted(CODECS), default="float32", help="DiLoCo.")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo: the outer SGD's learning rate.")
    parser.add_argument("--outer-momentum", type=float, default=0.9, help="DiLoCo: its Nesterov momentum (0: none).")
    parser.add_argument(
        "--sample-seconds",
        type=_sample_seconds,
        default=0.0,
        help="Extra seconds of simulated compute per sample trained.",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    group = WorldInfo.from_env()
    name = args.member if group.world_size == 1 else f"{args.member}.{group.rank}"
    args.run_dir.mkdir(parents=True, exist_ok=True)
    events = EventLog(args.run_dir / f"events-{name}.jsonl")
    events.write("started")
    try:
        _train(args, group, name, events)
    except (
        LighthouseError,
        LighthouseUnreachable,
        PlanMismatchError,
        ShardingMismatchError,
        StateLostError,
        ShardError,
        ShardsLostError,
    ) as error:
        lost = {"shards_lost": list(error.shards)} if isinstance(error, ShardsLostError) else {}
        events.write("error", message=str(error), **lost)
        print(f"stalwart worker {name}: {error}", file=sys.stderr)
        raise SystemExit(EXIT_USER_ERROR) from None
    finally:
        events.close()


def _train(args: argparse.Namespace, group: WorldInfo, name: str, events: EventLog) -> None:
    """Train under a Manager until the job has committed ``--max-steps`` steps."""
    faults = Faults(
        kill_at=args.kill_at if args.kill_rank in (None, group.rank) else None,
        corrupt_at=args.corrupt_at,
        inf_at=args.inf_at,
    )

    def on_event(event: Event, step: int) -> None:
        if not faults.manager_event(event, step):
            events.write(event, step=step, quorum_id=manager.quorum_id, world_size=manager.world_size)

    device = default_device()
    task = TASKS[args.model]
    if args.model == "digits":
        dataset, collate = digits_source(args.data)
    elif args.data != "digits":
        raise SystemExit(f"--data {args.data!r} applies to --model digits only")
    else:
        dataset, collate = task.dataset(), default_collate
    elastic = ElasticLoader(dataset, collate_fn=collate, seed=args.seed) if args.loader == "elastic" else None
    model = task.model(args.seed).to(device)
    if args.fsdp:
        _fully_shard(model, task.fsdp_units(model), group, device)
    optimizer = task.optimizer(model, args.optimizer, task.lr if args.lr is None else args.lr)
    redundancy = args.parity if args.parity is not None else None if args.overlap is None else Overlap(args.overlap)
    scheduler = task.scheduler(optimizer, args.max_steps)
    timeouts = Timeouts.resolve(
        collective_timeout=args.collective_timeout,
        connect_timeout=args.connect_timeout,
        rendezvous_timeout=args.rendezvous_timeout,
        heal_timeout=args.heal_timeout,
    )
    checkpoint = (
        None if args.checkpoint_dir is None else Checkpointing(args.checkpoint_dir, every_steps=args.checkpoint_every)
    )
    manager = Manager(
        model,
        optimizer,
        lighthouse=args.lighthouse,
        member=args.member,
        token=args.token,
        max_microbatch=args.max_microbatch,
        timeouts=timeouts,
        transport=Transport(host=args.host),
        group=ReplicaGroup(group),
        device=device,
        on_event=on_event,
        checkpoint=checkpoint,
        redundancy=redundancy,
        node=args.node,
        sync=_diloco(args),
    )
    manager.register_state("lr_scheduler", scheduler)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10) if args.scaler else None
    if scaler is not None:
        manager.register_state("scaler", scaler)
    loader: ElasticLoader | DataLoader[Any] = elastic or DataLoader(
        dataset,
        batch_sampler=ManagedDistributedSampler(manager, cast(Sized, dataset)),
        num_workers=args.loader_workers,
        collate_fn=collate,
    )
    parts = LoopParts(
        optimizer,
        task.loss,
        scheduler=scheduler,
        scaler=scaler,
        clip=task.clip if args.clip is None else args.clip,
        evaluate=functools.partial(_evaluate, task, model, args.eval_seconds, events, faults),
        eval_every=args.eval_every,
        eval_first=args.eval_first,
    )
    pacing = Pacing(step_seconds=args.step_seconds, sample_seconds=args.sample_seconds, hold_file=args.hold_file)
    try:
        try:
            with StepRecords(
                args.run_dir, args.member, name, diloco=manager.diloco is not None, dataloader=elastic is None
            ) as records:
                train(manager, loader, parts, max_steps=args.max_steps, faults=faults, pacing=pacing, probe=records)
                records.close_rounds(manager)
        except JobFinishedError as error:
            events.write("joined_after_end", step=manager.ledger.step)
            print(f"stalwart worker {name}: {error}; nothing to do", file=sys.stderr)
            return
        if manager.departed:
            events.write("departed", step=manager.ledger.step)
            print(
                f"stalwart worker {name}: left the quorum after step {manager.ledger.step - 1} on request "
                "(SIGTERM); the others train on",
                file=sys.stderr,
            )
            return
        if manager.joined_after_end:
            events.write("joined_after_end", step=manager.ledger.step)
            print(
                f"stalwart worker {name}: the job had already committed its {manager.ledger.step} steps "
                "when this worker joined (its final checkpoint is loaded); nothing to do",
                file=sys.stderr,
            )
            return
        whole = {
            key: (value.full_tensor() if is_dtensor(value) else value).cpu()
            for key, value in model.state_dict().items()
        }
        torch.save(whole, args.run_dir / f"final-{name}.pt")
        events.write("finished", step=manager.ledger.step, **redundancy_report(manager), **_diloco_report(manager))
    finally:
        manager.close()
        if elastic is not None:
            elastic.close()
        if dist.is_initialized():  # the group's own (FSDP2) process group: never left to interpreter teardown
            dist.destroy_process_group()


class StepRecords(StepProbe):
    """The worker's step records: one JSON line per step to ``steps-NAME.jsonl`` (DiLoCo: per round, and one
    per inner step to ``inner-NAME.jsonl``); with a DataLoader, each also holds the step's ``base_index`` and
    the micro-batches dropped so far."""

    def __init__(self, run_dir: Path, member: str, name: str, *, diloco: bool, dataloader: bool) -> None:
        self.member = member
        self.dataloader = dataloader
        self.rounds = RoundRecords(member)
        self._steps: TextIO = open(run_dir / f"steps-{name}.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self._inner: TextIO | None = open(run_dir / f"inner-{name}.jsonl", "a", encoding="utf-8") if diloco else None  # noqa: SIM115
        self._base_index: int | None = None

    def __enter__(self) -> StepRecords:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._steps.close()
        if self._inner is not None:
            self._inner.close()

    def step_started(self, manager: Manager, number: int) -> None:
        """DiLoCo: the line of the round committed just before (the loop's first point after a round's commit,
        before any hold or kill point of the next inner step: a round held or killed after its commit is on
        record)."""
        self.rounds.write(manager, self._steps)

    @contextlib.contextmanager
    def microbatch(self, manager: Manager, samples: int) -> Iterator[None]:
        if self.dataloader:  # the share's position as the sampler sees it, after any failure retry
            self._base_index = manager.get_data_loading_info().base_index
        yield

    def step_finished(self, manager: Manager, step: TrainStep, scaler: torch.amp.GradScaler | None) -> None:
        report = step.report
        record = {
            **report_record(self.member, report),
            "drift_heals": report.drift_heals,
            "loaded_checksum": f"{report.loaded_checksum:016x}",
            "scale": None if scaler is None else scaler.get_scale(),
        }
        if self.dataloader:
            record.update(base_index=self._base_index, dropped=manager.dropped_microbatches)
        out = self._inner if self._inner is not None else self._steps
        out.write(json.dumps(record) + "\n")
        out.flush()

    def close_rounds(self, manager: Manager) -> None:
        """DiLoCo: the last round's line, once the loop has ended."""
        self.rounds.write(manager, self._steps)


def report_record(member: str, report: StepReport) -> dict[str, Any]:
    """The fields a step's line and a round's line share: who wrote it, when, and what ``report`` says."""
    return {
        "member": member,
        "pid": os.getpid(),
        "step": report.step,
        "epoch": report.epoch,
        "quorum_id": report.quorum_id,
        "world_size": report.world_size,
        "samples": report.samples,
        "loss": report.loss,
        "time": time.time(),
        "positions": sorted(report.positions.tolist()),
    }


class RoundRecords:
    """DiLoCo: one line per committed round, written at the top of the inner step after its outer step (or at the
    loop's end)."""

    def __init__(self, member: str) -> None:
        self.member = member
        self.written = -1

    def write(self, manager: Manager, out: TextIO) -> None:
        report = manager.last_round
        if report is None or report.step <= self.written:
            return
        self.written = report.step
        record = report_record(self.member, report)
        out.write(json.dumps(record) + "\n")
        out.flush()


def _evaluate(task: Task, model: torch.nn.Module, seconds: float, events: EventLog, faults: Faults, step: int) -> None:
    """The leader's evaluation after ``step`` steps: ``seconds`` of simulated work, then the loss of the first 64
    samples (``--kill-at STEP:during_evaluate`` kills it in the middle, after the step numbered ``step - 1``)."""
    faults.kill_if("during_evaluate", step - 1)
    time.sleep(seconds)
    dataset = task.dataset()
    batch = default_collate([dataset[index] for index in range(64)])
    with torch.no_grad():
        loss = float(task.loss(model, [tensor.to(next(model.parameters()).device) for tensor in batch]))
    events.write("evaluated", step=step, loss=loss)


def _diloco(args: argparse.Namespace) -> DiLoCo | None:
    """The DiLoCo configuration of ``--diloco`` and its companions (None without it)."""
    if args.diloco is None:
        return None
    lr, momentum = args.outer_lr, args.outer_momentum

    def outer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)

    return DiLoCo(
        args.diloco,
        outer_optimizer=outer,
        fragments=args.fragments,
        overlap=args.exchange_overlap,
        pseudo_gradient_dtype=CODECS[args.pseudo_gradient_dtype],
    )


def _diloco_report(manager: Manager) -> dict[str, Any]:
    """DiLoCo: the outer state's digest (equal on every member) and what this process sent to other groups."""
    rounds = manager.diloco
    if rounds is None:
        return {}
    traffic = rounds.traffic
    return {
        "outer_digest": rounds.outer.digest(),
        "bytes_sent": traffic.bytes,
        "exchanges": traffic.exchanges,
        "collectives": traffic.collectives,
        "largest_exchange": traffic.largest,
        "exchange_log": traffic.log,
        "inner_steps": rounds.inner.steps,
    }


def _fully_shard(model: torch.nn.Module, units: list[torch.nn.Module], group: WorldInfo, device: torch.device) -> None:
    """Shard each of ``units`` (the task's layers), then the root, over a mesh of the group's processes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard  # FSDP2 only where --fsdp asks for it: a second of CPU

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=group.rank, world_size=group.world_size)
    mesh = init_device_mesh(device.type, (group.world_size,))
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)


def run() -> None:
    """The process's entry: :func:`main`, then an exit that skips the interpreter's teardown.

    Everything is written and closed by then; what teardown would still do is
    destroy torch.distributed's C++ objects (aborted process groups and their
    threads), which can end in ``std::terminate`` and turn exit status 0 or 2
    into a SIGABRT.
    """
    status = 1
    try:
        main()
        status = 0
    except SystemExit as stop:
        status = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


if __name__ == "__main__":
    run()

"""What reduce-scattering the gradient to its shards' holders (ZeRO-2) would save against today's sharded step.

Run from the repository root, with the virtual environment active::

    python -m benchmarks.sharded_wire                 # 8 processes, the redundancy benchmark's 2.6M elements, 5 rounds
    python -m benchmarks.sharded_wire --quick         # 4 processes, 262,144 elements, 2 rounds: well under a minute
    python -m benchmarks.sharded_wire --device cuda   # NCCL, one GPU per process (LOCAL_RANK = rank)

Today's sharded step (ZeRO-1) all-reduces the whole gradient, so that the
user's update window sees all of it (the loop contract: ``clip_grad_norm_``
over the global norm, a GradScaler's inf check every member agrees on), then
each process updates its shards and the parameters are gathered from the
primaries. Issue 19 asks for the gradient reduce-scattered to the shards'
holders instead. This measures only what that changes: the collectives of
one step on a gradient of ``P`` float32 elements, through stalwart's
:class:`~stalwart.runtime.comm.Communicator` (Gloo on 127.0.0.1, or NCCL),
with no model and no update, so the difference is the wire's alone:

- ``ddp``: the all-reduce (DDP's step; every ratio is against it);
- ``zero-1``: the all-reduce, then the parameter gather (today's sharded step);
- ``zero-2``: the gradient reduce-scattered to the shards' primaries, then the gather;
- ``zero-2 +1``, ``zero-2 +2``: as ``zero-2``, each primary then forwards its
  reduced shard to 1 or 2 more holders: the copy of ``Overlap(1/8)`` over 8
  processes (2: ``Overlap(1/4)``), or, so that a lost data cell could be
  updated again after a repair, the parity holders of ``Parity(7, 1)``
  (2: ``Parity(6, 2)``).

The reduce-scatter is an all-to-all of the gradient's chunks and a local sum
of what arrives: on Gloo that costs less than its ring all-reduce, where
Gloo's own ``reduce_scatter_tensor`` cost more than twice the all-reduce
(115 against 47 ms for 3M elements over 8 processes). On NCCL,
``reduce_scatter_tensor`` would be the primitive; the all-to-all sends the
same bytes. The parameter gather is the
Communicator's (one all-to-all on Gloo, NCCL's all-gather). Bytes are what
each process sends per step by the algorithms' counts, in units of the
gradient's ``4 P`` bytes: ring all-reduce ``2 (N - 1) / N``, reduce-scatter
and gather ``(N - 1) / N`` each, a forward ``1 / N``.

Every process runs every variant once a round, in an order that rotates each
round (:mod:`benchmarks._rounds`), ``--steps`` timed steps each after a
barrier; rank 0's median per round is kept, with the CPU time its process
used (with more processes than cores, CPU time is the steadier figure). The
table shows the median of the rounds, the ratio to ``ddp`` and the spread of
the per-round ratios. Every wait is bounded; the benchmark never fails on a
figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks._measure import add_rounds, make_console, print_table, progress_display
from benchmarks._rounds import fixed, interleaved_rounds, median_span, round_ratios, span
from benchmarks._runtime_workers import MODELS, build_model
from benchmarks._workers import wait_for, worker_env
from stalwart.launch.processes import ForkedWorker
from stalwart.runtime.comm import Communicator

COLLECTIVE_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 900.0
FORWARDS = {"ddp": None, "zero-1": None, "zero-2": 0, "zero-2 +1": 1, "zero-2 +2": 2}
"""Each variant, and for the reduce-scattered ones how many more holders each primary forwards its shard to."""
VARIANTS = tuple(FORWARDS)
COLUMNS = (
    "variant", "sent per process (x gradient)", "bytes vs DDP", "ms per step (rounds)", "vs DDP", "by round",
    "CPU ms", "CPU vs DDP",
)  # fmt: skip


@dataclass(frozen=True)
class Settings:
    """One run's sizes."""

    processes: int
    elements: int
    rounds: int
    steps: int
    warmup_rounds: int = 1
    device: str = "cpu"


FULL = Settings(processes=8, elements=sum(p.numel() for p in build_model(MODELS["3m"]).parameters()), rounds=5, steps=6)
QUICK = Settings(processes=4, elements=1 << 18, rounds=2, steps=3)


def wire_units(variant: str, processes: int) -> float:
    """Bytes each process sends per step, in units of the gradient's bytes (the algorithms' counts)."""
    share = (processes - 1) / processes
    forwards = FORWARDS[variant]
    if variant == "ddp":
        return 2 * share
    if forwards is None:  # zero-1: the all-reduce, then the gather
        return 3 * share
    return 2 * share + forwards / processes


class Step:
    """One variant's collectives on this process's gradient, with every buffer made once."""

    def __init__(self, comm: Communicator, elements: int) -> None:
        world = comm.world_size
        self.comm = comm
        self.chunk = -(-elements // world)
        self.gradient = torch.randn(self.chunk * world, device=comm.device)
        self.work = torch.empty_like(self.gradient)
        self.received = torch.empty_like(self.gradient)
        self.shard = torch.empty(self.chunk, device=comm.device)
        self.gathered = torch.empty(self.chunk * world, device=comm.device)
        self.forward_send = torch.empty(self.chunk * 2, device=comm.device)
        self.forwarded = torch.empty(self.chunk * 2, device=comm.device)

    def run(self, variant: str) -> None:
        forwards = FORWARDS[variant]
        if forwards is None:
            self.work.copy_(self.gradient)  # the reducer's bucket: the gradient itself stays for a retry
            self.comm.start_all_reduce_sum(self.work)()
            if variant == "zero-1":
                self._gather(self.work[self.comm.rank * self.chunk : (self.comm.rank + 1) * self.chunk])
            return
        self._reduce_scatter()
        if forwards:
            self._forward(forwards)
        self._gather(self.shard)

    def _reduce_scatter(self) -> None:
        """Chunk ``r`` of every process's gradient to rank ``r``, summed there."""
        sizes = [self.chunk] * self.comm.world_size
        self.comm.all_to_all(self.gradient, sizes, sizes, out=self.received)
        torch.sum(self.received.view(self.comm.world_size, self.chunk), dim=0, out=self.shard)

    def _forward(self, forwards: int) -> None:
        """This primary's reduced shard to the next ``forwards`` ranks (its copies' or parity holders' place)."""
        world, rank = self.comm.world_size, self.comm.rank
        targets = {(rank + offset) % world for offset in range(1, forwards + 1)}
        sources = {(rank - offset) % world for offset in range(1, forwards + 1)}
        send = self.forward_send[: self.chunk * len(targets)]
        send.view(len(targets), self.chunk).copy_(self.shard.expand(len(targets), self.chunk))
        send_sizes = [self.chunk if peer in targets else 0 for peer in range(world)]
        receive_sizes = [self.chunk if peer in sources else 0 for peer in range(world)]
        self.comm.all_to_all(send, send_sizes, receive_sizes, out=self.forwarded[: sum(receive_sizes)])

    def _gather(self, shard: torch.Tensor) -> None:
        self.comm.all_gather(shard, out=self.gathered)

    def verify(self) -> None:
        """The reduce-scattered path delivers what the all-reduce does: each shard, its forwards and the gather.

        A wrong chunking or forward would make the measured variants cheaper than the real thing; the sums
        differ only in their order (``allclose``).
        """
        world, rank, chunk = self.comm.world_size, self.comm.rank, self.chunk
        self.run("zero-1")
        whole = self.work.clone()
        self.run("zero-2 +2")
        expected = {
            "the reduced shard": (self.shard, whole[rank * chunk : (rank + 1) * chunk]),
            "the gathered gradient": (self.gathered, whole),
        }
        sources = sorted({(rank - offset) % world for offset in (1, 2)})
        for index, source in enumerate(sources):
            expected[f"the shard forwarded from rank {source}"] = (
                self.forwarded[index * chunk : (index + 1) * chunk],
                whole[source * chunk : (source + 1) * chunk],
            )
        for what, (got, want) in expected.items():
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                raise RuntimeError(f"rank {rank}: {what} differs from the all-reduce's by {(got - want).abs().max()}")

    def barrier(self) -> None:
        self.comm.start_all_reduce_sum(torch.zeros(1, device=self.comm.device))()


def measure_rounds(
    step: Step, settings: Settings, done: Callable[[], None] = lambda: None
) -> dict[str, list[tuple[float, float]]]:
    """Every variant's (wall, CPU) median seconds per step in each kept round, in the rounds' rotated order.

    ``done`` is called after each variant's steps of a round (warm-up rounds included).
    """

    def measure(variant: str, _round: int) -> tuple[float, float]:
        walls, cpus = [], []
        for _ in range(settings.steps):
            step.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            step.run(variant)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
        done()
        return statistics.median(walls), statistics.median(cpus)

    return interleaved_rounds(VARIANTS, settings.rounds, measure, warmup=settings.warmup_rounds)


def worker_main() -> None:
    """A process's entry (``sys.argv``: its options): rendezvous on the file store, measure, rank 0 writes JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--settings", required=True, help="the run's Settings as JSON")
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(sys.argv[1:])
    settings = Settings(**json.loads(args.settings))
    torch.set_num_threads(1)
    torch.manual_seed(args.rank)
    device = torch.device(f"cuda:{args.rank}") if settings.device == "cuda" else torch.device("cpu")
    store = dist.FileStore(str(args.store), settings.processes)
    comm = Communicator(store, args.rank, settings.processes, timeout=COLLECTIVE_TIMEOUT_S, device=device)
    progress = args.out.with_suffix(".progress")

    def done() -> None:
        if args.rank == 0:
            with progress.open("a", encoding="utf-8") as lines:
                lines.write(".\n")

    step = Step(comm, settings.elements)
    step.verify()
    results = measure_rounds(step, settings, done)
    if args.rank == 0:
        args.out.write_text(json.dumps(results), encoding="utf-8")
    comm.retire()


def measurements(settings: Settings) -> int:
    """How many variant-rounds a run measures (its progress total)."""
    return (settings.warmup_rounds + settings.rounds) * len(VARIANTS)


def run(
    settings: Settings, run_dir: Path, advance: Callable[[int], None] = lambda _done: None
) -> dict[str, list[list[float]]]:
    """Start the processes, wait for them (bounded), and return rank 0's results.

    ``advance`` is told, while they run, how many variant-rounds are measured so far.
    """
    out = run_dir / "results.json"
    progress = out.with_suffix(".progress")
    arguments = ["--settings", json.dumps(dataclasses.asdict(settings)), "--store", str(run_dir / "store")]
    processes = [
        ForkedWorker(
            [*arguments, "--rank", str(rank), "--out", str(out)],
            worker_env(rank if settings.device == "cuda" else None),
            run_dir / f"worker-{rank}.log",
            entry="benchmarks.sharded_wire:worker_main",
        )
        for rank in range(settings.processes)
    ]

    def report_progress() -> None:
        if progress.exists():
            advance(progress.read_text(encoding="utf-8").count("\n"))

    try:
        wait_for(processes, RUN_TIMEOUT_S, report_progress)
    finally:
        for process in processes:
            process.kill()
    codes = [process.poll() for process in processes]
    if codes != [0] * len(processes) or not out.exists():
        logs = (run_dir / "worker-0.log").read_text(encoding="utf-8", errors="replace")[-2000:]
        raise RuntimeError(f"the processes ended with {codes} (None: killed after {RUN_TIMEOUT_S:.0f} s):\n{logs}")
    results: dict[str, list[list[float]]] = json.loads(out.read_text(encoding="utf-8"))
    return results


def table_rows(results: dict[str, list[list[float]]], processes: int) -> list[list[str]]:
    """One row per variant: bytes, wall and CPU median per step, their ratios to ``ddp`` and each round's ratio."""
    milliseconds = fixed(1, 1e3)
    ratio = fixed(3, suffix="x")
    base_walls = [wall for wall, _ in results["ddp"]]
    base_cpus = [cpu for _, cpu in results["ddp"]]
    rows = []
    for variant in VARIANTS:
        walls = [wall for wall, _ in results[variant]]
        cpus = [cpu for _, cpu in results[variant]]
        units = wire_units(variant, processes)
        rows.append(
            [
                variant,
                f"{units:.3f}",
                ratio(units / wire_units("ddp", processes)),
                median_span(walls, milliseconds),
                ratio(statistics.median(walls) / statistics.median(base_walls)),
                span(round_ratios(walls, base_walls), ratio),
                milliseconds(statistics.median(cpus)),
                ratio(statistics.median(cpus) / statistics.median(base_cpus)),
            ]
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sharded_wire", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 processes, 262,144 elements, 2 rounds")
    parser.add_argument("--processes", type=int, choices=range(2, 33), metavar="N", help="processes (2-32)")
    add_rounds(parser)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per process")
    args = parser.parse_args(argv)
    settings = dataclasses.replace(
        QUICK if args.quick else FULL,
        device=args.device,
        **({"processes": args.processes} if args.processes else {}),
        **({"rounds": args.rounds} if args.rounds else {}),
    )
    if settings.device == "cuda" and torch.cuda.device_count() < settings.processes:
        print(f"--device cuda needs a GPU per process: {settings.processes} asked, {torch.cuda.device_count()} seen")
        return 2
    console = make_console()
    console.print(
        f"torch {torch.__version__}, {settings.processes} processes on {settings.device}, "
        f"{settings.elements:,} float32 gradient elements, {settings.rounds} rounds of {settings.steps} steps"
    )
    with tempfile.TemporaryDirectory(prefix="sharded-wire-") as directory, progress_display(console) as progress:
        task = progress.add_task("processes starting, then the rounds", total=measurements(settings))
        results = run(settings, Path(directory), lambda done: progress.update(task, completed=done))
    print_table(
        console,
        "The wire of one step: reduce-scattered gradients (ZeRO-2) against today's all-reduce and gather (ZeRO-1)",
        COLUMNS,
        table_rows(results, settings.processes),
        caption=(
            "sent: the algorithms' byte counts (ring all-reduce 2 (N-1)/N, reduce-scatter and gather (N-1)/N each, a "
            "forward 1/N). ms: rank 0's median per round, then the median of the rounds and their range; by round: "
            "each round's ratio to ddp. zero-2 +1 / +2: each reduced shard forwarded to 1 / 2 more holders (copies, "
            "or the parity holders a repair would need it on)."
        ),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

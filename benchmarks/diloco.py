"""Training across regions: the GPT example, DDP against DiLoCo and Streaming DiLoCo, on a modelled WAN link.

``python -m benchmarks.diloco [--model gpt-tiny]`` trains the GPT example's model, data,
optimizer (AdamW over weight-decay groups, warm-up and cosine, clipping at
1.0) with four replica groups (four worker processes of
:mod:`stalwart.launch.worker`, one per group) on the same samples and seed:

- torch DDP, the baseline a user has today: ``benchmarks._ddp_gpt`` under
  torchrun, the same model, optimizer and samples (the lighthouse's plan's
  order), one process per group, ``DistributedDataParallel`` all-reducing
  the gradients every step;
- stalwart's every-step mode (the same gradient all-reduce, plus its step
  tail), fault-tolerant, with ``--systems every``;
- DiLoCo with H = 16 and H = 64 inner steps a round (outer Nesterov SGD at
  0.7, momentum 0.9);
- Streaming DiLoCo, H = 64 in 4 fragments, each exchange overlapped with 8
  inner steps, in float32 and in 8 bits with error feedback.

Per system: the validation loss of the final model at equal samples, the
bytes one process sends to other groups per sample trained, the peak bytes
per second (over 1-second windows), and the samples per second with the
cross-group link at 1 Gbit/s and 100 ms RTT. The link is a model
(:mod:`benchmarks._wan_model`): the workers run on 127.0.0.1 and record the
bytes and collectives of their exchanges; the model times those collectives
on the link and adds what compute does not hide to the run's measured wall
time. Then each system again under a seeded failure trace (group 2
SIGKILLed at a seeded inner step and started again after ``--replace-delay``
seconds; it joins at the next boundary and is healed, its heal's bytes timed
on the link too; not DDP, whose job a lost process ends): samples lost and
trained twice (from the committed records, audited), samples retrained (the
dead group's share handed to the survivors: the work the failure cost), and
goodput (samples per modelled second against
the same system's failure-free run). Rounds interleave the systems; each
figure is a median ±half its range over rounds.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.table import Column

from benchmarks._measure import REPO_ROOT, Goal, make_console, print_goals, print_table
from benchmarks._wan_model import (
    Link,
    diloco_stalls,
    every_step_stall,
    every_step_timeline,
    exchange_hops,
    peak_rate,
    ring_bytes,
    rounds_timeline,
)
from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.launch import gpt
from stalwart.launch.cluster import LocalCluster
from stalwart.launch.report import audit_steps, committed_steps
from stalwart.launch.tasks import GPT_SIZES, TASKS, gpt_datasets
from stalwart.runtime.diloco.schedule import fragment_launches
from stalwart.runtime.reducer import plan_buckets
from stalwart.runtime.tail import TailLayout

_JOB_TIMEOUT = 1800.0
EVAL_BATCHES = 20
EVAL_BATCH = 32


@dataclass(frozen=True)
class System:
    """One way to train: its key and name, the worker's options, and its round shape (None: every step)."""

    key: str
    name: str
    options: tuple[str, ...]
    inner_steps: int | None = None
    fragments: int = 1
    overlap: int = 0
    codec: str = "float32"
    ddp: bool = False
    """Plain torch DDP under torchrun (no lighthouse: no failure trace)."""
    default: bool = True
    """Run unless ``--systems`` names others."""


@dataclass
class Run:
    """What one run measured."""

    val_loss: float
    samples: int
    wall: float
    """Seconds from the first inner step's start to the last commit, on 127.0.0.1 (the leader's records)."""
    modelled: float
    """``wall`` plus what the link adds."""
    bytes_per_process: float
    peak: float
    lost: int
    twice: int
    retrained: int
    extra_heal_bytes: float = 0.0
    notes: list[str] = field(default_factory=list)


def systems(quick: bool) -> list[System]:
    ddp = System("ddp", "torch DDP", (), ddp=True)
    if quick:
        return [
            ddp,
            System("every", "stalwart every step", (), default=False),
            System("d8", "DiLoCo H=8", ("--diloco", "8"), 8),
            System("s8i8", "Streaming H=8 F=2 int8", ("--diloco", "8", "--fragments", "2",
                   "--exchange-overlap", "2", "--pseudo-gradient-dtype", "int8"), 8, 2, 2, "int8"),
        ]  # fmt: skip
    return [
        ddp,
        System("every", "stalwart every step", (), default=False),
        System("d16", "DiLoCo H=16", ("--diloco", "16"), 16),
        System("d64", "DiLoCo H=64", ("--diloco", "64"), 64),
        System("s64", "Streaming H=64 F=4", ("--diloco", "64", "--fragments", "4", "--exchange-overlap", "8"),
               64, 4, 8),
        System("s64i8", "Streaming H=64 F=4 int8", ("--diloco", "64", "--fragments", "4", "--exchange-overlap",
               "8", "--pseudo-gradient-dtype", "int8"), 64, 4, 8, "int8"),
    ]  # fmt: skip


def run_system(
    system: System,
    args: argparse.Namespace,
    work: Path,
    kill_step: int | None,
    link: Link,
    start_heal_bytes: float | None,
) -> tuple[Run, float]:
    """Train ``system`` (with group 2 SIGKILLed at ``kill_step`` and replaced); its figures and its heals' bytes."""
    run_dir = work / f"{system.key}-{len(list(work.glob(f'{system.key}-*')))}"
    if system.ddp:
        return run_ddp(args, run_dir, link), 0.0
    train, _ = gpt_datasets(args.model)
    plan = EpochPlan(len(train), args.global_batch * (system.inner_steps or 1), seed=args.seed)
    worker_args = ["--model", args.model, "--optimizer", "adamw", "--max-steps", str(args.steps),
                   "--max-microbatch", str(args.micro_batch), "--collective-timeout", "30", "--seed",
                   str(args.seed), *system.options]  # fmt: skip
    victim = 2
    with Lighthouse(plan, min_replicas=1, start_replicas=args.groups, heartbeat_timeout=2.0, join_timeout=60.0) as lh:
        cluster = LocalCluster(lh.url, run_dir, worker_args, preloaded=False)  # replacements pay a start
        for worker in range(args.groups):
            kill = worker == victim and kill_step is not None
            cluster.start(worker, ["--kill-at", f"{kill_step}:during_backward"] if kill else None)
        deadline = time.monotonic() + _JOB_TIMEOUT
        if kill_step is not None:
            while cluster.processes[victim].poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(args.replace_delay)
            cluster.start(victim)
        while cluster.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        cluster.terminate()
        heal_bytes = lh.metrics.registry.get_sample_value("stalwart_heal_bytes_total") or 0.0
        retrained = lh.metrics.registry.get_sample_value("stalwart_samples_reassigned_total") or 0.0
    leader = _finished(run_dir / "events-worker-0.jsonl")
    records = committed_steps(run_dir)
    _, duplicates, missing = audit_steps(plan, records)
    samples = sum(record["samples"] for record in records)
    wall, step_seconds = _wall(run_dir / ("inner-worker-0.jsonl" if system.inner_steps else "steps-worker-0.jsonl"))
    members = args.groups
    if system.inner_steps is None:
        tail_floats = TailLayout(members, False).size
        added, sent, timeline = _every_step_link(args, link, len(records), step_seconds, tail_floats)
    else:
        log = leader["exchange_log"]
        added = diloco_stalls(link, log, system.codec, members, step_seconds)
        sent = float(leader["bytes_sent"])
        first_round = [entry for entry in log if entry["round"] == 0]
        fragment_bytes = [0.0] * system.fragments
        for entry in first_round:
            if entry["kind"] == "exchange":
                fragment_bytes[entry["fragment"]] = entry["bytes"]
        tail_bytes = next(entry["bytes"] for entry in first_round if entry["kind"] == "tail")
        launches = list(fragment_launches(system.inner_steps, system.fragments, system.overlap))
        timeline = rounds_timeline(link, args.steps // system.inner_steps, system.inner_steps, launches,
                                   system.overlap, fragment_bytes, system.codec, members, step_seconds,
                                   tail_bytes)  # fmt: skip
    extra_heal = 0.0 if start_heal_bytes is None else max(0.0, heal_bytes - start_heal_bytes)
    if extra_heal:
        added += link.seconds(exchange_hops("float32", 2), extra_heal)  # a broadcast from the source group
    run = Run(
        val_loss=_val_loss(run_dir / "final-worker-0.pt", args),
        samples=samples,
        wall=wall,
        modelled=wall + added,
        bytes_per_process=sent,
        peak=peak_rate(timeline),
        lost=missing,
        twice=duplicates,
        retrained=int(retrained),
        extra_heal_bytes=extra_heal,
    )
    return run, heal_bytes


def run_ddp(args: argparse.Namespace, run_dir: Path, link: Link) -> Run:
    """Train with plain torch DDP (``benchmarks._ddp_gpt`` under torchrun, one process per group)."""
    run_dir.mkdir(parents=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.groups),
               "-m", "benchmarks._ddp_gpt", "--model", args.model, "--steps", str(args.steps), "--global-batch",
               str(args.global_batch), "--micro-batch", str(args.micro_batch), "--seed", str(args.seed),
               "--times", str(run_dir / "times.jsonl"), "--out", str(run_dir / "final.pt")]  # fmt: skip
    with open(run_dir / "torchrun.log", "wb") as output:
        done = subprocess.run(command, cwd=REPO_ROOT, stdout=output, stderr=subprocess.STDOUT, timeout=_JOB_TIMEOUT)
    if done.returncode != 0:
        raise RuntimeError(f"torch DDP exited with {done.returncode}; see {run_dir / 'torchrun.log'}")
    wall, step_seconds = _wall(run_dir / "times.jsonl")
    added, sent, timeline = _every_step_link(args, link, args.steps, step_seconds, 0)
    return Run(
        val_loss=_val_loss(run_dir / "final.pt", args),
        samples=args.steps * args.global_batch,
        wall=wall,
        modelled=wall + added,
        bytes_per_process=sent,
        peak=peak_rate(timeline),
        lost=0,
        twice=0,
        retrained=0,
    )


def _wall(path: Path) -> tuple[float, float]:
    """Seconds of the run's steps (from its per-step wall clocks, the first step's time estimated) and per step."""
    times = [json.loads(line)["time"] for line in _lines(path)]
    wall = (times[-1] - times[0]) * len(times) / max(len(times) - 1, 1)
    return wall, wall / len(times)


def _every_step_link(
    args: argparse.Namespace, link: Link, steps: int, step_seconds: float, tail_floats: int
) -> tuple[float, float, list[tuple[float, float, float]]]:
    """An every-step run on the link: seconds it adds, bytes one process sends, its sends' timeline.

    The gradients in 25 MiB buckets (DDP's default cap) and ``tail_floats``
    more floats (stalwart's step tail) in the last one.
    """
    params = list(TASKS[args.model].model(args.seed).parameters())
    buckets = plan_buckets([(p.numel(), p.dtype) for p in params], cap_bytes=25 * 2**20)
    last_bucket = 4 * (buckets[-1].numel + tail_floats)
    step_bytes = 4 * (sum(p.numel() for p in params) + tail_floats)
    added = steps * every_step_stall(link, last_bucket, args.groups)
    sent = steps * ring_bytes(step_bytes, args.groups)
    return added, sent, every_step_timeline(link, steps, step_seconds, step_bytes, last_bucket, args.groups)


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _finished(path: Path) -> dict[str, Any]:
    for line in reversed(_lines(path)):
        event = json.loads(line)
        if event["event"] == "finished":
            return event
    raise RuntimeError(f"{path} has no finished event: the leader did not finish")


def _val_loss(path: Path, args: argparse.Namespace) -> float:
    model = gpt.GPT(GPT_SIZES[args.model])
    model.load_state_dict(torch.load(path, weights_only=True))
    _, val = gpt_datasets(args.model)
    return gpt.evaluate(model, val, EVAL_BATCHES, EVAL_BATCH, torch.device("cpu"))


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    """Median ±half the range of ``values`` (the median alone for one value)."""
    median = fmt.format(statistics.median(values))
    if len(values) == 1:
        return median
    return f"{median} ±{fmt.format((max(values) - min(values)) / 2)}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="Interleaved rounds of every system.")
    parser.add_argument("--steps", type=int, default=256, help="Inner steps (every-step: steps) each run trains.")
    parser.add_argument("--groups", type=int, default=4, help="Replica groups, one worker process each.")
    parser.add_argument("--global-batch", type=int, default=32, help="Samples per (inner) step over every group.")
    parser.add_argument("--micro-batch", type=int, default=8, help="Largest micro-batch.")
    parser.add_argument("--model", choices=sorted(GPT_SIZES), default="gpt", help="The GPT example's size.")
    parser.add_argument("--seed", type=int, default=0, help="Model, data order and failure trace seed.")
    parser.add_argument("--replace-delay", type=float, default=2.0, help="Seconds until a killed group restarts.")
    parser.add_argument("--bandwidth", type=float, default=1e9, help="The cross-group link's bits per second.")
    parser.add_argument("--rtt", type=float, default=0.1, help="The link's round-trip time in seconds.")
    parser.add_argument("--no-failures", action="store_true", help="Only the failure-free runs.")
    parser.add_argument("--quick", action="store_true", help="A smoke run: gpt-tiny, 32 steps, H=8, 3 groups.")
    parser.add_argument(
        "--systems",
        nargs="+",
        default=None,
        help="Keys of the systems: d16 d64 s64 s64i8 every (default all but every); torch DDP always runs.",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.model, args.groups, args.rounds = 32, "gpt-tiny", 3, 1
    link = Link(args.bandwidth / 8, args.rtt)
    known = systems(args.quick)
    keys = [system.key for system in known]
    for key in args.systems or []:
        if key not in keys:
            parser.error(f"--systems takes {keys}, got {key!r}")
    chosen = [
        system
        for system in known
        if system.ddp or (system.default if args.systems is None else system.key in args.systems)
    ]
    for system in chosen:
        if system.inner_steps and args.steps % system.inner_steps:
            parser.error(f"--steps {args.steps} must be a multiple of {system.name}'s H = {system.inner_steps}")
    trace = random.Random(args.seed)
    kill_steps = [trace.randrange(args.steps // 3, args.steps // 2) for _ in range(args.rounds)]
    console = make_console(200)
    results: dict[str, dict[str, list[Run]]] = {system.name: {"free": [], "failure": []} for system in chosen}
    with tempfile.TemporaryDirectory(prefix="stalwart-diloco-") as scratch:
        work = Path(scratch)
        for number in range(args.rounds):
            order = chosen if number % 2 == 0 else list(reversed(chosen))
            for system in order:
                console.print(f"round {number + 1}/{args.rounds}: {system.name}", highlight=False)
                free, start_heals = run_system(system, args, work, None, link, None)
                results[system.name]["free"].append(free)
                if not args.no_failures and not system.ddp:
                    console.print(f"  with group 2 killed at step {kill_steps[number]}", highlight=False)
                    failed, _ = run_system(system, args, work, kill_steps[number], link, start_heals)
                    results[system.name]["failure"].append(failed)
    report(console, args, chosen, results, kill_steps, link)


def report(
    console: Any,
    args: argparse.Namespace,
    chosen: list[System],
    results: dict[str, dict[str, list[Run]]],
    kill_steps: list[int],
    link: Link,
) -> None:
    """One table: every system's figures, failure-free and under the trace, and the ratios to torch DDP's."""
    base = results[chosen[0].name]["free"]
    rows = []
    goal_rows: list[tuple[System, float, float, float]] = []
    for system in chosen:
        free, failed = results[system.name]["free"], results[system.name]["failure"]
        per_sample = [run.bytes_per_process / run.samples for run in free]
        fewer = [b.bytes_per_process / b.samples / p for b, p in zip(base, per_sample, strict=True)]
        loss_ratio = [run.val_loss / b.val_loss for run, b in zip(free, base, strict=True)]
        rate = [run.samples / run.modelled for run in free]
        speedup = [r / (b.samples / b.modelled) for r, b in zip(rate, base, strict=True)]
        row = [
            system.name,
            spread([run.val_loss for run in free], "{:.4f}"),
            spread(loss_ratio, "{:.3f}"),
            spread(per_sample, "{:,.0f}"),
            spread(fewer, "{:.1f}x"),
            spread([run.peak / 1e6 for run in free], "{:.2f}"),
            spread(rate, "{:.1f}"),
            spread(speedup, "{:.2f}x"),
        ]
        if not args.no_failures and not failed:
            row += ["n/a"] * 4
        elif failed:
            goodput = [
                (run.samples / run.modelled) / (f.samples / f.modelled) for run, f in zip(failed, free, strict=True)
            ]
            row += [
                spread([float(run.lost) for run in failed], "{:.0f}"),
                spread([float(run.twice) for run in failed], "{:.0f}"),
                spread([float(run.retrained) for run in failed], "{:.0f}"),
                spread([100 * g for g in goodput], "{:.1f}%"),
            ]
        rows.append(row)
        goal_rows.append((system, statistics.median(fewer), statistics.median(loss_ratio), statistics.median(speedup)))
    columns: list[str | Column] = [Column("system", no_wrap=True), "val loss", "vs DDP", "bytes/sample",
                                   "fewer bytes", "peak MB/s", "samples/s", "vs DDP"]  # fmt: skip
    if not args.no_failures:
        columns += ["lost", "trained twice", "retrained", "goodput"]
    print_table(
        console,
        f"GPT ({args.model}), {args.groups} groups, {args.steps} inner steps of {args.global_batch} samples, "
        f"{args.rounds} round(s); link {8 * link.bandwidth / 1e9:g} Gbit/s, {1000 * link.rtt:g} ms RTT (modelled)",
        columns,
        rows,
        caption=(
            f"Each figure: the median ±half its range over the {args.rounds} round(s). "
            "Validation loss of the final model (global parameters) on the first "
            f"{EVAL_BATCHES * EVAL_BATCH} validation windows. Bytes: what one process sends to other groups (ring "
            "algorithms' counts of the payloads the code sent; every step: the gradient buckets, and stalwart's step "
            "tail). torch DDP: the baseline, trained on the same plan's samples; it has no failure trace (a process "
            "lost ends a DDP job). "
            "Samples/s: samples over the measured wall time on 127.0.0.1 plus the link model's time."
            + (
                ""
                if args.no_failures
                else f" Failure trace: group 2 SIGKILLed at inner step {', '.join(map(str, kill_steps))} and "
                f"restarted {args.replace_delay:g} s later; lost / trained twice from the audit of the committed "
                "steps; retrained: the dead group's positions handed to survivors; goodput against the same "
                "system's failure-free run."
            )
        ),
    )
    goals = []
    for system, fewer, loss_ratio, speedup in goal_rows:
        if system.inner_steps is None:
            continue
        goals.append(
            Goal(
                f"{system.name}: >= 100x fewer bytes per sample than DDP, val loss within 3%",
                fewer >= 100 and loss_ratio <= 1.03,
                f"{fewer:.1f}x, loss {100 * (loss_ratio - 1):+.2f}%",
            )
        )
        goals.append(Goal(f"{system.name}: >= 5x DDP's samples/s at the link", speedup >= 5, f"{speedup:.2f}x"))
    if not args.no_failures:
        lost = sum(run.lost + run.twice for system in chosen for run in results[system.name]["failure"])
        goals.append(Goal("0 samples lost or trained twice through the failures", lost == 0, f"{lost}"))
    print_goals(console, goals)


if __name__ == "__main__":
    main()

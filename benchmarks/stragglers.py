"""Straggler benchmark: step time with one member slowed 2x, with equal shares and with balanced shares.

Run from the repository root, with the virtual environment active::

    python -m benchmarks.stragglers            # 3 rounds of both runs, 3 workers, 80 steps each: ~3 min on 2 cores
    python -m benchmarks.stragglers --quick    # 1 round, 20 steps: under a minute

Each run is the digits job (:mod:`stalwart.launch.worker`) on a
:class:`~stalwart.launch.cluster.LocalCluster` of ``--workers`` processes
against an embedded lighthouse, global batch 48 in chunks of 4. Every worker
adds ``--sample-seconds`` of simulated compute per sample it trains (the
digits model itself costs microseconds); worker 0 adds twice as much, so it
trains at half the others' throughput. ``equal`` runs with equal shares (the
default lighthouse); ``balanced`` with ``--balance-every 5``: every 5 steps
the workers re-weigh their shares by what the step's all-reduce says each
measured. The step time is the median interval between a fast worker's
consecutive committed steps, after ``WARMUP_STEPS`` (start-up, and the first
re-weighing). The two runs alternate, in an order that flips each round, so
each round's ratio compares runs made under the same machine load. Each run
is also audited: every step trained on its planned total, each sample once.

The benchmark reports; it never fails because a number is off. With equal
shares a step lasts as long as the slow worker's third of it, 16 samples at
2S; balanced, the slow worker takes 2 chunks of the 12 (8 samples at 2S) and
the others 5 (20 samples at S), so the ideal ratio is 40/64 = 0.62 plus
fixed per-step costs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks._measure import add_rounds, make_console, print_table
from benchmarks._rounds import interleaved_rounds, rotated, round_ratios
from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan
from stalwart.launch.cluster import LocalCluster
from stalwart.launch.report import audit_steps, committed_steps, planned_total

PLAN = EpochPlan(1797, 48, seed=0, local_batch_multiple=4)
BALANCE_EVERY = 5
WARMUP_STEPS = 15
"""Steps left out of the step time (start-up, the first re-weighing); a run of fewer than twice as many leaves
out its first half."""
QUICK_STEPS = 20
MODES = ("equal", "balanced")
RUN_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Run:
    """One measured run: its median step time, whether it kept its promises, and the lighthouse's last weights."""

    mode: str
    step_ms: float
    exact: bool
    weights: dict[str, int]


def run_job(mode: str, workers: int, steps: int, sample_seconds: float, run_dir: Path) -> Run:
    """Train ``steps`` steps with ``workers`` processes (worker 0 at half speed); bounded by ``RUN_TIMEOUT_S``."""
    lighthouse = Lighthouse(
        PLAN,
        min_replicas=1,
        start_replicas=workers,
        heartbeat_timeout=2.0,
        join_timeout=30.0,
        balance_every=BALANCE_EVERY if mode == "balanced" else 0,
    )
    lighthouse.start()
    arguments = ["--max-steps", str(steps), "--max-microbatch", "8", "--sample-seconds", str(sample_seconds)]
    cluster = LocalCluster(lighthouse.url, run_dir, arguments)
    try:
        for worker in range(workers):
            cluster.start(worker, ["--sample-seconds", str(2 * sample_seconds)] if worker == 0 else None)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while cluster.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        if cluster.running():
            cluster.terminate()
            raise RuntimeError(f"the {mode} run did not end in {RUN_TIMEOUT_S} s; see the logs in {run_dir}")
        balance = lighthouse.status()["ledger"]["balance"]
    finally:
        lighthouse.stop()
    records = committed_steps(run_dir)
    exact = audit_steps(PLAN, records) == (True, 0, 0) and [r["samples"] for r in records] == [
        planned_total(PLAN, step) for step in range(steps)
    ]
    times = [json.loads(line)["time"] for line in (run_dir / "steps-worker-1.jsonl").read_text().splitlines()]
    warmup = min(WARMUP_STEPS, steps // 2)
    intervals = [later - earlier for earlier, later in itertools.pairwise(times[warmup:])]
    return Run(mode, 1000 * statistics.median(intervals), exact, {} if balance is None else balance["weights"])


def main(argv: Sequence[str] | None = None) -> int:
    """Run the rounds and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"One round of {QUICK_STEPS} steps.")
    add_rounds(parser, "rounds of both runs (default 3; --quick 1)")
    parser.add_argument("--workers", type=int, default=3, help="Worker processes (2 to 6).")
    parser.add_argument(
        "--sample-seconds", type=float, default=0.002, help="Simulated compute per sample of a fast worker."
    )
    args = parser.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    if not 2 <= args.workers <= 6:
        parser.error(f"--workers must be in [2, 6], got {args.workers}")
    if not 0 < args.sample_seconds <= 0.1:
        parser.error(f"--sample-seconds must be in (0, 0.1], got {args.sample_seconds}")
    steps = QUICK_STEPS if args.quick else 80
    console = make_console()
    with tempfile.TemporaryDirectory(prefix="stalwart-stragglers-") as scratch:

        def measure(mode: str, number: int) -> Run:
            console.print(f"round {number + 1}/{rounds}: {mode} shares, {steps} steps", highlight=False)
            return run_job(mode, args.workers, steps, args.sample_seconds, Path(scratch) / f"round-{number}-{mode}")

        measured = interleaved_rounds(MODES, rounds, measure)
    equal = [run.step_ms for run in measured["equal"]]
    balanced = [run.step_ms for run in measured["balanced"]]
    ratios = round_ratios(balanced, equal)
    rows = [
        [
            str(number + 1),
            " then ".join(rotated(MODES, number)),
            f"{equal[number]:.1f}",
            f"{balanced[number]:.1f}",
            f"{ratios[number]:.2f}",
            _weights(measured["balanced"][number].weights),
            "yes" if measured["equal"][number].exact and measured["balanced"][number].exact else "NO",
        ]
        for number in range(rounds)
    ]
    medians = (f"{statistics.median(values):.1f}" for values in (equal, balanced))
    rows.append(["median", "", *medians, f"{statistics.median(ratios):.2f}", "", ""])
    print_table(
        console,
        f"Step time with worker 0 at half speed ({args.workers} workers, {args.sample_seconds * 1000:g} ms per "
        f"sample, 2x on worker 0; global batch {PLAN.global_batch_size}, multiple {PLAN.local_batch_multiple})",
        ["round", "order", "equal shares (ms)", f"balanced, every {BALANCE_EVERY} (ms)", "ratio", "weights", "exact"],
        rows,
        caption="ratio: balanced / equal in the same round; weights: the lighthouse's last, in chunks of "
        f"{PLAN.local_batch_multiple} (worker 0 first); exact: planned totals, each sample once.",
    )
    return 0


def _weights(weights: dict[str, int]) -> str:
    return " ".join(str(weights[name]) for name in sorted(weights))


if __name__ == "__main__":
    sys.exit(main())

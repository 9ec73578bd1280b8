"""The GPT example's step time under stalwart against its plain torchrun DDP twin, interleaved rounds.

``python -m benchmarks.gpt_loop`` runs the two scripts exactly as written,
``examples/gpt_ddp.py`` under ``torchrun --nproc-per-node P`` and
``examples/gpt.py`` as P workers against a lighthouse, on the same model,
data, global batch and micro-batch, with no failures. The time per step is
read off the runs themselves: both print a validation line every
``--eval-every`` steps (rank 0 / the leader evaluates), and
the time between the second and the last of those lines, over the steps
between them, is the step time with start-up and the first steps left out.
Each evaluation is one batch (``GPT_EVAL_BATCHES=1``); under both systems
the other processes start the next step while the leader evaluates. Rounds
alternate which system runs first; the table shows each system's median and
range and the per-round ratio stalwart / DDP. Each round is a new pair of
jobs, and a pair of jobs differs by a few per cent of its own: resolving a
difference of 2 per cent takes 16 rounds or more (docs/guide/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks._measure import REPO_ROOT, make_console, print_table
from benchmarks._rounds import fixed, interleaved_rounds, median_span, round_ratios
from stalwart.coord.server import Lighthouse

EXAMPLES = REPO_ROOT / "examples"
_TIMEOUT = 900.0
_MS = fixed(1, 1000)


def step_seconds(lines: list[tuple[float, str]], eval_every: int) -> float:
    """Seconds per step between the second and the last validation line (their arrival times)."""
    marks = [(when, int(text.split()[1].rstrip(":"))) for when, text in lines if text.startswith("step ")]
    if len(marks) < 3:
        raise RuntimeError(f"expected at least 3 validation lines every {eval_every} steps, got {len(marks)}")
    (start, first), (end, last) = marks[1], marks[-1]
    return (end - start) / (last - first)


def run_ddp(processes: int, environment: dict[str, str]) -> float:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
               str(EXAMPLES / "gpt_ddp.py")]  # fmt: skip
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    return step_seconds(_drain(process), int(environment["GPT_EVAL_EVERY"]))


def run_stalwart(processes: int, environment: dict[str, str]) -> float:
    with Lighthouse(None, min_replicas=processes, start_replicas=processes, join_timeout=60.0) as lighthouse:
        workers = [
            subprocess.Popen(
                [sys.executable, str(EXAMPLES / "gpt.py")],
                env={**environment, "STALWART_LIGHTHOUSE": lighthouse.url, "STALWART_MEMBER": f"w{number}"},
                stdout=subprocess.PIPE,
                text=True,
                cwd=REPO_ROOT,
            )
            for number in range(processes)
        ]
        with ThreadPoolExecutor(len(workers)) as pool:  # read every worker at once: any may be the leader
            lines = [line for lines in pool.map(_drain, workers) for line in lines]
    return step_seconds(sorted(lines), int(environment["GPT_EVAL_EVERY"]))


def _drain(worker: subprocess.Popen[str]) -> list[tuple[float, str]]:
    """A worker's lines with the times they arrived (only the leader prints)."""
    assert worker.stdout is not None
    lines = [(time.monotonic(), line.strip()) for line in worker.stdout]
    worker.wait(timeout=_TIMEOUT)
    if worker.returncode != 0:
        raise RuntimeError(f"{worker.args!r} exited with {worker.returncode}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2, help="Processes in both systems (default 2).")
    parser.add_argument(
        "--rounds", type=int, default=3, help="Interleaved rounds (default 3: a quick look; 16 or more resolve 2%%)."
    )
    parser.add_argument("--steps", type=int, default=100, help="Steps each run trains (default 100).")
    parser.add_argument("--eval-every", type=int, default=10, help="Validation lines every this many steps.")
    parser.add_argument("--quick", action="store_true", help="One round of 40 steps (a smoke run).")
    args = parser.parse_args(argv)
    rounds, steps = (1, 40) if args.quick else (args.rounds, args.steps)
    console = make_console()
    with tempfile.TemporaryDirectory() as scratch:
        environment = {
            **os.environ,
            "GPT_STEPS": str(steps),
            "GPT_EVAL_EVERY": str(args.eval_every),
            "GPT_EVAL_BATCHES": "1",
            "GPT_OUTPUT": str(Path(scratch) / "gpt.pt"),
            "PYTHONUNBUFFERED": "1",
        }
        environment.pop("OMP_NUM_THREADS", None)  # torchrun and the Manager both give each worker one thread
        runs = {"ddp": run_ddp, "stalwart": run_stalwart}

        def measure(system: str, number: int) -> float:
            console.print(f"round {number + 1}/{rounds}: {system}", highlight=False)
            return runs[system](args.processes, environment)

        times = interleaved_rounds(tuple(runs), rounds, measure)
    ratios = round_ratios(times["stalwart"], times["ddp"])
    rows = [
        ["torchrun + DDP (examples/gpt_ddp.py)", median_span(times["ddp"], _MS), "1.000"],
        ["stalwart (examples/gpt.py)", median_span(times["stalwart"], _MS), median_span(ratios, fixed(3))],
    ]
    print_table(
        console,
        f"GPT example, {args.processes} processes, {steps} steps, {rounds} interleaved rounds",
        ["system", "step (ms): median (min-max)", "vs DDP: median (min-max of rounds)"],
        rows,
        caption="Step time between the second and the last validation line of each run; no failures.",
    )


if __name__ == "__main__":
    main()
